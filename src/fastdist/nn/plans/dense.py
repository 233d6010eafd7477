"""The dense families' rows: one `Family` per Hugging Face architecture (by ``config.model_type``).

* Llama: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` (q/k/v bias), with
  grouped-query attention (kv heads fewer than ranks are replicated); Qwen3: per-head q/k norms;
* GPT-2: ``Conv1D`` weights stored (in, out), fused ``c_attn`` split into q/k/v, vocabulary 50257
  padded to a multiple of the axis;
* Gemma, Gemma 2, Gemma 3 (text): the scaled embedding vocabulary-parallel with its scale
  (``VocabParallel(scale="embed_scale")``, still tied to the head); Gemma 2/3's final-logit
  soft-capping is elementwise, so the head's vocabulary shards are capped where they are;
  attention soft-capping, ``query_pre_attn_scalar`` and the sliding windows run inside each
  rank's heads; Gemma 3's per-head ``q_norm``/``k_norm`` are pvary'd;
* Phi-3 and Phi-4: the fused ``qkv_proj`` (``[q | k | v]``) split by heads, the fused
  ``gate_up_proj`` as two parts; its attention slices ``qkv`` with
  ``self.config.num_attention_heads``, so each attention gets a per-rank config view;
* GPT-NeoX / Pythia: ``query_key_value`` laid out per head (``(heads, 3, head_dim)``);
* Falcon: the new decoder architecture (``query_key_value`` grouped by kv head), multi-query
  (every rank holds the fused weight whole and projects its heads' rows) and the original
  per-head layout (`fastdist.nn.plans.hooks.falcon_variant`); ALiBi is refused;
* StableLM: per-head q/k LayerNorm lists (each rank applies its heads' norms), partial rotary
  (`fastdist.nn.plans.hooks.stablelm_variant`);
* OLMo and OLMo-2: OLMo-2's ``q_norm``/``k_norm`` are RMSNorms over the whole projection, their
  sums of squares summed over the axis (`HeadParallelAttention`'s ``full_width_norms``).

The LM head is vocabulary-parallel: ``logits`` are this rank's columns ``(batch, seq,
V_padded / n)`` unless ``gather_logits``; the model's ``loss_function`` becomes
`fastdist.nn.causal_lm_loss`, so ``model(input_ids, labels=...)`` returns the whole vocabulary's
loss as the single-device model does. The table of what is tested for each is in
``docs/models.md``.
"""

from __future__ import annotations

from dataclasses import replace

from fastdist.nn.plans.family import Family, Mlp
from fastdist.nn.plans.hooks import falcon_variant, stablelm_variant

__all__ = ["DENSE"]


def _kv_groups(hq: int, hkv: int, d: int) -> int:
    return hq // hkv


def _split_width(hq: int, hkv: int, d: int) -> int:
    return hq * d


_NEOX_MLP = Mlp(up=("dense_h_to_4h",), down="dense_4h_to_h")

LLAMA = Family(("llama", "mistral", "qwen2"), attrs=(("num_key_value_groups", _kv_groups),))
QWEN3 = replace(LLAMA, model_types=("qwen3",), head_norms=("q_norm", "k_norm"))
GPT2 = Family(
    ("gpt2",),
    attention="attn",
    qkv="c_attn",
    o="c_proj",
    attrs=(("split_size", _split_width),),
    kv_heads=None,
    head_dim=None,
    mlps=(Mlp(up=("c_fc",), down="c_proj"),),
    prefix="transformer",
    layers="h",
    embed="wte",
    final_norm="ln_f",
    norms=("ln_1", "ln_2"),
)
GEMMA = Family(("gemma",), embed_scale="embed_scale")
GEMMA2 = replace(
    GEMMA,
    model_types=("gemma2",),
    norms=GEMMA.norms + ("pre_feedforward_layernorm", "post_feedforward_layernorm"),
)
GEMMA3 = replace(GEMMA2, model_types=("gemma3_text",), head_norms=("q_norm", "k_norm"))
PHI3 = Family(
    ("phi3",),
    qkv="qkv_proj",
    mlps=(Mlp(up=("gate_up_proj",), fused=(("gate_up_proj", "intermediate_size"),)),),
)
GPT_NEOX = Family(
    ("gpt_neox",),
    prefix="gpt_neox",
    embed="embed_in",
    final_norm="final_layer_norm",
    attention="attention",
    kv_heads=None,
    head_dim=None,
    qkv="query_key_value",
    o="dense",
    qkv_layout="per_head",
    mlps=(_NEOX_MLP,),
)
# kv heads, q|k|v layout and norms by the variant (new decoder, multi-query, per head)
FALCON = replace(
    GPT_NEOX,
    model_types=("falcon",),
    prefix="transformer",
    layers="h",
    embed="word_embeddings",
    final_norm="ln_f",
    attention="self_attention",
    variant=falcon_variant,
)
STABLELM = Family(("stablelm",), head_dim=None, variant=stablelm_variant)
OLMO = Family(("olmo",))
OLMO2 = replace(
    OLMO,
    model_types=("olmo2",),
    norms=("post_attention_layernorm", "post_feedforward_layernorm"),
    full_width_norms=(("q_norm", "q"), ("k_norm", "k")),
)

#: the dense rows, in the order of the docs' table
DENSE: tuple[Family, ...] = (
    LLAMA,
    QWEN3,
    GPT2,
    GEMMA,
    GEMMA2,
    GEMMA3,
    PHI3,
    GPT_NEOX,
    FALCON,
    STABLELM,
    OLMO,
    OLMO2,
)
