"""Launch a multi-process scenario (tests/dist_worker.py, tests/reliability_worker.py) and collect
every rank's result.

No port is chosen by guessing: the ranks meet through a ``TCPStore`` this process hosts on a port
the OS picks (as :func:`fastdist.testing.run_on_gloo` does; every rank, rank 0 included, joins it
as a client, which ``TORCHELASTIC_USE_AGENT_STORE`` tells ``init_process_group`` to do), and the
port a scenario's rank 0 hosts a ``StatelessGroup`` store on (``FASTDIST_TEST_STORE_PORT``) is
held by this process for the whole run (:func:`reserved_port`), so no other process can take it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str
    value: Any


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A port that no other process can take while the block runs, except by binding it with
    ``SO_REUSEADDR`` (as ``TCPStore`` does): this process holds it bound, not listening. The OS
    never hands a bound port to another ``bind(port 0)`` or outgoing connection, and a plain
    ``bind`` of it fails."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


def run_world(
    scenario: str,
    world: int,
    *,
    timeout: float = 240.0,
    seed: int = 0,
    env: dict[str, str] | None = None,
    module: str = "tests.dist_worker",
) -> list[RankResult]:
    """Run ``scenario`` of ``module`` on ``world`` gloo processes; kill all of them past
    ``timeout`` (never hang).

    ``env`` adds variables, e.g. ``FASTDIST_TEST_BACKEND`` / ``FASTDIST_TEST_LIBRARY`` to run
    the scenario's meshes on a ctypes backend.
    """
    limit = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(
        "127.0.0.1", 0, world, is_master=True, timeout=limit, wait_for_workers=False
    )  # type: ignore[attr-defined]
    try:
        with reserved_port() as stateless_port:
            return _run(scenario, world, module, store.port, stateless_port, timeout, seed, env)
    finally:
        del store  # the rendezvous closes with the run


def _run(
    scenario: str,
    world: int,
    module: str,
    port: int,
    stateless_port: int,
    timeout: float,
    seed: int,
    extra: dict[str, str] | None,
) -> list[RankResult]:
    env = {
        **os.environ,
        **(extra or {}),
        # init_process_group(init_method="tcp://...") joins our store; rank 0 hosts none
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "FASTDIST_TEST_STORE_PORT": str(stateless_port),
        "FASTDIST_TEST_SEED": str(seed),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    with tempfile.TemporaryDirectory() as out:
        logs = [tempfile.TemporaryFile(mode="w+") for _ in range(world)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", module, scenario, str(r), str(world), str(port), out],
                cwd=ROOT,
                env=env,
                stdout=logs[r],
                stderr=subprocess.STDOUT,
            )
            for r in range(world)
        ]
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{scenario} on {world} ranks did not finish within {timeout} s:\n" + _dump(logs)
            ) from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
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
    assert not bad, "\n".join(
        f"--- rank {r.rank} exited {r.returncode} ---\n{r.output[-4000:]}" for r in bad
    )
    return [r.value for r in results]


# ============================================================================ examples
def torchrun_example(example: str, world: int, *args: str) -> subprocess.CompletedProcess[str]:
    """``examples/<example> <args>`` under ``torchrun --standalone`` on ``world`` gloo processes
    (skipped where torch has no gloo); the completed process, whatever its exit code."""
    import pytest

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(world),
            str(ROOT / "examples" / example),
            *args,
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_example_without_torchrun(example: str) -> subprocess.CompletedProcess[str]:
    """``examples/<example>`` run as a plain script (no torchrun environment)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / example)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
