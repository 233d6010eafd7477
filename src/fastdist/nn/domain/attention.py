"""Self-attention over spatial tokens in a domain-parallel model: each rank keeps the queries of
its own block and attends to the keys and values of the whole domain, gathered over the split
axes (``all_gather``: in backward each rank gets the sum over ranks of its keys' and values'
gradients, ``psum_scatter``).

The keys' order does not change a softmax over them (no mask, no positional bias), so the blocks
are gathered as they lie, one axis after the other, without reordering them into the domain's
row-major order. The attention module's own ``forward`` runs (diffusers' ``Attention`` with its
``AttnProcessor2_0``, Wan's ``WanAttentionBlock``): `attention_call` marks it, and the style's
functional guard sends its ``F.scaled_dot_product_attention`` to `gathered_sdpa`. A forward that
ran no ``F.scaled_dot_product_attention`` (another processor) raises after it, at the first call.

``ring=True`` (``DomainParallel(..., attention="ring")``): no rank gathers the whole domain's keys;
the blocks of keys and values travel around the ring of the split axes (``ring_shift`` over them
taken as one flattened axis), and each rank merges its queries' scores against each block with an
online softmax (a running max, sum and weighted sum of values, `ring_sdpa`). `RingAttention` has
its own backward, which passes the blocks around again with their gradients' accumulators (as
flash attention recomputes its scores): neither pass holds more than this rank's block and the
one arriving, and the backward keeps only this rank's ``q``, ``k``, ``v``, the output and the
log-sum-exp of each query's scores. Uneven blocks on simulated ranks (padded to one shape): the
padding tokens are masked out of the keys (`AttentionCall.valid`), in both forms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.domain.windows import outside_region, ragged_mask, region
from fastdist.ops import all_gather, all_gather_v, ring_shift

__all__ = [
    "AttentionCall",
    "attention_call",
    "current_attention",
    "flat_split",
    "gathered_sdpa",
    "is_spatial_attention",
    "RingAttention",
    "ring_sdpa",
    "run_attention",
]


@dataclass
class AttentionCall:
    """One running attention module: where, the axes its tokens span, this rank's token count."""

    mesh: Mesh
    where: str
    axes: tuple[str, ...]
    tokens: int
    cross: bool
    hits: int = 0
    #: keys passed around a ring (online softmax) in place of gathered
    ring: bool = False
    #: this rank's valid tokens ``[tokens]`` (bool; simulated uneven blocks), or ``None``: all
    valid: Tensor | None = None


def current_attention() -> AttentionCall | None:
    """The innermost attention module running now, or ``None``."""
    calls = region().attention
    return calls[-1] if calls else None


def is_spatial_attention(m: nn.Module) -> bool:
    """diffusers' ``Attention`` (its processors call ``F.scaled_dot_product_attention``) and
    Wan's per-frame ``WanAttentionBlock``: modules the style runs with gathered keys."""
    name = type(m).__name__
    return (name == "Attention" and type(m).__module__.startswith("diffusers")) or (
        name == "WanAttentionBlock"
    )


@contextmanager
def attention_call(call: AttentionCall) -> Iterator[AttentionCall]:
    """Mark ``call`` running; raise after it if it attended without the gathered keys."""
    calls = region().attention
    calls.append(call)
    try:
        yield call
    finally:
        calls.pop()
    if call.hits == 0:
        raise ParallelizeError(
            f"domain parallel: {call.where} ran no F.scaled_dot_product_attention, so the style "
            "could not give its queries the whole domain's keys (another attention processor?). "
            "Fix: diffusers' AttnProcessor2_0 (attn.set_processor(AttnProcessor2_0()))"
        )


