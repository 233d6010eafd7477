"""The floor plan is a check, not a memory (docs/design.md, "Layers").

* the import-linter contract in ``pyproject.toml`` holds: each layer imports only the layers below
  it, function-level imports included, and names every part of the package;
* no module takes another module's private name (``from fastdist.x import _helper``,
  ``x._helper``), and a private module is imported only inside its own package;
* no module rebinds another module's attributes (``fastdist.nn.moe.dispatch = ...``,
  ``setattr(prim, "bind", ...)``): observers and policies hook in through declared points;
* no file of ``src/fastdist`` is over 1,000 lines.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PKG = SRC / "fastdist"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


MODULES = _modules()


def _package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _home(importer: str, target: str) -> bool:
    """Whether ``importer`` lives in the package that holds the module ``target``."""
    package = target.rpartition(".")[0]
    return importer == package or importer.startswith(package + ".")


def _fastdist_modules_bound(tree: ast.AST) -> dict[str, str]:
    """Local names bound to fastdist modules: ``import fastdist.x as X``, ``from fastdist import
    x``."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    bound[a.asname or a.name.partition(".")[0]] = a.name if a.asname else "fastdist"
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in MODULES:
                    bound[a.asname or a.name] = full
    return bound


def _target(node: ast.Attribute, bound: dict[str, str]) -> tuple[str, str] | None:
    """``(module, attribute)`` when ``node`` is an attribute of a fastdist module reached through
    a bound name (``D._axis_comm``, ``fastdist.nn.moe.dispatch``), else ``None``."""
    chain = [node.attr]
    value = node.value
    while isinstance(value, ast.Attribute):
        chain.append(value.attr)
        value = value.value
    if not isinstance(value, ast.Name) or value.id not in bound:
        return None
    module = bound[value.id]
    *path, attr = reversed(chain)
    for part in path:
        if f"{module}.{part}" not in MODULES:
            return None  # an attribute of an object the module holds: not the module's own
        module = f"{module}.{part}"
    return module, attr


def _violations() -> Iterator[str]:
    for name, path in sorted(MODULES.items()):
        tree = ast.parse(path.read_text())
        bound = _fastdist_modules_bound(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if not node.module.startswith("fastdist"):
                    continue
                if node.module in MODULES and node.module != name:
                    parts = node.module.split(".")
                    if any(map(_is_private, parts)) and not _home(name, node.module):
                        yield f"{name}:{node.lineno} imports the private module {node.module}"
                for a in node.names:
                    if _is_private(a.name) and f"{node.module}.{a.name}" not in MODULES:
                        yield f"{name}:{node.lineno} takes {node.module}.{a.name}"
            elif isinstance(node, ast.Attribute) and (target := _target(node, bound)):
                module, attr = target
                if module == name:
                    continue
                if _is_private(attr):
                    yield f"{name}:{node.lineno} reaches {module}.{attr}"
                if isinstance(node.ctx, (ast.Store, ast.Del)):
                    yield f"{name}:{node.lineno} rebinds {module}.{attr}"
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("setattr", "delattr")
                and node.args
                and isinstance(node.args[0], ast.Name)
                and bound.get(node.args[0].id, name) != name
            ):
                yield f"{name}:{node.lineno} rebinds {bound[node.args[0].id]} with {node.func.id}"


def test_the_layer_contract_holds() -> None:
    linter = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run(
        [str(linter), "--config", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = proc.stdout[proc.stdout.find("Contracts") :]
    assert proc.returncode == 0, report + proc.stderr[-2000:]
    assert "1 kept, 0 broken" in report


def test_the_layer_contract_names_every_part_of_the_package() -> None:
    """A new subpackage or top-level module cannot slip past the contract unplaced."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = conf["contracts"]
    placed = {
        part.strip().strip("()")
        for layer in contract["layers"]
        for part in layer.replace(":", "|").split("|")
    }
    children = {
        "fastdist." + p.name.removesuffix(".py")
        for p in PKG.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()
    }
    assert children <= placed, sorted(children - placed)
    assert placed <= children, sorted(placed - children)


def test_no_private_names_across_modules_and_no_rebinding() -> None:
    found = list(_violations())
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "code, expect",
    [
        ("from fastdist.ops.prelude import _hidden", "takes fastdist.ops.prelude._hidden"),
        ("from fastdist.core import mesh as M\nM._hidden(1)", "reaches fastdist.core.mesh._hidden"),
        ("import fastdist.nn.moe as M\nM.dispatch = print", "rebinds fastdist.nn.moe.dispatch"),
        ("from fastdist.nn import moe\nsetattr(moe, 'dispatch', print)", "with setattr"),
    ],
)
def test_the_checker_sees_each_kind_of_violation(
    code: str, expect: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: each violation it looks for, planted in a module of the package."""
    fake = PKG / "tools" / "visual.py"
    monkeypatch.setitem(MODULES, "fastdist.tools.visual", tmp_path / "planted.py")
    (tmp_path / "planted.py").write_text(code + "\n")
    found = [v for v in _violations() if v.startswith("fastdist.tools.visual:")]
    assert fake.exists() and any(expect in v for v in found), found


def test_no_file_is_over_1000_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in PKG.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 1000
    }
    assert not long, long


def test_the_design_page_lists_every_file_with_its_concern() -> None:
    """docs/design.md's floor plan names each file of the package once, and no file that is gone."""
    text = (ROOT / "docs" / "design.md").read_text()
    listed = re.findall(r"^\| `([\w/]+\.py)` \| \S", text, flags=re.M)
    files = [
        str(p.relative_to(PKG))
        for p in sorted(PKG.rglob("*.py"))
        if not (p.name == "__init__.py" and p.parent != PKG and p.parent.name != "ops")
    ]
    assert sorted(listed) == sorted(set(listed)), "a file listed twice"
    assert set(files) == set(listed), (
        sorted(set(files) - set(listed)),
        sorted(set(listed) - set(files)),
    )
