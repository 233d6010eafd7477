"""The functional guard of a domain-parallel region: while the region runs, the torch calls of
the model's own code (between the style's layers) that would act on this rank's block as if it
were the whole domain raise a `ParallelizeError` at the first call, naming the op, the dim and
the fix; ``F.interpolate`` runs domain-parallel, and the ``F.scaled_dot_product_attention`` of a
known attention module gets the whole domain's keys.

Where the split dims are. A tensor the guard has not followed holds the split dims where the
field holds them, counted from the end (``-2``: H of ``[N, C, H, W]``), when it has enough dims
(at least ``2 + |d|``): the style's layers take and give such tensors. The region's inputs other
than the field (whole on every rank) hold none, nor does what is computed from them only
(`Guard.mark_clean`). Outside a known attention module the guard follows the split dims through
the model's own ``permute`` / ``transpose`` / ``movedim``, reshapes (``view``, ``reshape``,
``flatten``, ``unflatten``, ``squeeze``, ``unsqueeze``), basic indexing, reductions over other
dims, ``einsum``, ``stack``, ``unbind``, ``Tensor.unfold``, ``expand`` and elementwise
broadcasting, and every op whose output keeps the input's number of dims, and records where they
lie on each tensor whose layout differs. A split dim merged into the leading (batch) dim (Wan's
``[N * T, C, H, W]`` per-frame upsampling) is followed as *folded*: per-batch ops run, the
reshape that takes it out again restores it. The ops that reduce, mix, contract or index along
a dim are rows of `fastdist.nn.domain.optables`. Refused where the guard cannot follow exactly:
a reshape that merges a split dim with another dim (other than into the batch) or cuts one into
several, advanced indexing of a tensor that holds split dims, an op it does not read that
changes the number of dims of such a tensor, a direct ``torch.ops.aten`` call on one (unless
elementwise), a layer of the style (or the region's output) given a tensor whose split dims are
moved, and ops of different dims on a moved tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._ops import OpOverload, OpOverloadPacket
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.domain.attention import current_attention, gathered_sdpa
from fastdist.nn.domain.layers import check_converted, inside_layer, layer_depth
from fastdist.nn.domain.layout import (
    Layout,
    canonical,
    einsum_layout,
    empty,
    index_layout,
    leading,
    reshaped,
    spans,
    stacked,
    tensors,
)
from fastdist.nn.domain.opdims import flat_ints, is_pointwise, op_name
from fastdist.nn.domain.optables import (
    ALIKE,
    ALWAYS,
    CAT,
    CHANNEL_DROPOUT,
    CONTRACT,
    CONTRACT_AFTER_BIAS,
    EVERY_INPUT,
    FIRST_ONLY,
    JOINS,
    LEADING,
    META,
    MIXING,
    MOVE_IN_PLACE,
    PAD,
    PERMUTE,
    REDUCTIONS,
    REFUSED,
    REPEAT,
    RESHAPE,
    RESIZE,
    SIZED,
    STACK,
    STACK_ALONG,
    UNBIND,
    UNSHUFFLE,
    WHOLE_DOMAIN,
)
from fastdist.nn.domain.windows import (
    Split,
    domain_upsample,
    ragged_sizes,
    region,
    rows_seen,
    upsample_factors,
)

__all__ = ["Guard", "Layout"]


class Guard(TorchFunctionMode):
    """While a domain-parallel region runs: functional calls of the model's own code (between
    the style's layers) that would act on this rank's block as if it were the whole domain
    raise; ``F.interpolate`` runs domain-parallel; where the split dims lie on each tensor the
    model moved them on is recorded (`Layout`, the module docstring)."""

    def __init__(self, mesh: Mesh, split: Split, where: str) -> None:
        super().__init__()
        self.mesh, self.split, self.where = mesh, split, where
        self.active = False  # entered by the pre-hook, left by the forward hook
        self.records: Any = WeakIdKeyDictionary()  # Tensor -> Layout (only non-canonical ones)
        self.block_rows: dict[int, int] = {}  # this call's rows of the field along each split dim

    # ------------------------------------------------------------------ layouts
    def layout(self, x: Tensor) -> Layout:
        """Where ``x`` holds the split dims."""
        rec: Layout | None = self.records.get(x)
        return canonical(x, self.split) if rec is None else rec

    def _store(self, y: Tensor, lay: Layout) -> None:
        if lay == canonical(y, self.split):
            if y in self.records:
                del self.records[y]
        else:
            self.records[y] = lay

    def _refuse(self, what: str, x: Tensor, why: str, fix: str) -> ParallelizeError:
        return ParallelizeError(
            f"DomainParallel on {self.where!r}: the model calls {what} itself on a tensor of "
            f"shape {tuple(x.shape)} (split dims at {self._where_split(x)}): {why}. Fix: {fix}"
        )

    def _where_split(self, x: Tensor) -> str:
        lay = self.layout(x)
        parts = [
            f"{d} -> dim {p}" if f is None else f"{d} -> folded into dim 0"
            for (d, _), p, f in zip(self.split, lay.at, lay.folded, strict=True)
            if p is not None or f is not None
        ]
        return "{" + ", ".join(parts) + "}"

    # ------------------------------------------------------------------ the mode
    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if layer_depth() != 0:
            return func(*args, **kwargs)
        ins = [t for v in (*args, *kwargs.values()) for t in tensors(v)]  # and in a list
        if ins and all(self.clean(t) for t in ins):  # nothing of the field: as on one device
            return self._clean_op(func, ins, args, kwargs)
        if func is F.interpolate:
            check_converted(self.where, "F.interpolate")
            return self._interpolate(*args, **kwargs)
        call = current_attention()
        if func is F.scaled_dot_product_attention and call is not None:
            check_converted(self.where, "F.scaled_dot_product_attention")
            return gathered_sdpa(call, *args, **kwargs)
        x = args[0] if args and isinstance(args[0], Tensor) else kwargs.get("input")
        if x is None and args and isinstance(args[0], (tuple, list)):  # cat, stack, ...
            seq = tensors(args[0])
            x = next((t for t in seq if t in self.records), seq[0] if seq else None)
        if func in REFUSED:
            raise ParallelizeError(
                f"DomainParallel on {self.where!r}: the model calls {op_name(func)} itself, not "
                f"through a module the style runs: {REFUSED[func]}. Fix: use the torch.nn "
                "module (Conv2d, GroupNorm, ...) or end the region before it"
            )
        if call is None:
            done = self._joined(func, ins, args, kwargs)
            if done is not None:
                return done[0]
        if not isinstance(x, Tensor) or func in META:
            return func(*args, **kwargs)
        rest = args[1:] if args and args[0] is x else args
        self._check_op(func, x, rest, kwargs, ins, call is not None)
        if call is not None:
            return func(*args, **kwargs)
        self._before(func, x, rest, kwargs)
        out = func(*args, **kwargs)
        self._follow(func, x, rest, kwargs, out)
        return out

    def clean(self, t: Tensor) -> bool:
        """Whether ``t`` holds no split rows for sure: a region input other than the field
        (`mark_clean`), or computed from such inputs only."""
        rec: Layout | None = self.records.get(t)
        return rec is not None and not rec.dims()

    def mark_clean(self, values: Any, block: Tensor) -> None:
        """The region's inputs other than the field (a timestep or text embedding): whole on
        every rank, they hold no split rows, whatever their number of dims. ``block``: this
        rank's block of the field (its rows along each split dim, `_check_sized`)."""
        self.block_rows = {d: block.shape[d] for d, _ in self.split}
        for t in tensors(list(values)):
            self.records[t] = empty(len(self.split))

    def _block_sized(self, func: Any, ins: list[Tensor], out: Any) -> int | None:
        """The split dim along which an op that sizes its output (``F.interpolate(size=)``,
        ``expand``, an adaptive pooling: `SIZED`), given tensors that hold no split rows, gave
        an output this rank's block rows where its inputs have not (a size taken from
        ``h.shape``), or ``None``."""
        if func not in SIZED:
            return None
        for y in tensors(out):
            for d, a in self.split:
                rows, p = self.block_rows.get(d), y.dim() + d
                if (
                    rows is not None and p >= 0 and y.shape[p] == rows
                    and self.mesh.axis_size(a) > 1
                    and not any(t.dim() == y.dim() and t.shape[p] == rows for t in ins)
                ):  # fmt: skip
                    return d
        return None

    def _clean_op(self, func: Any, ins: list[Tensor], args: Any, kwargs: Any) -> Any:
        """An op on tensors that hold no split rows: as on one device, its outputs holding none
        too; but a whole tensor resized to this rank's block (``F.interpolate(cond,
        size=h.shape[-2:])``) would be paired with the block's rows as if it were theirs
        (refused), and one expanded or repeated to it is constant along those rows: taken to
        hold them (the guard checks what follows)."""
        out = func(*args, **kwargs)
        d = self._block_sized(func, ins, out)
        if d is not None and func in RESIZE:
            raise self._refuse(
                op_name(func), ins[0], f"it sizes a tensor that holds no split rows (a region "
                f"input other than the field, whole on every rank) to this rank's rows along "
                f"the split dim {d}", "pass that tensor as the field, or size it to the whole "
                "domain before the region",
            )  # fmt: skip
        if d is None:
            for y in tensors(out):
                self.records[y] = empty(len(self.split))
        return out

    def _joined(
        self, func: Any, ins: list[Tensor], args: tuple[Any, ...], kwargs: Any
    ) -> tuple[Any] | None:
        """Ops over several tensors the guard reads itself (outside a known attention module):
        ``cat``-like joins (checked), ``stack`` and ``einsum`` (followed), aten calls (refused
        unless elementwise); ``(output,)`` when it ran the op, else ``None``."""
        aten = isinstance(func, (OpOverload, OpOverloadPacket))
        if not (aten or func in JOINS):
            return None
        held = [t for t in ins if self.layout(t).dims()]
        seq = tensors(args[0]) if args and isinstance(args[0], (tuple, list)) else []
        if func in CAT and seq:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            for t in seq:
                self._check_dims(func, t, [dim], "mixes")
        elif func in STACK_ALONG and held:
            along = STACK_ALONG[func]
            for t in seq:
                self._check_dims(func, t, range(t.dim()) if along is None else [along], "mixes")
        elif func in STACK and held and seq:
            return (self._stack(func, seq, args, kwargs),)
        elif func is torch.einsum and held:
            return (self._einsum(args, kwargs),)
        elif aten and held and not is_pointwise(func):
            raise self._refuse(
                f"torch.ops.{func}", held[0], "a direct aten call, which the guard does not "
                "read (it may act on the split dims)", "the torch function it implements "
                "(torch.sum, x.flip, ...), which the guard reads, or end the region before it",
            )  # fmt: skip
        return None

    def _stack(self, func: Any, seq: list[Tensor], args: tuple[Any, ...], kwargs: Any) -> Any:
        """``torch.stack``: the split dims of the tensors (alike) shifted past the new dim."""
        lays = {self.layout(t) for t in seq}
        if len(lays) > 1:
            raise self._refuse(
                op_name(func), seq[0], "it stacks tensors whose split dims lie at different "
                "places (or hold none)", "move the split dims back first",
            )  # fmt: skip
        dim = int(kwargs.get("dim", args[1] if len(args) > 1 else 0))
        new = stacked(lays.pop(), dim, seq[0].dim())
        if isinstance(new, str):
            raise self._refuse(op_name(func), seq[0], new, "keep the batch dim first")
        out = func(*args, **kwargs)
        self._store(out, new)
        return out

    def _einsum(self, args: tuple[Any, ...], kwargs: Any) -> Any:
        """``torch.einsum``: followed where each split dim keeps its subscript into the output
        (`fastdist.nn.domain.layout.einsum_layout`), else refused."""
        ops = list(args[1:])
        ops = tensors(ops[0]) if len(ops) == 1 and isinstance(ops[0], (tuple, list)) else ops
        eq = args[0] if args and isinstance(args[0], str) else None
        new: Layout | str | None = "the sublist form, which the guard does not read"
        if eq is not None and all(isinstance(t, Tensor) for t in ops):
            shapes = [tuple(t.shape) for t in ops]
            new = einsum_layout(eq, shapes, [self.layout(t) for t in ops])
        if isinstance(new, str):
            first = next(t for t in ops if isinstance(t, Tensor) and self.layout(t).dims())
            raise self._refuse(
                f"torch.einsum({eq!r})", first, new, "keep each split dim's subscript in the "
                "output (contract only dims that are not split), or end the region before it",
            )  # fmt: skip
        out = torch.einsum(*args, **kwargs)
        if new is not None:
            self._store(out, new)
        return out

    def _check_op(
        self, func: Any, x: Tensor, rest: tuple[Any, ...], kwargs: Any, ins: list[Tensor],
        inside: bool,
    ) -> None:  # fmt: skip
        """The reductions, mixing ops and paddings of the tables over a split dim of ``x`` (of
        every tensor argument, for the ops of ``EVERY_INPUT``); inside a known attention module
        (``inside``) only those of ``ALWAYS``."""
        if func in PAD:
            self._check_pad(func, x, *rest, **kwargs)
            return
        verb, table = ("reduces", REDUCTIONS) if func in REDUCTIONS else ("mixes", MIXING)
        if func not in table or (inside and func not in ALWAYS):
            return
        for t in [x, *(t for t in ins if t is not x)] if func in EVERY_INPUT else [x]:
            self._check_dims(func, t, table[func](t, rest, kwargs), verb)
        if func in ALIKE:
            self._check_alike(func, ins)

    def _check_alike(self, func: Any, ins: list[Tensor]) -> None:
        """An index and the tensor it indexes (``gather``, ``scatter``): alike along the dims
        that hold split rows (a block indexed at the whole tensor's positions, or a whole
        tensor at a block's, is wrong)."""
        for a in ins:
            for b in ins:
                if a.dim() != b.dim():
                    continue
                only = self.layout(a).dims() - self.layout(b).dims()
                if any(b.shape[p] > 1 for p in only):
                    raise self._refuse(
                        op_name(func), a, f"it indexes with a tensor of shape {tuple(b.shape)} "
                        f"that holds the split rows elsewhere ({self._where_split(b)})",
                        "index a tensor split as the index is, or end the region before it",
                    )  # fmt: skip

    def _check_dims(self, func: Any, x: Tensor, dims: Any, verb: str) -> None:
        """A reduction (``mean``, ``max``, a norm, a softmax, ...) or a mixing op (an FFT, a roll,
        a cumulative op, a sort, a difference) over a dim of ``x`` that holds split rows: this
        rank's block only, where one device acts on the whole domain."""
        dims = [dims] if isinstance(dims, int) else dims
        lay = self.layout(x)
        hit = {int(r) % max(x.dim(), 1) for r in dims} & lay.dims()
        if not hit:
            return
        p = min(hit)
        d = next(
            d
            for (d, _), a, f in zip(self.split, lay.at, lay.folded, strict=True)
            if a == p or (f is not None and p == 0)
        )
        at = f"dim {p} of this tensor" + (", folded into the batch" if p not in lay.at else "")
        short = getattr(func, "__name__", op_name(func))
        if verb == "reduces":
            raise ParallelizeError(
                f"DomainParallel on {self.where!r}: the model reduces a tensor of shape "
                f"{tuple(x.shape)} over the split dim {d} itself ({short}), {at}: this rank's "
                "block only, where one device reduces the whole domain. Fix: a module the style "
                "runs (GroupNorm, a pooling), or end the domain-parallel region before it"
            )
        raise ParallelizeError(
            f"DomainParallel on {self.where!r}: the model calls {short} over the split dim {d} "
            f"of a tensor of shape {tuple(x.shape)} itself, {at}: each rank would transform "
            "its own block as if it were the whole domain (an FFT, a roll, a flip, a "
            "cumulative op, a sort, a difference, a concatenation, a split or a repetition "
            "along it mixes the rows of that dim). Fix: end the "
            "domain-parallel region before it, or do not split that dim"
        )

    def _check_pad(self, func: Any, x: Tensor, pad: Any, *args: Any, **kwargs: Any) -> None:
        held = self.layout(x).dims()
        for j in range(len(pad) // 2):  # pad[2j], pad[2j+1]: dim -1-j
            if (pad[2 * j] or pad[2 * j + 1]) and x.dim() - 1 - j in held:
                d = next((d for d, _ in self.split if x.dim() + d == x.dim() - 1 - j), -1 - j)
                raise ParallelizeError(
                    f"DomainParallel on {self.where!r}: the model pads the split dim {d} "
                    f"itself ({op_name(func)} {tuple(pad)}): each rank would pad its own block. "
                    "Fix: pad through the convolution (fastdist.nn.DomainConv padding=), or do "
                    "not split that dim"
                )

    def _before(self, func: Any, x: Tensor, rest: tuple[Any, ...], kwargs: Any) -> None:
        """Refusals that the call's arguments decide (outside a known attention module)."""
        held = self.layout(x).dims()
        if not held:
            return
        if func in UNSHUFFLE:
            self._check_unshuffle(func, x, rest, kwargs)
        if func in CHANNEL_DROPOUT:
            self._check_channel_dropout(func, x, rest, kwargs)
        if func in MOVE_IN_PLACE:
            raise self._refuse(
                op_name(func), x, "an in-place op that moves the dims of a tensor holding split "
                "rows", "its out-of-place form (x = x.transpose(...))",
            )  # fmt: skip
        if func in REPEAT:
            reps = flat_ints(rest or (kwargs.get("dims", kwargs.get("sizes", ())),))
            lead = len(reps) - x.dim()
            hit = [p for p in held if lead + p >= 0 and reps[lead + p] != 1]
            if hit:
                self._check_dims(func, x, hit, "mixes")
        if func in CONTRACT:
            other = rest[0] if rest and isinstance(rest[0], Tensor) else None
            if x.dim() - 1 in held or (
                other is not None
                and func is not F.linear
                and (other.dim() - 2 if other.dim() > 1 else 0) in self.layout(other).dims()
            ):
                raise self._refuse(
                    op_name(func), x, "it contracts a dim that holds split rows (each rank would "
                    "sum over its own block only)", "end the domain-parallel region before it",
                )  # fmt: skip
        if func in CONTRACT_AFTER_BIAS:
            for t in tensors([*rest, *kwargs.values()]) + [x]:
                if {t.dim() - 1, t.dim() - 2} & self.layout(t).dims():
                    raise self._refuse(
                        op_name(func), t, "it contracts or mixes a dim that holds split rows",
                        "end the domain-parallel region before it",
                    )  # fmt: skip
        if func is Tensor.unfold:
            self._check_dims(func, x, [kwargs.get("dimension", rest[0] if rest else 0)], "mixes")
        if func is Tensor.__setitem__ and rest:
            why = index_layout(self.layout(x), x, rest[0])
            if isinstance(why, str):
                raise self._refuse(
                    "Tensor.__setitem__", x, f"the index is {why}",
                    "write whole split dims, or end the domain-parallel region before it",
                )  # fmt: skip

    def _check_unshuffle(self, func: Any, x: Tensor, rest: tuple[Any, ...], kwargs: Any) -> None:
        """``F.pixel_unshuffle(x, r)`` (``nn.PixelUnshuffle``) folds ``r x r`` pixel groups of the
        last two dims into the channels: exact on each rank's block where every rank's block
        along a split dim among them divides by ``r`` (the groups then start at the block's start
        as they do in the whole domain); else refused here, naming the blocks, before torch's own
        error (which names the block's size only) or an error at a later layer."""
        r = int(rest[0] if rest else kwargs[UNSHUFFLE[func]])
        lay = self.layout(x)
        for (d, axis), p in zip(self.split, lay.at, strict=True):
            if p is None or p < x.dim() - 2:
                continue  # dim -3 (the channels) is refused by the table (MIXING)
            rows = x.shape[p]
            n, sim = self.mesh.axis_size(axis), self.mesh.backend is None
            sizes = ragged_sizes(self.mesh, axis, d, rows, self.where) or [rows] * (n if sim else 1)
            if all(s % r == 0 for s in sizes):
                continue
            whose = "each rank's" if sim else "this rank's"
            raise ParallelizeError(
                f"DomainParallel on {self.where!r}: the model calls pixel_unshuffle "
                f"(nn.PixelUnshuffle / F.pixel_unshuffle) with downscale_factor={r} on a tensor "
                f"of shape {tuple(x.shape)} whose dim {p} holds the split dim {d} (axis "
                f"{axis!r}, {n} ranks) in blocks of {sizes} rows ({whose}): every block must "
                f"divide by {r} so that its {r} x {r} pixel groups are the whole domain's. Fix: "
                f"a domain length along dim {d} divisible by {r} x {n} (times the strides "
                f"before this layer), uneven blocks (sizes=) each a multiple of {r} here, or "
                f"fewer ranks of {axis!r}"
            )

    def _check_channel_dropout(
        self, func: Any, x: Tensor, rest: tuple[Any, ...], kwargs: Any
    ) -> None:
        """A channel dropout in training (``F.dropout2d(x, p, training=True)``) of a tensor that
        holds split rows: one device drops a channel over the whole domain, each rank would draw
        its own mask for its block (a channel dropped in part of the domain). Refused."""
        key = CHANNEL_DROPOUT[func]
        p = float(rest[0] if rest else kwargs.get("p", 0.5))
        training = bool(rest[1] if len(rest) > 1 else kwargs.get(key, True))
        if training and p > 0:
            raise self._refuse(
                op_name(func), x, f"a channel dropout in training (p={p}) drops whole channels "
                "over the domain on one device, but each rank would draw its own mask for its "
                "block (a channel dropped in part of the domain only)", "p=0, eval mode, "
                "or end the domain-parallel region before it",
            )  # fmt: skip

    def _follow(self, func: Any, x: Tensor, rest: tuple[Any, ...], kwargs: Any, out: Any) -> None:
        """Where the split dims lie on the call's outputs (refused where the guard cannot
        follow them)."""
        lay = self.layout(x)
        outs = tensors(out)
        if func in PERMUTE and lay.dims():
            order = [o % x.dim() for o in PERMUTE[func](x, rest, kwargs)] if x.dim() else []
            if any(lay.folded) and order[:1] != [0]:
                raise self._refuse(
                    op_name(func), x, "it moves the batch dim, which holds a split dim merged "
                    "into it", "keep the batch dim first",
                )  # fmt: skip
            at = tuple(None if p is None else order.index(p) for p in lay.at)
            self._store(outs[0], Layout(at, lay.folded))
        elif func in RESHAPE and lay.dims() and len(outs) == 1:
            new = reshaped(lay, tuple(x.shape), tuple(outs[0].shape))
            if isinstance(new, str):
                raise self._refuse(
                    op_name(func), x, f"reshaping it to {tuple(outs[0].shape)}: {new}, which the "
                    "guard cannot follow (a layer after it would mix the block's rows as if "
                    "they were the whole domain's)",
                    "keep the split dims apart (flatten only the batch and channel dims), a "
                    "known attention module (diffusers' Attention), or end the domain-parallel "
                    "region before it",
                )  # fmt: skip
            self._store(outs[0], new)
        elif func is Tensor.__getitem__ and lay.dims() and len(outs) == 1:
            new = index_layout(lay, x, rest[0] if rest else ())
            if isinstance(new, str):
                raise self._refuse(
                    "Tensor.__getitem__", x, f"the index is {new}: each rank would index its "
                    "own block", "index whole split dims, or end the domain-parallel region "
                    "before it",
                )  # fmt: skip
            self._store(outs[0], new)
        elif func is Tensor.unfold and lay.dims() and len(outs) == 1:
            self._store(outs[0], lay)  # the windows' dim is new, at the end
        elif func in LEADING and lay.dims() and len(outs) == 1:
            new = leading(lay, tuple(x.shape), tuple(outs[0].shape))
            if isinstance(new, str):
                raise self._refuse(op_name(func), x, new, "expand the other dims only")
            self._store(outs[0], new)
        elif func in UNBIND and lay.dims():
            d = int(kwargs.get("dim", rest[0] if rest else 0)) % x.dim()
            for y in outs:
                at = tuple(None if p is None else p - (p > d) for p in lay.at)
                self._store(y, Layout(at, lay.folded))
        elif func in REDUCTIONS and lay.dims():
            self._follow_reduction(func, x, REDUCTIONS[func](x, rest, kwargs), outs)
        else:
            self._follow_any(func, x, rest, kwargs, outs)

    def _follow_reduction(self, func: Any, x: Tensor, dims: Any, outs: list[Tensor]) -> None:
        """A reduction over dims that hold no split rows: its outputs keep them (``keepdim``),
        or drop the reduced dims before them."""
        lay = self.layout(x)
        gone = sorted({int(r) % x.dim() for r in ([dims] if isinstance(dims, int) else dims)})
        for y in outs:
            if y.dim() == x.dim():
                self._store(y, lay)
            elif y.dim() == x.dim() - len(gone):
                at = tuple(None if p is None else p - sum(g < p for g in gone) for p in lay.at)
                self._store(y, Layout(at, lay.folded))
            else:
                raise self._refuse(
                    op_name(func), x, f"its output has {y.dim()} dims, not those it keeps",
                    "a reduction the guard reads (dim=, keepdim=), or end the region before it",
                )  # fmt: skip

    def _follow_any(
        self, func: Any, x: Tensor, rest: tuple[Any, ...], kwargs: Any, outs: list[Tensor]
    ) -> None:
        """Any other op: an output with the dims of the input that holds split rows (a followed
        one first) has its layout; other outputs of a followed input are refused."""
        ins = [x, *(t for v in (*rest, *kwargs.values()) for t in tensors(v))]
        ins = ins[:1] if func in FIRST_ONLY else ins
        held = [t for t in ins if self.layout(t).dims()]
        if not held or not outs:
            return
        src = next((t for t in held if t in self.records), held[0])
        lay = self.layout(src)
        for t in held:
            other = self.layout(t)
            if t.dim() == src.dim() and other != lay and spans(t, other) and spans(src, lay):
                raise self._refuse(
                    op_name(func), src, f"it combines it with a tensor of shape {tuple(t.shape)} "
                    f"whose split dims lie elsewhere ({self._where_split(t)})",
                    "move the split dims back first (or do not move them)",
                )  # fmt: skip
        for y in outs:
            new: Layout | str = lay
            if y.dim() > src.dim() and is_pointwise(func):  # broadcast: new leading dims
                new = leading(lay, tuple(src.shape), tuple(y.shape))
            elif y.dim() != src.dim():
                new = "an op the guard does not read that changes the number of dims"
            if isinstance(new, str):
                raise self._refuse(
                    op_name(func), src, f"its output has {y.dim()} dims: {new}, so the guard "
                    "cannot tell where the split dims lie on it (nor whether it acts on them)",
                    "an op the guard reads (reshape, permute, einsum, stack, a reduction over "
                    "dims that are not split), or end the domain-parallel region before it",
                )  # fmt: skip
            self._store(y, new)

    # ------------------------------------------------------------------ layers and output
    def check_layer(self, kind: str, where: str, args: Any, kwargs: Any) -> None:
        """Before a layer of the style (of ``kind``) runs: refused where an input's split dims
        are moved (the layer exchanges halos along the field's dims, counted from the end), or,
        for a layer over the whole domain, folded into the batch."""
        if not region().depth or layer_depth() or current_attention() is not None:
            return
        for t in (*tensors(list(args)), *tensors(list(kwargs.values()))):
            rec: Layout | None = self.records.get(t)
            if rec is None:
                continue
            canon = canonical(t, self.split)
            if kind == "linear":
                bad = t.dim() - 1 in rec.dims()
            else:
                bad = any(
                    f is None and a != c
                    for a, f, c in zip(rec.at, rec.folded, canon.at, strict=True)
                ) or (kind in WHOLE_DOMAIN and any(rec.folded))
            if bad and not rec.dims() and not any(rec.folded):
                raise ParallelizeError(
                    f"DomainParallel on {self.where!r}: {where} gets a tensor of shape "
                    f"{tuple(t.shape)} that holds no split rows (a region input other than the "
                    "field, or computed from such inputs only): the layer would exchange its "
                    "halos with the other ranks as if it were this rank's block. Fix: run that "
                    "layer outside the domain-parallel region, or pass that tensor as the field"
                )
            if bad:
                raise ParallelizeError(
                    f"DomainParallel on {self.where!r}: {where} gets a tensor of shape "
                    f"{tuple(t.shape)} whose split dims the model's own code moved (split dims "
                    f"at {self._where_split(t)}; the layer takes them where the field has "
                    f"them, dims {[d for d, _ in self.split]} from the end). Fix: move them back "
                    "before the layer (x.transpose(...) again), or do not split those dims"
                )

    def after_layer(self, args: Any, out: Any) -> None:
        """After a layer (not an attention): its output keeps the layout of its input (a split dim
        folded into the batch, the moved dims of a Linear's channels-last input)."""
        first = next(iter(tensors(list(args))), None)
        rec: Layout | None = None if first is None else self.records.get(first)
        if rec is not None and isinstance(out, Tensor):
            if self.clean(first):  # type: ignore[arg-type]
                self.records[out] = rec  # a Linear of a timestep embedding: still none
            elif out.dim() == first.dim():  # type: ignore[union-attr]
                self._store(out, rec)

    def check_output(self, out: Any) -> None:
        """The region's output: every tensor must hold the split dims where the field has them
        (they are gathered there)."""
        if isinstance(out, Tensor):
            if out in self.records:
                raise ParallelizeError(
                    f"DomainParallel on {self.where!r}: the region returns a tensor of shape "
                    f"{tuple(out.shape)} whose split dims the model's own code moved (split "
                    f"dims at {self._where_split(out)}): gathering it along the field's dims "
                    "would give a wrong answer. Fix: move them back before returning, or end "
                    "the domain-parallel region before the move"
                )
        elif isinstance(out, (tuple, list)):
            for v in out:
                self.check_output(v)
        elif hasattr(out, "keys") and hasattr(out, "__getitem__"):
            for k in list(out.keys()):
                self.check_output(out[k])

    # ------------------------------------------------------------------ interpolation
    def _interpolate(
        self,
        x: Tensor,
        size: Any = None,
        scale_factor: Any = None,
        mode: str = "nearest",
        align_corners: bool | None = None,
        recompute_scale_factor: bool | None = None,
        antialias: bool = False,
    ) -> Tensor:
        if current_attention() is None:
            self.check_layer("upsample", "F.interpolate", (x,), {})
        factor = upsample_factors(
            x, size, scale_factor, mode, bool(align_corners), antialias, mesh=self.mesh,
            split=self.split, where=self.where,
        )  # fmt: skip
        with inside_layer():
            out = domain_upsample(
                x, factor, mode, mesh=self.mesh, split=self.split, where=self.where
            )
        rows_seen(x.shape, out, x.dim() - 2, self.split, f"F.interpolate in {self.where!r}")
        self.after_layer((x,), out)
        return out
