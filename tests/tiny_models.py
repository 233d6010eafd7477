"""The tiny Hugging Face models every test builds: one config table per family, built from random
init (nothing is downloaded) under a fixed seed, in float64 and eval mode by default.

``build(family, ...)`` is the one entry point: the dense families of ``fastdist.nn.plans`` (hidden
32, 2 layers, 4 query heads, ``kv`` key-value heads, vocabulary 61: prime, so every tp size pads
it), the mixture-of-experts families (4 experts, top-2, eager experts: grouped_mm has no float64)
and Falcon's three attention layouts (``falcon:new``, ``falcon:mqa``, ``falcon:per_head``).
Keyword overrides replace any config field. ``auto_zoo`` is the wider set the automatic plan is
checked on (with pad/bos/eos token ids), and ``tiny_llama`` / ``llama_config`` the small Llamas
the pipeline tests run on many processes. The diffusers DiTs (``tiny_wan`` / ``wan_config``,
``tiny_ltx``, ``tiny_sd3``, ``tiny_flux``, ``tiny_cogvideox``, ``tiny_hunyuan_video``) take the
sizes the tests vary (heads, layers, seed). Workers import this module as ``tests.tiny_models``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

F64 = torch.float64
VOCAB = 61  # prime: padded to a multiple of every tp size
#: MoE families: experts computed one by one (grouped_mm, the default, has no float64)
EAGER = dict(num_experts_per_tok=2, experts_implementation="eager")

Fields = Callable[[int, int, int], dict[str, Any]]  # (kv, layers, vocab) -> config fields


def _dense(kv: int, layers: int, vocab: int) -> dict[str, Any]:
    return dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv,
        max_position_embeddings=64,
    )


def _falcon(kv: int, layers: int, vocab: int) -> dict[str, Any]:
    return dict(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=64,
        alibi=False,
    )


def _moe(kv: int, layers: int, vocab: int) -> dict[str, Any]:
    return dict(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=64,
        **EAGER,
    )


#: the router's aux loss in the model's loss (the families whose models add it)
_ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.05)


# Gemma 2/3: soft-capped logits and attention, query_pre_attn_scalar != head_dim, sliding windows
# (4) shorter than the tests' sequences (8) on alternate layers
_GEMMA23 = dict(
    head_dim=8,
    query_pre_attn_scalar=16,
    sliding_window=4,
    final_logit_softcapping=3.0,
    attn_logit_softcapping=2.0,
)
# DeepSeek-V2/V3: multi-head latent attention, a shared expert, grouped routing
_MLA = dict(
    num_key_value_heads=4,
    intermediate_size=24,
    moe_intermediate_size=8,
    n_routed_experts=4,
    n_shared_experts=1,
    kv_lora_rank=12,
    qk_rope_head_dim=4,
    qk_nope_head_dim=6,
    v_head_dim=8,
    n_group=2,
    topk_group=1,
)


def _row(base: Fields, **fields: Any) -> Fields:
    return lambda kv, layers, vocab: {**base(kv, layers, vocab), **fields}


def _without_kv(kv: int, layers: int, vocab: int) -> dict[str, Any]:
    fields = _dense(kv, layers, vocab)
    del fields["num_key_value_heads"]
    return fields


def _gpt2(kv: int, layers: int, vocab: int) -> dict[str, Any]:
    return dict(vocab_size=vocab, n_embd=32, n_layer=layers, n_head=4, n_positions=64)


#: family -> (model class, config class, config fields); classes by their transformers names
FAMILIES: dict[str, tuple[str, str, Fields]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", _row(_dense, attention_bias=True)),
    "mistral": ("MistralForCausalLM", "MistralConfig", _row(_dense, sliding_window=5)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", _dense),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", _row(_dense, head_dim=8)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", _row(_dense, head_dim=8)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", _row(_dense, **_GEMMA23)),
    "gemma3_text": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        _row(_dense, **_GEMMA23, layer_types=["sliding_attention", "full_attention"]),
    ),
    "phi3": (
        "Phi3ForCausalLM",
        "Phi3Config",
        _row(_dense, pad_token_id=0, eos_token_id=1, bos_token_id=2),
    ),
    "gpt_neox": (
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        _row(_without_kv, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
    ),
    "gpt2": (
        "GPT2LMHeadModel",
        "GPT2Config",
        _row(_gpt2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    ),
    # Falcon-40B/180B: grouped q|k|v, two layer norms, parallel attention
    "falcon:new": (
        "FalconForCausalLM",
        "FalconConfig",
        lambda kv, layers, vocab: {
            **_falcon(kv, layers, vocab),
            "bias": False,
            "new_decoder_architecture": True,
            "num_kv_heads": kv,
        },
    ),
    # Falcon-7B: multi-query ([q heads | k | v]), parallel attention
    "falcon:mqa": (
        "FalconForCausalLM",
        "FalconConfig",
        _row(_falcon, bias=False, new_decoder_architecture=False, multi_query=True),
    ),
    # the original layout: per-head q|k|v, sequential attention then MLP
    "falcon:per_head": (
        "FalconForCausalLM",
        "FalconConfig",
        _row(
            _falcon,
            bias=True,
            new_decoder_architecture=False,
            multi_query=False,
            parallel_attn=False,
        ),
    ),
    # per-head q/k LayerNorms, a quarter of each head rotated, q/k/v bias
    "stablelm": (
        "StableLmForCausalLM",
        "StableLmConfig",
        _row(_dense, qk_layernorm=True, eos_token_id=1, bos_token_id=2),
    ),
    "olmo": (
        "OlmoForCausalLM",
        "OlmoConfig",
        _row(_dense, clip_qkv=0.5, pad_token_id=0, eos_token_id=1),
    ),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", _row(_dense, pad_token_id=0, eos_token_id=1)),
    # mixture of experts
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        _row(_moe, **_ROUTER, num_key_value_heads=2, intermediate_size=8, num_local_experts=4),
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        _row(
            _moe,
            **_ROUTER,
            num_key_value_heads=2,
            intermediate_size=24,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=16,
            num_experts=4,
            mlp_only_layers=[0],  # layer 0 dense, layer 1 sparse
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        _row(
            _moe,
            **_ROUTER,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=24,
            moe_intermediate_size=8,
            num_experts=4,
            norm_topk_prob=True,
        ),
    ),
    "olmoe": (
        "OlmoeForCausalLM",
        "OlmoeConfig",
        _row(_moe, **_ROUTER, num_key_value_heads=2, intermediate_size=8, num_experts=4),
    ),
    # no q LoRA (q_proj by heads), every layer sparse, group-limited softmax routing
    "deepseek_v2": (
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        _row(
            _moe,
            **_MLA,
            q_lora_rank=None,
            first_k_dense_replace=0,
            topk_method="group_limited_greedy",
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        _row(_moe, **_MLA, q_lora_rank=16, first_k_dense_replace=1, rope_interleave=True),
    ),
    "gpt_oss": (
        "GptOssForCausalLM",
        "GptOssConfig",
        _row(
            _moe,
            **_ROUTER,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=8,
            num_local_experts=4,
            sliding_window=3,  # layer 0 sliding, layer 1 full
            attn_implementation="eager",  # attention sinks
        ),
    ),
}
FAMILIES["falcon"] = FAMILIES["falcon:new"]


def config(
    family: str, *, kv: int = 2, layers: int = 2, vocab: int = VOCAB, **overrides: Any
) -> Any:
    """The tiny config of ``family`` (a key of `FAMILIES`); ``overrides`` replace any field."""
    import transformers

    _, cls, fields = FAMILIES[family]
    return getattr(transformers, cls)(**{**fields(kv, layers, vocab), **overrides})


def instantiate(
    family: str, *, kv: int = 2, layers: int = 2, vocab: int = VOCAB, **overrides: Any
) -> Any:
    """``family``'s model class on its tiny `config`, as constructed (the default dtype, train
    mode, the current RNG state): e.g. under ``torch.device("meta")``."""
    import transformers

    cfg = config(family, kv=kv, layers=layers, vocab=vocab, **overrides)
    return getattr(transformers, FAMILIES[family][0])(cfg)


def build(
    family: str,
    *,
    kv: int = 2,
    layers: int = 2,
    vocab: int = VOCAB,
    seed: int = 0,
    dtype: torch.dtype = F64,
    fill_zeros: bool = False,
    **overrides: Any,
) -> Any:
    """A tiny single-device model of ``family`` initialised under ``torch.manual_seed(seed)``,
    in ``dtype``, eval mode (no dropout). DeepSeek-V3's score-correction bias (a zero buffer) is
    drawn at init, so that it takes part. ``fill_zeros``: `randomize_zeros` after the cast."""
    torch.manual_seed(seed)
    model = instantiate(family, kv=kv, layers=layers, vocab=vocab, **overrides)
    if family == "deepseek_v3":
        for layer in model.model.layers[model.config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
    model = model.to(dtype).eval()
    if fill_zeros:
        randomize_zeros(model)
    return model


def randomize_zeros(model: nn.Module, std: float = 0.3) -> None:
    """Random values (normal, ``std``) for the parameters some inits leave all zero (routers,
    biases) and for attention sinks, so that a wrong shard of them shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_meta and (p.abs().max() == 0 or "sinks" in name):
                p.normal_(0, std)


