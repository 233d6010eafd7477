"""Halo exchange: a block of a split spatial domain padded with its neighbours' edge rows
(``halo_exchange``), composed from ``ppermute`` (conventions in ``fastdist.ops``).

No new primitive: the op is two ``ppermute``s of edge rows (one per side) and local slicing,
padding and concatenation, so its gradient is theirs: each received halo row's gradient goes
back along the inverse pairs and is added into the sender's edge row (the transpose of the
exchange), and its replication rule is ``ppermute``'s (``V`` to ``V``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fastdist.core.mesh import AxisName, Mesh
from fastdist.core.primitive import GroupSpec
from fastdist.errors import CollectiveError
from fastdist.ops.permutes import axis_index, ppermute_p
from fastdist.ops.prelude import (
    apply_primitive,
    check_sizes,
    enter,
    local_rows,
    names_this_rank,
    norm_dim,
)

__all__ = ["halo_exchange"]

#: The padding at the domain's two ends, by ``torch.nn.Conv*d``'s ``padding_mode`` names.
MODES = ("zeros", "circular", "replicate", "reflect")


@names_this_rank
def halo_exchange(
    x: Tensor,
    mesh: Mesh,
    axis: AxisName,
    dim: int,
    width: int | tuple[int, int],
    *,
    mode: str = "zeros",
    sizes: Sequence[int] | None = None,
) -> Tensor:
    """Pad this rank's block of a domain split along ``dim`` over ``axis`` with its neighbours'
    edge rows (the halo), as ``torch.nn.functional.pad`` pads the whole domain.

    The domain is the blocks of the ranks along ``axis`` concatenated along ``dim`` in axis
    order. Rank ``i`` gets ``[before rows of rank i-1 | its own rows | after rows of rank
    i+1]``. At the domain's ends (rank 0's ``before``, rank ``n-1``'s ``after``) ``mode`` says
    what the rows are, as ``padding_mode`` does for ``torch.nn.Conv*d``: ``"zeros"``,
    ``"circular"`` (periodic: the ring wraps around), ``"replicate"`` or ``"reflect"``.
    Several split dims (a 2-D or 3-D decomposition) take one call per dim, each on the result
    of the previous one: the corners arrive with the second call.

    Shape: ``dim`` grows by ``before + after`` rows. Gradient: the transpose of the exchange:
    the gradients of the received halo rows are sent back and added into the sender's edge rows
    (and, for ``replicate`` / ``reflect``, into the end ranks' own rows they copy). Built on
    :func:`ppermute` (two per call), so the replication rule is its: varying to varying.

    Uneven blocks: ``sizes[i]`` is the row count of rank ``i`` along ``dim``; a rank's input
    may hold more rows (padding, ignored; simulated ranks share one shape, so there every
    input has at least ``max(sizes)`` rows). The result holds ``before + sizes[i] + after``
    valid rows first, then zeros up to ``before + x.shape[dim] + after`` rows.

    Args:
        x: this rank's block of the domain (inside :func:`fastdist.simulate`, each rank's slice
            of the input).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis the domain is split over (a tuple of axes: one flattened axis,
            row-major).
        dim: the split dim of ``x``.
        width: the halo rows on each side, an int, or ``(before, after)`` (e.g. ``(k - 1, 0)``
            for a causal convolution). Each must be at most the smallest block's rows
            (``reflect``: the end blocks need one more row than the halo they reflect).
        mode: the padding at the domain's ends: ``"zeros"``, ``"circular"``, ``"replicate"``
            or ``"reflect"``.
        sizes: the row count of each rank's block along ``dim``, in axis order (the same list
            on every rank); ``None``: every block is ``x.shape[dim]`` rows.

    Returns:
        this rank's block with its halo: ``before + x.shape[dim] + after`` rows along ``dim``
        (with ``sizes``: the valid rows first, then zeros).

    Raises:
        CollectiveError: a width wider than a block, an unknown ``mode``, ``sizes`` of the
            wrong length, or fewer rows than the block's size.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"sp": 2})
    >>> pad = fd.simulate(lambda x: fd.halo_exchange(x, mesh, "sp", 0, 1), mesh)
    >>> pad(torch.tensor([[1., 2., 3.], [4., 5., 6.]]))  # rank 0: 1 2 3, rank 1: 4 5 6
    tensor([[0., 1., 2., 3., 4.],
            [3., 4., 5., 6., 0.]])
    """
    x, spec = enter("halo_exchange", x, mesh, axis)
    d = norm_dim("halo_exchange", axis, "dim", dim, x.dim())
    lo, hi = _widths(axis, width)
    if mode not in MODES:
        raise CollectiveError(
            "halo_exchange",
            axis,
            f"mode={mode!r} is not a padding mode",
            f"pass one of {', '.join(map(repr, MODES))}",
        )
    simulated = spec.comm is None
    index = None if simulated else spec.comm.index  # type: ignore[union-attr]
    xm = x.movedim(d, 0)  # [C, *rest]: the split dim first
    rows = xm.shape[0]
    sz = [rows] * spec.n if sizes is None else check_sizes("halo_exchange", axis, sizes, spec.n)
    local_rows("halo_exchange", axis, xm, sz, simulated, index)
    _check_widths(axis, lo, hi, mode, sz)
    if simulated and any(s != rows for s in sz):
        out = _ragged(mesh, axis, spec, xm, lo, hi, mode, sz)
    else:
        own = sz[0 if index is None else index]
        out = _static(mesh, axis, spec, xm, lo, hi, mode, own)
    return out.movedim(0, d)


def _widths(axis: AxisName, width: Any) -> tuple[int, int]:
    """``width`` as ``(before, after)`` non-negative ints."""
    pair = (width, width) if not isinstance(width, (tuple, list)) else tuple(width)
    if len(pair) != 2 or any(type(w) is not int or w < 0 for w in pair):
        raise CollectiveError(
            "halo_exchange",
            axis,
            f"width={width!r} is not a row count >= 0 or a (before, after) pair of them",
            "pass e.g. 1 or (2, 0)",
        )
    return pair[0], pair[1]


def _check_widths(axis: AxisName, lo: int, hi: int, mode: str, sizes: Sequence[int]) -> None:
    """Every halo comes from one neighbour's block: no wider than the smallest block (and, to
    reflect, narrower than the end block it reflects)."""
    small = min(sizes)
    if max(lo, hi) > small:
        raise CollectiveError(
            "halo_exchange",
            axis,
            f"the halo (before={lo}, after={hi}) is wider than the smallest block "
            f"({small} rows, sizes={list(sizes)})",
            f"split the domain over fewer ranks, or into blocks of at least {max(lo, hi)} rows",
        )
    if mode == "reflect" and (lo >= sizes[0] or hi >= sizes[-1]):
        raise CollectiveError(
            "halo_exchange",
            axis,
            f"reflect padding of (before={lo}, after={hi}) rows needs end blocks of more rows "
            f"than that (sizes={list(sizes)})",
            f"give the first block more than {lo} rows and the last more than {hi}",
        )


def _exchange(
    mesh: Mesh, spec: GroupSpec, last: Tensor, first: Tensor, ring: bool
) -> tuple[Tensor, Tensor]:
    """``(before, after)``: the previous rank's ``last`` rows and the next rank's ``first``
    rows (zeros at the domain's ends, unless ``ring``)."""
    n = spec.n
    fwd = [v for i in range(n - 1) for v in (i, i + 1)] + ([n - 1, 0] if ring else [])
    bwd = [v for i in range(n - 1) for v in (i + 1, i)] + ([0, n - 1] if ring else [])
    before = (
        apply_primitive(ppermute_p, mesh, last, spec, perm=tuple(fwd)) if last.shape[0] else last
    )
    after = (
        apply_primitive(ppermute_p, mesh, first, spec, perm=tuple(bwd)) if first.shape[0] else first
    )
    return before, after


def _ends(
    mesh: Mesh,
    axis: AxisName,
    spec: GroupSpec,
    before: Tensor,
    after: Tensor,
    mine: tuple[Tensor, Tensor],
) -> tuple[Tensor, Tensor]:
    """Rank 0's ``before`` and rank ``n-1``'s ``after`` replaced by ``mine`` (its own rows).

    Through ``torch.where`` on every rank, so the received tensors stay in the graph: every
    rank runs the exchange's backward (a real rank that skipped it would hang its peers)."""
    n = spec.n
    if spec.comm is not None:  # one real rank: its index is a Python int
        i = spec.comm.index
        yes = torch.ones((), dtype=torch.bool, device=before.device)
        if i == 0:
            before = torch.where(yes, mine[0], before)
        if i == n - 1:
            after = torch.where(yes, mine[1], after)
        return before, after
    k = axis_index(mesh, axis).to(before.device)
    return torch.where(k == 0, mine[0], before), torch.where(k == n - 1, mine[1], after)


def _fill_ends(
    mesh: Mesh,
    axis: AxisName,
    spec: GroupSpec,
    before: Tensor,
    after: Tensor,
    mode: str,
    xm: Tensor,
    own: int | Tensor,
) -> tuple[Tensor, Tensor]:
    """The domain's ends filled as ``mode`` pads them (``replicate`` / ``reflect``; the others
    are done by the exchange): rank 0's ``before`` and rank ``n-1``'s ``after`` become copies
    of its own rows. ``own``: this rank's valid rows of ``xm`` (an int, or a per-rank 0-d
    tensor on simulated uneven ranks); one index rule for both, rows picked by ``index_select``.
    """
    if mode not in ("replicate", "reflect"):
        return before, after
    dev, top = xm.device, xm.shape[0] - 1
    up_lo = torch.arange(before.shape[0], device=dev)
    up_hi = torch.arange(after.shape[0], device=dev)
    own_t = torch.as_tensor(own, device=dev)
    if mode == "replicate":  # the first row lo times, the last valid row hi times
        first, last = 0 * up_lo, own_t - 1 + 0 * up_hi
    else:  # rows lo..1 before, rows own-2, own-3, ... after (a middle rank's: clamped, unused)
        first = (before.shape[0] - up_lo).clamp(max=top)
        last = (own_t - 2 - up_hi).clamp(min=0)
    mine = (xm.index_select(0, first), xm.index_select(0, last))
    return _ends(mesh, axis, spec, before, after, mine)


def _static(
    mesh: Mesh,
    axis: AxisName,
    spec: GroupSpec,
    xm: Tensor,
    lo: int,
    hi: int,
    mode: str,
    own: int,
) -> Tensor:
    """Every rank's block is its first ``own`` rows, a Python int (even blocks, or one real
    rank)."""
    block = xm[:own]  # [own, *rest]
    before, after = _exchange(mesh, spec, block[own - lo :], block[:hi], mode == "circular")
    before, after = _fill_ends(mesh, axis, spec, before, after, mode, block, own)
    tail = xm.new_zeros(xm.shape[0] - own, *block.shape[1:])  # the padding rows, zeroed
    return torch.cat([before, block, after, tail])  # [lo + rows + hi, *rest]


def _ragged(
    mesh: Mesh,
    axis: AxisName,
    spec: GroupSpec,
    xm: Tensor,
    lo: int,
    hi: int,
    mode: str,
    sizes: Sequence[int],
) -> Tensor:
    """Simulated ranks with uneven blocks: the edge rows' offsets differ per rank, so rows are
    picked with per-rank index tensors (``index_select`` under the rank vmap)."""
    dev, rows = xm.device, xm.shape[0]
    own = torch.tensor(sizes, device=dev)[axis_index(mesh, axis).to(dev)]  # this rank's rows
    last = xm.index_select(0, own - lo + torch.arange(lo, device=dev))  # [lo, *rest]
    before, after = _exchange(mesh, spec, last, xm[:hi], mode == "circular")
    before, after = _fill_ends(mesh, axis, spec, before, after, mode, xm, own)
    zero = xm.new_zeros(1, *xm.shape[1:])
    src = torch.cat([before, xm, after, zero])  # [lo + rows + hi + 1, *rest]
    j = torch.arange(lo + rows + hi, device=dev)
    # row j of the result: before / own rows (j), after (j + rows - own), else the zero row
    pick = torch.where(
        j < lo + own, j, torch.where(j < lo + own + hi, j + rows - own, lo + rows + hi)
    )
    return src.index_select(0, pick)  # [lo + rows + hi, *rest]
