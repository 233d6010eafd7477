"""Causal attention over key blocks with an online softmax, the zig-zag ring that computes only
the (query, key) half-blocks the causal mask leaves visible, and the merge of partial results
(for a decoding step against a KV cache split over the ranks).

The pieces `fastdist.nn.styles.context_llm` runs every context-parallel attention with:

* `Partial`: the running state of an online softmax for some queries (the row max ``top``, the
  sum of the exponentials ``total``, the weighted values ``acc``); `partial` starts one, `update`
  folds one more key block into it (masked by token index: causal, sliding window, padding),
  `finish` divides; `attend` does the three over an iterator of key blocks.
* `zigzag_ring`: the load-balanced causal ring. In the zig-zag layout rank ``r`` of ``n`` holds
  query chunks ``r`` (early) and ``2n - 1 - r`` (late) of ``2n`` chunks of ``c`` tokens, and so
  does every key/value block that passes by. Of the four ``c x c`` products of a block, the
  causal mask leaves visible:

  ============================  ===============================  ===========
  block from rank ``j``         visible products                 computed
  ============================  ===============================  ===========
  ``j == r`` (its own, step 0)  early x early (causal), late x   ``3 c^2``
                                early, late x late (causal)
  ``j < r``                     early x ``j``, late x ``j``      ``2 c^2``
  ``j > r``                     late x ``j``, late x ``2n-1-j``  ``2 c^2``
  ============================  ===============================  ===========

  so a rank computes ``(2n + 1) c^2`` products instead of ``4 n c^2`` (ring-flash-attention's
  and torchtitan's zig-zag). Which case a block is comes from its token indices (``j < r``
  exactly when its first key precedes the first query), chosen with ``torch.where``, so the
  code has one shape on every rank and runs in a simulation's ``vmap`` as on real ranks.
* `merge`: the exact softmax over the union of key sets from `Partial` results computed over
  disjoint key sets (the log-sum-exp merge: each rescaled to the common max).

`count_work` records the ``(queries, keys)`` shape of every product inside its block (a test
can check the skipped half-blocks stay skipped).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import NamedTuple, cast

import torch
from torch import Tensor

from fastdist.core.mesh import Mesh
from fastdist.ops import ring_shift

__all__ = [
    "Block",
    "Partial",
    "attend",
    "count_work",
    "finish",
    "merge",
    "partial",
    "ring_blocks",
    "update",
    "zigzag_ring",
]

#: a key/value block: k ``(B, Hkv, Sk, D)``, v ``(B, Hkv, Sk, Dv)``, the keys' token indices
#: ``(1 or B, Sk)`` and padding flags ``(B, Sk)`` (True: a real token) or None
Block = tuple[Tensor, Tensor, Tensor, Tensor | None]

#: the lists the open `count_work` blocks of this context record the products of `update` in
#: (a context variable: each block sets and resets its own context's value, nothing global grows)
_WORK: contextvars.ContextVar[tuple[list[tuple[int, int]], ...]] = contextvars.ContextVar(
    "fastdist_causal_ring_work", default=()
)


class Partial(NamedTuple):
    """The online-softmax state of ``Sq`` queries over the keys folded in so far (grouped by kv
    head: ``G = Hq / Hkv``): ``top`` ``(B, Hkv, G, Sq, 1)`` the running max (``-inf``: no key
    seen yet), ``total`` ``(B, Hkv, G, Sq, 1)`` the sum of ``exp(score - top)``, ``acc``
    ``(B, Hkv, G, Sq, Dv)`` the values weighted by the same."""

    top: Tensor
    total: Tensor
    acc: Tensor


@contextlib.contextmanager
def count_work() -> Iterator[list[tuple[int, int]]]:
    """Within the block, the ``(queries, keys)`` of every score product `update` computes (per
    rank: inside a simulation the shapes are each rank's).

    >>> import torch
    >>> q = torch.randn(1, 2, 4, 8); k = v = torch.randn(1, 2, 4, 8)
    >>> i = torch.arange(4).unsqueeze(0)
    >>> with count_work() as work:
    ...     _ = attend(q, iter([(k, v, i, None)]), i, 0.35, None, None)
    >>> work
    [(4, 4)]
    """
    seen: list[tuple[int, int]] = []
    token = _WORK.set((*_WORK.get(), seen))
    try:
        yield seen
    finally:
        _WORK.reset(token)


def keep_mask(qi: Tensor, ki: Tensor, kvalid: Tensor | None, window: int | None) -> Tensor:
    """(Bm, 1, 1, Sq, Sk) True where query (token index ``qi`` (Bm, Sq)) may see key ``ki``:
    causal, within the sliding ``window``, a real (not padding) key."""
    keep = ki.unsqueeze(-2) <= qi.unsqueeze(-1)  # (Bm, Sq, Sk)
    if window is not None:
        keep = keep & (qi.unsqueeze(-1) - ki.unsqueeze(-2) < window)
    if kvalid is not None:
        keep = keep & kvalid.unsqueeze(-2)
    return keep[:, None, None]


def partial(q: Tensor, hkv: int, dv: int) -> Partial:
    """The state of queries ``q`` ``(B, Hq, Sq, D)`` before any key: max ``-inf``, sums 0."""
    B, hq, sq, _ = q.shape
    shape = (B, hkv, hq // hkv, sq, 1)
    top = q.new_full(shape, float("-inf"))
    return Partial(top, q.new_zeros(shape), q.new_zeros(*shape[:-1], dv))


def update(
    state: Partial,
    q: Tensor,
    block: Block,
    qi: Tensor,
    scaling: float,
    window: int | None,
    softcap: float | None,
) -> Partial:
    """``state`` (of queries ``q`` ``(B, Hq, Sq, D)`` at token indices ``qi`` ``(1 or B, Sq)``)
    with one more key block folded in."""
    k, v, ki, kvalid = block
    B, hq, sq, _ = q.shape
    for seen in _WORK.get():
        seen.append((sq, k.shape[2]))
    qg = q.reshape(B, k.shape[1], hq // k.shape[1], sq, -1)  # (B, Hkv, G, Sq, D)
    s = (qg @ k.unsqueeze(2).transpose(-1, -2)) * scaling  # (B, Hkv, G, Sq, Sk)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    keep = keep_mask(qi, ki, kvalid, window)
    # the running max only shifts the exponents: from detached scores, as flash attention
    block_top = torch.where(keep, s.detach(), float("-inf")).amax(-1, keepdim=True)
    top = torch.maximum(state.top, block_top)
    shift = torch.where(top.isfinite(), top, 0.0)  # rows that saw no key yet
    p = torch.exp(torch.where(keep, s - shift, float("-inf")))  # (B, Hkv, G, Sq, Sk)
    # the old sums rescaled to the new max (0 where the old max is -inf: nothing seen)
    scale = _rescale(state.top, shift)
    total = state.total * scale + p.sum(-1, keepdim=True)
    acc = state.acc * scale + p @ v.unsqueeze(2)  # (B, Hkv, G, Sq, Dv)
    return Partial(top, total, acc)


def _rescale(top: Tensor, shift: Tensor) -> Tensor:
    """``exp(top - shift)``, 0 where ``top`` is ``-inf`` (nothing seen): the exponent is taken of
    a finite value only, so no backward meets an infinite one."""
    seen = top.isfinite()
    return torch.where(seen, torch.exp(torch.where(seen, top - shift, 0.0)), 0.0)


def finish(state: Partial) -> Tensor:
    """The attention output ``(B, Sq, Hq, Dv)`` (0 for a query that saw no key: a padding query).

    The division's denominator is 1 where no key was seen, not a clamp: a tiny clamp underflows to
    0 in float32 / bfloat16, and although ``torch.where`` hides the forward's ``0 / 0``, its
    backward multiplies the masked-out zero gradient by ``1 / 0`` (NaN, spread to every gradient).

    >>> import torch
    >>> seen = Partial(torch.zeros(1, 1, 1, 2, 1), torch.tensor([2.0, 0.0]).reshape(1, 1, 1, 2, 1),
    ...                torch.ones(1, 1, 1, 2, 3))
    >>> finish(seen)[0, :, 0].tolist()  # query 1 saw no key
    [[0.5, 0.5, 0.5], [0.0, 0.0, 0.0]]
    """
    seen = state.total > 0
    out = torch.where(seen, state.acc / torch.where(seen, state.total, 1.0), 0.0)
    return out.flatten(1, 2).transpose(1, 2)  # (B, Hkv, G, Sq, Dv) -> (B, Sq, Hq, Dv)


def merge(parts: list[Partial]) -> Partial:
    """One `Partial` from several over disjoint key sets of the same queries: each rescaled to
    the common max (the log-sum-exp merge; exact: the softmax over the union of the keys).

    A query no part saw a key for keeps max ``-inf`` and sums 0 (`finish` gives it 0); every
    exponent is of a finite difference (a part's ``-inf`` max is scaled by 0, not ``exp``'d).
    """
    if not parts:
        raise ValueError("causal_ring.merge: no partial results to merge (an empty list)")
    top = parts[0].top
    for p in parts[1:]:
        top = torch.maximum(top, p.top)
    shift = torch.where(top.isfinite(), top, 0.0)
    total = acc = None
    for p in parts:
        scale = _rescale(p.top, shift)
        total = p.total * scale if total is None else total + p.total * scale
        acc = p.acc * scale if acc is None else acc + p.acc * scale
    return Partial(top, cast(Tensor, total), cast(Tensor, acc))


def attend(
    q: Tensor,
    blocks: Iterator[Block],
    qi: Tensor,
    scaling: float,
    window: int | None,
    softcap: float | None,
) -> Tensor:
    """Softmax attention of q ``(B, Hq, Sq, D)`` over key blocks (every product computed,
    masked) merged with an online softmax -> ``(B, Sq, Hq, Dv)``."""
    state: Partial | None = None
    for block in blocks:
        if state is None:
            state = partial(q, block[0].shape[1], block[1].shape[-1])
        state = update(state, q, block, qi, scaling, window, softcap)
    if state is None:
        raise ValueError("causal_ring.attend: no key blocks (an empty iterator)")
    return finish(state)


def ring_blocks(mesh: Mesh, axis: str, block: Block) -> Iterator[Block]:
    """This rank's k/v block, then every other rank's, passed around the ring over ``axis``
    (the next transfer issued before the current block is used)."""
    n = mesh.axis_size(axis)

    def shift(t: Tensor | None) -> Tensor | None:
        return None if t is None else ring_shift(t, mesh, axis)

    for step in range(n):
        nxt = tuple(shift(t) for t in block) if step < n - 1 else None
        yield block
        if nxt is not None:
            block = nxt  # type: ignore[assignment]


def _half(block: Block, which: int, c: int) -> Block:
    """The first (``which=0``) or second chunk of ``c`` keys of a block."""
    k, v, ki, kvalid = block
    cut = slice(0, c) if which == 0 else slice(c, 2 * c)
    return k[:, :, cut], v[:, :, cut], ki[:, cut], None if kvalid is None else kvalid[:, cut]


def _pick(cond: Tensor, a: Block, b: Block) -> Block:
    """``a`` where ``cond`` (a 0-d bool, per rank), else ``b``, element by element."""
    va = None if a[3] is None or b[3] is None else torch.where(cond, a[3], b[3])
    return (
        torch.where(cond, a[0], b[0]),
        torch.where(cond, a[1], b[1]),
        torch.where(cond, a[2], b[2]),
        va,
    )


def _pick_state(cond: Tensor, a: Partial, b: Partial) -> Partial:
    """``a`` where ``cond`` (a 0-d bool, per rank: the same on every element), else ``b``, each
    of the three tensors (``top``, ``total``, ``acc``) chosen with ``torch.where``: the zig-zag
    ring's one code path for the two cases of a block (``j < r`` or ``j > r``), which a
    simulation's ``vmap`` can run (no Python branch on a rank-varying value)."""
    return Partial(*(torch.where(cond, x, y) for x, y in zip(a, b, strict=True)))


def zigzag_ring(
    q: Tensor,
    mine: Block,
    qi: Tensor,
    mesh: Mesh,
    axis: str,
    scaling: float,
    window: int | None,
    softcap: float | None,
) -> Tensor:
    """Causal attention of this rank's zig-zag queries ``q`` ``(B, Hq, 2c, D)`` (token indices
    ``qi`` ``(1, 2c)``: chunk ``r`` then ``2n - 1 - r``) over every rank's keys, the blocks
    passed around ``axis``, computing only the half-blocks the causal mask leaves visible (see
    this module's docstring) -> ``(B, 2c, Hq, Dv)``."""
    c = q.shape[2] // 2
    hkv, dv = mine[0].shape[1], mine[1].shape[-1]
    qe, ql = q[:, :, :c], q[:, :, c:]  # (B, Hq, c, D) early and late queries
    qie, qil = qi[:, :c], qi[:, c:]
    early, late = partial(qe, hkv, dv), partial(ql, hkv, dv)
    for step, block in enumerate(ring_blocks(mesh, axis, mine)):
        first, second = _half(block, 0, c), _half(block, 1, c)
        if step == 0:  # its own block: early x early, late x every key (both causal)
            early = update(early, qe, first, qie, scaling, window, softcap)
            late = update(late, ql, block, qil, scaling, window, softcap)
            continue
        before = block[2][0, 0] < qi[0, 0]  # the block's rank j < r (0-d, per rank)
        # j < r: early x first; j > r: late x first
        target = _pick_state(before, early, late)
        qa, qia = torch.where(before, qe, ql), torch.where(before, qie, qil)
        done = update(target, qa, first, qia, scaling, window, softcap)
        early, late = _pick_state(before, done, early), _pick_state(before, late, done)
        # j < r: late x first; j > r: late x second
        late = update(late, ql, _pick(before, first, second), qil, scaling, window, softcap)
    return torch.cat([finish(early), finish(late)], dim=1)  # (B, 2c, Hq, Dv)
