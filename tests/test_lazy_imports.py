"""What each first command imports (issue 32.9), and the command line's argument checks and
verdicts (issue 32.10).

``import fastdist`` imports no torch: each public name imports its module on first use
(src/fastdist/__init__.py). The times are a benchmark row (benchmarks/import_time.py), not
asserted here; what is asserted is which modules a command loads, in a fresh interpreter.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastdist as fd

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch._dynamo", "torch.distributed.checkpoint", "transformers", "fastdist.serving.queue")


def _loaded(code: str, *modules: str) -> list[str]:
    """Which of ``modules`` are in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    probe = (
        f"{code}\nimport json, sys; print(json.dumps([m for m in {modules!r} if m in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return list(json.loads(out.stdout.splitlines()[-1]))


def test_import_fastdist_imports_no_torch_and_first_use_nothing_heavy() -> None:
    assert _loaded("import fastdist", "torch", "fastdist.ops") == []
    # the probe sees modules: a use loads them
    assert _loaded("import fastdist as fd; fd.psum", "torch", "fastdist.ops") == [
        "torch",
        "fastdist.ops",
    ]
    core = (
        "import fastdist as fd; fd.Mesh, fd.psum, fd.simulate, fd.spmd, fd.comm.send, "
        "fd.all_gather_v"
    )
    assert _loaded(core, *HEAVY, "fastdist.nn", "fastdist.train") == []
    assert _loaded("import fastdist.nn", *HEAVY, "fastdist.train") == []
    assert _loaded("import fastdist as fd; fd.serving", *HEAVY) == ["fastdist.serving.queue"]


def test_python_m_fastdist_help_imports_no_torch() -> None:
    code = (
        "import runpy, sys\n"
        "sys.argv = ['fastdist', '--help']\n"
        "try:\n"
        "    runpy.run_module('fastdist', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code"
    )
    assert _loaded(code, "torch", "fastdist.ops", "argparse") == ["argparse"]
    # the argument checks too
    code = code.replace("'--help'", "'demo', '--dp', '0'").replace("== 0", "== 2")
    assert _loaded(code, "torch", "argparse") == ["argparse"]


def test_the_lazy_table_the_type_checking_imports_and_all_agree() -> None:
    """``_EXPORTS`` (what runs), the ``if TYPE_CHECKING:`` imports (what mypy and the API reference
    read) and ``__all__`` name the same objects, each from the same module."""
    tree = ast.parse((ROOT / "src" / "fastdist" / "__init__.py").read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n)]
    typed = {
        a.name: (a.name if node.module == "fastdist" else node.module.removeprefix("fastdist."))
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    }
    exports = fd._EXPORTS  # type: ignore[attr-defined]
    assert typed == exports
    assert set(fd.__all__) == set(exports)
    for name, module in exports.items():
        obj = getattr(fd, name)
        home = sys.modules[f"fastdist.{module}"]
        assert obj is (
            home if name in fd._SUBMODULES else getattr(home, name)  # type: ignore[attr-defined]
        )
    assert set(fd.__all__) <= set(dir(fd))
    with pytest.raises(AttributeError, match="module 'fastdist' has no attribute 'psumm'"):
        fd.psumm  # type: ignore[attr-defined]  # noqa: B018


def test_fd_simulate_stays_the_function_when_its_module_is_imported_first() -> None:
    """Importing the submodules ``fastdist.sim.simulate`` and ``fastdist.check.spmd`` first
    leaves ``fd.simulate`` and ``fd.spmd`` the functions."""
    code = (
        "import fastdist.nn, fastdist.sim.simulate, fastdist.check.spmd\n"
        "import fastdist as fd\n"
        "print(fd.simulate.__module__, fd.simulate.__name__, fd.spmd.__module__, fd.spmd.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == [
        "fastdist.sim.simulate",
        "simulate",
        "fastdist.check.spmd",
        "spmd",
    ]


def test_the_dynamo_marker_set_without_importing_dynamo_is_torchs() -> None:
    """fastdist marks its run-while-tracing helpers the way ``torch._dynamo.assume_constant_result``
    does, without importing dynamo; if torch changes how it marks them, this fails."""
    import torch._dynamo

    from fastdist.comm import axes, failures

    def probe() -> int:
        return 0

    torch._dynamo.assume_constant_result(probe)  # type: ignore[no-untyped-call]
    assert vars(probe) == {"_dynamo_marked_constant": True}
    for fn in (axes.group_name_while_tracing, failures.raise_while_tracing):
        assert vars(fn)["_dynamo_marked_constant"] is True


def test_the_demo_checks_its_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from fastdist.__main__ import MAX_DEMO_RANKS, main

    for args, says in (
        (["--dp", "0"], "argument --dp: 0 ranks: the degree must be at least 1"),
        (["--tp", "-2"], "argument --tp: -2 ranks: the degree must be at least 1"),
        (["--tp", "two"], "argument --tp: 'two' is not a whole number of ranks"),
        (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        (["--dp", "2", "--tp", str(MAX_DEMO_RANKS)], f"at most {MAX_DEMO_RANKS}"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["demo", *args])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and says in err, (args, err)
        assert err.startswith("usage: ") and "Traceback" not in err
    proc = subprocess.run(
        [sys.executable, "-m", "fastdist", "demo", "--dp", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "error: argument --dp: 0 ranks" in proc.stderr


def test_the_demo_verdict_says_what_differs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import fastdist.tools.demo
    from fastdist.__main__ import main

    real = fastdist.tools.demo.run_demo

    def broken(*a: object, **k: object) -> fastdist.tools.demo.DemoResult:
        res = real(*a, **k)  # type: ignore[arg-type]
        res.max_grad_diff["W1"] = 0.5  # as if a gradient were wrong
        res.loss += 3e-3
        return res

    assert main(["demo", "--dp", "1", "--tp", "2"]) == 0
    ok = capsys.readouterr().out
    assert "  OK: every rank matches the single device within 1e-10\n" in ok
    monkeypatch.setattr(fastdist.tools.demo, "run_demo", broken)
    assert main(["demo", "--dp", "1", "--tp", "2"]) == 1
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if "MISMATCH" in ln]
    assert line.startswith(
        "  MISMATCH: the ranks differ from the single device beyond 1e-10: loss by 3.00e-03, "
        "grad W1 by 5.00e-01"
    ), line
    assert "every rank matches" not in out
    res = broken(1, 2, dtype=torch.float64)
    assert not res.ok and list(res.mismatches) == ["loss", "grad W1"]
    assert res.mismatches["grad W1"] == 0.5
