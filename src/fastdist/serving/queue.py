"""A message queue broadcaster on a mesh axis: one writer, N readers of picklable objects.

The serving side of vLLM's ``GroupCoordinator`` (its constructors are in
:mod:`fastdist.serving.broadcasters`) on a :class:`~fastdist.Mesh` built with
``fastdist.connect``. Readers on the writer's host read from a shared-memory ring
(:mod:`fastdist.serving.shm_ring`); readers on other hosts read from a TCP socket
(:mod:`fastdist.serving.sockets`). Objects larger than a slot are split over consecutive slots
(the overflow path): :mod:`fastdist.serving.wire` moves the bytes, this module holds the public
calls and the collective setup. Every wait has a timeout; a peer that exits makes the others raise
:class:`~fastdist.errors.PeerLostError` naming it; the segment is unlinked as soon as every local
reader has attached, so nothing is left in ``/dev/shm`` after a crash (a setup that fails
unlinks it at once; a writer killed during setup leaves it to Python's resource tracker, which
unlinks it when the writer is gone).

>>> import fastdist as fd                                     # doctest: +SKIP
>>> mesh = fd.connect(tp=4)                                    # doctest: +SKIP
>>> with fd.serving.MessageQueue.create(mesh, "tp") as q:     # doctest: +SKIP
...     step = q.broadcast_object({"step": 3} if q.is_writer else None)
"""

from __future__ import annotations

import contextlib
import math
import secrets
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastdist.comm.p2p import all_gather_object
from fastdist.errors import (
    CollectiveError,
    CommError,
    MeshError,
    QueueClosedError,
)
from fastdist.ops.prelude import names_this_rank
from fastdist.serving.checks import MAX_TIMEOUT_S, check_options, check_readers
from fastdist.serving.node import NodeInfo, axis_group, node_info
from fastdist.serving.shm_ring import ShmRing
from fastdist.serving.sockets import CLOSE, FRAME, accept_readers, connect_to_writer, listen
from fastdist.serving.wire import QueueWire

if TYPE_CHECKING:  # typing.Self is Python 3.11+; fastdist supports 3.10
    from typing_extensions import Self

__all__ = ["MessageQueue", "build_queues"]

_IDLE_CHECK_S = 1.0  # how often an enqueue that does not wait checks that the readers are alive


