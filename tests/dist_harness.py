"""Launch a multi-process scenario from tests/dist_worker.py and collect every rank's result."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdist.testing import _free_port as free_port

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str
    value: Any


def run_world(scenario: str, world: int, *, timeout: float = 240.0, seed: int = 0, env: dict[str, str] | None = None) -> list[RankResult]:
    """Run ``scenario`` on ``world`` gloo processes; kill all of them past ``timeout`` (never hang).

    ``env`` adds variables, e.g. ``FASTDIST_TEST_BACKEND`` / ``FASTDIST_TEST_LIBRARY`` to run
    the scenario's meshes on a ctypes backend.
    """
    port = free_port()
    env = {**os.environ, **(env or {}), "FASTDIST_TEST_STORE_PORT": str(free_port()), "FASTDIST_TEST_SEED": str(seed), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as out:
        logs = [tempfile.TemporaryFile(mode="w+") for _ in range(world)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.dist_worker", scenario, str(r), str(world), str(port), out], cwd=ROOT, env=env, stdout=logs[r], stderr=subprocess.STDOUT
            )
            for r in range(world)
        ]
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"{scenario} on {world} ranks did not finish within {timeout} s:\n" + _dump(logs)) from None
        results = []
        for r, (p, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            path = Path(out) / f"{r}.pkl"
            value = pickle.loads(path.read_bytes()) if path.exists() else None
            results.append(RankResult(r, p.returncode, log.read(), value))
        return results


def _dump(logs: list[Any]) -> str:
    parts = []
    for r, log in enumerate(logs):
        log.seek(0)
        parts.append(f"--- rank {r} ---\n{log.read()[-3000:]}")
    return "\n".join(parts)


def expect_ok(results: list[RankResult]) -> list[Any]:
    bad = [r for r in results if r.returncode != 0]
    assert not bad, "\n".join(f"--- rank {r.rank} exited {r.returncode} ---\n{r.output[-4000:]}" for r in bad)
    return [r.value for r in results]
