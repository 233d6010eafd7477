"""The styles a ``parallelize`` plan maps module names to: how one module of an unmodified model is
parallelized.

``ColwiseParallel`` / ``RowwiseParallel`` (``nn.Linear`` and Hugging Face ``Conv1D``, fused parts,
padding), ``VocabParallel`` (embedding or LM head), ``HeadParallelAttention`` (the model's own
attention on this rank's heads), and the input styles ``SequenceShard``, ``GatherSequence``,
``PrepareInput`` and ``PvaryParams``. Each style's ``apply`` swaps or hooks one module in place;
:func:`fastdist.nn.parallelize` walks the model and applies them.
"""

from __future__ import annotations

import copy
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.core.sharding import P
from fastdist.errors import MeshError
from fastdist.nn.layers import VocabParallelEmbedding, _column_input, _linear
from fastdist.nn.state import Layout
from fastdist.ops.collectives import (
    all_gather_invariant,
    axis_index,
    local_chunk,
    psum,
    psum_scatter,
    pvary,
)

__all__ = [
    "Style",
    "ColwiseParallel",
    "RowwiseParallel",
    "VocabParallel",
    "SequenceShard",
    "GatherSequence",
    "PrepareInput",
    "PvaryParams",
    "HeadParallelAttention",
    "ParallelizeError",
    "ParallelLinear",
    "HeadParams",
    "ScaledVocabParallelEmbedding",
]

InputKind = Literal["replicated", "sequence"] | None


class ParallelizeError(MeshError):
    """A plan does not fit the model: a pattern that matches nothing, a module of the wrong kind,
    heads that do not split."""


@dataclass
class _Context:
    """What styles share while one model is parallelized."""

    mesh: Mesh
    #: id(single-device parameter) -> its parallel replacement, so tied weights stay tied
    converted: dict[int, nn.Parameter] = field(default_factory=dict)
    #: parameter (module, name) pairs to pvary over these axes at every call
    pvary: list[tuple[nn.Module, str, str]] = field(default_factory=list)
    #: the axis of a vocabulary-parallel LM head that gives sharded logits (the loss must know)
    sharded_logits: str | None = None
    #: every axis a style split something over
    axes: list[str] = field(default_factory=list)

    def param(
        self, old: Tensor | None, layout: Layout, where: str, *, linear_weight: bool = False
    ) -> nn.Parameter | None:
        """The parallel parameter for single-device ``old`` (stacked over ranks on a simulated
        mesh).

        ``linear_weight``: an (out, in) weight that ``F.linear`` consumes. Stacked, it is stored
        (in, out)-contiguous and viewed as (out, in): the batched backward produces its gradient
        in that stride order, so gradient accumulation needs no copy (and the forward's batched
        matmul reads the transposed weight contiguously), as one device's ``mm`` does.
        """
        if old is None:
            return None
        if id(old) in self.converted:
            return self.converted[id(old)]
        full = old.detach()
        if full.is_meta:
            # a model built on the meta device: a meta shard of the local shape, no values (the
            # whole tensor is never made); ParallelModel.load / init_weights give it storage
            local = layout.local_shape(tuple(full.shape), self.mesh, where)
            stacked = self.mesh.backend is None
            data = torch.empty(
                (self.mesh.size, *local) if stacked else local, dtype=full.dtype, device="meta"
            )
            if stacked and linear_weight and data.dim() == 3:
                # as below: a [world, out, in] view of [world, in, out] memory
                data = data.transpose(1, 2).contiguous().transpose(1, 2)
        elif self.mesh.backend is None:
            data = torch.stack(
                [layout.shard(full, self.mesh, r, where) for r in range(self.mesh.size)]
            )  # [world, out, in]
            if linear_weight and data.dim() == 3:
                # [world, out, in] view of [world, in, out] memory
                data = data.transpose(1, 2).contiguous().transpose(1, 2)
        else:
            data = layout.shard(full, self.mesh, self.mesh.rank, where)
        new = nn.Parameter(data, requires_grad=old.requires_grad)
        self.converted[id(old)] = new
        return new


class Style:
    """How one module becomes parallel. ``apply`` returns the module to put in its place (possibly
    itself).

    ``check`` raises for a module the style cannot handle, changing nothing: ``parallelize``
    checks every match before it applies any, so a bad plan leaves the model as it was.
    """

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        pass

    def apply(self, module: nn.Module, name: str, ctx: _Context) -> nn.Module:
        raise NotImplementedError


def _hidden_hook(fn: Callable[[Tensor], Tensor]) -> Callable[..., Any]:
    """A forward pre-hook applying ``fn`` to a module's hidden states (first positional or
    ``hidden_states=``)."""

    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise ParallelizeError(
                f"parallelize: {type(module).__name__} was called without hidden states to prepare "
                "(no positional argument and no hidden_states=)"
            )
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}

    return hook


# ============================================================================ linear layers
def _is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): a linear layer that stores its weight as (in, out)."""
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and isinstance(getattr(module, "weight", None), Tensor)
    )


class ParallelLinear(nn.Module):
    """A column- or row-parallel linear layer built from an existing ``nn.Linear`` or ``Conv1D``.

    Keeps the parameter names (``weight``, ``bias``) and the weight's orientation: ``(out, in)``
    for ``nn.Linear``, ``(in, out)`` for ``Conv1D`` (``transposed``). Column: the output
    features are split (fused ``parts`` each on their own; a ``size`` padded to a multiple of
    the axis); the input is prepared by ``input`` (``"replicated"``: ``pvary``, backward
    all-reduces dx; ``"sequence"``: all-gather of the sequence dim, backward reduce-scatter;
    ``None``: already prepared by the parent module). Row: the input features are split, the
    partial products summed (``output="replicated"``: psum; ``"sequence"``: reduce-scatter of
    the sequence dim), and the bias added once after the sum.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        mesh: Mesh,
        axis: str,
        *,
        kind: Literal["col", "row"],
        transposed: bool,
        layouts: dict[str, Layout],
        input: InputKind = None,
        output: InputKind = "replicated",
        gather_output: bool = False,
        size: int | None = None,
        seq_dim: int = 1,
    ) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.mesh, self.axis, self.kind, self.transposed = mesh, axis, kind, transposed
        self.input, self.output, self.gather_output, self.size, self.seq_dim = (
            input,
            output,
            gather_output,
            size,
            seq_dim,
        )
        self._layouts = layouts

    def param_layouts(self) -> dict[str, Layout]:
        return dict(self._layouts) if self.bias is not None else {"weight": self._layouts["weight"]}

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight.t() if self.transposed else self.weight  # (out_local, in) either way
        if self.kind == "col":
            if self.input is not None:
                x = _column_input(x, self.mesh, self.axis, self.input == "sequence", self.seq_dim)
            y = _linear(x, w, self.bias)  # (..., out/n)
            if self.gather_output:
                y = all_gather_invariant(y, self.mesh, self.axis, dim=-1)  # (..., out padded)
                if self.size is not None:
                    y = y.narrow(-1, 0, self.size)  # drop the padding columns
            return y
        y = F.linear(x, w)  # (..., out): this rank's partial sum
        if self.output == "sequence":
            y = psum_scatter(y, self.mesh, self.axis, dim=self.seq_dim)  # summed, my sequence shard
            # meets per-rank rows
            bias = pvary(self.bias, self.mesh, self.axis) if self.bias is not None else None
            if bias is None:
                # the collective's output may be a view of its custom function's result, which
                # autograd forbids modifying in place (Falcon: mlp_output += attention_output)
                y = y.clone()
        else:
            y, bias = psum(y, self.mesh, self.axis), self.bias
        return y + bias if bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"{self.kind}, axis={self.axis!r}, "
            f"weight={tuple(self.weight.shape)}{', transposed' if self.transposed else ''}"
        )


