"""Which names a documentation example uses that fastdist does not have.

Run as a script by tests/test_docs_and_notebooks.py, in a fresh interpreter (a submodule is an
attribute of its package once anything imported it): reads a JSON list of code blocks on stdin,
prints a JSON list with each block's unknown names.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from typing import cast


def unknown_names(code: str) -> list[str]:
    """Names in ``code`` that do not exist: ``from fastdist... import x`` and ``import
    fastdist...`` statements; attribute chains rooted at ``fd``/``fastdist`` or at a name such an
    import binds (resolved by attribute access only: a submodule the package does not import must
    be imported by the block); and the first attribute of a variable the examples use for a
    fastdist object."""
    import importlib

    import fastdist as fd

    holds = {
        "mesh": fd.Mesh,
        "mesh2": fd.Mesh,
        "q": fd.serving.MessageQueue,
        "mine": fd.serving.MessageQueue,
        "info": fd.serving.NodeInfo,
        "pm": fd.nn.ParallelModel,
        "ctx": fd.comm.GraphCaptureContext,
    }
    roots: dict[str, object] = {"fd": fd, "fastdist": fd}
    bad = []
    tree = ast.parse(code)
    _mark_parents(tree)
    for node in ast.walk(tree):  # imports first: they bind the roots
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fastdist":
            try:
                module = importlib.import_module(cast(str, node.module))
            except ImportError:
                bad.append(f"from {node.module}")
                continue
            for alias in node.names:
                try:
                    got = getattr(module, alias.name, None) or importlib.import_module(
                        f"{node.module}.{alias.name}"
                    )
                except ImportError:
                    bad.append(f"from {node.module} import {alias.name}")
                    continue
                roots[alias.asname or alias.name] = got
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fastdist":
                    try:
                        got = importlib.import_module(alias.name)
                    except ImportError:
                        bad.append(f"import {alias.name}")
                        continue
                    if alias.asname:
                        roots[alias.asname] = got
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or isinstance(
            getattr(node, "parent", None), ast.Attribute
        ):
            continue
        chain, root = [], node
        while isinstance(root, ast.Attribute):
            chain.insert(0, root.attr)
            root = root.value
        if not isinstance(root, ast.Name):
            continue
        if root.id in roots:
            obj = roots[root.id]
            for attr in chain:
                if not hasattr(obj, attr):
                    bad.append(".".join([root.id, *chain]))
                    break
                obj = getattr(obj, attr)
        elif root.id in holds and chain[0] not in _attributes(holds[root.id]):
            bad.append(f"{root.id}.{chain[0]} ({holds[root.id].__name__})")
    return bad


def _attributes(cls: type) -> set[str]:
    """What an instance of ``cls`` has: class attributes, dataclass fields, and what
    ``__init__`` assigns to ``self``."""
    import dataclasses
    import inspect

    names = set(dir(cls))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    try:
        init = inspect.getsource(cls.__init__) if "__init__" in vars(cls) else ""
    except OSError:  # generated (a dataclass's)
        init = ""
    names |= set(re.findall(r"self\.(\w+)\b(?=[^=\n]*=[^=])", init))
    return names


def _mark_parents(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node  # type: ignore[attr-defined]


if __name__ == "__main__":
    print(json.dumps([unknown_names(code) for code in json.load(sys.stdin)]))