# ============================================================================ the automatic plan
#: the zoo ``family="auto"`` / ``plan="auto"`` is checked on (tests/test_verify_auto.py): dense,
#: MoE and families with no ready plan, with pad/bos/eos token ids
_AUTO_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_AUTO_SMALL = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4)
_AUTO: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(_AUTO_COMMON, attention_bias=True)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(_AUTO_COMMON, sliding_window=5)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", _AUTO_COMMON),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(_AUTO_COMMON, head_dim=8)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(_AUTO_COMMON, head_dim=8)),
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(_AUTO_COMMON, head_dim=8, sliding_window=5),
    ),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", _AUTO_COMMON),
    "gpt_neox": (
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        dict(_AUTO_SMALL, hidden_size=32, intermediate_size=48),
    ),
    "gpt2": (
        "GPT2LMHeadModel",
        "GPT2Config",
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    ),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(_AUTO_SMALL, hidden_size=32)),
    "falcon_new": (
        "FalconForCausalLM",
        "FalconConfig",
        dict(_AUTO_SMALL, hidden_size=32, num_kv_heads=2, new_decoder_architecture=True),
    ),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", _AUTO_COMMON),
    "olmo": ("OlmoForCausalLM", "OlmoConfig", _AUTO_COMMON),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", _AUTO_COMMON),
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(_AUTO_COMMON, num_local_experts=4, **EAGER),
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            _AUTO_COMMON,
            num_experts=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            **EAGER,
        ),
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(_AUTO_COMMON, head_dim=8, sliding_window=5),
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(_AUTO_COMMON, head_dim=8, num_experts=4, moe_intermediate_size=16, **EAGER),
    ),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(_AUTO_COMMON, num_experts=4, **EAGER)),
    "gpt_oss": (
        "GptOssForCausalLM",
        "GptOssConfig",
        dict(_AUTO_COMMON, head_dim=8, num_local_experts=4, **EAGER),
    ),
    "codegen": (
        "CodeGenForCausalLM",
        "CodeGenConfig",
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4),
    ),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(_AUTO_SMALL, hidden_size=32)),
    "opt": (
        "OPTForCausalLM",
        "OPTConfig",
        dict(_AUTO_SMALL, hidden_size=32, ffn_dim=48, max_position_embeddings=64),
    ),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(
            _AUTO_COMMON,
            n_routed_experts=4,
            moe_intermediate_size=16,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            **EAGER,
        ),
    ),
}
AUTO_FAMILIES = tuple(_AUTO)