#: ``nn.Linear`` subclasses whose own forward computes exactly ``F.linear`` (Falcon's
#: ``FalconLinear``: ``x @ weight.T + bias``): a parallel linear layer replaces them safely
_PLAIN_LINEAR_SUBCLASSES = frozenset({"FalconLinear"})


def _plain_forward(module: nn.Module, base: type[nn.Module], name: str) -> None:
    """Refuse a subclass with its own forward (Gemma's scaled embedding): swapping it would drop
    what that forward adds."""
    if type(module).forward is base.forward:
        return
    if base is nn.Linear and type(module).__name__ in _PLAIN_LINEAR_SUBCLASSES:
        return
    hint = (
        " (it has an 'embed_scale': VocabParallel(scale='embed_scale') multiplies by it)"
        if isinstance(module, nn.Embedding) and hasattr(module, "embed_scale")
        else ""
    )
    raise ParallelizeError(
        f"parallelize: {name!r} is a {type(module).__name__}, a {base.__name__} subclass with "
        f"its own forward; the parallel layer would compute a plain {base.__name__} and "
        "silently drop what that forward adds (e.g. a scale). Fix: wrap the module's extra "
        f"computation around a plain layer, or write a style for this class{hint}"
    )


def _linear_parts(
    module: nn.Module, name: str, style: str = "a linear style"
) -> tuple[Tensor, Tensor | None, bool, int, int]:
    """(weight, bias, transposed, in_features, out_features) of an ``nn.Linear`` or ``Conv1D``;
    ``style`` names the style in the error for another module type."""
    if isinstance(module, nn.Linear):
        _plain_forward(module, nn.Linear, name)
        return module.weight, module.bias, False, module.in_features, module.out_features
    if _is_conv1d(module):
        w, b = cast(Tensor, module.weight), cast("Tensor | None", getattr(module, "bias", None))
        return w, b, True, int(w.shape[0]), int(w.shape[1])
    raise ParallelizeError(
        f"parallelize: {name!r} is a {type(module).__name__}; {style} needs nn.Linear or "
        "transformers' Conv1D. Fix: give this style to the linear layers only (check the plan's "
        "module names against model.named_modules()), or write a style for this module type"
    )


@dataclass(frozen=True)
class ColwiseParallel(Style):
    """Split a linear layer's output features over ``axis`` (Megatron's column parallel).

    ``input``: how the layer prepares its input (see `ParallelLinear`); ``None`` when
    the parent already did (`PrepareInput`, shared by q/k/v or gate/up).
    ``parts``: fused projections side by side (GPT-2's ``c_attn``: q, k, v), each split on
    its own. ``pad``: pad the output features to a multiple of the axis size (a vocabulary).
    ``gather_output``: all-gather the outputs (padding dropped).

    Args:
        axis: the mesh axis the output features are split over.
        input: how the layer prepares its input: ``"replicated"`` (``pvary``; backward all-reduces
            dx), ``"sequence"`` (all-gather of the sequence dim) or ``None`` (the parent already
            did, with `PrepareInput`).
        parts: the sizes of fused projections side by side (GPT-2's ``c_attn``: q, k, v), each split
            on its own.
        pad: pad the output features to a multiple of the axis size (a vocabulary).
        gather_output: all-gather the outputs (padding dropped).
        seq_dim: the sequence dim of the hidden states.
    """

    axis: str = "tp"
    input: InputKind = None
    parts: tuple[int, ...] = ()
    pad: bool = False
    gather_output: bool = False
    seq_dim: int = 1

    def _layouts(
        self, module: nn.Module, name: str, mesh: Mesh
    ) -> tuple[Tensor, Tensor | None, bool, Layout, Layout, int | None]:
        """(weight, bias, transposed, weight layout, bias layout, padded size), or raise if the
        layer does not split."""
        weight, bias, transposed, _, out = _linear_parts(
            module, name, f"{type(self).__name__}(axis={self.axis!r})"
        )
        odim = 1 if transposed else 0  # the weight's output dim
        size = out if self.pad else None
        if not self.pad and not self.parts and out % mesh.axis_size(self.axis):
            raise ParallelizeError(
                f"parallelize: {name!r} has {out} output features, not divisible by the "
                f"{mesh.axis_size(self.axis)} ranks of {self.axis!r}. Fix: "
                "ColwiseParallel(pad=True) for a vocabulary, or another tp size"
            )
        wl = Layout(P(*([None] * odim), self.axis), parts=self.parts, size=size)
        wl.local_shape(tuple(weight.shape), mesh, f"{name}.weight")  # fused parts must split too
        return weight, bias, transposed, wl, Layout(P(self.axis), parts=self.parts, size=size), size

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        self._layouts(module, name, mesh)

    def apply(self, module: nn.Module, name: str, ctx: _Context) -> nn.Module:
        weight, bias, transposed, wl, bl, size = self._layouts(module, name, ctx.mesh)
        return ParallelLinear(
            ctx.param(weight, wl, f"{name}.weight", linear_weight=not transposed),  # type: ignore[arg-type]
            ctx.param(bias, bl, f"{name}.bias"),
            ctx.mesh,
            self.axis,
            kind="col",
            transposed=transposed,
            layouts={"weight": wl, "bias": bl},
            input=self.input,
            gather_output=self.gather_output,
            size=size,
            seq_dim=self.seq_dim,
        )


@dataclass(frozen=True)
class RowwiseParallel(Style):
    """Split a linear layer's input features over ``axis`` (Megatron's row parallel); bias added
    once after the sum.

    ``output="replicated"``: all-reduce (backward: identity); ``"sequence"``: reduce-scatter
    of the sequence dim (sequence parallelism; backward: all-gather).

    Args:
        axis: the mesh axis the input features are split over.
        output: ``"replicated"`` (all-reduce; backward: identity) or ``"sequence"`` (reduce-scatter
            of the sequence dim; backward: all-gather).
        seq_dim: the sequence dim of the hidden states.
    """

    axis: str = "tp"
    output: Literal["replicated", "sequence"] = "replicated"
    seq_dim: int = 1

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        _, _, _, inp, _ = _linear_parts(module, name, f"{type(self).__name__}(axis={self.axis!r})")
        if inp % mesh.axis_size(self.axis):
            raise ParallelizeError(
                f"parallelize: {name!r} has {inp} input features, not divisible by the "
                f"{mesh.axis_size(self.axis)} ranks of {self.axis!r}. "
                f"Fix: a tp size that divides {inp}"
            )

    def apply(self, module: nn.Module, name: str, ctx: _Context) -> nn.Module:
        self.check(module, name, ctx.mesh)
        weight, bias, transposed, _, _ = _linear_parts(
            module, name, f"{type(self).__name__}(axis={self.axis!r})"
        )
        wl = Layout(P(self.axis, None) if transposed else P(None, self.axis))
        bl = Layout()
        return ParallelLinear(
            ctx.param(weight, wl, f"{name}.weight", linear_weight=not transposed),  # type: ignore[arg-type]
            ctx.param(bias, bl, f"{name}.bias"),
            ctx.mesh,
            self.axis,
            kind="row",
            transposed=transposed,
            layouts={"weight": wl, "bias": bl},
            output=self.output,
            seq_dim=self.seq_dim,
        )


