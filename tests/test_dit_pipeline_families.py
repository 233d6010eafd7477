"""Pipeline x context parallelism (pp 2 x sp 2) of diffusers DiTs other than Wan on 4 real gloo
processes (docs/pipeline.md, "Diffusion transformers (DiTs)"; docs/context_parallel.md,
"Composition"), each a tiny float64 model with 2 heads of 8 cut into 2 stages of 1 and 3 blocks,
each stage's tokens split over ``sp`` by the family's ready plan (Ulysses; one case ring),
under 1F1B with 2 micro-batches:

* ``FluxTransformer2DModel`` and ``HunyuanVideoTransformer3DModel``: two block lists (double-
  then single-stream), the second stage across them; the text stream handed on with each
  activation; Flux's position ids whole in every micro-batch, HunyuanVideo's padded text mask
  per sample;
* ``CogVideoXTransformer3DModel`` (with its rotary tables): a stage hands on ``[text; the rank's
  image tokens]`` in one tensor;
* ``LTXVideoTransformer3DModel``: a masked text token, ``num_frames`` / ``height`` / ``width``;
* ``SD3Transformer2DModel``: blocks return ``(text, image)``, the last one ``context_pre_only``;
* Flux again with 9 image tokens (uneven: 5 and 4 per rank) and the ring plan
  (``plan=fastdist.nn.plans.flux(model, mesh, mode="ring")``).

Against the unmodified model on one device: the loss, every parameter's gradient, the
whole-model clip's norm, an SGD (momentum) step, and that step's ``fastdist.checkpoint``
(written by the 4 ranks, the embedders every stage holds under the same names) loaded into the
plain model on one device and back into the pipeline cut elsewhere (stages of 3 and 1 blocks,
bit-equal to what was saved); every block on every rank gets its half of the image tokens
(rounded up: the shorter block padded). The same
compositions on simulated ranks: ``tests/test_pipeline_dit.py``.

None of these families computes in float32 inside (unlike Wan): loss and gradients to 1e-12
(gradients relative to each one's largest entry, floored at 1e-6), weights after the step to
1e-12 (measured: gradients 2.2e-14 at most, HunyuanVideo; losses 1.8e-16; weights 2.8e-17).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fastdist as fd

pytest.importorskip("diffusers.models.transformers.transformer_flux")

from tests.pipeline_dit_worker import (  # noqa: E402
    cogvideox_batch,
    flux_batch,
    hunyuan_batch,
    ltx_batch,
    one_device,
    sd3_batch,
    tiny_cogvideox,
    tiny_flux,
    tiny_hunyuan_video,
    tiny_ltx,
    tiny_sd3,
)

FAMILIES = ("flux", "hunyuan_video", "cogvideox", "ltx_video", "sd3", "flux_ring_uneven")
#: the image tokens each block gets on each rank (9 over 2 ranks: 5 and 4, padded to 5)
TOKENS = {
    "flux": 8,
    "hunyuan_video": 4,
    "cogvideox": 6,
    "ltx_video": 4,
    "sd3": 8,
    "flux_ring_uneven": 5,
}
MAX_NORM = 0.05  # below every model's gradient norm (0.8 to 2.4): the clip scales


def build(family: str) -> tuple[nn.Module, dict[str, Any]]:
    """The tiny float64 model (2 heads of 8; Flux and HunyuanVideo: 2 double- and 2
    single-stream blocks, CogVideoX: 4 blocks and its rotary tables) and a batch of 4 samples
    with its target."""
    if family == "flux":
        return tiny_flux(), flux_batch()
    if family == "flux_ring_uneven":
        return tiny_flux(), flux_batch_3x3()
    if family == "sd3":
        return tiny_sd3(), sd3_batch()
    if family == "ltx_video":
        return tiny_ltx(), ltx_batch()
    if family == "cogvideox":
        return tiny_cogvideox(rotary=True), cogvideox_batch(rotary=True)
    return tiny_hunyuan_video(), hunyuan_batch()


def flux_batch_3x3(n: int = 4, seed: int = 1) -> dict[str, Any]:
    """`flux_batch` with 9 image tokens (a 3 x 3 grid): uneven over 2 ranks."""
    return flux_batch(n, seed, side=3)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def record_tokens(pipe: Any, seen: list[int]) -> list[Any]:
    """Hooks on every block of the stages held here, recording the token count of the image
    stream each block gets (positional or keyword ``hidden_states``)."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        seen.append(int(x.shape[1]))

    handles = []
    for pm in pipe.stages.values():
        for name in ("transformer_blocks", "single_transformer_blocks"):
            for block in getattr(pm.module, name, ()):
                handles.append(block.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


def reload(path: str, family: str, mesh: fd.Mesh) -> dict[str, Any]:
    """The checkpoint loaded back into a pipeline of other weights cut elsewhere (stages of 3
    and 1 blocks) and a fresh SGD: the weights and momentum its stages got, by name (a stage's
    copies of a shared embedder checked to agree)."""
    from tests.checkpoint_worker import optim_state

    model, _ = build(family)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # other weights: everything must come from the checkpoint
    pipe = fd.train.pipeline(model, mesh, schedule="gpipe", microbatches=2, layers_per_stage=[3, 1])
    opt = sgd(pipe.parameters())
    extra = fd.checkpoint.load(f"{path}/{family}", pipe, opt)
    momentum: dict[str, Tensor] = {}
    for j in sorted(pipe.stages):
        for name, st in optim_state(pipe.stages[j], opt).items():
            assert name not in momentum or torch.equal(momentum[name], st["momentum_buffer"])
            momentum[name] = st["momentum_buffer"]
    return {"extra": extra, "state": pipe.state_dict(), "momentum": momentum}


def pp_sp_steps(path: str) -> dict[str, Any]:
    """One rank of pp 2 x sp 2: per family, a 1F1B step of 2 micro-batches (stages of 1 and 3
    blocks), the clip, an SGD step and a checkpoint of it, loaded back into stages of 3 and 1."""
    torch.set_num_threads(1)
    mesh = fd.connect(pp=2, sp=2, timeout=120)
    out: dict[str, Any] = {"coords": mesh.coords(mesh.rank)}
    for family in FAMILIES:
        model, b = build(family)
        ring = (
            fd.nn.plans.flux(model, mesh, mode="ring") if family.endswith("ring_uneven") else None
        )
        pipe = fd.train.pipeline(
            model, mesh, schedule="1f1b", microbatches=2, layers_per_stage=[1, 3], plan=ring
        )
        seen: list[int] = []
        handles = record_tokens(pipe, seen)
        loss = pipe.step(**b)
        for h in handles:
            h.remove()
        grads = pipe.grads()
        total = pipe.clip_grad_norm_(MAX_NORM)
        opt = sgd(pipe.parameters())
        opt.step()
        fd.checkpoint.save(f"{path}/{family}", pipe, opt, extra={"family": family})
        out[family] = {
            "loss": loss,
            "grads": grads,
            "norm": total,
            "state": pipe.state_dict(),
            "stages": sorted(pipe.stages),
            "tokens": seen,
            "reloaded": reload(path, family, mesh),
        }
    return out


def reference(family: str) -> dict[str, Any]:
    """One device: the loss, the gradients, the clipped norm, the weights and momentum after the
    SGD step."""
    model, b = build(family)
    loss = one_device(model, b)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt = sgd(model.parameters())
    opt.step()
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}  # and buffers
    momentum = {n: opt.state[p]["momentum_buffer"] for n, p in model.named_parameters()}
    return {"loss": loss, "grads": grads, "norm": norm, "state": state, "momentum": momentum}


