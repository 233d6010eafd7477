"""``plan="auto"`` on transformers decoder families nobody wrote a plan for, as a demanding user
brings them: each built from a tiny config in float64 (nothing downloaded), parameters that init
to zero or one perturbed (so a wrong shard of them shows), and compared with the unmodified model
on one device: logits, loss and every parameter's gradient after ``backward``, on simulated ranks
at tp=2 and tp=4, with sequence parallelism on and off. Either the parallel model equals one
device to float64 rounding, or ``parallelize`` refuses with a `ParallelizeError` naming the
module.

The bug this file was written for: `fastdist.nn.plans.auto` read the plan off the first decoder
block only. A model whose later blocks differ (dense MLPs in the first layers and experts in the
rest, as GLM-4-MoE, Ernie-4.5-MoE and DeepSeek-style models; a convolution or a recurrence in
place of the attention, as LFM2's conv layers) got the first block's entries on every block: its
expert blocks ran whole on every rank behind a ``pvary`` (on simulated ranks a vmap error at the
first call; on real ranks every rank's whole input gradient summed over tp), and with sequence
parallelism its conv layers ran on a rank's tokens only. ``verify`` did not stop either on a
model built on the meta device, whose two-layer check copy holds no such block (LFM2 with a conv
layer at index 2, sequence-parallel: logits off by 8e-5 instead of 1e-16).
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fastdist as fd

transformers = pytest.importorskip("transformers")

F64 = torch.float64
V = 64
EXACT = {"rtol": 1e-10, "atol": 1e-10}
#: Cohere's LayerNorm and Gemma-style norms compute in float32 (the model's own upcast)
FLOAT32 = {"rtol": 1e-6, "atol": 1e-6}

_BASE = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_GQA = dict(_BASE, num_key_value_heads=2)
_MOE = dict(_GQA, experts_implementation="eager")


def build(model_cls: str, config_cls: str, fields: dict[str, Any], perturb: bool = True) -> Any:
    """A tiny float64 model in eval mode (eager attention, seed 0); with ``perturb``, every
    parameter that inits to all zeros or all ones gets noise, so a misplaced one shows."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            cfg = getattr(transformers, config_cls)(**fields)
            cfg._attn_implementation = "eager"
            model = getattr(transformers, model_cls)(cfg)
        finally:
            logging.disable(logging.NOTSET)
    model = model.to(F64).eval()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                if p.abs().max() == 0 or bool((p == 1).all()):
                    p.add_(torch.randn_like(p) * 0.1)
    return model


def batch() -> tuple[Tensor, Tensor]:
    ids = torch.randint(3, V, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, -3:] = -100
    return ids, labels


