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
  the experts over ``ep`` (`fastdist.nn.moe.ExpertParallel`; see ``docs/moe.md``);
* `gemma`: Gemma, Gemma 2, Gemma 3 (text): the scaled embedding vocabulary-parallel with its
  scale, soft-capped logits on the vocabulary shards;
* `phi3`: Phi-3 and Phi-4 (fused ``qkv_proj`` and ``gate_up_proj``; a per-rank config view);
* `gpt_neox`: GPT-NeoX / Pythia (per-head ``query_key_value``);
* `falcon`: Falcon's new decoder architecture, multi-query and original layouts (no ALiBi);
* `stablelm`: StableLM (per-head q/k LayerNorm lists);
* `olmo`: OLMo and OLMo-2 (q/k norms over the whole width, their statistics summed over
  ``axis``).

`plan_for` picks one by ``config.model_type`` (`FAMILIES`; the MoE families are
`fastdist.nn.moe_plans`'); the table of what is tested for each is in ``docs/models.md``.

The LM head is vocabulary-parallel: ``logits`` are this rank's columns
``(batch, seq, V_padded / n)`` unless ``gather_logits``; the model's ``loss_function`` is
set to `fastdist.nn.causal_lm_loss`, so ``model(input_ids, labels=...)`` returns the
loss of the whole vocabulary (``-100`` labels ignored), as the single-device model does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from torch import nn

from fastdist.core.mesh import Mesh
from fastdist.nn.auto import auto
from fastdist.nn.moe_plans import FAMILIES as MOE_FAMILIES
from fastdist.nn.moe_plans import mixtral as _moe_mixtral
from fastdist.nn.moe_plans import moe_plan_for
from fastdist.nn.styles import (
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

__all__ = [
    "auto",
    "falcon",
    "gemma",
    "gpt2",
    "gpt_neox",
    "hf_checkpoint_renames",
    "llama",
    "mixtral",
    "olmo",
    "phi3",
    "plan_for",
    "stablelm",
]

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

    Args:
        model_or_config: the model, or its ``config``.
        axis: the mesh axis of tensor parallelism.
        sequence_parallel: also split the sequence over ``axis`` between the attention and MLP
            blocks (Megatron's sequence parallelism).
        gather_logits: the LM head gives the whole vocabulary's logits ``(..., V)``; else each
            rank's vocabulary shard.
        prefix: the name of the base model inside the causal LM (``model`` in ``model.layers.*``).

    Returns:
        the plan: a dict from module name patterns to styles (print it, edit it).

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

    Args:
        model_or_config: the model, or its ``config``.
        axis: the mesh axis of tensor parallelism.
        sequence_parallel: also split the sequence over ``axis`` between the attention and MLP
            blocks (Megatron's sequence parallelism).
        gather_logits: the LM head gives the whole vocabulary's logits ``(..., V)``; else each
            rank's vocabulary shard.
        prefix: the name of the base model inside the causal LM (``model`` in ``model.layers.*``).

    Returns:
        the plan: a dict from module name patterns to styles (print it, edit it).

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

    Args:
        model_or_config: the model, or its ``config``.
        axis: the mesh axis of tensor parallelism.
        ep_axis: the mesh axis the experts are split over.
        strategy: ``"all_to_all"`` or ``"allgather"``, as in `fastdist.nn.moe.dispatch`.
        capacity_factor: drop assignments past the capacity; ``None``: dropless (see
            `fastdist.nn.moe.moe`).
        sequence_parallel: also split the sequence over ``axis`` between the attention and MLP
            blocks (Megatron's sequence parallelism).
        gather_logits: the LM head gives the whole vocabulary's logits ``(..., V)``; else each
            rank's vocabulary shard.
        prefix: the name of the base model inside the causal LM (``model`` in ``model.layers.*``).

    Returns:
        the plan: a dict from module name patterns to styles (print it, edit it).

    >>> from transformers import MixtralConfig
    >>> config = MixtralConfig(
    ...     hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    >>> plan = mixtral(config)
    >>> plan["model.layers.*.mlp.experts"]  # doctest: +NORMALIZE_WHITESPACE
    ExpertParallel(axis='ep', strategy='all_to_all', tp_axis='tp', tokens='replicated',
                   capacity_factor=None, capacity=None)
    """
    # one implementation, with the other MoE families' (fastdist.nn.moe_plans)
    return _moe_mixtral(
        model_or_config,
        axis=axis,
        ep_axis=ep_axis,
        strategy=strategy,  # type: ignore[arg-type]
        capacity_factor=capacity_factor,
        sequence_parallel=sequence_parallel,
        gather_logits=gather_logits,
        prefix=prefix,
    )


# ============================================================================ dense families
def _head_dim(cfg: Any) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _decoder(
    cfg: Any,
    *,
    axis: str,
    sequence_parallel: bool,
    gather_logits: bool,
    prefix: str,
    layers: str,
    attn: str,
    attention: Callable[[Any], HeadParallelAttention],
    mlp: Plan,
    layer_norms: tuple[str, ...],
    final_norm: str,
    embed: str,
    head: str,
    embed_scale: str | None = None,
) -> Plan:
    """A decoder-only causal LM: vocabulary-parallel embedding and head, head-parallel attention,
    the MLP's column/row pieces (``mlp``: child name -> style, under ``{layers}.*.mlp``), and
    Megatron sequence parallelism over ``layer_norms`` up to ``final_norm``."""
    seq = _seq(sequence_parallel)
    plan: Plan = {
        f"{prefix}.{embed}": VocabParallel(axis, scale=embed_scale),
        f"{prefix}.{layers}.*.{attn}": attention(seq),
        f"{prefix}.{layers}.*.mlp": PrepareInput(axis, seq),
        **{f"{prefix}.{layers}.*.mlp.{k}": v for k, v in mlp.items()},
        head: VocabParallel(axis, input="replicated", gather_output=gather_logits),
    }
    if sequence_parallel:
        plan.update(
            _sequence_region(axis, f"{prefix}.{layers}", layer_norms, f"{prefix}.{final_norm}")
        )
    return plan


def _gated_mlp(axis: str, seq: Any) -> Plan:
    return {
        "gate_proj": ColwiseParallel(axis),
        "up_proj": ColwiseParallel(axis),
        "down_proj": RowwiseParallel(axis, seq),
    }


def _refuse(family: str, why: str, fix: str) -> None:
    raise ParallelizeError(
        f"parallelize: the {family} plan cannot split this model ({why}). Fix: {fix}"
    )


def gemma(
    model_or_config: Any,
    *,
    axis: str = "tp",
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "model",
) -> Plan:
    """The plan for Gemma, Gemma 2 and Gemma 3 (text: ``Gemma3ForCausalLM``) over ``axis``.

    The scaled embedding (``embed_tokens(ids) * sqrt(hidden)``) is vocabulary-parallel with
    its own scale (``VocabParallel(scale="embed_scale")``) and stays tied to the head. Gemma 2/3's
    final-logit soft-capping (``tanh(logits / cap) * cap``) is elementwise, so the head's
    vocabulary shards are capped where they are and the loss is the whole vocabulary's;
    attention soft-capping, ``query_pre_attn_scalar`` and the alternating sliding windows run
    inside each rank's heads. Gemma 3's per-head ``q_norm``/``k_norm`` are pvary'd.

    Args:
        model_or_config: the model, or its ``config``.
        axis: the mesh axis of tensor parallelism.
        sequence_parallel: also split the sequence over ``axis`` between the attention and MLP
            blocks (Megatron's sequence parallelism).
        gather_logits: the LM head gives the whole vocabulary's logits ``(..., V)``; else each
            rank's vocabulary shard.
        prefix: the name of the base model inside the causal LM (``model`` in ``model.layers.*``).

    Returns:
        the plan: a dict from module name patterns to styles (print it, edit it).

    >>> from transformers import Gemma2Config
    >>> plan = gemma(Gemma2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
    ...                           head_dim=16), sequence_parallel=True)
    >>> plan["model.embed_tokens"].scale
    'embed_scale'
    """
    cfg = _config(model_or_config)
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, _head_dim(cfg)
    kind = getattr(cfg, "model_type", "gemma")
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    if kind != "gemma":
        norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    qk = ("q_norm", "k_norm") if kind.startswith("gemma3") else ()
    return _decoder(
        cfg,
        axis=axis,
        sequence_parallel=sequence_parallel,
        gather_logits=gather_logits,
        prefix=prefix,
        layers="layers",
        attn="self_attn",
        attention=lambda seq: HeadParallelAttention(
            heads, kv, d, axis, input=seq, output=seq, norms=qk
        ),
        mlp=_gated_mlp(axis, _seq(sequence_parallel)),
        layer_norms=norms,
        final_norm="norm",
        embed="embed_tokens",
        head="lm_head",
        embed_scale="embed_scale",
    )


def phi3(
    model_or_config: Any,
    *,
    axis: str = "tp",
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "model",
) -> Plan:
    """The plan for Phi-3 and Phi-4 (``Phi3ForCausalLM``) over ``axis``: the fused ``qkv_proj``
    (``[q | k | v]``) split by heads, the fused ``gate_up_proj`` as two parts. Its attention
    slices ``qkv`` with ``self.config.num_attention_heads``: each attention module gets a
    per-rank view of the config (see `HeadParallelAttention`).

    Args:
        model_or_config: the model, or its ``config``.
        axis: the mesh axis of tensor parallelism.
        sequence_parallel: also split the sequence over ``axis`` between the attention and MLP
            blocks (Megatron's sequence parallelism).
        gather_logits: the LM head gives the whole vocabulary's logits ``(..., V)``; else each
            rank's vocabulary shard.
        prefix: the name of the base model inside the causal LM (``model`` in ``model.layers.*``).

    Returns:
        the plan: a dict from module name patterns to styles (print it, edit it).

    >>> from transformers import Phi3Config
    >>> plan = phi3(Phi3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4,
    ...                        num_key_value_heads=2))
    >>> plan["model.layers.*.mlp.gate_up_proj"].parts
    (96, 96)
    """
    cfg = _config(model_or_config)
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, _head_dim(cfg)
    seq = _seq(sequence_parallel)
    inter = cfg.intermediate_size
    return _decoder(
        cfg,
        axis=axis,
        sequence_parallel=sequence_parallel,
        gather_logits=gather_logits,
        prefix=prefix,
        layers="layers",
        attn="self_attn",
        attention=lambda seq: HeadParallelAttention(
            heads, kv, d, axis, input=seq, output=seq, qkv="qkv_proj"
        ),
        mlp={
            "gate_up_proj": ColwiseParallel(axis, parts=(inter, inter)),
            "down_proj": RowwiseParallel(axis, seq),
        },
        layer_norms=("input_layernorm", "post_attention_layernorm"),
        final_norm="norm",
        embed="embed_tokens",
        head="lm_head",
    )


def gpt_neox(
    model_or_config: Any,
    *,
    axis: str = "tp",
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "gpt_neox",
) -> Plan:
    """The plan for GPT-NeoX / Pythia over ``axis``: ``query_key_value`` is laid out per head
    (``(heads, 3, head_dim)``), so each rank's heads are one block of its rows.

    Args:
        model_or_config: the model, or its ``config``.
        axis: the mesh axis of tensor parallelism.
        sequence_parallel: also split the sequence over ``axis`` between the attention and MLP
            blocks (Megatron's sequence parallelism).
        gather_logits: the LM head gives the whole vocabulary's logits ``(..., V)``; else each
            rank's vocabulary shard.
        prefix: the name of the base model inside the causal LM (``model`` in ``model.layers.*``).

    Returns:
        the plan: a dict from module name patterns to styles (print it, edit it).

    >>> from transformers import GPTNeoXConfig
    >>> plan = gpt_neox(GPTNeoXConfig(hidden_size=64, num_attention_heads=4))
    >>> plan["gpt_neox.layers.*.attention"].qkv_layout
    'per_head'
    """
    cfg = _config(model_or_config)
    heads = cfg.num_attention_heads
    seq = _seq(sequence_parallel)
    return _decoder(
        cfg,
        axis=axis,
        sequence_parallel=sequence_parallel,
        gather_logits=gather_logits,
        prefix=prefix,
        layers="layers",
        attn="attention",
        attention=lambda seq: HeadParallelAttention(
            heads,
            heads,
            cfg.hidden_size // heads,
            axis,
            input=seq,
            output=seq,
            qkv="query_key_value",
            o="dense",
            qkv_layout="per_head",
        ),
        mlp={
            "dense_h_to_4h": ColwiseParallel(axis),
            "dense_4h_to_h": RowwiseParallel(axis, seq),
        },
        layer_norms=("input_layernorm", "post_attention_layernorm"),
        final_norm="final_layer_norm",
        embed="embed_in",
        head="lm_head",
    )


def falcon(
    model_or_config: Any,
    *,
    axis: str = "tp",
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "transformer",
) -> Plan:
    """The plan for Falcon over ``axis``: the new decoder architecture (``query_key_value``
    grouped by kv head: ``(kv, q per kv + 2, head_dim)``), multi-query (``[q heads | k | v]``,
    one kv head: every rank holds the fused weight whole and projects its heads' rows) and the
    original per-head layout. ALiBi (``alibi=True``) is refused: its bias is built for every
    head outside the attention.

    Args:
        model_or_config: the model, or its ``config``.
        axis: the mesh axis of tensor parallelism.
        sequence_parallel: also split the sequence over ``axis`` between the attention and MLP
            blocks (Megatron's sequence parallelism).
        gather_logits: the LM head gives the whole vocabulary's logits ``(..., V)``; else each
            rank's vocabulary shard.
        prefix: the name of the base model inside the causal LM (``model`` in ``model.layers.*``).

    Returns:
        the plan: a dict from module name patterns to styles (print it, edit it).

    >>> from transformers import FalconConfig
    >>> cfg = FalconConfig(hidden_size=64, num_attention_heads=4, num_kv_heads=2,
    ...                    new_decoder_architecture=True)
    >>> falcon(cfg)["transformer.h.*.self_attention"].qkv_layout
    'grouped'
    """
    cfg = _config(model_or_config)
    if getattr(cfg, "alibi", False):
        _refuse(
            "Falcon",
            "alibi=True: the model builds the ALiBi bias for all heads and each attention "
            "views it by its own head count",
            "a Falcon with rotary positions (alibi=False), or keep the attention replicated "
            "(a plan without the self_attention entry)",
        )
    heads, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    layout: Any
    if cfg.new_decoder_architecture:
        kv, layout = cfg.num_kv_heads, "grouped"
    elif cfg.multi_query:
        kv, layout = 1, "concat"
    else:
        kv, layout = heads, "per_head"
    seq = _seq(sequence_parallel)
    if not cfg.parallel_attn:
        norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    elif cfg.num_ln_in_parallel_attn == 2 or (
        cfg.num_ln_in_parallel_attn is None and cfg.new_decoder_architecture
    ):
        norms = ("ln_attn", "ln_mlp")
    else:
        norms = ("input_layernorm",)
    return _decoder(
        cfg,
        axis=axis,
        sequence_parallel=sequence_parallel,
        gather_logits=gather_logits,
        prefix=prefix,
        layers="h",
        attn="self_attention",
        attention=lambda seq: HeadParallelAttention(
            heads,
            kv,
            d,
            axis,
            input=seq,
            output=seq,
            qkv="query_key_value",
            o="dense",
            qkv_layout=layout,
        ),
        mlp={
            "dense_h_to_4h": ColwiseParallel(axis),
            "dense_4h_to_h": RowwiseParallel(axis, seq),
        },
        layer_norms=norms,
        final_norm="ln_f",
        embed="word_embeddings",
        head="lm_head",
    )


def stablelm(
    model_or_config: Any,
    *,
    axis: str = "tp",
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "model",
) -> Plan:
    """The plan for StableLM over ``axis``: its attention reads ``self.num_heads`` and
    ``self.num_key_value_heads`` (set per rank), rotates part of each head (within a head:
    unchanged), and with ``qk_layernorm`` normalises each head with its own LayerNorm (each
    rank applies its heads' norms).

    Args:
        model_or_config: the model, or its ``config``.
        axis: the mesh axis of tensor parallelism.
        sequence_parallel: also split the sequence over ``axis`` between the attention and MLP
            blocks (Megatron's sequence parallelism).
        gather_logits: the LM head gives the whole vocabulary's logits ``(..., V)``; else each
            rank's vocabulary shard.
        prefix: the name of the base model inside the causal LM (``model`` in ``model.layers.*``).

    Returns:
        the plan: a dict from module name patterns to styles (print it, edit it).

    >>> from transformers import StableLmConfig
    >>> plan = stablelm(StableLmConfig(hidden_size=64, num_attention_heads=4,
    ...                                num_key_value_heads=4, qk_layernorm=True))
    >>> plan["model.layers.*.self_attn"].head_norm_lists
    (('q_layernorm', 'q'), ('k_layernorm', 'k'))
    """
    cfg = _config(model_or_config)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    qk: Any = (("q_layernorm", "q"), ("k_layernorm", "k")) if cfg.qk_layernorm else ()
    norms: tuple[str, ...] = ("input_layernorm",)
    if not cfg.use_parallel_residual:
        norms += ("post_attention_layernorm",)
    return _decoder(
        cfg,
        axis=axis,
        sequence_parallel=sequence_parallel,
        gather_logits=gather_logits,
        prefix=prefix,
        layers="layers",
        attn="self_attn",
        attention=lambda seq: HeadParallelAttention(
            heads,
            kv,
            cfg.hidden_size // heads,
            axis,
            input=seq,
            output=seq,
            head_norm_lists=qk,
        ),
        mlp=_gated_mlp(axis, _seq(sequence_parallel)),
        layer_norms=norms,
        final_norm="norm",
        embed="embed_tokens",
        head="lm_head",
    )


def olmo(
    model_or_config: Any,
    *,
    axis: str = "tp",
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str = "model",
) -> Plan:
    """The plan for OLMo and OLMo-2 over ``axis``. OLMo-2's ``q_norm``/``k_norm`` are RMSNorms
    over the whole projection (all heads together): each rank normalises its heads with the
    sum of squares summed over ``axis`` (the single-device statistics; see
    `HeadParallelAttention`'s ``full_width_norms``). OLMo's norms have no parameters.

    Args:
        model_or_config: the model, or its ``config``.
        axis: the mesh axis of tensor parallelism.
        sequence_parallel: also split the sequence over ``axis`` between the attention and MLP
            blocks (Megatron's sequence parallelism).
        gather_logits: the LM head gives the whole vocabulary's logits ``(..., V)``; else each
            rank's vocabulary shard.
        prefix: the name of the base model inside the causal LM (``model`` in ``model.layers.*``).

    Returns:
        the plan: a dict from module name patterns to styles (print it, edit it).

    >>> from transformers import Olmo2Config
    >>> plan = olmo(Olmo2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2))
    >>> plan["model.layers.*.self_attn"].full_width_norms
    (('q_norm', 'q'), ('k_norm', 'k'))
    """
    cfg = _config(model_or_config)
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, _head_dim(cfg)
    two = getattr(cfg, "model_type", "olmo") == "olmo2"
    full: Any = (("q_norm", "q"), ("k_norm", "k")) if two else ()
    norms = (
        ("post_attention_layernorm", "post_feedforward_layernorm")
        if two
        else ("input_layernorm", "post_attention_layernorm")
    )
    return _decoder(
        cfg,
        axis=axis,
        sequence_parallel=sequence_parallel,
        gather_logits=gather_logits,
        prefix=prefix,
        layers="layers",
        attn="self_attn",
        attention=lambda seq: HeadParallelAttention(
            heads, kv, d, axis, input=seq, output=seq, full_width_norms=full
        ),
        mlp=_gated_mlp(axis, _seq(sequence_parallel)),
        layer_norms=norms,
        final_norm="norm",
        embed="embed_tokens",
        head="lm_head",
    )


# ============================================================================ checkpoint names
def _checkpoint_keys(source: Any) -> list[str]:
    """The tensor names of a safetensors file, a directory of them, or a state dict."""
    from collections.abc import Mapping
    from pathlib import Path

    if isinstance(source, Mapping):
        return [str(k) for k in source]
    if not isinstance(source, (str, Path)):
        return []
    path = Path(source)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    keys: list[str] = []
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - safetensors comes with transformers
        return []
    for file in files:
        if file.suffix == ".safetensors" and file.is_file():
            with safe_open(str(file), framework="pt") as f:
                keys += list(f.keys())
    return keys


def hf_checkpoint_renames(model: nn.Module, source: Any) -> dict[str, str] | None:
    """Model name -> checkpoint name for the renamings transformers applies when it loads this
    model's checkpoints (``save_pretrained`` writes GPT-NeoX's ``lm_head`` as ``embed_out``, as
    Pythia's checkpoints have it): only names the checkpoint holds and the model lacks. None
    when nothing is renamed (or transformers has no such table)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return None
    rules: list[tuple[str, str]] = []
    kind = getattr(getattr(model, "config", None), "model_type", None)
    for key in dict.fromkeys((type(model).__name__, kind)):
        table = get_checkpoint_conversion_mapping(key) if key else None  # type: ignore[no-untyped-call]
        for rule in table or []:
            if type(rule) is WeightRenaming and len(rule.source_patterns) == 1:
                rules.append((rule.source_patterns[0], rule.target_patterns[0]))
    if not rules:
        return None
    own = set(model.state_dict(keep_vars=True))
    out: dict[str, str] = {}
    for key in _checkpoint_keys(source):
        if key in own:
            continue
        new = key
        for src, tgt in rules:
            new = re.sub(src, tgt, new)
        if new != key and new in own:
            out[new] = key
    return out or None


FAMILIES = {
    "llama": llama,
    "mistral": llama,
    "qwen2": llama,
    "qwen3": llama,
    "gpt2": gpt2,
    "mixtral": mixtral,
    # dense families: Gemma, Phi-3/4, GPT-NeoX, Falcon, StableLM, OLMo
    "gemma": gemma,
    "gemma2": gemma,
    "gemma3_text": gemma,
    "phi3": phi3,
    "gpt_neox": gpt_neox,
    "falcon": falcon,
    "stablelm": stablelm,
    "olmo": olmo,
    "olmo2": olmo,
    # Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GPT-OSS: fastdist.nn.moe_plans
    **MOE_FAMILIES,
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
    one.

    Args:
        model: a transformers model.
        mesh: the mesh it will run on.
        axis: the mesh axis of tensor parallelism.
        sequence_parallel: also split the sequence over ``axis`` between the attention and MLP
            blocks (Megatron's sequence parallelism).
        gather_logits: the LM head gives the whole vocabulary's logits ``(..., V)``; else each
            rank's vocabulary shard.

    Returns:
        the plan: a dict from module name patterns to styles (print it, edit it).
    """
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind in MOE_FAMILIES:
        return moe_plan_for(
            model, mesh, axis=axis, sequence_parallel=sequence_parallel, gather_logits=gather_logits
        )
    if kind not in FAMILIES:
        raise ParallelizeError(
            f"parallelize: no ready-made plan for {type(model).__name__} (model_type {kind!r}); "
            f"plans exist for {sorted(FAMILIES)}. "
            "Fix: pass plan= (see fastdist.nn.plans.llama for the shape of one)"
        )
    mesh.axis_indices(axis, "parallelize")
    return FAMILIES[kind](
        model, axis=axis, sequence_parallel=sequence_parallel, gather_logits=gather_logits
    )