# ============================================================================ vocabulary
@dataclass(frozen=True)
class VocabParallel(Style):
    """The vocabulary over ``axis``: an ``nn.Embedding`` (rows) or an LM head ``nn.Linear`` (output
    features).

    The vocabulary is padded with zero rows to a multiple of the axis size (GPT-2's 50257).
    An LM head gives this rank's logits ``(..., V_padded / n)`` (padding columns are 0; losses
    take ``vocab_size`` to mask them: `fastdist.nn.cross_entropy`), or with
    ``gather_output`` the whole vocabulary ``(..., V)``. ``input``: how the head prepares its input.
    A head tied to the embedding stays tied (one parameter, both uses' gradients).

    Args:
        axis: the mesh axis the vocabulary is split over.
        input: how an LM head prepares its input (``"replicated"`` or ``"sequence"``).
        gather_output: give an LM head's logits for the whole vocabulary ``(..., V)``.
        seq_dim: the sequence dim of the hidden states.
        scale: the name of an embedding module's scale attribute (Gemma's ``embed_scale``) the
            output is multiplied by.
    """

    axis: str = "tp"
    input: InputKind = "replicated"
    gather_output: bool = False
    seq_dim: int = 1
    scale: str | None = None

    def _head(self) -> ColwiseParallel:
        return ColwiseParallel(
            self.axis,
            input=self.input,
            pad=True,
            gather_output=self.gather_output,
            seq_dim=self.seq_dim,
        )

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        if not isinstance(module, nn.Embedding):
            if self.scale is not None:
                raise ParallelizeError(
                    f"parallelize: VocabParallel(scale={self.scale!r}) on {name!r}, a "
                    f"{type(module).__name__}: scale is for embeddings. Fix: drop scale= on the "
                    "LM head"
                )
            return self._head().check(module, name, mesh)
        if self.scale is None:
            _plain_forward(module, nn.Embedding, name)
        else:
            _check_scaled_embedding(module, name, self.scale)
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ParallelizeError(
                f"parallelize: {name!r} uses max_norm / scale_grad_by_freq / sparse, which the "
                "vocabulary-parallel embedding does not implement"
            )

    def apply(self, module: nn.Module, name: str, ctx: _Context) -> nn.Module:
        self.check(module, name, ctx.mesh)
        if isinstance(module, nn.Embedding):
            emb = (
                VocabParallelEmbedding(
                    module.num_embeddings, 0, ctx.mesh, self.axis, padding_idx=module.padding_idx
                )
                if self.scale is None
                else ScaledVocabParallelEmbedding(
                    module.num_embeddings,
                    ctx.mesh,
                    self.axis,
                    getattr(module, self.scale),
                    self.scale,
                    padding_idx=module.padding_idx,
                )
            )  # weight set below
            emb.weight = ctx.param(module.weight, emb.param_layouts()["weight"], f"{name}.weight")  # type: ignore[assignment]
            return emb
        if not self.gather_output:
            ctx.sharded_logits = self.axis
        return self._head().apply(module, name, ctx)


def _check_scaled_embedding(module: nn.Embedding, name: str, scale: str) -> None:
    """``module(ids)`` must be ``embedding(ids) * module.<scale>`` (Gemma's
    ``GemmaTextScaledWordEmbedding``): checked on two rows where the weights have values."""
    value = getattr(module, scale, None)
    if not isinstance(value, (Tensor, int, float)) or (
        isinstance(value, Tensor) and value.numel() != 1
    ):
        raise ParallelizeError(
            f"parallelize: VocabParallel(scale={scale!r}) on {name!r} "
            f"({type(module).__name__}): the module has no scalar attribute {scale!r} "
            f"(found {type(value).__name__}). Fix: name the attribute its forward multiplies by"
        )
    if module.weight.is_meta or (isinstance(value, Tensor) and value.is_meta):
        return  # no values to compare (a model built on the meta device)
    ids = torch.tensor([0, module.num_embeddings - 1], device=module.weight.device)
    with torch.no_grad():
        got = module(ids)  # (2, dim)
        want = F.embedding(ids, module.weight) * torch.as_tensor(value).to(module.weight.dtype)
    if not torch.equal(got, want):
        raise ParallelizeError(
            f"parallelize: {name!r} ({type(module).__name__}) does not compute "
            f"embedding(ids) * {scale} (rows 0 and {module.num_embeddings - 1} differ); the "
            "scaled vocabulary-parallel embedding would change its output. Fix: write a style "
            "for this class"
        )


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """A `VocabParallelEmbedding` whose output is multiplied by the module's own scale (Gemma's
    ``embed_scale = sqrt(hidden_size)``), in the weight's dtype as the single-device module does;
    the scale keeps its attribute name (a buffer stays a buffer)."""

    def __init__(
        self,
        num_embeddings: int,
        mesh: Mesh,
        axis: str,
        value: Any,
        attr: str = "embed_scale",
        *,
        padding_idx: int | None = None,
    ) -> None:
        super().__init__(num_embeddings, 0, mesh, axis, padding_idx=padding_idx)
        self._scale_attr = attr
        if isinstance(value, Tensor):
            self.register_buffer(attr, value, persistent=False)
        else:
            setattr(self, attr, value)

    def forward(self, ids: Tensor) -> Tensor:
        scale = torch.as_tensor(getattr(self, self._scale_attr))
        return super().forward(ids) * scale.to(self.weight.dtype)


# ============================================================================ regions
class _InputHook(Style):
    """A style that transforms the module's input hidden states with one collective (a forward
    pre-hook)."""

    axis: str
    seq_dim: int

    def prepare(self, x: Tensor, mesh: Mesh) -> Tensor:
        raise NotImplementedError

    def apply(self, module: nn.Module, name: str, ctx: _Context) -> nn.Module:
        mesh = ctx.mesh
        module.register_forward_pre_hook(
            _hidden_hook(lambda x: self.prepare(x, mesh)), with_kwargs=True
        )
        return module


