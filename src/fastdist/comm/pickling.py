"""How a message between ranks becomes bytes and back: ``pickle``, except for the tensors torch's
own pickling cannot bring back.

On torch 2.13 a tensor of a dtype outside :data:`TORCH_PICKLES` (every float8, uint16, uint32,
uint64, complex32, ...) pickles, but ``pickle.loads`` of that pickle fails
(``AttributeError: ... UntypedStorage has no attribute 'dtype'``). Here such a tensor travels as
its storage's bytes and comes back as an equal tensor (:func:`rebuild_tensor`: the same dtype,
shape, strides, storage offset, values and ``requires_grad``; a ``Parameter`` stays one; a
conjugate or negative view arrives resolved, with its values). Every other object pickles as
``pickle`` does it, and the bytes load with plain ``pickle.loads`` on any rank that imports
fastdist.

The one way fastdist pickles messages: the object helpers of :mod:`fastdist.comm.p2p` and
:class:`~fastdist.comm.StatelessGroup` call :func:`dumps` / :func:`loads`, and
:class:`~fastdist.serving.MessageQueue`'s writer keeps an :class:`Encoder`.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from typing import IO, Any

import torch

__all__ = ["TORCH_PICKLES", "Encoder", "dumps", "loads", "pickler", "rebuild_tensor"]

#: the dtypes whose tensors torch's own pickling brings back (torch 2.13); a tensor of any other
#: dtype travels as its storage's bytes
TORCH_PICKLES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
    }
)


def rebuild_tensor(
    data: torch.Tensor,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
) -> torch.Tensor:
    """A reader's copy of a tensor that was pickled as its storage's bytes: ``data`` (uint8,
    the whole storage) viewed as ``dtype`` with the tensor's offset, size and stride.

    Args:
        data: the storage's bytes, a uint8 tensor on the tensor's device.
        dtype: the tensor's dtype.
        offset: its storage offset, in elements.
        size: its shape.
        stride: its strides, in elements.
        requires_grad: whether it required grad.

    Returns:
        the tensor, sharing ``data``'s storage.
    """
    t = torch.empty(0, dtype=dtype, device=data.device)
    t.set_(data.untyped_storage(), offset, size, stride)
    return t.requires_grad_(requires_grad)


def _reduce_tensor(t: torch.Tensor) -> Any:
    """How a plain tensor pickles: as torch does, unless torch could not unpickle it."""
    if (
        t.dtype in TORCH_PICKLES
        or t.layout != torch.strided
        or t.is_quantized
        or t.device.type == "meta"
        or (t.requires_grad and not t.is_leaf)  # torch's own refusal, with its message
    ):
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # type: ignore[no-untyped-call]
    if t.is_conj() or t.is_neg():  # the bytes hold the values before the lazy conj / negation
        t = t.resolve_conj().resolve_neg()
    data = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    shape = (t.storage_offset(), tuple(t.shape), t.stride(), t.requires_grad)
    return rebuild_tensor, (data, t.dtype, *shape)


def pickler(buf: IO[bytes]) -> pickle.Pickler:
    """A pickler (highest protocol) writing to ``buf`` whose tensors of a dtype outside
    :data:`TORCH_PICKLES` go as their storage's bytes (:func:`rebuild_tensor`); every other
    object as ``pickle.dumps`` writes it.

    Args:
        buf: the binary file to write to.

    Returns:
        the pickler (its memo grows with each ``dump``: ``clear_memo()`` between messages).
    """
    p = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    p.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}
    return p


def dumps(obj: Any) -> bytes:
    """``obj``'s pickle, which :func:`loads` (or ``pickle.loads``) brings back equal on any
    rank: ``pickle.dumps``, except that a tensor torch's own pickling cannot bring back (float8,
    uint16/32/64, complex32, ...) goes as its storage's bytes.

    Args:
        obj: a picklable object.

    Returns:
        the pickle.

    Raises:
        whatever ``pickle.dumps`` raises for an object that does not pickle (a lambda, a lock, a
        tensor requiring grad that is not a leaf).
    """
    buf = io.BytesIO()
    pickler(buf).dump(obj)
    return buf.getvalue()


def loads(data: bytes | bytearray | memoryview) -> Any:
    """The object :func:`dumps` (or an :class:`Encoder`) pickled.

    Args:
        data: the pickle.

    Returns:
        the object.

    Raises:
        whatever ``pickle.loads`` raises for a pickle this process cannot load (a class it
        cannot import, a device it lacks).
    """
    return pickle.loads(data)


class Encoder:
    """A writer's pickler (highest protocol), kept between messages: :func:`dumps` without a new
    buffer and pickler for each message (``pickle.loads`` of its bytes brings the message back,
    float8, uint16/32/64 and complex32 tensors included)."""

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self._pickler = pickler(self._buf)

    def dumps(self, obj: Any) -> memoryview:
        """``obj``'s pickle: a view of this encoder's buffer, valid until the next call (no copy
        of a large message besides the pickling itself).

        Args:
            obj: a picklable object.

        Returns:
            a view of the pickle.
        """
        try:
            self._buf.seek(0)
            self._buf.truncate()
        except BufferError:  # a view of the last message is still held: leave it that buffer
            self._buf = io.BytesIO()
            self._pickler = pickler(self._buf)
        self._pickler.clear_memo()
        try:
            self._pickler.dump(obj)
        except BaseException:
            self._pickler = pickler(self._buf)  # its state after a failed dump is not for reuse
            raise
        return self._buf.getbuffer()
