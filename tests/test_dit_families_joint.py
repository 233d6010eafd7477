"""Context parallelism of the joint text-image DiT families whose ready plans came with issue
38.2's second part: diffusers' ``CogVideoXTransformer3DModel`` (text joined before ``to_q``,
rotary tables given as a model input), ``QwenImageTransformer2DModel`` (image and text rotary
tables apart, a text mask), ``Flux2Transformer2DModel`` (``[text; image]`` rotary tables joined
in the forward, single-stream blocks with one fused projection) and
``HunyuanVideoTransformer3DModel`` (token refiner, text last, an attention mask over
``[video; text]``). Built from tiny configs, random init, float64: forward and every gradient
against the same model on one device, on simulated ranks (Ulysses, ring, USP; token counts the
ranks do not divide) and on gloo processes; ``plan="auto"``; the refusals.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fastdist as fd
from fastdist.errors import ParallelizeError

diffusers = pytest.importorskip("diffusers")

from tests import tiny_models as tm  # noqa: E402
from tests.test_context_mmdit import MODES  # noqa: E402  (mesh axes, plan keywords) by mode

Inputs = dict[str, Any]


def _randn(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def tiny_cogvideox(rotary: bool = True) -> tuple[nn.Module, Inputs]:
    """2 blocks, 4 heads of 8; 3 latent frames of 6 x 6, patch 2: 27 video tokens (14 + 13 over
    2 ranks, 7 + 7 + 7 + 6 over 4), 5 text tokens; random rotary tables of every position."""
    model = tm.tiny_cogvideox()
    g = torch.Generator().manual_seed(1)
    x = {
        "hidden_states": _randn(g, 2, 3, 4, 6, 6),
        "encoder_hidden_states": _randn(g, 2, 5, 16),
        "timestep": torch.tensor([3, 700]),
        "image_rotary_emb": (_randn(g, 27, 8), _randn(g, 27, 8)) if rotary else None,
    }
    return model, x


def tiny_cogvideox_15() -> tuple[nn.Module, Inputs]:
    """CogVideoX 1.5's layout: frames patched in pairs (``patch_size_t=2``) and an ``ofs``
    embedding (image-to-video) added to the timestep's; 4 latent frames of 6 x 6: 18 tokens."""
    model = tm.tiny_cogvideox(sample_frames=9, patch_size_t=2, ofs_embed_dim=8)
    g = torch.Generator().manual_seed(1)
    x = {
        "hidden_states": _randn(g, 2, 4, 4, 6, 6),
        "encoder_hidden_states": _randn(g, 2, 5, 16),
        "timestep": torch.tensor([3, 700]),
        "ofs": torch.tensor([2.0, 2.0], dtype=torch.float64),
        "image_rotary_emb": (_randn(g, 18, 8), _randn(g, 18, 8)),
    }
    return model, x


def tiny_qwen_image(masked: bool = True, **kw: Any) -> tuple[nn.Module, Inputs]:
    """2 blocks, 4 heads of 8; 9 packed image tokens (3 x 3), 5 text tokens, the last two of
    the second sample masked (``encoder_hidden_states_mask``)."""
    torch.manual_seed(0)
    model = diffusers.QwenImageTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=16, axes_dims_rope=(2, 2, 4), **kw,
    ).double()  # fmt: skip
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, -2:] = False
    x = {
        "hidden_states": _randn(g, 2, 9, 4),
        "encoder_hidden_states": _randn(g, 2, 5, 16),
        "timestep": torch.tensor([0.3, 0.7], dtype=torch.float64),
        "img_shapes": [[(1, 3, 3)]] * 2,
        "encoder_hidden_states_mask": mask if masked else None,
    }
    return model, x


def tiny_flux2() -> tuple[nn.Module, Inputs]:
    """1 double- and 1 single-stream block, 4 heads of 8; 9 packed image tokens, 5 text
    tokens, 4-axis position ids."""
    torch.manual_seed(0)
    model = diffusers.Flux2Transformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1,
        attention_head_dim=8, num_attention_heads=4, joint_attention_dim=16,
        timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2),
    ).double()  # fmt: skip
    g = torch.Generator().manual_seed(1)
    grid = torch.meshgrid(*(torch.arange(n) for n in (1, 3, 3, 1)), indexing="ij")
    txt_ids = torch.zeros(5, 4)
    txt_ids[:, 3] = torch.arange(5)
    x = {
        "hidden_states": _randn(g, 2, 9, 4),
        "encoder_hidden_states": _randn(g, 2, 5, 16),
        "timestep": torch.tensor([0.3, 0.7], dtype=torch.float64),
        "img_ids": torch.stack(grid, -1).reshape(-1, 4),
        "txt_ids": txt_ids,
        "guidance": torch.tensor([3.0, 3.0], dtype=torch.float64),
    }
    return model, x


