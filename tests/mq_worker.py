"""One rank of a tests/test_mq.py scenario: ``python -m tests.mq_worker SCENARIO RANK WORLD
STORE_PORT OUT_DIR``.

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
from fastdist import serving

N_MESSAGES = 10_000
TIMEOUT = 3.0  # the queues' per-call timeout in the failure scenarios


def sizes(n: int, seed: int = 0) -> list[int]:
    """Mixed sizes, bytes to MBs: mostly small, every 100th 10-300 KB, every 1000th 1-3 MB (larger
    than a slot)."""
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


SHORT = 0.5  # the per-call timeout of the enqueue-timeout scenario
# more than loopback TCP buffers hold (tcp_wmem + tcp_rmem maxima are a few tens of MB)
BIG = 128 << 20


def _mesh(timeout: float = 30) -> fd.Mesh:
    return fd.connect(tp=dist.get_world_size(), timeout=timeout)


def _nodes(mesh: fd.Mesh, rank: int, remote: int | None) -> serving.NodeInfo:
    """Pretend ``remote`` runs on another host (so it reads over the socket)."""
    return serving.node_info(mesh, "tp", hostname="host-b" if rank == remote else "host-a")


def stream(rank: int, out: Path) -> Any:
    """10,000 mixed messages; readers 1, 2 through shared memory, reader 3 through the socket."""
    mesh = _mesh()
    q = serving.MessageQueue.create(
        mesh,
        "tp",
        writer=0,
        nodes=_nodes(mesh, rank, 3),
        max_chunk_bytes=1 << 20,
        max_chunks=8,
        timeout=30,
    )
    # unlinked once every local reader attached
    leaked = q.shm_name is not None and os.path.exists(f"/dev/shm/{q.shm_name}")
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
            assert len(data) == s and data == payload(i, s), (
                f"rank {rank}: message {i} has wrong contents"
            )
            got += 1
        try:
            q.dequeue(timeout=10)
            closed = "no error"
        except serving.QueueClosedError as e:
            closed = str(e)
        q.close()
    return {
        "got": got,
        "seconds": time.perf_counter() - t0,
        "leaked": leaked,
        "closed": closed,
        "remote": q.remote_readers,
        "pid": os.getpid(),
        "shm": q.shm_name,
    }


def writer_dies(rank: int, out: Path) -> Any:
    """The writer SIGKILLs itself after 300 messages; every reader must get all 300, then
    PeerLostError naming rank 0."""
    mesh = _mesh()
    q = serving.MessageQueue.create(
        mesh,
        "tp",
        writer=0,
        nodes=_nodes(mesh, rank, 3),
        max_chunks=4,
        max_chunk_bytes=4096,
        timeout=TIMEOUT,
    )
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
        return {
            "got": got,
            "type": type(e).__name__,
            "msg": str(e),
            "at": time.time(),
            "peer": getattr(e, "peer", None),
        }


def reader_dies(rank: int, out: Path, victim: int) -> Any:
    """Reader ``victim`` SIGKILLs itself after 50 messages; the writer must raise PeerLostError
    naming it."""
    mesh = _mesh()
    q = serving.MessageQueue.create(
        mesh,
        "tp",
        writer=0,
        nodes=_nodes(mesh, rank, 3),
        max_chunks=4,
        max_chunk_bytes=4096,
        timeout=TIMEOUT,
    )
    if q.is_writer:
        sent = 0
        try:
            while sent < 1_000_000:
                q.enqueue((sent, payload(sent, 1000)))
                sent += 1
            result: Any = {"sent": sent, "type": None}
        except fd.FastdistError as e:
            result = {
                "sent": sent,
                "type": type(e).__name__,
                "msg": str(e),
                "at": time.time(),
                "peer": getattr(e, "peer", None),
            }
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
    except serving.QueueClosedError:
        return {"got": got, "type": "QueueClosedError"}


def locality(rank: int, out: Path) -> Any:
    """node_info / local_device on one host; the single-reader variant; non-blocking modes; a
    per-call timeout."""
    mesh = _mesh()
    info = serving.node_info(mesh)
    res: dict[str, Any] = {
        "local_rank": info.local_rank,
        "local_size": info.local_size,
        "nodes": info.nodes,
        "single_host": info.single_host,
        "device": str(serving.local_device(info)),
        "same_as_0": info.same_host_as(0),
    }
    fake = _nodes(mesh, rank, 3)
    res["fake_nodes"], res["fake_local"] = fake.nodes, (fake.local_rank, fake.local_size)
    # single reader: ranks 1..3 each write to rank 0 (rank 3 over the socket); one message larger
    # than a slot
    mine, theirs = serving.create_single_reader_mq_broadcasters(
        mesh, "tp", reader=0, nodes=fake, max_chunk_bytes=1024, max_chunks=2, timeout=20
    )
    if mine is not None:
        mine.enqueue(("hello", rank, payload(rank, 5000)))
        mine.enqueue(("bye", rank))
        mine.close()
    else:
        res["single"] = [(q.dequeue(), q.dequeue()) if q is not None else None for q in theirs]
        res["single"] = [
            None if v is None else (v[0][0], v[0][1], v[0][2] == payload(v[0][1], 5000), v[1])
            for v in res["single"]
        ]
        for q in theirs:
            if q is not None:
                q.close()
    # non-blocking and timeouts
    q = serving.MessageQueue.create(
        mesh, "tp", writer=0, nodes=fake, max_chunks=2, max_chunk_bytes=1024, timeout=20
    )
    fd.comm.barrier(mesh)
    if q.is_reader:
        try:
            q.dequeue(block=False)
            res["empty"] = "no error"
        except serving.QueueEmpty as e:
            res["empty"] = str(e)
        t0 = time.monotonic()
        try:
            q.dequeue(timeout=0.3)
            res["timeout"] = "no error"
        except fd.CollectiveTimeout as e:
            res["timeout"], res["timeout_s"] = str(e), time.monotonic() - t0
    fd.comm.barrier(mesh)
    if q.is_writer:
        q.enqueue(1, block=False)
        q.enqueue(2, block=False)
        try:
            q.enqueue(3, block=False)
            res["full"] = "no error"
        except serving.QueueFull as e:
            res["full"] = str(e)
        try:
            q.dequeue()
        except fd.CollectiveError as e:
            res["wrong_role"] = str(e)
    fd.comm.barrier(mesh)
    if q.is_reader:
        res["read"] = [q.dequeue(), q.dequeue()]
    fd.comm.barrier(mesh)
    q.enqueue(4) if q.is_writer else res.setdefault("read", []).append(q.broadcast_object())
    q.close()
    return res


def enqueue_timeout(rank: int, out: Path) -> Any:
    """A reader that does not read: the writer's enqueue(timeout=SHORT) raises CollectiveTimeout
    naming it.

    A: shared memory, the ring full before the message: nothing sent, the queue goes on.
    B: a socket reader, a message larger than the socket buffers: cut off, the queue is unusable.
    C: shared memory, the ring fills in the middle of a multi-slot message: cut off, likewise.
    """
    mesh = _mesh()
    res: dict[str, Any] = {}
    same = serving.node_info(mesh, "tp")
    q = serving.MessageQueue.create(
        mesh,
        "tp",
        writer=0,
        readers=[1, 2],
        nodes=same,
        max_chunks=2,
        max_chunk_bytes=1024,
        timeout=20,
    )
    if q.is_writer:
        q.enqueue("m0")
        q.enqueue("m1")
    elif rank == 1:
        res["read"] = [q.dequeue(), q.dequeue()]
    fd.comm.barrier(mesh)  # reader 1 read both; reader 2 read nothing: both slots are held
    if q.is_writer:
        t0 = time.monotonic()
        try:
            q.enqueue("never sent", timeout=SHORT)
            res["shm"] = "no error"
        except fd.CollectiveTimeout as e:
            res["shm"], res["shm_s"] = str(e), time.monotonic() - t0
    fd.comm.barrier(mesh)
    if rank == 2:
        res["read"] = [q.dequeue(), q.dequeue()]
    fd.comm.barrier(mesh)
    if q.is_writer:
        q.enqueue("m2")  # the queue goes on after a timeout that sent nothing
    elif q.is_reader:
        res["read"].append(q.dequeue())
        try:
            q.dequeue(timeout=20)
        except serving.QueueClosedError as e:
            res["after_close"] = str(e)
    q.close()
    # B: reader 3 on "another host" does not read a message larger than the socket buffers
    fake = _nodes(mesh, rank, 3)
    q = serving.MessageQueue.create(mesh, "tp", writer=0, readers=[3], nodes=fake, timeout=20)
    if q.is_writer:
        big = bytes(BIG)
        t0 = time.monotonic()
        try:
            q.enqueue(big, timeout=SHORT)
            res["sock"] = "no error"
        except fd.CollectiveTimeout as e:
            res["sock"], res["sock_s"] = str(e), time.monotonic() - t0
        del big
        try:
            q.enqueue("after the cut")
            res["sock_broken"] = "no error"
        except fd.CommError as e:
            res["sock_broken"], res["sock_broken_type"] = str(e), type(e).__name__
    _close_then_read(mesh, q, res, "sock_reader")
    # C: shared memory, a 5-slot message into a 2-slot ring that reader 2 does not drain
    q = serving.MessageQueue.create(
        mesh,
        "tp",
        writer=0,
        readers=[2],
        nodes=same,
        max_chunks=2,
        max_chunk_bytes=1024,
        timeout=20,
    )
    if q.is_writer:
        t0 = time.monotonic()
        try:
            q.enqueue(bytes(5000), timeout=SHORT)
            res["cut"] = "no error"
        except fd.CollectiveTimeout as e:
            res["cut"], res["cut_s"] = str(e), time.monotonic() - t0
    _close_then_read(mesh, q, res, "cut_reader")
    return res


def _close_then_read(mesh: Any, q: Any, res: dict[str, Any], key: str) -> None:
    """After a cut-off message: the writer closes; the reader's next dequeue must raise (recorded
    under ``key``)."""
    fd.comm.barrier(mesh)
    if q.is_writer:
        q.close()
    elif q.is_reader:
        try:
            q.dequeue(timeout=20)
            res[key] = "no error"
        except fd.FastdistError as e:
            res[key], res[f"{key}_type"] = str(e), type(e).__name__
        q.close()


def setup_crash(rank: int, out: Path, who: int) -> Any:
    """Rank ``who`` (0: the writer, 2: a shared-memory reader) SIGKILLs itself in the middle of
    MessageQueue.create, after the writer made the segment and before the readers attached."""
    from multiprocessing import shared_memory

    mesh = _mesh(timeout=10)
    nodes = _nodes(mesh, rank, 3)
    made: list[str] = []

    class Recorded(shared_memory.SharedMemory):
        def __init__(self, name: str | None = None, create: bool = False, size: int = 0) -> None:
            super().__init__(name=name, create=create, size=size)
            if create:
                made.append(self.name)
                (out / "segment.txt").write_text(self.name)

    shared_memory.SharedMemory = Recorded  # type: ignore[misc]
    if rank == who == 2:
        (out / "killed.txt").write_text(repr(time.time()))
        # before attaching (the writer makes its segment, then finds this rank gone)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == who == 0:
        import fastdist.serving.queue as D

        real = D.all_gather_object

        def dies_after_making_the_segment(obj: Any, *a: Any, **k: Any) -> Any:
            if made:  # the segment exists; no reader has attached yet
                (out / "killed.txt").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return real(obj, *a, **k)

        D.all_gather_object = dies_after_making_the_segment  # type: ignore[assignment]
    t0 = time.monotonic()
    try:
        serving.MessageQueue.create(
            mesh, "tp", writer=0, nodes=nodes, max_chunks=2, max_chunk_bytes=1024, timeout=5
        )
        res: dict[str, Any] = {"type": None}
    except Exception as e:  # noqa: BLE001
        res = {"type": type(e).__name__, "msg": str(e)}
    res["s"] = time.monotonic() - t0
    res["made"] = made
    # checked while this process still runs
    res["left"] = [n for n in made if os.path.exists(f"/dev/shm/{n}")]
    return res


def main() -> None:
    scenario, rank, world, port, out = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        Path(sys.argv[5]),
    )
    torch.set_num_threads(1)
    limit = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=limit)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=limit)
    name, _, arg = scenario.partition(":")
    fn = {
        "stream": stream,
        "writer_dies": writer_dies,
        "reader_dies": reader_dies,
        "locality": locality,
        "enqueue_timeout": enqueue_timeout,
        "setup_crash": setup_crash,
    }[name]
    value = fn(rank, out, int(arg)) if arg else fn(rank, out)
    (out / f"{rank}.pkl").write_bytes(pickle.dumps(value))
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown: peers may be gone


if __name__ == "__main__":
    main()