class MessageQueue(QueueWire):
    """One writer, N readers of picklable objects on a mesh axis. Build it with :meth:`create`.

    Contract:

    * Every reader gets every message exactly once, in the order written, or an error: never a
      silent loss, never a hang. Each call waits at most its ``timeout`` (default: the queue's).
    * ``enqueue`` (writer) blocks while a local reader is ``max_chunks`` slots behind, or a
      remote reader's socket is full; ``block=False`` raises :class:`~fastdist.errors.QueueFull`
      at once instead, having sent nothing. ``dequeue`` (reader) blocks until a message arrives;
      ``block=False`` raises :class:`~fastdist.errors.QueueEmpty` at once when none has started
      arriving.
    * Objects larger than ``max_chunk_bytes`` are split over consecutive slots (a message may
      exceed the whole ring: the writer streams it while the readers drain it).
    * A peer that exits makes the waiting side raise :class:`~fastdist.errors.PeerLostError`
      naming its rank (local peers: checked every 50 ms by pid; remote: the socket closes); a
      live peer that does not keep up raises :class:`~fastdist.CollectiveTimeout` naming it.
    * An ``enqueue`` that times out before any reader could see its message sent nothing, and
      the queue goes on. One that fails after part of the message went out (a remote reader's
      socket filled up, or the ring filled up in the middle of a large message) leaves the
      queue unusable: later ``enqueue`` calls raise :class:`~fastdist.CommError`, and after
      :meth:`close` the readers get an error (not ``QueueClosedError``), so none of them
      takes a cut-off message for a whole one.
    * After :meth:`close` on the writer, readers get the messages already written, then
      :class:`~fastdist.errors.QueueClosedError`.

    Example (every rank of ``tp`` runs it; index 0 writes)::

        with MessageQueue.create(mesh, "tp", writer=0) as q:
            if q.is_writer:
                q.enqueue({"step": 1, "tokens": [3, 5]})
            else:
                msg = q.dequeue(timeout=10)
    """

    # ------------------------------------------------------------------ roles
    @property
    def is_writer(self) -> bool:
        """Whether this rank writes (``enqueue``)."""
        return self.index == self.writer

    @property
    def is_reader(self) -> bool:
        """Whether this rank reads (``dequeue``)."""
        return self.index in self.readers

    def __repr__(self) -> str:
        role = "writer" if self.is_writer else "reader" if self.is_reader else "bystander"
        return (
            f"MessageQueue(axis={self.axis!r}, writer={self.writer}, readers={list(self.readers)} "
            f"(remote {list(self.remote_readers)}), "
            f"{self.max_chunks} x {self.max_chunk_bytes} B, this rank: {role})"
        )

    # ------------------------------------------------------------------ setup
    @classmethod
    @names_this_rank
    def create(
        cls,
        mesh: Any,
        axis: Any = None,
        *,
        writer: int = 0,
        readers: Sequence[int] | None = None,
        max_chunk_bytes: int = 1 << 20,
        max_chunks: int = 8,
        timeout: float = 60.0,
        nodes: NodeInfo | None = None,
    ) -> MessageQueue:
        """Build the queue; a collective: every rank of the ``axis`` group (default: whole mesh)
        calls it with the same arguments.

        Args:
            mesh: a mesh from ``fastdist.connect`` (its gloo group carries the setup: three
                small all-gathers, or three with ``nodes``).
            axis: the mesh axis (or tuple, or ``None`` for the whole mesh).
            writer: the writer's index along the axis.
            readers: the readers' indices (default: every other index).
            max_chunk_bytes: the size of one slot of the shared-memory ring; a larger message
                spans several slots.
            max_chunks: how many slots the ring has: how far the slowest local reader may lag
                before ``enqueue`` waits.
            timeout: seconds each call waits by default (and the setup waits for its peers).
            nodes: a :class:`~fastdist.serving.NodeInfo` of the same axis from
                :func:`~fastdist.serving.node_info` (saves an all-gather; tests pass one with
                made-up hostnames to use the socket path on one host).

        Raises:
            CommError: a rank failed to set up (named, with its error); every rank raises it.
        """
        return build_queues(
            "MessageQueue.create",
            mesh,
            axis,
            [(writer, readers)],
            max_chunk_bytes,
            max_chunks,
            timeout,
            nodes,
        )[0]

    def _open_ends(self) -> tuple[str | None, str | None, int, bytes]:
        """Setup step 1, the writer: make the ring and the listening socket its readers need;
        returns what they attach or connect to (segment name, address, port, token)."""
        token = secrets.token_bytes(16)
        name: str | None = None
        host: str | None = None
        port = 0
        if self.local_readers:
            self._ring = ShmRing.create(
                len(self.local_readers), self.max_chunk_bytes, self.max_chunks
            )
            name = self.shm_name = self._ring.name
        if self.remote_readers:
            self._listener, host, port = listen(len(self.remote_readers))
        return name, host, port, token

    def _attach(self, handle: tuple[str | None, str | None, int, bytes], timeout: float) -> None:
        """Setup step 2, a reader: attach to the writer's ring, or connect to its socket."""
        seg, addr, port, token = handle
        if self.index in self.local_readers:
            self._ring = ShmRing.attach(
                str(seg), len(self.local_readers), self.max_chunk_bytes, self.max_chunks
            )
            self.shm_name, self._slot = str(seg), self.local_readers.index(self.index)
        else:
            self._sock = connect_to_writer(str(addr), port, self.index, token, timeout)

    def _accept(self, token: bytes, deadline: float) -> None:
        """Setup step 3, the writer: accept the remote readers."""
        assert self._listener is not None
        accept_readers(
            self._listener, self.remote_readers, token, deadline, self.ranks, self._conns
        )
        self._listener = None

    def _role(self, op: str, writer: bool) -> None:
        if self._closed:
            raise self._err(
                op, QueueClosedError, "this rank already closed the queue", "make a new queue"
            )
        if writer != self.is_writer or (not writer and not self.is_reader):
            need = "the writer" if writer else "a reader"
            raise CollectiveError(
                f"MessageQueue.{op}",
                self.axis,
                f"called on index {self.index}, which is not {need} of {self!r}",
                f"call {'enqueue' if writer else 'dequeue'} on {need} only "
                "(q.is_writer / q.is_reader)",
                rank=f"rank {self.ranks[self.index]}",
            )

    def _timeout(self, timeout: float | None) -> float:
        if timeout is None:
            return self.timeout
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 <= timeout <= MAX_TIMEOUT_S  # nan and inf too: a wait must end
        ):
            raise MeshError(
                f"MessageQueue: timeout must be seconds in [0, {MAX_TIMEOUT_S:g}], got "
                f"{timeout!r}. Fix: pass a finite number of seconds (a wait must end)"
            )
        return float(timeout)

    # ------------------------------------------------------------------ writer
    def enqueue(self, obj: Any, *, timeout: float | None = None, block: bool = True) -> None:
        """Send ``obj`` (picklable) to every reader, in order. Writer only.

        ``block=False``: raise :class:`~fastdist.errors.QueueFull` at once (nothing sent) unless
        every slot the message needs is free and every remote reader's socket is writable.

        Args:
            obj: the picklable object to send.
            timeout: seconds to wait at most; default: the queue's.
            block: ``False``: raise ``QueueFull`` at once instead of waiting (nothing sent).

        >>> q.enqueue({"step": 7}, timeout=5)   # doctest: +SKIP
        """
        op = "enqueue"
        self._role(op, True)
        t = self._timeout(timeout)
        deadline = time.monotonic() + t
        self._take_turn(op, block, t)
        self._call_timeout = t
        try:
            self._enqueue(op, obj, deadline, block)
        finally:
            self._lock.release()

    def _enqueue(self, op: str, obj: Any, deadline: float, block: bool) -> None:
        """``enqueue``'s work, this thread holding the queue's lock."""
        if self._broken:
            raise self._err(
                op,
                CommError,
                f"an earlier enqueue failed after part of its message went out ({self._broken}); "
                "the readers may hold part of that message, so nothing more can be sent in order",
                "close this queue and make a new one",
            )
        payload = self._encoder.dumps(obj)
        frags = max(1, math.ceil(len(payload) / self.max_chunk_bytes))
        if not block:
            self._refuse_if_full(frags)
        # a reader that exited while the ring had room is found here
        if time.monotonic() - self._last_check > _IDLE_CHECK_S:
            self._check_alive(op, self.readers)
            self._last_check = time.monotonic()
        started = [False]  # whether any reader may have seen part of this message
        try:
            if self._ring is not None:
                self._write_ring(op, self._ring, payload, frags, deadline, started)
            self._write_sockets(op, payload, deadline, started)
        except BaseException as e:
            # a timeout (or error) mid-message: some readers have it, or part of it; never go on as
            # if it were sent
            if started[0]:
                self._broken = f"{type(e).__name__} in message {self._messages + 1}"
            raise
        self._messages += 1

    def broadcast_object(self, obj: Any = None, *, timeout: float | None = None) -> Any:
        """The writer sends ``obj`` and returns it; a reader returns the next message (ignores
        ``obj``).

        The drop-in for ``fastdist.comm.broadcast_object(obj, mesh, axis, src=writer)`` in a loop.

        Args:
            obj: the object to send (the writer); ignored on a reader.
            timeout: seconds to wait at most; default: the queue's.

        Returns:
            the message: ``obj`` on the writer, the next message on a reader.
        """
        if self.is_writer:
            self.enqueue(obj, timeout=timeout)
            return obj
        return self.dequeue(timeout=timeout)

    # ------------------------------------------------------------------ reader
    def dequeue(self, *, timeout: float | None = None, block: bool = True) -> Any:
        """The next message, in the order written. Reader only.

        ``block=False``: raise :class:`~fastdist.errors.QueueEmpty` at once if no message has
        started to arrive (a message whose first part arrived is awaited whole, within the
        timeout).

        Args:
            timeout: seconds to wait at most; default: the queue's.
            block: ``False``: raise ``QueueEmpty`` at once when no message has started to arrive.

        Returns:
            the next message, in the order written.

        >>> msg = q.dequeue(timeout=5)   # doctest: +SKIP
        """
        op = "dequeue"
        self._role(op, False)
        t = self._timeout(timeout)
        deadline = time.monotonic() + t
        self._take_turn(op, block, t)
        self._call_timeout = t
        try:
            if self._sock is not None:
                obj = self._recv_message(op, deadline, block)
            else:
                assert self._ring is not None
                obj = self._read_ring(op, self._ring, deadline, block)
            self._messages += 1
            return obj
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ teardown
    def close(self, *, timeout: float = 5.0) -> None:
        """Release this rank's end (idempotent). The writer marks the queue closed first: readers
        get what was written, then :class:`~fastdist.errors.QueueClosedError`.

        A call of this end waiting in another thread of this rank ends with
        :class:`~fastdist.errors.QueueClosedError` (at once on the ring; a remote reader's
        socket is shut down), and ``close`` waits for it, at most ``timeout`` seconds.

        Args:
            timeout: seconds the writer waits at most to send the close message to remote readers
                (and any end for a call of another thread to end).
        """
        if self._closed:
            return
        timeout = self._timeout(timeout)
        self._closed = True  # a wait of another thread sees it
        if self._sock is not None:  # wakes a receive of another thread
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        turn = self._lock.acquire(timeout=timeout)
        try:
            self._release(timeout)
        finally:
            if turn:
                self._lock.release()

    def _release(self, timeout: float) -> None:
        """``close``'s work: the close message, then every end let go."""
        if self.is_writer:
            if self._ring is not None:
                self._ring.mark_closed()
            deadline = time.monotonic() + timeout
            # a cut-off stream gets no close frame: its reader sees the cut
            for c in [] if self._broken else self._conns.values():
                try:
                    c.settimeout(max(deadline - time.monotonic(), 1e-3))
                    c.sendall(FRAME.pack(CLOSE))
                except OSError:
                    pass
        for c in [
            *self._conns.values(),
            *([self._sock] if self._sock is not None else []),
            *([self._listener] if self._listener else []),
        ]:
            try:
                c.close()
            except OSError:
                pass
        self._conns.clear()
        self._sock = self._listener = None
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# =================================================================== building queues (collectively)
def build_queues(
    op: str,
    mesh: Any,
    axis: Any,
    specs: Sequence[tuple[int, Sequence[int] | None]],
    max_chunk_bytes: int,
    max_chunks: int,
    timeout: float,
    nodes: NodeInfo | None,
) -> list[MessageQueue]:
    """Set up one queue per ``(writer, readers)`` in ``specs`` in one collective setup; every rank
    of the axis gets an object for each (:meth:`MessageQueue.create` and the broadcasters of
    :mod:`fastdist.serving.broadcasters` call it).

    Args:
        op: the public name of the caller (for errors).
        mesh: a mesh from ``fastdist.connect``.
        axis: the axis of the queues; ``None``: the whole mesh.
        specs: each queue's writer index and reader indices (``None``: every other index).
        max_chunk_bytes: as :meth:`MessageQueue.create`.
        max_chunks: as :meth:`MessageQueue.create`.
        timeout: as :meth:`MessageQueue.create`.
        nodes: as :meth:`MessageQueue.create`.
    """
    ranks, index, label = axis_group(op, mesh, axis)
    n = len(ranks)
    check_options(op, label, max_chunk_bytes, max_chunks, timeout)
    info = nodes if nodes is not None else node_info(mesh, axis)
    if info.ranks != ranks:
        raise CollectiveError(
            op,
            label,
            f"nodes= describes ranks {list(info.ranks)}, not this axis group {list(ranks)}",
            "pass node_info(mesh, axis) of the same axis",
        )
    queues: list[MessageQueue] = []
    for writer, readers in specs:
        rd = check_readers(op, label, n, writer, readers)
        queues.append(
            MessageQueue(
                op_axis=label,
                ranks=ranks,
                index=index,
                writer=writer,
                readers=rd,
                local=tuple(r for r in rd if info.same_host(r, writer)),
                pids=info.pids,
                max_chunk_bytes=max_chunk_bytes,
                max_chunks=max_chunks,
                timeout=timeout,
            )
        )
    try:
        _connect(op, mesh, axis, queues, (ranks, index, label), timeout)
    except BaseException:
        # a peer died or a collective failed mid-setup: unlink this rank's segments now, not at exit
        for q in queues:
            q.close()
        raise
    return queues


