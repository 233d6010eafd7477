"""The mixture-of-experts families' rows (by ``config.model_type``).

* Mixtral: attention by heads, experts over the expert axis;
* Qwen2-MoE: Llama-style attention (q/k/v bias) by heads; routed experts over the expert axis;
  the shared expert column/row-parallel over the tensor axis; the router and
  ``shared_expert_gate`` replicated; dense layers (``mlp_only_layers``, ``decoder_sparse_step``:
  `fastdist.nn.plans.hooks.qwen_moe_layers`) over the tensor axis;
* Qwen3-MoE: as Qwen2-MoE without a shared expert, with per-head q/k norms;
* OLMoE: attention by heads with its whole-width ``q_norm``/``k_norm`` (statistics summed over
  the tensor axis);
* DeepSeek-V2/V3: multi-head latent attention (`fastdist.nn.plans.hooks.LatentAttention`): the
  per-head projections by heads, the latent projections and their norms replicated; routed
  experts over the expert axis, shared experts over the tensor axis, the first
  ``first_k_dense_replace`` dense MLPs over the tensor axis; the router (softmax or sigmoid
  scores, group-limited top-k) replicated;
* GPT-OSS: attention by heads with each rank's attention sinks (``head_params``), alternating
  sliding windows as the model computes them; its experts' transposed, interleaved, biased layout.

Every row keeps the router replicated (one device's routing, ``router_logits`` and aux loss).
With the tensor axis equal to the expert axis (a mesh with only ``ep``, or only ``tp``) the same
ranks are the attention's tensor-parallel group and the experts' group, and every expert is whole
on its rank. With ``sequence_parallel`` each MoE block runs on the whole sequence
(`fastdist.nn.plans.hooks.SequenceGather`), so routing and the aux loss stay one device's.
"""

from __future__ import annotations

from dataclasses import replace

from fastdist.nn.plans.family import Family, Mlp
from fastdist.nn.plans.hooks import deepseek_moe_layers, latent_attention, qwen_moe_layers

__all__ = ["MOE"]

MIXTRAL = Family(("mixtral",), experts=("mlp.experts",))
QWEN2_MOE = replace(
    MIXTRAL,
    model_types=("qwen2_moe",),
    shared=(Mlp("shared_expert"),),
    moe_layers=qwen_moe_layers,
)
QWEN3_MOE = replace(
    MIXTRAL,
    model_types=("qwen3_moe",),
    head_norms=("q_norm", "k_norm"),
    moe_layers=qwen_moe_layers,
)
OLMOE = replace(
    MIXTRAL, model_types=("olmoe",), full_width_norms=(("q_norm", "q"), ("k_norm", "k"))
)
DEEPSEEK = replace(
    MIXTRAL,
    model_types=("deepseek_v2", "deepseek_v3"),
    shared=(Mlp("shared_experts"),),
    attention_style=latent_attention,
    moe_layers=deepseek_moe_layers,
)
GPT_OSS = replace(MIXTRAL, model_types=("gpt_oss",), head_params=("sinks",))

#: the MoE rows, in the order of the docs' table
MOE: tuple[Family, ...] = (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE, DEEPSEEK, GPT_OSS)
