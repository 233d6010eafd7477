"""Context parallelism of DiT families besides Wan (issue 38.2): diffusers'
``LTXVideoTransformer3DModel`` (LTX-Video: self-attention with 3-D rotary embeddings,
cross-attention to masked text states) in every mode, forward and backward against one device in
float64; and the refusal of a joint text-image attention whose processor the split does not know
(SD3's and Flux's plans: tests/test_context_mmdit.py; CogVideoX, QwenImage, Flux 2,
HunyuanVideo: tests/test_dit_families_joint.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

import fastdist as fd
from fastdist.errors import ParallelizeError
from tests.test_context_parallel import assert_grads
from tests.tiny_models import tiny_ltx

pytest.importorskip("diffusers.models.transformers.transformer_ltx")


def ltx_inputs(frames: int = 2, size: int = 3) -> dict[str, object]:
    """``frames * size * size`` patchified latent tokens, 5 text tokens (the last one masked)."""
    g = torch.Generator().manual_seed(1)
    tokens = frames * size * size
    mask = torch.ones(2, 5, dtype=torch.float64)
    mask[:, -1] = 0
    return {
        "hidden_states": torch.randn(2, tokens, 4, generator=g, dtype=torch.float64),
        "encoder_hidden_states": torch.randn(2, 5, 16, generator=g, dtype=torch.float64),
        "timestep": torch.tensor([3.0, 700.0], dtype=torch.float64),
        "encoder_attention_mask": mask,
        "num_frames": frames,
        "height": size,
        "width": size,
    }


@pytest.mark.parametrize(
    "axes,kw",
    [
        ({"sp": 2}, {}),
        ({"sp": 4}, {"mode": "ring"}),
        ({"cp": 2, "sp": 2}, {"mode": "usp", "ring_axis": "cp"}),
    ],
    ids=["ulysses-2", "ring-4", "usp-2x2"],
)
def test_ltx_video_equals_one_device(axes: dict[str, int], kw: dict[str, str]) -> None:
    """18 tokens: 9 + 9 over 2 ranks, 5 + 5 + 4 + 4 over 4."""
    model, x = tiny_ltx(), ltx_inputs()
    ref = copy.deepcopy(model)
    want = ref(**x).sample
    want.pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}  # type: ignore[union-attr]
    mesh = fd.Mesh(axes)
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.ltx_video(model, mesh, **kw))  # type: ignore[arg-type]
    n = mesh.size
    out = pm(**{k: v.expand(n, *v.shape) if isinstance(v, Tensor) else v for k, v in x.items()})
    out.sample.pow(2).sum().backward()
    for r in range(n):
        torch.testing.assert_close(out.sample[r].detach(), want.detach(), rtol=0, atol=1e-12)
    assert_grads(pm.grads(), grads)


def test_ltx_video_is_auto() -> None:
    mesh = fd.Mesh({"sp": 2})
    pm = fd.nn.parallelize(tiny_ltx(), mesh, "auto", verify=False)
    assert pm.plan == fd.nn.plans.ltx_video(axis="sp")


def test_unknown_joint_attention_is_refused() -> None:
    """A hand-written joint plan over a DiT whose attention processor the split does not know
    (AuraFlow's) is refused at ``parallelize``; a ready plan refuses a model of another class.
    (``plan="auto"`` over AuraFlow, and the joint families with ready plans:
    tests/test_dit_families_joint.py.)"""
    from diffusers import AuraFlowTransformer2DModel

    aura = AuraFlowTransformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
        caption_projection_dim=16, out_channels=4, pos_embed_max_size=16,
    )  # fmt: skip
    plan = fd.nn.ContextParallel(
        blocks="joint_transformer_blocks", attention=(), cross=(), joint=("attn",),
        single_blocks="single_transformer_blocks", joined=("attn",),
        whole=("pos_embed", "time_step_embed", "context_embedder"),
        feeds=("time_step_embed", "context_embedder"), rotary=None,
    )  # fmt: skip
    with pytest.raises(ParallelizeError, match=r"runs the processor AuraFlowAttnProcessor2_0"):
        fd.nn.parallelize(aura, fd.Mesh({"sp": 2}), {"": plan})
    with pytest.raises(ParallelizeError, match="not a diffusers LTXVideoTransformer3DModel"):
        fd.nn.plans.ltx_video(aura)


# ------------------------------------------------------------------ real ranks
def ltx_checkpointed_on_gloo() -> tuple[Tensor, dict[str, Tensor]]:
    """One gloo rank of sp=2 (ring), diffusers' gradient checkpointing on: a forward of 18
    tokens, one of 8 (2 frames of 2 x 2) never backpropagated, then the first one's backward
    (the recomputed blocks use their own forward's split); the output and every gradient."""
    mesh = fd.connect(sp=2, timeout=120)
    model = tiny_ltx()
    model.enable_gradient_checkpointing()  # type: ignore[operator]
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.ltx_video(mode="ring"))
    out = pm(**ltx_inputs()).sample
    pm(**ltx_inputs(size=2)).sample.sum()  # never backpropagated
    out.pow(2).sum().backward()
    return out.detach(), pm.grads()


def test_ltx_video_checkpointed_on_gloo() -> None:
    from tests.dist_harness import run_on_gloo

    ref = tiny_ltx()
    want = ref(**ltx_inputs()).sample
    want.pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}  # type: ignore[union-attr]
    for out, got in run_on_gloo(ltx_checkpointed_on_gloo, 2, timeout=300):
        torch.testing.assert_close(out, want.detach(), rtol=0, atol=1e-12)
        assert_grads(got, grads)
