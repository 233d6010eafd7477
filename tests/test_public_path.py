"""The fast path's switch (docs/design.md, "Dispatch"): the simulated-rank tests pass on the public
route too.

``FASTDIST_FAST_PATH=0`` turns off the two shortcuts that use private torch internals;
every value and gradient must be the same. The fast tier of the files below, and one gloo
test, run again in a subprocess with the switch off (the main run, with the default on, covers
the fast path).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import fastdist as fd
from fastdist.core import primitive

ROOT = Path(__file__).resolve().parent.parent
FILES = [
    "tests/test_collectives.py",
    "tests/test_uneven.py",
    "tests/test_checking.py",
    "tests/test_mesh.py",
    "tests/test_errors.py",
    "tests/test_nn.py",
    "tests/test_cross_entropy.py",
    "tests/test_autograd_function_simulate.py",
]
#: real ranks: the Function's C entry point (the fast path's first shortcut) against Function.apply
GLOO_TEST = "tests/test_cross_entropy.py::test_cross_entropy_on_gloo"


def test_the_switch_is_read_from_the_environment() -> None:
    code = "import fastdist.core.transforms as t; print(t.FAST_PATH)"
    env = {**os.environ, "FASTDIST_FAST_PATH": "0"}
    off = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert off.stdout.strip() == "False"
    assert primitive.FAST_PATH is (os.environ.get("FASTDIST_FAST_PATH", "1") != "0")


@pytest.mark.skipif(os.environ.get("FASTDIST_FAST_PATH") == "0", reason="already the public route")
def test_simulated_rank_suite_passes_on_the_public_route() -> None:
    env = {
        **os.environ,
        "FASTDIST_FAST_PATH": "0",
        "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci"),
    }
    # the fast tier of FILES without its compiled tests (the fast path is off under compile
    # anyway: their slow tests compile or spawn gloo processes), and one gloo test for the
    # real-rank shortcut (apply_function)
    for selection in (["-m", "not slow", "-k", "not compile", *FILES], [GLOO_TEST]):
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-x"]
            + selection,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
        tail = proc.stdout[-4000:] + proc.stderr[-2000:]
        assert proc.returncode == 0, tail
        assert " passed" in proc.stdout and " failed" not in proc.stdout, tail


def test_the_fast_path_switch_is_per_thread() -> None:
    """The functorch switch the fast path flips around a stacked-Function call is thread-local
    torch state."""
    f = torch._C._functorch
    seen: list[bool] = []
    prev = f.get_single_level_autograd_function_allowed()
    f.set_single_level_autograd_function_allowed(True)
    try:
        t = threading.Thread(
            target=lambda: seen.append(f.get_single_level_autograd_function_allowed())
        )
        t.start()
        t.join(30)
    finally:
        f.set_single_level_autograd_function_allowed(prev)
    assert seen == [False]
    mesh = fd.Mesh({"tp": 2})
    x = torch.ones(2, 3, requires_grad=True)
    fd.simulate(lambda v: fd.psum(v, mesh, "tp"), mesh)(
        x
    ).sum().backward()  # the fast path restores the switch
    assert f.get_single_level_autograd_function_allowed() == prev
    assert torch.equal(x.grad, torch.ones(2, 3))
