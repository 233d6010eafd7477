"""Each rank patch-embeds its own frames (issue 38.6): Wan's plan cuts the latent's frames before
``patch_embedding`` where a rank's tokens are whole frames (`ContextParallel(frames=...)`,
`fastdist.nn.styles.context_region.FrameEmbed`), its parameters ``pvary``'d; elsewhere the conv
runs on the whole latent and the first block cuts its rows (`own_rows`). Against the unmodified
model on one device in float64 (outputs exact, gradients to Wan's float32 norms' rounding), and
against the plan without ``frames`` (the path before: bit-equal outputs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fastdist as fd
from tests import tiny_models as tm

pytest.importorskip("diffusers.models.transformers.transformer_wan")


def tiny_wan(patch: tuple[int, int, int] = (1, 2, 2), layers: int = 1) -> nn.Module:
    """A tiny float64 Wan (4 heads of 12, random init) of patch ``patch``."""
    return tm.tiny_wan(heads=4, layers=layers, patch_size=patch)


def inputs(frames: int, h: int = 4, w: int = 4, grad: bool = False) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, frames, h, w, generator=g, dtype=torch.float64)
    return {
        "hidden_states": x.requires_grad_(grad),
        "timestep": torch.tensor([3.0, 700.0], dtype=torch.float64),
        "encoder_hidden_states": torch.randn(2, 5, 16, generator=g, dtype=torch.float64),
    }


def reference(model: nn.Module, x: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """One device: the output and the gradients of ``sum(out**2)`` (the latent's as
    ``"<latent>"`` when it requires one)."""
    x = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in x.items()}
    out = model(**x).sample
    out.pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    if x["hidden_states"].grad is not None:
        grads["<latent>"] = x["hidden_states"].grad
    return out.detach(), grads


def assert_grads(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, g in want.items():
        err = float((got[name] - g).abs().max() / g.abs().max())
        assert err < 1e-6, f"{name}: {err:.2e}"


def conv_inputs(model: nn.Module) -> list[tuple[int, ...]]:
    """Records the shape of every input ``patch_embedding`` gets (registered after the plan's
    hook: what the conv computes on)."""
    seen: list[tuple[int, ...]] = []
    model.patch_embedding.register_forward_pre_hook(
        lambda m, a: seen.append(tuple(a[0].shape)), prepend=False
    )
    return seen


def old_plan(**kw: Any) -> dict[str, Any]:
    """Wan's plan without ``frames``: the whole latent embedded on every rank (the path before)."""
    return {"": dataclasses.replace(fd.nn.plans.wan(**kw)[""], frames=None)}


# (frames, height, width, patch, mesh, plan options, latent frames each rank embeds: None = all)
CASES = {
    "sp2-frames4": (4, 4, 4, (1, 2, 2), {"sp": 2}, {}, 2),
    "sp4-ring": (4, 4, 6, (1, 2, 2), {"sp": 4}, {"mode": "ring"}, 1),
    "usp-2x2": (4, 4, 4, (1, 2, 2), {"cp": 2, "sp": 2}, {"mode": "usp", "ring_axis": "cp"}, 1),
    "pt2-odd-frame": (5, 4, 4, (2, 2, 2), {"sp": 2}, {}, 2),  # 2 token frames, 1 latent left over
    "frames3-sp2": (3, 4, 4, (1, 2, 2), {"sp": 2}, {}, None),  # 12 tokens: 1.5 frames per rank
    "uneven-9-sp4": (1, 6, 6, (1, 2, 2), {"sp": 4}, {}, None),  # 9 tokens: 3, 2, 2, 2
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("grad", [False, True])
def test_frames_equal_one_device_simulated(case: str, grad: bool) -> None:
    """Outputs equal one device's and the plan-without-frames' (bit for bit); every gradient
    (the patch embedding's, summed over the ranks, and the latent's when it has one) equals one
    device's; the conv sees only the rank's frames where its tokens are whole frames."""
    frames, h, w, patch, axes, options, mine = CASES[case]
    mesh, x = fd.Mesh(axes), inputs(frames, h, w, grad)
    n = mesh.size
    out, grads = reference(tiny_wan(patch), x)
    old = fd.nn.parallelize(tiny_wan(patch), mesh, old_plan(**options))
    old_out = old(**{k: v.detach().expand(n, *v.shape) for k, v in x.items()}).sample
    model = tiny_wan(patch)
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.wan(**options))
    seen = conv_inputs(model)  # after the plan's hook
    assert {(type(m).__name__, p) for m, p, _ in pm.pvary_sites} >= {
        ("Conv3d", "weight"),
        ("Conv3d", "bias"),
    }
    xs = {k: v.detach().expand(n, *v.shape).requires_grad_(v.requires_grad) for k, v in x.items()}
    got = pm(**xs).sample
    got.pow(2).sum().backward()
    assert seen[0][2] == (frames if mine is None else mine), seen
    assert torch.equal(got.detach(), old_out)
    for r in range(n):
        torch.testing.assert_close(got[r].detach(), out, rtol=0, atol=1e-12)
    got_grads = pm.grads()
    if grad:  # each simulated rank's latent gradient is one device's
        latent = xs["hidden_states"].grad
        for r in range(n):
            assert_grads({"<latent>": latent[r]}, {"<latent>": grads["<latent>"]})
        got_grads["<latent>"] = grads["<latent>"]
    assert_grads(got_grads, grads)