def _error_text(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def _connect(
    op: str,
    mesh: Any,
    axis: Any,
    queues: list[MessageQueue],
    group: tuple[tuple[int, ...], int, Any],
    timeout: float,
) -> None:
    """The collective part of :func:`build_queues`: segments and sockets made, attached,
    connected, unlinked. Each step's errors are all-gathered, so every rank fails together."""
    ranks, index, label = group
    error = ""
    handles: dict[int, tuple[str | None, str | None, int, bytes]] = {}
    try:  # 1. writers make their segment and listening socket
        for k, q in enumerate(queues):
            if q.is_writer:
                handles[k] = q._open_ends()
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = _error_text(e)
    every = all_gather_object((handles, error), mesh, axis)
    error = ""
    try:  # 2. readers attach / connect
        if not any(e[1] for e in every):
            for k, q in enumerate(queues):
                if q.is_reader:
                    q._attach(every[q.writer][0][k], timeout)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = _error_text(e)
    every2 = all_gather_object(error, mesh, axis)
    error = ""
    # 3. every local reader attached: unlink (nothing is left in /dev/shm after a crash); accept the
    # remote readers
    try:
        for k, q in enumerate(queues):
            if q.is_writer and q._ring is not None:
                q._ring.unlink()
            if q.is_writer and q._listener is not None and not any(every2):
                if not any(e[1] for e in every):
                    q._accept(handles[k][3], time.monotonic() + timeout)
    except Exception as e:  # noqa: BLE001
        error = _error_text(e)
    # 4. everyone learns of a failed accept, and returns only once the segment is unlinked
    every3 = all_gather_object(error, mesh, axis)
    failed = (
        [(ranks[i], e[1]) for i, e in enumerate(every) if e[1]]
        + [(ranks[i], e) for i, e in enumerate(every2) if e]
        + [(ranks[i], e) for i, e in enumerate(every3) if e]
    )
    if failed:
        for q in queues:
            q.close()
        r0, why = failed[0]
        raise CommError(
            op,
            label,
            ranks,
            ranks[index],
            f"setting up the queue failed on rank {r0}: {why}",
            "see that rank's log; /dev/shm needs room for max_chunks x max_chunk_bytes, and "
            "remote readers need to reach the writer's "
            "address (set FASTDIST_MQ_ADDR on the writer's host to choose it)",
        )