def assert_close_rel(got: Tensor, want: Tensor, what: str, tol: float = 1e-12) -> None:
    scale = max(float(want.abs().max()), 1e-6)
    err = float((got - want).abs().max())
    assert err <= tol * scale, f"{what}: {err:.2e} of {scale:.2e}"


def load_one_device(path: Path, family: str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The pipeline's checkpoint in the unmodified model (other weights) and a plain SGD: its
    weights and momentum."""
    model, _ = build(family)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # other weights: everything must come from the checkpoint
    opt = sgd(model.parameters())
    assert fd.checkpoint.load(path / family, model, opt) == {"family": family}
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}  # and buffers
    return state, {n: opt.state[p]["momentum_buffer"] for n, p in model.named_parameters()}


def test_pp2_sp2_on_gloo_equals_one_device(tmp_path: Path) -> None:
    """4 gloo processes, pp 2 x sp 2: Flux, HunyuanVideo, CogVideoX, LTX-Video, SD3 (module
    doc)."""
    from tests.dist_harness import run_on_gloo

    ranks = run_on_gloo(pp_sp_steps, 4, str(tmp_path), timeout=300)
    for family in FAMILIES:
        want = reference(family)
        held: set[str] = set()
        for r in ranks:
            got, what = r[family], f"{family} rank {r['coords']}"
            assert got["stages"] == [r["coords"]["pp"]], what
            # the tokens travel split: every block on every rank got half the image tokens
            assert got["tokens"] and set(got["tokens"]) == {TOKENS[family]}, what
            assert_close_rel(got["loss"], want["loss"], f"{what} loss")
            assert_close_rel(got["norm"], want["norm"], f"{what} clipped norm", 1e-9)
            assert set(got["grads"]) <= set(got["state"]) <= set(want["state"]), what
            for name, g in got["grads"].items():
                assert_close_rel(g, want["grads"][name], f"{what} gradient {name}")
            for name, w in got["state"].items():  # weights after the step (and buffers)
                assert_close_rel(w, want["state"][name], f"{what} {name}")
            held |= set(got["grads"])
        assert held == set(want["grads"]) == set(want["momentum"]), family
        state, momentum = load_one_device(tmp_path, family)
        reloaded: set[str] = set()
        for r in ranks:  # the pipeline cut elsewhere got what was saved
            back = r[family]["reloaded"]
            assert back["extra"] == {"family": family}
            assert set(back["momentum"]) <= set(back["state"]), family
            for name, w in back["state"].items():
                assert torch.equal(w, state[name]), f"{family} reloaded {name}"
            for name, m in back["momentum"].items():
                assert torch.equal(m, momentum[name]), f"{family} reloaded momentum {name}"
            reloaded |= set(back["state"])
        assert reloaded == set(state), family
        for name, w in want["state"].items():
            holder = next(r[family]["state"][name] for r in ranks if name in r[family]["state"])
            assert torch.equal(state[name], holder), f"{family} loaded {name}"
            assert_close_rel(state[name], w, f"{family} loaded {name} vs one device")
        for name, m in want["momentum"].items():
            assert_close_rel(momentum[name], m, f"{family} momentum {name}")