def assert_matches_one_device(
    ref: nn.Module, pm: Any, mesh: fd.Mesh, tol: dict[str, float] = EXACT
) -> None:
    """Logits, loss and every parameter's gradient of ``pm`` (simulated ranks) equal ``ref``'s
    on one device."""
    ids, labels = batch()
    logits = ref(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
    loss.backward()
    n = mesh.size
    out = pm(input_ids=ids.expand(n, *ids.shape), labels=labels.expand(n, *labels.shape))
    got = torch.cat([out.logits[mesh.rank_of({"tp": i})] for i in range(n)], -1)[..., :V]
    torch.testing.assert_close(got, logits.detach(), **tol)
    torch.testing.assert_close(out.loss, loss.detach().expand(n), **tol)
    out.loss.sum().backward()
    grads = pm.grads()
    want = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
    assert want.keys() <= grads.keys()
    for k, g in want.items():
        torch.testing.assert_close(grads[k], g, **tol, msg=lambda m, k=k: f"{k}: {m}")


def parallel(model: nn.Module, tp: int, sp: bool) -> tuple[Any, fd.Mesh]:
    mesh = fd.Mesh({"tp": tp})
    if not sp:
        return fd.nn.parallelize(model, mesh, "auto"), mesh
    plan = fd.nn.plans.plan(model, mesh, family="auto", sequence_parallel=True)
    return fd.nn.parallelize(model, mesh, plan, verify=True), mesh


# ============================================================================ the families
#: id -> (model class, config class, fields, tp, sequence parallel, tolerance); what each adds
FAMILIES: dict[str, tuple[str, str, dict[str, Any], int, bool, dict[str, float]]] = {
    # partial rotary, per-head LayerNorm q/k norms, parallel attention + MLP, biased LM head
    "phi-qk-layernorm-sp": (
        "PhiForCausalLM",
        "PhiConfig",
        dict(_GQA, partial_rotary_factor=0.5, qk_layernorm=True),
        2,
        True,
        EXACT,
    ),
    "phi-tp4": (
        "PhiForCausalLM",
        "PhiConfig",
        dict(_BASE, partial_rotary_factor=0.5),
        4,
        False,
        EXACT,
    ),
    # GPT-J: rotary_dim, parallel residual, fused-free q/k/v without bias
    "gptj-tp4-sp": (
        "GPTJForCausalLM",
        "GPTJConfig",
        dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64),
        4,
        True,
        EXACT,
    ),
    # Starcoder2: biases everywhere, LayerNorm with bias, GQA with kv heads < tp
    "starcoder2-tp4-sp": ("Starcoder2ForCausalLM", "Starcoder2Config", _GQA, 4, True, EXACT),
    # Granite: embedding, residual, attention multipliers, logits scaling; tied
    "granite-tied-tp4-sp": (
        "GraniteForCausalLM",
        "GraniteConfig",
        dict(
            _GQA,
            tie_word_embeddings=True,
            embedding_multiplier=2.0,
            logits_scaling=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.3,
        ),
        4,
        True,
        EXACT,
    ),
    # Persimmon: fused per-head query_key_value, per-head q/k LayerNorms, partial rotary
    "persimmon-sp": (
        "PersimmonForCausalLM",
        "PersimmonConfig",
        dict(_BASE, qk_layernorm=True, partial_rotary_factor=0.5),
        2,
        True,
        EXACT,
    ),
    # GPTBigCode: multi-query c_attn [q | k | v] with one kv head, held whole on every rank
    "bigcode-mqa-tp4-sp": (
        "GPTBigCodeForCausalLM",
        "GPTBigCodeConfig",
        dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=True),
        4,
        True,
        EXACT,
    ),
    # Cohere: parallel residual, LayerNorm (float32), logit scale, tied embeddings
    "cohere-tp4": (
        "CohereForCausalLM",
        "CohereConfig",
        dict(_GQA, logit_scale=0.5),
        4,
        False,
        FLOAT32,
    ),
    # Nemotron: layernorm1p, partial rotary, relu^2 MLP without gate
    "nemotron-tp4-sp": (
        "NemotronForCausalLM",
        "NemotronConfig",
        dict(_GQA, partial_rotary_factor=0.5),
        4,
        True,
        EXACT,
    ),
    # GLM: interleaved partial rotary, fused gate_up_proj
    "glm-tp4": (
        "GlmForCausalLM",
        "GlmConfig",
        dict(_GQA, head_dim=8, partial_rotary_factor=0.5),
        4,
        False,
        EXACT,
    ),
    # GPT-Neo: local attention with window_size = 4, the head count by coincidence (a config
    # field the attention reads: was refused as a whole-model head count)
    "gptneo-window-tp4-sp": (
        "GPTNeoForCausalLM",
        "GPTNeoConfig",
        dict(
            vocab_size=V,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            max_position_embeddings=64,
        ),
        4,
        True,
        EXACT,
    ),
    # Gemma 4 (text): full-attention layers with their own head dim (global_head_dim): a block
    # group of their own; Gemma's norms in float32
    "gemma4-global-head-dim": (
        "Gemma4ForCausalLM",
        "Gemma4TextConfig",
        dict(
            _GQA,
            head_dim=8,
            global_head_dim=16,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=V,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
        2,
        False,
        FLOAT32,
    ),
}


@pytest.mark.parametrize("case", list(FAMILIES))
def test_auto_matches_one_device(case: str) -> None:
    model_cls, config_cls, fields, tp, sp, tol = FAMILIES[case]
    ref = build(model_cls, config_cls, fields)
    pm, mesh = parallel(copy.deepcopy(ref), tp, sp)
    assert_matches_one_device(ref, pm, mesh, tol)


