"""The tiny Wan DiT, its batch and its one-device loss for tests/test_pipeline_dit.py, and the gloo
worker that runs `fastdist.train.pipeline` of it on real ranks (pp 2, 2 processes): every rank
builds the same float64 model from a fixed seed, computes the one-device reference itself and
returns the largest differences, the names it holds gradients for, and what a refused batch said.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import fastdist as fd
from tests import tiny_models as tm


def tiny_wan(layers: int = 4, seed: int = 0) -> nn.Module:
    """The pipeline tests' float64 Wan text-to-video transformer: ``layers`` blocks of 2 heads
    of 8."""
    return tm.tiny_wan(heads=2, head_dim=8, layers=layers, seed=seed)


def batch(n: int = 4, weighted: bool = False, seed: int = 1) -> dict[str, Tensor]:
    """``n`` samples: latents (4 channels, 2 frames, 4 x 4: 8 tokens), one timestep each, 5 text
    tokens, a target of the output's shape, optionally per-sample weights."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "hidden_states": torch.randn(n, 4, 2, 4, 4, generator=g, dtype=torch.float64),
        "timestep": torch.randint(0, 1000, (n,), generator=g).to(torch.float64),
        "encoder_hidden_states": torch.randn(n, 5, 16, generator=g, dtype=torch.float64),
        "target": torch.randn(n, 4, 2, 4, 4, generator=g, dtype=torch.float64),
    }
    if weighted:
        out["weighting"] = torch.rand(n, 1, 1, 1, 1, generator=g, dtype=torch.float64) + 0.5
    return out


def one_device(model: nn.Module, b: dict[str, Tensor]) -> Tensor:
    """The loss on one device: ``mean(weighting * (output - target) ** 2)`` (its backward run)."""
    kw = {k: v for k, v in b.items() if k not in ("target", "weighting")}
    out = model(**kw, return_dict=False)[0]
    d = (out - b["target"]) ** 2
    loss = (d * b["weighting"]).mean() if "weighting" in b else d.mean()
    loss.backward()
    return loss.detach()


def _case(
    mesh: fd.Mesh, family: str = "wan", checkpointing: bool = False, **kw: Any
) -> dict[str, Any]:
    """One step of a fresh pipeline against one device: the loss's error, the largest gradient
    error relative to each gradient's largest entry (floored at 1e-6), the names this rank
    holds."""
    model, b = {
        "wan": lambda: (tiny_wan(), batch(weighted=True)),
        "sd3": lambda: (tiny_sd3(), sd3_batch()),
        "cogvideox": lambda: (tiny_cogvideox(True), cogvideox_batch(True)),
    }[family]()
    ref = copy.deepcopy(model)
    want = one_device(ref, b)
    if checkpointing:  # diffusers' own (non-reentrant): blocks recomputed in backward
        model.enable_gradient_checkpointing()
    pipe = fd.train.pipeline(model, mesh, microbatches=2, **kw)
    loss = pipe.step(**b)
    grads = pipe.grads()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    err = max(
        float((g - ref_grads[n]).abs().max() / max(float(ref_grads[n].abs().max()), 1e-6))
        for n, g in grads.items()
    )
    return {
        "loss_shape": tuple(loss.shape),
        "loss_err": float((loss - want).abs() / want.abs()),
        "grad_err": err,
        "names": sorted(grads),
        "model": sorted(ref_grads),
        "stages": sorted(pipe.stages),
        "pipe": pipe,
    }


def wan_on_2() -> dict[str, Any]:
    """2 ranks, pp 2: Wan under GPipe, 1F1B and interleaved 1F1B, SD3 under 1F1B, Wan and
    CogVideoX with gradient checkpointing (the stages' first and last blocks recomputed in
    backward) under 1F1B, against one device; then a batch whose
    latents differ on the two ranks (refused by the batch digest: a float tensor's bits)."""
    torch.set_num_threads(1)
    mesh = fd.connect(pp=2, timeout=60)
    out: dict[str, Any] = {}
    pipes: dict[str, Any] = {}
    for name, kw in {
        "gpipe": {"schedule": "gpipe"},
        "1f1b": {"schedule": "1f1b"},
        "interleaved_1f1b": {"schedule": "interleaved_1f1b", "virtual": 2},
        "sd3_1f1b": {"schedule": "1f1b", "family": "sd3"},  # the text stream handed on
        "wan_ckpt": {"schedule": "1f1b", "checkpointing": True},
        "cogvideox_ckpt": {"schedule": "1f1b", "family": "cogvideox", "checkpointing": True},
    }.items():
        case = _case(mesh, **kw)
        pipes[name] = case.pop("pipe")
        out[name] = case
    b = batch()
    b["hidden_states"] = b["hidden_states"] + 1e-3 * dist.get_rank()  # differ by a little
    try:
        pipes["1f1b"].step(**b)  # a Wan pipeline
        out["differs"] = None
    except Exception as e:  # noqa: BLE001 - the parent asserts the type and message
        out["differs"] = f"{type(e).__name__}: {e}"
    return out


def tiny_ltx(layers: int = 4, seed: int = 0) -> nn.Module:
    """The pipeline tests' float64 LTX-Video transformer: ``layers`` blocks of 2 heads of 12 (no
    float32 internals: it matches one device to rounding)."""
    return tm.tiny_ltx(heads=2, layers=layers, seed=seed)


