"""fastdist.mq on 4 real processes: delivery, failures (never a hang, never a silent loss), /dev/shm hygiene, node locality.

Each scenario runs ``tests/mq_worker.py`` on 4 processes under a hard wall timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from fastdist import mq

from .mq_worker import N_MESSAGES, TIMEOUT

ROOT = Path(__file__).resolve().parent.parent
WALL = 60.0  # hard limit per scenario


def run(scenario: str, out: Path, world: int = 4) -> tuple[list[Any], list[int], list[str]]:
    """Run ``scenario`` on ``world`` processes (results in ``out``); kill them all past WALL seconds. Returns (values, returncodes, logs)."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=datetime.timedelta(seconds=WALL), wait_for_workers=False)  # type: ignore[attr-defined]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1"}
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(open(out / f"log{r}.txt", "w+")) for r in range(world)]
        procs = [subprocess.Popen([sys.executable, "-m", "tests.mq_worker", scenario, str(r), str(world), str(store.port), str(out)], cwd=ROOT, env=env,
                                  stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world)]
        deadline = time.monotonic() + WALL
        try:
            for p in procs:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            for p in procs:
                p.wait()
            text = "".join(f"--- rank {r}\n{(out / f'log{r}.txt').read_text()[-3000:]}" for r in range(world))
            raise AssertionError(f"{scenario} did not finish within {WALL} s:\n{text}") from None
    texts = [(out / f"log{r}.txt").read_text() for r in range(world)]
    values = [pickle.loads((out / f"{r}.pkl").read_bytes()) if (out / f"{r}.pkl").exists() else None for r in range(world)]
    # no segment left behind by any of the ranks (names carry the writer's pid)
    left = [f for p in procs for f in glob.glob(f"/dev/shm/{mq._SHM_PREFIX}{p.pid}_*")]
    assert not left, f"{scenario} left shared-memory segments behind: {left}"
    return values, [p.returncode for p in procs], texts


def _ok(values: list[Any], codes: list[int], texts: list[str]) -> None:
    bad = [r for r, c in enumerate(codes) if c != 0]
    assert not bad, "\n".join(f"--- rank {r} exited {codes[r]}\n{texts[r][-3000:]}" for r in bad)


def test_ten_thousand_mixed_messages_exactly_once_in_order(tmp_path: Path) -> None:
    t0 = time.monotonic()
    values, codes, texts = run("stream", tmp_path)
    _ok(values, codes, texts)
    assert values[0]["remote"] == (3,)  # rank 3 "on another host": the socket path; 1 and 2 through shared memory
    for r in (1, 2, 3):
        assert values[r]["got"] == N_MESSAGES, values[r]
        assert "closed the queue" in values[r]["closed"] and f"read all {N_MESSAGES} message(s)" in values[r]["closed"]
    assert not any(v["leaked"] for v in values)  # unlinked right after setup
    print(f"stream: {N_MESSAGES} messages in {max(v['seconds'] for v in values):.2f} s (run {time.monotonic() - t0:.1f} s)")


def test_writer_killed_readers_raise_naming_it(tmp_path: Path) -> None:
    values, codes, texts = run("writer_dies", tmp_path)
    assert codes[0] == -9
    killed = float((tmp_path / "killed.txt").read_text())
    for r in (1, 2, 3):
        assert codes[r] == 0, texts[r][-3000:]
        v = values[r]
        assert v["got"] == 300, v  # everything written before the crash arrives: no silent loss
        assert v["type"] == "PeerLostError" and v["peer"] == 0, v
        assert "the writer, rank 0 (axis index 0)" in v["msg"] and f"on rank {r}" in v["msg"] and "Fix:" in v["msg"]
        assert v["at"] - killed < TIMEOUT + 2, v["at"] - killed


@pytest.mark.parametrize("victim", [2, 3], ids=["shm-reader", "socket-reader"])
def test_reader_killed_writer_raises_naming_it(victim: int, tmp_path: Path) -> None:
    values, codes, texts = run(f"reader_dies:{victim}", tmp_path)
    assert codes[victim] == -9
    killed = float((tmp_path / "killed.txt").read_text())
    for r in range(4):
        if r != victim:
            assert codes[r] == 0, texts[r][-3000:]
    w = values[0]
    assert w["type"] == "PeerLostError" and w["peer"] == victim, w
    assert f"the reader, rank {victim} (axis index {victim})" in w["msg"] and "Fix:" in w["msg"]
    assert w["at"] - killed < TIMEOUT + 2, w["at"] - killed
    for r in range(1, 4):
        if r != victim:  # the survivors got everything the writer sent (and maybe the message it was sending), then the close
            assert values[r]["type"] == "QueueClosedError" and values[r]["got"] in (w["sent"], w["sent"] + 1), (values[r], w["sent"])


def test_node_locality_single_reader_nonblocking_and_timeouts(tmp_path: Path) -> None:
    values, codes, texts = run("locality", tmp_path)
    _ok(values, codes, texts)
    for r, v in enumerate(values):
        assert (v["local_rank"], v["local_size"], v["nodes"], v["device"]) == (r, 4, [[0, 1, 2, 3]], "cpu")
        assert v["same_as_0"] == [True] * 4
        assert v["fake_nodes"] == [[0, 1, 2], [3]] and v["fake_local"] == ((r, 3) if r < 3 else (0, 1))
    assert values[0]["single"] == [None, ("hello", 1, True, ("bye", 1)), ("hello", 2, True, ("bye", 2)), ("hello", 3, True, ("bye", 3))]
    assert "the message needs 1 slot(s), 0 of 2 are free" in values[0]["full"]
    assert "not a reader" in values[0]["wrong_role"]
    for r in (1, 2, 3):
        v = values[r]
        assert v["read"] == [1, 2, 4]
        assert "no message" in v["empty"]
        assert "the writer, rank 0, sent nothing" in v["timeout"] and 0.25 < v["timeout_s"] < 2.0, v
