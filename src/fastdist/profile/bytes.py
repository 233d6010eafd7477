"""Bytes of a collective in the nccl-tests definitions
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): its size S, its
bus-bandwidth factor and the latency terms of its ring.

>>> bus_factor("allreduce", 8)
1.75
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fastdist.errors import ProfileError

__all__ = ["bus_factor", "ring_steps", "traffic"]


def bus_factor(kind: str, n: int) -> float:
    """The nccl-tests bus-bandwidth factor of a collective ``kind`` over ``n`` ranks.

    ``bus bytes = size * factor``: what each rank sends over its link in the ring (or
    pairwise) algorithm, so ``bus bytes / time`` compares with the link bandwidth.

    ===============  ==================  ====================================
    kind             factor              size S (bytes)
    ===============  ==================  ====================================
    ``allreduce``    ``2(n-1)/n``        the buffer (input = output)
    ``allgather``    ``(n-1)/n``         the gathered output (n x input)
    ``reducescatter`` ``(n-1)/n``        the input (n x output)
    ``alltoall``     ``(n-1)/n``         one rank's whole send buffer
    ``gather`` / ``scatter`` ``(n-1)/n`` the whole gathered (scattered) buffer
    ``broadcast``    ``1``               the buffer
    ``sendrecv``     ``1``               one rank's send buffer
    ===============  ==================  ====================================

    Args:
        kind: the nccl-tests collective (the table's first column).
        n: the ranks in the group.

    Returns:
        the factor: bus bytes per byte of the size S.

    >>> bus_factor("allreduce", 4), bus_factor("allgather", 4), bus_factor("broadcast", 4)
    (1.5, 0.75, 1.0)
    """
    if n <= 1:
        return 0.0
    if kind == "allreduce":
        return 2 * (n - 1) / n
    if kind in ("allgather", "reducescatter", "alltoall", "gather", "scatter"):
        return (n - 1) / n
    if kind in ("broadcast", "sendrecv"):
        return 1.0
    raise ProfileError(
        "bus_factor",
        f"unknown collective kind {kind!r}",
        "use one of allreduce, allgather, reducescatter, alltoall, gather, scatter, broadcast, "
        "sendrecv",
    )


def ring_steps(kind: str, n: int) -> int:
    """Latency terms of the ring (pairwise) algorithm: sequential messages per rank."""
    if n <= 1:
        return 0
    if kind == "allreduce":
        return 2 * (n - 1)
    if kind == "sendrecv":
        return 1
    return n - 1


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def traffic(
    op: str, n: int, tensors: Sequence[Any], params: Mapping[str, Any], out: Any
) -> tuple[str, int, float, bool] | None:
    """``(kind, size S, fraction of ranks that send, size is an upper bound)`` of one per-rank op;
    ``None``: moves no data."""
    x = tensors[0]
    row = _nbytes(tuple(x.shape[1:]), x.dtype)
    if op in ("psum", "pmean", "pmax", "pmin"):
        return "allreduce", _nbytes(tuple(x.shape), x.dtype), 1.0, False
    # pmax/pmin backward: all-reduce (min) of an int64 winner index per element
    if op == "select_extreme":
        return "allreduce", _nbytes(tuple(x.shape), torch.int64), 1.0, False
    if op in ("all_gather", "all_gather_invariant"):
        return "allgather", _nbytes(tuple(out.shape), out.dtype), 1.0, False
    if op == "psum_scatter":
        return "reducescatter", _nbytes(tuple(x.shape), x.dtype), 1.0, False
    if op == "all_to_all":
        return "alltoall", _nbytes(tuple(x.shape), x.dtype), 1.0, False
    if op == "ppermute":
        perm = list(params["perm"])
        movers = sum(1 for s, d in zip(perm[0::2], perm[1::2]) if s != d)
        return "sendrecv", _nbytes(tuple(x.shape), x.dtype), movers / n, False
    if op == "halo_swap":  # both edges [2, w, ...]: each half to one neighbour, at once
        return "sendrecv", _nbytes(tuple(x.shape), x.dtype), 1.0, False
    if op == "broadcast":
        return "broadcast", _nbytes(tuple(x.shape), x.dtype), 1.0, False
    if op == "all_gather_v":
        return "allgather", sum(params["sizes"]) * row, 1.0, False
    if op == "reduce_scatter_v":
        return "reducescatter", sum(params["sizes"]) * row, 1.0, False
    if op == "gather_v":
        return "gather", sum(params["sizes"]) * row, 1.0, False
    if op == "scatter_v":
        return "scatter", sum(params["sizes"]) * row, 1.0, False
    # the split sizes are data: the whole send buffer bounds what is sent
    if op == "ragged_all_to_all":
        return "alltoall", _nbytes(tuple(x.shape), x.dtype), 1.0, True
    return None  # pvary, local_chunk, keep_src: local
