"""The styles a ``parallelize`` plan maps module names to: how one module of an unmodified model is
parallelized.

``ColwiseParallel`` / ``RowwiseParallel`` (``nn.Linear`` and Hugging Face ``Conv1D``, fused parts,
padding), ``VocabParallel`` (embedding or LM head), ``HeadParallelAttention`` (the model's own
attention on this rank's heads), and the input styles ``SequenceShard``, ``GatherSequence``,
``PrepareInput`` and ``PvaryParams``. Each style's ``apply`` swaps or hooks one module in place;
:func:`fastdist.nn.parallelize` walks the model and applies them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..collectives import all_gather_invariant, axis_index, local_chunk, psum, psum_scatter, pvary
from ..errors import MeshError
from ..mesh import Mesh
from ..sharding import P
from .layers import VocabParallelEmbedding, _column_input, _linear
from .state import Layout

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
        else:
            y, bias = psum(y, self.mesh, self.axis), self.bias
        return y + bias if bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"{self.kind}, axis={self.axis!r}, "
            f"weight={tuple(self.weight.shape)}{', transposed' if self.transposed else ''}"
        )


def _plain_forward(module: nn.Module, base: type[nn.Module], name: str) -> None:
    """Refuse a subclass with its own forward (Gemma's scaled embedding): swapping it would drop
    what that forward adds."""
    if type(module).forward is not base.forward:
        raise ParallelizeError(
            f"parallelize: {name!r} is a {type(module).__name__}, a {base.__name__} subclass with "
            f"its own forward; the parallel layer would compute a plain {base.__name__} and "
            "silently drop what that forward adds (e.g. a scale). Fix: wrap the module's extra "
            "computation around a plain layer, or write a style for this class"
        )


def _linear_parts(module: nn.Module, name: str) -> tuple[Tensor, Tensor | None, bool, int, int]:
    """(weight, bias, transposed, in_features, out_features) of an ``nn.Linear`` or ``Conv1D``."""
    if isinstance(module, nn.Linear):
        _plain_forward(module, nn.Linear, name)
        return module.weight, module.bias, False, module.in_features, module.out_features
    if _is_conv1d(module):
        w, b = cast(Tensor, module.weight), cast("Tensor | None", getattr(module, "bias", None))
        return w, b, True, int(w.shape[0]), int(w.shape[1])
    raise ParallelizeError(
        f"parallelize: {name!r} is a {type(module).__name__}; a linear style needs nn.Linear or "
        "transformers' Conv1D"
    )


@dataclass(frozen=True)
class ColwiseParallel(Style):
    """Split a linear layer's output features over ``axis`` (Megatron's column parallel).

    ``input``: how the layer prepares its input (see `ParallelLinear`); ``None`` when
    the parent already did (`PrepareInput`, shared by q/k/v or gate/up).
    ``parts``: fused projections side by side (GPT-2's ``c_attn``: q, k, v), each split on
    its own. ``pad``: pad the output features to a multiple of the axis size (a vocabulary).
    ``gather_output``: all-gather the outputs (padding dropped).
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
        weight, bias, transposed, _, out = _linear_parts(module, name)
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
    """

    axis: str = "tp"
    output: Literal["replicated", "sequence"] = "replicated"
    seq_dim: int = 1

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        _, _, _, inp, _ = _linear_parts(module, name)
        if inp % mesh.axis_size(self.axis):
            raise ParallelizeError(
                f"parallelize: {name!r} has {inp} input features, not divisible by the "
                f"{mesh.axis_size(self.axis)} ranks of {self.axis!r}. "
                f"Fix: a tp size that divides {inp}"
            )

    def apply(self, module: nn.Module, name: str, ctx: _Context) -> nn.Module:
        self.check(module, name, ctx.mesh)
        weight, bias, transposed, _, _ = _linear_parts(module, name)
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
    """

    axis: str = "tp"
    input: InputKind = "replicated"
    gather_output: bool = False
    seq_dim: int = 1

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
            return self._head().check(module, name, mesh)
        _plain_forward(module, nn.Embedding, name)
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ParallelizeError(
                f"parallelize: {name!r} uses max_norm / scale_grad_by_freq / sparse, which the "
                "vocabulary-parallel embedding does not implement"
            )

    def apply(self, module: nn.Module, name: str, ctx: _Context) -> nn.Module:
        self.check(module, name, ctx.mesh)
        if isinstance(module, nn.Embedding):
            emb = VocabParallelEmbedding(
                module.num_embeddings, 0, ctx.mesh, self.axis, padding_idx=module.padding_idx
            )  # weight set below
            emb.weight = ctx.param(module.weight, emb.param_layouts()["weight"], f"{name}.weight")  # type: ignore[assignment]
            return emb
        if not self.gather_output:
            ctx.sharded_logits = self.axis
        return self._head().apply(module, name, ctx)


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
    on the whole, replicated sequence (e.g. the final norm before a view by the whole length)."""

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
    summed over ``axis`` (without it every rank keeps only its shard's partial gradient)."""

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


@dataclass(frozen=True)
class HeadParallelAttention(Style):
    """An attention module with its heads split over ``axis`` (Megatron/vLLM tensor parallelism).

    The module's own forward runs unchanged on this rank's heads: its input is prepared once
    (``input``), ``q``/``k``/``v`` are column-parallel by heads (or one fused ``qkv`` with its
    three parts), ``ops`` is row-parallel (``output``). Grouped-query attention: with kv heads
    ``>= n`` both head counts must divide by ``n``; with fewer kv heads than ranks (``n % kv == 0``)
    every rank holds the kv projections whole and uses the head its query heads share, as
    Megatron and vLLM replicate kv heads. ``attrs`` maps module attribute names to what they
    must be per rank, computed from the local head counts (e.g. ``num_key_value_groups``).
    ``norms``: child modules with per-head parameters (Qwen3's ``q_norm``/``k_norm``), pvary'd.
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

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        n = mesh.axis_size(self.axis)
        self.local_heads(n, name)
        self._check_shapes(module, name)
        if self.qkv is not None and self.num_kv_heads < n:
            raise ParallelizeError(
                f"parallelize: attention {name!r} fuses q, k, v in {self.qkv!r} and has "
                f"{self.num_kv_heads} kv heads "
                f"for {n} ranks; a fused projection needs kv heads divisible by {n}"
            )
        for norm in self.norms:
            _child(module, norm, name)

    def apply(self, module: nn.Module, name: str, ctx: _Context) -> nn.Module:
        self.check(module, name, ctx.mesh)
        n = ctx.mesh.axis_size(self.axis)
        hq, hkv = self.local_heads(n, name)
        PrepareInput(self.axis, self.input, self.seq_dim).apply(module, name, ctx)
        col = ColwiseParallel(self.axis, seq_dim=self.seq_dim)
        if self.qkv is not None:
            q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            fused = ColwiseParallel(self.axis, parts=(q_out, kv_out, kv_out), seq_dim=self.seq_dim)
            _swap(
                module,
                self.qkv,
                fused.apply(_child(module, self.qkv, name), f"{name}.{self.qkv}", ctx),
            )
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
        for attr, value in self.attrs:
            setattr(module, attr, value(hq, hkv, self.head_dim))
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
