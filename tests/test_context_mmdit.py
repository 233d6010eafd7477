"""Context parallelism of joint text-image attention DiTs (MM-DiT, issue 38.1): diffusers'
``SD3Transformer2DModel`` (SD3, and SD3.5's dual attention with q/k RMS norms) and
``FluxTransformer2DModel`` (double- and single-stream blocks, rotary embedding of text and image
positions), whose text tokens, replicated on every rank, join the split image tokens inside every
attention. Forward and backward against the same model on one device in float64, in every mode,
with image token counts the ranks do not divide; ``plan="auto"``; the refusals.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, cast

import pytest
import torch
from torch import Tensor, nn

import fastdist as fd
from fastdist.errors import ParallelizeError
from tests.tiny_models import tiny_flux, tiny_sd3

sd3_module = pytest.importorskip("diffusers.models.transformers.transformer_sd3")

#: (mesh axes, plan keywords) of each mode
MODES: dict[str, tuple[dict[str, int], dict[str, Any]]] = {
    "ulysses-2": ({"sp": 2}, {}),
    "ulysses-4": ({"sp": 4}, {}),
    "ring-2": ({"sp": 2}, {"mode": "ring"}),
    "ring-4": ({"sp": 4}, {"mode": "ring"}),
    "usp-2x2": ({"cp": 2, "sp": 2}, {"mode": "usp", "ring_axis": "cp"}),
}


def sd3_inputs(size: int = 3, text: int = 5) -> dict[str, Tensor]:
    """``size * size`` image tokens (9: 5 + 4 over 2 ranks, 3 + 2 + 2 + 2 over 4), ``text``
    text tokens."""
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(2, 4, size, size, generator=g, dtype=torch.float64),
        "encoder_hidden_states": torch.randn(2, text, 16, generator=g, dtype=torch.float64),
        "pooled_projections": torch.randn(2, 8, generator=g, dtype=torch.float64),
        "timestep": torch.tensor([3.0, 700.0], dtype=torch.float64),
    }


def reference(model: nn.Module, x: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """The output and every parameter's gradient of ``sum(out**2)`` on one device."""
    out = model(**x).sample
    out.pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def assert_grads(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    """Every gradient within 1e-9 of the largest entry of its parameter's (SD3 has no float32
    norms); the last block's ``add_q_proj`` (its text queries' output is dropped:
    ``context_pre_only``) has a zero gradient, which must be zero here too."""
    assert sorted(got) == sorted(want)
    for name, g in want.items():
        err = float((got[name] - g).abs().max() / max(float(g.abs().max()), 1.0))
        assert err < 1e-9, f"{name}: {err:.2e}"


def check(mode: str, model: nn.Module, x: dict[str, Tensor], plan: Any = fd.nn.plans.sd3) -> None:
    """``model`` made context-parallel by ``plan`` (a ready plan function) in ``mode``: every
    rank's output and every gradient equal one device's."""
    axes, kw = MODES[mode]
    out, grads = reference(copy.deepcopy(model), x)
    mesh = fd.Mesh(axes)
    pm = fd.nn.parallelize(model, mesh, plan(model, mesh, **kw))
    n = mesh.size
    got = pm(**{k: v.expand(n, *v.shape) for k, v in x.items()}).sample
    got.pow(2).sum().backward()
    for r in range(n):
        torch.testing.assert_close(got[r].detach(), out, rtol=0, atol=1e-12)
    assert_grads(pm.grads(), grads)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_sd3_equals_one_device(mode: str) -> None:
    """9 image tokens (uneven over 2 and 4 ranks), 5 text tokens on every rank."""
    check(mode, tiny_sd3(), sd3_inputs())


def test_sd3_even_tokens_and_long_text() -> None:
    """16 image tokens (even), 11 text tokens (more than a rank's image rows), ring over 4."""
    check("ring-4", tiny_sd3(), sd3_inputs(size=4, text=11))


@pytest.mark.parametrize("mode", ["ulysses-2", "usp-2x2"])
def test_sd35_dual_attention_equals_one_device(mode: str) -> None:
    """SD3.5: block 0 has a second, image-only attention (``attn2``, a split self-attention),
    q/k RMS norms on both streams."""
    check(mode, tiny_sd3(dual_attention_layers=(0,), qk_norm="rms_norm"), sd3_inputs())


def test_sd3_is_auto() -> None:
    pm = fd.nn.parallelize(tiny_sd3(), fd.Mesh({"sp": 2}), "auto", verify=False)
    assert pm.plan == fd.nn.plans.sd3(axis="sp")


def test_sd3_refusals() -> None:
    mesh = fd.Mesh({"sp": 2})
    with pytest.raises(ParallelizeError, match=r"'transformer_blocks\.0\.attn' .* 3 heads"):
        model = sd3_module.SD3Transformer2DModel(
            sample_size=8, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
            num_attention_heads=3, joint_attention_dim=16, caption_projection_dim=24,
            pooled_projection_dim=8, out_channels=4, pos_embed_max_size=8,
        )  # fmt: skip
        fd.nn.parallelize(model, mesh, fd.nn.plans.sd3())
    with pytest.raises(ParallelizeError, match=r"is a cross-attention.*joint="):
        bad = dict(vars(fd.nn.plans.sd3()[""]), attention=("attn",), joint=())
        fd.nn.parallelize(tiny_sd3(), mesh, {"": fd.nn.ContextParallel(**bad)})
    with pytest.raises(ParallelizeError, match=r"attn2' .* not a joint text-image attention"):
        bad = dict(vars(fd.nn.plans.sd3()[""]), attention=(), joint=("attn", "attn2"))
        dual = tiny_sd3(dual_attention_layers=(0,))
        fd.nn.parallelize(dual, mesh, {"": fd.nn.ContextParallel(**bad)})
    model = tiny_sd3()
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.sd3(mode="ring"))
    x = {k: v.expand(2, *v.shape) for k, v in sd3_inputs().items()}
    from diffusers.models.attention_processor import AttnProcessor2_0

    blocks = cast(nn.ModuleList, model.transformer_blocks)
    blocks[0].attn.set_processor(AttnProcessor2_0())  # type: ignore[no-untyped-call]
    with pytest.raises(ParallelizeError, match="processor was replaced after parallelize"):
        pm(**x)
    with pytest.raises(ParallelizeError, match=r"runs the processor AttnProcessor2_0"):
        fd.nn.parallelize(model, mesh, fd.nn.plans.sd3())
    with pytest.raises(ParallelizeError, match="not a diffusers SD3Transformer2DModel"):
        fd.nn.plans.sd3(nn.Linear(2, 2))


