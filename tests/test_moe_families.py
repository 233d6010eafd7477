"""The ready plans for the mixture-of-experts families (fastdist.nn.moe_plans) against one device,
in float64 on simulated ranks: logits, the loss with the router's aux loss where the model adds it,
every gradient, and two AdamW steps, over tp, ep and ep x tp. Tiny configs: hidden 32, 2 layers,
4 experts, vocabulary 61 (padded)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import fastdist as fd
from tests.test_hf_models import VOCAB, batch, full_logits, rep

transformers = pytest.importorskip("transformers")

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}
FAMILIES = ["qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss"]
MESHES = [{"tp": 2}, {"ep": 2}, {"ep": 2, "tp": 2}]


def build(family: str, seed: int = 0) -> Any:
    """A small single-device model of ``family`` in float64, eval mode, eager experts."""
    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        num_experts_per_tok=2,
        experts_implementation="eager",  # grouped_mm (the default) has no float64
    )
    router = dict(output_router_logits=True, router_aux_loss_coef=0.05)
    if family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            **common,
            **router,
            num_key_value_heads=2,
            intermediate_size=24,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=16,
            num_experts=4,
            mlp_only_layers=[0],  # layer 0 dense, layer 1 sparse
        )
        model = transformers.Qwen2MoeForCausalLM(cfg)
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **common,
            **router,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=24,
            moe_intermediate_size=8,
            num_experts=4,
            norm_topk_prob=True,
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(
            **common, **router, num_key_value_heads=2, intermediate_size=8, num_experts=4
        )
        model = transformers.OlmoeForCausalLM(cfg)
    elif family in ("deepseek_v2", "deepseek_v3"):
        mla = dict(
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
        if family == "deepseek_v2":
            # no q LoRA (q_proj by heads), every layer sparse, group-limited softmax routing
            cfg = transformers.DeepseekV2Config(
                **common,
                **mla,
                q_lora_rank=None,
                first_k_dense_replace=0,
                topk_method="group_limited_greedy",
            )
            model = transformers.DeepseekV2ForCausalLM(cfg)
        else:
            cfg = transformers.DeepseekV3Config(
                **common, **mla, q_lora_rank=16, first_k_dense_replace=1, rope_interleave=True
            )
            model = transformers.DeepseekV3ForCausalLM(cfg)
            for layer in model.model.layers[1:]:  # the correction bias (a buffer) takes part
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
    elif family == "gpt_oss":
        cfg = transformers.GptOssConfig(
            **common,
            **router,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=8,
            num_local_experts=4,
            sliding_window=3,  # layer 0 sliding, layer 1 full
            attn_implementation="eager",  # attention sinks
        )
        model = transformers.GptOssForCausalLM(cfg)
    else:
        raise AssertionError(family)
    model = model.to(F64).eval()
    with torch.no_grad():  # some inits leave zeros (routers, biases, sinks): random values
        for name, p in model.named_parameters():
            if p.abs().max() == 0 or "sinks" in name:
                p.normal_(0, 0.3)
    return model


def reference(model: Any, ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """(logits, loss, aux_loss) on one device; the cross-entropy in float64."""
    out = model(input_ids=ids)
    ce = F.cross_entropy(
        out.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    aux = getattr(out, "aux_loss", None)
    loss = ce if aux is None else ce + model.config.router_aux_loss_coef * aux
    return out.logits, loss, aux


@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "x".join(f"{k}{v}" for k, v in a.items()))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_one_device(
    family: str, axes: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = TOL
    if family.startswith("deepseek"):
        # DeepSeek's routers compute in float32 even in a float64 model
        # (``hidden_states.type(torch.float32)``, softmax in ``torch.float32``): here on both sides
        # in float64, so that everything must agree to 1e-10 (test_deepseek_float32_router: as
        # shipped)
        monkeypatch.setattr(torch, "float32", torch.float64)
    if family == "deepseek_v2":
        # its rotary embedding runs in complex64 (``xq.float()``) on both sides, so the gradients
        # of the rope features carry float32 rounding (~1e-7 relative; within 1e-10 absolute
        # here); AdamW's update lr * m / sqrt(v) is scale-free, so the weights after two steps
        # agree to lr * 1e-7
        weights = {"rtol": 1e-6, "atol": 1e-8}
    check_family(family, axes, TOL, TOL, weights)


def check_family(
    family: str,
    axes: dict[str, int],
    forward: dict[str, float],
    grads_tol: dict[str, float],
    weights: dict[str, float],
) -> None:
    """Logits, loss (+ aux loss), every gradient and two AdamW steps against one device, to the
    given tolerances."""
    ref = build(family)
    model = copy.deepcopy(ref)
    mesh = fd.Mesh(axes)
    pm = fd.nn.parallelize(model, mesh)  # plan_for by model_type
    vocab_axis = "tp" if "tp" in axes else "ep"
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for step in range(2):
        ids, labels = batch(10 + step)
        want_logits, want_loss, want_aux = reference(ref, ids, labels)
        out = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
        torch.testing.assert_close(
            full_logits(out.logits, mesh, vocab_axis), want_logits.detach(), **forward
        )
        if want_aux is not None:
            torch.testing.assert_close(out.aux_loss, rep(want_aux.detach(), mesh), **forward)
        torch.testing.assert_close(out.loss, rep(want_loss.detach(), mesh), **forward)
        want_loss.backward()
        out.loss.sum().backward()  # each rank's backward of its own (equal) loss
        grads = pm.grads()  # single-device view; replicas checked to agree
        assert grads.keys() == {n for n, _ in ref.named_parameters()}
        for name, p in ref.named_parameters():
            torch.testing.assert_close(
                grads[name],
                p.grad,
                **grads_tol,
                msg=lambda m, name=name, step=step: f"step {step} {name}: {m}",
            )
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    state = pm.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            state[name], p.detach(), **weights, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_float32_router(family: str) -> None:
    """As transformers ships them, DeepSeek's routers run in float32 in a float64 model; the
    float32 linear layer rounds differently in the simulation's batched kernels than in one
    device's, so the parallel model agrees with one device to float32's precision (router
    weights one float32 rounding apart)."""
    f32 = {"rtol": 1e-6, "atol": 1e-7}
    check_family(family, {"ep": 2, "tp": 2}, f32, f32, {"rtol": 1e-5, "atol": 1e-7})
