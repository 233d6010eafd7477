"""Ready-made `fastdist.nn.parallelize` plans for Hugging Face model families.

A plan is a plain dict (module-name pattern -> styles): print it, copy it, edit it. Each
function here reads the head counts from the model's config and returns the plan for
tensor parallelism over ``axis``, with Megatron-style sequence parallelism when
``sequence_parallel`` (norms and residuals on a sequence shard from the first decoder
layer to the final norm; gathered at each attention/MLP input, reduce-scattered at each
output).

* `llama`: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``
  (q/k/v bias), ``Qwen3ForCausalLM`` (per-head q/k norms), with grouped-query attention
  (kv heads fewer than ranks are replicated);
* `gpt2`: ``GPT2LMHeadModel`` (``Conv1D`` weights stored (in, out), fused ``c_attn``
  split into q/k/v, vocabulary 50257 padded to a multiple of the axis);
* `mixtral`: ``MixtralForCausalLM``: the Llama attention and vocabulary pieces over ``axis``,
  the experts over ``ep`` (`fastdist.nn.moe.ExpertParallel`; see ``docs/moe.md``).

The LM head is vocabulary-parallel: ``logits`` are this rank's columns
``(batch, seq, V_padded / n)`` unless ``gather_logits``; the model's ``loss_function`` is
set to `fastdist.nn.causal_lm_loss`, so ``model(input_ids, labels=...)`` returns the
loss of the whole vocabulary (``-100`` labels ignored), as the single-device model does.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..mesh import Mesh
from .auto import auto
from .moe import ExpertParallel
from .styles import (
    ColwiseParallel,
    GatherSequence,
    HeadParallelAttention,
    ParallelizeError,
    PrepareInput,
    PvaryParams,
    RowwiseParallel,
    SequenceShard,
    VocabParallel,
)

__all__ = ["auto", "gpt2", "llama", "mixtral", "plan_for"]

Plan = dict[str, Any]


def _config(model_or_config: Any) -> Any:
    return getattr(model_or_config, "config", model_or_config)


def _seq(sequence_parallel: bool) -> Any:
    return "sequence" if sequence_parallel else "replicated"


def _sequence_region(axis: str, layers: str, norms: tuple[str, ...], final_norm: str) -> Plan:
    """Megatron-style sequence parallelism from the first decoder layer's input to the final norm's
    input."""
    region: Plan = {f"{layers}.0": SequenceShard(axis), final_norm: GatherSequence(axis)}
    # norms on a sequence shard
    region.update({f"{layers}.*.{norm}": PvaryParams(axis) for norm in norms})
    return region


def llama(
    model_or_config: Any,
    *,
    axis: str = "tp",
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "model",
) -> Plan:
    """The plan for the Llama family (Llama, Mistral, Qwen2, Qwen3) over ``axis``.

    >>> from transformers import LlamaConfig
    >>> config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    >>> plan = llama(config, sequence_parallel=True)
    >>> print(*sorted(plan)[:3])
    lm_head model.embed_tokens model.layers.*.input_layernorm
    """
    cfg = _config(model_or_config)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    seq = _seq(sequence_parallel)
    norms = ("q_norm", "k_norm") if getattr(cfg, "model_type", "") in ("qwen3", "qwen3_moe") else ()
    plan: Plan = {
        f"{prefix}.embed_tokens": VocabParallel(axis),
        f"{prefix}.layers.*.self_attn": HeadParallelAttention(
            heads,
            kv,
            head_dim,
            axis,
            input=seq,
            output=seq,
            norms=norms,
            attrs=(("num_key_value_groups", lambda hq, hkv, d: hq // hkv),),
        ),
        f"{prefix}.layers.*.mlp": PrepareInput(axis, seq),
        f"{prefix}.layers.*.mlp.gate_proj": ColwiseParallel(axis),
        f"{prefix}.layers.*.mlp.up_proj": ColwiseParallel(axis),
        f"{prefix}.layers.*.mlp.down_proj": RowwiseParallel(axis, seq),
        "lm_head": VocabParallel(axis, input="replicated", gather_output=gather_logits),
    }
    if sequence_parallel:
        plan.update(
            _sequence_region(
                axis,
                f"{prefix}.layers",
                ("input_layernorm", "post_attention_layernorm"),
                f"{prefix}.norm",
            )
        )
    return plan


def gpt2(
    model_or_config: Any,
    *,
    axis: str = "tp",
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "transformer",
) -> Plan:
    """The plan for GPT-2 over ``axis``: ``Conv1D`` layers, fused ``c_attn``, padded vocabulary.

    >>> from transformers import GPT2Config
    >>> print(*sorted(gpt2(GPT2Config(n_embd=64, n_head=4)))[:2])
    lm_head transformer.h.*.attn
    """
    cfg = _config(model_or_config)
    heads, hidden = cfg.n_head, cfg.n_embd
    seq = _seq(sequence_parallel)
    plan: Plan = {
        f"{prefix}.wte": VocabParallel(axis),
        f"{prefix}.h.*.attn": HeadParallelAttention(
            heads,
            heads,
            hidden // heads,
            axis,
            input=seq,
            output=seq,
            qkv="c_attn",
            o="c_proj",
            attrs=(("split_size", lambda hq, hkv, d: hq * d),),
        ),
        f"{prefix}.h.*.mlp": PrepareInput(axis, seq),
        f"{prefix}.h.*.mlp.c_fc": ColwiseParallel(axis),
        f"{prefix}.h.*.mlp.c_proj": RowwiseParallel(axis, seq),
        "lm_head": VocabParallel(axis, input="replicated", gather_output=gather_logits),
    }
    if sequence_parallel:
        plan.update(_sequence_region(axis, f"{prefix}.h", ("ln_1", "ln_2"), f"{prefix}.ln_f"))
    return plan


def mixtral(
    model_or_config: Any,
    *,
    axis: str = "tp",
    ep_axis: str = "ep",
    strategy: str = "all_to_all",
    capacity_factor: float | None = None,
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "model",
) -> Plan:
    """The plan for Mixtral: experts over ``ep_axis``, attention, vocabulary and each expert's
    features over ``axis``.

    The Llama plan's attention and vocabulary pieces over ``axis`` (tensor parallelism), the
    experts module (``gate_up_proj``/``down_proj`` 3-D parameters) `fastdist.nn.moe.ExpertParallel`
    over ``ep_axis`` with ``strategy`` (``"all_to_all"`` or ``"allgather"``). With
    ``axis == ep_axis`` (a mesh with only ``ep``) the ep ranks are also the attention's
    tensor-parallel group (vLLM's layout) and experts are whole; otherwise each expert's
    intermediate features split over ``axis`` too. Tokens are replicated over both axes
    (each ep rank dispatches its share and the outputs are gathered back), so the router,
    ``router_logits`` and the model's ``aux_loss`` are one device's. The router stays
    replicated. ``capacity_factor``: token dropping (default: dropless).

    >>> from transformers import MixtralConfig
    >>> config = MixtralConfig(
    ...     hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    >>> plan = mixtral(config)
    >>> plan["model.layers.*.mlp.experts"]  # doctest: +NORMALIZE_WHITESPACE
    ExpertParallel(axis='ep', strategy='all_to_all', tp_axis='tp', tokens='replicated',
                   capacity_factor=None, capacity=None)
    """
    if sequence_parallel:
        raise ParallelizeError(
            "parallelize: the Mixtral plan has no sequence parallelism yet (the experts take "
            "replicated tokens). Fix: sequence_parallel=False"
        )
    plan = {
        k: v
        for k, v in llama(
            model_or_config, axis=axis, gather_logits=gather_logits, prefix=prefix
        ).items()
        if ".mlp" not in k
    }
    plan[f"{prefix}.layers.*.mlp.experts"] = ExpertParallel(
        ep_axis,
        strategy,  # type: ignore[arg-type]
        None if axis == ep_axis else axis,
        capacity_factor=capacity_factor,
    )
    return plan


FAMILIES = {
    "llama": llama,
    "mistral": llama,
    "qwen2": llama,
    "qwen3": llama,
    "gpt2": gpt2,
    "mixtral": mixtral,
}


def plan_for(
    model: nn.Module,
    mesh: Mesh,
    *,
    axis: str = "tp",
    sequence_parallel: bool = False,
    gather_logits: bool = False,
) -> Plan:
    """The ready-made plan for ``model`` (by ``config.model_type``); raises for a family without
    one."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in FAMILIES:
        raise ParallelizeError(
            f"parallelize: no ready-made plan for {type(model).__name__} (model_type {kind!r}); "
            f"plans exist for {sorted(FAMILIES)}. "
            "Fix: pass plan= (see fastdist.nn.plans.llama for the shape of one)"
        )
    # experts over ep; attention over tp, or over ep itself on a mesh without tp
    if kind == "mixtral":
        axis = axis if axis in mesh.axis_names else "ep"
        mesh.axis_indices("ep", "parallelize")
    mesh.axis_indices(axis, "parallelize")
    return FAMILIES[kind](
        model, axis=axis, sequence_parallel=sequence_parallel, gather_logits=gather_logits
    )