# ============================================================================ blocks that differ
def test_dense_layers_then_experts_match_one_device() -> None:
    """GLM-4-MoE's first layer is a dense MLP, the next hold experts (first_k_dense_replace);
    Qwen2-MoE with mlp_only_layers=[0] the same: each group of blocks gets its own entries.
    Before, every block got the dense layer's entries (the experts whole on every rank behind
    a pvary): a vmap error here, every rank's input gradient summed over tp on real ranks."""
    glm = build(
        "Glm4MoeForCausalLM",
        "Glm4MoeConfig",
        dict(
            _MOE,
            head_dim=8,
            n_routed_experts=4,
            moe_intermediate_size=16,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
    )
    qwen = qwen_dense_then_experts()
    for ref in (glm, qwen):
        plan = fd.nn.plans.plan(ref, family="auto")
        assert isinstance(plan["model.layers.0.mlp.gate_proj"], fd.nn.ColwiseParallel)
        assert isinstance(plan["model.layers.1.mlp.experts"], fd.nn.moe.ExpertParallel)
        assert "model.layers.1.mlp.gate_proj" not in plan
        pm, mesh = parallel(copy.deepcopy(ref), 2, False)
        assert_matches_one_device(ref, pm, mesh)


def _meta(model_cls: str, config_cls: str, fields: dict[str, Any]) -> Any:
    cfg = getattr(transformers, config_cls)(**fields)
    cfg._attn_implementation = "eager"
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return getattr(transformers, model_cls)(cfg).eval()


_QWEN_DENSE_FIRST = dict(
    _MOE,
    num_hidden_layers=4,
    num_experts=4,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    mlp_only_layers=[0, 1],
)


def test_meta_model_with_experts_past_the_check_copy() -> None:
    """On the meta device verify checks a two-layer copy, which holds only the dense layers
    here: before, parallelize accepted a plan without the experts. Now the plan has them (and
    equals one device once initialised); verify, which cannot build the experts' layers,
    refuses instead of passing."""
    model = _meta("Qwen2MoeForCausalLM", "Qwen2MoeConfig", _QWEN_DENSE_FIRST)
    plan = fd.nn.plans.plan(model, family="auto")
    assert "model.layers.*.mlp" not in plan
    for i in (2, 3):
        assert isinstance(plan[f"model.layers.{i}.mlp.experts"], fd.nn.moe.ExpertParallel)
    mesh = fd.Mesh({"tp": 2})
    with pytest.raises(fd.nn.ParallelizeError, match=r"model\.layers\.2\.mlp\.experts"):
        fd.nn.parallelize(model, mesh, "auto")
    pm = fd.nn.parallelize(model, mesh, "auto", verify=False)
    one = _meta("Qwen2MoeForCausalLM", "Qwen2MoeConfig", _QWEN_DENSE_FIRST)
    fd.nn.init_weights(pm, seed=0, dtype=F64)
    fd.nn.init_weights(one, seed=0, dtype=F64)
    ids, _ = batch()
    want = one(input_ids=ids).logits
    got = pm(input_ids=ids.expand(2, *ids.shape)).logits
    torch.testing.assert_close(torch.cat([got[0], got[1]], -1)[..., :V], want, **EXACT)


_LFM2 = dict(_GQA, num_hidden_layers=4)


def test_sequence_parallelism_over_a_conv_layer_is_refused() -> None:
    """LFM2 with a short-convolution layer at index 2: sequence-parallel, the conv would see a
    rank's tokens only. Before, a model on the meta device passed verify (its two-layer copy
    holds attention layers only) and gave logits off by 8e-5."""
    fields = dict(_LFM2, layer_types=["full_attention", "full_attention", "conv", "full_attention"])
    model = _meta("Lfm2ForCausalLM", "Lfm2Config", fields)
    with pytest.raises(
        fd.nn.ParallelizeError, match=r"model\.layers\.2 .*conv .*sequence_parallel=False"
    ):
        fd.nn.plans.plan(model, fd.Mesh({"tp": 2}), family="auto", sequence_parallel=True)


@pytest.mark.parametrize("order", [["full_attention", "conv"], ["conv", "full_attention"]])
def test_conv_layers_run_whole_without_sequence_parallelism(order: list[str]) -> None:
    """The conv layers keep their mixer whole on every rank (their MLPs split); the attention
    layers split by heads, whichever comes first (a conv first was refused: no attention in
    layers.0)."""
    ref = build("Lfm2ForCausalLM", "Lfm2Config", dict(_GQA, layer_types=order))
    conv = order.index("conv")
    plan = fd.nn.plans.plan(ref, family="auto")
    assert f"model.layers.{conv}.self_attn" not in plan
    assert f"model.layers.{1 - conv}.self_attn" in plan
    assert f"model.layers.{conv}.feed_forward.w1" in plan
    pm, mesh = parallel(copy.deepcopy(ref), 2, False)
    assert_matches_one_device(ref, pm, mesh)


# ============================================================================ refusals
#: id -> (model class, config class, fields, the refusal)
REFUSED: dict[str, tuple[str, str, dict[str, Any], str]] = {
    # no attention anywhere: a state-space model
    "mamba": (
        "MambaForCausalLM",
        "MambaConfig",
        dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=4, conv_kernel=4),
        r"no attention found in backbone\.layers\.0 \(MambaBlock\)",
    ),
    # q/k LayerNorms with a (heads, head_dim) weight: per head, not one shared norm
    "cohere-qk-norm": (
        "CohereForCausalLM",
        "CohereConfig",
        dict(_GQA, use_qk_norm=True),
        r"'model\.layers\.0\.self_attn' \(CohereAttention\) has a child 'q_norm'",
    ),
    # ALiBi slopes for all heads, built inside the attention
    "mpt-alibi": (
        "MptForCausalLM",
        "MptConfig",
        dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=64),
        r"'transformer\.blocks\.0\.attn' \(MptAttention\) .*raised RuntimeError",
    ),
    # differential attention pairs head h with head h + heads / 2 (torch.chunk over heads)
    "diffllama": (
        "DiffLlamaForCausalLM",
        "DiffLlamaConfig",
        _GQA,
        r"'model\.layers\.0\.self_attn' \(DiffLlamaAttention\)",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_auto_refuses(case: str) -> None:
    model_cls, config_cls, fields, refusal = REFUSED[case]
    model = build(model_cls, config_cls, fields)
    with pytest.raises(fd.nn.ParallelizeError, match=refusal):
        fd.nn.parallelize(model, fd.Mesh({"tp": 2}), "auto")
    assert not any(type(m).__module__.startswith("fastdist.") for m in model.modules())


# ============================================================================ real processes
def qwen_dense_then_experts(**extra: Any) -> Any:
    """A tiny float64 Qwen2-MoE (seed 0): layer 0 a dense MLP, layer 1 a sparse expert block (4
    experts, a shared expert); ``extra`` config fields on top (e.g. ``num_experts_per_tok``)."""
    return build(
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            _MOE,
            num_experts=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            mlp_only_layers=[0],
            **extra,
        ),
    )


