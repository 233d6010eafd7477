"""fastdist's modules form layers: no import cycle, counting imports inside functions too.

``if TYPE_CHECKING:`` imports are left out (they never run). A package's own submodules
importing the package's ``__init__`` are left out too (Python initialises the package first).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (SRC / "fastdist").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                full = ".".join(base) + (f".{node.module}" if node.module else "")
            else:
                full = node.module or ""
            found.update(m for m in (full, *(f"{full}.{a.name}" for a in node.names)) if m in mods)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in mods)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m != name and not name.startswith(m + ".")}


def test_no_import_cycles() -> None:
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    # the parser sees imports
    assert "fastdist.core.mesh" in graph["fastdist.ops.prelude"]
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                dfs(dep)
        path.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            dfs(name)


def _every_import(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (functions and ``TYPE_CHECKING``
    blocks included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path.name}: relative import {ast.unparse(node)}"
            found.add(node.module or "")
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_the_mesh_is_a_torch_free_value() -> None:
    """``fastdist.core.mesh`` (and its picture, ``core.mesh_view``) import nothing but the standard
    library, ``fastdist.errors`` and ``fastdist.core``: no torch, no backend, no tool, not even
    inside a function. Connecting a mesh to a job is ``fastdist.comm.connect``'s."""
    for name in ("mesh.py", "mesh_view.py"):
        imported = _every_import(SRC / "fastdist" / "core" / name)
        assert "fastdist.errors" in imported or name == "mesh_view.py"  # the parser sees imports
        outside = {
            m
            for m in imported
            if m.split(".")[0] not in sys.stdlib_module_names
            and m != "fastdist.errors"
            and not m.startswith("fastdist.core.")
        }
        assert not outside, f"core/{name} imports {sorted(outside)}"


def test_the_torch_free_check_can_fail(tmp_path: Path) -> None:
    planted = tmp_path / "mesh.py"
    planted.write_text("import math\n\ndef f():\n    from fastdist.comm import connect\n")
    assert _every_import(planted) == {"math", "fastdist.comm"}
