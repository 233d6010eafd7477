"""The shared-memory ring buffer under :class:`~fastdist.serving.MessageQueue`: one writer, the
readers on its host.

Layout of the segment (``multiprocessing.shared_memory``, named ``fdmq_<pid>_<random>``)::

    line 0          the written count (offset 0), the closed flag (8), the magic number (16)
    line 1 + s      local reader s's read count (each counter on its own 64-byte cache line)
    slots           max_chunks slots of ``stride`` bytes: a fragment header (its length, 1 if
                    more fragments of the message follow), then up to max_chunk_bytes of body

Fragment ``k`` lives in slot ``k % max_chunks``. The writer fills a slot, then publishes the
written count; a reader reads below that count, then publishes its own count, which frees the
slot. :class:`ShmRing` holds the bytes; the waiting, the timeouts and the errors are the queue's.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import struct
import threading
from multiprocessing import resource_tracker, shared_memory

__all__ = ["SHM_PREFIX", "ShmRing", "fence"]

SHM_PREFIX = "fdmq_"  # every segment's name starts with it (then the writer's pid)
_U64 = struct.Struct("<Q")
# a slot's header: fragment length, 1 if more fragments of the message follow
_FRAG = struct.Struct("<QQ")
_MAGIC = 0xFA57D157_0001
_LINE = 64  # each counter on its own cache line
_WRITTEN, _CLOSED, _MAGIC_AT = 0, 8, 16  # offsets in line 0

_FENCE_LOCK = threading.Lock()


def fence() -> None:
    """A full memory barrier (a lock's acquire and release issue one), between a slot's bytes and
    its counter: needed where the CPU reorders memory accesses (ARM); x86 keeps them in order
    anyway."""
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


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


class ShmRing:
    """One queue's ring in shared memory: the writer's end (:meth:`create`) or a local reader's
    (:meth:`attach`).

    Args:
        name: the segment's name.
        segment: the writer's ``SharedMemory`` or a reader's mapping.
        readers: how many local readers (counters) the ring has.
        max_chunk_bytes: the most body bytes one slot holds.
        max_chunks: how many slots the ring has.
    """

    def __init__(
        self,
        name: str,
        segment: shared_memory.SharedMemory | _Attached,
        readers: int,
        max_chunk_bytes: int,
        max_chunks: int,
    ) -> None:
        self.name, self.max_chunks = name, max_chunks
        self._segment: shared_memory.SharedMemory | _Attached | None = segment
        self._buf: memoryview | None = segment.buf
        self._readers = readers
        self._data, self._stride, _ = self.layout(readers, max_chunk_bytes, max_chunks)
        # the writer unlinks the name once every local reader attached (see unlink)
        self._unlinked = not isinstance(segment, shared_memory.SharedMemory)

    @staticmethod
    def layout(readers: int, max_chunk_bytes: int, max_chunks: int) -> tuple[int, int, int]:
        """``(data, stride, size)``: where the slots start, the bytes per slot (a whole number of
        cache lines), the segment's size."""
        stride = _FRAG.size + max_chunk_bytes
        stride += -stride % _LINE
        data = _LINE * (1 + readers)
        return data, stride, data + max_chunks * stride

    @classmethod
    def create(cls, readers: int, max_chunk_bytes: int, max_chunks: int) -> ShmRing:
        """The writer's end: a new segment, its counters zeroed and its magic number set.

        Args:
            readers: how many local readers the ring has.
            max_chunk_bytes: the most body bytes one slot holds.
            max_chunks: how many slots the ring has.
        """
        name = f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        data, _, size = cls.layout(readers, max_chunk_bytes, max_chunks)
        ring = cls(
            name,
            shared_memory.SharedMemory(name=name, create=True, size=size),
            readers,
            max_chunk_bytes,
            max_chunks,
        )
        buf = ring._view()
        buf[:data] = bytes(data)
        _U64.pack_into(buf, _MAGIC_AT, _MAGIC)
        return ring

    @classmethod
    def attach(cls, name: str, readers: int, max_chunk_bytes: int, max_chunks: int) -> ShmRing:
        """A local reader's end of the writer's segment ``name``.

        Args:
            name: the segment's name (from the writer).
            readers: how many local readers the ring has.
            max_chunk_bytes: the most body bytes one slot holds.
            max_chunks: how many slots the ring has.

        Raises:
            RuntimeError: the segment is not a fastdist queue's.
        """
        ring = cls(name, _Attached(name), readers, max_chunk_bytes, max_chunks)
        if ring._get(_MAGIC_AT) != _MAGIC:
            ring.close()
            raise RuntimeError(f"segment {name} is not a fastdist queue")
        return ring

    # ------------------------------------------------------------------ counters
    def _view(self) -> memoryview:
        assert self._buf is not None, "the ring was closed"
        return self._buf

    def _get(self, off: int) -> int:
        return int(_U64.unpack_from(self._view(), off)[0])

    def _set(self, off: int, value: int) -> None:
        _U64.pack_into(self._view(), off, value)

    def written(self) -> int:
        """How many fragments the writer published."""
        return self._get(_WRITTEN)

    def publish(self, count: int) -> None:
        """The writer: fragments below ``count`` may be read."""
        self._set(_WRITTEN, count)

    def closed(self) -> bool:
        """Whether the writer closed the queue."""
        return bool(self._get(_CLOSED))

    def mark_closed(self) -> None:
        """The writer: the queue is closed (after every fragment published so far)."""
        fence()
        self._set(_CLOSED, 1)

    def read_count(self, slot: int) -> int:
        """How many fragments local reader ``slot`` has read."""
        return self._get(_LINE * (1 + slot))

    def set_read_count(self, slot: int, count: int) -> None:
        """Local reader ``slot`` has read the fragments below ``count`` (their slots are free)."""
        self._set(_LINE * (1 + slot), count)

    def min_read(self) -> int:
        """The slowest local reader's count."""
        return min(self.read_count(s) for s in range(self._readers))

    # ------------------------------------------------------------------ slots
    def write(self, count: int, part: memoryview, more: bool) -> None:
        """Place fragment ``count`` (``more``: the message goes on in the next fragment); the
        caller made sure its slot is free and publishes it afterwards."""
        buf = self._view()
        off = self._data + (count % self.max_chunks) * self._stride
        _FRAG.pack_into(buf, off, len(part), int(more))
        buf[off + _FRAG.size : off + _FRAG.size + len(part)] = part

    def read(self, count: int) -> tuple[memoryview, bool]:
        """Fragment ``count``'s body (a view into the ring: release it before the slot is freed)
        and whether more fragments of its message follow."""
        buf = self._view()
        off = self._data + (count % self.max_chunks) * self._stride
        n, more = _FRAG.unpack_from(buf, off)
        return buf[off + _FRAG.size : off + _FRAG.size + n], bool(more)

    # ------------------------------------------------------------------ teardown
    def unlink(self) -> None:
        """The writer: remove the segment's name (the mappings stay valid), so nothing is left in
        ``/dev/shm`` after a crash. Idempotent; a no-op on a reader."""
        if not self._unlinked and isinstance(self._segment, shared_memory.SharedMemory):
            self._segment.unlink()
        self._unlinked = True

    def close(self) -> None:
        """Unmap this end (the writer unlinks the name first if it has not). Idempotent."""
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        if self._segment is not None:
            with contextlib.suppress(FileNotFoundError):
                self.unlink()
            self._segment.close()
            self._segment = None
