"""Normalizations of a domain-parallel model whose statistics span the split dims: group,
instance and batch norm, each rank's sums all-reduced over the split axes (``psum``) so that every
rank normalizes with the whole domain's mean and variance.

The statistics are invariant over the split axes and meet each rank's own rows, so they are
``pvary``'d after the ``psum``: in backward each rank's share of their gradient is summed over the
axes, which is the gradient of one device's mean and variance. On real ranks the counts are summed
too (blocks may be uneven there). Token-local norms (``LayerNorm`` / ``RMSNorm`` over channels)
need nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.domain.windows import Split, ragged_mask, split_here
from fastdist.ops import psum, pvary

__all__ = ["domain_moments", "domain_group_norm", "domain_batch_norm"]


def domain_moments(
    x: Tensor,
    reduce: tuple[int, ...],
    nsp: int,
    mesh: Mesh,
    split: Split,
    batch_axes: tuple[str, ...] = (),
    *,
    mask: Tensor | None = None,
    where: str = "a norm",
) -> tuple[Tensor, Tensor, int, Tensor]:
    """``(mean, biased variance, count, x - mean)`` of ``x`` over the dims ``reduce`` of the
    whole domain (keepdim; the centered ``x`` once, for the norm to scale: autograd then keeps
    one tensor of ``x``'s size, as torch's fused norms do): local sums ``psum``'d over the axes
    of the split dims among ``reduce`` (two passes: the mean, then the squared deviations), and
    over ``batch_axes`` (the data-parallel ranks' batches: a synchronized batch norm). ``nsp``:
    the spatial dims at the end of ``x`` (a split dim beyond them is in the batch). ``mask``
    (bool, broadcastable to ``x``): the valid rows (simulated uneven blocks; by default those of
    the ragged split dims among ``reduce``); the count is then a tensor."""
    here = [(d, a) for _, d, a in split_here(split, nsp) if x.dim() + d in reduce]
    axes = tuple(a for _, a in here) + batch_axes
    if mask is None:
        mask = ragged_mask(x, nsp, mesh, split, where, [d for d, _ in here])
    if mask is not None:
        keep = mask.expand(x.shape)
        n = _total(keep.to(x.dtype).sum(reduce, keepdim=True), mesh, axes)
        zero = x.new_zeros(())
        mean = _total(torch.where(keep, x, zero).sum(reduce, keepdim=True), mesh, axes) / n
        centered = x - mean
        dev = torch.where(keep, centered, zero)
        var = _total((dev * dev).sum(reduce, keepdim=True), mesh, axes) / n
        return mean, var, n, centered  # type: ignore[return-value]
    count = 1
    for r in reduce:
        count *= x.shape[r]
    if axes and mesh.backend is None:  # simulated ranks: even blocks
        count *= mesh.axis_size(axes)
    elif axes:  # real ranks: blocks may be uneven, so the counts are summed too
        count = int(psum(x.new_tensor(float(count)), mesh, axes).item())
    mean = _total(x.sum(reduce, keepdim=True), mesh, axes) / count
    centered = x - mean
    var = _total((centered * centered).sum(reduce, keepdim=True), mesh, axes) / count
    return mean, var, count, centered


def _total(t: Tensor, mesh: Mesh, axes: tuple[str, ...]) -> Tensor:
    """The sum of ``t`` over ``axes``, ``pvary``'d back for use with each rank's rows."""
    return pvary(psum(t, mesh, axes), mesh, axes) if axes else t


def domain_group_norm(
    x: Tensor,
    groups: int,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    *,
    mesh: Mesh,
    split: Split,
    mask: Tensor | None = None,
    where: str = "a group norm",
) -> Tensor:
    """``F.group_norm`` of the whole domain on this rank's block ``[N, C, *spatial]`` (an
    instance norm is ``groups == C``); ``mask``: the valid positions (simulated uneven blocks,
    by default from the split)."""
    n, c = x.shape[:2]
    xg = x.reshape(n, groups, c // groups, *x.shape[2:])  # [N, G, C/G, *spatial]
    # (the split dims, counted from the end, are the same on xg)
    _, var, _, centered = domain_moments(
        xg, tuple(range(2, xg.dim())), x.dim() - 2, mesh, split, mask=mask, where=where
    )
    scale = torch.rsqrt(var + eps)  # [N, G, 1, 1...]: small
    gshape = (1, groups, c // groups, *[1] * (x.dim() - 2))
    if weight is not None:  # folded into the small scale: one full-size product, one saved
        scale = scale * weight.reshape(gshape)
    y = centered * scale
    if bias is not None:
        y = y + bias.reshape(gshape)
    return y.reshape(x.shape)


def domain_batch_norm(
    x: Tensor,
    module: torch.nn.modules.batchnorm._BatchNorm,
    weight: Tensor | None,
    bias: Tensor | None,
    *,
    mesh: Mesh,
    split: Split,
    where: str,
    batch_axes: tuple[str, ...] | None = None,
) -> Tensor:
    """``BatchNorm`` of the whole domain: in training (or without running statistics) the batch
    statistics over ``N`` and every spatial dim, all-reduced (over ``batch_axes`` too: every
    data rank's batch); the running statistics updated as one device updates them (real ranks;
    every rank the same values). In eval with running statistics the norm is local.
    ``batch_axes=None`` on a mesh with axes of more than one rank besides the split ones raises
    (the statistics of one data rank's batch, or of all: the caller says which)."""
    m = module
    shape = (1, -1, *[1] * (x.dim() - 2))
    use_batch = m.training or m.running_mean is None
    if not use_batch:
        assert m.running_mean is not None and m.running_var is not None
        mean, var = m.running_mean.reshape(shape), m.running_var.reshape(shape)
    else:
        reduce = (0, *range(2, x.dim()))
        if batch_axes is None:
            batch_axes = _no_other_axes(mesh, split, where)
        mean, var, count, centered = domain_moments(
            x, reduce, x.dim() - 2, mesh, split, batch_axes, where=where
        )
        if m.training and m.track_running_stats and m.running_mean is not None:
            _update_running(m, mean, var, count, mesh, where)
    scale = torch.rsqrt(var + m.eps)
    if weight is not None:  # folded into the per-channel scale
        scale = scale * weight.reshape(shape)
    y = (centered if use_batch else x - mean) * scale
    if bias is not None:
        y = y + bias.reshape(shape)
    return y


def _no_other_axes(mesh: Mesh, split: Split, where: str) -> tuple[str, ...]:
    """``()`` where every axis of more than one rank is a split axis; raises otherwise."""
    split_axes = {a for _, a in split}
    other = [a for a in mesh.axis_names if a not in split_axes and mesh.axis_size(a) > 1]
    if other:
        raise ParallelizeError(
            f"domain parallel: {where} is a BatchNorm taking batch statistics on a mesh with "
            f"the axes {other} besides the split ones: one device normalizes over the whole "
            "batch, each data rank holds a part. Fix: DomainParallel(..., "
            f"batch_axes={tuple(other)!r}) (statistics over their batches too, as "
            "SyncBatchNorm), or batch_axes=() (each rank's own batch, as DDP without "
            "SyncBatchNorm)"
        )
    return ()


def _update_running(
    m: torch.nn.modules.batchnorm._BatchNorm,
    mean: Tensor,
    var: Tensor,
    count: int,
    mesh: Mesh,
    where: str,
) -> None:
    """The running statistics updated from the whole domain's batch statistics (unbiased
    variance), as ``F.batch_norm`` does on one device."""
    if mesh.backend is None:
        raise ParallelizeError(
            f"domain parallel: {where} is a BatchNorm in training mode with running statistics "
            "on simulated ranks, which run every rank at once and cannot update one buffer from "
            "each. Fix: model.eval(), track_running_stats=False, or real ranks (fastdist.connect)"
        )
    assert m.running_mean is not None and m.running_var is not None
    assert m.num_batches_tracked is not None
    with torch.no_grad():
        m.num_batches_tracked.add_(1)
        factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else float(m.momentum)
        unbiased = var.flatten() * count / max(count - 1, 1)
        m.running_mean.mul_(1 - factor).add_(mean.flatten(), alpha=factor)
        m.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
