"""Halo exchange: a block of a split spatial domain padded with its neighbours' edge rows
(``halo_exchange``), one collective per call (conventions in ``fastdist.ops``).

The collective is ``halo_swap`` (internal): every rank packs its two edges as ``[2, w, ...]``
(``[0]``: its first rows, for the previous rank; ``[1]``: its last rows, for the next) and gets
``[previous rank's [1], next rank's [0]]`` around the ring, both sides in one exchange (one
``all_to_all`` on real ranks, one gather on simulated ranks). It is its own transpose, so its
gradient is itself: each received halo row's gradient goes back to the sender and is added into
its edge row. Replication rule: ``V`` to ``V``. The ends of a non-periodic domain are masked
(``torch.where`` on every rank, so every rank's exchange stays in the graph).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from fastdist.core.mesh import AxisName, Mesh
from fastdist.core.primitive import GroupSpec, Primitive
from fastdist.errors import CollectiveError
from fastdist.ops.permutes import axis_index
from fastdist.ops.prelude import (
    apply_primitive,
    as_index,
    bits_carrier,
    check_sizes,
    enter,
    local_rows,
    moves_bits,
    names_this_rank,
    norm_dim,
    same_shape,
)
from fastdist.ops.uneven import check_shard_rows, gather_counts

if TYPE_CHECKING:
    from fastdist.core.comm import AxisComm

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
    (and, for ``replicate`` / ``reflect``, into the end ranks' own rows they copy). One
    collective per call in the forward and one in the backward (both sides at once, each
    ``max(before, after)`` rows; the exchange goes around the ring, so with a non-periodic
    ``mode`` the first and last ranks also swap rows that are then dropped); varying to varying.

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
            on every rank); ``None``: each block is its rank's whole ``x`` along ``dim`` (on
            simulated ranks, which share one shape, all equal; real ranks' may differ).

    Returns:
        this rank's block with its halo: ``before + x.shape[dim] + after`` rows along ``dim``
        (with ``sizes``: the valid rows first, then zeros).

    Raises:
        CollectiveError: a width wider than a block, an unknown ``mode``, ``sizes`` of the
            wrong length, or fewer rows than the block's size. On real ranks the block checks
            see every rank's row count (one small all-gather of them per call, eager): a bad
            block on one rank raises on every rank of the group.

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
    sz = _block_sizes(axis, spec, xm, sizes, agree=max(lo, hi) > 0)
    _check_widths(axis, lo, hi, mode, sz)
    # the rows are picked and joined along d itself: the result keeps x's memory layout (a
    # convolution after it reads it without a copy)
    # rows picked on the bits of a dtype torch has no kernels for (float8, uint16, ...)
    carrier = bits_carrier(x, simulated)
    y = x if carrier is None else x.view(carrier)
    if simulated and any(s != rows for s in sz):
        out = _ragged(mesh, axis, spec, y, d, lo, hi, mode, sz)
    else:
        out = _static(mesh, axis, spec, y, d, lo, hi, mode, sz[0 if index is None else index])
    return out if carrier is None else out.view(x.dtype)


def _block_sizes(
    axis: AxisName, spec: GroupSpec, xm: Tensor, sizes: Sequence[int] | None, agree: bool
) -> list[int]:
    """Every rank's block rows, checked against the rows its input holds.

    Real ranks, with a halo to exchange (``agree``): one small all-gather of the row counts
    (eager), so every check below sees every rank's blocks and raises the same error on all of
    them (a check of this rank's own rows alone raised on one rank, its peers left in the
    exchange until the timeout, or paired with its next call). Without ``sizes`` a real rank's
    block is its whole input (blocks may differ). No halo: no exchange, so no all-gather either
    (each rank checks its own)."""
    rows, op = xm.shape[0], "halo_exchange"
    if sizes is None:
        table = gather_counts(op, spec, [rows]) if agree else None
        return [rows] * spec.n if table is None else [t[0] for t in table]
    sz = check_sizes(op, axis, sizes, spec.n)
    if not agree or check_shard_rows(op, axis, spec, rows, lambda i: sz[i], "sizes[{i}]") is None:
        simulated = spec.comm is None
        local_rows(op, axis, xm, sz, simulated, None if simulated else spec.comm.index)  # type: ignore[union-attr]
    return sz


def _widths(axis: AxisName, width: Any) -> tuple[int, int]:
    """``width`` as ``(before, after)`` non-negative ints."""
    pair = (width, width) if not isinstance(width, (tuple, list)) else tuple(width)
    ints = [as_index(w) for w in pair]  # NumPy integers too
    if len(ints) != 2 or any(w is None or w < 0 for w in ints):
        raise CollectiveError(
            "halo_exchange",
            axis,
            f"width={width!r} is not a row count >= 0 or a (before, after) pair of them",
            "pass e.g. 1 or (2, 0)",
        )
    return cast(int, ints[0]), cast(int, ints[1])


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


# ====================================================================== halo_swap
@moves_bits
def _swap_stacked(spec: GroupSpec, x: Tensor) -> Tensor:
    """``[world, 2, *s]``: member ``j`` gets ``[x[j-1][1], x[j+1][0]]`` (around the ring)."""
    y, a = spec.axis_view(x)  # [*before, n, *after, 2, *s]
    side, n = y.dim() - x.dim() + 1, spec.n
    prev = torch.tensor([(j - 1) % n for j in range(n)], device=x.device)
    nxt = torch.tensor([(j + 1) % n for j in range(n)], device=x.device)
    before = y.select(side, 1).index_select(a, prev)
    after = y.select(side, 0).index_select(a, nxt)
    return spec.from_axis_view(torch.stack([before, after], side), x.shape[1:])


def _swap_dist(comm: AxisComm, x: Tensor) -> Tensor:
    """One ``all_to_all`` of the two sides (rows of dim 0): ``x[0]`` to the previous member,
    ``x[1]`` to the next; received in member order, put back as ``[before, after]``."""
    n, me = comm.n, comm.index
    prev, nxt = (me - 1) % n, (me + 1) % n
    sends, recvs = [0] * n, [0] * n
    for j in (prev, nxt):
        sends[j] += 1
        recvs[j] += 1
    # two members: both sides go to the other one, x's order; it sends [its 0, its 1], which
    # are this rank's [after, before]. More: in member order, which the ring's wrap reverses.
    wrap = n == 2 or prev > nxt
    send = x.flip(0) if wrap and n > 2 else x
    got = comm.all_to_all_rows("halo_exchange", send.contiguous(), recvs, sends)
    return got.flip(0) if wrap else got


def _swap_bwd(ops: Any, spec: GroupSpec, g: Tensor, saved: Any) -> tuple[Any, ...]:
    # the transpose: the gradient of rank i's before goes back to i-1 as the gradient of its
    # [1], that of its after to i+1 as the gradient of its [0]: the same swap
    return (ops.halo_swap(g, spec=spec),)


#: internal: both sides of a halo in one exchange (``[2, w, ...]`` in and out; around the ring)
halo_swap_p = Primitive(
    "halo_swap",
    shape=same_shape,
    stacked=_swap_stacked,
    distributed=_swap_dist,
    backward=_swap_bwd,
    jvp="linear",  # a permutation of rows: the tangent takes the same swap
    replication=("V", "V"),
)


def _exchange(
    mesh: Mesh, spec: GroupSpec, x: Tensor, d: int, lo: int, hi: int, start: int | Tensor
) -> tuple[Tensor, Tensor]:
    """``(before, after)``: the previous rank's last ``lo`` rows and the next rank's first
    ``hi`` rows of ``x`` along ``d`` around the ring (this rank's last rows start at ``start``:
    an int, or a per-rank 0-d tensor), in one ``halo_swap``. The edges are picked by one
    ``index_select`` (its backward adds into the rows: no copy of the block per side)."""
    w, dev = max(lo, hi), x.device
    if w == 0:  # nothing to exchange (new tensors: no zero-row slice of x in the graph)
        shape = list(x.shape)
        shape[d] = 0
        return x.new_zeros(shape), x.new_zeros(shape)
    up = torch.arange(w, device=dev)
    first = torch.where(up < hi, up, 0)  # padding rows (past a side's width): row 0, unused
    last = torch.where(up < lo, torch.as_tensor(start, device=dev) + up, 0)
    edges = x.index_select(d, torch.cat([first, last])).movedim(d, 0)  # [2w, *rest]
    pair = edges.reshape(2, w, *edges.shape[1:])
    got = apply_primitive(halo_swap_p, mesh, pair, spec)  # [2, w, *rest]
    return got[0, :lo].movedim(0, d), got[1, :hi].movedim(0, d)


def _ends(
    mesh: Mesh,
    axis: AxisName,
    spec: GroupSpec,
    before: Tensor,
    after: Tensor,
    mine: tuple[Tensor, Tensor],
) -> tuple[Tensor, Tensor]:
    """Rank 0's ``before`` and rank ``n-1``'s ``after`` replaced by ``mine``.

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
    halo: tuple[Tensor, Tensor],
    mode: str,
    x: Tensor,
    d: int,
    own: int | Tensor,
) -> tuple[Tensor, Tensor]:
    """The domain's ends filled as ``mode`` pads them (the exchange goes around the ring, as
    ``circular`` pads): rank 0's ``before`` and rank ``n-1``'s ``after`` become zeros
    (``zeros``) or copies of its own rows along ``d`` (``replicate`` / ``reflect``). ``own``:
    this rank's valid rows of ``x`` (an int, or a per-rank 0-d tensor on simulated uneven
    ranks); one index rule for both, rows picked by ``index_select``.
    """
    before, after = halo
    if mode == "circular":
        return before, after
    if mode == "zeros":
        zero = before.new_zeros(())
        return _ends(mesh, axis, spec, before, after, (zero, zero))
    dev, top = x.device, x.shape[d] - 1
    up_lo = torch.arange(before.shape[d], device=dev)
    up_hi = torch.arange(after.shape[d], device=dev)
    own_t = torch.as_tensor(own, device=dev)
    if mode == "replicate":  # the first row lo times, the last valid row hi times
        first, last = 0 * up_lo, own_t - 1 + 0 * up_hi
    else:  # rows lo..1 before, rows own-2, own-3, ... after (a middle rank's: clamped, unused)
        first = (before.shape[d] - up_lo).clamp(max=top)
        last = (own_t - 2 - up_hi).clamp(min=0)
    mine = (x.index_select(d, first), x.index_select(d, last))
    return _ends(mesh, axis, spec, before, after, mine)


