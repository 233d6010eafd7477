"""fastdist.serving on 4 real processes: delivery, failures (never a hang, never a silent loss),
/dev/shm hygiene, node locality.

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

from fastdist import errors as fd_errors
from fastdist import serving
from fastdist.serving import shm_ring

from .mq_worker import N_MESSAGES, SHORT, TIMEOUT

#: how long past the queue's timeout a survivor may take to raise on a loaded 2-core machine (a
#: bound, not a speed: a survivor left waiting would be killed by the run's own timeout)
SLACK = 10.0

ROOT = Path(__file__).resolve().parent.parent
WALL = 60.0  # hard limit per scenario


def run(scenario: str, out: Path, world: int = 4) -> tuple[list[Any], list[int], list[str]]:
    """Run ``scenario`` on ``world`` processes (results in ``out``); kill them all past WALL
    seconds. Returns (values, returncodes, logs)."""
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world,
        is_master=True,
        timeout=datetime.timedelta(seconds=WALL),
        wait_for_workers=False,
    )  # type: ignore[attr-defined]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "MASTER_ADDR": "127.0.0.1",
    }
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(open(out / f"log{r}.txt", "w+")) for r in range(world)]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.mq_worker",
                    scenario,
                    str(r),
                    str(world),
                    str(store.port),
                    str(out),
                ],
                cwd=ROOT,
                env=env,
                stdout=logs[r],
                stderr=subprocess.STDOUT,
            )
            for r in range(world)
        ]
        deadline = time.monotonic() + WALL
        try:
            for p in procs:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            for p in procs:
                p.wait()
            text = "".join(
                f"--- rank {r}\n{(out / f'log{r}.txt').read_text()[-3000:]}" for r in range(world)
            )
            raise AssertionError(f"{scenario} did not finish within {WALL} s:\n{text}") from None
    texts = [(out / f"log{r}.txt").read_text() for r in range(world)]
    values = [
        pickle.loads((out / f"{r}.pkl").read_bytes()) if (out / f"{r}.pkl").exists() else None
        for r in range(world)
    ]
    # no segment left behind by any of the ranks (names carry the writer's pid); a killed writer's
    # segment is unlinked by its resource tracker, which may take a moment after the kill
    give_up = time.monotonic() + 5.0
    while (
        left := [f for p in procs for f in glob.glob(f"/dev/shm/{shm_ring.SHM_PREFIX}{p.pid}_*")]
    ) and time.monotonic() < give_up:
        time.sleep(0.05)
    assert not left, f"{scenario} left shared-memory segments behind: {left}"
    return values, [p.returncode for p in procs], texts


def _ok(values: list[Any], codes: list[int], texts: list[str]) -> None:
    bad = [r for r, c in enumerate(codes) if c != 0]
    assert not bad, "\n".join(f"--- rank {r} exited {codes[r]}\n{texts[r][-3000:]}" for r in bad)


def test_ten_thousand_mixed_messages_exactly_once_in_order(tmp_path: Path) -> None:
    t0 = time.monotonic()
    values, codes, texts = run("stream", tmp_path)
    _ok(values, codes, texts)
    # rank 3 "on another host": the socket path; 1 and 2 through shared memory
    assert values[0]["remote"] == (3,)
    for r in (1, 2, 3):
        assert values[r]["got"] == N_MESSAGES, values[r]
        assert (
            "closed the queue" in values[r]["closed"]
            and f"read all {N_MESSAGES} message(s)" in values[r]["closed"]
        )
    assert not any(v["leaked"] for v in values)  # unlinked right after setup
    print(
        f"stream: {N_MESSAGES} messages in {max(v['seconds'] for v in values):.2f} s (run "
        f"{time.monotonic() - t0:.1f} s)"
    )


def test_writer_killed_readers_raise_naming_it(tmp_path: Path) -> None:
    values, codes, texts = run("writer_dies", tmp_path)
    assert codes[0] == -9
    killed = float((tmp_path / "killed.txt").read_text())
    for r in (1, 2, 3):
        assert codes[r] == 0, texts[r][-3000:]
        v = values[r]
        assert v["got"] == 300, v  # everything written before the crash arrives: no silent loss
        assert v["type"] == "PeerLostError" and v["peer"] == 0, v
        assert (
            "the writer, rank 0 (axis index 0)" in v["msg"]
            and f"on rank {r}" in v["msg"]
            and "Fix:" in v["msg"]
        )
        assert v["at"] - killed < TIMEOUT + SLACK, v["at"] - killed


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
    assert w["at"] - killed < TIMEOUT + SLACK, w["at"] - killed
    for r in range(1, 4):
        # the survivors got everything the writer sent (and maybe the message it was sending),
        # then the close
        if r != victim:
            assert values[r]["type"] == "QueueClosedError" and values[r]["got"] in (
                w["sent"],
                w["sent"] + 1,
            ), (values[r], w["sent"])


def test_node_locality_single_reader_nonblocking_and_timeouts(tmp_path: Path) -> None:
    values, codes, texts = run("locality", tmp_path)
    _ok(values, codes, texts)
    for r, v in enumerate(values):
        assert (v["local_rank"], v["local_size"], v["nodes"], v["device"]) == (
            r,
            4,
            [[0, 1, 2, 3]],
            "cpu",
        )
        assert v["same_as_0"] == [True] * 4
        assert v["fake_nodes"] == [[0, 1, 2], [3]] and v["fake_local"] == (
            (r, 3) if r < 3 else (0, 1)
        )
    assert values[0]["single"] == [
        None,
        ("hello", 1, True, ("bye", 1)),
        ("hello", 2, True, ("bye", 2)),
        ("hello", 3, True, ("bye", 3)),
    ]
    assert "the message needs 1 slot(s), 0 of 2 are free" in values[0]["full"]
    assert "not a reader" in values[0]["wrong_role"]
    for r in (1, 2, 3):
        v = values[r]
        assert v["read"] == [1, 2, 4]
        assert "no message" in v["empty"]
        assert "the writer, rank 0, sent nothing" in v["timeout"] and 0.25 < v["timeout_s"] < 2.0, v


def test_enqueue_per_call_timeout_names_the_reader_that_does_not_read(tmp_path: Path) -> None:
    values, codes, texts = run("enqueue_timeout", tmp_path)
    _ok(values, codes, texts)
    w = values[0]
    # A: the ring is full before the message: CollectiveTimeout naming rank 2 (not rank 1, which
    # read), nothing sent, the queue goes on
    assert "no free slot: reader(s) rank 2 still hold the oldest of 2 slots" in w["shm"], w["shm"]
    assert (
        f"within the timeout ({SHORT:g} s)" in w["shm"]
        and "Fix:" in w["shm"]
        and "reader(s) rank 1" not in w["shm"]
    )
    assert SHORT <= w["shm_s"] < SHORT + 1.0, w["shm_s"]
    for r in (1, 2):
        # the timed-out message never arrives; the next one does
        assert values[r]["read"] == ["m0", "m1", "m2"], values[r]
        assert "read all 3 message(s)" in values[r]["after_close"], values[r]
    # B: a socket reader that does not read a 128 MB message: timeout naming rank 3; the stream is
    # cut, so the queue refuses more
    assert "the remote reader rank 3 did not take the message within the timeout" in w["sock"], w[
        "sock"
    ]
    assert SHORT <= w["sock_s"] < SHORT + 1.0, w["sock_s"]
    assert (
        w["sock_broken_type"] == "CommError"
        and "an earlier enqueue failed after part of its message went out" in w["sock_broken"]
    )
    assert (
        "CollectiveTimeout in message 1" in w["sock_broken"]
        and "make a new one" in w["sock_broken"]
    )
    # no close frame after a cut: the reader is told of the cut, never handed a partial object
    v3 = values[3]
    assert (
        v3["sock_reader_type"] == "PeerLostError"
        and "in the middle of a message" in v3["sock_reader"]
    ), v3
    # C: the ring fills in the middle of a 5-slot message: timeout naming rank 2; the reader gets an
    # error, not 2 of 5 slots
    assert "no free slot: reader(s) rank 2" in w["cut"] and SHORT <= w["cut_s"] < SHORT + 1.0, (
        w["cut"],
        w["cut_s"],
    )
    v2 = values[2]
    assert (
        v2["cut_reader_type"] == "CommError"
        and "closed the queue in the middle of message 1" in v2["cut_reader"]
    ), v2


@pytest.mark.parametrize("who", [0, 2], ids=["writer", "reader"])
def test_crash_before_readers_attach_leaves_no_segment(who: int, tmp_path: Path) -> None:
    """A rank SIGKILLed in the middle of MessageQueue.create, after the segment exists and before
    the readers attach."""
    # run() also checks /dev/shm once every process exited
    values, codes, texts = run(f"setup_crash:{who}", tmp_path)
    assert codes[who] == -9
    segment = (tmp_path / "segment.txt").read_text()
    assert segment.startswith(shm_ring.SHM_PREFIX) and not os.path.exists(f"/dev/shm/{segment}")
    for r in range(4):
        if r == who:
            continue
        assert codes[r] == 0, texts[r][-3000:]
        v = values[r]
        # an error within the mesh's timeout, not a hang
        assert v["type"] is not None and v["s"] < 10 + 5, v
        assert not v["left"], v  # the surviving writer unlinked its segment at once, not at exit
    if who == 2:
        assert values[0]["made"] == [segment] and values[0]["left"] == []


def test_local_device_cuda_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 9 of torchrun --nnodes 2 --nproc-per-node 8 is local rank 1: cuda:1; a host with fewer
    devices than ranks is a MeshError."""
    import torch

    hosts = ("node-a",) * 8 + ("node-b",) * 8
    info = serving.NodeInfo(
        None, tuple(range(16)), 9, hosts, hosts, tuple((1, None) for _ in range(16))
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert serving.local_device(info) == torch.device("cuda", 1)
    assert serving.local_device(info, "cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(fd_errors.MeshError) as e:
        serving.local_device(info)
    msg = str(e.value)
    assert (
        "rank 9 is local rank 1 of 8 on host 'node-b', which has 1 cuda device(s)" in msg
        and "--nproc-per-node=1" in msg
    ), msg


def test_local_device_npu_branch(tmp_path: Path) -> None:
    """torch_npu stand-in (privateuse1 renamed 'npu', a module with is_available/device_count), in
    a fresh process."""
    code = """
import types, torch
torch.utils.rename_privateuse1_backend("npu")
npu = types.ModuleType("fake_torch_npu")
npu.is_available = lambda: True
npu.device_count = lambda: 4
torch._register_device_module("npu", npu)
torch.cuda.is_available = lambda: False
from fastdist import MeshError
from fastdist import serving
hosts = ("a",) * 8
info = serving.NodeInfo(None, tuple(range(8)), 3, hosts, hosts, tuple((1, None) for _ in range(8)))
print("DEVICE", serving.local_device(info))
try:
    serving.local_device(serving.NodeInfo(None, tuple(range(8)), 5, hosts, hosts, info.pids))
except MeshError as e:
    print("ERROR", e)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DEVICE npu:3" in proc.stdout, proc.stdout
    assert (
        "rank 5 is local rank 5 of 8 on host 'a', which has 4 npu device(s)" in proc.stdout
        and "ASCEND_RT_VISIBLE_DEVICES" in proc.stdout
    ), proc.stdout
