"""Transports: how one axis group talks on one device type.

:class:`TorchTransport` makes direct c10d calls (eagerly, the least work per call);
:class:`FunctionalTransport` goes through torch's functional collectives
(``torch.ops._c10d_functional``) so that ``torch.compile`` traces a step without graph breaks.
A mesh with a ctypes backend uses :class:`fastdist.comm.native.NativeCommunicator` for device
tensors instead. All three implement :class:`fastdist.core.comm.Transport`.

Backends by tensor device: ``cpu`` -> gloo, ``cuda`` -> nccl, ``npu`` -> hccl (needs
``torch_npu``); see :func:`select_backend`.

Dtypes: the data-movement collectives (all-gather, all-to-all, broadcast and the v-row variants
built on them) carry a tensor of any dtype bit for bit. c10d backends refuse many dtypes (gloo:
int16, uint16/32/64, every float8, float4 and bits dtype with "Invalid scalar type"; its
functional all-to-all also every complex dtype; NCCL and HCCL have gaps of their own), so a
tensor whose dtype is not in :data:`CARRIED` travels as a bitwise view of the dtype
:func:`wire_dtype` names (same item size: 1 byte -> uint8, 2 -> float16, 4 -> int32, 8 -> int64;
complex128 -> float64 pairs; the one table, in ``fastdist.core.carriers``, which simulated ranks'
movement rules use too) and is viewed back on arrival: no copy, no arithmetic. Quantized
dtypes (a scale per tensor) have no such view: :func:`wire_dtype` returns None and the op raises a
:class:`~fastdist.errors.CollectiveError` before anything is sent. Reductions are untouched (their
dtypes are checked above, ``ReductionDtypeError``).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor

from fastdist.core.carriers import CARRIED, wire_dtype
from fastdist.core.rows import pad_rows
from fastdist.errors import CollectiveError, NoBackendError

__all__ = ["select_backend", "wire_dtype", "CARRIED", "TorchTransport", "FunctionalTransport"]

_F = torch.ops._c10d_functional


def select_backend(device_type: str, *, npu_available: bool | None = None) -> str:
    """The c10d backend for tensors on ``device_type``: cpu -> gloo, cuda -> nccl, npu -> hccl.

    ``npu_available`` defaults to whether ``torch_npu`` can be imported.

    Args:
        device_type: ``"cpu"``, ``"cuda"`` or ``"npu"``.
        npu_available: whether ``torch_npu`` is usable; default: whether it can be imported.

    Returns:
        the c10d backend name: ``"gloo"``, ``"nccl"`` or ``"hccl"``.

    >>> select_backend("cpu"), select_backend("cuda"), select_backend("npu", npu_available=True)
    ('gloo', 'nccl', 'hccl')
    """
    if device_type == "cpu":
        return "gloo"
    if device_type == "cuda":
        return "nccl"
    if device_type == "npu":
        if npu_available is None:
            npu_available = importlib.util.find_spec("torch_npu") is not None
        if not npu_available:
            raise NoBackendError(
                "fastdist: NPU tensors need the HCCL backend from torch_npu, which is not "
                "importable. Fix: pip install torch_npu"
            )
        return "hccl"
    raise NoBackendError(
        f"fastdist: no collective backend for {device_type!r} tensors. "
        "Fix: move tensors to cpu, cuda or npu"
    )


def _to_wire(op: str, name: str, x: Tensor) -> Tensor:
    """``x`` contiguous, viewed bitwise as its :func:`wire_dtype` (rows unchanged); an error naming
    ``op`` before anything is sent for a dtype that has none."""
    wire = wire_dtype(x.dtype)
    if wire is None:
        raise CollectiveError(
            op,
            name,
            f"a {x.dtype} tensor cannot be moved between ranks: it has no bitwise view as a dtype "
            "the c10d backends carry (a quantized tensor's values need its scale and zero point)",
            "send x.int_repr() (and its q_scale()/q_zero_point()) and quantize on arrival, or "
            "x.dequantize()",
        )
    y = x.contiguous()
    if wire is x.dtype:
        return y
    if wire.itemsize == x.dtype.itemsize:
        return y.view(wire)
    return y.unsqueeze(-1).view(wire)  # [*s, itemsize ratio]: rows unchanged


def _from_wire(y: Tensor, dtype: torch.dtype) -> Tensor:
    """The inverse of :func:`_to_wire`: ``y`` viewed back as ``dtype``."""
    if y.dtype is dtype:
        return y
    if y.dtype.itemsize == dtype.itemsize:
        return y.view(dtype)
    return y.view(dtype).squeeze(-1)


_Move = TypeVar("_Move", bound=Callable[..., Tensor])


def _bitwise(move: _Move) -> _Move:
    """A data-movement method ``move(self, op, x, *rest)`` that carries any dtype: ``x`` outside
    :data:`CARRIED` is sent as its :func:`wire_dtype` view (:func:`_to_wire`, which raises for a
    dtype with none) and the result viewed back; a carried ``x`` goes as it is (one set lookup)."""

    @functools.wraps(move)
    def run(self: Any, op: str, x: Tensor, *rest: Any) -> Tensor:
        dtype = x.dtype
        if dtype in CARRIED:
            return move(self, op, x, *rest)
        return _from_wire(move(self, op, _to_wire(op, self.name, x), *rest), dtype)

    return cast(_Move, run)


_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


class TorchTransport:
    """torch.distributed for one axis group on one device type, called eagerly.

    Direct c10d calls on the group: the least work per call (about half the CPU time of
    the functional collectives on small messages). Outputs are new tensors; inputs are
    never written. Under ``torch.compile`` :class:`FunctionalTransport` takes its place.
    """

    def __init__(self, pg: Any, n: int) -> None:
        self.pg, self.name, self.n = pg, str(pg.group_name), n

    def all_reduce(self, op: str, x: Tensor, reduce_op: str) -> Tensor:
        # a contiguous copy, what c10d writes into; a contiguous x copied as it is laid out
        # (clone() keeps its strides): torch parses that call faster than one with memory_format=
        y = x.clone() if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(y, op=_REDUCE_OPS[reduce_op], group=self.pg)
        return y

    @_bitwise
    def all_gather_rows(self, op: str, x: Tensor) -> Tensor:
        s = x.shape  # read once: each read builds a torch.Size
        # the sizes as separate ints: torch parses them faster than a tuple (as torch.empty(n))
        out = x.new_empty(self.n * s[0], *s[1:])  # [n * s0, *rest]
        dist.all_gather_single(out, x.contiguous(), group=self.pg)
        return out

    def reduce_scatter_rows(self, op: str, x: Tensor) -> Tensor:
        s = x.shape
        out = x.new_empty(s[0] // self.n, *s[1:])  # [s0 / n, *rest]
        dist.reduce_scatter_single(out, x.contiguous(), group=self.pg)
        return out

    @_bitwise
    def all_to_all_rows(
        self, op: str, x: Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None
    ) -> Tensor:
        s = x.shape
        rows = s[0] if out_splits is None else sum(out_splits)  # None: equal splits both ways
        out = x.new_empty(rows, *s[1:])  # [rows received, *rest]
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=self.pg)
        return out

    @_bitwise
    def broadcast(self, op: str, x: Tensor, src: int) -> Tensor:
        # x may be a wire view of the caller's tensor (_bitwise): the clone is what c10d writes
        y = x.clone() if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
        dist.broadcast(y, group_src=src, group=self.pg)
        return y

    def all_gather_v_rows(self, op: str, x: Tensor, sizes: Sequence[int], index: int) -> Tensor:
        """Pad every member's rows to the largest size, all-gather, drop the padding."""
        m = max(sizes)
        # [n, m, *f]
        got = self.all_gather_rows(op, pad_rows(x[: sizes[index]], m)).unflatten(0, (self.n, m))  # type: ignore[no-untyped-call]
        return torch.cat([got[i, : sizes[i]] for i in range(self.n)])  # [sum, *f]

    def reduce_scatter_v_rows(self, op: str, x: Tensor, sizes: Sequence[int], index: int) -> Tensor:
        """Pad every chunk to the largest size, reduce-scatter, drop the padding."""
        m = max(sizes)
        padded = torch.cat([pad_rows(t, m) for t in torch.split(x, list(sizes))])  # [n * m, *f]
        return self.reduce_scatter_rows(op, padded)[: sizes[index]]  # [sizes[me], *f]