def auto_zoo(family: str) -> Any:
    """A tiny float64 model of ``family`` (one of `AUTO_FAMILIES`) in eval mode, seed 0, as the
    automatic plan is checked on; transformers' warnings and logs about the configs silenced."""
    import transformers

    model_cls, config_cls, fields = _AUTO[family]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            cfg = getattr(transformers, config_cls)(**fields)
            model = getattr(transformers, model_cls)(cfg)
        finally:
            logging.disable(logging.NOTSET)
    return model.to(F64).eval()


# ============================================================================ pipeline Llamas
def llama_config(**overrides: Any) -> Any:
    """A small ``LlamaConfig`` that runs in float64 on CPU: 4 layers, hidden 32, GQA (4 query
    heads, 2 key-value heads), vocabulary 128, eager attention, untied embeddings (the LM head
    lives on the last stage, the embedding on the first). ``overrides`` replace any field."""
    from transformers import LlamaConfig

    kw: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_llama(layers: int = 4, seed: int = 0, vocab: int = 64) -> nn.Module:
    """A float64 Llama small enough for 8 processes on 2 cores, in train mode: hidden 16, GQA (4
    query heads, 2 key-value heads), vocabulary 64, untied embeddings (the LM head lives on the
    last stage), eager attention."""
    from transformers import LlamaForCausalLM

    cfg = llama_config(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(F64).train()


def tiny_mixtral(seed: int = 0, **overrides: Any) -> nn.Module:
    """A 1-layer float64 Mixtral: hidden 16, 4 query heads and 2 key-value heads, 4 experts of 8
    features, top 2, vocabulary 64, transformers' eager experts loop (its grouped-mm path takes
    no float64). ``overrides`` replace any config field (``router_jitter_noise=``, ...); the
    model's mode is as built."""
    from transformers import MixtralConfig, MixtralForCausalLM

    kw: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_implementation="eager",
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(**kw)).to(F64)


