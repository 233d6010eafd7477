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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.ops import all_gather, all_gather_v

__all__ = [
    "AttentionCall",
    "attention_call",
    "current_attention",
    "flat_split",
    "gathered_sdpa",
    "is_spatial_attention",
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


#: the attention modules running now (innermost last)
_CALLS: list[AttentionCall] = []


def current_attention() -> AttentionCall | None:
    """The innermost attention module running now, or ``None``."""
    return _CALLS[-1] if _CALLS else None


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
    _CALLS.append(call)
    try:
        yield call
    finally:
        _CALLS.pop()
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
    forward: Callable[..., Tensor],
    *args: Any,
    **kwargs: Any,
) -> Tensor:
    """An attention module's own ``forward`` on this rank's block ``[N, C, *spatial]``: its tokens
    are the last two spatial dims (H x W); a split dim before them (T of
    Wan's per-frame attention) is in its batch."""
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
    with attention_call(AttentionCall(mesh, where, axes, tokens, cross)):
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
    if not call.cross and call.axes:
        k, v = gather_tokens(k, call), gather_tokens(v, call)
    out: Tensor = F.scaled_dot_product_attention(q, k, v, **kwargs)
    return out


def gather_tokens(t: Tensor, call: AttentionCall) -> Tensor:
    """Every rank's tokens (dim -2) over ``call.axes``: ``all_gather`` (even blocks) or, on real
    ranks whose blocks differ, ``all_gather_v`` by each rank's token count."""
    mesh, dim = call.mesh, t.dim() - 2
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
