"""Linear and vocabulary styles: `ColwiseParallel`, `RowwiseParallel` (``nn.Linear`` and Hugging
Face ``Conv1D``, fused parts, padding), `VocabParallel` (an embedding or an LM head), and the
modules they put in place (`ParallelLinear`, `ScaledVocabParallelEmbedding`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.core.sharding import P
from fastdist.errors import ParallelizeError
from fastdist.nn.layers import VocabParallelEmbedding, column_input, linear
from fastdist.nn.state import Layout
from fastdist.nn.styles.base import Style, StyleContext, runs_whole
from fastdist.ops import all_gather_invariant, psum, psum_scatter, pvary

__all__ = [
    "InputKind",
    "ParallelLinear",
    "ColwiseParallel",
    "RowwiseParallel",
    "VocabParallel",
    "ScaledVocabParallelEmbedding",
    "linear_parts",
]

#: how a column-parallel layer prepares its input (``None``: the parent module already did)
InputKind = Literal["replicated", "sequence"] | None


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
        whole = runs_whole(self)  # sequence parallelism on the whole sequence (whole_sequence)
        if self.kind == "col":
            if self.input is not None:
                split = self.input == "sequence" and not whole
                x = column_input(x, self.mesh, self.axis, split, self.seq_dim)
            y = linear(x, w, self.bias)  # (..., out/n)
            if self.gather_output:
                y = all_gather_invariant(y, self.mesh, self.axis, dim=-1)  # (..., out padded)
                if self.size is not None:
                    y = y.narrow(-1, 0, self.size)  # drop the padding columns
            return y
        y = F.linear(x, w)  # (..., out): this rank's partial sum
        if self.output == "sequence" and not whole:
            y = psum_scatter(y, self.mesh, self.axis, dim=self.seq_dim)  # summed, my sequence shard
            # meets per-rank rows
            bias = pvary(self.bias, self.mesh, self.axis) if self.bias is not None else None
            if bias is None and _may_be_view(y):
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


def _may_be_view(y: Tensor) -> bool:
    """Whether ``y`` (a collective's output) may be a view at some level, which autograd forbids
    modifying in place when a custom function made it: under ``torch.compile`` (not looked at),
    or a view on any of its functorch levels (a simulated rank's tensor wraps the stacked one).
    Otherwise ``y`` is the collective's own fresh result, which the caller may modify in place."""
    if torch.compiler.is_compiling():
        return True
    functorch: Any = torch._C._functorch
    while True:
        if y._is_view():
            return True
        if not (functorch.is_batchedtensor(y) or functorch.is_gradtrackingtensor(y)):
            return False
        y = functorch.get_unwrapped(y)


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


def linear_parts(
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
        weight, bias, transposed, _, out = linear_parts(
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

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        weight, bias, transposed, wl, bl, size = self._layouts(module, name, ctx.mesh)
        return _parallel_linear(
            ctx,
            name,
            (weight, bias, transposed, wl, bl),
            self.axis,
            kind="col",
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
        parts: the sizes of inputs joined side by side (a DiT's single-stream ``proj_out`` over
            ``[attention output; MLP hidden]``, each column-parallel on its own), each split on
            its own.
    """

    axis: str = "tp"
    output: Literal["replicated", "sequence"] = "replicated"
    seq_dim: int = 1
    parts: tuple[int, ...] = ()

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        weight, _, transposed, inp, _ = linear_parts(
            module, name, f"{type(self).__name__}(axis={self.axis!r})"
        )
        if inp % mesh.axis_size(self.axis):
            raise ParallelizeError(
                f"parallelize: {name!r} has {inp} input features, not divisible by the "
                f"{mesh.axis_size(self.axis)} ranks of {self.axis!r}. "
                f"Fix: a tp size that divides {inp}"
            )
        self._layout(transposed).local_shape(tuple(weight.shape), mesh, f"{name}.weight")

    def _layout(self, transposed: bool) -> Layout:
        """The weight's layout: its input features (of each part) over ``axis``."""
        return Layout(P(self.axis, None) if transposed else P(None, self.axis), parts=self.parts)

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        self.check(module, name, ctx.mesh)
        weight, bias, transposed, _, _ = linear_parts(
            module, name, f"{type(self).__name__}(axis={self.axis!r})"
        )
        wl, bl = self._layout(transposed), Layout()
        return _parallel_linear(
            ctx,
            name,
            (weight, bias, transposed, wl, bl),
            self.axis,
            kind="row",
            output=self.output,
            seq_dim=self.seq_dim,
        )


def _parallel_linear(
    ctx: StyleContext,
    name: str,
    parts: tuple[Any, Any, bool, Layout, Layout],
    axis: str,
    **opts: Any,
) -> ParallelLinear:
    """The ``ParallelLinear`` replacing the linear layer ``name``: ``parts`` its weight, bias,
    whether the weight is stored transposed, and their layouts; ``opts`` the kind's options."""
    weight, bias, transposed, wl, bl = parts
    return ParallelLinear(
        ctx.param(weight, wl, f"{name}.weight", linear_weight=not transposed),  # type: ignore[arg-type]
        ctx.param(bias, bl, f"{name}.bias"),
        ctx.mesh,
        axis,
        transposed=transposed,
        layouts={"weight": wl, "bias": bl},
        **opts,
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

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
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
        if self.gather_output:
            ctx.gathered_logits = self.axis
        else:
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
