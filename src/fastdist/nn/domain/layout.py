"""Where a tensor holds the split dims of a domain-parallel region (`Layout`), and how a
reshape or a basic index moves them: the bookkeeping of the functional guard
(`fastdist.nn.domain.guard`), pure functions of shapes and indices."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from fastdist.nn.domain.windows import Split


@dataclass(frozen=True)
class Layout:
    """Where a tensor holds each split dim (in the order of the style's ``split``): ``at`` its
    dim (``None``: not held), ``folded`` the ``(stride, rows)`` of one merged into the leading
    (batch) dim 0, else ``None``."""

    at: tuple[int | None, ...]
    folded: tuple[tuple[int, int] | None, ...]

    def dims(self) -> set[int]:
        """The dims of the tensor that hold split rows (dim 0 when one is folded into it)."""
        return {p for p in self.at if p is not None} | ({0} if any(self.folded) else set())


def canonical(x: Tensor, split: Split) -> Layout:
    """The layout of a tensor the guard has not followed: the field's, counted from the end."""
    n = x.dim()
    return Layout(tuple(n + d if n >= 2 - d else None for d, _ in split), (None,) * len(split))


def _groups(ins: Sequence[int], outs: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """A reshape from ``ins`` to ``outs`` as groups of input dims and the output dims they become
    (size-1 dims alone); ``None`` when the shapes do not factor (empty tensors)."""
    i = j = 0
    groups: list[tuple[list[int], list[int]]] = []
    while i < len(ins) or j < len(outs):
        one_in, one_out = i < len(ins) and ins[i] == 1, j < len(outs) and outs[j] == 1
        if one_in and not one_out:
            groups.append(([i], []))
            i += 1
            continue
        if one_out and not one_in:
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(ins) or j >= len(outs):
            return None
        gi, go, pi, po = [i], [j], ins[i], outs[j]
        i, j = i + 1, j + 1
        while pi != po:
            if pi < po and i < len(ins):
                gi.append(i)
                pi, i = pi * ins[i], i + 1
            elif po < pi and j < len(outs):
                go.append(j)
                po, j = po * outs[j], j + 1
            else:
                return None
        groups.append((gi, go))
    return groups


def _restore(ins: Sequence[int], outs: Sequence[int], go: list[int], stride: int, rows: int) -> Any:
    """Where a split dim of ``rows`` rows at ``stride`` (the product of the dims inside it) in a
    merged group lands among the group's output dims ``go``: the output dim of ``rows`` rows with
    that product inside it, else ``None``."""
    for k, j in enumerate(go):
        if outs[j] == rows and math.prod(outs[m] for m in go[k + 1 :]) == stride:
            return j
    return None


def reshaped(lay: Layout, ins: Sequence[int], outs: Sequence[int]) -> Layout | str:
    """The layout after a reshape from ``ins`` to ``outs``, or why the guard cannot follow it."""
    groups = _groups(ins, outs)
    if groups is None:
        return "the shapes do not factor"
    at: list[int | None] = []
    folded: list[tuple[int, int] | None] = []
    for p, f in zip(lay.at, lay.folded, strict=True):
        if p is None and f is None:
            at.append(None)
            folded.append(None)
            continue
        src = 0 if f is not None or p is None else p
        gi, go = next((gi, go) for gi, go in groups if src in gi)
        if f is not None:  # folded in dim 0: the group is [0, ...], 0 outermost
            stride, rows = f[0] * math.prod(ins[q] for q in gi[1:]), f[1]
        elif len(gi) == 1:
            if len(go) != 1:
                return "it cuts a split dim into several dims (or drops it)"
            stride, rows = 1, ins[src]
            go = go[:1]
        elif gi[0] == 0:  # merged into the leading (batch) dim: folded
            stride, rows = math.prod(ins[q] for q in gi if q > src), ins[src]
        else:
            return "it merges a split dim with another dim"
        j = _restore(ins, outs, go, stride, rows) if len(go) > 1 or stride == 1 else None
        if j is not None and j != 0:
            at.append(j)
            folded.append(None)
        elif go and go[0] == 0 and (j == 0 or len(go) == 1):
            at.append(None)
            inner = 1 if j == 0 else stride
            folded.append((inner, rows))
        else:
            return "it spreads a split dim merged into the batch over several dims"
    return Layout(tuple(at), tuple(folded))


def tensors(v: Any) -> list[Tensor]:
    """The tensors of ``v`` (one, or a tuple / list of them)."""
    if isinstance(v, Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for t in v if isinstance(t, Tensor)]
    return []


def index_layout(lay: Layout, x: Tensor, index: Any) -> Layout | str:
    """The layout after basic indexing ``x[index]`` (ints, slices, ``None``, ``...``), or why
    the guard cannot follow it (a split dim cut or indexed, advanced indexing)."""
    items = list(index) if isinstance(index, tuple) else [index]
    basic = (i is None or i is Ellipsis or type(i) in (int, slice) for i in items)
    if not all(basic):
        return "advanced indexing (a tensor, list or bool index)"
    taken = sum(1 for i in items if i is not None and i is not Ellipsis)
    if items.count(Ellipsis) > 1 or taken > x.dim():
        return "an index the guard does not read"
    held = lay.dims()
    src = dst = 0
    where: dict[int, int] = {}
    for item in items:
        if item is Ellipsis:
            for _ in range(x.dim() - taken):
                where[src] = dst
                src, dst = src + 1, dst + 1
        elif item is None:
            dst += 1
        elif isinstance(item, int) and not isinstance(item, bool):
            if src in held:
                return f"an integer index of dim {src}, which holds split rows"
            src += 1
        else:
            if src in held and item.indices(x.shape[src]) != (0, x.shape[src], 1):
                return f"a slice {item} of dim {src}, which holds split rows (each rank's block)"
            where[src] = dst
            src, dst = src + 1, dst + 1
    for _ in range(src, x.dim()):
        where[src] = dst
        src, dst = src + 1, dst + 1
    if any(f is not None for f in lay.folded) and where.get(0) != 0:
        return "it moves the batch dim that holds split rows"
    return Layout(tuple(None if p is None else where[p] for p in lay.at), lay.folded)


def spans(t: Tensor, lay: Layout) -> bool:
    """Whether ``t`` has more than one row along a dim that holds split rows (not a broadcast
    one)."""
    return any(t.shape[p] > 1 for p in lay.dims())


def empty(n: int) -> Layout:
    """The layout of a tensor that holds none of the ``n`` split dims (a region input other than
    the field, or a tensor computed from such inputs only)."""
    return Layout((None,) * n, (None,) * n)


def stacked(lay: Layout, dim: int, n: int) -> Layout | str:
    """The layout after stacking tensors of ``n`` dims (each of layout ``lay``) along a new
    ``dim``, or why the guard cannot follow it."""
    d = dim % (n + 1)
    if any(lay.folded) and d == 0:
        return "it stacks in front of the batch dim that holds a split dim merged into it"
    return Layout(tuple(None if p is None else p + (p >= d) for p in lay.at), lay.folded)


def leading(lay: Layout, ins: Sequence[int], outs: Sequence[int]) -> Layout | str:
    """The layout after broadcasting ``ins`` to ``outs`` (``expand``: new leading dims), or why
    the guard cannot follow it (a dim that holds split rows grown from one row)."""
    k = len(outs) - len(ins)
    if k < 0:
        return "it drops dims"
    if k and any(lay.folded):
        return "it puts new dims in front of the batch dim that holds a split dim merged into it"
    if any(ins[p] != outs[p + k] for p in lay.dims()):
        return "it broadcasts a dim that holds split rows"
    return Layout(tuple(None if p is None else p + k for p in lay.at), lay.folded)


def _einsum_terms(eq: str, ranks: Sequence[int]) -> tuple[list[str], str] | str:
    """The subscripts of each operand and of the output, an ellipsis written out (as letters
    that cannot be the equation's), or why the guard does not read the equation."""
    eq = eq.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        return "an equation that does not name each operand"
    extra = [r - (len(t) - 3 if "..." in t else len(t)) for t, r in zip(terms, ranks, strict=True)]
    if any(e < 0 or (e and "..." not in t) for e, t in zip(extra, terms, strict=True)):
        return "an equation the guard does not read"
    width = max(extra, default=0)
    ell = "".join(chr(0x100 + i) for i in range(width))  # right-aligned, as broadcasting
    terms = [t.replace("...", ell[width - e :]) for t, e in zip(terms, extra, strict=True)]
    if not arrow:  # implicit output: the ellipsis, then each subscript used once, sorted
        once = sorted(c for c in set("".join(terms)) if "".join(terms).count(c) == 1)
        out = ell + "".join(c for c in once if c not in ell)
    return terms, out.replace("...", ell)


def einsum_layout(
    eq: str, shapes: Sequence[Sequence[int]], lays: Sequence[Layout]
) -> Layout | str | None:
    """The layout of ``torch.einsum(eq, *operands)`` (``shapes`` and ``lays`` their shapes and
    layouts), ``None`` when no operand holds a split dim, or why the guard cannot follow it: a
    split dim summed over (not in the output), two operands holding a split dim under different
    subscripts, a split dim's subscript on a dim of an operand that holds it not (the whole
    dim against a block), a split dim on a diagonal or folded into the batch."""
    got = _einsum_terms(eq, [len(s) for s in shapes])
    if isinstance(got, str):
        return got
    terms, out = got
    if not any(lay.dims() for lay in lays):
        return None
    n = len(lays[0].at)
    letters: list[str | None] = [None] * n
    for term, lay in zip(terms, lays, strict=True):
        if any(lay.folded):
            return "an operand holds a split dim merged into the batch"
        for s, p in enumerate(lay.at):
            if p is None:
                continue
            if letters[s] not in (None, term[p]) or term.count(term[p]) > 1:
                return f"the split dim is subscript {term[p]!r} here, elsewhere another or twice"
            letters[s] = term[p]
    for s, c in enumerate(letters):
        if c is None:
            continue
        if c not in out:
            return f"it sums over subscript {c!r}, which holds split rows"
        for term, lay, shape in zip(terms, lays, shapes, strict=True):
            at = [i for i, t in enumerate(term) if t == c]
            if at and lay.at[s] != at[0] and shape[at[0]] != 1:
                return f"subscript {c!r} holds split rows in one operand and not in another"
    return Layout(tuple(None if c is None else out.index(c) for c in letters), (None,) * n)
