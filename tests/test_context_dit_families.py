"""Context parallelism of DiT families besides Wan (issue 38.2): diffusers'
``LTXVideoTransformer3DModel`` (LTX-Video: self-attention with 3-D rotary embeddings,
cross-attention to masked text states) in every mode, forward and backward against one device in
float64; and the refusal of the joint text-image attention families without a plan (CogVideoX,
QwenImage; SD3's and Flux's plans are in tests/test_context_mmdit.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import fastdist as fd
from fastdist.errors import ParallelizeError
from tests.test_context_parallel import assert_grads

ltx = pytest.importorskip("diffusers.models.transformers.transformer_ltx")


def tiny_ltx(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = ltx.LTXVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=4,
        attention_head_dim=12,
        cross_attention_dim=48,
        num_layers=2,
        caption_channels=16,
    )
    return model.to(torch.float64)


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


def test_joint_attention_families_are_refused() -> None:
    """CogVideoX and QwenImage (joint attention, no plan) are refused by ``plan="auto"``; a
    hand-written joint plan over CogVideoX is refused at ``parallelize`` (its processor joins the
    text before ``to_q``, which the split does not know)."""
    from diffusers import CogVideoXTransformer3DModel, QwenImageTransformer2DModel

    cog = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        time_embed_dim=8, text_embed_dim=16, num_layers=1, sample_width=4, sample_height=4,
        sample_frames=3, patch_size=2, temporal_compression_ratio=2, max_text_seq_length=4,
    )  # fmt: skip
    qwen = QwenImageTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    for model in (cog, qwen):
        kind = type(model).__name__
        with pytest.raises(ParallelizeError, match=f"{kind} .* joint text-image attention"):
            fd.nn.parallelize(model, fd.Mesh({"sp": 2}), "auto", verify=False)
    plan = fd.nn.ContextParallel(
        blocks="transformer_blocks", attention=(), cross=(), joint=("attn1",),
        whole=("patch_embed", "time_embedding"), feeds=("time_embedding",), rotary=None,
    )  # fmt: skip
    with pytest.raises(ParallelizeError, match=r"runs the processor CogVideoXAttnProcessor2_0"):
        fd.nn.parallelize(cog, fd.Mesh({"sp": 2}), {"": plan})
    with pytest.raises(ParallelizeError, match="not a diffusers LTXVideoTransformer3DModel"):
        fd.nn.plans.ltx_video(cog)
