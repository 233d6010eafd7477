"""The windowed layers of a domain-parallel model on one rank's block: convolutions, transposed
convolutions, pooling and upsampling, each equal to its rows of the whole domain's result.

A split is a tuple of ``(dim, axis)`` pairs, ``dim`` a negative index counted from the end of
the activations (``-2``: H of an image or a video, ``-1``: W, ``-3``: T of a video), so the same
split holds for a ``Conv3d`` on ``[N, C, T, H, W]`` and a ``Conv2d`` on the frames folded into
the batch (``[N * T, C, H, W]``): a split dim beyond a layer's spatial dims is in its batch, and
the layer is local along it. Blocks are even (every rank of an axis the same rows); a layer whose
output would not split evenly (a stride that does not divide a block) raises naming the module.

The halo a window reaches (kernel ``k``, stride ``s``, dilation ``d``, padding ``(lo, hi)``
along a split dim, ``D = d * (k - 1)``): ``lo`` rows before, ``D - lo - s + 1`` after (a
negative count: rows cropped from the block's end), which gives every rank ``rows / s`` output
rows when ``D + 1 - s <= lo + hi <= D`` (the whole output is ``L / s`` rows long).

Uneven blocks on simulated ranks (which share one shape): every rank's block is padded to the
largest block's rows, and `Region.ragged` holds each split dim's block sizes at the field's
resolution while the region runs. At a layer whose input has ``m`` rows along a split dim
(the largest block's rows at that layer's resolution, ``M`` at the field's), rank ``i`` holds
``sizes[i] * m / M`` valid rows first (`ragged_sizes`); the rows after them are padding, which
the halo exchange skips (its ``sizes=``), the windowed layers zero in their output, and the norms,
the adaptive pooling and the attention leave out (a mask of the valid rows, `ragged_mask`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.ops import all_gather, axis_index, halo_exchange

__all__ = [
    "Region",
    "region",
    "outside_region",
    "ragged_sizes",
    "upsample_factors",
    "ragged_mask",
    "zero_padding_rows",
    "Split",
    "split_here",
    "window_halo",
    "exchange",
    "domain_conv",
    "domain_conv_transpose",
    "domain_pool",
    "domain_upsample",
    "rows_seen",
    "one_row_ambiguity",
]

#: ``(dim counted from the end, mesh axis)`` for every split dim
Split = tuple[tuple[int, str], ...]


@dataclass
class Region:
    """The domain-parallel region running now in this thread (the style's hooks enter and
    leave it around each call; nothing is shared between threads or models).

    Attributes:
        depth: how many regions are running now (a domain layer runs only inside one).
        pooled: the split axes a global (adaptive) pooling has reduced to one row, the same on
            every rank.
        thin: the split axes along which a rank holds a block of one row of the domain (the
            field's, or a window's output): with a global pooling over the same axis, a one-row
            tensor could be either, which the region refuses where it matters (grown, gathered
            at the output: `rows_seen`, `one_row_ambiguity`).
        ragged: the uneven blocks on simulated ranks: ``{dim from the end: each rank's rows at
            the field's resolution}``.
        layers: the nesting depth of domain layers running now (their own ``F.pad`` /
            ``F.interpolate`` calls are not checked by the functional guard).
        attention: the attention modules running now (``AttentionCall``, innermost last).
        frames: the saved-tensor hooks each running module started under (checkpointing).
        reentered: the checkpointed modules that re-entered the region in the backward.
    """

    depth: int = 0
    pooled: set[str] = field(default_factory=set)
    thin: set[str] = field(default_factory=set)
    ragged: dict[int, tuple[int, ...]] = field(default_factory=dict)
    layers: int = 0
    attention: list[Any] = field(default_factory=list)
    #: the saved-tensor hooks (a checkpoint's) each running module of the region started under,
    #: the region's own first (`fastdist.nn.domain.layers.Recompute`)
    frames: list[Any] = field(default_factory=list)
    #: the modules recomputed in the backward that re-entered the region (their ids)
    reentered: list[int] = field(default_factory=list)


_REGION: ContextVar[Region | None] = ContextVar("fastdist_domain_region", default=None)


def region() -> Region:
    """This thread's (this context's) `Region`, created at its first use."""
    state = _REGION.get()
    if state is None:
        state = Region()
        _REGION.set(state)
    return state


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_MAXPOOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVGPOOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def split_here(split: Split, nsp: int) -> list[tuple[int, int, str]]:
    """``(spatial index, dim from the end, axis)`` of the split dims among a layer's ``nsp``
    spatial dims (the others are in its batch: nothing to exchange)."""
    return [(nsp + d, d, axis) for d, axis in split if -d <= nsp]


def outside_region(where: str) -> ParallelizeError:
    """The error of a domain layer run outside its region: called directly, or recomputed by
    activation checkpointing in the backward, it would treat a block as the whole or lose the
    region's state (the ranks' rows, the functional guard)."""
    return ParallelizeError(
        f"domain parallel: {where} ran outside its DomainParallel region (called directly, or "
        "recomputed by activation checkpointing in the backward with no record of its region), "
        "where it cannot know its block. Fix: call the module the style was applied to; "
        "checkpoint a module of the region with use_reentrant=False"
    )


def ragged_sizes(mesh: Mesh, axis: str, dim: int, rows: int, where: str) -> list[int] | None:
    """Each rank's valid rows along the split dim ``dim`` (from the end, over ``axis``) of a
    tensor padded to ``rows`` there, on simulated ranks with uneven blocks; ``None`` for even
    blocks, real ranks (each holds its own rows) and a global pooling's one row."""
    state = region()
    base = state.ragged.get(dim)
    if base is None or mesh.backend is not None or (axis in state.pooled and rows == 1):
        return None
    top = max(base)
    if any((b * rows) % top for b in base):
        raise ParallelizeError(
            f"domain parallel: {where} gets {rows} rows along the split dim {dim} where the "
            f"field's blocks are {list(base)}: the blocks scaled by {rows}/{top} are not whole "
            "rows (a stride that does not divide every block). Fix: blocks that are multiples "
            "of the strides on the way"
        )
    return [b * rows // top for b in base]


def rows_seen(
    before: Sequence[int], y: Tensor, nsp: int, split: Split, where: str, *, pooled: bool = False
) -> None:
    """After a layer of the region mapped a tensor of shape ``before`` to ``y`` (``nsp`` spatial
    dims at their ends): a block shrunk to one row along a split axis marks it `Region.thin`,
    and a one-row tensor along an axis a global pooling reduced may not grow (an upsampling of
    the pooled field would be gathered as if each rank held a block of it; with the axis thin
    too, the one row could be either). ``pooled``: ``y`` is a global pooling's output (its one
    row is not a block)."""
    state = region()
    for _, d, axis in split_here(split, nsp):
        if -d > len(before) or -d > y.dim():
            continue
        rin, rout = before[d], y.shape[d]
        if rin == 1 and rout > 1 and axis in state.pooled:
            if axis in state.thin:
                raise one_row_ambiguity(where, d, axis)
            raise ParallelizeError(
                f"domain parallel: {where} grows a field a global pooling reduced to one row "
                f"along the split dim {d} (axis {axis!r}) from 1 to {rout} rows: that one row is "
                "the whole domain's, the same on every rank, not this rank's block, so its "
                "upsampling would be gathered as if each rank held a block of it. Fix: broadcast "
                "the pooled tensor against the field instead (x * p, x + p), or end the "
                "domain-parallel region at the pooling"
            )
        if rout == 1 and rin > 1 and not pooled:
            state.thin.add(axis)


def one_row_ambiguity(where: str, d: int, axis: str) -> ParallelizeError:
    """The error where a one-row tensor along ``axis`` could be a rank's block or a global
    pooling's whole result (both seen along it in one region)."""
    return ParallelizeError(
        f"domain parallel: {where}: along the split dim {d} (axis {axis!r}) a rank holds a block "
        "of one row and a global pooling reduced a field to one row in the same region: a "
        "one-row tensor is then either this rank's block (gathered, read with a halo, upsampled "
        "as a block) or the whole pooled field (the same on every rank), which the style cannot "
        "tell apart. Fix: a domain of more rows per rank at that resolution (fewer ranks, or "
        "fewer downsamplings inside the region), or end the domain-parallel region before the "
        "global pooling"
    )


def _own(mesh: Mesh, axis: str, sizes: Sequence[int], device: Any) -> Tensor:
    """This rank's entry of ``sizes`` (a per-rank 0-d tensor on simulated ranks)."""
    return torch.tensor(list(sizes), device=device)[axis_index(mesh, axis).to(device)]


def ragged_mask(
    x: Tensor, nsp: int, mesh: Mesh, split: Split, where: str, dims: Sequence[int] | None = None
) -> Tensor | None:
    """A bool mask broadcastable to ``x`` (``nsp`` spatial dims at its end): True on this rank's
    valid rows along every ragged split dim (among ``dims`` from the end, if given); ``None``
    where no split dim is ragged."""
    mask: Tensor | None = None
    for _, d, axis in split_here(split, nsp):
        if dims is not None and d not in dims:
            continue
        sizes = ragged_sizes(mesh, axis, d, x.shape[d], where)
        if sizes is None:
            continue
        rows = torch.arange(x.shape[d], device=x.device) < _own(mesh, axis, sizes, x.device)
        rows = rows.reshape(x.shape[d], *[1] * (-d - 1))
        mask = rows if mask is None else mask & rows
    return mask


def zero_padding_rows(y: Tensor, nsp: int, mesh: Mesh, split: Split, where: str) -> Tensor:
    """``y`` with the padding rows of ragged split dims set to zero (they stay finite: a layer
    after it never reads them, a norm masks them)."""
    mask = ragged_mask(y, nsp, mesh, split, where)
    return y if mask is None else torch.where(mask, y, y.new_zeros(()))


def window_halo(
    where: str,
    dim: int,
    rows: int,
    k: int,
    s: int,
    d: int,
    lo: int,
    hi: int,
    sizes: Sequence[int] | None = None,
) -> tuple[int, int]:
    """``(before, after)`` halo rows of a window op along one split dim with ``rows`` rows per
    block (``after < 0``: crop); raises where the ranks' outputs would not split the whole one
    evenly."""
    span = d * (k - 1)
    if not span + 1 - s <= lo + hi <= span:
        raise ParallelizeError(
            f"domain parallel: {where} has kernel {k}, stride {s}, dilation {d} and padding "
            f"({lo}, {hi}) along the split dim {dim}: its output is not the input's length / {s}, "
            "so the ranks' blocks would not tile it. Fix: a padding that keeps the length at "
            f"stride 1 (lo + hi == {span}), or do not split dim {dim}"
        )
    if any(r % s for r in (sizes or [rows])):
        raise ParallelizeError(
            f"domain parallel: {where} has stride {s} along the split dim {dim} and blocks of "
            f"{list(sizes or [rows])} rows: every block must hold a multiple of {s} rows so "
            "that each starts on an output row. Fix: a domain length divisible by the stride "
            "times the ranks (uneven blocks: each a multiple of the strides on the way)"
        )
    return lo, span - lo - s + 1


def exchange(
    x: Tensor,
    mesh: Mesh,
    axis: str,
    dim: int,
    before: int,
    after: int,
    mode: str = "zeros",
    sizes: Sequence[int] | None = None,
) -> Tensor:
    """``x`` with ``before`` / ``after`` halo rows along ``dim`` (``after < 0``: that many rows
    cropped from the end), the domain's ends padded as ``mode`` pads; ``sizes``: each rank's
    valid rows (simulated uneven blocks: the halo follows them, then the padding rows)."""
    d = x.dim() + dim if dim < 0 else dim
    if axis in region().pooled and (before or after > 0) and x.shape[d] == 1:
        if axis in region().thin:
            raise one_row_ambiguity("a window reading a halo", dim, axis)
        raise ParallelizeError(
            f"domain parallel: a window reads a halo along {axis!r} of a field a global pooling "
            "reduced to one row (the same on every rank). Fix: end the domain-parallel region "
            "at the pooling, or a 1-wide kernel after it"
        )
    x = halo_exchange(x, mesh, axis, d, (before, max(after, 0)), mode=mode, sizes=sizes)
    return x if after >= 0 else x.narrow(d, 0, x.shape[d] + after)


def _end_rows(
    x: Tensor,
    mesh: Mesh,
    axis: str,
    dim: int,
    before: int,
    after: int,
    sizes: Sequence[int] | None = None,
) -> Tensor:
    """A bool mask broadcastable to ``x`` (halo-padded along ``dim``): True on the halo rows
    that lie outside the domain (rank 0's ``before``, the last rank's rows after its own: its
    ``after``, and with ragged ``sizes`` its padding rows too)."""
    d = x.dim() + dim if dim < 0 else dim
    n, rows = mesh.axis_size(axis), x.shape[d]
    k = axis_index(mesh, axis).to(x.device)
    j = torch.arange(rows, device=x.device)
    end = rows - max(after, 0) if sizes is None else before + _own(mesh, axis, sizes, x.device)
    outside = ((j < before) & (k == 0)) | ((j >= end) & (k == n - 1))
    return outside.reshape(rows, *[1] * (x.dim() - d - 1))


def _flat_pad(pads: Sequence[tuple[int, int]]) -> list[int]:
    """``(before, after)`` per spatial dim as ``F.pad`` takes them (the last dim first)."""
    return [v for p in reversed(pads) for v in p]


def domain_conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    stride: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    pads: Sequence[tuple[int, int]],
    mode: str,
    mesh: Mesh,
    split: Split,
    where: str,
) -> Tensor:
    """A convolution (``weight``: ``[out, in / groups, *kernel]``) of this rank's block: each split
    dim's halo exchanged (the ends padded as ``mode``), the other dims padded by ``pads`` (one
    ``(before, after)`` pair per spatial dim), then a convolution without padding."""
    nsp = weight.dim() - 2
    pads = list(pads)
    for i, d, axis in split_here(split, nsp):
        k = weight.shape[2 + i]
        lo, hi = pads[i]
        sizes = ragged_sizes(mesh, axis, d, x.shape[d], where)
        before, after = window_halo(where, d, x.shape[d], k, stride[i], dilation[i], lo, hi, sizes)
        x = exchange(x, mesh, axis, d, before, after, mode, sizes)
        pads[i] = (0, 0)
    conv_pad: Any = 0
    if mode == "zeros" and all(lo == hi for lo, hi in pads):
        conv_pad = tuple(lo for lo, _ in pads)  # the convolution pads (no copy of the block)
    elif any(v for p in pads for v in p):
        x = F.pad(x, _flat_pad(pads), mode="constant" if mode == "zeros" else mode)
    y = _CONV[nsp](x, weight, bias, tuple(stride), conv_pad, tuple(dilation), groups)
    return zero_padding_rows(y, nsp, mesh, split, where) if region().ragged else y


