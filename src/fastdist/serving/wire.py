"""The wire under :class:`~fastdist.serving.MessageQueue`: how a message's bytes move and how
waiting for them fails.

:class:`QueueWire` holds a queue's ends (the shared-memory ring of
:mod:`fastdist.serving.shm_ring`, the sockets of :mod:`fastdist.serving.sockets`) and moves one
pickled message over them: the writer's side in fragments of one slot each, every fragment
written once its slot is free and published by the ring's count, and as a length frame then the
bytes on each remote reader's socket; a reader's side the other way round. Every wait polls with
a deadline, checks every 50 ms that the peers it waits for still run, and fails with an error that
names the op, the axis, this rank and the peer. One call of an end runs at a time (threads of a
rank take turns). An :class:`~fastdist.comm.pickling.Encoder` pickles the writer's messages (a
tensor torch's own pickling cannot bring back travels as its bytes), and
:func:`~fastdist.comm.pickling.loads` unpickles them; a reader's unpickling error is the queue's
``CommError``, the message having left the queue. :class:`~fastdist.serving.MessageQueue` (its
public calls, its roles and its collective setup) builds on it.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from fastdist.comm.pickling import Encoder, loads, rebuild_tensor
from fastdist.errors import (
    CollectiveTimeout,
    CommError,
    PeerLostError,
    QueueClosedError,
    QueueEmpty,
    QueueFull,
)
from fastdist.serving.node import pid_alive
from fastdist.serving.shm_ring import ShmRing, fence
from fastdist.serving.sockets import CLOSE, COALESCE, FRAME, is_open

# Encoder and rebuild_tensor live in fastdist.comm.pickling (shared with the object collectives)
__all__ = ["Encoder", "QueueWire", "rebuild_tensor"]

_SPIN_S = 2e-4  # wait by yielding the CPU this long, then sleep in growing steps
_MAX_SLEEP_S = 1e-3
_CHECK_S = 0.05  # how often a waiting side checks that the peers it waits for are alive


class QueueWire:
    """A message queue's ends and the moving of one message's bytes over them (the writer's
    ring fragments and socket frames, a reader's), with the waits and errors of both.

    Contract: every wait ends by its deadline; a peer found gone raises
    :class:`~fastdist.errors.PeerLostError` naming it, a live peer that does not keep up
    :class:`~fastdist.CollectiveTimeout`. The public calls (``enqueue``, ``dequeue``, ``close``)
    and the setup are :class:`~fastdist.serving.MessageQueue`'s, which subclasses it; build one
    with ``MessageQueue.create``.
    """

    def __init__(
        self,
        *,
        op_axis: Any,
        ranks: tuple[int, ...],
        index: int,
        writer: int,
        readers: tuple[int, ...],
        local: tuple[int, ...],
        pids: tuple[tuple[int, int | None], ...],
        max_chunk_bytes: int,
        max_chunks: int,
        timeout: float,
    ) -> None:
        """A queue's state with no end made yet (``MessageQueue.create`` makes them).

        Args:
            op_axis: the axis the errors name.
            ranks: the axis group's global ranks, in axis order.
            index: this rank's index along the axis.
            writer: the writer's index.
            readers: the readers' indices.
            local: the readers on the writer's host (they read the ring), in slot order.
            pids: each index's process id and start time (the liveness checks of local peers).
            max_chunk_bytes: the size of one slot of the ring.
            max_chunks: how many slots the ring has.
            timeout: seconds each call waits by default.
        """
        self.axis, self.ranks, self.index, self.writer = op_axis, ranks, index, writer
        self.readers = readers
        self.local_readers = local  # axis indices reading through shared memory, slot order
        self.remote_readers = tuple(r for r in readers if r not in local)
        self.max_chunk_bytes, self.max_chunks, self.timeout = (
            max_chunk_bytes,
            max_chunks,
            float(timeout),
        )
        self._pids = pids
        self._ring: ShmRing | None = None
        # the segment's name (already unlinked once create returns)
        self.shm_name: str | None = None
        self._slot = -1  # this reader's slot among local readers
        self._count = 0  # fragments written (writer) or read (local reader)
        self._messages = 0  # messages written or read
        self._listener: socket.socket | None = None
        self._conns: dict[int, socket.socket] = {}  # writer: remote reader index -> socket
        self._sock: socket.socket | None = None  # remote reader: the socket to the writer
        self._closed = False
        # writer: why an enqueue failed after part of its message went out (the queue is then
        # unusable)
        self._broken = ""
        self._last_check = time.monotonic()
        self._call_timeout = self.timeout  # the running call's timeout (for messages)
        # one enqueue / dequeue at a time: threads of this rank sharing the queue take turns (two
        # writes at once would fill one slot twice, two reads read one message twice)
        self._lock = threading.Lock()
        self._encoder = Encoder()

    # ------------------------------------------------------------------ writer
    def _refuse_if_full(self, frags: int) -> None:
        """``enqueue(block=False)``: raise QueueFull unless the message can go out at once."""
        if self._ring is not None and frags > self.max_chunks:  # no retry would ever place it
            raise QueueFull(
                f"fastdist.MessageQueue.enqueue on rank {self.ranks[self.index]}: the message "
                f"needs {frags} slots, more than the ring's {self.max_chunks}, so it never goes "
                "out at once. Fix: pass block=True (the readers drain it while it streams in), "
                "or make the queue with larger max_chunk_bytes"
            )
        if self._ring is not None:
            free = self.max_chunks - (self._count - self._ring.min_read())
            if frags > free:
                raise QueueFull(
                    f"fastdist.MessageQueue.enqueue on rank {self.ranks[self.index]}: the message "
                    f"needs {frags} slot(s), {free} of "
                    f"{self.max_chunks} are free (a reader is behind). Fix: retry later, pass "
                    "block=True, or make the queue with more slots"
                )
        if self._conns:
            _, w, _ = select.select([], list(self._conns.values()), [], 0)
            if len(w) < len(self._conns):
                raise QueueFull(
                    f"fastdist.MessageQueue.enqueue on rank {self.ranks[self.index]}: "
                    "a remote reader's socket is full. Fix: retry later or pass block=True"
                )

    def _write_ring(
        self,
        op: str,
        ring: ShmRing,
        payload: memoryview,
        frags: int,
        deadline: float,
        started: list[bool],
    ) -> None:
        """Write ``payload`` to the ring in ``frags`` fragments, each once its slot is free."""
        view = memoryview(payload)
        for j in range(frags):
            if self._count - ring.min_read() >= self.max_chunks:
                self._wait(
                    op,
                    lambda: self._count - ring.min_read() < self.max_chunks,
                    deadline,
                    self._lagging,
                    lambda: f"no free slot: {self._lag_text()}",
                )
            fence()  # the readers' counters were read before the slot is overwritten
            part = view[j * self.max_chunk_bytes : (j + 1) * self.max_chunk_bytes]
            ring.write(self._count, part, j + 1 < frags)
            self._count += 1
            fence()  # the slot's bytes are visible before the count that publishes them
            ring.publish(self._count)  # readers read only below this count
            started[0] = True

    def _write_sockets(
        self, op: str, payload: memoryview, deadline: float, started: list[bool]
    ) -> None:
        """Send ``payload`` to every remote reader: its length, then its bytes."""
        n = len(payload)
        for idx, c in self._conns.items():
            started[0] = True
            self._send(
                op, idx, c, FRAME.pack(n) + payload if n <= COALESCE else FRAME.pack(n), deadline
            )
            if n > COALESCE:
                self._send(op, idx, c, payload, deadline)

    def _lagging(self) -> list[int]:
        assert self._ring is not None
        low = self._count - self.max_chunks
        return [r for s, r in enumerate(self.local_readers) if self._ring.read_count(s) <= low]

    def _lag_text(self) -> str:
        lag = self._lagging()
        return (
            "reader(s) "
            + ", ".join(f"rank {self.ranks[r]}" for r in lag)
            + f" still hold the oldest of {self.max_chunks} slots"
        )

    def _send(
        self, op: str, idx: int, c: socket.socket, data: bytes | memoryview, deadline: float
    ) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            left = 1e-3
        c.settimeout(left)
        try:
            c.sendall(data)
        except TimeoutError as e:
            self._check_alive(op, [idx])
            raise self._err(
                op,
                CollectiveTimeout,
                f"the remote reader rank {self.ranks[idx]} did not take the message within the "
                "timeout",
                "pass a larger timeout, or check that reader: it may be stuck elsewhere",
            ) from e
        except OSError as e:
            raise self._lost(op, idx, f"closed its connection ({e.__class__.__name__}: {e})") from e

    # ------------------------------------------------------------------ reader
    def _writer_gone(self) -> list[int]:
        return [self.writer]

    def _await_fragment(
        self, op: str, ring: ShmRing, deadline: float, block: bool, mid: bool = False
    ) -> None:
        if ring.written() > self._count:
            return
        # closed: read the count again (it may have been published just before the close, after
        # the read above)
        if ring.closed():
            fence()
            if ring.written() > self._count:
                return
            if mid:  # closed with a message cut off: the writer's enqueue failed part-way
                raise self._err(
                    op,
                    CommError,
                    f"the writer, rank {self.ranks[self.writer]}, closed the queue in the middle "
                    f"of message {self._messages + 1} (its enqueue failed part-way); "
                    f"this rank read {self._messages} whole message(s)",
                    "see the writer's log (a timeout or a lost reader); make a new queue to go on",
                )
            raise self._closed_error(op)  # closed, and everything written was read

        def ready() -> bool:
            return ring.written() > self._count or ring.closed()

        if not block:
            self._check_alive_then(op, [self.writer], ready)
            if ready():
                return self._await_fragment(op, ring, deadline, block, mid)
            raise self._empty()
        self._wait(
            op,
            ready,
            deadline,
            self._writer_gone,
            lambda: (
                f"the writer, rank {self.ranks[self.writer]}, sent nothing after {self._messages} "
                "message(s)"
            ),
        )
        if ring.written() <= self._count:
            self._await_fragment(op, ring, deadline, block, mid)  # closed meanwhile

    def _read_ring(self, op: str, ring: ShmRing, deadline: float, block: bool) -> Any:
        parts: list[bytes] = []
        while True:
            self._await_fragment(op, ring, deadline, block if not parts else True, mid=bool(parts))
            fence()  # the count was read before the slot's bytes
            body, more = ring.read(self._count)
            if not more and not parts:
                try:  # the message leaves the queue even if it does not unpickle
                    return self._loads(op, body)
                finally:
                    body.release()
                    self._count += 1
                    fence()  # the slot was read before the writer may reuse it
                    ring.set_read_count(self._slot, self._count)
            parts.append(bytes(body))
            body.release()
            self._count += 1
            fence()
            ring.set_read_count(self._slot, self._count)
            if not more:
                return self._loads(op, b"".join(parts))

    def _recv_message(self, op: str, deadline: float, block: bool) -> Any:
        assert self._sock is not None
        if not block:
            r, _, _ = select.select([self._sock], [], [], 0)
            if not r:
                raise self._empty()
        (n,) = FRAME.unpack(self._recv_exact(op, 8, deadline, first=True))
        if n == CLOSE:
            raise self._closed_error(op)
        return self._loads(op, self._recv_exact(op, n, deadline, first=False))

    def _loads(self, op: str, data: Any) -> Any:
        """Unpickle a message that has left the queue; one that does not unpickle here raises
        a ``CommError`` (counted as read: the next call returns the message after it)."""
        try:
            return loads(data)
        except Exception as e:
            self._messages += 1
            raise self._err(
                op,
                CommError,
                f"message {self._messages} from the writer, rank {self.ranks[self.writer]}, "
                f"could not be unpickled on this rank ({type(e).__name__}: {e}); it has left the "
                "queue: the next dequeue returns the message after it",
                "send objects every reader can unpickle: classes importable on every rank (not "
                "defined only on the writer or in an interactive session), CPU tensors (or "
                "devices every reader has)",
            ) from e

    def _recv_exact(self, op: str, n: int, deadline: float, first: bool) -> bytearray:
        assert self._sock is not None
        out = bytearray(n)
        view, got = memoryview(out), 0
        while got < n:
            left = deadline - time.monotonic()
            self._sock.settimeout(max(left, 1e-3))
            try:
                k = self._sock.recv_into(view[got:])
            except TimeoutError as e:
                raise self._err(
                    op,
                    CollectiveTimeout,
                    f"the writer, rank {self.ranks[self.writer]}, sent nothing "
                    f"{'new' if first and got == 0 else 'more of a message'} after "
                    f"{self._messages} message(s) within the timeout",
                    "pass a larger timeout, or check the writer: it may be stuck elsewhere",
                ) from e
            except OSError as e:
                raise self._lost(
                    op, self.writer, f"closed the connection ({e.__class__.__name__}: {e})"
                ) from e
            if k == 0:
                raise self._lost(
                    op,
                    self.writer,
                    "closed the connection without closing the queue (exited)"
                    if first and got == 0
                    else "closed the connection in the middle of a message (it exited, or its "
                    "enqueue failed part-way)",
                )
            got += k
        return out

    # ------------------------------------------------------------------ errors
    def _err(self, op: str, cls: type[CommError], problem: str, fix: str) -> CommError:
        return cls(
            f"MessageQueue.{op}", self.axis, self.ranks, self.ranks[self.index], problem, fix
        )

    def _lost(self, op: str, peer: int, how: str) -> CommError:
        if self._closed:  # this rank's own close (in another thread) cut the connection
            return self._closed_here(op)
        role = "writer" if peer == self.writer else "reader"
        fix = (
            "the writer is gone: see its log; make a new queue (MessageQueue.create on every "
            "surviving rank of a new job) to go on"
            if role == "writer"
            else "see that reader's log; close this queue and make a new one without it"
        )
        return PeerLostError(
            f"MessageQueue.{op}",
            self.axis,
            self.ranks,
            self.ranks[self.index],
            self.ranks[peer],
            f"the {role}, rank {self.ranks[peer]} (axis index {peer}), {how} after "
            f"{self._messages} message(s) on this rank",
            fix,
        )

    def _closed_here(self, op: str) -> CommError:
        return self._err(
            op,
            QueueClosedError,
            "this rank closed the queue (in another thread) while this call waited",
            "close the queue once no thread of this rank uses it, or make a new queue",
        )

    def _closed_error(self, op: str) -> CommError:
        return self._err(
            op,
            QueueClosedError,
            f"the writer, rank {self.ranks[self.writer]}, closed the queue; this rank read all "
            f"{self._messages} message(s)",
            "stop reading (the writer is done), or make a new queue",
        )

    def _empty(self) -> QueueEmpty:
        return QueueEmpty(
            f"fastdist.MessageQueue.dequeue on rank {self.ranks[self.index]}: no message. "
            "Fix: retry later, or pass block=True"
        )

    # ------------------------------------------------------------------ waiting
    def _take_turn(self, op: str, block: bool, timeout: float) -> None:
        """Acquire the queue's lock for this call: at once (``block=False``: ``QueueFull`` /
        ``QueueEmpty`` if another thread holds it) or within ``timeout``."""
        got = self._lock.acquire(timeout=timeout) if block else self._lock.acquire(blocking=False)
        if got and self._closed:  # closed by another thread while this call waited its turn
            self._lock.release()
            raise self._closed_here(op)
        if got:
            return
        if not block and op == "dequeue":
            raise self._empty()
        if not block:
            raise QueueFull(
                f"fastdist.MessageQueue.enqueue on rank {self.ranks[self.index]}: another "
                "thread of this rank is sending a message. Fix: retry later, or pass block=True"
            )
        raise self._err(
            op,
            CollectiveTimeout,
            f"another thread of this rank was still in {op} on this queue after the timeout "
            f"({timeout:g} s)",
            "pass a larger timeout, or give each thread its own queue",
        )

    def _check_alive(self, op: str, peers: Sequence[int]) -> None:
        for p in peers:
            if p in self._conns:
                c = self._conns[p]
                r, _, _ = select.select([c], [], [], 0)
                if r and not is_open(c):
                    raise self._lost(op, p, "closed its connection (exited)")
            elif p == self.writer and self._sock is not None:
                continue  # a remote reader learns of the writer's exit from its socket
            elif not pid_alive(*self._pids[p]):
                raise self._lost(op, p, f"exited (pid {self._pids[p][0]} is gone)")

    def _check_alive_then(self, op: str, peers: Sequence[int], ready: Callable[[], bool]) -> None:
        """Raise for a peer that is gone unless ``ready()`` now holds (what a peer did before it
        exited, e.g. closing, counts)."""
        try:
            self._check_alive(op, peers)
        except PeerLostError:
            if not ready():
                raise

    def _wait(
        self,
        op: str,
        ready: Callable[[], bool],
        deadline: float,
        peers: Callable[[], list[int]],
        what: Callable[[], str],
    ) -> None:
        """Until ``ready()``; check every 50 ms that ``peers()`` live; past ``deadline`` raise
        CollectiveTimeout saying ``what()``."""
        start = now = time.monotonic()
        check = now + _CHECK_S
        nap = 1e-5
        while not ready():
            if self._closed:  # another thread of this rank closed the queue
                raise self._closed_here(op)
            now = time.monotonic()
            if now - start < _SPIN_S:
                os.sched_yield()
            else:
                time.sleep(nap)
                nap = min(nap * 2, _MAX_SLEEP_S)
            if now >= check:
                self._check_alive_then(op, peers(), ready)
                check = now + _CHECK_S
            if now >= deadline:
                if ready():
                    return
                self._check_alive_then(op, peers(), ready)
                raise self._err(
                    op,
                    CollectiveTimeout,
                    f"{what()} within the timeout ({self._call_timeout:g} s); the peer is alive "
                    "but did not keep up",
                    "pass a larger timeout (per call or MessageQueue.create(timeout=...)), or "
                    "check that peer: it may be stuck elsewhere",
                )
