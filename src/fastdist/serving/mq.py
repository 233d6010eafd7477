"""A message queue broadcaster on a mesh axis, and node locality (which ranks share a host).

The serving side of vLLM's ``GroupCoordinator`` (``create_mq_broadcaster``,
``create_single_reader_mq_broadcasters``) and FastVideo's ``in_the_same_node_as`` /
``get_local_torch_device``, as functions of a :class:`~fastdist.Mesh` built with
``Mesh.from_torch``.

* :class:`MessageQueue`: one writer, N readers, picklable objects. Readers on the writer's
  host read from a shared-memory ring buffer (``multiprocessing.shared_memory``); readers on
  other hosts read from a TCP socket. Objects larger than a slot are split over consecutive
  slots (the overflow path). Every wait has a timeout; a peer that exits makes the others
  raise :class:`PeerLostError` naming it; the segment is unlinked as soon as every local
  reader has attached, so nothing is left in ``/dev/shm`` after a crash (a setup that fails
  unlinks it at once; a writer killed during setup leaves it to Python's resource tracker,
  which unlinks it when the writer is gone).
* :func:`node_info`, :func:`local_device`: hostnames exchanged once per call; the local rank
  and the device (``cuda:<local_rank>``, ``npu:<local_rank>`` or ``cpu``).

>>> import fastdist as fd                                     # doctest: +SKIP
>>> mesh = fd.Mesh.from_torch(tp=4)                           # doctest: +SKIP
>>> with fd.serving.mq.MessageQueue.create(mesh, "tp") as q:          # doctest: +SKIP
...     step = q.broadcast_object({"step": 3} if q.is_writer else None)
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import pickle
import queue
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import TYPE_CHECKING, Any

import torch

from fastdist.errors import (
    CollectiveError,
    CollectiveTimeout,
    CommError,
    FastdistError,
    MeshError,
)
from fastdist.ops.prelude import names_this_rank

if TYPE_CHECKING:  # typing.Self is Python 3.11+; fastdist supports 3.10
    from typing_extensions import Self

__all__ = [
    "MessageQueue",
    "NodeInfo",
    "PeerLostError",
    "QueueClosedError",
    "QueueEmpty",
    "QueueFull",
    "create_mq_broadcaster",
    "create_single_reader_mq_broadcasters",
    "local_device",
    "node_info",
]

_U64 = struct.Struct("<Q")
# a slot's header: fragment length, 1 if more fragments of the message follow
_FRAG = struct.Struct("<QQ")
_HELLO = struct.Struct("<Q16s")  # a remote reader's greeting: its axis index, the queue's token
_MAGIC = 0xFA57D157_0001
_CLOSE = 2**64 - 1  # the frame length that says the writer closed the queue
_LINE = 64  # each counter on its own cache line
_SPIN_S = 2e-4  # wait by yielding the CPU this long, then sleep in growing steps
_MAX_SLEEP_S = 1e-3
_CHECK_S = 0.05  # how often a waiting side checks that the peers it waits for are alive
_IDLE_CHECK_S = 1.0  # how often an enqueue that does not wait checks that the readers are alive
_SHM_PREFIX = "fdmq_"
_COALESCE = 1 << 16  # a socket message up to this size goes out in one send (header + body)


_FENCE_LOCK = threading.Lock()


def _fence() -> None:
    """A full memory barrier (a lock's acquire and release issue one), between a slot's bytes and
    its counter: needed where the CPU reorders memory accesses (ARM); x86 keeps them in order
    anyway."""
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


# =================================================================== errors
class PeerLostError(CommError):
    """A message queue's peer exited (its process is gone, or its socket closed without the close
    message).

    Attributes (besides :class:`~fastdist.CommError`'s):
        peer: the global rank of the peer that is gone.
    """

    def __init__(
        self,
        op: str,
        axis: object,
        ranks: Sequence[int],
        rank: int,
        peer: int,
        problem: str,
        fix: str,
    ) -> None:
        self.peer = peer
        super().__init__(op, axis, ranks, rank, problem, fix)


class QueueClosedError(CommError):
    """A reader asked for a message after the writer closed the queue and every message was read."""


class QueueEmpty(FastdistError, queue.Empty):
    """``dequeue(block=False)`` found no message (also a ``queue.Empty``)."""


class QueueFull(FastdistError, queue.Full):
    """``enqueue(block=False)`` could not place the message at once (also a ``queue.Full``);
    nothing was sent."""


# =================================================================== node locality
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _proc_identity(pid: int) -> int | None:
    """The start time of process ``pid`` (Linux ``/proc``), which tells a reused pid apart; None
    elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` (started at ``start``) still runs on this host (a zombie counts as
    gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if fields[0] in ("Z", "X"):
        return False
    return start is None or int(fields[19]) == start


@dataclass(frozen=True)
class NodeInfo:
    """Where the ranks of a mesh axis run: which share a host with which.

    Built by :func:`node_info` (one all-gather of hostnames). Hosts are compared by hostname
    *and* boot id, so two machines that report the same hostname are still told apart.

    Attributes:
        axis: the axis (``None``: the whole mesh).
        ranks: the group's global ranks, in axis order.
        index: this rank's index along the axis.
        hosts: each index's hostname.
        host_keys: what hosts are compared by (hostname and boot id).
        pids: each index's process id and start time (for liveness checks on one host).

    What rank 9 of ``torchrun --nnodes 2 --nproc-per-node 8`` sees (written out by hand here;
    :func:`node_info` fills it in a job):

    >>> from fastdist.serving.mq import NodeInfo, local_device
    >>> hosts = ("node-a",) * 8 + ("node-b",) * 8
    >>> ids = tuple((100 + r, None) for r in range(16))
    >>> info = NodeInfo(None, tuple(range(16)), 9, hosts, hosts, ids)
    >>> info.local_rank, info.local_size, info.single_host
    (1, 8, False)
    >>> info.nodes
    [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
    >>> info.same_host(8), info.same_host(7)
    (True, False)
    >>> local_device(info, "cpu")
    device(type='cpu')
    """

    axis: Any
    ranks: tuple[int, ...]
    index: int
    hosts: tuple[str, ...]
    host_keys: tuple[str, ...]
    pids: tuple[tuple[int, int | None], ...]

    def same_host(self, i: int, j: int | None = None) -> bool:
        """Whether axis indices ``i`` and ``j`` (default: this rank) run on one host.

        Args:
            i: an index along the axis.
            j: another index; default: this rank's.
        """
        return self.host_keys[i] == self.host_keys[self.index if j is None else j]

    def same_host_as(self, i: int) -> list[bool]:
        """For every index, whether it shares a host with index ``i`` (FastVideo's
        ``in_the_same_node_as``).

        Args:
            i: an index along the axis.
        """
        return [k == self.host_keys[i] for k in self.host_keys]

    @property
    def local_indices(self) -> tuple[int, ...]:
        """The axis indices on this rank's host, in axis order."""
        return tuple(i for i in range(len(self.ranks)) if self.same_host(i))

    @property
    def local_rank(self) -> int:
        """This rank's position among the ranks of the axis on its host (torchrun's ``LOCAL_RANK``
        for the whole mesh)."""
        return self.local_indices.index(self.index)

    @property
    def local_size(self) -> int:
        """How many ranks of the axis run on this rank's host."""
        return len(self.local_indices)

    @property
    def nodes(self) -> list[list[int]]:
        """The axis indices grouped by host, hosts in order of first appearance."""
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(self.host_keys):
            groups.setdefault(k, []).append(i)
        return list(groups.values())

    @property
    def single_host(self) -> bool:
        """Whether every rank of the axis runs on one host."""
        return len(set(self.host_keys)) == 1


def _group(op: str, mesh: Any, axis: Any) -> tuple[tuple[int, ...], int, Any]:
    if getattr(mesh, "_comm", None) is None:
        from fastdist.errors import NoBackendError

        raise NoBackendError(
            f"fastdist.{op}: {mesh!r} is not backed by torch.distributed. Fix: build it with "
            "Mesh.from_torch(...) inside a torch.distributed job"
        )
    names = mesh.axis_names if axis is None else axis
    ranks = tuple(mesh.group(mesh.rank, names))
    label = axis if axis is not None else (names[0] if len(names) == 1 else tuple(names))
    return ranks, ranks.index(mesh.rank), label


def node_info(mesh: Any, axis: Any = None, *, hostname: str | None = None) -> NodeInfo:
    """Which ranks of ``axis`` (default: the whole mesh) share a host. Collective: every rank of
    the group calls it.

    One ``all_gather_object`` of (hostname, boot id, pid) over the axis; keep the result, it
    does not change. ``hostname`` overrides ``socket.gethostname()`` (tests use it to pretend
    ranks run on another host; hosts are then compared by the given names alone).

    Under ``torchrun --nnodes=N --nproc-per-node=P`` the global ranks of a node are
    consecutive, so on the whole mesh :attr:`NodeInfo.local_rank` equals ``LOCAL_RANK``.

    Args:
        mesh: a mesh from ``Mesh.from_torch``.
        axis: the axis whose ranks to locate; default: the whole mesh.
        hostname: a name to report instead of ``socket.gethostname()`` (hosts are then compared by
            these names alone).

    Returns:
        where the ranks of ``axis`` run, which share a host with which.

    >>> info = fastdist.serving.mq.node_info(mesh)        # doctest: +SKIP
    >>> info.local_rank, info.local_size, info.nodes   # doctest: +SKIP
    (1, 4, [[0, 1, 2, 3], [4, 5, 6, 7]])
    """
    from fastdist.comm.distributed import all_gather_object

    ranks, index, label = _group("node_info", mesh, axis)
    host = socket.gethostname() if hostname is None else hostname
    key = f"{host}/{_boot_id()}" if hostname is None else f"{host}/given"
    mine = (host, key, os.getpid(), _proc_identity(os.getpid()))
    every = all_gather_object(mine, mesh, axis)
    return NodeInfo(
        label,
        ranks,
        index,
        tuple(e[0] for e in every),
        tuple(e[1] for e in every),
        tuple((e[2], e[3]) for e in every),
    )


def _default_device_type() -> str:
    if torch.cuda.is_available():
        return "cuda"
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return "npu"
    return "cpu"


def local_device(where: Any, device_type: str | None = None) -> torch.device:
    """This rank's device: ``cuda:<local_rank>``, ``npu:<local_rank>`` or ``cpu``.

    ``where`` is a :class:`NodeInfo` of the whole mesh, or a mesh (then :func:`node_info` runs
    over the whole mesh: a collective). ``device_type`` defaults to ``cuda`` if available, else
    ``npu`` (``torch_npu``), else ``cpu``. Raises :class:`~fastdist.MeshError` when the host
    has fewer devices than ranks.

    Args:
        where: a ``NodeInfo`` of the whole mesh, or a mesh (then ``node_info`` runs over it: a
            collective).
        device_type: ``"cuda"``, ``"npu"`` or ``"cpu"``; default: ``cuda`` if available, else
            ``npu``, else ``cpu``.

    Returns:
        this rank's device: ``cuda:<local_rank>``, ``npu:<local_rank>`` or ``cpu``.

    >>> dev = fastdist.serving.mq.local_device(mesh)   # doctest: +SKIP
    >>> torch.cuda.set_device(dev)             # doctest: +SKIP
    """
    info = where if isinstance(where, NodeInfo) else node_info(where)
    kind = _default_device_type() if device_type is None else device_type
    if kind == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, kind, None)
    count = int(mod.device_count()) if mod is not None and hasattr(mod, "device_count") else 0
    if info.local_rank >= count:
        raise MeshError(
            f"fastdist.local_device: rank {info.ranks[info.index]} is local rank {info.local_rank} "
            f"of {info.local_size} on host {info.hosts[info.index]!r}, which has {count} {kind} "
            f"device(s). Fix: start at most {count} processes per host (torchrun "
            f"--nproc-per-node={count}), or check CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES"
        )
    return torch.device(kind, info.local_rank)


# =================================================================== the queue
def _address() -> str:
    """An address of this host that the other hosts can reach: ``FASTDIST_MQ_ADDR``, else the
    interface that routes to ``MASTER_ADDR``."""
    given = os.environ.get("FASTDIST_MQ_ADDR")
    if given:
        return given
    master = os.environ.get("MASTER_ADDR", "")
    if master and master not in ("localhost", "127.0.0.1", "::1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                # no packet is sent: only picks the route
                s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
                return str(s.getsockname()[0])
        except OSError:
            pass
    try:
        addr = socket.gethostbyname(socket.gethostname())
        return addr if not addr.startswith("127.") or not master else "127.0.0.1"
    except OSError:
        return "127.0.0.1"


class _Attached:
    """A reader's mapping of the writer's segment, kept out of every resource tracker.

    ``SharedMemory(name)`` registers the segment with the process's resource tracker (before
    Python 3.13), which may be shared with the writer (``torch.multiprocessing.spawn``); a
    reader's unregister would then drop the writer's registration. The writer owns the name.
    """

    def __init__(self, name: str) -> None:
        try:
            import _posixshmem  # type: ignore[import-not-found]
        except ImportError:  # not POSIX: fall back on SharedMemory, then forget it in the tracker
            shm = shared_memory.SharedMemory(name=name)
            with contextlib.suppress(Exception):
                resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
            self._shm: shared_memory.SharedMemory | None = shm
            self.buf: memoryview = shm.buf  # type: ignore[assignment]
            return
        self._shm = None
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            return
        self.buf.release()
        self._mmap.close()


class MessageQueue:
    """One writer, N readers of picklable objects on a mesh axis. Build it with :meth:`create`.

    Contract:

    * Every reader gets every message exactly once, in the order written, or an error: never a
      silent loss, never a hang. Each call waits at most its ``timeout`` (default: the queue's).
    * ``enqueue`` (writer) blocks while a local reader is ``max_chunks`` slots behind, or a
      remote reader's socket is full; ``block=False`` raises :class:`QueueFull` at once instead,
      having sent nothing. ``dequeue`` (reader) blocks until a message arrives; ``block=False``
      raises :class:`QueueEmpty` at once when none has started arriving.
    * Objects larger than ``max_chunk_bytes`` are split over consecutive slots (a message may
      exceed the whole ring: the writer streams it while the readers drain it).
    * A peer that exits makes the waiting side raise :class:`PeerLostError` naming its rank
      (local peers: checked every 50 ms by pid; remote: the socket closes); a live peer that
      does not keep up raises :class:`~fastdist.CollectiveTimeout` naming it.
    * An ``enqueue`` that times out before any reader could see its message sent nothing, and
      the queue goes on. One that fails after part of the message went out (a remote reader's
      socket filled up, or the ring filled up in the middle of a large message) leaves the
      queue unusable: later ``enqueue`` calls raise :class:`~fastdist.CommError`, and after
      :meth:`close` the readers get an error (not :class:`QueueClosedError`), so none of them
      takes a cut-off message for a whole one.
    * After :meth:`close` on the writer, readers get the messages already written, then
      :class:`QueueClosedError`.

    Example (every rank of ``tp`` runs it; index 0 writes)::

        with MessageQueue.create(mesh, "tp", writer=0) as q:
            if q.is_writer:
                q.enqueue({"step": 1, "tokens": [3, 5]})
            else:
                msg = q.dequeue(timeout=10)
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
        self._shm: shared_memory.SharedMemory | _Attached | None = None
        self._buf: memoryview | None = None
        self._unlinked = True
        self.shm_name: str | None = (
            None  # the segment's name (already unlinked once create returns)
        )
        self._slot = -1  # this reader's slot among local readers
        self._stride = _FRAG.size + max_chunk_bytes
        self._stride += -self._stride % _LINE
        self._data = _LINE * (1 + len(local))
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
            mesh: a mesh from ``Mesh.from_torch`` (its gloo group carries the setup: three
                small all-gathers, or three with ``nodes``).
            axis: the mesh axis (or tuple, or ``None`` for the whole mesh).
            writer: the writer's index along the axis.
            readers: the readers' indices (default: every other index).
            max_chunk_bytes: the size of one slot of the shared-memory ring; a larger message
                spans several slots.
            max_chunks: how many slots the ring has: how far the slowest local reader may lag
                before ``enqueue`` waits.
            timeout: seconds each call waits by default (and the setup waits for its peers).
            nodes: a :class:`NodeInfo` of the same axis from :func:`node_info` (saves an all-gather;
                tests pass one with made-up hostnames to use the socket path on one host).

        Raises:
            CommError: a rank failed to set up (named, with its error); every rank raises it.
        """
        return _build(
            "MessageQueue.create",
            mesh,
            axis,
            [(writer, readers)],
            max_chunk_bytes,
            max_chunks,
            timeout,
            nodes,
        )[0]

    # ------------------------------------------------------------------ errors
    def _err(self, op: str, cls: type[CommError], problem: str, fix: str) -> CommError:
        return cls(
            f"MessageQueue.{op}", self.axis, self.ranks, self.ranks[self.index], problem, fix
        )

    def _lost(self, op: str, peer: int, how: str) -> PeerLostError:
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
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise MeshError(f"MessageQueue: timeout must be seconds >= 0, got {timeout!r}")
        return float(timeout)

    # ------------------------------------------------------------------ shared memory counters
    def _get(self, off: int) -> int:
        assert self._buf is not None
        return int(_U64.unpack_from(self._buf, off)[0])

    def _set(self, off: int, value: int) -> None:
        assert self._buf is not None
        _U64.pack_into(self._buf, off, value)

    def _min_read(self) -> int:
        return min(self._get(_LINE * (1 + s)) for s in range(len(self.local_readers)))

    def _check_alive(self, op: str, peers: Sequence[int]) -> None:
        for p in peers:
            if p in self._conns:
                c = self._conns[p]
                r, _, _ = select.select([c], [], [], 0)
                if r and not _peek(c):
                    raise self._lost(op, p, "closed its connection (exited)")
            elif p == self.writer and self._sock is not None:
                continue  # a remote reader learns of the writer's exit from its socket
            elif not _alive(*self._pids[p]):
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

    # ------------------------------------------------------------------ writer
    def enqueue(self, obj: Any, *, timeout: float | None = None, block: bool = True) -> None:
        """Send ``obj`` (picklable) to every reader, in order. Writer only.

        ``block=False``: raise :class:`QueueFull` at once (nothing sent) unless every slot the
        message needs is free and every remote reader's socket is writable.

        Args:
            obj: the picklable object to send.
            timeout: seconds to wait at most; default: the queue's.
            block: ``False``: raise ``QueueFull`` at once instead of waiting (nothing sent).

        >>> q.enqueue({"step": 7}, timeout=5)   # doctest: +SKIP
        """
        op = "enqueue"
        self._role(op, True)
        if self._broken:
            raise self._err(
                op,
                CommError,
                f"an earlier enqueue failed after part of its message went out ({self._broken}); "
                "the readers may hold part of that message, so nothing more can be sent in order",
                "close this queue and make a new one",
            )
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        t = self._call_timeout = self._timeout(timeout)
        deadline = time.monotonic() + t
        n = len(payload)
        frags = max(1, math.ceil(n / self.max_chunk_bytes))
        if self._buf is not None and not block:
            free = self.max_chunks - (self._count - self._min_read())
            if frags > free:
                raise QueueFull(
                    f"fastdist.MessageQueue.enqueue on rank {self.ranks[self.index]}: the message "
                    f"needs {frags} slot(s), {free} of "
                    f"{self.max_chunks} are free (a reader is behind). Fix: retry later, pass "
                    "block=True, or make the queue with more slots"
                )
        if self._conns and not block:
            _, w, _ = select.select([], list(self._conns.values()), [], 0)
            if len(w) < len(self._conns):
                raise QueueFull(
                    f"fastdist.MessageQueue.enqueue on rank {self.ranks[self.index]}: "
                    "a remote reader's socket is full. Fix: retry later or pass block=True"
                )
        # a reader that exited while the ring had room is found here
        if time.monotonic() - self._last_check > _IDLE_CHECK_S:
            self._check_alive(op, self.readers)
            self._last_check = time.monotonic()
        started = False  # whether any reader may have seen part of this message
        try:
            if self._buf is not None:
                view = memoryview(payload)
                for j in range(frags):
                    if self._count - self._min_read() >= self.max_chunks:
                        self._wait(
                            op,
                            lambda: self._count - self._min_read() < self.max_chunks,
                            deadline,
                            self._lagging,
                            lambda: f"no free slot: {self._lag_text()}",
                        )
                    _fence()  # the readers' counters were read before the slot is overwritten
                    part = view[j * self.max_chunk_bytes : (j + 1) * self.max_chunk_bytes]
                    off = self._data + (self._count % self.max_chunks) * self._stride
                    _FRAG.pack_into(self._buf, off, len(part), int(j + 1 < frags))
                    self._buf[off + _FRAG.size : off + _FRAG.size + len(part)] = part
                    self._count += 1
                    _fence()  # the slot's bytes are visible before the count that publishes them
                    # publishes the slot: readers read only below this count
                    self._set(0, self._count)
                    started = True
            for idx, c in self._conns.items():
                started = True
                self._send(
                    op, idx, c, _U64.pack(n) + payload if n <= _COALESCE else _U64.pack(n), deadline
                )
                if n > _COALESCE:
                    self._send(op, idx, c, payload, deadline)
        except BaseException as e:
            # a timeout (or error) mid-message: some readers have it, or part of it; never go on as
            # if it were sent
            if started:
                self._broken = f"{type(e).__name__} in message {self._messages + 1}"
            raise
        self._messages += 1

    def _lagging(self) -> list[int]:
        low = self._count - self.max_chunks
        return [r for s, r in enumerate(self.local_readers) if self._get(_LINE * (1 + s)) <= low]

    def _lag_text(self) -> str:
        lag = self._lagging()
        return (
            "reader(s) "
            + ", ".join(f"rank {self.ranks[r]}" for r in lag)
            + f" still hold the oldest of {self.max_chunks} slots"
        )

    def _send(self, op: str, idx: int, c: socket.socket, data: bytes, deadline: float) -> None:
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

    def broadcast_object(self, obj: Any = None, *, timeout: float | None = None) -> Any:
        """The writer sends ``obj`` and returns it; a reader returns the next message (ignores
        ``obj``).

        The drop-in for ``fastdist.broadcast_object(obj, mesh, axis, src=writer)`` in a loop.

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

        ``block=False``: raise :class:`QueueEmpty` at once if no message has started to
        arrive (a message whose first part arrived is awaited whole, within the timeout).

        Args:
            timeout: seconds to wait at most; default: the queue's.
            block: ``False``: raise ``QueueEmpty`` at once when no message has started to arrive.

        Returns:
            the next message, in the order written.

        >>> msg = q.dequeue(timeout=5)   # doctest: +SKIP
        """
        op = "dequeue"
        self._role(op, False)
        t = self._call_timeout = self._timeout(timeout)
        deadline = time.monotonic() + t
        if self._sock is not None:
            obj = self._recv_message(op, deadline, block)
        else:
            obj = self._read_ring(op, deadline, block)
        self._messages += 1
        return obj

    def _writer_gone(self) -> list[int]:
        return [self.writer]

    def _await_fragment(self, op: str, deadline: float, block: bool, mid: bool = False) -> None:
        if self._get(0) > self._count:
            return
        # closed: read the count again (it may have been published just before the close, after
        # the read above)
        if self._get(8):
            _fence()
            if self._get(0) > self._count:
                return
        # closed with a message cut off: the writer's enqueue failed part-way
        if self._get(8) and mid:
            raise self._err(
                op,
                CommError,
                f"the writer, rank {self.ranks[self.writer]}, closed the queue in the middle of "
                f"message {self._messages + 1} (its enqueue failed part-way); "
                f"this rank read {self._messages} whole message(s)",
                "see the writer's log (a timeout or a lost reader); make a new queue to go on",
            )
        if self._get(8):  # closed, and everything written was read
            raise self._err(
                op,
                QueueClosedError,
                f"the writer, rank {self.ranks[self.writer]}, closed the queue; this rank read all "
                f"{self._messages} message(s)",
                "stop reading (the writer is done), or make a new queue",
            )
        if not block:
            self._check_alive_then(
                op, [self.writer], lambda: self._get(0) > self._count or bool(self._get(8))
            )
            if self._get(0) > self._count or self._get(8):
                return self._await_fragment(op, deadline, block, mid)
            raise QueueEmpty(
                f"fastdist.MessageQueue.dequeue on rank {self.ranks[self.index]}: no message. "
                "Fix: retry later, or pass block=True"
            )
        self._wait(
            op,
            lambda: self._get(0) > self._count or bool(self._get(8)),
            deadline,
            self._writer_gone,
            lambda: (
                f"the writer, rank {self.ranks[self.writer]}, sent nothing after {self._messages} "
                "message(s)"
            ),
        )
        if self._get(0) <= self._count:
            self._await_fragment(op, deadline, block, mid)  # closed meanwhile

    def _read_ring(self, op: str, deadline: float, block: bool) -> Any:
        assert self._buf is not None
        mine = _LINE * (1 + self._slot)
        parts: list[bytes] = []
        while True:
            self._await_fragment(op, deadline, block if not parts else True, mid=bool(parts))
            _fence()  # the count was read before the slot's bytes
            off = self._data + (self._count % self.max_chunks) * self._stride
            n, more = _FRAG.unpack_from(self._buf, off)
            body = self._buf[off + _FRAG.size : off + _FRAG.size + n]
            if not more and not parts:
                obj = pickle.loads(body)
                body.release()
                self._count += 1
                _fence()  # the slot was read before the writer may reuse it
                self._set(mine, self._count)
                return obj
            parts.append(bytes(body))
            body.release()
            self._count += 1
            _fence()
            self._set(mine, self._count)
            if not more:
                return pickle.loads(b"".join(parts))

    def _recv_message(self, op: str, deadline: float, block: bool) -> Any:
        assert self._sock is not None
        if not block:
            r, _, _ = select.select([self._sock], [], [], 0)
            if not r:
                raise QueueEmpty(
                    f"fastdist.MessageQueue.dequeue on rank {self.ranks[self.index]}: no message. "
                    "Fix: retry later, or pass block=True"
                )
        (n,) = _U64.unpack(self._recv_exact(op, 8, deadline, first=True))
        if n == _CLOSE:
            raise self._err(
                op,
                QueueClosedError,
                f"the writer, rank {self.ranks[self.writer]}, closed the queue; this rank read all "
                f"{self._messages} message(s)",
                "stop reading (the writer is done), or make a new queue",
            )
        return pickle.loads(self._recv_exact(op, n, deadline, first=False))

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

    # ------------------------------------------------------------------ teardown
    def close(self, *, timeout: float = 5.0) -> None:
        """Release this rank's end (idempotent). The writer marks the queue closed first: readers
        get what was written, then :class:`QueueClosedError`.

        Args:
            timeout: seconds the writer waits at most to send the close message to remote readers.
        """
        if self._closed:
            return
        self._closed = True
        if self.is_writer:
            if self._buf is not None:
                _fence()
                self._set(8, 1)
            deadline = time.monotonic() + timeout
            # a cut-off stream gets no close frame: its reader sees the cut
            for c in [] if self._broken else self._conns.values():
                try:
                    c.settimeout(max(deadline - time.monotonic(), 1e-3))
                    c.sendall(_U64.pack(_CLOSE))
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
        self._release_shm()

    def _release_shm(self) -> None:
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        if self._shm is not None:
            if not self._unlinked and isinstance(self._shm, shared_memory.SharedMemory):
                try:
                    self._shm.unlink()
                except FileNotFoundError:
                    pass
                self._unlinked = True
            self._shm.close()
            self._shm = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _peek(c: socket.socket) -> bool:
    """False when a readable socket is at EOF (or broken)."""
    try:
        return bool(c.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return True
    except OSError:
        return False


# =================================================================== building queues (collectively)
def _build(
    op: str,
    mesh: Any,
    axis: Any,
    specs: Sequence[tuple[int, Sequence[int] | None]],
    max_chunk_bytes: int,
    max_chunks: int,
    timeout: float,
    nodes: NodeInfo | None,
) -> list[MessageQueue]:
    """Set up one queue per ``(writer, readers)`` in ``specs``; every rank of the axis gets an
    object for each."""
    ranks, index, label = _group(op, mesh, axis)
    n = len(ranks)
    for arg, v in (("max_chunk_bytes", max_chunk_bytes), ("max_chunks", max_chunks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CollectiveError(
                op, label, f"{arg}={v!r} is not a positive int", f"pass {arg} >= 1"
            )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise CollectiveError(
            op, label, f"timeout={timeout!r} is not positive seconds", "pass timeout > 0"
        )
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
        if isinstance(writer, bool) or not isinstance(writer, int) or not 0 <= writer < n:
            raise CollectiveError(
                op,
                label,
                f"writer={writer!r} is not an index along the axis (size {n})",
                f"use 0..{n - 1}",
            )
        rd = tuple(i for i in range(n) if i != writer) if readers is None else tuple(readers)
        if any(
            isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n or r == writer
            for r in rd
        ) or len(set(rd)) != len(rd):
            raise CollectiveError(
                op,
                label,
                f"readers={list(rd)} must be distinct indices along the axis other than the "
                f"writer {writer}",
                f"use indices in 0..{n - 1}",
            )
        local = tuple(r for r in rd if info.same_host(r, writer))
        queues.append(
            MessageQueue(
                op_axis=label,
                ranks=ranks,
                index=index,
                writer=writer,
                readers=rd,
                local=local,
                pids=info.pids,
                max_chunk_bytes=max_chunk_bytes,
                max_chunks=max_chunks,
                timeout=timeout,
            )
        )
    try:
        _connect(op, mesh, axis, queues, ranks, index, label, max_chunks, timeout)
    except BaseException:
        # a peer died or a collective failed mid-setup: unlink this rank's segments now, not at exit
        for q in queues:
            q.close()
        raise
    return queues


def _connect(
    op: str,
    mesh: Any,
    axis: Any,
    queues: list[MessageQueue],
    ranks: tuple[int, ...],
    index: int,
    label: Any,
    max_chunks: int,
    timeout: float,
) -> None:
    """The collective part of :func:`_build`: segments and sockets made, attached, connected,
    unlinked."""
    from fastdist.comm.distributed import all_gather_object

    error = ""
    handles: dict[int, tuple[str | None, str | None, int, bytes]] = {}
    try:  # 1. writers make their segment and listening socket
        for k, q in enumerate(queues):
            if not q.is_writer:
                continue
            token = secrets.token_bytes(16)
            name: str | None = None
            host: str | None = None
            port = 0
            if q.local_readers:
                name = f"{_SHM_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
                size = q._data + max_chunks * q._stride
                shm = q._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
                q._unlinked, q.shm_name = False, name
                buf: memoryview = shm.buf  # type: ignore[assignment]
                q._buf = buf
                buf[: q._data] = bytes(q._data)
                q._set(16, _MAGIC)
            if q.remote_readers:
                lst = socket.create_server(("", 0), backlog=len(q.remote_readers) + 4)
                q._listener, host, port = lst, _address(), lst.getsockname()[1]
            handles[k] = (name, host, port or 0, token)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = f"{type(e).__name__}: {e}"
    every = all_gather_object((handles, error), mesh, axis)
    error = ""
    try:  # 2. readers attach / connect
        if not any(e[1] for e in every):
            for k, q in enumerate(queues):
                if not q.is_reader:
                    continue
                seg, addr, port, token = every[q.writer][0][k]
                if index in q.local_readers:
                    q._shm = _Attached(str(seg))
                    q._buf, q.shm_name, q._slot = q._shm.buf, str(seg), q.local_readers.index(index)
                    if q._get(16) != _MAGIC:
                        raise RuntimeError(f"segment {seg} is not a fastdist queue")
                else:
                    s = socket.create_connection((str(addr), port), timeout=timeout)
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    s.sendall(_HELLO.pack(index, token))
                    q._sock = s
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = f"{type(e).__name__}: {e}"
    every2 = all_gather_object(error, mesh, axis)
    error = ""
    # 3. every local reader attached: unlink (nothing is left in /dev/shm after a crash); accept the
    # remote readers
    try:
        for k, q in enumerate(queues):
            if q.is_writer and isinstance(q._shm, shared_memory.SharedMemory):
                q._shm.unlink()
                q._unlinked = True
            if (
                q.is_writer
                and q._listener is not None
                and not any(every2)
                and not any(e[1] for e in every)
            ):
                _accept(q, handles[k][3], time.monotonic() + timeout)
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
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


def _accept(q: MessageQueue, token: bytes, deadline: float) -> None:
    assert q._listener is not None
    want = set(q.remote_readers)
    while want:
        q._listener.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            c, _ = q._listener.accept()
        except TimeoutError as e:
            raise TimeoutError(
                f"remote reader(s) {sorted(q.ranks[i] for i in want)} did not connect within the "
                "timeout"
            ) from e
        c.settimeout(max(deadline - time.monotonic(), 1e-3))
        hello = b""
        while len(hello) < _HELLO.size:
            chunk = c.recv(_HELLO.size - len(hello))
            if not chunk:
                break
            hello += chunk
        if len(hello) != _HELLO.size:
            c.close()
            continue
        idx, tok = _HELLO.unpack(hello)
        if tok != token or idx not in want:
            c.close()
            continue
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        q._conns[idx] = c
        want.discard(idx)
    q._listener.close()
    q._listener = None


@names_this_rank
def create_mq_broadcaster(
    mesh: Any, axis: Any = None, *, writer: int = 0, **kwargs: Any
) -> MessageQueue:
    """vLLM's ``GroupCoordinator.create_mq_broadcaster``: :meth:`MessageQueue.create` with every
    other index reading. Collective.

    Args:
        mesh: a mesh from ``Mesh.from_torch``.
        axis: the axis of the queue; default: the whole mesh.
        writer: the index along ``axis`` that writes.
        **kwargs: passed to ``MessageQueue.create`` (``max_chunk_bytes``, ``max_chunks``,
            ``timeout``, ...).

    Returns:
        this rank's end of the queue.
    """
    return MessageQueue.create(mesh, axis, writer=writer, **kwargs)


@names_this_rank
def create_single_reader_mq_broadcasters(
    mesh: Any, axis: Any = None, *, reader: int = 0, **kwargs: Any
) -> tuple[MessageQueue | None, list[MessageQueue | None]]:
    """vLLM's ``create_single_reader_mq_broadcasters``: every other index writes to its own queue,
    read by ``reader``. Collective.

    Returns ``(mine, theirs)``: on a writing rank ``mine`` is its queue (to ``enqueue``) and
    ``theirs`` is empty; on the reader ``mine`` is None and ``theirs[i]`` is the queue from
    index ``i`` (None at ``reader``). One setup for all queues (four small all-gathers).

    Args:
        mesh: a mesh from ``Mesh.from_torch``.
        axis: the axis of the queues; default: the whole mesh.
        reader: the index along ``axis`` that reads every queue.
        **kwargs: passed to ``MessageQueue.create`` for every queue.

    >>> mine, theirs = create_single_reader_mq_broadcasters(mesh, "tp")        # doctest: +SKIP
    >>> replies = [q.dequeue() for q in theirs if q is not None]   # on index 0   # doctest: +SKIP
    """
    ranks, index, label = _group("create_single_reader_mq_broadcasters", mesh, axis)
    n = len(ranks)
    if isinstance(reader, bool) or not isinstance(reader, int) or not 0 <= reader < n:
        raise CollectiveError(
            "create_single_reader_mq_broadcasters",
            label,
            f"reader={reader!r} is not an index along the axis (size {n})",
            f"use 0..{n - 1}",
        )
    writers = [i for i in range(n) if i != reader]
    opts = {"max_chunk_bytes": 1 << 20, "max_chunks": 8, "timeout": 60.0, "nodes": None, **kwargs}
    qs = _build(
        "create_single_reader_mq_broadcasters",
        mesh,
        axis,
        [(w, [reader]) for w in writers],
        opts["max_chunk_bytes"],
        opts["max_chunks"],
        opts["timeout"],
        opts["nodes"],
    )
    if index == reader:
        theirs: list[MessageQueue | None] = [None] * n
        for w, q in zip(writers, qs):
            theirs[w] = q
        return None, theirs
    for w, q in zip(writers, qs):
        if w != index:
            q.close()  # a bystander's object holds nothing
    return qs[writers.index(index)], []