def domain_conv_transpose(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    stride: Sequence[int],
    padding: Sequence[int],
    output_padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    mesh: Mesh,
    split: Split,
    where: str,
) -> Tensor:
    """A transposed convolution of this rank's block: along a split dim (stride ``s``) each input
    row spreads over ``s`` output rows and their kernel's reach, so the block takes the input
    rows whose spread reaches its ``rows * s`` output rows (a halo of
    ``(D - p) // s`` before and ``(p - 1) // s + 1`` after, zeros at the ends), is transposed
    without padding, and its own output rows are cut out."""
    nsp = weight.dim() - 2
    here = split_here(split, nsp)
    pad, outpad = list(padding), list(output_padding)
    cuts: list[tuple[int, int, int]] = []  # (dim from the end, start, rows)
    for i, d, axis in here:
        s, p, span = stride[i], padding[i], dilation[i] * (weight.shape[2 + i] - 1)
        if span + output_padding[i] + 1 - 2 * p != s:
            raise ParallelizeError(
                f"domain parallel: {where} (stride {s}, kernel {weight.shape[2 + i]}, padding "
                f"{p}, output_padding {output_padding[i]}, dilation {dilation[i]}) does not "
                f"multiply the length of the split dim {d} by {s}, so the ranks' outputs would "
                "not tile the whole one. Fix: e.g. kernel 2s with padding s/2, or do not split "
                f"dim {d}"
            )
        rows = x.shape[d]
        before, after = max(0, (span - p) // s), max(0, (p - 1) // s + 1)
        sizes = ragged_sizes(mesh, axis, d, rows, where)
        x = exchange(x, mesh, axis, d, before, after, sizes=sizes)
        cuts.append((d, before * s + p, rows * s))
        pad[i], outpad[i] = 0, 0
    # no cut (each block's output is exactly its rows): the bias in the transposed convolution,
    # no narrow (whose backward would zero-fill and copy the whole output)
    uncut = all(output_padding[i] == 0 for i, _, _ in here) and all(
        start == 0 and rows == x.shape[d] * stride[nsp + d] for d, start, rows in cuts
    )
    y = _CONVT[nsp](
        x, weight, bias if uncut else None, tuple(stride), tuple(pad), tuple(outpad), groups,
        tuple(dilation),
    )  # fmt: skip
    if uncut:
        return zero_padding_rows(y, nsp, mesh, split, where) if region().ragged else y
    for d, start, rows in cuts:
        short = start + rows - y.shape[d]
        if short > 0:  # rows no input row reaches (the output padding): zeros
            y = F.pad(y, [0, 0] * (-d - 1) + [0, short])
        y = y.narrow(y.dim() + d, start, rows)
    if bias is not None:
        y = y + bias.reshape(-1, *[1] * nsp)
    return zero_padding_rows(y, nsp, mesh, split, where) if region().ragged else y


def domain_pool(
    x: Tensor,
    kind: str,
    nsp: int,
    *,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    count_include_pad: bool,
    divisor_override: int | None,
    mesh: Mesh,
    split: Split,
    where: str,
) -> Tensor:
    """Max (``kind="max"``) or average pooling of this rank's block: each split dim's halo
    exchanged; at the domain's ends the halo rows are what pooling pads with (``-inf`` for max,
    zeros for average, left out of the count unless ``count_include_pad``)."""
    pad = list(padding)
    outside: Tensor | None = None
    for i, d, axis in split_here(split, nsp):
        sizes = ragged_sizes(mesh, axis, d, x.shape[d], where)
        before, after = window_halo(
            where, d, x.shape[d], kernel[i], stride[i], dilation[i], padding[i], padding[i],
            sizes,
        )  # fmt: skip
        x = exchange(x, mesh, axis, d, before, after, sizes=sizes)
        ends = _end_rows(x, mesh, axis, d, before, after, sizes)
        outside = ends if outside is None else outside | ends
        pad[i] = 0
    if kind == "max":
        if outside is not None:
            x = x.masked_fill(outside, float("-inf"))
        y = _MAXPOOL[nsp](x, tuple(kernel), tuple(stride), tuple(pad), tuple(dilation))
    elif outside is None or count_include_pad or divisor_override is not None:
        y = _avg(x, nsp, kernel, stride, pad, count_include_pad, divisor_override)
    else:
        # the mean over the window's rows inside the domain: a sum over a count (at least 1:
        # a window over padding rows only counts none, and its result is zeroed below)
        total = _avg(x, nsp, kernel, stride, pad, True, 1)
        inside = (~outside).to(x.dtype).expand(*[1] * (x.dim() - nsp), *x.shape[-nsp:])
        y = total / _avg(inside, nsp, kernel, stride, pad, True, 1).clamp(min=1)
    return zero_padding_rows(y, nsp, mesh, split, where) if region().ragged else y


def _avg(
    x: Tensor,
    nsp: int,
    kernel: Sequence[int],
    stride: Sequence[int],
    pad: Sequence[int],
    include: bool,
    divisor: int | None,
) -> Tensor:
    """``F.avg_pool{nsp}d`` (``avg_pool1d`` has no ``divisor_override``: a 2-D pool of height
    1 stands in)."""
    if nsp == 1:
        y = F.avg_pool2d(
            x.unsqueeze(-2), (1, kernel[0]), (1, stride[0]), (0, pad[0]), False, include, divisor
        )
        return y.squeeze(-2)
    pool: Any = _AVGPOOL[nsp]  # (2-d and 3-d: they take divisor_override)
    out: Tensor = pool(x, tuple(kernel), tuple(stride), tuple(pad), False, include, divisor)
    return out


#: the halo rows an interpolation mode reads beyond a block (align_corners=False)
UPSAMPLE_HALO = {
    "nearest": 0,
    "nearest-exact": 0,
    "linear": 1,
    "bilinear": 1,
    "trilinear": 1,
    "bicubic": 2,
}


def domain_upsample(
    x: Tensor, scale: Sequence[int], mode: str, *, mesh: Mesh, split: Split, where: str
) -> Tensor:
    """``F.interpolate(x, scale_factor=scale, mode=mode)`` (``align_corners=False``) of this
    rank's block, integer factors: nearest modes are local; the linear modes (and bicubic) read
    one row (two) beyond the block, so each split dim gets that halo, the domain's ends
    replicated (the whole interpolation clamps there), and the rows it adds are cut away."""
    nsp = len(scale)
    halo = UPSAMPLE_HALO[mode]
    cuts: list[tuple[int, int, int]] = []
    if halo:
        for _, d, axis in split_here(split, nsp):
            rows = x.shape[d]
            sizes = ragged_sizes(mesh, axis, d, rows, where)
            x = exchange(x, mesh, axis, d, halo, halo, "replicate", sizes)
            cuts.append((d, halo * scale[nsp + d], rows * scale[nsp + d]))
    extra = {} if mode.startswith("nearest") else {"align_corners": False}
    y = F.interpolate(x, scale_factor=tuple(float(s) for s in scale), mode=mode, **extra)
    for d, start, rows in cuts:
        y = y.narrow(y.dim() + d, start, rows)
    return zero_padding_rows(y, nsp, mesh, split, where) if region().ragged else y


def _whole_rows(x: Tensor, d: int, axis: str, mesh: Mesh, where: str) -> int:
    """The whole domain's rows along the split dim ``d`` of ``x`` (uneven blocks: simulated
    ranks' ragged sizes, or every real rank's rows)."""
    ragged = ragged_sizes(mesh, axis, d, x.shape[d], where)
    if ragged is not None:
        return sum(ragged)
    if mesh.backend is None:
        return x.shape[d] * mesh.axis_size(axis)
    rows = all_gather(x.new_tensor([float(x.shape[d])]), mesh, axis)
    return int(rows.sum().item())


def _check_block_size(
    factor: list[float], x: Tensor, nsp: int, mesh: Mesh, split: Split, where: str
) -> None:
    """``size=`` is read as the whole domain's size; one the model computed from a block's
    shape (``2 * h.shape[2]``, ``skip.shape[2:]``) reads as a factor ``n`` times too small
    along each split dim of ``n`` ranks, a wrong answer with no error. Refused where the sizes
    look so: a split dim's factor times its ranks is another dim's factor, not its own (an
    even upsampling read as uneven), or every spatial dim split and left as it is."""
    ranks = {nsp + d: mesh.axis_size(a) for d, a in split if -d <= nsp}
    ranks = {i: n for i, n in ranks.items() if n > 1}
    if not ranks:
        return
    odd = [
        i
        for i, n in ranks.items()
        for j in range(nsp)
        if j != i and factor[i] != factor[j] and factor[i] * n == factor[j]
    ] or (  # fmt: skip
        [i for i in ranks if factor[i] == 1] if len(ranks) == nsp and set(factor) == {1.0} else []
    )
    if odd:
        i = odd[0]
        raise ParallelizeError(
            f"DomainParallel on {where!r}: F.interpolate(size=...) of a block of shape "
            f"{tuple(x.shape)} gives factors {factor} read as the whole domain's size: along the "
            f"split dim {i - nsp} ({ranks[i]} ranks) that looks like a size computed from this "
            "rank's block (h.shape), which would upsample it too little with no error. Fix: "
            "scale_factor=, or a size of the whole domain that upsamples every dim alike"
        )


def upsample_factors(
    x: Tensor, size: Any, scale_factor: Any, mode: str, align_corners: bool, antialias: bool,
    *, mesh: Mesh, split: Split, where: str,
) -> list[int]:  # fmt: skip
    """The integer factor per spatial dim of the model's own ``F.interpolate`` of a block
    ``x``: ``size`` is the whole domain's (the split dims' whole rows from every rank), else
    ``scale_factor``; refused unless integer factors >= 1 in a mode `domain_upsample` builds,
    ``align_corners=False``, no antialiasing."""
    nsp = x.dim() - 2
    if size is not None:  # the whole domain's size: a factor per dim
        sizes = size if isinstance(size, (tuple, list)) else [size] * nsp
        whole = [x.shape[2 + i] for i in range(nsp)]
        for d, a in split:
            if -d <= nsp:
                whole[nsp + d] = _whole_rows(x, d, a, mesh, where)
        factor = [s / w for s, w in zip(sizes, whole, strict=True)]
        _check_block_size(factor, x, nsp, mesh, split, where)
    else:
        sf = scale_factor if isinstance(scale_factor, (tuple, list)) else [scale_factor] * nsp
        factor = [float(s) for s in sf]
    if (
        mode not in UPSAMPLE_HALO
        or align_corners
        or antialias
        or any(f != int(f) or f < 1 for f in factor)
    ):
        raise ParallelizeError(
            f"DomainParallel on {where!r}: F.interpolate(mode={mode!r}, align_corners="
            f"{align_corners}, factors {factor}) over a split field is built for integer "
            f"factors >= 1, align_corners=False, modes {sorted(UPSAMPLE_HALO)}. Fix: such "
            "an upsampling, or end the region before it"
        )
    return [int(f) for f in factor]