# ------------------------------------------------------------------ Flux
def flux_inputs(size: int = 3, text: int = 5) -> dict[str, Tensor]:
    """``size * size`` packed image tokens at grid positions, ``text`` text tokens at distinct
    positions (so the text rows of the rotary embedding matter)."""
    g = torch.Generator().manual_seed(1)
    grid = torch.meshgrid(
        torch.zeros(1), torch.arange(size * 1.0), torch.arange(size * 1.0), indexing="ij"
    )
    return {
        "hidden_states": torch.randn(2, size * size, 4, generator=g, dtype=torch.float64),
        "encoder_hidden_states": torch.randn(2, text, 16, generator=g, dtype=torch.float64),
        "pooled_projections": torch.randn(2, 8, generator=g, dtype=torch.float64),
        "timestep": torch.tensor([0.003, 0.7], dtype=torch.float64),
        "img_ids": torch.stack(grid, -1).reshape(-1, 3).to(torch.float64),  # (tokens, 3)
        "txt_ids": torch.arange(3.0 * text, dtype=torch.float64).view(text, 3),
    }


@pytest.mark.parametrize("mode", ["ulysses-2", "ring-4", "usp-2x2"])
def test_flux_equals_one_device(mode: str) -> None:
    """9 image tokens (5 + 4 over 2 ranks, 3 + 2 + 2 + 2 over 4), 5 text tokens."""
    check(mode, tiny_flux(), flux_inputs(), fd.nn.plans.flux)


def test_flux_is_auto() -> None:
    pm = fd.nn.parallelize(tiny_flux(), fd.Mesh({"sp": 2}), "auto", verify=False)
    assert pm.plan == fd.nn.plans.flux(axis="sp")