@dataclass(frozen=True)
class SequenceShard(_InputHook):
    """Cut the module's input hidden states to this rank's sequence shard (forward: slice;
    backward: all-gather).

    Megatron-style sequence parallelism starts here (the first decoder layer): the model
    computes positions and masks from the whole sequence before it.

    Args:
        axis: the mesh axis the sequence is split over.
        seq_dim: the sequence dim of the hidden states.
    """

    axis: str = "tp"
    seq_dim: int = 1

    def prepare(self, x: Tensor, mesh: Mesh) -> Tensor:
        n = mesh.axis_size(self.axis)
        if x.shape[self.seq_dim] % n:
            raise ParallelizeError(
                f"sequence parallelism over {self.axis!r}: the sequence (dim {self.seq_dim} of "
                f"shape {tuple(x.shape)}) does not divide by the {n} ranks. Fix: "
                f"pad the batch to a multiple of {n} tokens (padding masked with attention_mask "
                "and labels=-100)"
            )
        return local_chunk(x, mesh, self.axis, dim=self.seq_dim)


@dataclass(frozen=True)
class GatherSequence(_InputHook):
    """Gather the module's input hidden states from the sequence shards (forward: all-gather;
    backward: this rank's slice): the end of a sequence-parallel region. The module then runs
    on the whole, replicated sequence (e.g. the final norm before a view by the whole length).

    Args:
        axis: the mesh axis the sequence is split over.
        seq_dim: the sequence dim of the hidden states.
    """

    axis: str = "tp"
    seq_dim: int = 1

    def prepare(self, x: Tensor, mesh: Mesh) -> Tensor:
        return all_gather_invariant(x, mesh, self.axis, dim=self.seq_dim)


@dataclass(frozen=True)
class PrepareInput(_InputHook):
    """The input collective of the column-parallel layers inside the module, run once for all of
    them.

    ``"replicated"``: ``pvary`` (backward all-reduces dx); ``"sequence"``: all-gather of the
    sequence dim (backward reduce-scatter), so the module sees the whole sequence.

    Args:
        axis: the mesh axis of the column-parallel layers inside the module.
        kind: ``"replicated"`` (``pvary``; backward all-reduces dx) or ``"sequence"`` (all-gather of
            the sequence dim; backward reduce-scatter).
        seq_dim: the sequence dim of the hidden states.
    """

    axis: str = "tp"
    kind: Literal["replicated", "sequence"] = "replicated"
    seq_dim: int = 1

    def prepare(self, x: Tensor, mesh: Mesh) -> Tensor:
        return _column_input(x, mesh, self.axis, self.kind == "sequence", self.seq_dim)


@dataclass(frozen=True)
class PvaryParams(Style):
    """The module's replicated parameters meet rank-varying data (a norm on a sequence shard, a
    per-head norm on a head shard): ``pvary`` them at every call, so each rank's gradient is
    summed over ``axis`` (without it every rank keeps only its shard's partial gradient).

    Args:
        axis: the mesh axis the data the parameters meet varies over.
    """

    axis: str = "tp"

    def apply(self, module: nn.Module, name: str, ctx: _Context) -> nn.Module:
        ctx.pvary.extend((module, n, self.axis) for n, _ in module.named_parameters(recurse=False))
        return module


