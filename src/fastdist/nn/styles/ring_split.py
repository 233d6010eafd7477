"""A token sequence split over one mesh axis or two (Ulysses x ring), evenly or not, and the
attention over it: what `fastdist.nn.ContextParallel` runs inside an unmodified model.

`TokenSplit` is the layout: ``T`` tokens over the ``n`` ranks of ``axes`` (one axis, or
``(ring_axis, ulysses_axis)`` ring-major, so that after the Ulysses all-to-all each ring rank
holds one contiguous block). Rank ``i`` owns ``sizes[i]`` consecutive tokens, ``T // n`` or one
more (the first ``T % n`` ranks); every rank holds ``m = ceil(T / n)`` rows, its tokens first,
then zero rows when ``n`` does not divide ``T``. The padding rows never reach a result: the
attention masks them as keys, their outputs are dropped by `TokenSplit.gather`, so their
gradient is zero. Nothing of the user's sequence is padded: the result is that of the whole
``T`` tokens.

`split_attention` is one self-attention over the split tokens, given this rank's q, k, v
(rotary embedding already applied, for the rank's own positions):

* ``ulysses``: all-to-all to every token of ``H / n`` heads, ``F.scaled_dot_product_attention``
  (with a key mask when uneven), all-to-all back;
* ``ring``: `fastdist.nn.RingAttention` over the axis (any head count);
* ``usp``: the Ulysses all-to-all over ``ulysses_axis``, then the ring over ``ring_axis``.

The ring has no key mask; for uneven splits a padding key is given a score of about -1e4 by one
extra head dimension (``q' = [q * sqrt((D+1)/D), 1]``, ``k' = [k, 0 or -1e4 * sqrt(D+1)]``), so
its softmax weight is ``exp(-1e4) = 0`` exactly in every float dtype, and a real key's score is
unchanged up to rounding.

`AttentionSwap` is the ``TorchFunctionMode`` that puts `split_attention` in place of the one
``F.scaled_dot_product_attention`` a model's attention processor calls. `DispatchSwap` does the
same without a mode for the processors that reach the attention only through diffusers'
``dispatch_attention_fn`` (`DIRECT_PROCESSORS`): a mode runs every torch call of the processor
through Python (about 0.3-0.5 ms per attention call of a Wan block at 512 rows per rank).
"""

from __future__ import annotations

import math
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from fastdist.core.mesh import AxisName, Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.attention import RingAttention
from fastdist.ops import (
    all_gather,
    all_gather_invariant,
    all_to_all_4d,
    axis_index,
    local_chunk,
)

__all__ = [
    "TokenSplit",
    "split_attention",
    "joint_attention",
    "AttentionSwap",
    "DispatchSwap",
    "DIRECT_PROCESSORS",
    "SDPA",
]

#: torch's own attention function, captured at import: what `AttentionSwap` replaces
SDPA: Any = F.scaled_dot_product_attention

#: the score a padding key gets in the ring (exp of it is 0 in every float dtype)
_MASKED_SCORE = 1e4