def run_attention(
    mesh: Mesh,
    split: tuple[tuple[int, str], ...],
    where: str,
    ring: bool,
    forward: Callable[..., Tensor],
    *args: Any,
    **kwargs: Any,
) -> Tensor:
    """An attention module's own ``forward`` on this rank's block ``[N, C, *spatial]``: its tokens
    are the last two spatial dims (H x W); a split dim before them (T of
    Wan's per-frame attention) is in its batch."""
    if not region().depth:
        raise outside_region(where)
    x = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
    cross = kwargs.get("encoder_hidden_states") is not None or (
        len(args) > 1 and isinstance(args[1], Tensor)
    )
    if not isinstance(x, Tensor) or x.dim() < 4:
        raise ParallelizeError(
            f"domain parallel: {where} got {tuple(getattr(x, 'shape', ()))}, not a field "
            "[N, C, H, W] (tokens flattened by the model's code: the style cannot tell which "
            "split dims they span). Fix: an attention module that takes the field (diffusers' "
            "VAE / UNet attention blocks), or end the region before it"
        )
    token_dims = (-2, -1)
    axes = tuple(a for d, a in split if d in token_dims)
    tokens = math.prod(x.shape[d] for d in token_dims)
    valid = ragged_mask(x, 2, mesh, split, where, token_dims)
    if valid is not None:  # [H, 1], [W] or [H, W] -> [H * W]
        valid = valid.expand(x.shape[-2:]).flatten()
    with attention_call(AttentionCall(mesh, where, axes, tokens, cross, ring=ring, valid=valid)):
        out: Tensor = forward(*args, **kwargs)
    return out


def gathered_sdpa(
    call: AttentionCall,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    **kwargs: Any,
) -> Tensor:
    """``F.scaled_dot_product_attention`` of this rank's queries ``[..., L, d]`` over the keys and
    values of every rank of ``call.axes`` (self-attention), or over the replicated keys as they
    are (cross-attention)."""
    if attn_mask is not None or is_causal or dropout_p:
        raise ParallelizeError(
            f"domain parallel: {call.where} attends with a mask, is_causal or dropout over "
            "spatial tokens split across ranks: not built. Fix: no mask, dropout_p=0"
        )
    if q.shape[-2] != call.tokens or (not call.cross and k.shape[-2] != call.tokens):
        raise ParallelizeError(
            f"domain parallel: {call.where} attends over {q.shape[-2]} queries and "
            f"{k.shape[-2]} keys, not this rank's {call.tokens} tokens of the field. Fix: an "
            "attention over the field's H x W tokens, or end the region before it"
        )
    call.hits += 1
    if call.cross or not call.axes:
        out: Tensor = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return out
    if call.ring:
        return ring_sdpa(call, q, k, v, scale=kwargs.get("scale"))
    k, v = gather_tokens(k, call), gather_tokens(v, call)
    if call.valid is not None:  # padding keys (simulated uneven blocks) left out
        keep = gather_tokens(call.valid.to(q.dtype), call, 0) > 0.5
        kwargs = {**kwargs, "attn_mask": keep.reshape(*[1] * (q.dim() - 1), -1)}
    out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    return out


def ring_sdpa(
    call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None
) -> Tensor:
    """Attention of this rank's queries ``[..., Lq, d]`` over every rank's keys and values
    ``[..., Lk, d]`` of ``call.axes`` (one flattened ring): each block's scores merged with an
    online softmax, the next block's transfer issued before this block's products. The backward
    passes the blocks around again (with their gradients' accumulators), so neither pass keeps
    more than this rank's block and the one arriving."""
    axis: Any = call.axes[0] if len(call.axes) == 1 else call.axes
    valid = None if call.valid is None else call.valid.to(q.dtype)  # [Lk]: 1 on real tokens
    if call.mesh.backend is not None:  # real ranks: uneven blocks padded to one shape to travel
        rows = all_gather(k.new_tensor([float(k.shape[-2])]), call.mesh, axis)
        top_rows, own = int(rows.max().item()), k.shape[-2]
        if top_rows != own:
            k, v = (F.pad(t, (0, 0, 0, top_rows - own)) for t in (k, v))
        if int(rows.min().item()) != top_rows:
            valid = (torch.arange(top_rows, device=q.device) < own).to(q.dtype)
    if valid is None:
        valid = q.new_ones(k.shape[-2])
    factor = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, _ = RingAttention.apply(q, k, v, valid, call.mesh, axis, factor)  # type: ignore[no-untyped-call]
    result: Tensor = out
    return result


