"""Review of fastdist.serving as a serving loop uses it: threads sharing a queue's end, tensors of
every dtype, messages a reader cannot unpickle, timeouts that would never end, misspelt options,
the device of a rank, and the example server's requests.

Each test builds a writer's and a reader's end of one queue in this process (`_ends`: the ring
of shared memory, or a connected socket pair), the same objects ``MessageQueue.create`` makes on
two ranks; ``tests/test_mq.py`` runs the queue across processes. Every test here failed on the
code before its fix (noted in each docstring).
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import fastdist as fd
from fastdist import serving
from fastdist.errors import (
    CollectiveError,
    CollectiveTimeout,
    CommError,
    MeshError,
    QueueClosedError,
    QueueEmpty,
    QueueFull,
)
from fastdist.serving import node as serving_node
from fastdist.serving.checks import check_options
from fastdist.serving.node import pid_start_time
from fastdist.serving.queue import MessageQueue
from fastdist.serving.shm_ring import ShmRing
from fastdist.serving.wire import Encoder

from .dist_harness import load_example

PATHS = ["ring", "socket"]
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


@pytest.fixture
def fast_switch() -> Iterator[None]:
    """Threads switch every microsecond: what a race needs to show within a few hundred
    messages."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _ends(path: str, chunk: int = 256, chunks: int = 4, timeout: float = 10.0) -> Any:
    """A writer's end (axis index 0) and a reader's end (index 1) of one queue in this process,
    over the shared-memory ring or a socket."""
    me = (os.getpid(), pid_start_time(os.getpid()))
    opts: dict[str, Any] = dict(
        op_axis="tp",
        ranks=(0, 1),
        writer=0,
        readers=(1,),
        local=(1,) if path == "ring" else (),
        pids=(me, me),
        max_chunk_bytes=chunk,
        max_chunks=chunks,
        timeout=timeout,
    )
    w, r = MessageQueue(index=0, **opts), MessageQueue(index=1, **opts)
    if path == "ring":
        w._ring = ShmRing.create(1, chunk, chunks)
        r._ring, r._slot = ShmRing.attach(w._ring.name, 1, chunk, chunks), 0
        w._ring.unlink()
    else:
        w._conns[1], r._sock = socket.socketpair()
    return w, r


def _send(w: MessageQueue, r: MessageQueue, obj: Any) -> Any:
    """``obj`` through the queue (read by a thread: a message may be larger than the ring)."""
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(r.dequeue(timeout=10)))
    reader.start()
    w.enqueue(obj, timeout=10)
    reader.join(15)
    assert got, "the reader got nothing"
    return got[0]


