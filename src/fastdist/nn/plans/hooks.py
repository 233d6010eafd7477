"""The code some family rows need where data cannot say it, each a named hook a row references:
DeepSeek's multi-head latent attention (`LatentAttention`, `latent_attention`), the MoE block on
the whole sequence inside a sequence-parallel region (`SequenceGather`), the config-dependent
fields of Falcon and StableLM (`falcon_variant`, `stablelm_variant`), which layers of
Qwen-MoE and DeepSeek hold experts (`qwen_moe_layers`, `deepseek_moe_layers`), and the refusal of
outputs a tensor-parallel plan would return a rank's part of (`RefusePartialOutputs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.styles import (
    ColwiseParallel,
    GatherSequence,
    PrepareInput,
    PvaryParams,
    RowwiseParallel,
    Style,
    StyleContext,
    get_child,
    linear_parts,
    runs_whole,
    swap_child,
)
from fastdist.ops import local_chunk

__all__ = [
    "LatentAttention",
    "RefusePartialOutputs",
    "SequenceGather",
    "deepseek_moe_layers",
    "falcon_variant",
    "latent_attention",
    "qwen_moe_layers",
    "refuse",
    "stablelm_variant",
]


# ============================================================================ styles
@dataclass(frozen=True)
class LatentAttention(Style):
    """DeepSeek-V2/V3's multi-head latent attention with its heads split over ``axis``.

    The module's own forward runs on this rank's heads. Split by heads (column-parallel):
    ``q_proj`` (no q LoRA) or ``q_b_proj``, and ``kv_b_proj`` (each head's no-rope key and
    value); row-parallel: ``o_proj``. Replicated: the latent projections ``q_a_proj``,
    ``kv_a_proj_with_mqa`` (whose rope part is one key shared by every head) and their norms
    ``q_a_layernorm``/``kv_a_layernorm``: every rank computes the latents of its tokens
    (small: ``q_lora_rank + kv_lora_rank + qk_rope_head_dim`` features) and their parameters
    are pvary'd, so each gets the gradient summed over its heads' ranks. The input is
    prepared once (pvary; backward all-reduce), the output summed over ``axis``.
    ``num_heads`` becomes this rank's heads.
    """

    num_heads: int
    axis: str = "tp"
    input: Literal["replicated", "sequence"] = "replicated"
    output: Literal["replicated", "sequence"] = "replicated"

    def _sizes(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        n = mesh.axis_size(self.axis)
        h = self.num_heads
        if h % n:
            raise ParallelizeError(
                f"parallelize: attention {name!r} has {h} heads, not divisible by the {n} ranks "
                f"of {self.axis!r}. Fix: a tp size that divides {h}"
            )
        q = "q_proj" if getattr(module, "q_proj", None) is not None else "q_b_proj"
        for child, side in ((q, "out"), ("kv_b_proj", "out"), ("o_proj", "in")):
            _, _, _, inp, out = linear_parts(get_child(module, child, name), f"{name}.{child}")
            size = out if side == "out" else inp
            if size % h:
                raise ParallelizeError(
                    f"parallelize: attention {name!r}: {child} has {size} {side}put features, "
                    f"not a multiple of the style's {h} heads. Fix: build the plan from this "
                    "model's own config"
                )
        get_child(module, "kv_a_proj_with_mqa", name)

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        self._sizes(module, name, mesh)

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        self._sizes(module, name, ctx.mesh)
        ax = self.axis
        PrepareInput(ax, self.input).apply(module, name, ctx)
        col = ColwiseParallel(ax)
        for child in ("q_proj", "q_b_proj", "kv_b_proj"):
            sub = getattr(module, child, None)
            if isinstance(sub, nn.Module):
                swap_child(module, child, col.apply(sub, f"{name}.{child}", ctx))
        o = RowwiseParallel(ax, self.output).apply(
            get_child(module, "o_proj", name), f"{name}.o_proj", ctx
        )
        swap_child(module, "o_proj", o)
        for child in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
            sub = getattr(module, child, None)
            if isinstance(sub, nn.Module):
                PvaryParams(ax).apply(sub, f"{name}.{child}", ctx)
        setattr(module, "num_heads", self.num_heads // ctx.mesh.axis_size(ax))  # noqa: B010
        return module


@dataclass(frozen=True)
class SequenceGather(Style):
    """A module that runs on the whole sequence inside a sequence-parallel region (a mixture of
    experts block: its router and experts take replicated tokens): its input hidden states are
    all-gathered over ``axis`` (backward: this rank's slice of the gradient), its output (or
    the output's first element, for a block returning a tuple) cut back to this rank's
    sequence shard (backward: all-gather).
    """

    axis: str = "tp"
    seq_dim: int = 1

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        mesh, axis, dim = ctx.mesh, self.axis, self.seq_dim
        GatherSequence(axis, dim).apply(module, name, ctx)

        def shard(mod: nn.Module, args: Any, out: Any) -> Any:
            if runs_whole(mod):  # the whole sequence on every rank (whole_sequence)
                return out
            if isinstance(out, tuple):
                return (local_chunk(out[0], mesh, axis, dim=dim), *out[1:])
            return local_chunk(out, mesh, axis, dim=dim)

        module.register_forward_hook(shard)
        return module


@dataclass(frozen=True)
class RefusePartialOutputs(Style):
    """On a tensor-parallel plan's base model: refuse, at the call, the outputs each rank would
    hold only its part of: ``output_attentions`` (every attention's weights are the rank's heads,
    ``heads=True``) and, with Megatron sequence parallelism (``sequence=True``),
    ``output_hidden_states`` (every layer's hidden states but the last are the rank's sequence
    shard). A call's own argument wins over the model config's default, as in transformers.
    """

    axis: str = "tp"
    plan: str = "tensor-parallel"
    heads: bool = True
    sequence: bool = False

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        module.register_forward_pre_hook(self._refuse, with_kwargs=True)
        return module

    def _refuse(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        config = getattr(module, "config", None)
        for arg, on, what, fix in (
            (
                "output_attentions",
                self.heads,
                "each attention's weights of this rank's heads",
                "the weights of every head need the unparallelized model",
            ),
            (
                "output_hidden_states",
                self.sequence,
                "every layer's hidden states but the last as this rank's sequence shard",
                "or a plan without sequence_parallel (its hidden states are whole)",
            ),
        ):
            asked = kwargs.get(arg)
            if asked is None:
                asked = getattr(config, arg, False)
            if on and asked:
                raise ParallelizeError(
                    f"{type(module).__name__}: {arg}=True under the {self.plan} plan over "
                    f"{self.axis!r} would return {what} only, not the model's. Fix: leave "
                    f"{arg} unset (and False in the model config); {fix}"
                )


# ============================================================================ row hooks
def latent_attention(
    config: Any, axis: str, seq: Literal["replicated", "sequence"]
) -> LatentAttention:
    """DeepSeek's attention style: `LatentAttention` over ``axis``."""
    return LatentAttention(config.num_attention_heads, axis, seq, seq)


def refuse(family: str, why: str, fix: str) -> None:
    """Raise the `ParallelizeError` of a family's plan that cannot split this model."""
    raise ParallelizeError(
        f"parallelize: the {family} plan cannot split this model ({why}). Fix: {fix}"
    )


def falcon_variant(config: Any) -> Mapping[str, Any]:
    """Falcon's layouts: the new decoder architecture (``query_key_value`` grouped by kv head),
    multi-query (``[q heads | k | v]``, one kv head) or the original per-head one; its norms by
    ``parallel_attn``/``num_ln_in_parallel_attn``. ALiBi is refused: its bias is built for
    every head outside the attention."""
    if getattr(config, "alibi", False):
        refuse(
            "Falcon",
            "alibi=True: the model builds the ALiBi bias for all heads and each attention "
            "views it by its own head count",
            "a Falcon with rotary positions (alibi=False), or keep the attention replicated "
            "(a plan without the self_attention entry)",
        )
    out: dict[str, Any]
    if config.new_decoder_architecture:
        out = {"kv_heads": "num_kv_heads", "qkv_layout": "grouped"}
    elif config.multi_query:
        out = {"kv_heads": 1, "qkv_layout": "concat"}
    else:
        out = {"kv_heads": None, "qkv_layout": "per_head"}
    if not config.parallel_attn:
        out["norms"] = ("input_layernorm", "post_attention_layernorm")
    elif config.num_ln_in_parallel_attn == 2 or (
        config.num_ln_in_parallel_attn is None and config.new_decoder_architecture
    ):
        out["norms"] = ("ln_attn", "ln_mlp")
    else:
        out["norms"] = ("input_layernorm",)
    return out


def stablelm_variant(config: Any) -> Mapping[str, Any]:
    """StableLM: per-head q/k LayerNorm lists with ``qk_layernorm``; no second norm with
    ``use_parallel_residual``."""
    qk = (("q_layernorm", "q"), ("k_layernorm", "k")) if config.qk_layernorm else ()
    norms: tuple[str, ...] = ("input_layernorm",)
    if not config.use_parallel_residual:
        norms += ("post_attention_layernorm",)
    return {"head_norm_lists": qk, "norms": norms}


def qwen_moe_layers(config: Any) -> list[int]:
    """Qwen-MoE's layers with experts: every ``decoder_sparse_step``-th, but ``mlp_only_layers``."""
    dense = getattr(config, "mlp_only_layers", None) or []
    return [
        i
        for i in range(config.num_hidden_layers)
        if i not in dense and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
    ]


def deepseek_moe_layers(config: Any) -> list[int]:
    """DeepSeek's layers with experts: all but the first ``first_k_dense_replace``."""
    count = config.num_hidden_layers
    first = min(int(getattr(config, "first_k_dense_replace", 0) or 0), count)
    return list(range(first, count))