# ============================================================================ diffusers DiTs
# Each builder takes the sizes the tests vary; ``overrides`` replace any other config field. The
# widths that must equal the attention width ``heads * head_dim`` (SD3's caption projection,
# LTX's cross-attention, Wan I2V's added key-value projections) follow ``heads``.
def _dit(name: str, seed: int, fields: dict[str, Any]) -> nn.Module:
    """diffusers' ``name`` of ``fields``, random init under ``seed``, in float64 and train mode
    (as diffusers builds it); nothing is downloaded."""
    import diffusers

    torch.manual_seed(seed)
    return getattr(diffusers, name)(**fields).to(F64)


def wan_config(
    heads: int = 2, head_dim: int = 12, layers: int = 2, i2v: bool = False, **overrides: Any
) -> dict[str, Any]:
    """The fields of a tiny ``WanTransformer3DModel``: ``layers`` blocks of ``heads`` heads of
    ``head_dim`` (12: a 3-D RoPE of 4 frame + 4 height + 4 width dims), patch (1, 2, 2), 4 latent
    channels, text width 16; with ``i2v``, Wan image-to-video's image projections (image states
    of width 8, ``added_kv_proj_dim`` the attention width)."""
    fields: dict[str, Any] = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=layers,
        rope_max_seq_len=32,
    )
    if i2v:
        fields.update(image_dim=8, added_kv_proj_dim=heads * head_dim)
    return {**fields, **overrides}


def tiny_wan(
    heads: int = 2,
    head_dim: int = 12,
    layers: int = 2,
    seed: int = 0,
    i2v: bool = False,
    **overrides: Any,
) -> nn.Module:
    """A tiny float64 Wan text-to-video (with ``i2v``: image-to-video) transformer of
    `wan_config`'s fields."""
    return _dit(
        "WanTransformer3DModel", seed, wan_config(heads, head_dim, layers, i2v, **overrides)
    )