def _scores(q: Tensor, k: Tensor, valid: Tensor, factor: float) -> Tensor:
    """``q k^T * factor`` ``[..., Lq, Lk]``, the padding keys (``valid < 0.5``) at ``-inf``."""
    return (q @ k.transpose(-1, -2) * factor).masked_fill(valid < 0.5, float("-inf"))


class RingAttention(torch.autograd.Function):
    """Ring attention over the ranks of ``axis`` with its own backward: the forward merges the
    blocks with an online softmax and keeps only this rank's ``q``, ``k``, ``v``, the output and
    the log-sum-exp per query; the backward passes ``k``, ``v`` around again with the
    accumulators of their gradients (``n`` shifts bring each accumulator home)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        q: Tensor, k: Tensor, v: Tensor, valid: Tensor, mesh: Mesh, axis: Any, factor: float
    ) -> tuple[Tensor, Tensor]:
        n = mesh.axis_size(axis)
        top = total = acc = None
        for step in range(n):
            if step + 1 < n:  # the block of rank (i - step - 1) % n, on its way
                nxt = [ring_shift(t, mesh, axis) for t in (k, v, valid)]
            s = _scores(q, k, valid, factor)  # [..., Lq, Lk]
            # every rank's own block has a real token, so the running max starts finite
            new_top = (
                s.amax(-1, keepdim=True)
                if top is None
                else torch.maximum(top, s.amax(-1, keepdim=True))
            )
            p = torch.exp(s - new_top)
            if top is None or total is None or acc is None:
                total, acc = p.sum(-1, keepdim=True), p @ v  # [..., Lq, 1], [..., Lq, dv]
            else:
                rescale = torch.exp(top - new_top)
                total = total * rescale + p.sum(-1, keepdim=True)
                acc = acc * rescale + p @ v
            top = new_top
            if step + 1 < n:
                k, v, valid = nxt
        assert acc is not None and total is not None and top is not None
        return acc / total, top + torch.log(total)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        q, k, v, valid, mesh, axis, factor = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, valid, out, lse)
        ctx.mesh, ctx.axis, ctx.factor = mesh, axis, factor
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, valid, out, lse = ctx.saved_tensors
        mesh, axis, factor = ctx.mesh, ctx.axis, ctx.factor
        n = mesh.axis_size(axis)
        delta = (dout * out).sum(-1, keepdim=True)  # [..., Lq, 1]
        dq = torch.zeros_like(q)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)  # travel with their block
        for step in range(n):
            p = torch.exp(_scores(q, k, valid, factor) - lse)  # [..., Lq, Lk]: the softmax
            dv = dv + p.transpose(-1, -2) @ dout
            ds = p * (dout @ v.transpose(-1, -2) - delta)
            dq = dq + ds @ k * factor
            dk = dk + ds.transpose(-1, -2) @ q * factor
            if step + 1 < n:
                k, v, valid = (ring_shift(t, mesh, axis) for t in (k, v, valid))
            dk, dv = ring_shift(dk, mesh, axis), ring_shift(dv, mesh, axis)
        return dq, dk, dv, None, None, None, None


def gather_tokens(t: Tensor, call: AttentionCall, dim: int = -2) -> Tensor:
    """Every rank's tokens (dim ``dim``) over ``call.axes``: ``all_gather`` (even blocks, or
    simulated uneven ones padded to one shape) or, on real ranks whose blocks differ,
    ``all_gather_v`` by each rank's token count."""
    mesh, dim = call.mesh, dim % t.dim()
    for axis in call.axes:
        if mesh.backend is None:
            t = all_gather(t, mesh, axis, dim)
            continue
        rows = all_gather(t.new_tensor([float(t.shape[dim])]), mesh, axis)
        sizes = [int(r) for r in rows.tolist()]
        if len(set(sizes)) == 1:
            t = all_gather(t, mesh, axis, dim)
        else:
            t = all_gather_v(t.contiguous(), mesh, axis, sizes, dim)
    return t


def flat_split(call: AttentionCall) -> tuple[tuple[int, str], ...]:
    """The split of a ``[N, C, L]`` view of the field inside an attention module (diffusers'
    ``Attention.group_norm`` on the flattened tokens): every token axis on the last dim."""
    return tuple((-1, a) for a in call.axes)