# ----------------------------------------------------------------------------- threads
@pytest.mark.parametrize("path", PATHS)
def test_threads_sharing_the_writer_lose_and_repeat_nothing(path: str, fast_switch: None) -> None:
    """Four client threads enqueue on one writer end, messages of one slot and of several (and,
    over the socket, of more than one send): the reader gets each exactly once, each whole.

    Before: no lock. Two threads wrote the same slot (one message lost, another read twice:
    1197 distinct of 1200) or interleaved the fragments of two messages (``UnpicklingError``)."""
    w, r = _ends(path, chunk=64, chunks=64)
    big = "x" * (70_000 if path == "socket" else 150)  # socket: length and body in two sends
    got: list[Any] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for _ in range(4 * 150):
                got.append(r.dequeue(timeout=10))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def client(c: int) -> None:
        try:
            for i in range(150):
                w.enqueue((c, i, big if i % 3 == 0 else "x"), timeout=10)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=read)] + [
        threading.Thread(target=client, args=(c,)) for c in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    w.close()
    r.close()
    assert not errors, errors[0]
    assert sorted(m[:2] for m in got) == [(c, i) for c in range(4) for i in range(150)]
    assert all(m[2] == (big if m[1] % 3 == 0 else "x") for m in got)


@pytest.mark.parametrize("path", PATHS)
def test_threads_sharing_a_reader_each_get_other_messages(path: str, fast_switch: None) -> None:
    """Two threads dequeue from one reader end: together they get every message once.

    Before: both could read the same slot (a message twice, and the ring's count advanced past
    one never read)."""
    w, r = _ends(path, chunk=64, chunks=64)
    got: list[list[Any]] = [[], []]
    errors: list[BaseException] = []

    def read(k: int) -> None:
        try:
            for _ in range(200):
                got[k].append(r.dequeue(timeout=10))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    readers = [threading.Thread(target=read, args=(k,)) for k in range(2)]
    for t in readers:
        t.start()
    for i in range(400):
        w.enqueue((i, "y" * (100 if i % 2 else 1)), timeout=10)
    for t in readers:
        t.join(30)
    w.close()
    r.close()
    assert not errors, errors[0]
    assert sorted(m[0] for m in got[0] + got[1]) == list(range(400))
    for part in got:  # each thread's share in the order written
        assert [m[0] for m in part] == sorted(m[0] for m in part)


# ----------------------------------------------------------------------------- tensors
def _dtypes() -> list[torch.dtype]:
    """Every whole-byte dtype of this torch: those torch's pickling brings back, and those it
    does not (float8 kinds, uint16/32/64, complex32)."""
    names = [
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    ]  # fmt: skip
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (every bit pattern, nan included)."""
    g = torch.Generator().manual_seed(seed)
    size = dtype.itemsize
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=g)
    if dtype is torch.bool:
        return raw % 2 == 1
    return raw.view(dtype)


def _bytes(t: torch.Tensor) -> list[int]:
    return t.contiguous().reshape(-1).view(torch.uint8).tolist()


@pytest.mark.parametrize("path", PATHS)
def test_tensors_of_every_dtype_arrive_equal(path: str) -> None:
    """A message holding tensors of every dtype (float8 kinds, uint16/32/64, complex32 and the
    ones torch's pickling handles), contiguous, transposed, sliced at an offset, expanded, 0-d,
    empty, a conjugate view and a parameter: each arrives with its dtype, shape, strides and
    bytes, on both paths (the ring's message spans several slots).

    Before: ``pickle.loads`` of torch's own pickle of a float8, uint16/32/64 or complex32 tensor
    fails on the reader (``AttributeError: ... UntypedStorage has no attribute 'dtype'``), and
    on the ring the reader was stuck on that message (every later dequeue raised again)."""
    dtypes = _dtypes()
    names = {str(d) for d in dtypes}
    assert {"torch.float8_e4m3fn", "torch.uint16", "torch.complex32", "torch.float64"} <= names
    w, r = _ends(path)
    msg: dict[str, Any] = {}
    for k, d in enumerate(dtypes):
        t = _random(d, (4, 6), k)
        msg[f"{d}"] = t
        msg[f"{d} transposed"] = t.t()
        msg[f"{d} slice"] = t[1:3, 2:]  # a storage offset, a stride of 6
        msg[f"{d} expanded"] = t[2].expand(3, 6)  # a stride of 0
        msg[f"{d} element"] = t[3, 4]  # 0-d, at an offset
        msg[f"{d} empty"] = t[:0]
    msg["complex64 conj"] = torch.complex(torch.arange(4.0), torch.ones(4)).conj()
    msg["complex32 conj"] = msg["torch.complex32"].conj()
    msg["float8 grad"] = _random(torch.float8_e5m2, (3,), 0).requires_grad_()
    msg["float8 parameter"] = torch.nn.Parameter(_random(torch.float8_e4m3fn, (2, 2), 1))
    got = _send(w, r, msg)
    assert got.keys() == msg.keys()
    for key, want in msg.items():
        have = got[key]
        assert (type(have), have.dtype, have.shape) == (type(want), want.dtype, want.shape), key
        assert have.requires_grad == want.requires_grad, key
        if want.is_conj():
            assert _bytes(have.resolve_conj()) == _bytes(want.resolve_conj()), key
        else:
            assert have.stride() == want.stride(), key
            assert _bytes(have) == _bytes(want), key
    w.close()
    r.close()


@pytest.mark.parametrize("path", PATHS)
def test_messages_at_slot_boundaries_arrive_whole(path: str) -> None:
    """Pickles of one byte less, exactly, and one byte more than 1, 2, 4 and 9 slots (the ring
    has 4: it wraps around many times, and a message larger than it streams through)."""
    w, r = _ends(path, chunk=64, chunks=4)
    enc = Encoder()
    for slots in (1, 2, 4, 9):
        for target in (64 * slots - 1, 64 * slots, 64 * slots + 1):
            n = next(n for n in range(2000) if len(enc.dumps(b"q" * n)) >= target)
            assert len(enc.dumps(b"q" * n)) == target
            assert _send(w, r, b"q" * n) == b"q" * n
    w.close()
    r.close()


def test_an_object_that_does_not_pickle_sends_nothing() -> None:
    """``enqueue`` of an unpicklable object raises the pickling error having sent nothing (the
    writer's pickler, kept between messages, starts afresh); the next message arrives alone.
    A view of the last message still held (an error's traceback) does not stop the next."""
    w, r = _ends("ring")
    with pytest.raises((pickle.PicklingError, AttributeError)):
        w.enqueue(["half", lambda: 1])
    w.enqueue("whole")
    held = w._encoder.dumps("held")  # a view of the encoder's buffer, not released
    w.enqueue({"next": 1})
    assert (r.dequeue(timeout=5), r.dequeue(timeout=5)) == ("whole", {"next": 1})
    assert pickle.loads(held) == "held"
    with pytest.raises(QueueEmpty):
        r.dequeue(block=False)
    w.close()
    r.close()


# ----------------------------------------------------------------------------- bad messages
class _NotOnReaders:
    """Pickles on the writer; unpickling raises (as a class only the writer can import does)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (int, ("not a number",))


@pytest.mark.parametrize("path,size", [("ring", 10), ("ring", 1000), ("socket", 10)])
def test_a_message_the_reader_cannot_unpickle_leaves_the_queue(path: str, size: int) -> None:
    """A message that does not unpickle on the reader raises a ``CommError`` naming the message
    and the cause, and the next dequeue returns the next message (one slot, several slots, a
    socket alike).

    Before: on the ring, a message of one slot raised the bare ``ValueError`` and stayed in its
    slot: every later dequeue raised it again, and the writer stalled once the ring filled."""
    w, r = _ends(path, chunk=256, chunks=8)
    w.enqueue([_NotOnReaders(), "p" * size])
    w.enqueue("the next one")
    with pytest.raises(CommError) as e:
        r.dequeue(timeout=5)
    msg = str(e.value)
    assert "message 1 from the writer, rank 0, could not be unpickled" in msg, msg
    assert "ValueError" in msg and "the next dequeue returns the message after it" in msg, msg
    assert r.dequeue(timeout=5) == "the next one"
    for i in range(20):  # the ring goes on (8 slots)
        w.enqueue(i, timeout=5)
        assert r.dequeue(timeout=5) == i
    w.close()
    r.close()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, 1e12])
def test_timeouts_that_never_end_are_refused(path: str, bad: float) -> None:
    """A per-call timeout of nan, inf or past what a socket can wait is refused at once (and at
    setup, by the options' check).

    Before: ``dequeue(timeout=nan)`` on the ring waited forever (``now >= nan`` is never true);
    on a socket nan raised a bare ``ValueError`` and inf or 1e12 an ``OverflowError``; setup
    accepted all three."""
    w, r = _ends(path)
    out: list[BaseException] = []

    def call() -> None:
        try:
            r.dequeue(timeout=bad)
        except BaseException as e:  # noqa: BLE001 - checked below
            out.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(3)
    assert out, f"dequeue(timeout={bad}) still waits after 3 s"
    assert isinstance(out[0], MeshError) and "finite" in str(out[0]), out[0]
    with pytest.raises(MeshError, match="finite"):
        w.enqueue("m", timeout=bad)
    with pytest.raises(CollectiveError, match="finite"):
        check_options("MessageQueue.create", "tp", 1024, 4, bad)
    w.close()
    r.close()


def test_a_message_larger_than_the_ring_without_blocking_says_it_never_fits() -> None:
    """``enqueue(block=False)`` of a message needing more slots than the ring has: ``QueueFull``
    saying no retry places it (before: "a reader is behind ... retry later", forever)."""
    w, r = _ends("ring", chunk=64, chunks=2)
    with pytest.raises(QueueFull, match="more than the ring's 2, so it never goes out at once"):
        w.enqueue("z" * 1000, block=False)
    w.enqueue("small", block=False)
    assert r.dequeue(timeout=5) == "small"
    w.close()
    r.close()


def test_a_thread_waiting_its_turn_times_out_naming_it() -> None:
    """A second thread's enqueue waits for the first's (which waits for a full ring) within its
    own timeout, then raises ``CollectiveTimeout`` saying another thread holds the queue
    (``block=False``: ``QueueFull`` at once); the first's message goes out once the ring has
    room."""
    w, r = _ends("ring", chunk=64, chunks=1)
    w.enqueue("fills the ring")
    first = threading.Thread(target=w.enqueue, args=("a",))  # waits for the slot
    first.start()
    while not w._lock.locked():
        pass
    with pytest.raises(CollectiveTimeout, match="another thread of this rank was still in"):
        w.enqueue("b", timeout=0.2)
    with pytest.raises(QueueFull, match="another thread of this rank is sending"):
        w.enqueue("b", block=False)
    assert r.dequeue(timeout=5) == "fills the ring"
    first.join(15)
    assert r.dequeue(timeout=5) == "a"
    w.close()
    r.close()


@pytest.mark.parametrize("who", ["ring reader", "socket reader", "ring writer"])
def test_close_from_another_thread_ends_a_waiting_call(who: str) -> None:
    """A thread waits in ``dequeue`` (nothing sent) or ``enqueue`` (the ring full) with a 30 s
    timeout; another thread of the rank closes that end: the waiting call raises
    ``QueueClosedError`` at once, and ``close`` returns within a second.

    Before: ``close`` let go of the ring under the waiting call, which failed with a bare
    ``AssertionError`` ("the ring was closed"); a socket reader waited out its timeout."""
    w, r = _ends("socket" if who == "socket reader" else "ring", chunk=64, chunks=1)
    end = w if who == "ring writer" else r
    if who == "ring writer":
        w.enqueue("fills the ring")
    out: list[BaseException] = []

    def call() -> None:
        try:
            end.enqueue("waits", timeout=30) if end is w else r.dequeue(timeout=30)
        except BaseException as e:  # noqa: BLE001 - checked below
            out.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    while not end._lock.locked():
        pass
    t0 = time.monotonic()
    end.close()
    t.join(5)
    assert time.monotonic() - t0 < 1.5
    assert out and isinstance(out[0], QueueClosedError), out
    assert "this rank closed the queue (in another thread) while this call waited" in str(out[0])
    (r if end is w else w).close()


# ----------------------------------------------------------------------------- setup
def _stub_mesh(rank: int) -> Any:
    """A dp=2 x tp=2 mesh as the setup sees it (backed, this rank, its groups): enough for the
    checks that run before any collective."""
    m = fd.Mesh({"dp": 2, "tp": 2})
    return SimpleNamespace(
        backend="gloo",
        rank=rank,
        size=m.size,
        axis_names=m.axis_names,
        group=lambda r, axis: m.group(r, axis),
    )


def test_single_reader_broadcasters_refuse_an_unknown_option() -> None:
    """A misspelt option of ``create_single_reader_mq_broadcasters`` is refused before the
    setup (before: dropped, its default silently in force, e.g. a 60 s timeout for
    ``timout=5``)."""
    with pytest.raises(CollectiveError, match=r"unknown option\(s\) \['timout'\]"):
        serving.create_single_reader_mq_broadcasters(_stub_mesh(0), "tp", timout=5)


def test_local_device_refuses_the_node_info_of_one_axis(monkeypatch: pytest.MonkeyPatch) -> None:
    """dp=2 x tp=2 on one host with 4 GPUs: ``local_device(node_info(mesh, "tp"))`` would give
    global rank 2 (dp 1, tp 0) ``cuda:0``, global rank 0's device; it raises, naming
    ``node_info(mesh)``, which gives ``cuda:2``."""

    def gather(obj: Any, mesh: Any, axis: Any) -> list[Any]:  # every rank on this host
        ranks = mesh.group(mesh.rank, mesh.axis_names if axis is None else axis)
        return [(obj[0], obj[1], 1000 + r, None) for r in ranks]

    monkeypatch.setattr(serving_node, "all_gather_object", gather)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    mesh = _stub_mesh(2)
    assert serving.local_device(serving.node_info(mesh)) == torch.device("cuda", 2)
    part = serving.node_info(mesh, "tp")
    assert (part.local_rank, part.whole_mesh) == (0, False)
    with pytest.raises(MeshError, match=r"covers axis 'tp' only .* pass node_info\(mesh\)"):
        serving.local_device(part)


# ----------------------------------------------------------------------------- the example
def test_the_example_server_refuses_requests_it_cannot_serve() -> None:
    """examples/serve.py: a request for 0 new tokens (``generate`` refuses it; the loop's
    prefill makes a token and its stop rule ``len == max_new_tokens`` never held again: it
    decoded forever), an empty prompt or a token outside the vocabulary is refused when the
    scheduler is made; a request for 1 token finishes at its prefill."""
    ex = load_example("serve.py", "serve_review_example")
    for bad, why in [
        (ex.Request(0, 0, [1, 2], 0), "max_new_tokens=0 must be at least 1"),
        (ex.Request(0, 0, [], 3), r"prompt \[\] must be 1 or more token ids"),
        (ex.Request(0, 0, [1, ex.VOCAB], 3), "must be 1 or more token ids in"),
    ]:
        with pytest.raises(ValueError, match=why):
            ex.Scheduler([bad], 2, None)
    sched = ex.Scheduler([ex.Request(0, 0, [1, 2], 1)], 2, None)
    step = sched.next_step()
    assert step is not None and step["prefill"] == [(0, [1, 2])]
    sched.update(step, {0: torch.arange(float(ex.VOCAB))})
    assert [r.tokens for r in sched.finished] == [[ex.VOCAB - 1]]
    assert sched.next_step() is None