def dense_then_experts_on_gloo() -> dict[str, float]:
    """One gloo rank: ``parallelize(model, mesh, "auto")`` (verified) on a Qwen2-MoE whose first
    layer is dense; every gradient's largest difference from one device, relative to its size."""
    ref = qwen_dense_then_experts()
    mesh = fd.connect(tp=2, timeout=60)
    pm = fd.nn.parallelize(copy.deepcopy(ref), mesh, "auto")
    ids, labels = batch()
    logits = ref(input_ids=ids).logits
    F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1)).backward()
    pm(input_ids=ids, labels=labels).loss.backward()
    grads = pm.grads()
    return {
        k: float((grads[k] - p.grad).abs().max() / p.grad.abs().max())
        for k, p in ref.named_parameters()
        if p.grad is not None
    }


def test_dense_then_experts_on_two_gloo_processes() -> None:
    """Real ranks, where the old plan ran silently: verify passed it (the forward is one
    device's) and every gradient before an expert block came out wrong (the block's input
    gradient, whole on every rank, summed over tp: 1.0 relative in
    model.layers.1.post_attention_layernorm.weight)."""
    from tests.dist_harness import run_on_gloo

    for diffs in run_on_gloo(dense_then_experts_on_gloo, 2, timeout=300):
        worst = max(diffs, key=diffs.__getitem__)
        assert diffs[worst] < 1e-10, (worst, diffs[worst])
