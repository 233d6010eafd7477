"""The functional guard of a domain-parallel region: while the region runs, the torch calls of
the model's own code (between the style's layers) that would act on this rank's block as if it
were the whole domain raise a `ParallelizeError` at the first call, naming the op, the dim and
the fix; ``F.interpolate`` runs domain-parallel, and the ``F.scaled_dot_product_attention`` of a
known attention module gets the whole domain's keys.

Where the split dims are. A tensor the guard has not followed holds the split dims where the
field holds them, counted from the end (``-2``: H of ``[N, C, H, W]``), when it has enough dims
(at least ``2 + |d|``): the style's layers take and give such tensors. Outside a known attention
module the guard follows the split dims through the model's own ``permute`` / ``transpose`` /
``movedim``, reshapes (``view``, ``reshape``, ``flatten``, ``unflatten``, ``squeeze``,
``unsqueeze``), basic indexing, reductions over other dims and every op whose output keeps the
input's number of dims, and records where they lie on each tensor whose layout differs. A split
dim merged into the leading (batch) dim (Wan's ``[N * T, C, H, W]`` per-frame upsampling) is
followed as *folded*: per-batch ops run, the reshape that takes it out again restores it.
Refused where the guard cannot follow exactly: a reshape that merges a split dim with another
dim (other than into the batch) or cuts one into several, advanced indexing of a tensor that
holds split dims, a layer of the style (or the region's output) given a tensor whose split dims
are moved, and ops of different dims on a moved tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.domain.attention import current_attention, gathered_sdpa
from fastdist.nn.domain.layers import check_converted, inside_layer, layer_depth
from fastdist.nn.domain.windows import (
    UPSAMPLE_HALO,
    Split,
    domain_upsample,
    ragged_sizes,
    region,
)
from fastdist.ops import all_gather

__all__ = ["Guard", "Layout"]

_REFUSED: dict[Any, str] = {
    F.scaled_dot_product_attention: "self-attention over spatial tokens mixes the whole domain",
    F.group_norm: "a functional group norm takes statistics over this rank's block only",
    F.batch_norm: "a functional batch norm takes statistics over this rank's block only",
    F.instance_norm: "a functional instance norm takes statistics over this rank's block only",
    F.unfold: "a functional unfold reads past this rank's block",
    F.fold: "a functional fold writes past this rank's block",
    F.grid_sample: "a grid sample reads the field at positions anywhere in the whole domain",
    **{
        f: "a functional pooling or convolution reads past this rank's block"
        for f in (
            F.adaptive_avg_pool1d,
            F.adaptive_avg_pool2d,
            F.adaptive_avg_pool3d,
            F.adaptive_max_pool1d,
            F.adaptive_max_pool2d,
            F.adaptive_max_pool3d,
            F.avg_pool1d,
            F.avg_pool2d,
            F.avg_pool3d,
            F.max_pool1d,
            F.max_pool2d,
            F.max_pool3d,
            F.conv1d,
            F.conv2d,
            F.conv3d,
            F.conv_transpose1d,
            F.conv_transpose2d,
            F.conv_transpose3d,
        )  # fmt: skip
    },
}

#: ``None``: an op over every dim
_ALL = None


def _as_dims(v: Any) -> list[int] | None:
    """``v`` as a list of dims, or ``None`` when it names none (``None``, a dtype, a bool)."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int):
        return [v]
    if isinstance(v, (tuple, list)) and all(isinstance(i, int) for i in v):
        return [int(i) for i in v]
    return None