def tiny_ltx(heads: int = 4, layers: int = 2, seed: int = 0) -> nn.Module:
    """A tiny float64 LTX-Video transformer: ``layers`` blocks of ``heads`` heads of 12 (a 3-D
    RoPE), cross-attention to text of width 16 projected to the attention width."""
    fields = dict(
        in_channels=4,
        out_channels=4,
        num_attention_heads=heads,
        attention_head_dim=12,
        cross_attention_dim=heads * 12,
        num_layers=layers,
        caption_channels=16,
    )
    return _dit("LTXVideoTransformer3DModel", seed, fields)


def tiny_sd3(heads: int = 4, layers: int = 2, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny float64 SD3 (MM-DiT): ``layers`` joint blocks (the last one ``context_pre_only``)
    of ``heads`` heads of 8, patch 1 on an 8 x 8 sample, text of width 16 projected to the
    attention width, pooled text of width 8; ``overrides`` (SD3.5's ``dual_attention_layers``,
    ``qk_norm``) replace any field."""
    fields = dict(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        num_layers=layers,
        attention_head_dim=8,
        num_attention_heads=heads,
        joint_attention_dim=16,
        caption_projection_dim=heads * 8,
        pooled_projection_dim=8,
        out_channels=4,
        pos_embed_max_size=8,
    )
    return _dit("SD3Transformer2DModel", seed, {**fields, **overrides})


def tiny_flux(heads: int = 4, seed: int = 0) -> nn.Module:
    """A tiny float64 Flux: 2 double-stream and 2 single-stream blocks of ``heads`` heads of 8,
    patch 1, 3-axis rotary (2, 2, 4), text of width 16, pooled text of width 8."""
    fields = dict(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=8,
        num_attention_heads=heads,
        joint_attention_dim=16,
        pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4),
    )
    return _dit("FluxTransformer2DModel", seed, fields)


def tiny_cogvideox(
    heads: int = 4,
    layers: int = 2,
    size: int = 6,
    rotary: bool = True,
    seed: int = 0,
    **overrides: Any,
) -> nn.Module:
    """A tiny float64 CogVideoX: ``layers`` blocks (each updates the text stream too) of
    ``heads`` heads of 8, 5 sample frames (3 latent frames) of ``size`` x ``size`` in patches
    of 2, 5 text tokens of width 16, ``rotary`` positional embeddings (tables given as a model
    input); ``overrides`` (CogVideoX 1.5's ``patch_size_t``, ``ofs_embed_dim``) replace any
    field."""
    fields = dict(
        num_attention_heads=heads,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        time_embed_dim=8,
        text_embed_dim=16,
        num_layers=layers,
        sample_width=size,
        sample_height=size,
        sample_frames=5,
        patch_size=2,
        temporal_compression_ratio=2,
        max_text_seq_length=5,
        use_rotary_positional_embeddings=rotary,
    )
    return _dit("CogVideoXTransformer3DModel", seed, {**fields, **overrides})


def tiny_hunyuan_video(
    heads: int = 4, layers: int = 1, single_layers: int = 1, seed: int = 0, **overrides: Any
) -> nn.Module:
    """A tiny float64 HunyuanVideo: ``layers`` double- and ``single_layers`` single-stream
    blocks of ``heads`` heads of 8, a 1-layer token refiner, patch 1, rotary (2, 2, 4), text of
    width 16, pooled text of width 8; ``overrides`` (``image_condition_type``) replace any
    field."""
    fields = dict(
        in_channels=4,
        out_channels=4,
        num_attention_heads=heads,
        attention_head_dim=8,
        num_layers=layers,
        num_single_layers=single_layers,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 2, 4),
    )
    return _dit("HunyuanVideoTransformer3DModel", seed, {**fields, **overrides})