def ltx_batch(n: int = 4, seed: int = 1) -> dict[str, Any]:
    """``n`` samples of 2 x 2 x 2 patchified latent tokens (4 channels), 5 text tokens (the last
    one masked), a timestep each, a target of the output's shape."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, 5, dtype=torch.float64)
    mask[:, -1] = 0
    return {
        "hidden_states": torch.randn(n, 8, 4, generator=g, dtype=torch.float64),
        "encoder_hidden_states": torch.randn(n, 5, 16, generator=g, dtype=torch.float64),
        "timestep": torch.randint(0, 1000, (n,), generator=g).to(torch.float64),
        "encoder_attention_mask": mask,
        "num_frames": 2,
        "height": 2,
        "width": 2,
        "target": torch.randn(n, 8, 4, generator=g, dtype=torch.float64),
    }


def tiny_cogvideox(rotary: bool, layers: int = 4) -> nn.Module:
    """The pipeline tests' float64 CogVideoX: ``layers`` blocks of 2 heads of 8, 3 latent
    frames of 4 x 4 in patches of 2: 12 image tokens, 5 text tokens."""
    return tm.tiny_cogvideox(heads=2, layers=layers, size=4, rotary=rotary)


def cogvideox_batch(rotary: bool, n: int = 4, seed: int = 1) -> dict[str, Any]:
    """``n`` samples: latents (3 frames, 4 channels, 4 x 4), 5 text tokens, integer timesteps, a
    target of the output's shape; with ``rotary`` the rotary tables of the 12 image tokens (a
    model input, not per sample)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {
        "hidden_states": torch.randn(n, 3, 4, 4, 4, generator=g, dtype=torch.float64),
        "encoder_hidden_states": torch.randn(n, 5, 16, generator=g, dtype=torch.float64),
        "timestep": torch.randint(0, 1000, (n,), generator=g),
        "target": torch.randn(n, 3, 4, 4, 4, generator=g, dtype=torch.float64),
    }
    if rotary:
        out["image_rotary_emb"] = tuple(
            torch.randn(12, 8, generator=g, dtype=torch.float64) for _ in range(2)
        )
    return out


def tiny_sd3(layers: int = 4) -> nn.Module:
    """The pipeline tests' float64 SD3 (MM-DiT): ``layers`` joint blocks (the last one
    ``context_pre_only``) of 2 heads of 8, patch 1."""
    return tm.tiny_sd3(heads=2, layers=layers)


def sd3_batch(n: int = 4, seed: int = 1) -> dict[str, Any]:
    """``n`` samples: 4 x 4 latents (16 tokens), 5 text tokens, pooled text, a timestep each, a
    target of the output's shape."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(n, 4, 4, 4, generator=g, dtype=torch.float64),
        "encoder_hidden_states": torch.randn(n, 5, 16, generator=g, dtype=torch.float64),
        "pooled_projections": torch.randn(n, 8, generator=g, dtype=torch.float64),
        "timestep": torch.randint(0, 1000, (n,), generator=g).to(torch.float64),
        "target": torch.randn(n, 4, 4, 4, generator=g, dtype=torch.float64),
    }


def tiny_flux() -> nn.Module:
    """The pipeline tests' float64 Flux: 2 double-stream and 2 single-stream blocks, 2 heads of
    8."""
    return tm.tiny_flux(heads=2)


def flux_batch(n: int = 4, seed: int = 1, side: int = 4) -> dict[str, Any]:
    """``n`` samples of ``side * side`` packed image tokens (a grid, 4 x 4 by default), 5 text
    tokens at distinct positions, pooled text, a timestep each, a target of the output's shape;
    the position ids (not per sample)."""
    g = torch.Generator().manual_seed(seed)
    axis = torch.arange(float(side))
    grid = torch.meshgrid(torch.zeros(1), axis, axis, indexing="ij")
    tokens = side * side
    return {
        "hidden_states": torch.randn(n, tokens, 4, generator=g, dtype=torch.float64),
        "encoder_hidden_states": torch.randn(n, 5, 16, generator=g, dtype=torch.float64),
        "pooled_projections": torch.randn(n, 8, generator=g, dtype=torch.float64),
        "timestep": torch.rand(n, generator=g, dtype=torch.float64),
        "img_ids": torch.stack(grid, -1).reshape(-1, 3).to(torch.float64),
        "txt_ids": torch.arange(15.0, dtype=torch.float64).view(5, 3),
        "target": torch.randn(n, tokens, 4, generator=g, dtype=torch.float64),
    }


def tiny_hunyuan_video() -> nn.Module:
    """The pipeline tests' float64 HunyuanVideo: 2 double- and 2 single-stream blocks, a 1-layer
    token refiner, 2 heads of 8, patch 1."""
    return tm.tiny_hunyuan_video(heads=2, layers=2, single_layers=2)


def hunyuan_batch(n: int = 4, seed: int = 1) -> dict[str, Any]:
    """``n`` samples: 2 frames of 2 x 2 latents (8 tokens), 5 text tokens (the last two of the
    second sample padding), pooled text, guidance, integer timesteps, a target."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, 5, dtype=torch.float64)
    mask[1, -2:] = 0
    return {
        "hidden_states": torch.randn(n, 4, 2, 2, 2, generator=g, dtype=torch.float64),
        "timestep": torch.randint(0, 1000, (n,), generator=g),
        "encoder_hidden_states": torch.randn(n, 5, 16, generator=g, dtype=torch.float64),
        "encoder_attention_mask": mask,
        "pooled_projections": torch.randn(n, 8, generator=g, dtype=torch.float64),
        "guidance": torch.full((n,), 3000.0, dtype=torch.float64),
        "target": torch.randn(n, 4, 2, 2, 2, generator=g, dtype=torch.float64),
    }
