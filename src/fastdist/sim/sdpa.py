"""``F.scaled_dot_product_attention`` batched over :func:`fastdist.simulate`'s ranks.

torch 2.13 has no vmap batching rule for the fused attention kernels
(``aten::_scaled_dot_product_flash_attention_for_cpu`` on CPU): under ``torch.vmap``
every call warns and runs the kernel once per rank in a Python loop. Models that call
``F.scaled_dot_product_attention`` in every layer (Hugging Face ``transformers`` with its
default ``attn_implementation="sdpa"``) then warn and run slowly under ``simulate``.

:class:`SdpaMode` is a ``TorchFunctionMode`` that ``simulate`` pushes only while the
per-rank function runs (created per call: no global registration, no module state).
It handles ``F.scaled_dot_product_attention`` and passes every other torch function
through unchanged. :func:`sdpa` then does what a batching rule would:

* eager, the innermost active transforms are vmaps (simulate's own, and any vmap over or
  inside it): each input is unwrapped at those levels (its physical tensor), the vmapped
  dims are folded into the batch dim, the kernel runs once on the folded tensors and the
  result is wrapped back. The backend is the one a rank calling SDPA on its own tensors
  gets (``torch._fused_sdp_choice``: folding changes only the batch dims, which are equal,
  and a mask's batch, 1 or the batch, which the CPU checks accept alike; on other devices
  one rank's slices are asked too), and the fused CPU kernel computes each batch entry on
  its own, so values are those of the per-rank loop, bit for bit; autograd records the
  kernel on the physical tensors, so ``backward()`` outside ``simulate`` gives the
  per-rank gradients too.
* under ``torch.compile`` (dynamo): the same fold at the innermost vmap level, through
  the functorch primitives dynamo traces (``_remove_batch_dim`` / ``_add_batch_dim``).
* where one rank would get the math backend (3-D inputs, a 3-D mask, a mask requiring
  grad, ...), where a ``torch.func`` grad/jvp transform is the innermost transform
  (``torch.func.grad`` inside ``simulate``: its tensors cannot be unwrapped) or sits above
  a vmap, and with ``dropout_p > 0``: torch's own math implementation
  (``aten::_scaled_dot_product_attention_math``, a bool mask converted first as the
  composite does), a composite of ops that vmap batches, with vmap's randomness semantics
  for the dropout (``randomness="error"`` raises vmap's error). It is what a rank gets
  whenever its backend is math, and equal to the fused kernel up to rounding otherwise.

The mode costs every torch call in the per-rank function (attribute reads such as
``x.shape`` included) one Python ``__torch_function__``: about 2.5 us under ``simulate``
(see docs/design.md); ``simulate(..., batch_sdpa=False)`` leaves it out.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch._functorch.predispatch import _add_batch_dim, _remove_batch_dim
from torch._functorch.pyfunctorch import coerce_cinterpreter
from torch.overrides import TorchFunctionMode

__all__ = ["SdpaMode", "sdpa", "TORCH_SDPA"]

#: torch's own function, captured at import: what a mode recognises in ``__torch_function__``
TORCH_SDPA: Any = torch.nn.functional.scaled_dot_product_attention
_MATH: Any = torch.ops.aten._scaled_dot_product_attention_math.default
_functorch: Any = torch._C._functorch
_VMAP = _functorch.TransformType.Vmap
_MATH_BACKEND = int(torch.nn.attention.SDPBackend.MATH.value)


class SdpaMode(TorchFunctionMode):
    """Batches ``F.scaled_dot_product_attention`` over vmapped ranks (see the module docstring);
    passes everything else through."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is TORCH_SDPA:
            return sdpa(*args, **(kwargs or {}))
        return self.call(func, args, kwargs or {})

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Every function but SDPA, called as it was: a subclass's hook for more functions."""
        if kwargs:
            return func(*args, **kwargs)
        return func(*args)


def sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` (same arguments), batched over the active vmaps without a
    per-rank loop."""
    opts = (dropout_p, is_causal, scale, enable_gqa)
    if torch.compiler.is_compiling():
        return _compiled(query, key, value, attn_mask, opts)
    stack = _functorch.get_interpreter_stack()
    if not stack:
        return _call(TORCH_SDPA, query, key, value, attn_mask, opts)
    levels = []  # the innermost run of vmap levels, innermost first
    below = len(stack)
    while below and stack[below - 1].key() == _VMAP:
        below -= 1
        levels.append(stack[below].level())
    if not levels or dropout_p > 0 or any(ci.key() == _VMAP for ci in stack[:below]):
        # a grad/jvp transform innermost, or a vmap under one (its tensors are out of reach), or
        # dropout
        return _math(query, key, value, attn_mask, opts)
    return _eager(levels, query, key, value, attn_mask, opts)


def _call(
    fn: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, opts: tuple[Any, ...]
) -> Tensor:
    dropout_p, is_causal, scale, enable_gqa = opts
    return fn(  # type: ignore[no-any-return]
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


def _math(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, opts: tuple[Any, ...]) -> Tensor:
    """torch's math backend (what the composite calls when it picks math): ops vmap and torch.func
    batch."""
    dropout_p, is_causal, scale, enable_gqa = opts
    # as the composite does first: True attends (0), False is -inf
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros((), dtype=q.dtype, device=mask.device).masked_fill(
            mask.logical_not(), float("-inf")
        )
    return _MATH(q, k, v, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]  # type: ignore[no-any-return]


def _choice(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, opts: tuple[Any, ...]) -> int:
    dropout_p, is_causal, scale, enable_gqa = opts
    if enable_gqa and k.dim() >= 3 and k.shape[-3] == 0:
        # torch's choice and math kernel divide the query heads by the key heads: a SIGFPE that
        # kills the process for none (a model slicing its heads by the whole model's count)
        raise RuntimeError(
            f"scaled_dot_product_attention(enable_gqa=True): the key has 0 heads for "
            f"{q.shape[-3]} query heads (shape {tuple(k.shape)})"
        )
    return int(
        torch._fused_sdp_choice(
            q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    )


def _foldable(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
    """Whether one rank's shapes fit a fused kernel (4-D, one batch size, a 2-D or broadcastable 4-D
    mask); else one rank gets math."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or not (q.shape[0] == k.shape[0] == v.shape[0]):
        return False
    return (
        mask is None
        or mask.dim() == 2
        or (
            mask.dim() == 4
            and mask.shape[0] in (1, q.shape[0])
            and mask.shape[1] in (1, q.shape[1])
        )
    )


def _eager(
    levels: list[int], q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, opts: tuple[Any, ...]
) -> Tensor:
    """Fold vmap ``levels`` (innermost first) into the batch dim: unwrap, one kernel call, wrap."""
    if not _foldable(q, k, v, mask):
        return _math(q, k, v, mask, opts)
    phys: list[Tensor | None] = []
    have: list[
        list[int]
    ] = []  # per input: the levels it is batched at, outermost first (its leading dims)
    sizes: dict[int, int] = {}
    for t in (q, k, v, mask):
        if t is None:
            phys.append(None)
            have.append([])
            continue
        mine: list[int] = []
        for level in levels:
            t, d = _functorch._unwrap_batched(t, level)
            if d is not None:
                t = t.movedim(d, 0) if d else t
                mine.insert(0, level)
                sizes[level] = t.shape[0]
        phys.append(t)
        have.append(mine)
    if not sizes:  # nothing batched at these levels (e.g. the inputs of an already folded call)
        return _call(TORCH_SDPA, q, k, v, mask, opts)
    pq, pk, pv, pmask = phys
    assert pq is not None and pk is not None and pv is not None
    cpu = q.device.type == "cpu"
    if cpu and not (pq.stride(-1) == 1 and pk.stride(-1) == 1 and pv.stride(-1) == 1):
        # the fused kernels want stride 1, which a copy made by folding could give
        return _math(q, k, v, mask, opts)
    order = [level for level in reversed(levels) if level in sizes]  # outermost first
    lead = [sizes[level] for level in order]
    n = math.prod(lead)
    fq, fk, fv = (_fold(p, h, order, lead) for p, h in zip((pq, pk, pv), have))
    fmask = None if pmask is None else _fold_mask(pmask, have[3], order, lead, n, q.shape[0])
    # The kernel one rank gets with its own tensors. Folding changes only the batch dims (all
    # equal) and the mask's batch (1 or the batch), which the CPU checks accept alike; on
    # other devices the choice on one rank's slices must agree too.
    choice = _choice(fq, fk, fv, fmask, opts)
    if choice != _MATH_BACKEND and not cpu:
        sq, sk, sv, smask = (
            None if p is None else p[(0,) * len(h)] if h else p for p, h in zip(phys, have)
        )
        assert sq is not None and sk is not None and sv is not None
        choice = choice if _choice(sq, sk, sv, smask, opts) == choice else _MATH_BACKEND
    if choice == _MATH_BACKEND:
        return _math(q, k, v, mask, opts)  # what that rank computes, through ops vmap batches
    out = _call(TORCH_SDPA, fq, fk, fv, fmask, opts)
    out = out.view(*lead, q.shape[0], *out.shape[1:])
    for level in order:  # outermost first: each wrap hides the leading dim
        out = _functorch._add_batch_dim(out, 0, level)
    return out


def _full(p: Tensor, have: list[int], order: list[int], lead: list[int]) -> Tensor:
    """``p`` with leading dims for ``have`` (outermost first) -> leading dims for all of ``order``
    (expanded, a view)."""
    if have == order:
        return p
    s = p.shape[len(have) :]
    shape = [p.shape[have.index(level)] if level in have else 1 for level in order]
    return p.reshape(*shape, *s).expand(*lead, *s)


def _fold(p: Tensor, have: list[int], order: list[int], lead: list[int]) -> Tensor:
    """q/k/v ``[*lead, B, ...]`` -> ``[prod(lead) * B, ...]`` (a view when the dims merge, else one
    copy)."""
    return _full(p, have, order, lead).flatten(0, len(lead))


def _fold_mask(
    p: Tensor, have: list[int], order: list[int], lead: list[int], n: int, b: int
) -> Tensor:
    """A mask of one rank's shape ``(L, S)`` or ``(1 | B, 1 | H, L, S)`` for the folded batch of
    ``n * B``.

    Not batched over the ranks and broadcasting over the batch: unchanged (no copy).
    """
    s = p.shape[len(have) :]
    if not have and (len(s) == 2 or s[0] == 1):
        return p
    p = _full(p, have, order, lead)
    if len(s) == 2:
        p = p.reshape(*lead, 1, 1, *s)
        s = p.shape[len(lead) :]
    p = p.expand(*lead, b, *s[1:])
    return p.reshape(n * b, *s[1:])


def _compiled(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, opts: tuple[Any, ...]
) -> Tensor:
    """Under dynamo: fold the innermost vmap level with the functorch primitives dynamo traces."""
    top = _functorch.peek_interpreter_stack()
    if top is None:
        return _call(TORCH_SDPA, q, k, v, mask, opts)
    ci: Any = coerce_cinterpreter(top)
    if ci.key() != _VMAP or opts[0] > 0:
        return _math(q, k, v, mask, opts)
    batched = [t is not None and _functorch.is_batchedtensor(t) for t in (q, k, v, mask)]
    if not any(batched):
        return _call(TORCH_SDPA, q, k, v, mask, opts)
    if not _foldable(q, k, v, mask):
        return _math(q, k, v, mask, opts)  # the math backend is what one rank gets here
    level, n = ci.level(), ci.batch_size()
    phys = [_remove_batch_dim(t, level, n, 0) for t in (q, k, v)]
    pmask = None
    if mask is not None:
        pmask = _remove_batch_dim(mask, level, n, 0) if batched[3] else mask
        if pmask.requires_grad:
            # the fused kernel takes no gradient for a mask: one rank gets math
            return _math(q, k, v, mask, opts)
    if any(_functorch.is_batchedtensor(t) for t in (*phys, pmask) if t is not None):
        return _math(q, k, v, mask, opts)  # another vmap outside this one
    fq, fk, fv = (_fold(p, [level], [level], [n]) for p in phys)
    fmask = (
        None
        if pmask is None
        else _fold_mask(pmask, [level] if batched[3] else [], [level], [n], n, q.shape[0])
    )
    out = _call(TORCH_SDPA, fq, fk, fv, fmask, opts)
    return _add_batch_dim(out.view(n, q.shape[0], *out.shape[1:]), 0, level)