def tiny_hunyuan_video(masked: bool = True, **kw: Any) -> tuple[nn.Module, Inputs]:
    """1 double- and 1 single-stream block, a 1-layer token refiner, 4 heads of 8; 2 frames of
    3 x 3: 18 video tokens (9 + 9 over 2, 5 + 5 + 4 + 4 over 4), 5 text tokens, the last two
    of the second sample padding (``encoder_attention_mask``)."""
    model = tm.tiny_hunyuan_video(**kw)
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 5, dtype=torch.float64)
    if masked:
        mask[1, -2:] = 0
    x = {
        "hidden_states": _randn(g, 2, 4, 2, 3, 3),
        "timestep": torch.tensor([3, 700]),
        "encoder_hidden_states": _randn(g, 2, 5, 16),
        "encoder_attention_mask": mask,
        "pooled_projections": _randn(g, 2, 8),
        "guidance": torch.tensor([3000.0, 3000.0], dtype=torch.float64),
    }
    return model, x


TINY: dict[str, Callable[[], tuple[nn.Module, Inputs]]] = {
    "cogvideox": tiny_cogvideox,
    "cogvideox-1.5": tiny_cogvideox_15,
    "qwen_image": tiny_qwen_image,
    "flux2": tiny_flux2,
    "hunyuan_video": tiny_hunyuan_video,
}


def reference(model: nn.Module, x: Inputs) -> tuple[Tensor, dict[str, Tensor]]:
    """The output and every parameter's gradient of ``sum(out**2)`` on one device."""
    out = model(**x).sample
    out.pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def assert_grads(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    """The same parameters have gradients; each within 1e-9 of its largest entry."""
    assert sorted(got) == sorted(want)
    for name, g in want.items():
        err = float((got[name] - g).abs().max() / max(float(g.abs().max()), 1.0))
        assert err < 1e-9, f"{name}: {err:.2e}"


def stacked(v: Any, n: int) -> Any:
    """An input with a leading rank dim (the same for every simulated rank)."""
    if isinstance(v, Tensor):
        return v.expand(n, *v.shape)
    if isinstance(v, tuple):
        return tuple(stacked(t, n) for t in v)
    return v


@pytest.mark.parametrize(
    "family,mode",
    [
        ("cogvideox", "ulysses-2"),
        ("cogvideox", "ring-4"),
        ("cogvideox-1.5", "ulysses-2"),
        ("qwen_image", "ulysses-4"),
        ("qwen_image", "usp-2x2"),
        ("flux2", "ulysses-2"),
        ("flux2", "ring-4"),
        ("flux2", "ulysses-4"),
        ("hunyuan_video", "ring-2"),
        ("hunyuan_video", "ulysses-4"),
        ("hunyuan_video", "usp-2x2"),
    ],
)
def test_equals_one_device(family: str, mode: str) -> None:
    model, x = TINY[family]()
    out, grads = reference(copy.deepcopy(model), x)
    axes, kw = MODES[mode]
    mesh = fd.Mesh(axes)
    plan = getattr(fd.nn.plans, family.split("-")[0])(model, mesh, **kw)
    pm = fd.nn.parallelize(model, mesh, plan)
    n = mesh.size
    got = pm(**{k: stacked(v, n) for k, v in x.items()}).sample
    got.pow(2).sum().backward()
    for r in range(n):
        torch.testing.assert_close(got[r].detach(), out, rtol=0, atol=1e-12)
    assert_grads(pm.grads(), grads)


def test_the_inputs_exercise_masks_and_rotary_tables() -> None:
    """The cases above could not pass with the text mask or the rotary tables ignored: on one
    device, each changes the output."""
    for build in (tiny_qwen_image, tiny_hunyuan_video):
        (model, x), (_, plain) = build(), build(masked=False)
        assert not torch.allclose(model(**x).sample, model(**plain).sample)
    (model, x), (_, plain) = tiny_cogvideox(), tiny_cogvideox(rotary=False)
    assert not torch.allclose(model(**x).sample, model(**plain).sample)


@pytest.mark.parametrize("family", ["cogvideox", "qwen_image", "flux2", "hunyuan_video"])
def test_auto_picks_the_ready_plan(family: str) -> None:
    model, _ = TINY[family]()
    pm = fd.nn.parallelize(model, fd.Mesh({"sp": 2}), "auto", verify=False)
    assert pm.plan == getattr(fd.nn.plans, family)(axis="sp")


def test_refusals() -> None:
    mesh = fd.Mesh({"sp": 2})
    qwen, _ = tiny_qwen_image(zero_cond_t=True)
    with pytest.raises(ParallelizeError, match=r"plans.qwen_image: .*zero_cond_t=True"):
        fd.nn.parallelize(qwen, mesh, "auto", verify=False)
    hunyuan, _ = tiny_hunyuan_video(image_condition_type="token_replace")
    with pytest.raises(ParallelizeError, match=r"image_condition_type='token_replace'"):
        fd.nn.plans.hunyuan_video(hunyuan, mesh)
    with pytest.raises(ParallelizeError, match="not a diffusers Flux2Transformer2DModel"):
        fd.nn.plans.flux2(tiny_cogvideox()[0])
    # an MM-DiT nobody wrote a plan for
    aura = diffusers.AuraFlowTransformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
        caption_projection_dim=16, out_channels=4, pos_embed_max_size=16,
    )  # fmt: skip
    with pytest.raises(ParallelizeError, match="AuraFlowTransformer2DModel .* joint text-image"):
        fd.nn.parallelize(aura, mesh, "auto", verify=False)