def test_no_grad_forward_and_verify() -> None:
    """A ``torch.no_grad()`` forward (a denoising step) embeds the rank's frames too and equals
    the path before; ``verify=`` (the replicas' gradient check) accepts the plan."""
    x = inputs(4)
    model = tiny_wan()
    pm = fd.nn.parallelize(model, fd.Mesh({"sp": 2}), fd.nn.plans.wan(), verify=x)
    seen = conv_inputs(model)
    old = fd.nn.parallelize(tiny_wan(), fd.Mesh({"sp": 2}), old_plan())
    seen.clear()
    with torch.no_grad():
        got = pm(**{k: v.expand(2, *v.shape) for k, v in x.items()}).sample
        want = old(**{k: v.expand(2, *v.shape) for k, v in x.items()}).sample
    assert seen == [(2, 4, 2, 4, 4)] and torch.equal(got, want)


def test_not_a_patch_conv_stays_whole() -> None:
    """A patch embedding that is no kernel = stride ``Conv3d`` (a pipeline stage's placeholder,
    a padded conv) is kept whole, its parameters not ``pvary``'d; ``frames`` must name one of
    ``whole``."""
    from fastdist.errors import ParallelizeError
    from fastdist.nn.styles.context_region import FrameEmbed

    assert FrameEmbed.fits(nn.Conv3d(4, 8, (1, 2, 2), (1, 2, 2)))
    assert not FrameEmbed.fits(nn.Conv3d(4, 8, 3, 1, padding=1))
    assert not FrameEmbed.fits(nn.Conv3d(4, 8, (1, 2, 2), (1, 1, 1)))
    assert not FrameEmbed.fits(nn.Linear(4, 8))
    model = tiny_wan()
    model.patch_embedding = nn.Conv3d(4, 48, (1, 2, 2), (1, 2, 2), dilation=(1, 1, 2)).double()
    pm = fd.nn.parallelize(model, fd.Mesh({"sp": 2}), fd.nn.plans.wan())
    assert not any(type(m).__name__ == "Conv3d" for m, _, _ in pm.pvary_sites)
    plan = {"": dataclasses.replace(fd.nn.plans.wan()[""], whole=("rope", "condition_embedder"))}
    with pytest.raises(ParallelizeError, match="frames='patch_embedding'.* is not one of whole"):
        fd.nn.parallelize(tiny_wan(), fd.Mesh({"sp": 2}), plan)


# ------------------------------------------------------------------ real ranks
def frames_on_gloo() -> list[Any]:
    """One gloo rank of sp=2: for 4 frames (each rank embeds 2) and 3 (the whole latent, rows
    cut), with the latent's gradient, and 4 frames with gradient checkpointing (diffusers'
    non-reentrant, then reentrant: the first block recomputed on its rank's rows): the output,
    the plan-without-frames' output, the gradients, the conv's input shape."""
    import functools

    mesh = fd.connect(sp=2, timeout=120)
    results = []
    for frames, checkpointed in CHECKPOINTED:
        x = inputs(frames, grad=True)
        model = tiny_wan(layers=2)
        if checkpointed == "default":
            model.enable_gradient_checkpointing()
        elif checkpointed == "reentrant":
            reentrant = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
            model.enable_gradient_checkpointing(reentrant)
        pm = fd.nn.parallelize(model, mesh, fd.nn.plans.wan())
        seen = conv_inputs(model)
        old = fd.nn.parallelize(tiny_wan(layers=2), mesh, old_plan())
        with torch.no_grad():
            want = old(**x).sample
        out = pm(**x).sample
        out.pow(2).sum().backward()
        grads = {**pm.grads(), "<latent>": x["hidden_states"].grad}
        results.append((out.detach(), want, grads, seen[0]))
    return results


#: (latent frames, gradient checkpointing) of the gloo test
CHECKPOINTED = ((4, None), (3, None), (4, "default"), (4, "reentrant"))


def test_frames_on_gloo() -> None:
    from tests.dist_harness import run_on_gloo

    want = [reference(tiny_wan(layers=2), inputs(f, grad=True)) for f, _ in CHECKPOINTED]
    for rank in run_on_gloo(frames_on_gloo, 2, timeout=300):
        for (got, old, grads, seen), (out, ref), frames in zip(rank, want, (2, 3, 2, 2)):
            assert torch.equal(got, old) and torch.equal(got, out)
            assert_grads(grads, ref)
            assert seen[2] == frames
