"""Global-norm gradient clipping over a parallel model: the single-device norm on every rank.

``torch.nn.utils.clip_grad_norm_`` on a tensor-parallel model is the classic silent mistake:
each rank sees only its shards and counts every replicated parameter once per rank, so the
ranks compute different norms, clip by different factors, and replicated weights drift apart.
`clip_grad_norm_` here computes the norm the single-device model would have:

* a parameter split over axes ``A`` (its `Layout`'s spec; an FSDP2 DTensor's ``Shard``
  placements add their mesh dims) contributes its local block, summed over ``A``
  (one ``psum`` per distinct axis set, ``pmax`` for the inf-norm);
* a parameter replicated over an axis counts once (its holders are not summed);
* vocabulary padding rows (`Layout` ``size``) count zero.

Every rank then gets the same total and scales its gradients by the same coefficient
(``max_norm / (total + 1e-6)``, clamped at 1, as torch does). Call it after the gradients
are reduced over the data axes (after ``backward`` with `fastdist.train.DataParallel`, DDP
or FSDP2), where data-parallel replicas hold equal gradients.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.errors import MeshError
from fastdist.nn.state import Layout, module_and_mesh, param_layouts

__all__ = [
    "clip_grad_norm_",
    "grad_norm",
    "refuse_unreduced",
    "check_norm_type",
    "clip_coefficient",
    "scale_grads",
    "total_norm",
]

#: the dtype of the per-axis-set partial sums (scalars) that the ranks reduce
_SUM = torch.float64


def check_norm_type(norm_type: float, op: str) -> float:
    """``norm_type`` as a float; raises `MeshError` (naming ``op``) unless it is a finite p > 0 or
    ``math.inf``."""
    p = float(norm_type)
    if not (p == math.inf or (math.isfinite(p) and p > 0)):
        raise MeshError(
            f"{op}: norm_type={norm_type!r} is not supported; use a finite p > 0 (2.0 is the "
            "usual) or math.inf"
        )
    return p


def _real_rows(g: Tensor, layout: Layout, mesh: Mesh, rank: int, rows: int, at: int) -> Tensor:
    """``g`` without vocabulary padding rows: ``g`` holds rows ``at..`` of this rank's block of
    ``rows`` rows along the padded dim (``at`` > 0 for an FSDP2 shard of the block)."""
    if layout.size is None:
        return g
    d = layout.dim
    assert d is not None  # size implies a split dim
    start = mesh.index(rank, layout.spec.axes_of(d)) * rows  # the block's first padded row
    real = max(0, min(rows, layout.size - start))  # rows of the block that exist
    return g.narrow(d, 0, max(0, min(g.shape[d], real - at)))


def _local_block(t: Tensor, mesh: Mesh) -> tuple[Tensor, tuple[str, ...], tuple[int, ...], int]:
    """(this rank's block of ``t``, extra axes it is split over, the block's shape, the first
    dim-0 row it holds): for an FSDP2 DTensor (a parameter or its gradient), its local shard,
    the mesh dims of its Shard placements, and its offset in the tp block (torch.chunk's
    split); a plain tensor is its own block."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return t, (), tuple(t.shape), 0
    d: Any = t  # a DTensor
    names = d.device_mesh.mesh_dim_names or ()
    extra = tuple(names[i] for i, pl in enumerate(placements) if pl.is_shard() and i < len(names))
    unknown = [a for a in extra if a not in mesh.axis_names]
    if unknown or any(pl.is_partial() for pl in placements):
        raise MeshError(
            f"clip_grad_norm_: a gradient is a DTensor with placements {tuple(placements)} over "
            f"mesh dims {names}, which {mesh!r} does not describe. Fix: build the DeviceMesh "
            "with fastdist.comm.to_device_mesh(mesh) and reduce partial gradients before clipping"
        )
    at = 0
    for i, pl in enumerate(placements):
        if pl.is_shard() and pl.dim == 0:  # FSDP2: dim 0 in torch.chunk pieces
            chunk = -(-d.shape[0] // d.device_mesh.size(i))
            at += d.device_mesh.get_local_rank(i) * chunk
    return d.to_local(), extra, tuple(d.shape), at


def _local_norm(block: Tensor, p: float) -> Tensor:
    """``max |g|`` (inf-norm; 0 for an empty block) or ``sum |g|^p`` of one block."""
    if p == math.inf:
        return block.abs().amax() if block.numel() else block.new_zeros(())
    return block.abs().pow(p).sum()


def _partial_norms(
    module: nn.Module, mesh: Mesh, p: float, simulated: bool
) -> tuple[dict[tuple[str, ...], Tensor], list[Tensor], torch.dtype | None]:
    """Per axis set, this rank's sum of ``|g|^p`` (max of ``|g|`` for inf) over the parameters
    split over exactly those axes ([world] on a simulated mesh); the gradients; their dtype.

    Every parameter that requires grad names its axis set, with or without a gradient on this
    rank, so that every rank runs the same collectives."""
    layouts = param_layouts(module)
    order = {a: i for i, a in enumerate(mesh.axis_names)}
    sums: dict[tuple[str, ...], Tensor] = {}
    grads: list[Tensor] = []
    dtype = None
    ranks = range(mesh.size) if simulated else [mesh.rank]
    for name, param in module.named_parameters():
        if param.grad is None and not param.requires_grad:
            continue
        layout = layouts.get(name, Layout())
        g, extra, block, at = _local_block(param.grad if param.grad is not None else param, mesh)
        key = tuple(sorted(layout.split_axes | set(extra), key=order.__getitem__))
        if param.grad is None:
            # no gradient on this rank (an expert without tokens): it contributes 0, but its axis
            # set must take part in the same collectives as on the ranks where it has one
            sums.setdefault(
                key, torch.zeros(mesh.size if simulated else (), dtype=_SUM, device=g.device)
            )
            continue
        grads.append(param.grad)
        dtype = dtype or g.dtype
        acc = torch.promote_types(g.dtype, torch.float32)
        rows = 0 if layout.dim is None else block[layout.dim + simulated]  # the padded dim's
        per_rank = []
        for i, r in enumerate(ranks):
            local = g[i] if simulated else g
            per_rank.append(_local_norm(_real_rows(local, layout, mesh, r, rows, at).to(acc), p))
        # float64 partial sums: every rank's collective has the same dtype, gradients or not
        value = (torch.stack(per_rank) if simulated else per_rank[0]).to(_SUM)
        if key in sums:
            sums[key] = torch.maximum(sums[key], value) if p == math.inf else sums[key] + value
        else:
            sums[key] = value
    return sums, grads, dtype


def _combine(sums: dict[tuple[str, ...], Tensor], mesh: Mesh, p: float) -> Tensor:
    """One rank's total norm from its partial sums: each axis set reduced over its axes."""
    from fastdist.ops import pmax, psum

    total: Tensor | None = None
    for axes in sorted(sums):  # the same order on every rank
        v = sums[axes]
        if axes:
            v = pmax(v, mesh, axes) if p == math.inf else psum(v, mesh, axes)
        total = v if total is None else (torch.maximum(total, v) if p == math.inf else total + v)
    assert total is not None
    return total if p == math.inf else total.pow(1.0 / p)


def grad_norm(model: Any, norm_type: float = 2.0, *, mesh: Mesh | None = None) -> Tensor:
    """The single-device total norm of a parallel model's gradients (on real ranks a collective:
    call it on every rank).

    Returns a 0-d tensor on real ranks; on a simulated mesh a ``[world]`` tensor, each rank's
    value (all equal when replicas agree). Parameters without a gradient are skipped; with no
    gradient at all the norm is 0. See `clip_grad_norm_`.

    Args:
        model: a `fastdist.nn.ParallelModel` (or a module of fastdist layers, with ``mesh=``).
        norm_type: p of the p-norm (finite > 0) or ``math.inf``.
        mesh: the mesh, when ``model`` is a plain module.

    Returns:
        the total norm: 0-d on real ranks, ``[world]`` on a simulated mesh.
    """
    return total_norm(model, norm_type, mesh, "fastdist.nn.grad_norm")[0]


def total_norm(
    model: Any, norm_type: float, mesh: Mesh | None, op: str
) -> tuple[Tensor, list[Tensor], Mesh]:
    """(total norm of the single-device gradients, this rank's gradients to scale, the mesh) of
    ``model``: what `grad_norm` returns and `clip_grad_norm_` scales by; ``op`` names the caller
    in errors."""
    module, mesh = module_and_mesh(model, mesh, op)
    p = check_norm_type(norm_type, op)
    refuse_unreduced(model, op)
    simulated = mesh.backend is None
    with torch.no_grad():
        sums, grads, dtype = _partial_norms(module, mesh, p, simulated)
        if not sums:
            zero = torch.zeros(mesh.size if simulated else ())
            return zero, grads, mesh
        if simulated:
            from fastdist.sim.simulate import simulate

            total = simulate(lambda s: _combine(s, mesh, p), mesh)(sums)
            _check_equal(total, mesh, op)
        else:
            total = _combine(sums, mesh, p)
    return total.to(dtype or torch.get_default_dtype()), grads, mesh  # torch: 0.0 if none


def refuse_unreduced(model: Any, op: str) -> None:
    """Raise `MeshError` naming ``op`` when ``model``'s data-parallel engine (its ``engine``
    attribute, e.g. `fastdist.train.DataParallel`) holds gradients received under ``no_sync``
    and not reduced yet: the last backward ran inside ``no_sync``, so each rank holds its own
    gradient, and a clip or step now would be per-rank (and a ZeRO all-gather would make the
    wrong weights look consistent)."""
    unreduced = getattr(getattr(model, "engine", None), "unreduced", None)
    names = unreduced() if callable(unreduced) else []
    if names:
        raise MeshError(
            f"{op}: the gradients of {names[:3]} ({len(names)} parameters) were accumulated "
            "under DataParallel.no_sync() and never reduced (the last backward ran inside "
            "no_sync), so every data rank holds only its own. Fix: run the last micro-batch's "
            "backward outside no_sync (no_sync skips the reduction; the first backward after it "
            "reduces everything accumulated)"
        )


def _check_equal(total: Tensor, mesh: Mesh, op: str) -> None:
    """On simulated ranks, every rank's norm must agree: a difference means replicas whose
    gradients were not reduced (data parallel) or a missing pvary."""
    spread = float((total - total[0]).abs().max()) if total.numel() else 0.0
    if spread > 1e-6 * max(float(total.abs().max()), 1e-30) and torch.isfinite(total).all():
        raise MeshError(
            f"{op}: the ranks of {mesh!r} compute different total norms "
            f"({[round(float(t), 6) for t in total]}): ranks that should hold equal gradients "
            "do not (data-parallel replicas not reduced yet, or a replicated parameter that "
            "meets rank-varying data without pvary). Fix: clip after the gradients are reduced "
            "over the data axes (fastdist.train.DataParallel, DDP, FSDP2)"
        )


def clip_grad_norm_(
    model: Any,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    mesh: Mesh | None = None,
) -> Tensor:
    """Clip a parallel model's gradients by their single-device total norm; return that norm.

    What ``torch.nn.utils.clip_grad_norm_(single_device_model.parameters(), ...)`` computes
    and applies, on every rank: the norm counts each single-device element once (sharded
    parameters summed over the axes they split, replicated ones once, vocabulary padding
    not at all), and every rank scales by the same ``min(1, max_norm / (norm + 1e-6))``.
    A non-finite norm scales by nan/inf as torch does, or raises with
    ``error_if_nonfinite``.

    Args:
        model: a `fastdist.nn.ParallelModel` (or a module of fastdist layers, with ``mesh=``).
            FSDP2 gradients (DTensors over the mesh's data axis) are understood.
        max_norm: the largest total norm kept.
        norm_type: p of the p-norm (finite > 0) or ``math.inf``.
        error_if_nonfinite: raise ``RuntimeError`` (every rank alike) if the norm is nan/inf.
        mesh: the mesh, when ``model`` is a plain module.

    Returns:
        The total norm before clipping: 0-d on real ranks, ``[world]`` on a simulated mesh.

    On real ranks a collective (call it on every rank, after the data-parallel reduction).

    >>> import torch, fastdist as fd
    >>> full = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    >>> ref = __import__("copy").deepcopy(full)
    >>> mesh = fd.Mesh({"tp": 2})
    >>> plan = {"0": fd.nn.ColwiseParallel(input="replicated"), "1": fd.nn.RowwiseParallel()}
    >>> pm = fd.nn.parallelize(full, mesh, plan)
    >>> x = torch.randn(3, 4)
    >>> pm(x.expand(2, 3, 4)).sum(dim=(1, 2)).sum().backward()
    >>> ref(x).sum().backward()
    >>> one_device = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    >>> norm = fd.nn.clip_grad_norm_(pm, 0.5)       # [world]: every rank's (equal) norm
    >>> bool(torch.allclose(norm, one_device.expand(2)))
    True
    >>> bool(torch.allclose(pm.grads()["0.weight"], ref[0].weight.grad))
    True
    """
    op = "fastdist.nn.clip_grad_norm_"
    total, grads, mesh = total_norm(model, norm_type, mesh, op)
    scale_grads(grads, clip_coefficient(op, total, max_norm, norm_type, error_if_nonfinite), mesh)
    return total


def clip_coefficient(
    op: str, total: Tensor, max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> Tensor:
    """torch's clipping factor ``min(1, max_norm / (total + 1e-6))``; raises for a non-finite
    norm with ``error_if_nonfinite`` (every rank alike: they hold the same total)."""
    if error_if_nonfinite and not bool(torch.isfinite(total).all()):
        raise RuntimeError(
            f"{op}: the total norm of order {float(norm_type)} of the gradients is non-finite "
            f"({total.tolist()}), so it cannot be clipped. Fix: find the nan/inf gradient, or "
            "pass error_if_nonfinite=False"
        )
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def scale_grads(grads: list[Tensor], coef: Tensor, mesh: Mesh) -> None:
    """Multiply each gradient (an FSDP2 DTensor's local block) by ``coef``: 0-d on real ranks,
    ``[world]`` (one per rank, along the stacked rank dim) on a simulated mesh."""
    with torch.no_grad():
        for g in grads:
            local = g.to_local() if hasattr(g, "to_local") else g
            c = coef.view(-1, *[1] * (local.dim() - 1)) if mesh.backend is None else coef
            local.mul_(c.to(local.dtype))
