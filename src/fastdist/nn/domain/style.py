"""`DomainParallel`: the ``parallelize`` style that makes an unmodified conv net domain-parallel
over one or more mesh axes (H; H x W; T x H x W).

Where the module is entered its input (the whole field, the same on every rank) is cut to this
rank's block; every layer that looks at neighbours runs on the block with a halo
(`fastdist.nn.domain.layers`), norms take statistics over the whole domain, token-local modules
run as they are; where it returns, the output is gathered (``output="gather"``) or left split.
Every parameter is replicated and ``pvary``'d over the split axes, so each rank's gradient is the
whole gradient. A module that mixes the whole domain in a way the style does not know is refused
at ``parallelize`` time (named, with the fix); functional calls in the model's own code that
would silently act on a block (``F.pad`` of a split dim, ``F.scaled_dot_product_attention``
outside a known attention module, a functional pooling or norm, a reduction over a split dim) are
refused when they run; ``F.interpolate`` is run domain-parallel, and the
``F.scaled_dot_product_attention`` of a known attention module gets the whole domain's keys.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.domain.guard import Guard
from fastdist.nn.domain.layers import (
    DOWNSAMPLE_PADS,
    Recompute,
    Site,
    classify,
    domain_forward,
    folded_pads,
    is_diffusers_downsample,
    saved_hooks_top,
)
from fastdist.nn.domain.windows import Split, one_row_ambiguity, ragged_sizes, region
from fastdist.nn.styles.base import Style, StyleContext
from fastdist.ops import (
    all_gather,
    all_gather_invariant,
    all_gather_v,
    axis_index,
    local_chunk,
    pmean,
)

__all__ = ["DomainParallel"]

#: the attribute that marks a module the style was applied to
_DONE = "_fastdist_domain_parallel"

#: the argument names a field may be passed by (when not positional)
_FIELD_NAMES = ("sample", "hidden_states", "x", "input", "z")


class DomainParallel(Style):
    """Split a conv net's spatial domain over mesh axes: ``dims`` maps a dim of the activations,
    counted from the end (``-1``: W, ``-2``: H, ``-3``: T of a video), to the mesh axis it is split
    over.

    Apply it to the module where the field enters (the model, or its decoder): its first
    positional argument (or ``input=``, or the first of ``sample=`` / ``hidden_states=`` / ``x=``)
    is cut to this rank's block along every split dim, and its output (every tensor of at least
    as many dims) is gathered (``output="gather"``) or left as this rank's block
    (``output="split"``). Blocks are even (each split dim divisible by its axis size at every
    layer: a clear error names the layer otherwise), or uneven with ``sizes=`` (each a multiple
    of the strides on the way).

    Built layers: ``Conv1d/2d/3d`` (any kernel, stride, dilation, groups; padding modes zeros,
    reflect, replicate, circular; a strided padding such that the length divides by the
    stride), diffusers' causal ``WanCausalConv3d`` (with its frame cache when T is not split),
    ``ConvTranspose1d/2d/3d`` (length times the stride), ``MaxPool`` / ``AvgPool`` 1-3d,
    ``Upsample`` (nearest, nearest-exact, linear, bilinear, trilinear, bicubic; integer factors,
    ``align_corners=False``) and ``F.interpolate`` in the model's code, ``GroupNorm``,
    ``InstanceNorm`` and ``BatchNorm`` with statistics over the whole domain (training or eval),
    and, as they are, token-local modules: ``LayerNorm`` / ``RMSNorm`` over channels,
    activations, ``Linear`` over channels (checked at the call), pixel (un)shuffle; adaptive
    pooling (whole bins per block, or global: combined over the ranks); self-attention over H x W
    tokens in diffusers' ``Attention`` and Wan's ``WanAttentionBlock`` (each rank's queries over
    the whole domain's gathered keys); physicsnemo's ``Identity``, ``Sin`` and ``SquarePlus``
    (exact classes) as token-local. Refused at ``parallelize`` time: other attention modules,
    ``Flatten``, norms over several dims, unknown leaf modules (``local=`` declares a class
    token-local). A module of the region checkpointed with ``use_reentrant=False`` re-enters
    the region where the backward recomputes it (real ranks; `fastdist.nn.domain.layers.Recompute`).

    Args:
        dims: ``{dim from the end: mesh axis}``, e.g. ``{-2: "h"}`` or ``{-2: "h", -1: "w"}``.
        output: ``"gather"`` (every rank gets the whole output) or ``"split"`` (its block).
        input: the name of the field's argument when it is passed by keyword.
        local: module classes that act on each position alone (run as they are).
        sizes: ``{dim from the end: each rank's rows}`` for uneven blocks of the field; the
            layers follow each rank's own rows (simulated ranks, which share one shape: every
            block padded to the largest, the padding rows masked out of every layer).
        batch_axes: the data-parallel axes a ``BatchNorm``'s batch statistics span too (as
            ``SyncBatchNorm``), or ``()`` for each data rank's own batch; required (a clear error
            at the call) when the mesh has axes of more than one rank besides the split ones.
        attention: how a spatial self-attention sees the other ranks' keys and values:
            ``"gather"`` (all-gathered: each rank holds the whole domain's) or ``"ring"``
            (passed around the ranks one block at a time, merged with an online softmax).

    >>> import torch, fastdist as fd
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.GroupNorm(2, 4),
    ...                           torch.nn.SiLU(), torch.nn.Conv2d(4, 2, 3, padding=1))
    >>> x = torch.randn(1, 2, 8, 6)
    >>> ref = net(x)
    >>> mesh = fd.Mesh({"h": 2})
    >>> pm = fd.nn.parallelize(net, mesh, {"": fd.nn.DomainParallel({-2: "h"})})
    >>> out = pm(x.expand(2, *x.shape))          # every rank: the whole field in and out
    >>> bool(torch.allclose(out[1], ref, atol=1e-5))
    True
    """

    def __init__(
        self,
        dims: Mapping[int, str],
        *,
        output: str = "gather",
        input: str | None = None,
        local: tuple[type, ...] = (),
        sizes: Mapping[int, Sequence[int]] | None = None,
        batch_axes: Sequence[str] | None = None,
        attention: str = "gather",
    ) -> None:
        self.split: Split = tuple(sorted((int(d), str(a)) for d, a in dict(dims).items()))
        self.output, self.input, self.local = output, input, tuple(local)
        self.axes = tuple(a for _, a in self.split)
        self.sizes = {int(d): tuple(int(v) for v in s) for d, s in dict(sizes or {}).items()}
        self.batch_axes = None if batch_axes is None else tuple(str(a) for a in batch_axes)
        self.attention = attention

    def __repr__(self) -> str:
        return f"DomainParallel({dict(self.split)}, output={self.output!r})"

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        where = name or type(module).__name__
        if not self.split or any(d >= 0 for d, _ in self.split):
            raise ParallelizeError(
                f"DomainParallel on {where!r}: dims={dict(self.split)} must map dims counted "
                "from the end (negative: -2 is H, -1 is W) to mesh axes. Fix: e.g. {-2: 'h'}"
            )
        if len(set(self.axes)) != len(self.axes):
            raise ParallelizeError(
                f"DomainParallel on {where!r}: dims={dict(self.split)} splits two dims over one "
                "axis. Fix: one axis per split dim"
            )
        for a in (*self.axes, *(self.batch_axes or ())):
            mesh.axis_size(a)  # an unknown axis raises, naming it
        if set(self.batch_axes or ()) & set(self.axes):
            raise ParallelizeError(
                f"DomainParallel on {where!r}: batch_axes={self.batch_axes} names a split axis. "
                "Fix: the data-parallel axes only"
            )
        done = [n for n, m in module.named_modules() if m.__dict__.get(_DONE)]
        if done:
            raise ParallelizeError(
                f"DomainParallel on {where!r}: {done[0] or where!r} is already domain-parallel. "
                "Fix: parallelize a fresh single-device model (copy.deepcopy before the first call)"
            )
        if set(self.sizes) - {d for d, _ in self.split}:
            raise ParallelizeError(
                f"DomainParallel on {where!r}: sizes= names dims {sorted(self.sizes)} that dims= "
                f"does not split ({[d for d, _ in self.split]}). Fix: one entry per split dim"
            )
        for d, a in self.split:
            if d in self.sizes and len(self.sizes[d]) != mesh.axis_size(a):
                raise ParallelizeError(
                    f"DomainParallel on {where!r}: sizes[{d}]={list(self.sizes[d])} has "
                    f"{len(self.sizes[d])} blocks for the {mesh.axis_size(a)} ranks of {a!r}. "
                    "Fix: one block size per rank"
                )
        if self.output == "split" and self.sizes and mesh.backend is None:
            raise ParallelizeError(
                f"DomainParallel on {where!r}: output='split' with uneven blocks on simulated "
                "ranks would return blocks padded to one shape. Fix: output='gather', or real "
                "ranks (fastdist.connect)"
            )
        if self.attention not in ("gather", "ring"):
            raise ParallelizeError(
                f"DomainParallel on {where!r}: attention={self.attention!r}. Fix: 'gather' or "
                "'ring'"
            )
        if self.output not in ("gather", "split"):
            raise ParallelizeError(
                f"DomainParallel on {where!r}: output={self.output!r}. Fix: 'gather' or 'split'"
            )
        bad = []
        skip: list[str] = []
        for sub_name, sub in module.named_modules():
            if any(sub_name.startswith(s + ".") for s in skip):
                continue
            kind, why = classify(sub, self.local)
            if why is not None:
                full = ".".join(p for p in (name, sub_name) if p)
                bad.append(f"{full or where!r} ({type(sub).__name__}): {why}")
                skip.append(sub_name)
        for pad_name, pad in folded_pads(module)[1]:
            full = ".".join(p for p in (name, pad_name) if p)
            bad.append(
                f"{full!r} ({type(pad).__name__}): a zero padding is built only right before a "
                "Conv1d/2d/3d with padding_mode='zeros' in an nn.Sequential (folded into its "
                "halo). Fix: pad through the convolution's padding="
            )
        if bad:
            more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
            raise ParallelizeError(
                f"DomainParallel on {where!r} cannot split these modules over "
                f"{dict(self.split)}: " + "; ".join(bad[:3]) + more
            )

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        mesh = ctx.mesh
        # convolutions that take a padding before them: diffusers' Downsample2D's F.pad, a
        # ZeroPad2d before them in a Sequential
        folds = folded_pads(module)[0]
        where = name or type(module).__name__
        guard = Guard(mesh, self.split, where)
        recompute = Recompute(guard, where)  # checkpointed modules re-enter in the backward
        for sub_name, sub in module.named_modules():
            if sub is not module:
                recompute.install(sub, ".".join(p for p in (name, sub_name) if p))
            kind, _ = classify(sub, self.local)
            if is_diffusers_downsample(sub):
                folds[id(getattr(sub, "conv"))] = DOWNSAMPLE_PADS  # noqa: B009
            full = ".".join(p for p in (name, sub_name) if p) or type(module).__name__
            pads = folds.get(id(sub))
            site = Site(
                mesh, self.split, f"{full!r} ({type(sub).__name__})", pads, self.batch_axes,
                self.attention,
            )  # fmt: skip
            forward = domain_forward(kind, site, sub)
            if forward is not None:
                sub.forward = forward
                _watch(guard, sub, kind, site.where)
            for pname, _ in sub.named_parameters(recurse=False):
                ctx.pvary.append((sub, pname, self.axes))  # type: ignore[arg-type]
        ctx.axes.extend(self.axes)
        module.__dict__[_DONE] = True
        # eager under torch.compile (why: fastdist.nn.domain.compiled's doc)
        module.forward = _eager_when_traced(module.forward)
        module.register_forward_pre_hook(
            _eager_when_traced(functools.partial(_enter, self, mesh, guard, where)),
            with_kwargs=True,
        )
        module.register_forward_hook(
            _eager_when_traced(functools.partial(_leave, self, mesh, guard)), always_call=True
        )
        return module


def _eager_when_traced(fn: Any) -> Any:
    """``fn``, run eagerly (one graph break) when dynamo traces it: a domain-parallel region's
    pre-hook, forward and hook (why: `fastdist.nn.domain.compiled`)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            from fastdist.nn.domain.compiled import region_outside_the_graph

            return region_outside_the_graph(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    return run


def _watch(guard: Guard, sub: nn.Module, kind: str, where: str) -> None:
    """The guard's check before a layer the style runs (its input's split dims where the field
    has them), and after it (a split dim folded into the batch kept)."""
    sub.register_forward_pre_hook(
        lambda m, args, kwargs: guard.check_layer(kind, where, args, kwargs), with_kwargs=True
    )
    if kind != "attention":
        sub.register_forward_hook(lambda m, args, out: guard.after_layer(args, out))


def _enter(
    style: DomainParallel,
    mesh: Mesh,
    guard: Guard,
    where: str,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook: the field cut to this rank's block; the functional guard on."""
    key = style.input or next((k for k in _FIELD_NAMES if k in kwargs), None)
    if style.input is None and args:
        args = (_cut(args[0], style, mesh, where), *args[1:])
    elif key is not None and key in kwargs:
        kwargs = {**kwargs, key: _cut(kwargs[key], style, mesh, where)}
    else:
        raise ParallelizeError(
            f"DomainParallel on {where!r}: called without the field (no positional argument and "
            f"none of {', '.join(_FIELD_NAMES)}). Fix: pass it first, or name it with input="
        )
    # the other inputs are whole on every rank: no split rows (a timestep, a text embedding)
    positional = args[1:] if style.input is None and args else args
    block = args[0] if style.input is None and args else kwargs[str(key)]  # cut above
    guard.mark_clean([*positional, *(v for k, v in kwargs.items() if k != key)], block)
    state = region()
    state.pooled.clear()
    state.ragged.clear()
    # a block of one row along a split axis (real ranks, uneven: any rank's, so that all agree;
    # simulated ones hold blocks padded to the largest)
    real = mesh.backend is not None
    state.thin = {
        a
        for d, a in style.split
        if min(style.sizes.get(d, []) if real else [], default=block.shape[d]) == 1
    }
    if mesh.backend is None:
        state.ragged.update(style.sizes)
    guard.__enter__()  # type: ignore[no-untyped-call]
    guard.active = True
    state.depth += 1
    state.frames.append(saved_hooks_top())
    return args, kwargs


def _cut(field: Any, style: DomainParallel, mesh: Mesh, where: str) -> Tensor:
    """This rank's block of the whole field (the same on every rank): even blocks, or on real
    ranks the blocks of ``style.sizes``."""
    x, split = field, style.split
    need = 2 + max(-d for d, _ in split)  # [N, C, *spatial]: the layers and the guard's layout
    if not isinstance(x, Tensor) or x.dim() < need:
        raise ParallelizeError(
            f"DomainParallel on {where!r}: the field is {type(x).__name__} "
            f"{tuple(getattr(x, 'shape', ()))}, not a batched [N, C, *spatial] tensor of at "
            f"least {need} dims holding the split dims {[d for d, _ in split]} (an unbatched "
            "field's split dims are not where the layers, the functional guard and the output's "
            "gather look for them: its output would be left split, its reductions unchecked). "
            "Fix: pass field.unsqueeze(0) (a batch of one) and take the output's [0]"
        )
    for d, axis in split:
        n = mesh.axis_size(axis)
        sizes = style.sizes.get(d)
        if sizes is not None:
            if sum(sizes) != x.shape[d]:
                raise ParallelizeError(
                    f"DomainParallel on {where!r}: sizes[{d}]={list(sizes)} add up to "
                    f"{sum(sizes)} rows, the field has {x.shape[d]}. Fix: blocks that tile it"
                )
            if mesh.backend is None:
                x = _cut_padded(x, mesh, axis, x.dim() + d, sizes)
            else:
                x = ChunkV.apply(x, mesh, axis, x.dim() + d, sizes)  # type: ignore[no-untyped-call]
            continue
        if x.shape[d] % n:
            raise ParallelizeError(
                f"DomainParallel on {where!r}: dim {d} of the field has {x.shape[d]} rows, not "
                f"divisible by the {n} ranks of {axis!r}. Fix: a length divisible by {n} (times "
                "the strides of the layers on the way), or sizes= (uneven blocks)"
            )
        x = local_chunk(x, mesh, axis, x.dim() + d)
    block: Tensor = x
    return block


def _cut_padded(x: Tensor, mesh: Mesh, axis: str, dim: int, sizes: Sequence[int]) -> Tensor:
    """Simulated ranks, uneven blocks: rank ``i``'s ``sizes[i]`` rows of the replicated ``x``
    along ``dim``, then zero rows up to ``max(sizes)``. Every rank's padded block is laid out
    once (``[n * max(sizes)]`` rows, the same on every rank) and ``local_chunk`` takes this
    rank's: in backward every rank's copy of ``x`` gets the whole gradient."""
    top, length = max(sizes), x.shape[dim]
    pick = [
        start + j if j < rows else length  # row `length`: the zero row appended below
        for start, rows in zip(itertools.accumulate([0, *sizes[:-1]]), sizes, strict=True)
        for j in range(top)
    ]
    zero = x.new_zeros(*x.shape[:dim], 1, *x.shape[dim + 1 :])
    laid = torch.cat([x, zero], dim).index_select(dim, torch.tensor(pick, device=x.device))
    block: Tensor = local_chunk(laid, mesh, axis, dim)  # [..., max(sizes), ...]
    return block


def _gather_padded(y: Tensor, mesh: Mesh, axis: str, dim: int, where: str) -> Tensor:
    """Simulated ranks, uneven blocks padded to one shape: every rank's valid rows of ``y``
    along ``dim``, concatenated (the whole domain's, the same on every rank)."""
    rows = y.shape[dim]
    sizes = ragged_sizes(mesh, axis, dim - y.dim(), rows, where)
    assert sizes is not None
    laid = all_gather_invariant(y, mesh, axis, dim)  # [..., n * rows, ...]
    pick = [i * rows + j for i, r in enumerate(sizes) for j in range(r)]
    return laid.index_select(dim, torch.tensor(pick, device=y.device))


class ChunkV(torch.autograd.Function):
    """This rank's rows ``sizes[i]`` of a replicated tensor along ``dim`` (real ranks); backward:
    the gradient of every rank's rows gathered (``all_gather_v``), so every rank's copy of the
    input gets the whole gradient (``local_chunk``'s rule, uneven)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, mesh: Mesh, axis: str, dim: int, sizes: Any) -> Tensor:
        ctx.mesh, ctx.axis, ctx.dim, ctx.sizes = mesh, axis, dim, sizes
        i = int(axis_index(mesh, axis))
        block: Tensor = x.narrow(dim, sum(sizes[:i]), sizes[i]).clone()
        return block

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        whole = all_gather_v(g.contiguous(), ctx.mesh, ctx.axis, ctx.sizes, ctx.dim)
        return whole, None, None, None, None


class GatherV(torch.autograd.Function):
    """Every rank's uneven block concatenated along ``dim`` for a replicated consumer (real
    ranks); backward: this rank's rows of the gradient (``all_gather_invariant``'s rule,
    uneven)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, mesh: Mesh, axis: str, dim: int, sizes: Any) -> Tensor:
        i = int(axis_index(mesh, axis))
        ctx.dim, ctx.start, ctx.rows = dim, sum(sizes[:i]), sizes[i]
        return all_gather_v(x.contiguous(), mesh, axis, sizes, dim)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        return g.narrow(ctx.dim, ctx.start, ctx.rows).contiguous(), None, None, None, None