def _arg_dims(name: str, at: int, default: Sequence[int] | None) -> Any:
    """The dims of an op that takes them as ``name`` (keyword, or the ``at``-th positional
    after the input; ``at < 0``: keyword only), else ``default`` (``None``: every dim)."""

    def dims(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        v = kwargs.get(name, args[at] if 0 <= at < len(args) else None)
        got = _as_dims(v)
        return (range(x.dim()) if default is None else default) if got is None else got

    return dims


def _max_dims(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``max`` / ``min``: over ``dim``, every dim without one; the binary ``max(x, y)``
    (elementwise) over none."""
    if (args and isinstance(args[0], Tensor)) or "other" in kwargs:
        return []
    return _arg_dims("dim", 0, _ALL)(x, args, kwargs)


def _norm_shape_dims(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.layer_norm`` / ``F.rms_norm``: the last ``len(normalized_shape)`` dims."""
    shape = kwargs.get("normalized_shape", args[0] if args else ())
    n = 1 if isinstance(shape, int) else len(shape)
    return range(x.dim() - n, x.dim())


def _fft_dims(default: tuple[int, ...] | None, at: int) -> Any:
    """The dims an FFT call transforms: its ``dim`` (keyword or the ``at``-th positional after
    the input), else the last ``len(s)`` dims when ``s`` is given, else ``default`` (``None``:
    every dim)."""

    def dims(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        dim = kwargs.get("dim", args[at] if len(args) > at else None)
        if dim is not None:
            return dim
        s = kwargs.get("s", args[0] if args and at == 1 else None)
        if s is not None and default is None:
            return tuple(range(-len(s), 0))
        return range(x.dim()) if default is None else default

    return dims


def _both(names: Sequence[str], dims: Any, module: Any = torch) -> dict[Any, Any]:
    """``{torch.name and Tensor.name: dims}`` for each name (those that exist)."""
    out = {}
    for name in names:
        for owner in (module, Tensor):
            f = getattr(owner, name, None)
            if f is not None:
                out[f] = dims
    return out


#: reductions: over a split dim they reduce this rank's block as if it were the domain
#: (``{op: the dims it reduces}``; its output drops them, or keeps them with size 1)
_REDUCTIONS: dict[Any, Any] = {
    **_both(
        (
            "mean",
            "sum",
            "nansum",
            "nanmean",
            "amax",
            "amin",
            "var",
            "std",
            "var_mean",
            "std_mean",
            "prod",
            "logsumexp",
            "argmax",
            "argmin",
            "median",
            "nanmedian",
            "count_nonzero",
            "softmax",
            "log_softmax",
        ),
        _arg_dims("dim", 0, _ALL),
    ),  # fmt: skip
    **_both(("max", "min"), _max_dims),
    **_both(("aminmax",), _arg_dims("dim", -1, _ALL)),
    **_both(("norm",), _arg_dims("dim", 1, _ALL)),
    **_both(("quantile", "nanquantile"), _arg_dims("dim", 1, _ALL)),
    **_both(("topk", "kthvalue"), _arg_dims("dim", 1, (-1,))),
    **_both(("mode",), _arg_dims("dim", 0, (-1,))),
    torch.linalg.vector_norm: _arg_dims("dim", 1, _ALL),
    torch.linalg.norm: _arg_dims("dim", 1, _ALL),
    torch.linalg.matrix_norm: _arg_dims("dim", 1, (-2, -1)),
    F.softmax: _arg_dims("dim", 0, _ALL),
    F.log_softmax: _arg_dims("dim", 0, _ALL),
    F.softmin: _arg_dims("dim", 0, _ALL),
    F.normalize: _arg_dims("dim", 1, (1,)),
    F.layer_norm: _norm_shape_dims,
    **({F.rms_norm: _norm_shape_dims} if hasattr(F, "rms_norm") else {}),
}

#: ops that mix values along their dims (each output row reads every input row, or another
#: row): over a split dim they act on this rank's block as if it were the whole domain
_MIXING: dict[Any, Any] = {
    **{getattr(torch.fft, n): _fft_dims((-1,), 1) for n in ("fft", "ifft", "rfft", "irfft")},
    **{getattr(torch.fft, n): _fft_dims((-1,), 1) for n in ("hfft", "ihfft")},
    **{getattr(torch.fft, n): _fft_dims((-2, -1), 1) for n in ("fft2", "ifft2", "rfft2")},
    **{getattr(torch.fft, n): _fft_dims((-2, -1), 1) for n in ("irfft2", "hfft2", "ihfft2")},
    **{getattr(torch.fft, n): _fft_dims(None, 1) for n in ("fftn", "ifftn", "rfftn", "irfftn")},
    **{getattr(torch.fft, n): _fft_dims(None, 1) for n in ("hfftn", "ihfftn")},
    **{getattr(torch.fft, n): _fft_dims(None, 0) for n in ("fftshift", "ifftshift")},
    **_both(("roll",), _arg_dims("dims", 1, _ALL)),
    **_both(("flip",), _arg_dims("dims", 0, _ALL)),
    **_both(("rot90",), _arg_dims("dims", 1, (0, 1))),
    **_both(("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"), _arg_dims("dim", 0, _ALL)),
    **_both(("sort", "argsort"), _arg_dims("dim", 0, (-1,))),
    **_both(("diff",), _arg_dims("dim", 1, (-1,))),
    **_both(("split", "chunk", "tensor_split"), _arg_dims("dim", 1, (0,))),
    **_both(("unbind",), _arg_dims("dim", 0, (0,))),
    torch.gradient: _arg_dims("dim", -1, _ALL),
}

#: ops that move dims: ``{op: (x, args, kwargs) -> the input dim at each output dim}``
_PERMUTE = {
    **_both(("permute",), lambda x, a, k: _flat_ints(a or k.get("dims"))),
    **_both(
        ("transpose", "swapaxes", "swapdims"),
        lambda x, a, k: _swap(x.dim(), *(a[:2] or (k["dim0"], k["dim1"]))),
    ),
    **_both(
        ("movedim", "moveaxis"),
        lambda x, a, k: _moved(x.dim(), *(a[:2] or (k["source"], k["destination"]))),
    ),
    Tensor.t: lambda x, a, k: _swap(x.dim(), 0, 1) if x.dim() == 2 else list(range(x.dim())),
    Tensor.T.__get__: lambda x, a, k: list(reversed(range(x.dim()))),  # type: ignore[attr-defined]
    Tensor.mT.__get__: lambda x, a, k: _swap(x.dim(), -2, -1),  # type: ignore[attr-defined]
    Tensor.mH.__get__: lambda x, a, k: _swap(x.dim(), -2, -1),  # type: ignore[attr-defined]
}

#: ops that reshape (the dims follow from the input's and the output's shapes)
_RESHAPE = {
    *_both(("reshape", "flatten", "unflatten", "squeeze", "unsqueeze"), None),
    Tensor.view,
    Tensor.view_as,
    Tensor.reshape_as,
}

#: in-place ops that move dims: refused on a tensor that holds split dims
_MOVE_IN_PLACE = {
    getattr(Tensor, n)
    for n in ("transpose_", "t_", "swapaxes_", "swapdims_", "squeeze_", "unsqueeze_", "resize_")
    if hasattr(Tensor, n)
}

_PAD = {F.pad, torch.constant_pad_nd}

#: concatenations (a sequence of tensors first): along a split dim each rank would join blocks
_CAT = {
    f for f in (torch.cat, getattr(torch, "concat", None), getattr(torch, "concatenate", None)) if f
}

#: repetitions of the whole tensor: along a split dim each rank would repeat its block
_REPEAT = {Tensor.repeat, Tensor.tile, torch.tile}

#: calls that only read a tensor's metadata or make a new one from its dtype and device
#: (nothing to follow)
_META = {Tensor.dim, Tensor.size, Tensor.numel, Tensor.stride, Tensor.__len__} | {
    getattr(Tensor, f"new_{n}") for n in ("zeros", "ones", "empty", "full", "tensor")
}


def _flat_ints(v: Any) -> list[int]:
    if len(v) == 1 and isinstance(v[0], (tuple, list)):
        v = v[0]
    return [int(i) for i in v]


def _swap(n: int, a: int, b: int) -> list[int]:
    order = list(range(n))
    order[a % n], order[b % n] = order[b % n], order[a % n]
    return order


def _moved(n: int, src: Any, dst: Any) -> list[int]:
    src = [s % n for s in ([src] if isinstance(src, int) else src)]
    dst = [d % n for d in ([dst] if isinstance(dst, int) else dst)]
    rest = iter(i for i in range(n) if i not in src)
    placed = dict(zip(dst, src, strict=True))
    return [placed[j] if j in placed else next(rest) for j in range(n)]


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


def _tensors(v: Any) -> list[Tensor]:
    """The tensors of ``v`` (one, or a tuple / list of them)."""
    if isinstance(v, Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for t in v if isinstance(t, Tensor)]
    return []


def _index_layout(lay: Layout, x: Tensor, index: Any) -> Layout | str:
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


#: ops whose first tensor contracts its last dim (and a second tensor its dim -2)
_CONTRACT = {
    F.linear, torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm, Tensor.bmm, torch.mm,
    Tensor.mm,
}  # fmt: skip

#: reductions and mixing ops the guard checked before it followed moved dims: checked inside a
#: known attention module too (the others only outside one)
_ALWAYS = {
    f
    for name in ("mean", "sum", "amax", "amin", "var", "std", "logsumexp", "prod", "nansum",
                 "roll", "flip", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp",
                 "sort", "argsort")
    for f in (getattr(torch, name), getattr(Tensor, name))
} | {f for f in _MIXING if getattr(f, "__module__", "").startswith("torch.fft")}  # fmt: skip

#: the kinds of layer (`fastdist.nn.domain.layers.classify`) that take statistics over, or
#: attend across, the split dims: a split dim folded into the batch is refused there
_WHOLE_DOMAIN = ("group_norm", "instance_norm", "batch_norm", "adaptive", "attention")


def _name(func: Any) -> str:
    """``func`` as the model's code spells it (``torch.max``, ``Tensor.max``, ``F.pad``)."""
    qual = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
    name = qual.split(".")[-1]
    if qual.startswith(("TensorBase.", "Tensor.")):
        return f"Tensor.{name}"
    if qual.startswith("_VariableFunctionsClass."):
        return f"torch.{name}"
    if getattr(func, "__module__", "") == "torch.nn.functional":
        return f"F.{name}"
    return qual.replace(".__get__", "")


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
        if func is F.interpolate:
            check_converted(self.where, "F.interpolate")
            return self._interpolate(*args, **kwargs)
        call = current_attention()
        if func is F.scaled_dot_product_attention and call is not None:
            check_converted(self.where, "F.scaled_dot_product_attention")
            return gathered_sdpa(call, *args, **kwargs)
        x = args[0] if args and isinstance(args[0], Tensor) else kwargs.get("input")
        if x is None and args and isinstance(args[0], (tuple, list)):  # cat, stack, ...
            seq = _tensors(args[0])
            x = next((t for t in seq if t in self.records), seq[0] if seq else None)
        if func in _REFUSED:
            raise ParallelizeError(
                f"DomainParallel on {self.where!r}: the model calls {_name(func)} itself, not "
                f"through a module the style runs: {_REFUSED[func]}. Fix: use the torch.nn "
                "module (Conv2d, GroupNorm, ...) or end the region before it"
            )
        if func in _CAT and call is None and args and isinstance(args[0], (tuple, list)):
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            for t in _tensors(args[0]):
                self._check_dims(func, t, [dim], "mixes")
        if not isinstance(x, Tensor) or func in _META:
            return func(*args, **kwargs)
        rest = args[1:] if args and args[0] is x else args
        if func in _PAD:
            self._check_pad(func, x, *rest, **kwargs)
        elif func in _REDUCTIONS and (call is None or func in _ALWAYS):
            self._check_dims(func, x, _REDUCTIONS[func](x, rest, kwargs), "reduces")
        elif func in _MIXING and (call is None or func in _ALWAYS):
            self._check_dims(func, x, _MIXING[func](x, rest, kwargs), "mixes")
        if call is not None:
            return func(*args, **kwargs)
        self._before(func, x, rest, kwargs)
        out = func(*args, **kwargs)
        self._follow(func, x, rest, kwargs, out)
        return out

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
        short = getattr(func, "__name__", _name(func))
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
                    f"itself ({_name(func)} {tuple(pad)}): each rank would pad its own block. "
                    "Fix: pad through the convolution (fastdist.nn.DomainConv padding=), or do "
                    "not split that dim"
                )

    def _before(self, func: Any, x: Tensor, rest: tuple[Any, ...], kwargs: Any) -> None:
        """Refusals that the call's arguments decide (outside a known attention module)."""
        held = self.layout(x).dims()
        if not held:
            return
        if func in _MOVE_IN_PLACE:
            raise self._refuse(
                _name(func), x, "an in-place op that moves the dims of a tensor holding split "
                "rows", "its out-of-place form (x = x.transpose(...))",
            )  # fmt: skip
        if func in _REPEAT:
            reps = _flat_ints(rest or (kwargs.get("dims", kwargs.get("sizes", ())),))
            lead = len(reps) - x.dim()
            hit = [p for p in held if lead + p >= 0 and reps[lead + p] != 1]
            if hit:
                self._check_dims(func, x, hit, "mixes")
        if func in _CONTRACT:
            other = rest[0] if rest and isinstance(rest[0], Tensor) else None
            if x.dim() - 1 in held or (
                other is not None
                and func is not F.linear
                and (other.dim() - 2 if other.dim() > 1 else 0) in self.layout(other).dims()
            ):
                raise self._refuse(
                    _name(func), x, "it contracts a dim that holds split rows (each rank would "
                    "sum over its own block only)", "end the domain-parallel region before it",
                )  # fmt: skip
        if func is Tensor.__setitem__ and rest:
            why = _index_layout(self.layout(x), x, rest[0])
            if isinstance(why, str):
                raise self._refuse(
                    "Tensor.__setitem__", x, f"the index is {why}",
                    "write whole split dims, or end the domain-parallel region before it",
                )  # fmt: skip

    def _follow(self, func: Any, x: Tensor, rest: tuple[Any, ...], kwargs: Any, out: Any) -> None:
        """Where the split dims lie on the call's outputs (refused where the guard cannot
        follow them)."""
        lay = self.layout(x)
        outs = _tensors(out)
        if func in _PERMUTE and lay.dims():
            order = [o % x.dim() for o in _PERMUTE[func](x, rest, kwargs)] if x.dim() else []
            if any(lay.folded) and order[:1] != [0]:
                raise self._refuse(
                    _name(func), x, "it moves the batch dim, which holds a split dim merged "
                    "into it", "keep the batch dim first",
                )  # fmt: skip
            at = tuple(None if p is None else order.index(p) for p in lay.at)
            self._store(outs[0], Layout(at, lay.folded))
        elif func in _RESHAPE and lay.dims() and len(outs) == 1:
            new = reshaped(lay, tuple(x.shape), tuple(outs[0].shape))
            if isinstance(new, str):
                raise self._refuse(
                    _name(func), x, f"reshaping it to {tuple(outs[0].shape)}: {new}, which the "
                    "guard cannot follow (a layer after it would mix the block's rows as if "
                    "they were the whole domain's)",
                    "keep the split dims apart (flatten only the batch and channel dims), a "
                    "known attention module (diffusers' Attention), or end the domain-parallel "
                    "region before it",
                )  # fmt: skip
            self._store(outs[0], new)
        elif func is Tensor.__getitem__ and lay.dims() and len(outs) == 1:
            new = _index_layout(lay, x, rest[0] if rest else ())
            if isinstance(new, str):
                raise self._refuse(
                    "Tensor.__getitem__", x, f"the index is {new}: each rank would index its "
                    "own block", "index whole split dims, or end the domain-parallel region "
                    "before it",
                )  # fmt: skip
            self._store(outs[0], new)
        elif func in _REDUCTIONS and lay.dims():
            dims = _REDUCTIONS[func](x, rest, kwargs)
            gone = sorted({int(r) % x.dim() for r in ([dims] if isinstance(dims, int) else dims)})
            for y in outs:
                if y.dim() == x.dim():
                    self._store(y, lay)
                elif y.dim() == x.dim() - len(gone):
                    at = tuple(None if p is None else p - sum(g < p for g in gone) for p in lay.at)
                    self._store(y, Layout(at, lay.folded))
        else:
            self._follow_any(func, x, rest, kwargs, outs)

    def _follow_any(
        self, func: Any, x: Tensor, rest: tuple[Any, ...], kwargs: Any, outs: list[Tensor]
    ) -> None:
        """Any other op: an output with the dims of the input that holds split rows (a followed
        one first) has its layout; other outputs of a followed input are refused."""
        ins = [x, *(t for v in (*rest, *kwargs.values()) for t in _tensors(v))]
        held = [t for t in ins if self.layout(t).dims()]
        if not held or not outs:
            return
        src = next((t for t in held if t in self.records), held[0])
        lay = self.layout(src)
        for t in held:
            other = self.layout(t)
            if t.dim() == src.dim() and other != lay and _spans(t, other) and _spans(src, lay):
                raise self._refuse(
                    _name(func), src, f"it combines it with a tensor of shape {tuple(t.shape)} "
                    f"whose split dims lie elsewhere ({self._where_split(t)})",
                    "move the split dims back first (or do not move them)",
                )  # fmt: skip
        for y in outs:
            if y.dim() == src.dim():
                self._store(y, lay)
            elif src in self.records:
                raise self._refuse(
                    _name(func), src, f"its output has {y.dim()} dims, and the guard cannot "
                    "follow the split dims of a moved tensor through it",
                    "move the split dims back first, or end the domain-parallel region before it",
                )  # fmt: skip

    # ------------------------------------------------------------------ layers and output
    def check_layer(self, kind: str, where: str, args: Any, kwargs: Any) -> None:
        """Before a layer of the style (of ``kind``) runs: refused where an input's split dims
        are moved (the layer exchanges halos along the field's dims, counted from the end), or,
        for a layer over the whole domain, folded into the batch."""
        if not region().depth or layer_depth() or current_attention() is not None:
            return
        for t in (*_tensors(list(args)), *_tensors(list(kwargs.values()))):
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
                ) or (kind in _WHOLE_DOMAIN and any(rec.folded))
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
        first = next(iter(_tensors(list(args))), None)
        rec: Layout | None = None if first is None else self.records.get(first)
        if rec is not None and isinstance(out, Tensor):
            if out.dim() == first.dim():  # type: ignore[union-attr]
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
    def _whole_rows(self, x: Tensor, d: int, axis: str) -> int:
        """The whole domain's rows along the split dim ``d`` of ``x`` (uneven blocks: simulated
        ranks' ragged sizes, or every real rank's rows)."""
        ragged = ragged_sizes(self.mesh, axis, d, x.shape[d], self.where)
        if ragged is not None:
            return sum(ragged)
        if self.mesh.backend is None:
            return x.shape[d] * self.mesh.axis_size(axis)
        rows = all_gather(x.new_tensor([float(x.shape[d])]), self.mesh, axis)
        return int(rows.sum().item())

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
        nsp = x.dim() - 2
        if size is not None:  # the whole domain's size: a factor per dim
            sizes = size if isinstance(size, (tuple, list)) else [size] * nsp
            whole = [x.shape[2 + i] for i in range(nsp)]
            for d, a in self.split:
                if -d <= nsp:
                    whole[nsp + d] = self._whole_rows(x, d, a)
            factor = [s / w for s, w in zip(sizes, whole, strict=True)]
        else:
            sf = scale_factor if isinstance(scale_factor, (tuple, list)) else [scale_factor] * nsp
            factor = [float(s) for s in sf]
        if (
            mode not in UPSAMPLE_HALO
            or align_corners
            or antialias
            or any(f != int(f) or f < 1 for f in factor)
        ):
            raise ParallelizeError(
                f"DomainParallel on {self.where!r}: F.interpolate(mode={mode!r}, align_corners="
                f"{align_corners}, factors {factor}) over a split field is built for integer "
                f"factors >= 1, align_corners=False, modes {sorted(UPSAMPLE_HALO)}. Fix: such "
                "an upsampling, or end the region before it"
            )
        with inside_layer():
            out = domain_upsample(
                x, [int(f) for f in factor], mode, mesh=self.mesh, split=self.split,
                where=self.where,
            )  # fmt: skip
        self.after_layer((x,), out)
        return out


def _spans(t: Tensor, lay: Layout) -> bool:
    """Whether ``t`` has more than one row along a dim that holds split rows (not a broadcast
    one)."""
    return any(t.shape[p] > 1 for p in lay.dims())
