"""Launch a multi-process scenario (tests/dist_worker.py, tests/reliability_worker.py) and collect
every rank's result.

No port is chosen by guessing: the ranks meet through a ``TCPStore`` this process hosts on a port
the OS picks (as :func:`fastdist.testing.run_on_gloo` does; every rank, rank 0 included, joins it
as a client, which ``TORCHELASTIC_USE_AGENT_STORE`` tells ``init_process_group`` to do), and the
port a scenario's rank 0 hosts a ``StatelessGroup`` store on (``FASTDIST_TEST_STORE_PORT``) is
held by this process for the whole run (:func:`reserved_port`), so no other process can take it.

Every rank is forked from a forkserver (one per pytest process) that has imported torch, fastdist
and transformers' common models once (:data:`PRELOAD`): a rank starts in a fraction of a second
instead of re-importing them for seconds of CPU, which is most of a gloo test's cost on 2 cores.
The processes are as real as spawned ones (their own gloo groups, sockets and memory).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import runpy
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fastdist.testing

ROOT = Path(__file__).resolve().parent.parent

#: what the forkserver imports before it forks any rank (tests/forkserver_preload.py)
PRELOAD = ["tests.forkserver_preload"]


def forkserver() -> Any:
    """The forkserver context, its preload set (used when the server starts: the first run)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_on_gloo(fn: Any, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """:func:`fastdist.testing.run_on_gloo` with the ranks forked from the preloaded forkserver."""
    forkserver()
    return fastdist.testing.run_on_gloo(fn, world_size, *args, start_method="forkserver", **kwargs)


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
    ctx = forkserver()
    with tempfile.TemporaryDirectory() as out:
        logs = [Path(out) / f"{r}.log" for r in range(world)]
        procs = [
            ctx.Process(
                target=_scenario_entry,
                args=(module, [scenario, str(r), str(world), str(port), out], env, str(logs[r])),
                name=f"{scenario}:rank{r}",
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
                if p.exitcode is None:
                    raise AssertionError(
                        f"{scenario} on {world} ranks did not finish within {timeout} s:\n"
                        + _dump(logs)
                    )
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
                    p.join()
        results = []
        for r, (p, log) in enumerate(zip(procs, logs)):
            path = Path(out) / f"{r}.pkl"
            value = pickle.loads(path.read_bytes()) if path.exists() else None
            output = log.read_text(errors="replace") if log.exists() else ""
            results.append(
                RankResult(r, p.exitcode if p.exitcode is not None else -9, output, value)
            )
        return results


def _scenario_entry(module: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """One rank, in a process forked from the forkserver: ``python -m module *argv`` with ``env``,
    its stdout and stderr (Python's and native code's) written to ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 did for a fresh interpreter
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _dump(logs: list[Path]) -> str:
    return "\n".join(
        f"--- rank {r} ---\n{log.read_text(errors='replace')[-3000:] if log.exists() else ''}"
        for r, log in enumerate(logs)
    )


def expect_ok(results: list[RankResult]) -> list[Any]:
    bad = [r for r in results if r.returncode != 0]
    assert not bad, "\n".join(
        f"--- rank {r.rank} exited {r.returncode} ---\n{r.output[-4000:]}" for r in bad
    )
    return [r.value for r in results]


# ============================================================================ examples
def load_example(example: str, module: str) -> Any:
    """``examples/<example>`` imported as the module ``module`` (registered in ``sys.modules``:
    an example's dataclasses look their module up while being made); its main guard not run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(module, ROOT / "examples" / example)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[module] = loaded
    spec.loader.exec_module(loaded)
    return loaded


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


def forked_example(
    example: str, world: int, *args: str, timeout: float = 300.0
) -> subprocess.CompletedProcess[str]:
    """``examples/<example> <args>`` on ``world`` gloo processes forked from the preloaded
    forkserver, each with the environment torchrun gives its ranks (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT`` of a store this process hosts...): the same run as
    :func:`torchrun_example` without a fresh interpreter per rank (and one for the launcher)
    importing torch and transformers, seconds of CPU each on 2 cores. Each example keeps one
    test under the real torchrun. The result reads as torchrun's: every rank's stdout (rank 0
    first), every rank's stderr, and exit code 1 if a rank failed (as torchrun), 0 otherwise;
    ranks still running after ``timeout`` are killed and the code is -9."""
    import pytest

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    limit = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(
        "127.0.0.1", 0, world, is_master=True, timeout=limit, wait_for_workers=False
    )  # type: ignore[attr-defined]
    base = {
        **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # every rank joins our store as a client
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    script = str(ROOT / "examples" / example)
    ctx = forkserver()
    try:
        with tempfile.TemporaryDirectory() as out:
            logs = [(Path(out) / f"{r}.out", Path(out) / f"{r}.err") for r in range(world)]
            procs = [
                ctx.Process(
                    target=_example_entry,
                    args=(
                        script,
                        list(args),
                        {**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                        [str(p) for p in logs[r]],
                    ),
                    name=f"{example}:rank{r}",
                )  # fmt: skip
                for r in range(world)
            ]
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            # as torchrun: the first rank to fail ends the others
            while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                time.sleep(0.05)
            codes = [p.exitcode for p in procs]
            for p in procs:
                if p.exitcode is None:
                    p.kill()
                p.join()
            stdout, stderr = (
                "".join(pair[i].read_text(errors="replace") for pair in logs if pair[i].exists())
                for i in (0, 1)
            )
    finally:
        del store
    code = (
        -9
        if all(c in (None, 0) for c in codes) and None in codes
        else int(any(c != 0 for c in codes))
    )
    return subprocess.CompletedProcess([script, *args], code, stdout, stderr)


def _example_entry(script: str, argv: list[str], env: dict[str, str], logs: list[str]) -> None:
    """One rank of :func:`forked_example`: ``python script *argv`` with ``env``, its stdout and
    stderr (Python's and native code's) written to ``logs``."""
    for fd_no, path in zip((1, 2), logs):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd_no)
        os.close(f)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    sys.path.insert(0, str(Path(script).parent))
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 did for a fresh interpreter
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


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