def _leave(
    style: DomainParallel, mesh: Mesh, guard: Guard, module: nn.Module, args: Any, out: Any
) -> Any:
    """Forward hook: the guard off (when the pre-hook got to turn it on); the output gathered
    (``output="gather"``)."""
    if not guard.active:  # the pre-hook raised before entering
        return out
    guard.active = False
    state = region()
    state.depth -= 1
    if state.frames:
        state.frames.pop()
    guard.__exit__(None, None, None)  # type: ignore[no-untyped-call]
    pooled = frozenset(state.pooled)
    thin = frozenset(state.thin)
    state.pooled.clear()
    state.thin.clear()
    try:
        guard.check_output(out)
        if style.output == "split":
            return out
        return _gather_tree(out, style.split, mesh, bool(style.sizes), pooled, thin)
    finally:
        state.ragged.clear()


def _gather_tree(
    out: Any,
    split: Split,
    mesh: Mesh,
    uneven: bool,
    pooled: frozenset[str] = frozenset(),
    thin: frozenset[str] = frozenset(),
) -> Any:
    """Every tensor of ``out`` that holds the split dims, gathered along them (``uneven``: each
    rank's rows told to the others first); one row along an axis a global pooling reduced
    (``pooled``) is already the whole, the same on every rank (``pmean``: its gradient counted
    once)."""
    if isinstance(out, Tensor):
        if out.dim() < 2 + max(-d for d, _ in split):
            return out
        for d, axis in split:
            dim = out.dim() + d
            if axis in pooled and out.shape[dim] == 1:
                if axis in thin:  # a rank's one-row block, or the pooled whole?
                    raise one_row_ambiguity("the region's output", d, axis)
                out = pmean(out, mesh, axis)
                continue
            if not uneven:
                out = all_gather_invariant(out, mesh, axis, dim)
                continue
            if mesh.backend is None:
                if d in region().ragged:
                    out = _gather_padded(out, mesh, axis, dim, "the region's output")
                else:
                    out = all_gather_invariant(out, mesh, axis, dim)
                continue
            rows = all_gather(out.new_tensor([float(out.shape[dim])]), mesh, axis)
            sizes = [int(r) for r in rows.tolist()]
            out = GatherV.apply(out, mesh, axis, dim, sizes)  # type: ignore[no-untyped-call]
        return out
    if isinstance(out, (tuple, list)):
        return type(out)(_gather_tree(v, split, mesh, uneven, pooled, thin) for v in out)
    if hasattr(out, "keys") and hasattr(out, "__setitem__"):  # dicts, diffusers' BaseOutput
        for k in list(out.keys()):
            out[k] = _gather_tree(out[k], split, mesh, uneven, pooled, thin)
    return out