# ============================================================================ attention
class _ReplicatedHeads(nn.Module):
    """k or v projection with fewer heads than ranks: every rank holds all ``heads`` (replicated)
    and projects only the head its query heads use (head ``rank // (n / heads)``). The weight is
    ``pvary``'d: each rank's gradient touches its head's rows, the sum over ranks is the whole
    gradient."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        mesh: Mesh,
        axis: str,
        heads: int,
        transposed: bool,
    ) -> None:
        super().__init__()
        self.weight, self.bias, self.mesh, self.axis, self.heads, self.transposed = (
            weight,
            bias,
            mesh,
            axis,
            heads,
            transposed,
        )

    def forward(self, x: Tensor) -> Tensor:
        n = self.mesh.axis_size(self.axis)
        head = axis_index(self.mesh, self.axis) // (n // self.heads)  # () my kv head
        w = pvary(self.weight, self.mesh, self.axis)
        w = w.t() if self.transposed else w  # (heads * head_dim, in)
        w = w.reshape(self.heads, -1, w.shape[-1])[head]  # (heads, head_dim, in) -> (head_dim, in)
        b = (
            pvary(self.bias, self.mesh, self.axis).reshape(self.heads, -1)[head]
            if self.bias is not None
            else None
        )  # (head_dim,)
        return F.linear(x, w, b)  # (..., head_dim)


# ---------------------------------------------------------------------------- per-rank attributes
#: attribute / config names holding the query head count, patched to the local count
_Q_HEAD_NAMES = ("num_heads", "num_attention_heads", "n_head", "n_heads")
#: ... the kv head count
_KV_HEAD_NAMES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv")
#: ... query heads per kv head
_GROUP_NAMES = ("num_key_value_groups", "num_kv_groups")
#: integers an attention reads that are never head counts or split widths, even when their value
#: equals one (a layer index, the head dim)
_NOT_COUNTS = frozenset(
    {
        "layer_idx",
        "head_dim",
        "head_size",
        "rotary_ndims",
        "max_position_embeddings",
        "sliding_window",
    }
)


def _reads(cls: type) -> tuple[set[str], set[str]]:
    """(``self.X`` attributes, ``self.config.X`` fields) that ``cls``'s methods other than
    ``__init__`` read, plus ``module.X`` reads of functions in its source file (transformers'
    ``eager_attention_forward(module, ...)``); empty where the source cannot be read."""
    attrs: set[str] = set()
    fields: set[str] = set()
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            break
        for key, fn in vars(klass).items():
            if key == "__init__" or not callable(fn):
                continue
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            fields |= set(re.findall(r"\bself\.config\.(\w+)", src))
            attrs |= set(re.findall(r"\bself\.(\w+)", src))
        try:
            text = inspect.getsource(sys.modules[klass.__module__])
        except (OSError, TypeError, KeyError):
            continue
        attrs |= set(re.findall(r"\bmodule\.(\w+)", text))
        fields |= set(re.findall(r"\bmodule\.config\.(\w+)", text))
    return attrs, fields


@dataclass(frozen=True)
class _PerRank:
    """What an attention module must see on each rank: attribute values and config fields."""

    attrs: dict[str, Any]
    config: dict[str, Any]


# ---------------------------------------------------------------------------- fused q|k|v rows
QkvLayout = Literal["concat", "per_head", "grouped"]


def _qkv_rows(
    layout: QkvLayout, hq: int, hkv: int, d: int, n: int, r: int, hl: int, kl: int
) -> list[int]:
    """The rows of a fused q|k|v weight that rank ``r`` projects, in the order the module's forward
    expects for ``hl`` query and ``kl`` kv heads.

    ``concat``: ``[q heads | k heads | v heads]`` (Phi-3's ``qkv_proj``, Falcon's multi-query);
    ``per_head``: ``(heads, 3, d)`` (GPT-NeoX, Falcon's original layout); ``grouped``:
    ``(kv heads, q per kv + 2, d)``, each kv head after its query heads (Falcon's new decoder).
    """
    qh = range(r * hl, (r + 1) * hl)
    kvh = range(r * kl, (r + 1) * kl) if hkv >= n else range(r // (n // hkv), r // (n // hkv) + 1)
    if layout == "per_head":
        return [h * 3 * d + j for h in qh for j in range(3 * d)]
    if layout == "concat":
        q = [h * d + j for h in qh for j in range(d)]
        ks = [hq * d + h * d + j for h in kvh for j in range(d)]
        vs = [(hq + hkv) * d + h * d + j for h in kvh for j in range(d)]
        return q + ks + vs
    g = hq // hkv  # query heads per kv head
    rows: list[int] = []
    for k in kvh:
        for h in (h for h in qh if h // g == k):
            rows += [(k * (g + 2) + h % g) * d + j for j in range(d)]
        rows += [(k * (g + 2) + g + s) * d + j for s in (0, 1) for j in range(d)]
    return rows


class _FusedRows(nn.Module):
    """A fused q|k|v projection whose rows for one rank are not one block of its weight (kv heads
    fewer than ranks): every rank holds the weight whole and projects only its heads' rows
    (``rows[rank]``). The weight is ``pvary``'d: each rank's gradient touches its rows, the sum
    over ranks is the whole gradient (kv rows shared by several ranks get each one's part)."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        mesh: Mesh,
        axis: str,
        rows: list[list[int]],
        transposed: bool,
    ) -> None:
        super().__init__()
        self.weight, self.bias, self.mesh, self.axis = weight, bias, mesh, axis
        self.rows, self.transposed = rows, transposed

    def forward(self, x: Tensor) -> Tensor:
        table = torch.tensor(self.rows, device=self.weight.device)  # (ranks, local_out)
        idx = table[axis_index(self.mesh, self.axis).to(self.weight.device)]  # (local_out,)
        w = pvary(self.weight, self.mesh, self.axis)
        w = w.t() if self.transposed else w  # (out, in)
        b = pvary(self.bias, self.mesh, self.axis)[idx] if self.bias is not None else None
        return F.linear(x, w[idx], b)  # (..., local_out)

    def extra_repr(self) -> str:
        return (
            f"axis={self.axis!r}, weight={tuple(self.weight.shape)} replicated, "
            f"{len(self.rows[0])} rows per rank"
        )


# ---------------------------------------------------------------------------- q/k norms
def _my_heads(mesh: Mesh, axis: str, heads: int, local: int) -> Tensor:
    """This rank's head indices (``local`` of ``heads``; one shared head when heads < ranks)."""
    n = mesh.axis_size(axis)
    r = axis_index(mesh, axis)
    if heads >= n:
        return r * local + torch.arange(local, device=r.device)  # (local,)
    return (r // (n // heads)).reshape(1)  # (1,)


class _FullWidthRMSNorm(nn.Module):
    """An RMSNorm over a projection's whole width (OLMo-2's ``q_norm``/``k_norm``: all heads
    together) on this rank's heads: the sum of squares is summed over ``axis`` (``psum``, then
    ``pvary`` so each rank's gradient reaches every rank's share of the statistics). Computed
    in float32 and cast back, as ``Olmo2RMSNorm`` does. ``weight``: this rank's columns; with
    heads fewer than ranks (replicated kv heads) the whole weight, of which each rank uses its
    head's slice, and each head's share counted once."""

    def __init__(
        self,
        weight: nn.Parameter,
        eps: float,
        mesh: Mesh,
        axis: str,
        width: int,
        heads: int,
        head_dim: int,
        layout: Layout,
    ) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = weight, eps
        self.mesh, self.axis, self.width, self.heads, self.head_dim = (
            mesh,
            axis,
            width,
            heads,
            head_dim,
        )
        self._layout = layout

    def param_layouts(self) -> dict[str, Layout]:
        return {"weight": self._layout}

    def forward(self, x: Tensor) -> Tensor:
        n = self.mesh.axis_size(self.axis)
        dtype = x.dtype
        h = x.to(torch.float32)  # (..., local width)
        ss = h.pow(2).sum(-1, keepdim=True)  # (..., 1): my heads' share
        w: Tensor = self.weight  # (local width,)
        copies = 1
        if self.heads < n:  # my one head: every head is held by n / heads ranks
            head = _my_heads(self.mesh, self.axis, self.heads, 1)
            w = pvary(self.weight, self.mesh, self.axis).reshape(self.heads, self.head_dim)[head]
            w, copies = w.reshape(-1), n // self.heads  # (1, head_dim) -> (head_dim,)
        total = pvary(psum(ss, self.mesh, self.axis), self.mesh, self.axis)  # (..., 1)
        var = total / (self.width * copies)
        return (w * (h * torch.rsqrt(var + self.variance_epsilon))).to(dtype)

    def extra_repr(self) -> str:
        return f"width={self.width} over {self.axis!r}, eps={self.variance_epsilon}"


def _rms_eps(module: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps"):
        value = getattr(module, attr, None)
        if isinstance(value, float):
            return value
    return None


def _check_full_width_norm(module: nn.Module, name: str, width: int) -> float:
    """``module`` must be ``weight * x / rms(x)`` over ``width`` in float32; returns its eps."""
    weight = getattr(module, "weight", None)
    eps = _rms_eps(module)
    if not isinstance(weight, Tensor) or tuple(weight.shape) != (width,) or eps is None:
        raise ParallelizeError(
            f"parallelize: {name!r} ({type(module).__name__}) is not an RMSNorm over the whole "
            f"{width} features of its projection (a weight of shape ({width},) and an eps). Fix: "
            "list it in HeadParallelAttention(norms=...) if it normalises each head, or write a "
            "style for it"
        )
    if weight.is_meta:
        return eps
    x = torch.randn(2, width, dtype=weight.dtype, generator=torch.Generator().manual_seed(0)).to(
        weight.device
    )
    with torch.no_grad():
        h = x.float()
        want = (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)
        got = module(x)
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        raise ParallelizeError(
            f"parallelize: {name!r} ({type(module).__name__}) does not compute "
            "weight * x * rsqrt(mean(x**2) + eps) over its whole width; splitting its heads "
            "would change it. Fix: write a style for this norm"
        )
    return eps


class _HeadNormList(nn.Module):
    """A per-head list of LayerNorms (StableLM's ``StableLmLayerNormPerHead``: ``norms[h]`` for
    head ``h`` of a ``(batch, heads, seq, head_dim)`` input) on this rank's heads. Every rank
    holds the whole list (the same parameter names) and applies its heads' norms; the
    parameters are ``pvary``'d, so their gradients sum over ranks."""

    def __init__(self, norms: nn.ModuleList, mesh: Mesh, axis: str, heads: int, local: int):
        super().__init__()
        self.norms, self.mesh, self.axis, self.heads, self.local = norms, mesh, axis, heads, local
        first = cast(nn.LayerNorm, norms[0])
        self.eps, self.dim = first.eps, first.normalized_shape

    def forward(self, x: Tensor) -> Tensor:
        idx = _my_heads(self.mesh, self.axis, self.heads, self.local)  # (local,)
        y = F.layer_norm(x, self.dim, None, None, self.eps)  # (batch, local, seq, head_dim)
        first = cast(nn.LayerNorm, self.norms[0])
        if first.weight is not None:
            w = torch.stack([cast(Tensor, m.weight) for m in self.norms])  # (heads, head_dim)
            y = y * pvary(w, self.mesh, self.axis)[idx][None, :, None, :]
        if first.bias is not None:
            b = torch.stack([cast(Tensor, m.bias) for m in self.norms])  # (heads, head_dim)
            y = y + pvary(b, self.mesh, self.axis)[idx][None, :, None, :]
        return y


def _check_head_norm_list(module: nn.Module, name: str, heads: int) -> None:
    norms = getattr(module, "norms", None)
    ok = (
        isinstance(norms, nn.ModuleList)
        and len(norms) == heads
        and all(type(m) is nn.LayerNorm for m in norms)
    )
    if not ok:
        raise ParallelizeError(
            f"parallelize: {name!r} ({type(module).__name__}) is not a list of {heads} per-head "
            "nn.LayerNorm modules in .norms. Fix: list per-head norms with one shared weight in "
            "HeadParallelAttention(norms=...), or write a style for it"
        )
    first = cast(nn.LayerNorm, cast(nn.ModuleList, norms)[0])
    if first.weight is None or first.weight.is_meta:
        return
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, heads, 2, first.normalized_shape[0], generator=g, dtype=first.weight.dtype)
    x = x.to(first.weight.device)
    with torch.no_grad():
        got = module(x)
        want = torch.cat([m(x[:, h : h + 1]) for h, m in enumerate(cast(nn.ModuleList, norms))], 1)
    if not torch.allclose(got, want):
        raise ParallelizeError(
            f"parallelize: {name!r} ({type(module).__name__}) does not apply norms[h] to head h "
            "of a (batch, heads, seq, head_dim) input. Fix: write a style for it"
        )


@dataclass(frozen=True)
class HeadParallelAttention(Style):
    """An attention module with its heads split over ``axis`` (Megatron/vLLM tensor parallelism).

    The module's own forward runs unchanged on this rank's heads: its input is prepared once
    (``input``), ``q``/``k``/``v`` are column-parallel by heads (or one fused ``qkv`` laid out
    as ``qkv_layout``), ``o`` is row-parallel (``output``). Grouped-query attention: with kv
    heads ``>= n`` both head counts must divide by ``n``; with fewer kv heads than ranks
    (``n % kv == 0``) every rank holds the kv projections whole and uses the head its query
    heads share, as Megatron and vLLM replicate kv heads (a fused ``qkv`` is then held whole
    and each rank projects its heads' rows).

    ``qkv_layout``: ``"concat"`` (``[q | k | v]``: GPT-2's ``c_attn``, Phi-3's ``qkv_proj``),
    ``"per_head"`` (``(heads, 3, head_dim)``: GPT-NeoX's ``query_key_value``) or ``"grouped"``
    (``(kv heads, q per kv + 2, head_dim)``: Falcon's new decoder architecture).

    Per-rank attributes: the forward must see this rank's head counts. Attributes with a
    head-count name (``num_heads``, ``num_key_value_heads``, ``num_kv_heads``,
    ``num_key_value_groups``, ...) holding the whole model's value are set to the local
    value; a ``config`` whose head-count fields the module's methods read
    (``self.config.num_attention_heads``: Phi-3) is replaced by a shallow copy with the local
    values, for this module only (the user's config object and other modules keep theirs).
    ``attrs`` maps further attribute names to what they must be per rank, computed from
    the local head counts and head dim (e.g. GPT-2's ``split_size``). An integer attribute
    the module's methods read whose value is a whole-model head count or split width, and
    that none of these covers, is refused (``ParallelizeError``: name it in ``attrs``, or in
    ``keep`` if it is not a head count).

    ``norms``: child modules with per-head parameters shared by all heads (Qwen3's
    ``q_norm``/``k_norm``), pvary'd. ``full_width_norms``: ``(child, "q" | "k")`` RMSNorms over
    the projection's whole width (OLMo-2): their statistics are summed over ``axis``.
    ``head_norm_lists``: ``(child, "q" | "k")`` lists of one LayerNorm per head (StableLM's
    ``q_layernorm``/``k_layernorm``): each rank applies its heads' norms.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    axis: str = "tp"
    input: Literal["replicated", "sequence"] = "replicated"
    output: Literal["replicated", "sequence"] = "replicated"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    qkv: str | None = None
    attrs: tuple[tuple[str, Callable[[int, int, int], Any]], ...] = ()
    norms: tuple[str, ...] = ()
    seq_dim: int = 1
    qkv_layout: QkvLayout = "concat"
    full_width_norms: tuple[tuple[str, Literal["q", "k"]], ...] = ()
    head_norm_lists: tuple[tuple[str, Literal["q", "k"]], ...] = ()
    keep: tuple[str, ...] = ()
    head_params: tuple[str, ...] = ()

    def local_heads(self, n: int, name: str) -> tuple[int, int]:
        """(query heads, kv heads) on one rank; raises for a layout that does not split."""
        hq, hkv = self.num_heads, self.num_kv_heads
        if hq % n or hq % hkv:
            raise ParallelizeError(
                f"parallelize: attention {name!r} has {hq} query heads and {hkv} kv heads; with "
                f"{n} ranks on {self.axis!r} the query heads "
                f"must divide by {n} and by the kv heads. Fix: a tp size that divides {hq}"
            )
        if hkv >= n and hkv % n == 0:
            return hq // n, hkv // n
        if hkv < n and n % hkv == 0:
            return hq // n, 1
        raise ParallelizeError(
            f"parallelize: attention {name!r} has {hkv} kv heads, which neither divide by the {n} "
            f"ranks of {self.axis!r} nor divide them. "
            f"Fix: a tp size that divides {hkv} or is a multiple of it"
        )

    def _check_shapes(self, module: nn.Module, name: str) -> None:
        """The projections' sizes must be what the head counts say (a plan built from another
        config would split wrongly)."""
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        want = (
            {self.qkv: ("out", q_out + 2 * kv_out)}
            if self.qkv is not None
            else {self.q: ("out", q_out), self.k: ("out", kv_out), self.v: ("out", kv_out)}
        )
        want[self.o] = ("in", q_out)
        for child, (side, size) in want.items():
            _, _, _, inp, out = _linear_parts(_child(module, child, name), f"{name}.{child}")
            if (out if side == "out" else inp) != size:
                raise ParallelizeError(
                    f"parallelize: attention {name!r}: {child} has {out if side == 'out' else inp} "
                    f"{side}put features, but the style's {self.num_heads} query heads, "
                    f"{self.num_kv_heads} kv heads and head_dim {self.head_dim} say {size}. Fix: "
                    "build the plan from this model's own config"
                )

    def per_rank(self, module: nn.Module, name: str, n: int) -> _PerRank:
        """The attribute values and config fields ``module`` must see on each rank; raises for
        an attribute that holds a whole-model head count or width and that nothing covers."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        hl, kl = self.local_heads(n, name)
        known: dict[str, tuple[int, int]] = {}  # name -> (whole-model value, local value)
        known.update({a: (hq, hl) for a in _Q_HEAD_NAMES})
        known.update({a: (hkv, kl) for a in _KV_HEAD_NAMES})
        known.update({a: (hq // hkv, hl // kl) for a in _GROUP_NAMES})
        # whole-model values that differ on a rank -> what they are
        changed: dict[int, str] = {}
        for v, lv, what in (
            (hq, hl, "query heads"),
            (hkv, kl, "kv heads"),
            (hq // hkv, hl // kl, "query heads per kv head"),
            (hq * d, hl * d, "query width (heads x head_dim)"),
            (hkv * d, kl * d, "kv width"),
            ((hq + 2 * hkv) * d, (hl + 2 * kl) * d, "fused q|k|v width"),
        ):
            if v != lv:
                changed.setdefault(v, what)
        given = {attr: fn(hl, kl, d) for attr, fn in self.attrs}
        attrs: dict[str, Any] = {}
        for attr, (whole, local) in known.items():
            value = getattr(module, attr, None)
            if attr in given or type(value) is not int:
                continue
            if value != whole:
                raise ParallelizeError(
                    f"parallelize: attention {name!r} ({type(module).__name__}) has {attr} = "
                    f"{value}, but the style says {whole}. Fix: build the plan from this model's "
                    "own config"
                )
            attrs[attr] = local
        attrs.update(given)
        reads, fields = _reads(type(module))

        def refuse(where: str, attr: str, value: int) -> None:
            raise ParallelizeError(
                f"parallelize: attention {name!r} ({type(module).__name__}) reads {where}{attr} "
                f"= {value}, the whole model's {changed[value]}, which is not what a rank holds "
                f"once the heads are split over the {n} ranks of {self.axis!r}; left as is, the "
                "model would fail or compute something else. Fix: "
                f"HeadParallelAttention(..., attrs=(({attr!r}, lambda hq, hkv, d: ...),)) with "
                f"its per-rank value, or keep=({attr!r},) if it is not a head count or width"
            )

        self._check_children(module, name, n, changed)
        skip = _NOT_COUNTS | set(self.keep) | set(attrs)
        for attr in sorted(reads - skip):
            value = getattr(module, attr, None)
            if type(value) is int and value in changed:
                refuse("self.", attr, value)
        config: dict[str, Any] = {}
        cfg = getattr(module, "config", None)
        if cfg is not None and not isinstance(cfg, nn.Module) and hasattr(cfg, "__dict__"):
            for field_name in sorted(fields - _NOT_COUNTS - set(self.keep)):
                value = getattr(cfg, field_name, None)
                if type(value) is not int:
                    continue
                if field_name in known and value == known[field_name][0]:
                    config[field_name] = known[field_name][1]
                elif value in changed:
                    refuse("self.config.", field_name, value)
            if config:  # the view's head counts agree with each other
                for field_name, (whole, local) in known.items():
                    if type(getattr(cfg, field_name, None)) is int:
                        if getattr(cfg, field_name) == whole and field_name not in self.keep:
                            config.setdefault(field_name, local)
        return _PerRank(attrs, config)

    def _check_children(
        self, module: nn.Module, name: str, n: int, changed: dict[int, str]
    ) -> None:
        """Refuse a child module the style leaves whole that is sized by the whole model's heads:
        a per-head module list (StableLM's ``q_layernorm``), a norm over the whole projection
        width (OLMo-2's ``q_norm``). Left whole, it would fail on a rank's heads or, worse,
        silently use the first heads' parameters on every rank."""
        handled = {self.q, self.k, self.v, self.o, *self.norms}
        handled |= {self.qkv} if self.qkv is not None else set()
        handled |= {c for c, _ in self.full_width_norms} | {c for c, _ in self.head_norm_lists}
        heads = {self.num_kv_heads: "k", self.num_heads: "q"}
        widths = {self.num_kv_heads * self.head_dim: "k", self.num_heads * self.head_dim: "q"}
        for pname, p in module.named_parameters(recurse=False):
            # the module's own per-head parameter (GPT-OSS's attention sinks), left whole
            if pname in self.head_params or pname in self.keep or p.dim() == 0:
                continue
            if p.shape[0] == self.num_heads and self.num_heads in changed:
                raise ParallelizeError(
                    f"parallelize: attention {name!r} ({type(module).__name__}): its own "
                    f"parameter {pname!r} {tuple(p.shape)} has one entry per query head, but each "
                    f"of the {n} ranks of {self.axis!r} holds only some heads; left whole it "
                    "would fail or apply the wrong heads' values. Fix: "
                    f"HeadParallelAttention(..., head_params=({pname!r},)) to split it with the "
                    f"heads, or keep=({pname!r},) if it is not per head"
                )
        for child, sub in module.named_children():
            if child in handled:
                continue
            lists = [len(m) for m in sub.children() if isinstance(m, nn.ModuleList)]
            sizes = [p.shape[0] for p in sub.parameters(recurse=False) if p.dim() == 1]
            per_head = [k for k in lists if k in heads and k in changed]
            full = [k for k in sizes if k in widths and k in changed]
            if per_head:
                which = heads[per_head[0]]
                fix = f"head_norm_lists=(({child!r}, {which!r}),) for one module per head"
            elif full:
                which = widths[full[0]]
                fix = f"full_width_norms=(({child!r}, {which!r}),) for an RMSNorm over the width"
            else:
                continue
            raise ParallelizeError(
                f"parallelize: attention {name!r} ({type(module).__name__}): its child "
                f"{child!r} ({type(sub).__name__}) is sized by the whole model's "
                f"{'query' if which == 'q' else 'kv'} heads, but each of the {n} ranks of "
                f"{self.axis!r} holds only some of them; left whole it would fail or apply "
                f"the wrong heads' parameters. Fix: HeadParallelAttention(..., {fix})"
            )

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        n = mesh.axis_size(self.axis)
        self.local_heads(n, name)
        self._check_shapes(module, name)
        if (
            self.qkv is not None
            and self.qkv_layout == "per_head"
            and (self.num_heads != self.num_kv_heads)
        ):
            raise ParallelizeError(
                f"parallelize: attention {name!r}: qkv_layout='per_head' needs as many kv heads "
                f"as query heads (got {self.num_heads} and {self.num_kv_heads}). Fix: "
                "qkv_layout='grouped' or 'concat'"
            )
        for norm in self.norms:
            _child(module, norm, name)
        for norm, which in self.full_width_norms:
            heads = self.num_heads if which == "q" else self.num_kv_heads
            _check_full_width_norm(
                _child(module, norm, name), f"{name}.{norm}", heads * self.head_dim
            )
        for norm, which in self.head_norm_lists:
            heads = self.num_heads if which == "q" else self.num_kv_heads
            _check_head_norm_list(_child(module, norm, name), f"{name}.{norm}", heads)
        self.per_rank(module, name, n)

    def _fused(self, module: nn.Module, name: str, ctx: _Context, n: int) -> nn.Module:
        """This rank's part of the fused q|k|v projection."""
        assert self.qkv is not None
        sub = _child(module, self.qkv, name)
        where = f"{name}.{self.qkv}"
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if hkv >= n:  # every rank's rows are one block of the weight
            if self.qkv_layout == "concat":
                parts = (hq * d, hkv * d, hkv * d)
                return ColwiseParallel(self.axis, parts=parts, seq_dim=self.seq_dim).apply(
                    sub, where, ctx
                )
            return ColwiseParallel(self.axis, seq_dim=self.seq_dim).apply(sub, where, ctx)
        hl, kl = self.local_heads(n, name)
        rows = [_qkv_rows(self.qkv_layout, hq, hkv, d, n, r, hl, kl) for r in range(n)]
        weight, bias, transposed, _, _ = _linear_parts(sub, where)
        return _FusedRows(
            ctx.param(weight, Layout(), f"{where}.weight"),  # type: ignore[arg-type]
            ctx.param(bias, Layout(), f"{where}.bias"),
            ctx.mesh,
            self.axis,
            rows,
            transposed,
        )

    def apply(self, module: nn.Module, name: str, ctx: _Context) -> nn.Module:
        self.check(module, name, ctx.mesh)
        n = ctx.mesh.axis_size(self.axis)
        hq, hkv = self.local_heads(n, name)
        per_rank = self.per_rank(module, name, n)
        PrepareInput(self.axis, self.input, self.seq_dim).apply(module, name, ctx)
        col = ColwiseParallel(self.axis, seq_dim=self.seq_dim)
        if self.qkv is not None:
            _swap(module, self.qkv, self._fused(module, name, ctx, n))
        else:
            _swap(module, self.q, col.apply(_child(module, self.q, name), f"{name}.{self.q}", ctx))
            for child in (self.k, self.v):
                sub = _child(module, child, name)
                if self.num_kv_heads >= n:
                    _swap(module, child, col.apply(sub, f"{name}.{child}", ctx))
                else:
                    weight, bias, transposed, _, _ = _linear_parts(sub, f"{name}.{child}")
                    _swap(
                        module,
                        child,
                        _ReplicatedHeads(
                            ctx.param(weight, Layout(), f"{name}.{child}.weight"),  # type: ignore[arg-type]
                            ctx.param(bias, Layout(), f"{name}.{child}.bias"),
                            ctx.mesh,
                            self.axis,
                            self.num_kv_heads,
                            transposed,
                        ),
                    )
        _swap(
            module,
            self.o,
            RowwiseParallel(self.axis, self.output, self.seq_dim).apply(
                _child(module, self.o, name), f"{name}.{self.o}", ctx
            ),
        )
        for norm in self.norms:
            PvaryParams(self.axis).apply(_child(module, norm, name), f"{name}.{norm}", ctx)
        for norm, which in self.full_width_norms:
            heads = self.num_heads if which == "q" else self.num_kv_heads
            sub = _child(module, norm, name)
            layout = Layout(P(self.axis)) if heads >= n else Layout()
            _swap(
                module,
                norm,
                _FullWidthRMSNorm(
                    ctx.param(cast(Tensor, sub.weight), layout, f"{name}.{norm}.weight"),  # type: ignore[arg-type]
                    cast(float, _rms_eps(sub)),
                    ctx.mesh,
                    self.axis,
                    heads * self.head_dim,
                    heads,
                    self.head_dim,
                    layout,
                ),
            )
        for norm, which in self.head_norm_lists:
            heads, local = (self.num_heads, hq) if which == "q" else (self.num_kv_heads, hkv)
            sub = _child(module, norm, name)
            _swap(
                module,
                norm,
                _HeadNormList(cast(nn.ModuleList, sub.norms), ctx.mesh, self.axis, heads, local),
            )
        if self.head_params:
            HeadParams(self.axis, self.head_params).apply(module, name, ctx)
        for attr, value in per_rank.attrs.items():
            setattr(module, attr, value)
        if per_rank.config:
            # a per-rank view: the user's config and the modules sharing it keep theirs
            view = copy.copy(module.config)
            for field_name, value in per_rank.config.items():
                setattr(view, field_name, value)
            module.config = view
        return module


@dataclass(frozen=True)
class HeadParams(Style):
    """Split the module's own per-head parameters (dim 0: one entry per head) over ``axis``, as
    its heads are split (GPT-OSS's attention ``sinks``). `HeadParallelAttention` applies it to
    its ``head_params``.

    >>> import torch, fastdist as fd
    >>> attn = torch.nn.Module()
    >>> attn.sinks = torch.nn.Parameter(torch.arange(4.0))
    >>> pm = fd.nn.parallelize(attn, fd.Mesh({"tp": 2}), {"": HeadParams("tp", ("sinks",))})
    >>> attn.sinks.tolist()                        # [rank, heads / 2]
    [[0.0, 1.0], [2.0, 3.0]]
    """

    axis: str = "tp"
    names: tuple[str, ...] = ("sinks",)

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        n = mesh.axis_size(self.axis)
        for pname in self.names:
            p = getattr(module, pname, None)
            if not isinstance(p, nn.Parameter) or p.dim() == 0:
                raise ParallelizeError(
                    f"parallelize: {name!r} ({type(module).__name__}) has no per-head parameter "
                    f"{pname!r}. Fix: name the module's own per-head parameters"
                )
            if p.shape[0] % n:
                raise ParallelizeError(
                    f"parallelize: {name}.{pname} has {p.shape[0]} heads, not divisible by the "
                    f"{n} ranks of {self.axis!r}. Fix: a {self.axis!r} size that divides "
                    f"{p.shape[0]}"
                )

    def apply(self, module: nn.Module, name: str, ctx: _Context) -> nn.Module:
        self.check(module, name, ctx.mesh)
        layout = Layout(P(self.axis))
        for pname in self.names:
            where = f"{name}.{pname}" if name else pname
            setattr(module, pname, ctx.param(getattr(module, pname), layout, where))
        # how they split (fastdist.nn.param_layouts reads a module's param_layouts()): an
        # instance attribute, so the model's own class stays as it is
        before = getattr(module, "param_layouts", None)
        own = dict.fromkeys(self.names, layout)

        def param_layouts() -> dict[str, Any]:
            return {**(before() if callable(before) else {}), **own}

        object.__setattr__(module, "param_layouts", param_layouts)
        return module


def _child(module: nn.Module, child: str, name: str) -> nn.Module:
    sub = getattr(module, child, None)
    if not isinstance(sub, nn.Module):
        raise ParallelizeError(
            f"parallelize: {name!r} ({type(module).__name__}) has no submodule {child!r}. Fix: "
            "name the projections of this attention class in the style (q=, k=, v=, o= or qkv=)"
        )
    return sub


def _swap(parent: nn.Module, child: str, new: nn.Module) -> None:
    if getattr(parent, child) is not new:
        setattr(parent, child, new)


# ============================================================================ the model