@dataclass(frozen=True)
class TokenSplit:
    """``tokens`` split over the ranks of ``axes`` (see the module docstring for the layout).

    Args:
        mesh: the mesh.
        axes: the split axes, row-major (``(ring_axis, ulysses_axis)`` for USP).
        tokens: the whole sequence length ``T``.

    >>> import fastdist as fd
    >>> s = TokenSplit(fd.Mesh({"sp": 2}), ("sp",), 5)
    >>> s.sizes, s.rows, s.even
    ((3, 2), 3, False)
    """

    mesh: Mesh
    axes: tuple[str, ...]
    tokens: int
    #: the axes as the collectives take them (one name, or a tuple row-major); set once here:
    #: read a dozen times per forward. Not a ``functools.cached_property``: its lock is a
    #: context manager dynamo cannot enter, so every traced use was a graph break (in a module
    #: hook, one dynamo cannot resume from: it ran the enclosing frame eagerly)
    axis: AxisName = field(init=False, repr=False, compare=False)
    #: the number of ranks the tokens are split over (``Mesh.axis_size`` resolves the axes)
    n: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        axis = self.axes[0] if len(self.axes) == 1 else self.axes
        object.__setattr__(self, "axis", axis)
        object.__setattr__(self, "n", self.mesh.axis_size(axis))
        if self.tokens < self.n:
            raise ParallelizeError(
                f"context parallelism over {self.axes}: {self.tokens} tokens over {self.n} "
                f"ranks leaves a rank without tokens. Fix: at least {self.n} tokens (more frames "
                "or a higher resolution), or fewer ranks"
            )

    @property
    def sizes(self) -> tuple[int, ...]:
        """The tokens each rank owns, in (row-major) axis order."""
        q, r = divmod(self.tokens, self.n)
        return tuple(q + (i < r) for i in range(self.n))

    @property
    def rows(self) -> int:
        """The rows every rank holds: ``ceil(T / n)``."""
        return -(-self.tokens // self.n)

    @property
    def even(self) -> bool:
        """Whether ``n`` divides ``T`` (no padding row anywhere)."""
        return self.tokens % self.n == 0

    def _padded_index(self, device: Any) -> Tensor:
        """(n * rows,) the token of each padded row, ``T`` (a zero row) for padding."""
        m, idx, start = self.rows, [], 0
        for size in self.sizes:
            idx += [*range(start, start + size), *[self.tokens] * (m - size)]
            start += size
        return torch.tensor(idx, device=device)

    def _valid_rows(self, device: Any) -> Tensor:
        """(n * rows,) the padded rows that hold a token, in order."""
        m = self.rows
        keep = torch.arange(m) < torch.tensor(self.sizes).unsqueeze(1)  # (n, m)
        return keep.flatten().nonzero().squeeze(1).to(device)

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's rows of a replicated ``x`` whose ``dim`` has the ``T`` tokens (its tokens,
        then zero rows). Backward gathers the gradient (``local_chunk``)."""
        if x.shape[dim] != self.tokens:
            raise ParallelizeError(
                f"context parallelism over {self.axes}: a tensor {tuple(x.shape)} meant to be "
                f"split with the {self.tokens} tokens has {x.shape[dim]} along dim {dim}. Fix: "
                "a plan whose split tensors all follow the tokens"
            )
        if not self.even:
            zero = torch.zeros_like(x.narrow(dim, 0, 1))
            # (.., n * rows, ..): every rank's block padded to `rows`
            x = torch.cat([x, zero], dim).index_select(dim, self._padded_index(x.device))
        return local_chunk(x, self.mesh, self.axis, dim=dim)

    def gather(self, x: Tensor, dim: int = 1) -> Tensor:
        """The whole sequence (``T`` along ``dim``), replicated, from every rank's rows; padding
        rows dropped. Backward: each rank keeps the gradient of its own rows."""
        whole = all_gather_invariant(x, self.mesh, self.axis, dim=dim)  # (.., n * rows, ..)
        if self.even:
            return whole.contiguous()
        return whole.index_select(dim, self._valid_rows(x.device))  # (.., T, ..)

    def key_flags(self, ring_axis: str | None, device: Any) -> Tensor:
        """(keys,) which rows of the keys one attention sees are real tokens: with a ring, this
        ring rank's block (``n_ulysses * rows``, after the Ulysses exchange); without, every
        padded row of the sequence."""
        nr = self.mesh.axis_size(ring_axis) if ring_axis is not None else 1
        sizes = torch.tensor(self.sizes, device=device).view(nr, -1)  # (ring, ulysses)
        if ring_axis is not None:
            sizes = sizes[axis_index(self.mesh, ring_axis).to(device)]  # (ulysses,) this ring rank
        return (torch.arange(self.rows, device=device) < sizes.unsqueeze(-1)).flatten()


def _ring(
    q: Tensor, k: Tensor, v: Tensor, split: TokenSplit, ring_axis: str, flags: Tensor | None = None
) -> Tensor:
    """Ring attention over ``ring_axis`` of ``(B, S, H, D)`` blocks; the keys whose ``flags``
    (``(S,)`` or ``(B, S)`` bool, this rank's block) are False masked (default: the split's
    padding rows)."""
    ring = RingAttention(split.mesh, ring_axis)
    if flags is None:
        if split.even:
            return cast(Tensor, ring(q, k, v))
        flags = split.key_flags(ring_axis, q.device)  # (S,) bool
    d = q.shape[-1]
    # one more head dim: a real key's score is unchanged, a padding key's is ~ -1e4
    extra = torch.where(flags, 0.0, -_MASKED_SCORE * math.sqrt(d + 1)).to(k.dtype)
    ones = q.new_ones(*q.shape[:-1], 1)
    q1 = torch.cat([q * math.sqrt((d + 1) / d), ones], -1)  # (B, S, H, D + 1)
    extra = extra.view(-1 if flags.dim() == 2 else 1, k.shape[1], 1, 1)  # (B or 1, S, 1, 1)
    k1 = torch.cat([k, extra.expand(*k.shape[:-1], 1)], -1)  # (B, S, H, D + 1)
    return cast(Tensor, ring(q1, k1, v))


def split_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    split: TokenSplit,
    *,
    ulysses_axis: str | None,
    ring_axis: str | None,
) -> Tensor:
    """Unmasked, non-causal attention of this rank's queries over the whole split sequence.

    Args:
        q: this rank's queries ``(batch, rows, heads, head_dim)`` (rotary applied).
        k: this rank's keys, like ``q``.
        v: this rank's values ``(batch, rows, heads, v_dim)``.
        split: the token layout (its axes: ``(ulysses_axis,)``, ``(ring_axis,)`` or
            ``(ring_axis, ulysses_axis)``).
        ulysses_axis: the axis of the heads <-> tokens all-to-all, or ``None``.
        ring_axis: the axis whose ranks pass k/v around, or ``None``.

    Returns:
        this rank's rows of the output ``(batch, rows, heads, v_dim)``; padding rows are not
        meaningful.
    """
    if ulysses_axis is not None:
        # (B, n_u * rows, H / n_u, D): every token of this ring block, this rank's heads
        q, k, v = (all_to_all_4d(t, split.mesh, ulysses_axis) for t in (q, k, v))
    if ring_axis is not None:
        o = _ring(q, k, v, split, ring_axis)
    else:
        mask = None if split.even else split.key_flags(None, q.device).view(1, 1, 1, -1)
        o = SDPA(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        o = o.transpose(1, 2)  # (B, S, H', Dv)
    if ulysses_axis is not None:
        o = all_to_all_4d(o, split.mesh, ulysses_axis, scatter_dim=1, gather_dim=2)
    return o  # (B, rows, H, Dv)


def _my_heads(t: Tensor, mesh: Mesh, axis: str) -> Tensor:
    """This rank's ``H / n`` heads of a ``(B, S, H, D)`` tensor that every rank of ``axis``
    holds: a plain slice (its gradient stays on this rank's heads, zero elsewhere)."""
    n = mesh.axis_size(axis)
    idx = axis_index(mesh, axis).to(t.device)
    heads = t.view(*t.shape[:2], n, t.shape[2] // n, *t.shape[3:])  # (B, S, n, H / n, D)
    return heads[:, :, idx]  # (B, S, H / n, D)


def joint_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    split: TokenSplit,
    *,
    text: int,
    text_first: bool,
    ulysses_axis: str | None,
    ring_axis: str | None,
    key_mask: Tensor | None = None,
) -> Tensor:
    """Joint text-image attention (MM-DiT) over the split image tokens and the ``text`` tokens
    every rank holds: every query (text and this rank's image rows) attends over the text keys
    once and every image key of the whole sequence.

    * Ulysses: the image rows go through the all-to-all (every image token, ``H / n`` heads); the
      text q, k, v are cut to the same ``H / n`` heads (every rank holds them all); one attention
      over ``[text; image]``; the image rows go back through the all-to-all, the text output's
      heads are gathered (``all_gather``: its gradient is summed over the ranks, each rank's
      text gradient being partial).
    * ring: each rank's queries are ``[text; image rows]``; the key/value block that travels is
      ``[text; image rows]`` too, its text rows real on ring rank 0 only and masked elsewhere, so
      the text keys count once. Every ring rank computes the text queries' output over the whole
      sequence (the same value on every rank).
    * USP: both, Ulysses first.

    The text rows' gradients this returns are a rank's part of the whole (they sum over the
    ranks): the text stream must be ``pvary``'d, as `ContextParallel` does with every parameter
    of the blocks and with the outputs of its ``feeds``.

    Args:
        q: ``(batch, text + rows, heads, head_dim)``: the text rows and this rank's image rows,
            in the processor's order (``text_first``).
        k: like ``q``.
        v: ``(batch, text + rows, heads, v_dim)``.
        split: the image token layout.
        text: the number of text tokens.
        text_first: whether the text rows come first (Flux, CogVideoX) or last (SD3).
        ulysses_axis: the axis of the heads <-> tokens all-to-all, or ``None``.
        ring_axis: the axis whose ranks pass k/v around, or ``None``.
        key_mask: ``(batch, text + rows)`` bool, in the order of ``q``: which of this rank's
            keys (text, the same on every rank, and its image rows) are attended (text padding:
            HunyuanVideo, QwenImage); ``None``: all. The image rows' flags go with their keys
            (through the all-to-all, around the ring); a query whose keys are all masked is not
            supported (its row is NaN, as on one device).

    Returns:
        the output ``(batch, text + rows, heads, v_dim)`` in the same order.
    """
    rows = q.shape[1] - text

    def parts(t: Tensor) -> tuple[Tensor, Tensor]:  # (text part, image part)
        return (t[:, :text], t[:, text:]) if text_first else (t[:, rows:], t[:, :rows])

    (qt, qi), (kt, ki), (vt, vi) = parts(q), parts(k), parts(v)
    keys = _joint_key_flags(key_mask, parts, split, ulysses_axis)  # (B, text + S) or None
    if ulysses_axis is not None:
        # (B, n_u * rows, H / n_u, D): every image token of this ring block, this rank's heads
        qi, ki, vi = (all_to_all_4d(t, split.mesh, ulysses_axis) for t in (qi, ki, vi))
        qt, kt, vt = (_my_heads(t, split.mesh, ulysses_axis) for t in (qt, kt, vt))
    qj, kj, vj = (torch.cat(pair, 1) for pair in ((qt, qi), (kt, ki), (vt, vi)))  # text first
    if ring_axis is not None:
        first = axis_index(split.mesh, ring_axis).to(q.device) == 0  # the text keys' ring rank
        flags = torch.cat([first.expand(text), split.key_flags(ring_axis, q.device)])
        if keys is not None:  # (B, text + S): and the mask's
            flags = flags & keys
        o = _ring(qj, kj, vj, split, ring_axis, flags)
    else:
        mask = None
        if not split.even or keys is not None:
            real = [q.new_ones(text, dtype=torch.bool), split.key_flags(None, q.device)]
            mask = torch.cat(real).view(1, 1, 1, -1)  # (1, 1, 1, keys): every query, head
            if keys is not None:  # (B, 1, 1, keys)
                mask = mask & keys[:, None, None]
        o = SDPA(qj.transpose(1, 2), kj.transpose(1, 2), vj.transpose(1, 2), attn_mask=mask)
        o = o.transpose(1, 2)  # (B, text + S, H', Dv)
    ot, oi = o[:, :text], o[:, text:]
    if ulysses_axis is not None:
        oi = all_to_all_4d(oi, split.mesh, ulysses_axis, scatter_dim=1, gather_dim=2)
        ot = all_gather(ot.contiguous(), split.mesh, ulysses_axis, dim=2)  # (B, text, H, Dv)
    return torch.cat([ot, oi] if text_first else [oi, ot], 1)  # (B, text + rows, H, Dv)


def _joint_key_flags(
    key_mask: Tensor | None,
    parts: Callable[[Tensor], tuple[Tensor, Tensor]],
    split: TokenSplit,
    ulysses_axis: str | None,
) -> Tensor | None:
    """The flags ``(B, text + S)`` of the keys one joint attention sees, text first: the text
    keys', then the image keys' (after the Ulysses exchange, every rank's rows of this ring
    block: ``S = n_u * rows``), from this rank's joint key mask ``(B, text + rows)``; ``None``
    without one."""
    if key_mask is None:
        return None
    text_keys, image_keys = parts(key_mask.bool())
    if ulysses_axis is not None:  # every rank's image rows of the block, in rank order
        flags = image_keys.to(torch.float32)  # gathered as numbers (B, n_u * rows)
        image_keys = all_gather_invariant(flags, split.mesh, ulysses_axis, dim=1) > 0.5
    return torch.cat([text_keys, image_keys], 1)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _refuse_odd(
    where: str,
    q: Tensor,
    k: Tensor,
    seq_dim: int,
    masked: bool,
    dropout_p: Any,
    is_causal: Any,
    enable_gqa: Any,
    scale: Any,
) -> None:
    """Refuse an attention call that the split attention cannot stand in for (``seq_dim``: the
    tokens' dim of ``q`` and ``k``, 4-d; ``masked``: a mask other than a key mask)."""
    odd = {
        "attn_mask": masked,
        "dropout_p": bool(dropout_p),
        "is_causal": bool(is_causal),
        "enable_gqa": bool(enable_gqa),
        "scale": scale is not None and not math.isclose(scale, q.shape[-1] ** -0.5),
        "shape": q.dim() != 4 or k.dim() != 4 or q.shape[seq_dim] != k.shape[seq_dim],
    }
    bad = [name for name, is_odd in odd.items() if is_odd]
    if bad:
        raise ParallelizeError(
            f"sequence-parallel attention {where!r}: its processor called "
            f"scaled_dot_product_attention with {bad} (q {tuple(q.shape)}, k "
            f"{tuple(k.shape)}); only a non-causal attention without dropout, unmasked (a "
            "joint attention: a boolean key mask (batch, 1, 1, keys)), is split. Fix: run "
            "this attention without context parallelism, or a plan for it"
        )


class AttentionSwap(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention(q, k, v)`` (``(B, H, S, D)``, no mask, no
    dropout, not causal, the default scale) runs as ``attend(q, k, v)`` on ``(B, S, H, D)``
    tensors; any other attention call is refused. ``calls`` counts the replaced calls.

    Args:
        attend: the attention over ``(B, S, H, D)`` q, k, v.
        where: the attention module's name, for errors.
        key_masks: also take a boolean key mask ``(B or 1, 1, 1, keys)`` (the same for every
            query and head: text padding), given to ``attend`` as ``key_mask=(B, keys)``.
    """

    def __init__(self, attend: Callable[..., Tensor], where: str, key_masks: bool = False) -> None:
        super().__init__()
        self.attend, self.where, self.calls, self.key_masks = attend, where, 0, key_masks

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not SDPA:
            return func(*args, **kwargs)
        given = {**dict(zip(_SDPA_ARGS, args)), **kwargs}
        q, k, v = given["query"], given["key"], given["value"]
        scale = given.get("scale")
        mask = given.get("attn_mask")
        key_mask = self._key_mask(mask, q, k) if self.key_masks else None
        _refuse_odd(
            self.where,
            q,
            k,
            -2,
            mask is not None and key_mask is None,
            given.get("dropout_p", 0.0),
            given.get("is_causal", False),
            given.get("enable_gqa", False),
            scale,
        )
        self.calls += 1
        extra = {} if key_mask is None else {"key_mask": key_mask}
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **extra)
        return out.transpose(1, 2)  # (B, H, S, Dv)

    @staticmethod
    def _key_mask(mask: Any, q: Tensor, k: Tensor) -> Tensor | None:
        """``(B, keys)`` of a boolean key mask ``(B or 1, 1, 1, keys)``; ``None`` for no mask
        or any other (refused by the caller)."""
        keys = k.shape[-2]
        if not (
            isinstance(mask, Tensor)
            and mask.dtype == torch.bool
            and mask.dim() == 4
            and mask.shape[1] == mask.shape[2] == 1
            and mask.shape[3] == keys
            and mask.shape[0] in (1, q.shape[0])
        ):
            return None
        return mask.reshape(mask.shape[0], keys).expand(q.shape[0], keys)


#: attention processors whose ``__call__`` reaches the attention only through diffusers'
#: ``dispatch_attention_fn`` (read in diffusers 0.42: Wan's and LTX-Video's self-attention call
#: it once, with q, k, v ``(B, S, H, D)``): `DispatchSwap` swaps it without a mode
DIRECT_PROCESSORS = frozenset({"WanAttnProcessor", "LTXVideoAttnProcessor"})


def _code_names(code: types.CodeType) -> set[str]:
    """The global and attribute names ``code`` and the functions defined in it use."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


class _Active:
    """One running call of a `DispatchSwap`: its attention and how many calls it replaced."""

    def __init__(self, attend: Callable[..., Tensor], key_masks: bool) -> None:
        self.attend, self.key_masks, self.calls = attend, key_masks, 0


class DispatchSwap:
    """A copy of a processor's ``__call__`` whose ``dispatch_attention_fn`` is this swap's:
    the processor's own code runs unchanged, and its attention call runs as ``attend`` on the
    ``(B, S, H, D)`` q, k, v it passes (no ``TorchFunctionMode``: the other torch calls of the
    processor run as they are).

    The call is replaced directly when it is what the native backend would run as one unmasked
    ``F.scaled_dot_product_attention`` (no ``backend`` other than the native one, active or
    given; no ``parallel_config``, no ``attention_kwargs``, no mask); any other call runs
    diffusers' own ``dispatch_attention_fn`` under an `AttentionSwap`, as a processor without
    this swap would (the same checks, the same refusals). Use `DispatchSwap.fits` first.

    Args:
        inner: the model's processor (its class in `DIRECT_PROCESSORS`).
        where: the attention module's name, for errors.
    """

    def __init__(self, inner: Any, where: str) -> None:
        fn = type(inner).__call__
        self.inner, self.where = inner, where
        self.original: Callable[..., Tensor] = fn.__globals__["dispatch_attention_fn"]
        names = dict(fn.__globals__)  # the module's names, this swap's dispatch among them
        names["dispatch_attention_fn"] = self._dispatch
        call = types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__, fn.__closure__)
        call.__kwdefaults__ = fn.__kwdefaults__
        self.call = call
        self.local = threading.local()  # per thread: the running calls (a stack of _Active)

    def __reduce__(self) -> tuple[Any, ...]:
        """Copied (``copy.deepcopy`` of a parallelized model) by building it again over the
        copied processor: the re-bound function and the per-thread stack are not copied."""
        return (DispatchSwap, (self.inner, self.where))

    @staticmethod
    def fits(inner: Any) -> bool:
        """Whether ``inner``'s ``__call__`` reaches its attention only through diffusers'
        ``dispatch_attention_fn``: a class of `DIRECT_PROCESSORS`, a plain function whose code
        (and the functions defined in it) names ``dispatch_attention_fn`` and never
        ``scaled_dot_product_attention``."""
        fn = vars(type(inner)).get("__call__")  # its own class's (not inherited)
        if type(inner).__name__ not in DIRECT_PROCESSORS or not isinstance(fn, types.FunctionType):
            return False
        names = _code_names(fn.__code__)
        dispatch = fn.__globals__.get("dispatch_attention_fn")
        return (
            "dispatch_attention_fn" in names
            and "scaled_dot_product_attention" not in names
            and getattr(dispatch, "__module__", "").endswith("attention_dispatch")
        )

    def run(
        self, attend: Callable[..., Tensor], key_masks: bool, *args: Any, **kwargs: Any
    ) -> tuple[Any, int]:
        """The processor's ``__call__(*args, **kwargs)`` with its attention as ``attend``
        (``key_masks``: `AttentionSwap`'s); (its output, the number of attention calls
        replaced)."""
        stack = self.local.__dict__.setdefault("stack", [])
        active = _Active(attend, key_masks)
        stack.append(active)
        try:
            out = self.call(self.inner, *args, **kwargs)
        finally:
            stack.pop()
        return out, active.calls

    def _native(self, backend: Any) -> bool:
        """Whether ``backend`` (``None``: diffusers' active one) is the native backend."""
        if backend is None:
            registry = getattr(self.original, "__globals__", {}).get("_AttentionBackendRegistry")
            backend = getattr(registry, "_active_backend", None)
        return bool(getattr(backend, "value", backend) == "native")

    def _dispatch(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        attention_kwargs: dict[str, Any] | None = None,
        *,
        backend: Any = None,
        parallel_config: Any = None,
    ) -> Tensor:
        """diffusers' ``dispatch_attention_fn`` as the processor calls it (q, k, v
        ``(B, S, H, D)``, the output too)."""
        active: _Active = self.local.stack[-1]
        plain = attn_mask is None and parallel_config is None and not attention_kwargs
        if plain and self._native(backend):
            _refuse_odd(self.where, query, key, 1, False, dropout_p, is_causal, enable_gqa, scale)
            active.calls += 1
            return active.attend(query, key, value)
        swap = AttentionSwap(active.attend, self.where, key_masks=active.key_masks)
        with swap:
            out = self.original(
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale,
                enable_gqa,
                attention_kwargs,
                backend=backend,
                parallel_config=parallel_config,
            )
        active.calls += swap.calls
        return out
