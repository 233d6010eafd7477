"""One rank of a tests/test_mq.py scenario: ``python -m tests.mq_worker SCENARIO RANK WORLD STORE_PORT OUT_DIR``.

Each rank joins a gloo job through the parent's TCPStore, runs the scenario and pickles its
result to ``OUT_DIR/<rank>.pkl`` (a rank that kills itself writes ``OUT_DIR/killed.txt``).
"""

from __future__ import annotations

import datetime
import os
import pickle
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fastdist as fd
from fastdist import mq

N_MESSAGES = 10_000
TIMEOUT = 3.0  # the queues' per-call timeout in the failure scenarios


def sizes(n: int, seed: int = 0) -> list[int]:
    """Mixed sizes, bytes to MBs: mostly small, every 100th 10-300 KB, every 1000th 1-3 MB (larger than a slot)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 1000 == 999:
            out.append(rng.randint(1 << 20, 3 << 20))
        elif i % 100 == 50:
            out.append(rng.randint(10_000, 300_000))
        else:
            out.append(rng.randint(0, 2000))
    return out


def payload(i: int, size: int) -> bytes:
    return bytes([i % 251]) * size


def _mesh() -> fd.Mesh:
    return fd.Mesh.from_torch(tp=dist.get_world_size(), timeout=30)


def _nodes(mesh: fd.Mesh, rank: int, remote: int | None) -> mq.NodeInfo:
    """Pretend ``remote`` runs on another host (so it reads over the socket)."""
    return mq.node_info(mesh, "tp", hostname="host-b" if rank == remote else "host-a")


def stream(rank: int, out: Path) -> Any:
    """10,000 mixed messages; readers 1, 2 through shared memory, reader 3 through the socket."""
    mesh = _mesh()
    q = mq.MessageQueue.create(mesh, "tp", writer=0, nodes=_nodes(mesh, rank, 3), max_chunk_bytes=1 << 20, max_chunks=8, timeout=30)
    leaked = q.shm_name is not None and os.path.exists(f"/dev/shm/{q.shm_name}")  # unlinked once every local reader attached
    sz = sizes(N_MESSAGES)
    t0 = time.perf_counter()
    got = 0
    if q.is_writer:
        for i, s in enumerate(sz):
            q.enqueue((i, payload(i, s)))
        q.close()
        closed = None
    else:
        for i, s in enumerate(sz):
            j, data = q.dequeue()
            assert j == i, f"rank {rank}: message {j} arrived where {i} was due"
            assert len(data) == s and data == payload(i, s), f"rank {rank}: message {i} has wrong contents"
            got += 1
        try:
            q.dequeue(timeout=10)
            closed = "no error"
        except mq.QueueClosedError as e:
            closed = str(e)
        q.close()
    return {"got": got, "seconds": time.perf_counter() - t0, "leaked": leaked, "closed": closed, "remote": q.remote_readers, "pid": os.getpid(),
            "shm": q.shm_name}


def writer_dies(rank: int, out: Path) -> Any:
    """The writer SIGKILLs itself after 300 messages; every reader must get all 300, then PeerLostError naming rank 0."""
    mesh = _mesh()
    q = mq.MessageQueue.create(mesh, "tp", writer=0, nodes=_nodes(mesh, rank, 3), max_chunks=4, max_chunk_bytes=4096, timeout=TIMEOUT)
    if q.is_writer:
        for i in range(300):
            q.enqueue((i, payload(i, 3000 if i % 7 else 9000)))  # some span several slots
        (out / "killed.txt").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    got = 0
    try:
        while True:
            i, data = q.dequeue()
            assert i == got and data == payload(i, 3000 if i % 7 else 9000)
            got += 1
    except fd.FastdistError as e:
        return {"got": got, "type": type(e).__name__, "msg": str(e), "at": time.time(), "peer": getattr(e, "peer", None)}


def reader_dies(rank: int, out: Path, victim: int) -> Any:
    """Reader ``victim`` SIGKILLs itself after 50 messages; the writer must raise PeerLostError naming it."""
    mesh = _mesh()
    q = mq.MessageQueue.create(mesh, "tp", writer=0, nodes=_nodes(mesh, rank, 3), max_chunks=4, max_chunk_bytes=4096, timeout=TIMEOUT)
    if q.is_writer:
        sent = 0
        try:
            while sent < 1_000_000:
                q.enqueue((sent, payload(sent, 1000)))
                sent += 1
            result: Any = {"sent": sent, "type": None}
        except fd.FastdistError as e:
            result = {"sent": sent, "type": type(e).__name__, "msg": str(e), "at": time.time(), "peer": getattr(e, "peer", None)}
        q.close()
        return result
    got = 0
    try:
        while True:
            i, _ = q.dequeue(timeout=30)
            assert i == got
            got += 1
            if rank == victim and got == 50:
                (out / "killed.txt").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
    except mq.QueueClosedError:
        return {"got": got, "type": "QueueClosedError"}


def locality(rank: int, out: Path) -> Any:
    """node_info / local_device on one host; the single-reader variant; non-blocking modes; a per-call timeout."""
    mesh = _mesh()
    info = mq.node_info(mesh)
    res: dict[str, Any] = {"local_rank": info.local_rank, "local_size": info.local_size, "nodes": info.nodes, "single_host": info.single_host,
                           "device": str(mq.local_device(info)), "same_as_0": info.same_host_as(0)}
    fake = _nodes(mesh, rank, 3)
    res["fake_nodes"], res["fake_local"] = fake.nodes, (fake.local_rank, fake.local_size)
    # single reader: ranks 1..3 each write to rank 0 (rank 3 over the socket); one message larger than a slot
    mine, theirs = mq.create_single_reader_mq_broadcasters(mesh, "tp", reader=0, nodes=fake, max_chunk_bytes=1024, max_chunks=2, timeout=20)
    if mine is not None:
        mine.enqueue(("hello", rank, payload(rank, 5000)))
        mine.enqueue(("bye", rank))
        mine.close()
    else:
        res["single"] = [(q.dequeue(), q.dequeue()) if q is not None else None for q in theirs]
        res["single"] = [None if v is None else (v[0][0], v[0][1], v[0][2] == payload(v[0][1], 5000), v[1]) for v in res["single"]]
        for q in theirs:
            if q is not None:
                q.close()
    # non-blocking and timeouts
    q = mq.MessageQueue.create(mesh, "tp", writer=0, nodes=fake, max_chunks=2, max_chunk_bytes=1024, timeout=20)
    fd.barrier(mesh)
    if q.is_reader:
        try:
            q.dequeue(block=False)
            res["empty"] = "no error"
        except mq.QueueEmpty as e:
            res["empty"] = str(e)
        t0 = time.monotonic()
        try:
            q.dequeue(timeout=0.3)
            res["timeout"] = "no error"
        except fd.CollectiveTimeout as e:
            res["timeout"], res["timeout_s"] = str(e), time.monotonic() - t0
    fd.barrier(mesh)
    if q.is_writer:
        q.enqueue(1, block=False)
        q.enqueue(2, block=False)
        try:
            q.enqueue(3, block=False)
            res["full"] = "no error"
        except mq.QueueFull as e:
            res["full"] = str(e)
        try:
            q.dequeue()
        except fd.CollectiveError as e:
            res["wrong_role"] = str(e)
    fd.barrier(mesh)
    if q.is_reader:
        res["read"] = [q.dequeue(), q.dequeue()]
    fd.barrier(mesh)
    q.enqueue(4) if q.is_writer else res.setdefault("read", []).append(q.broadcast_object())
    q.close()
    return res


def main() -> None:
    scenario, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    torch.set_num_threads(1)
    limit = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=limit)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=limit)
    name, _, arg = scenario.partition(":")
    fn = {"stream": stream, "writer_dies": writer_dies, "reader_dies": reader_dies, "locality": locality}[name]
    value = fn(rank, out, int(arg)) if arg else fn(rank, out)
    (out / f"{rank}.pkl").write_bytes(pickle.dumps(value))
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown: peers may be gone


if __name__ == "__main__":
    main()
