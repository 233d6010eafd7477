"""No namespace imports what only a rare call needs (issue 42.4): ``torch.distributed.checkpoint``
and, through it or DTensor, sympy cost about a second; they are imported by the first
distributed save or load. The start-up times themselves are a benchmark
(benchmarks/import_time.py), never asserted: this checks ``sys.modules`` in fresh interpreters.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import fastdist


def _benchmark_namespaces() -> tuple[str, ...]:
    """The namespace list of benchmarks/import_time.py (one list serves the benchmark and this
    test)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "import_time.py"
    spec = importlib.util.spec_from_file_location("import_time_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.NAMESPACES)


NAMESPACES = ("fastdist", *_benchmark_namespaces())
#: the modules no namespace may import
HEAVY = ("torch.distributed.checkpoint", "sympy", "torch.distributed.tensor")


def _run(code: str) -> object:
    """The JSON ``code`` prints last, run in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_every_namespace_is_in_this_list() -> None:
    """A new subpackage is checked too: the list above names every one."""
    src = Path(fastdist.__file__).parent
    found = {f"fastdist.{p.name}" for p in src.iterdir() if (p / "__init__.py").is_file()}
    assert found | {"fastdist", "fastdist.testing"} == set(NAMESPACES)


def test_no_namespace_imports_dcp_or_sympy() -> None:
    """One interpreter imports the namespaces in turn and records what each one brought in (a
    heavy module, once imported, stays: the first namespace that imports it is named)."""
    code = (
        "import importlib, json, sys\n"
        "import torch\n"
        f"heavy = {HEAVY!r}\n"
        "pulled = {}\n"
        f"for ns in {NAMESPACES!r}:\n"
        "    before = {h for h in heavy if h in sys.modules}\n"
        "    importlib.import_module(ns)\n"
        "    new = sorted(h for h in heavy if h in sys.modules and h not in before)\n"
        "    if new:\n"
        "        pulled[ns] = new\n"
        "print(json.dumps(pulled))"
    )
    assert _run(code) == {}


def test_a_safetensors_checkpoint_leaves_dcp_unimported(tmp_path: Path) -> None:
    """A safetensors save and load leave torch.distributed.checkpoint unimported (the deferred
    import of a DCP save and load runs in tests/test_checkpoint.py)."""
    code = f"""
import json, sys, torch, fastdist as fd
from fastdist import checkpoint
pm = fd.nn.parallelize(
    torch.nn.Sequential(torch.nn.Linear(4, 4)), fd.Mesh({{"tp": 2}}),
    {{"0": fd.nn.ColwiseParallel()}})
checkpoint.save({str(tmp_path / "w.safetensors")!r}, pm)
checkpoint.load({str(tmp_path / "w.safetensors")!r}, pm)
print(json.dumps(sorted(h for h in {HEAVY!r} if h in sys.modules)))
"""
    assert _run(code) == []
    from fastdist.checkpoint.api import is_dcp

    assert (tmp_path / "w.safetensors").is_file() and not is_dcp(tmp_path)