def test_flux_refusals() -> None:
    mesh = fd.Mesh({"sp": 2})
    plan = vars(fd.nn.plans.flux()[""])

    def refused(match: str, **change: Any) -> None:
        with pytest.raises(ParallelizeError, match=match):
            fd.nn.parallelize(tiny_flux(), mesh, {"": fd.nn.ContextParallel(**{**plan, **change})})

    # the single-stream blocks left out: their attention would see the rank's tokens alone
    refused(r"single_transformer_blocks\.0\.attn .* outside", single_blocks=None)
    # a single-stream attention (text in its hidden states) listed as joint, and the reverse
    single = "single_transformer_blocks"
    refused(
        r"single_transformer_blocks\.0\.attn' .* not a joint", blocks=single, single_blocks=None
    )
    refused(r"transformer_blocks\.0\.attn' .* encoder states", single_blocks="transformer_blocks")
    refused(r"text='context_embedder'.* not one of whole", whole=plan["whole"][:3], feeds=())


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_gradient_checkpointing_equals_one_device(family: str) -> None:
    """diffusers' gradient checkpointing enabled: ring over 2 ranks, 9 image tokens. On simulated
    ranks fastdist turns it off inside the model (no recomputation in the simulation's vmap): the
    blocks' recomputation is tested on gloo
    (`test_checkpointed_blocks_recompute_with_their_own_split_on_gloo`)."""
    build, inputs, plan = {
        "sd3": (tiny_sd3, sd3_inputs, fd.nn.plans.sd3),
        "flux": (tiny_flux, flux_inputs, fd.nn.plans.flux),
    }[family]
    model, x = build(), inputs()
    out, grads = reference(copy.deepcopy(model), x)
    model.enable_gradient_checkpointing()  # type: ignore[operator]
    mesh = fd.Mesh({"sp": 2})
    pm = fd.nn.parallelize(model, mesh, plan(model, mesh, mode="ring"))
    got = pm(**{k: v.expand(2, *v.shape) for k, v in x.items()}).sample
    got.pow(2).sum().backward()
    for r in range(2):
        torch.testing.assert_close(got[r].detach(), out, rtol=0, atol=1e-12)
    assert_grads(pm.grads(), grads)


# ------------------------------------------------------------------ real ranks
def sd3_usp_on_gloo() -> tuple[Tensor, dict[str, Tensor]]:
    """One gloo rank of cp=2 x sp=2 (USP: the text heads cut and gathered over sp, the text keys
    on ring rank 0 only), 9 image tokens (uneven): the whole output and every gradient."""
    mesh = fd.connect(cp=2, sp=2, timeout=120)
    pm = fd.nn.parallelize(tiny_sd3(), mesh, fd.nn.plans.sd3(mode="usp", ring_axis="cp"))
    out = pm(**sd3_inputs()).sample
    out.pow(2).sum().backward()
    return out.detach(), pm.grads()


def test_sd3_usp_uneven_on_gloo() -> None:
    from tests.dist_harness import run_on_gloo

    out, grads = reference(tiny_sd3(), sd3_inputs())
    for got, got_grads in run_on_gloo(sd3_usp_on_gloo, 4, timeout=300):
        torch.testing.assert_close(got, out, rtol=0, atol=1e-12)
        assert_grads(got_grads, grads)


def ulysses_on_gloo() -> list[tuple[Tensor, dict[str, Tensor]]]:
    """One gloo rank of sp=2 (Ulysses), 9 image tokens (5 + 4: the key mask of torch's attention
    on real tensors): Flux, and SD3.5 with a dual (image-only, plain split) attention; each
    one's whole output and every gradient."""
    mesh = fd.connect(sp=2, timeout=120)
    runs = [
        (tiny_flux(), flux_inputs(), fd.nn.plans.flux()),
        (tiny_sd3(dual_attention_layers=(0,)), sd3_inputs(), fd.nn.plans.sd3()),
    ]
    results = []
    for model, x, plan in runs:
        pm = fd.nn.parallelize(model, mesh, plan)
        out = pm(**x).sample
        out.pow(2).sum().backward()
        results.append((out.detach(), pm.grads()))
    return results