class FunctionalTransport(TorchTransport):
    """The same collectives through torch's functional collectives, which dynamo traces (used under
    ``torch.compile``).

    Built from the group's name (a constant in the graph), not the group object.
    """

    def __init__(self, name: str, n: int) -> None:
        self.pg, self.name, self.n = None, name, n

    def all_reduce(self, op: str, x: Tensor, reduce_op: str) -> Tensor:
        return cast(Tensor, _F.wait_tensor(_F.all_reduce(x.contiguous(), reduce_op, self.name)))

    @_bitwise
    def all_gather_rows(self, op: str, x: Tensor) -> Tensor:
        out = _F.wait_tensor(_F.all_gather_into_tensor(x.contiguous(), self.n, self.name))
        return cast(Tensor, out)

    def reduce_scatter_rows(self, op: str, x: Tensor) -> Tensor:
        return cast(
            Tensor,
            _F.wait_tensor(_F.reduce_scatter_tensor(x.contiguous(), "sum", self.n, self.name)),
        )

    @_bitwise
    def all_to_all_rows(
        self, op: str, x: Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None
    ) -> Tensor:
        if out_splits is None or in_splits is None:
            out_splits = in_splits = [x.shape[0] // self.n] * self.n
        y = x.contiguous()
        out = _F.wait_tensor(_F.all_to_all_single(y, list(out_splits), list(in_splits), self.name))
        return cast(Tensor, out)

    @_bitwise
    def broadcast(self, op: str, x: Tensor, src: int) -> Tensor:
        out = _F.wait_tensor(_F.broadcast(x.contiguous(), src, self.name))
        return cast(Tensor, out)
