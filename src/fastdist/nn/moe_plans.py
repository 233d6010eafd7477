"""Ready-made `fastdist.nn.parallelize` plans for the mixture-of-experts families of transformers.

Each function reads the model's config and returns a plain dict plan (print it, edit it); each
is registered in `fastdist.nn.plans.plan_for` by ``config.model_type``:

* `qwen2_moe`: ``Qwen2MoeForCausalLM``: Llama-style attention (q/k/v bias) by heads over
  ``axis``; routed experts over ``ep_axis`` (`fastdist.nn.moe.ExpertParallel`); the shared
  expert column/row-parallel over ``axis``; the router and ``shared_expert_gate`` replicated;
* `qwen3_moe`: ``Qwen3MoeForCausalLM``: as Qwen2-MoE without a shared expert, with per-head
  q/k norms;
* `olmoe`: ``OlmoeForCausalLM``: attention by heads with its whole-width ``q_norm``/``k_norm``
  (statistics summed over ``axis``); experts over ``ep_axis``;
* `deepseek_v2`, `deepseek_v3`: multi-head latent attention (`LatentAttention`): the per-head
  projections (``q_proj`` or ``q_b_proj``, ``kv_b_proj``, ``o_proj``) by heads over ``axis``,
  the latent projections (``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms) replicated;
  routed experts over ``ep_axis``, shared experts over ``axis``, the first
  ``first_k_dense_replace`` dense MLPs over ``axis``;
* `gpt_oss`: ``GptOssForCausalLM``: attention by heads with each rank's attention sinks
  (``head_params``), alternating sliding windows as the model computes them; its experts'
  transposed, interleaved, biased layout over ``ep_axis`` (and ``axis`` inside each expert).

* `mixtral`: ``MixtralForCausalLM`` (also `fastdist.nn.plans.mixtral`): attention by heads,
  experts over ``ep_axis``.

Every plan keeps the router replicated (one device's routing, ``router_logits`` and aux loss)
and makes the vocabulary parallel over ``axis`` as `fastdist.nn.plans.llama` does. With
``axis == ep_axis`` (a mesh with only ``ep``, or only ``tp``: `moe_plan_for`) the same ranks
are the attention's tensor-parallel group and the experts' group, and every expert is whole on
its rank. With ``sequence_parallel`` the norms and residuals sit on sequence shards of
``axis`` (Megatron) and each MoE block runs on the whole sequence (`SequenceGather`: its input
all-gathered, its output cut back), so routing and the aux loss stay one device's.
`fused_experts` reads ``save_pretrained`` checkpoints that store one tensor per expert.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.nn.moe import ExpertParallel, Strategy
from fastdist.nn.styles import (
    ColwiseParallel,
    GatherSequence,
    HeadParallelAttention,
    HeadParams,
    ParallelizeError,
    PrepareInput,
    PvaryParams,
    RowwiseParallel,
    SequenceShard,
    Style,
    VocabParallel,
    _child,
    _Context,
    _linear_parts,
    _swap,
)
from fastdist.ops.collectives import local_chunk

__all__ = [
    "FAMILIES",
    "HeadParams",
    "LatentAttention",
    "SequenceGather",
    "deepseek_v2",
    "deepseek_v3",
    "fused_experts",
    "gpt_oss",
    "mixtral",
    "moe_plan_for",
    "olmoe",
    "qwen2_moe",
    "qwen3_moe",
]

Plan = dict[str, Any]


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
            _, _, _, inp, out = _linear_parts(_child(module, child, name), f"{name}.{child}")
            size = out if side == "out" else inp
            if size % h:
                raise ParallelizeError(
                    f"parallelize: attention {name!r}: {child} has {size} {side}put features, "
                    f"not a multiple of the style's {h} heads. Fix: build the plan from this "
                    "model's own config"
                )
        _child(module, "kv_a_proj_with_mqa", name)

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        self._sizes(module, name, mesh)

    def apply(self, module: nn.Module, name: str, ctx: _Context) -> nn.Module:
        self._sizes(module, name, ctx.mesh)
        ax = self.axis
        PrepareInput(ax, self.input).apply(module, name, ctx)
        col = ColwiseParallel(ax)
        for child in ("q_proj", "q_b_proj", "kv_b_proj"):
            sub = getattr(module, child, None)
            if isinstance(sub, nn.Module):
                _swap(module, child, col.apply(sub, f"{name}.{child}", ctx))
        o = RowwiseParallel(ax, self.output).apply(
            _child(module, "o_proj", name), f"{name}.o_proj", ctx
        )
        _swap(module, "o_proj", o)
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

    def apply(self, module: nn.Module, name: str, ctx: _Context) -> nn.Module:
        mesh, axis, dim = ctx.mesh, self.axis, self.seq_dim
        GatherSequence(axis, dim).apply(module, name, ctx)

        def shard(mod: nn.Module, args: Any, out: Any) -> Any:
            if isinstance(out, tuple):
                return (local_chunk(out[0], mesh, axis, dim=dim), *out[1:])
            return local_chunk(out, mesh, axis, dim=dim)

        module.register_forward_hook(shard)
        return module


# ============================================================================ plan pieces
def _config(model_or_config: Any) -> Any:
    return getattr(model_or_config, "config", model_or_config)


def _seq(sequence_parallel: bool) -> Literal["replicated", "sequence"]:
    return "sequence" if sequence_parallel else "replicated"


def _sequence_parallel(
    plan: Plan, axis: str, prefix: str, sequence_parallel: bool, moe_layers: list[str]
) -> Plan:
    """Megatron-style sequence parallelism from the first decoder layer to the final norm: the
    norms on sequence shards (pvary'd), the MoE blocks on the whole sequence
    (`SequenceGather`)."""
    if sequence_parallel:
        plan[f"{prefix}.layers.0"] = SequenceShard(axis)
        plan[f"{prefix}.norm"] = GatherSequence(axis)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            plan[f"{prefix}.layers.*.{norm}"] = PvaryParams(axis)
        for layer in moe_layers:
            plan[f"{layer}.mlp"] = SequenceGather(axis)
    return plan


def _layer_patterns(prefix: str, which: list[int], layers: int) -> list[str]:
    """The patterns naming decoder layers ``which``: ``layers.*`` when that is all of them."""
    if len(which) == layers:
        return [f"{prefix}.layers.*"]
    return [f"{prefix}.layers.{i}" for i in which]


def _dense_mlp(layer: str, axis: str, mlp: str = "mlp", seq: Any = "replicated") -> Plan:
    """A gated MLP (gate/up column-parallel, down row-parallel) over ``axis``."""
    return {
        f"{layer}.{mlp}": PrepareInput(axis, seq),
        f"{layer}.{mlp}.gate_proj": ColwiseParallel(axis),
        f"{layer}.{mlp}.up_proj": ColwiseParallel(axis),
        f"{layer}.{mlp}.down_proj": RowwiseParallel(axis, seq),
    }


def _vocab(axis: str, prefix: str, gather_logits: bool) -> Plan:
    return {
        f"{prefix}.embed_tokens": VocabParallel(axis),
        "lm_head": VocabParallel(axis, input="replicated", gather_output=gather_logits),
    }


def _attention(cfg: Any, axis: str, sp: bool, **options: Any) -> HeadParallelAttention:
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return HeadParallelAttention(
        heads, kv, head_dim, axis, input=_seq(sp), output=_seq(sp), **options
    )


def _experts(
    axis: str, ep_axis: str, strategy: Strategy, capacity_factor: float | None
) -> ExpertParallel:
    return ExpertParallel(
        ep_axis, strategy, None if axis == ep_axis else axis, capacity_factor=capacity_factor
    )


def _qwen_moe(
    model_or_config: Any,
    family: str,
    *,
    axis: str,
    ep_axis: str,
    strategy: Strategy,
    capacity_factor: float | None,
    sequence_parallel: bool,
    gather_logits: bool,
    prefix: str,
    shared: bool,
    norms: tuple[str, ...],
) -> Plan:
    cfg = _config(model_or_config)
    sp = sequence_parallel
    L = cfg.num_hidden_layers
    sparse = [
        i
        for i in range(L)
        if i not in (getattr(cfg, "mlp_only_layers", None) or [])
        and cfg.num_experts > 0
        and (i + 1) % cfg.decoder_sparse_step == 0
    ]
    plan: Plan = _vocab(axis, prefix, gather_logits)
    plan[f"{prefix}.layers.*.self_attn"] = _attention(cfg, axis, sp, norms=norms)
    moe = _layer_patterns(prefix, sparse, L) if sparse else []
    for layer in moe:
        plan[f"{layer}.mlp.experts"] = _experts(axis, ep_axis, strategy, capacity_factor)
        if shared:
            plan.update(_dense_mlp(f"{layer}.mlp", axis, "shared_expert"))
    dense = [i for i in range(L) if i not in sparse]
    for layer in _layer_patterns(prefix, dense, L) if dense else []:
        plan.update(_dense_mlp(layer, axis, seq=_seq(sp)))
    return _sequence_parallel(plan, axis, prefix, sp, moe)


# ============================================================================ the plans
def qwen2_moe(
    model_or_config: Any,
    *,
    axis: str = "tp",
    ep_axis: str = "ep",
    strategy: Strategy = "all_to_all",
    capacity_factor: float | None = None,
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "model",
) -> Plan:
    """The plan for Qwen2-MoE: attention by heads and the shared expert over ``axis``, the routed
    experts over ``ep_axis`` (each expert's features over ``axis`` too unless
    ``axis == ep_axis``); dense layers (``mlp_only_layers``, ``decoder_sparse_step``) over
    ``axis``. The router and ``shared_expert_gate`` (one output) stay replicated.

    >>> from transformers import Qwen2MoeConfig
    >>> config = Qwen2MoeConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    ...                         num_experts=4, num_hidden_layers=2)
    >>> plan = qwen2_moe(config)
    >>> print(*sorted(k for k in plan if "mlp" in k), sep="\\n")
    model.layers.*.mlp.experts
    model.layers.*.mlp.shared_expert
    model.layers.*.mlp.shared_expert.down_proj
    model.layers.*.mlp.shared_expert.gate_proj
    model.layers.*.mlp.shared_expert.up_proj
    """
    return _qwen_moe(
        model_or_config,
        "Qwen2-MoE",
        axis=axis,
        ep_axis=ep_axis,
        strategy=strategy,
        capacity_factor=capacity_factor,
        sequence_parallel=sequence_parallel,
        gather_logits=gather_logits,
        prefix=prefix,
        shared=True,
        norms=(),
    )


def qwen3_moe(
    model_or_config: Any,
    *,
    axis: str = "tp",
    ep_axis: str = "ep",
    strategy: Strategy = "all_to_all",
    capacity_factor: float | None = None,
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "model",
) -> Plan:
    """The plan for Qwen3-MoE: as `qwen2_moe` without a shared expert; the per-head q/k norms
    (``head_dim`` wide) are replicated and pvary'd.

    >>> from transformers import Qwen3MoeConfig
    >>> config = Qwen3MoeConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    ...                         num_experts=4, num_hidden_layers=2, mlp_only_layers=[0])
    >>> print(*sorted(k for k in qwen3_moe(config) if "mlp" in k), sep="\\n")
    model.layers.0.mlp
    model.layers.0.mlp.down_proj
    model.layers.0.mlp.gate_proj
    model.layers.0.mlp.up_proj
    model.layers.1.mlp.experts
    """
    return _qwen_moe(
        model_or_config,
        "Qwen3-MoE",
        axis=axis,
        ep_axis=ep_axis,
        strategy=strategy,
        capacity_factor=capacity_factor,
        sequence_parallel=sequence_parallel,
        gather_logits=gather_logits,
        prefix=prefix,
        shared=False,
        norms=("q_norm", "k_norm"),
    )


def olmoe(
    model_or_config: Any,
    *,
    axis: str = "tp",
    ep_axis: str = "ep",
    strategy: Strategy = "all_to_all",
    capacity_factor: float | None = None,
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "model",
) -> Plan:
    """The plan for OLMoE: attention by heads over ``axis``, the experts over ``ep_axis`` (each
    expert's features over ``axis`` too unless ``axis == ep_axis``). OLMoE's ``q_norm`` and
    ``k_norm`` are RMS norms over the whole projection width (all heads at once): split with
    the heads, their sums of squares are summed over ``axis``
    (``HeadParallelAttention(full_width_norms=...)``), so each token's norm is the whole
    width's.

    >>> from transformers import OlmoeConfig
    >>> config = OlmoeConfig(hidden_size=32, num_attention_heads=4, num_experts=4)
    >>> olmoe(config)["model.layers.*.self_attn"].full_width_norms
    (('q_norm', 'q'), ('k_norm', 'k'))
    """
    cfg = _config(model_or_config)
    plan = _vocab(axis, prefix, gather_logits)
    plan[f"{prefix}.layers.*.self_attn"] = _attention(
        cfg, axis, sequence_parallel, full_width_norms=(("q_norm", "q"), ("k_norm", "k"))
    )
    plan[f"{prefix}.layers.*.mlp.experts"] = _experts(axis, ep_axis, strategy, capacity_factor)
    return _sequence_parallel(plan, axis, prefix, sequence_parallel, [f"{prefix}.layers.*"])


def _deepseek(
    model_or_config: Any,
    family: str,
    *,
    axis: str,
    ep_axis: str,
    strategy: Strategy,
    capacity_factor: float | None,
    sequence_parallel: bool,
    gather_logits: bool,
    prefix: str,
) -> Plan:
    cfg = _config(model_or_config)
    seq = _seq(sequence_parallel)
    L = cfg.num_hidden_layers
    first = min(int(getattr(cfg, "first_k_dense_replace", 0) or 0), L)
    plan: Plan = _vocab(axis, prefix, gather_logits)
    plan[f"{prefix}.layers.*.self_attn"] = LatentAttention(cfg.num_attention_heads, axis, seq, seq)
    moe = _layer_patterns(prefix, list(range(first, L)), L) if first < L else []
    for layer in moe:
        plan[f"{layer}.mlp.experts"] = _experts(axis, ep_axis, strategy, capacity_factor)
        plan.update(_dense_mlp(f"{layer}.mlp", axis, "shared_experts"))
    for layer in _layer_patterns(prefix, list(range(first)), L) if first else []:
        plan.update(_dense_mlp(layer, axis, seq=seq))
    return _sequence_parallel(plan, axis, prefix, sequence_parallel, moe)


def deepseek_v3(
    model_or_config: Any,
    *,
    axis: str = "tp",
    ep_axis: str = "ep",
    strategy: Strategy = "all_to_all",
    capacity_factor: float | None = None,
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "model",
) -> Plan:
    """The plan for DeepSeek-V3: `LatentAttention` over ``axis``; in the MoE layers the routed
    experts over ``ep_axis`` and the shared experts over ``axis``; the first
    ``first_k_dense_replace`` layers' dense MLPs over ``axis``. The router (sigmoid scores,
    group-limited top-k with ``e_score_correction_bias``) stays replicated.

    >>> from transformers import DeepseekV3Config
    >>> config = DeepseekV3Config(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
    ...                           first_k_dense_replace=1, n_routed_experts=4)
    >>> plan = deepseek_v3(config)
    >>> plan["model.layers.*.self_attn"]
    LatentAttention(num_heads=4, axis='tp', input='replicated', output='replicated')
    >>> "model.layers.0.mlp.gate_proj" in plan and "model.layers.1.mlp.experts" in plan
    True
    """
    return _deepseek(
        model_or_config,
        "DeepSeek-V3",
        axis=axis,
        ep_axis=ep_axis,
        strategy=strategy,
        capacity_factor=capacity_factor,
        sequence_parallel=sequence_parallel,
        gather_logits=gather_logits,
        prefix=prefix,
    )


def deepseek_v2(
    model_or_config: Any,
    *,
    axis: str = "tp",
    ep_axis: str = "ep",
    strategy: Strategy = "all_to_all",
    capacity_factor: float | None = None,
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "model",
) -> Plan:
    """The plan for DeepSeek-V2: as `deepseek_v3` (its router: softmax scores, greedy or
    group-limited top-k, replicated).

    >>> from transformers import DeepseekV2Config
    >>> config = DeepseekV2Config(hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
    ...                           n_routed_experts=4)
    >>> sorted(k for k in deepseek_v2(config) if "experts" in k)[:2]
    ['model.layers.*.mlp.experts', 'model.layers.*.mlp.shared_experts']
    """
    return _deepseek(
        model_or_config,
        "DeepSeek-V2",
        axis=axis,
        ep_axis=ep_axis,
        strategy=strategy,
        capacity_factor=capacity_factor,
        sequence_parallel=sequence_parallel,
        gather_logits=gather_logits,
        prefix=prefix,
    )


def gpt_oss(
    model_or_config: Any,
    *,
    axis: str = "tp",
    ep_axis: str = "ep",
    strategy: Strategy = "all_to_all",
    capacity_factor: float | None = None,
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "model",
) -> Plan:
    """The plan for GPT-OSS: attention by heads over ``axis`` with each rank's attention sinks
    (``HeadParallelAttention(head_params=("sinks",))``); the experts (stored transposed, gate
    and up interleaved, with biases) over ``ep_axis``, each expert's features over ``axis``
    too unless ``axis == ep_axis``; the router (with its bias) replicated. Sliding-window and
    full layers alternate as the model's own masks say (the masks do not depend on heads).

    >>> from transformers import GptOssConfig
    >>> config = GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    ...                       head_dim=8, num_local_experts=4)
    >>> gpt_oss(config)["model.layers.*.self_attn"].head_params
    ('sinks',)
    """
    cfg = _config(model_or_config)
    plan: Plan = _vocab(axis, prefix, gather_logits)
    plan[f"{prefix}.layers.*.self_attn"] = _attention(
        cfg, axis, sequence_parallel, head_params=("sinks",)
    )
    plan[f"{prefix}.layers.*.mlp.experts"] = _experts(axis, ep_axis, strategy, capacity_factor)
    return _sequence_parallel(plan, axis, prefix, sequence_parallel, [f"{prefix}.layers.*"])


def mixtral(
    model_or_config: Any,
    *,
    axis: str = "tp",
    ep_axis: str = "ep",
    strategy: Strategy = "all_to_all",
    capacity_factor: float | None = None,
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "model",
) -> Plan:
    """The plan for Mixtral (also `fastdist.nn.plans.mixtral`): attention by heads and the
    vocabulary over ``axis``, the experts over ``ep_axis`` (each expert's features over ``axis``
    too unless ``axis == ep_axis``); the router replicated.

    >>> from transformers import MixtralConfig
    >>> config = MixtralConfig(
    ...     hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    >>> sorted(mixtral(config))
    ['lm_head', 'model.embed_tokens', 'model.layers.*.mlp.experts', 'model.layers.*.self_attn']
    """
    cfg = _config(model_or_config)
    plan = _vocab(axis, prefix, gather_logits)
    plan[f"{prefix}.layers.*.self_attn"] = _attention(cfg, axis, sequence_parallel)
    plan[f"{prefix}.layers.*.mlp.experts"] = _experts(axis, ep_axis, strategy, capacity_factor)
    return _sequence_parallel(plan, axis, prefix, sequence_parallel, [f"{prefix}.layers.*"])


#: The ready-made MoE plans by ``config.model_type`` (merged into `fastdist.nn.plans.FAMILIES`).
FAMILIES: dict[str, Callable[..., Plan]] = {
    "mixtral": mixtral,
    "qwen2_moe": qwen2_moe,
    "qwen3_moe": qwen3_moe,
    "olmoe": olmoe,
    "deepseek_v2": deepseek_v2,
    "deepseek_v3": deepseek_v3,
    "gpt_oss": gpt_oss,
}


def moe_plan_for(
    model: nn.Module,
    mesh: Mesh,
    *,
    axis: str = "tp",
    sequence_parallel: bool = False,
    gather_logits: bool = False,
) -> Plan:
    """The ready-made plan for a mixture-of-experts ``model`` (by ``config.model_type``) on
    ``mesh``: the experts over ``"ep"`` when the mesh has that axis, else over ``axis`` itself
    (whole experts per rank); the attention and vocabulary over ``axis``, or over ``"ep"`` on
    a mesh without ``axis``.

    >>> import fastdist as fd
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
    ...     vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    ...     num_experts=4, num_hidden_layers=1, moe_intermediate_size=8))
    >>> moe_plan_for(model, fd.Mesh({"tp": 2}))["model.layers.*.mlp.experts"].axis
    'tp'
    """
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in FAMILIES:
        raise ParallelizeError(
            f"parallelize: no ready-made mixture-of-experts plan for {type(model).__name__} "
            f"(model_type {kind!r}); plans exist for {sorted(FAMILIES)}. Fix: pass plan="
        )
    names = mesh.axis_names
    ep_axis = "ep" if "ep" in names else axis
    if axis not in names and "ep" in names:
        axis = "ep"
    mesh.axis_indices(axis, "parallelize")
    return FAMILIES[kind](
        model,
        axis=axis,
        ep_axis=ep_axis,
        sequence_parallel=sequence_parallel,
        gather_logits=gather_logits,
    )


# ============================================================================ checkpoints
class _Slices:
    """A checkpoint tensor read by slices: ``shape`` and ``[slices]`` (what
    `fastdist.nn.load_checkpoint` asks of a state dict's values)."""

    def __init__(self, shape: tuple[int, ...], get: Callable[[tuple[slice, ...]], Tensor]):
        self.shape, self._get = shape, get

    def __getitem__(self, s: Any) -> Tensor:
        return self._get(s if isinstance(s, tuple) else (s,))


def _span(s: slice, size: int) -> tuple[int, int]:
    start, stop, step = s.indices(size)
    if step != 1:
        raise ValueError(f"fused_experts: a strided read ({s}) of a fused expert tensor")
    return start, max(start, stop)


def _merged(parts: list[list[_Slices]]) -> _Slices:
    """Experts merged on a new dim 0, the parts concatenated on dim 1: ``parts[k][e]`` is part
    ``k`` (e.g. gate, up) of expert ``e``, each (n_k, ...)."""
    E, sizes = len(parts[0]), [p[0].shape[0] for p in parts]
    rest = parts[0][0].shape[1:]

    def get(s: tuple[slice, ...]) -> Tensor:
        s = s + (slice(None),) * (2 + len(rest) - len(s))
        e0, e1 = _span(s[0], E)
        f0, f1 = _span(s[1], sum(sizes))
        experts = []
        for e in range(e0, e1):
            pieces, offset = [], 0
            for part, n in zip(parts, sizes, strict=True):
                lo, hi = max(f0, offset), min(f1, offset + n)
                if hi > lo:  # only the rows of this part the slice asks for
                    pieces.append(part[e][(slice(lo - offset, hi - offset), *s[2:])])
                offset += n
            experts.append(torch.cat(pieces, 0))  # (f1 - f0, ...)
        return torch.stack(experts)  # (e1 - e0, f1 - f0, ...)

    return _Slices((E, sum(sizes), *rest), get)


def _converters(model: nn.Module) -> list[tuple[list[str], str, bool]]:
    """transformers' rules that fuse per-expert checkpoint tensors into a model's 3-D expert
    parameters: (source patterns, target pattern, concatenated), for the two layouts it uses
    (experts merged on dim 0, then gate and up concatenated on dim 1, or not)."""
    if getattr(getattr(model, "config", None), "model_type", None) is None:
        return []  # not a transformers model: nothing to ask transformers about
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # pragma: no cover - a transformers without conversion rules
        return []
    mapping: Callable[[str], Any] = get_checkpoint_conversion_mapping
    kind = getattr(getattr(model, "config", None), "model_type", None)
    out = []
    for key in dict.fromkeys((type(model).__name__, kind)):
        for rule in (mapping(key) if key else None) or []:
            ops = [
                (type(o).__name__, getattr(o, "dim", None)) for o in getattr(rule, "operations", [])
            ]
            targets = getattr(rule, "target_patterns", [])
            if len(targets) != 1:
                continue
            if ops == [("MergeModulelist", 0), ("Concatenate", 1)]:
                out.append((list(rule.source_patterns), targets[0], True))
            elif ops == [("MergeModulelist", 0)] and len(rule.source_patterns) == 1:
                out.append((list(rule.source_patterns), targets[0], False))
    return out


def _renamings(model: nn.Module) -> list[tuple[str, str]]:
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # pragma: no cover
        return []
    mapping: Callable[[str], Any] = get_checkpoint_conversion_mapping
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return [
        (rule.source_patterns[0], rule.target_patterns[0])
        for key in dict.fromkeys((type(model).__name__, kind))
        for rule in (mapping(key) if key else None) or []
        if type(rule) is WeightRenaming and len(rule.source_patterns) == 1
    ]


@contextlib.contextmanager
def fused_experts(model: nn.Module, source: Any) -> Iterator[Mapping[str, Any]]:
    """A checkpoint whose experts are stored one tensor per expert (what transformers'
    ``save_pretrained`` writes for Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3:
    ``...experts.0.gate_proj.weight``, ``...experts.0.up_proj.weight``, ...), seen with the
    model's fused 3-D names (``...experts.gate_up_proj`` (E, 2I, H), ``...experts.down_proj``),
    for ``pm.load``: each rank still reads only its own slices (its experts' rows of its tp
    shard), as transformers' own conversion rules say (experts merged on dim 0, gate and up
    concatenated on dim 1; renamings such as Mixtral's ``block_sparse_moe`` applied). Other
    tensors pass through. ``model``: the (parallelized) model; ``source``: a ``save_pretrained``
    directory or ``.safetensors`` file.

    >>> import tempfile, torch, fastdist as fd
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_attention_heads=4,
    ...     num_key_value_heads=2, num_experts=4, num_hidden_layers=1, moe_intermediate_size=8)
    >>> saved = tempfile.mkdtemp()
    >>> Qwen3MoeForCausalLM(cfg).save_pretrained(saved)
    >>> pm = fd.nn.parallelize(Qwen3MoeForCausalLM(cfg), fd.Mesh({"ep": 2}))
    >>> with fused_experts(pm.module, saved) as checkpoint:
    ...     pm.load(checkpoint)
    """
    from fastdist.nn.state import _open_source

    rules, renames = _converters(model), _renamings(model)
    with _open_source(source) as (shapes, reader):
        named: dict[str, _Slices] = {}
        for key, shape in shapes.items():
            new = key
            for src, tgt in renames:
                new = re.sub(src, tgt, new)
            named[new] = _Slices(tuple(shape), reader(key))
        out = dict(named)
        for key in model.state_dict(keep_vars=True):
            for sources, target, concatenated in rules if key not in named else []:
                if not key.endswith(target.lstrip(".")):
                    continue
                prefix = key[: len(key) - len(target.lstrip("."))]
                parts: list[list[_Slices]] = []
                for pattern in sources:
                    each, e = [], 0
                    while (name := prefix + pattern.lstrip(".").replace("*", str(e))) in named:
                        each.append(named.pop(name))
                        out.pop(name, None)
                        e += 1
                    parts.append(each)
                if parts and all(parts) and len({len(p) for p in parts}) == 1:
                    out[key] = _merged(parts if concatenated else parts[:1])
                    break
        yield out
