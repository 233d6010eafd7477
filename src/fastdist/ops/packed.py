"""Packed Ulysses exchange: ``all_to_all_qkv`` trades q, k and v (sequence shard of all heads ->
whole sequence of a head shard) in ONE all-to-all instead of three (as yunchang and xDiT do);
conventions in ``fastdist.ops``.

It is a composition, not a new primitive: every rank cuts each tensor's heads into ``n`` groups
and writes the groups of all three, side by side, into one ``[n, B, m, F]`` buffer (one copy,
what the three ``all_to_all_4d`` calls copy too); ``all_to_all`` (dim 0 to dim 0: the buffer as
it is, no copy before or after the exchange) sends group ``j`` to rank ``j``; the three results
are views of what arrives (for batch 1; a larger batch copies each, as ``all_to_all_4d`` does).
Its gradient is the same exchange of the three gradients packed (autograd's rules of ``cat``,
``all_to_all`` and ``split``), so the backward also sends one message instead of three. The
values are those of ``all_to_all_4d`` on each tensor, bit for bit: only bytes move.

``pvary_packed`` is ``pvary`` of several tensors whose backward sums all their gradients in one
``psum`` (the outputs of a DiT's condition embedder, met by every rank's tokens: one
all-reduce per backward instead of one per tensor).

Tested on simulated ranks and gloo processes on CPU; it has never run on a GPU (NCCL).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fastdist.core.context import check_of, is_real
from fastdist.core.mesh import AxisName, Mesh
from fastdist.errors import CollectiveError
from fastdist.ops.gathers import all_to_all
from fastdist.ops.prelude import check_mesh, names_this_rank
from fastdist.ops.reductions import psum, pvary

__all__ = ["all_to_all_qkv", "pvary_packed"]


def _check(q: Tensor, k: Tensor, v: Tensor, axis: AxisName, n: int) -> None:
    """Refuse inputs that ``all_to_all_4d`` would refuse, or that do not fit one buffer."""
    named = {"q": q, "k": k, "v": v}
    for name, t in named.items():
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise CollectiveError(
                "all_to_all_qkv",
                axis,
                f"{name} must be a 4-d (batch, seq, heads, head_dim) tensor, got {got}",
                "reshape to 4-d or use all_to_all",
            )
    shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in named.items())
    if len({t.shape[:2] for t in named.values()}) != 1:
        raise CollectiveError(
            "all_to_all_qkv",
            axis,
            f"{shapes}: the batch and seq dims differ",
            "pass q, k and v of the same tokens, or call all_to_all_4d on each",
        )
    if len({(t.dtype, t.device) for t in named.values()}) != 1:
        raise CollectiveError(
            "all_to_all_qkv",
            axis,
            f"q, k and v differ in dtype or device ({[str(t.dtype) for t in named.values()]})",
            "cast them to one dtype and device, or call all_to_all_4d on each",
        )
    for name, t in named.items():
        if t.shape[2] % n:
            raise CollectiveError(
                "all_to_all_qkv",
                axis,
                f"{name} has {t.shape[2]} heads, not divisible by the axis size {n}",
                f"pad the heads to a multiple of {n}",
            )


@names_this_rank
def all_to_all_qkv(
    q: Tensor, k: Tensor, v: Tensor, mesh: Mesh, axis: AxisName
) -> tuple[Tensor, Tensor, Tensor]:
    """``all_to_all_4d(t, mesh, axis)`` of each of q, k and v, in one exchange.

    Each ``(batch, seq/P, H, head_dim)`` tensor becomes ``(batch, seq, H/P, head_dim)``: every
    rank trades its sequence shard of all heads for the whole sequence of its head shard
    (``P`` the axis size). The three may differ in head count and head dim (grouped-query k
    and v, a v head dim of its own), not in batch, sequence, dtype or device; every head count
    must be divisible by ``P``. Gradient: the inverse exchange of the three gradients, packed
    into one all-to-all too. The results are bit-equal to three ``all_to_all_4d`` calls; for
    batch 1 they are views of the one received buffer (strided along the sequence: attention
    kernels take them as they are).

    Args:
        q: this rank's queries ``(batch, seq/P, Hq, D)``.
        k: this rank's keys ``(batch, seq/P, Hk, D)``.
        v: this rank's values ``(batch, seq/P, Hv, Dv)``.
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).

    Returns:
        ``(q, k, v)``, each ``(batch, seq, H/P, head_dim)``: the whole sequence (ranks' shards in
        axis order) of this rank's ``H/P`` heads (rank ``r`` gets heads ``r*H/P ..``).

    >>> import torch, fastdist
    >>> from fastdist.ops import all_to_all_qkv
    >>> mesh = fastdist.Mesh({"sp": 2})
    >>> t = torch.arange(16.).view(2, 1, 2, 2, 2)  # per rank: (1, 2 tokens, 2 heads, 2)
    >>> step = lambda t: all_to_all_qkv(t, t, t, mesh, "sp")[0]
    >>> fastdist.simulate(step, mesh)(t).shape  # per rank: (1, 4 tokens, 1 head, 2)
    torch.Size([2, 1, 4, 1, 2])
    """
    check_mesh("all_to_all_qkv", mesh, axis)
    n = mesh.axis_size(axis)
    _check(q, k, v, axis, n)
    B, m = q.shape[:2]
    # (n, B, m, h_i * D_i): rank j's head group of each, side by side; one copy
    widths = [t.shape[2] // n * t.shape[3] for t in (q, k, v)]
    packed = torch.cat([t.reshape(B, m, n, w).movedim(2, 0) for t, w in zip((q, k, v), widths)], -1)
    got = all_to_all(packed, mesh, axis, split_dim=0, concat_dim=0)  # (n senders, B, m, F)
    parts = torch.split(got, widths, dim=-1)  # views
    # (B, n*m, h_i, D_i), the senders' tokens in axis order; a view when B == 1
    q2, k2, v2 = (
        p.movedim(0, 1).reshape(B, n * m, t.shape[2] // n, t.shape[3])
        for p, t in zip(parts, (q, k, v))
    )
    return q2, k2, v2


def pvary_packed(ts: Sequence[Tensor | None], mesh: Mesh, axis: AxisName) -> list[Tensor | None]:
    """``pvary(t, mesh, axis)`` of each tensor of ``ts`` (``None`` stays ``None``).

    On real ranks, recording a graph, outside a replication check and ``torch.compile``, the
    tensors of one dtype and device that need a gradient go through one autograd node whose
    backward sums their gradients over ``axis`` in ONE ``psum`` of their concatenation (a
    gradient that does not come is summed as zeros: every rank sends the same buffer); the
    values are those of one ``psum`` per tensor (an elementwise sum). Recording no graph
    (``torch.no_grad()``, inference mode) outside a replication check, the tensors come back as
    they are (``pvary``'s forward is the identity; only its backward does anything: no copy, as
    `fastdist.nn.PvarySites` under no grad). Anywhere else each tensor is ``pvary``'d on its own.
    """
    out: list[Tensor | None] = list(ts)
    grad = torch.is_grad_enabled()
    if not grad and check_of(mesh) is None:
        return out
    fast = grad and is_real(mesh) and check_of(mesh) is None and not torch.compiler.is_compiling()
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(ts):
        if t is None:
            continue
        if fast and t.requires_grad:
            groups.setdefault((t.dtype, t.device), []).append(i)
        else:
            out[i] = pvary(t, mesh, axis)
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = pvary(ts[idx[0]], mesh, axis)  # type: ignore[arg-type]
            continue
        views = _PackedPvary.apply(mesh, axis, *(ts[i] for i in idx))  # type: ignore[no-untyped-call]
        for i, v in zip(idx, views):
            out[i] = v
    return out


class _PackedPvary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, mesh: Mesh, axis: AxisName, *ts: Tensor) -> tuple[Tensor, ...]:
        ctx.mesh, ctx.axis = mesh, axis
        ctx.shapes = [t.shape for t in ts]
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in ts)

    @staticmethod
    def backward(ctx: Any, *gs: Tensor | None) -> tuple[Tensor | None, ...]:
        known = next((g for g in gs if g is not None), None)
        if known is None:  # no gradient came at all (the same on every rank: the same graph)
            return (None, None, *(None for _ in gs))
        flat = torch.cat(
            [
                g.reshape(-1) if g is not None else known.new_zeros(shape.numel())
                for g, shape in zip(gs, ctx.shapes)
            ]
        )
        flat = psum(flat, ctx.mesh, ctx.axis)
        sums = torch.split(flat, [shape.numel() for shape in ctx.shapes])
        return (None, None, *(s.view(shape) for s, shape in zip(sums, ctx.shapes)))