def test_flux_and_sd35_ulysses_uneven_on_gloo() -> None:
    from tests.dist_harness import run_on_gloo

    want = [
        reference(tiny_flux(), flux_inputs()),
        reference(tiny_sd3(dual_attention_layers=(0,)), sd3_inputs()),
    ]
    for got in run_on_gloo(ulysses_on_gloo, 2, timeout=300):
        for (out, grads), (got_out, got_grads) in zip(want, got, strict=True):
            torch.testing.assert_close(got_out, out, rtol=0, atol=1e-12)
            assert_grads(got_grads, grads)


def ten_tokens(family: str) -> dict[str, Tensor]:
    """10 image tokens (5 + 5 over 2 ranks: the same 5 rows per rank as 9 tokens, no padding)
    and 7 text tokens, other values."""
    g = torch.Generator().manual_seed(2)
    x = {**(sd3_inputs if family == "sd3" else flux_inputs)(text=7)}
    if family == "sd3":
        x["hidden_states"] = torch.randn(2, 4, 2, 5, generator=g, dtype=torch.float64)
        return x
    grid = torch.meshgrid(torch.zeros(1), torch.arange(2.0), torch.arange(5.0), indexing="ij")
    x["hidden_states"] = torch.randn(2, 10, 4, generator=g, dtype=torch.float64)
    x["img_ids"] = torch.stack(grid, -1).reshape(-1, 3).to(torch.float64)  # (10, 3)
    return x


#: (family, reentrant checkpoint) of each run of the checkpointing test
CHECKPOINTED = [("sd3", False), ("sd3", True), ("flux", False), ("flux", True)]


def checkpointed_on_gloo() -> tuple[list[dict[str, Tensor]], str]:
    """One gloo rank of sp=2 (ring), gradient checkpointing on, for each of `CHECKPOINTED`: a
    forward of 9 image tokens (5 + 4), then one of 10 (5 + 5, 7 text tokens) never
    backpropagated, then the first one's backward; every gradient."""
    mesh = fd.connect(sp=2, timeout=120)
    results = []
    for family, reentrant in CHECKPOINTED:
        build, inputs, plan = {
            "sd3": (tiny_sd3, sd3_inputs, fd.nn.plans.sd3),
            "flux": (tiny_flux, flux_inputs, fd.nn.plans.flux),
        }[family]
        model = build()
        model.enable_gradient_checkpointing(  # type: ignore[operator]
            functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=reentrant)
        )
        pm = fd.nn.parallelize(model, mesh, plan(model, mesh, mode="ring"))
        first = pm(**inputs()).sample
        pm(**ten_tokens(family)).sample.sum()  # a second forward, never backpropagated
        first.pow(2).sum().backward()
        results.append(pm.grads())
    return results, refused_on_gloo(mesh)


def refused_on_gloo(mesh: fd.Mesh) -> str:
    """Reentrant checkpointing with both forwards' graphs alive: which one a recomputed block
    belongs to cannot be known; the error."""
    model = tiny_sd3()
    model.enable_gradient_checkpointing(  # type: ignore[operator]
        functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    )
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.sd3(mode="ring"))
    first = pm(**sd3_inputs()).sample
    second = pm(**ten_tokens("sd3")).sample.sum()  # alive: its graph too
    try:
        first.pow(2).sum().backward()
    except ParallelizeError as e:
        return str(e)
    finally:
        del second
    return "not refused"


def test_checkpointed_blocks_recompute_with_their_own_split_on_gloo() -> None:
    """The recomputed blocks of the first forward use its own split (SD3 has no rotary
    embedding to carry it: the blocks' inputs carry it), with diffusers' (non-reentrant)
    checkpointing and a reentrant one (which drops what the inputs carry: the one forward whose
    graph is alive is used); with both forwards' graphs alive, a reentrant recomputation is
    refused."""
    from tests.dist_harness import run_on_gloo

    want = {
        f: reference(b(), i())[1]
        for f, b, i in [("sd3", tiny_sd3, sd3_inputs), ("flux", tiny_flux, flux_inputs)]
    }
    for got, refused in run_on_gloo(checkpointed_on_gloo, 2, timeout=300):
        for (family, _), grads in zip(CHECKPOINTED, got, strict=True):
            assert_grads(grads, want[family])
        assert "transformer_blocks.1 is recomputed in backward" in refused, refused
        assert "[(9, None), (10, None)]" in refused and "use_reentrant=False" in refused
