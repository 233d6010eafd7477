"""Transports: how one axis group talks on one device type.

:class:`TorchTransport` makes direct c10d calls (eagerly, the least work per call);
:class:`FunctionalTransport` goes through torch's functional collectives
(``torch.ops._c10d_functional``) so that ``torch.compile`` traces a step without graph breaks.
A mesh with a ctypes backend uses :class:`fastdist.comm.native.NativeCommunicator` for device
tensors instead. All three implement :class:`fastdist.core.comm.Transport`.

Backends by tensor device: ``cpu`` -> gloo, ``cuda`` -> nccl, ``npu`` -> hccl (needs
``torch_npu``); see :func:`select_backend`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from fastdist.core.rows import pad_rows
from fastdist.errors import NoBackendError

__all__ = ["select_backend", "TorchTransport", "FunctionalTransport"]

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

    def all_to_all_rows(
        self, op: str, x: Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None
    ) -> Tensor:
        s = x.shape
        rows = s[0] if out_splits is None else sum(out_splits)  # None: equal splits both ways
        out = x.new_empty(rows, *s[1:])  # [rows received, *rest]
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=self.pg)
        return out

    def broadcast(self, op: str, x: Tensor, src: int) -> Tensor:
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

    def all_gather_rows(self, op: str, x: Tensor) -> Tensor:
        return cast(
            Tensor, _F.wait_tensor(_F.all_gather_into_tensor(x.contiguous(), self.n, self.name))
        )

    def reduce_scatter_rows(self, op: str, x: Tensor) -> Tensor:
        return cast(
            Tensor,
            _F.wait_tensor(_F.reduce_scatter_tensor(x.contiguous(), "sum", self.n, self.name)),
        )

    def all_to_all_rows(
        self, op: str, x: Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None
    ) -> Tensor:
        if out_splits is None or in_splits is None:
            out_splits = in_splits = [x.shape[0] // self.n] * self.n
        return cast(
            Tensor,
            _F.wait_tensor(
                _F.all_to_all_single(x.contiguous(), list(out_splits), list(in_splits), self.name)
            ),
        )

    def broadcast(self, op: str, x: Tensor, src: int) -> Tensor:
        return cast(Tensor, _F.wait_tensor(_F.broadcast(x.contiguous(), src, self.name)))