def _static(
    mesh: Mesh,
    axis: AxisName,
    spec: GroupSpec,
    x: Tensor,
    d: int,
    lo: int,
    hi: int,
    mode: str,
    own: int,
) -> Tensor:
    """Every rank's block is its first ``own`` rows along ``d``, a Python int (even blocks, or
    one real rank)."""
    rows = x.shape[d]
    if lo == hi == 0 and own == rows:
        return x
    block = x if own == rows else x.narrow(d, 0, own)
    halo = _exchange(mesh, spec, block, d, lo, hi, own - lo)
    before, after = _fill_ends(mesh, axis, spec, halo, mode, block, d, own)
    if own == rows:
        return torch.cat([before, block, after], d)  # lo + rows + hi rows along d
    tail = list(x.shape)
    tail[d] = rows - own
    return torch.cat([before, block, after, x.new_zeros(tail)], d)  # the padding rows: zeros


def _ragged(
    mesh: Mesh,
    axis: AxisName,
    spec: GroupSpec,
    x: Tensor,
    d: int,
    lo: int,
    hi: int,
    mode: str,
    sizes: Sequence[int],
) -> Tensor:
    """Simulated ranks with uneven blocks: the edge rows' offsets differ per rank, so rows are
    picked with per-rank index tensors (``index_select`` under the rank vmap)."""
    dev, rows = x.device, x.shape[d]
    own = torch.tensor(sizes, device=dev)[axis_index(mesh, axis).to(dev)]  # this rank's rows
    halo = _exchange(mesh, spec, x, d, lo, hi, own - lo)
    before, after = _fill_ends(mesh, axis, spec, halo, mode, x, d, own)
    one = list(x.shape)
    one[d] = 1
    src = torch.cat([before, x, after, x.new_zeros(one)], d)  # a zero row last
    j = torch.arange(lo + rows + hi, device=dev)
    # row j of the result: before / own rows (j), after (j + rows - own), else the zero row
    pick = torch.where(
        j < lo + own, j, torch.where(j < lo + own + hi, j + rows - own, lo + rows + hi)
    )
    return src.index_select(d, pick)  # lo + rows + hi rows along d
