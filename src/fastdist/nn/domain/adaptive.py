"""Adaptive pooling of a domain-parallel field (``AdaptiveAvgPool`` / ``AdaptiveMaxPool`` 1-3d).

Along a split dim of whole length ``L`` pooled to ``o`` rows, bin ``j`` spans rows
``floor(j L / o)`` to ``ceil((j + 1) L / o)``. A rank whose block starts at row ``a`` and holds
``r`` rows with ``a o`` and ``r o`` multiples of ``L`` holds exactly the bins ``a o / L`` to
``(a + r) o / L``, and pooling its block alone to ``r o / L`` rows gives them (even blocks: ``o``
divisible by the ranks). Pooled to one row (global pooling), each rank pools its block and the
ranks combine: the mean weighted by each rank's rows (``psum``), the max (``pmax``); the result is
the whole domain's on every rank (``pvary``'d back, e.g. for a squeeze-excitation's product with
the field). Such a one-row result leaves the region as it is (``pmean`` over the axis: its
gradient counted once), and a window over it (a halo) raises. Any other output size is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.domain.windows import (
    Split,
    ragged_mask,
    ragged_sizes,
    region,
    rows_seen,
    split_here,
    zero_padding_rows,
)
from fastdist.ops import all_gather, pmax, psum, pvary

__all__ = ["domain_adaptive_pool"]

_ADAPTIVE: dict[tuple[str, int], Callable[..., Tensor]] = {
    ("avg", 1): F.adaptive_avg_pool1d, ("avg", 2): F.adaptive_avg_pool2d,
    ("avg", 3): F.adaptive_avg_pool3d, ("max", 1): F.adaptive_max_pool1d,
    ("max", 2): F.adaptive_max_pool2d, ("max", 3): F.adaptive_max_pool3d,
}  # fmt: skip


def _rows(x: Tensor, mesh: Mesh, axis: str, dim: int, where: str) -> list[int]:
    """Every rank's rows along ``dim`` (simulated ranks: even blocks, or the ragged sizes of
    blocks padded to one shape)."""
    if mesh.backend is None:
        sizes = ragged_sizes(mesh, axis, dim - x.dim(), x.shape[dim], where)
        return sizes if sizes is not None else [x.shape[dim]] * mesh.axis_size(axis)
    got = all_gather(x.new_tensor([float(x.shape[dim])]), mesh, axis)
    return [int(r) for r in got.tolist()]


def domain_adaptive_pool(
    x: Tensor,
    kind: str,
    nsp: int,
    output: Sequence[int | None],
    *,
    mesh: Mesh,
    split: Split,
    where: str,
) -> Tensor:
    """``F.adaptive_{kind}_pool{nsp}d(x, output)`` of the whole domain on this rank's block
    ``[N, C, *spatial]``: this rank's rows of the result (or, pooled to one row along a split
    dim, the whole result on every rank)."""
    local: list[int | None] = list(output)
    pooled: list[tuple[str, float]] = []  # (axis, this rank's share of the rows)
    mask = ragged_mask(x, nsp, mesh, split, where)
    if mask is not None:  # simulated uneven blocks: padding rows out of every bin they reach
        x = torch.where(mask, x, x.new_full((), float("-inf") if kind == "max" else 0.0))
    for i, d, axis in split_here(split, nsp):
        rows = _rows(x, mesh, axis, x.dim() + d, where)
        whole = sum(rows)
        o = whole if output[i] is None else int(output[i])  # type: ignore[arg-type]
        if o == 1 and len(rows) > 1:
            local[i] = 1
            pooled.append((axis, x.shape[x.dim() + d] / whole))
            continue
        starts = [sum(rows[:k]) for k in range(len(rows))]
        if any((a * o) % whole or (r * o) % whole for a, r in zip(starts, rows, strict=True)):
            raise ParallelizeError(
                f"domain parallel: {where} pools the split dim {d} ({whole} rows in blocks of "
                f"{rows}) to {o} rows: the blocks do not hold whole bins. Fix: an output size "
                f"divisible by the {len(rows)} ranks of {axis!r} (even blocks), 1 (global "
                "pooling), or end the region before it"
            )
        # (padded blocks: the bins of the padded rows follow, the same bin width)
        local[i] = x.shape[x.dim() + d] * o // whole
    y = _ADAPTIVE[(kind, nsp)](x, tuple(local))
    done = {a for a, _ in pooled}
    if mask is not None:  # the bins of padding rows zeroed (global ones are the whole's)
        y = y.nan_to_num(0.0, 0.0, 0.0)
        y = zero_padding_rows(y, nsp, mesh, tuple(p for p in split if p[1] not in done), where)
    # a block pooled to one row marks its axis thin; the global ones are the whole's
    rows_seen(x.shape, y, nsp, tuple(p for p in split if p[1] not in done), where)
    if not pooled:
        return y
    axes = tuple(a for a, _ in pooled)
    if kind == "max":
        y = pmax(y, mesh, axes)
    else:
        y = psum(y * math.prod(share for _, share in pooled), mesh, axes)
    region().pooled.update(axes)
    return pvary(y, mesh, axes)