def test_wrong_inputs_are_refused_at_the_call() -> None:
    """Rotary tables of another token count (CogVideoX); HunyuanVideo's whole-sequence mask
    given to a plan that does not cut it (``key_mask=None``): never a silent wrong answer."""
    mesh = fd.Mesh({"sp": 2})
    model, x = tiny_cogvideox()
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.cogvideox())
    x["image_rotary_emb"] = tuple(t[:20] for t in x["image_rotary_emb"])
    with pytest.raises(ParallelizeError, match=r"rotary tables \(image_rotary_emb\) of 20 image"):
        pm(**{k: stacked(v, 2) for k, v in x.items()})
    model, x = tiny_hunyuan_video()
    plan = {
        "": fd.nn.ContextParallel(**{**vars(fd.nn.plans.hunyuan_video()[""]), "key_mask": None})
    }
    pm = fd.nn.parallelize(model, mesh, plan)
    with pytest.raises(ParallelizeError, match=r"scaled_dot_product_attention with \['attn_mask'"):
        pm(**{k: stacked(v, 2) for k, v in x.items()})


# ------------------------------------------------------------------ real ranks
def other_size(family: str) -> Inputs:
    """Another token count (CogVideoX: 2 latent frames, 18 tokens; HunyuanVideo: 1 frame, 9;
    QwenImage and Flux2: 2 x 3 packed tokens, 6) with other values."""
    _, x = TINY[family]()
    g = torch.Generator().manual_seed(2)
    if family == "cogvideox":
        x["hidden_states"] = _randn(g, 2, 2, 4, 6, 6)
        x["image_rotary_emb"] = (_randn(g, 18, 8), _randn(g, 18, 8))
    elif family == "qwen_image":
        x["hidden_states"] = _randn(g, 2, 6, 4)
        x["img_shapes"] = [[(1, 2, 3)]] * 2
    elif family == "flux2":
        x["hidden_states"] = _randn(g, 2, 6, 4)
        grid = torch.meshgrid(*(torch.arange(n) for n in (1, 2, 3, 1)), indexing="ij")
        x["img_ids"] = torch.stack(grid, -1).reshape(-1, 4)
    else:
        x["hidden_states"] = _randn(g, 2, 4, 1, 3, 3)
    return x


def families_on_gloo() -> list[tuple[Tensor, dict[str, Tensor]]]:
    """One gloo rank of sp=2: HunyuanVideo with Ulysses (its text mask and 18 video tokens),
    CogVideoX with the ring (27 video tokens: uneven); then these two, QwenImage and Flux2 (9
    packed tokens: uneven) with diffusers' gradient checkpointing, ring: a forward, a second
    one of another token count never backpropagated, the first one's backward (the recomputed
    blocks cut their rotary tables and mask with their own forward's split; HunyuanVideo calls
    its blocks positionally; Flux2's single-stream blocks get [text; image rows] joined between
    blocks). Each run's output and every gradient."""
    mesh = fd.connect(sp=2, timeout=120)
    results = []
    runs = [("hunyuan_video", "ulysses", False), ("cogvideox", "ring", False)]
    runs += [("cogvideox", "ring", True), ("hunyuan_video", "ring", True)]
    runs += [("qwen_image", "ring", True), ("flux2", "ring", True)]
    for family, mode, checkpointed in runs:
        model, x = TINY[family]()
        if checkpointed:
            model.enable_gradient_checkpointing()  # type: ignore[operator]
        pm = fd.nn.parallelize(model, mesh, getattr(fd.nn.plans, family)(mode=mode))
        out = pm(**x).sample
        if checkpointed:
            pm(**other_size(family)).sample.sum()  # never backpropagated
        out.pow(2).sum().backward()
        results.append((out.detach(), pm.grads()))
    return results


def test_hunyuan_video_and_cogvideox_on_gloo() -> None:
    from tests.dist_harness import run_on_gloo

    families = ("hunyuan_video", "cogvideox", "cogvideox", "hunyuan_video", "qwen_image", "flux2")
    want = [reference(*TINY[f]()) for f in families]
    for got in run_on_gloo(families_on_gloo, 2, timeout=300):
        for (out, grads), (got_out, got_grads) in zip(want, got, strict=True):
            torch.testing.assert_close(got_out, out, rtol=0, atol=1e-12)
            assert_grads(got_grads, grads)
