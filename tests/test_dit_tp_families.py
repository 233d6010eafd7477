"""Tensor x context parallelism of every DiT family with a ready context-parallel plan (issue
38: heads over ``tp``, tokens over ``sp``): `fastdist.nn.plans.dit_tp.dit_tp` builds each
family's plan from its `TpSplit` records (the attentions whose heads are split, the column- and
row-parallel layers, the fused layers' parts). Each family's tiny diffusers model (the builders
of the context-parallel tests, float64, random init) on a simulated ``Mesh({"sp": 2, "tp": 2})``:
the output and every parameter's gradient against the unmodified model on one device, with the
tolerances of the context-parallel tests (outputs 1e-12; gradients 1e-9 of each one's largest
entry, Wan's 1e-6: its float32 norms); ``plan="auto"`` on a mesh with ``tp``; the refusals
(LTX-Video, norms over all heads that are not a plain RMSNorm, a linear layer the split does not
name). Flux on gloo processes: ``test_flux_tp_on_gloo``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fastdist as fd
from fastdist.errors import ParallelizeError
from fastdist.nn.plans.dit import DIT_FAMILIES, TpSplit
from fastdist.nn.plans.dit_tp import ContextTensorParallel, WidthRMSNorm, dit_tp, wan_tp

pytest.importorskip("diffusers")

from tests import test_context_parallel as wan_tests  # noqa: E402
from tests.test_context_dit_families import ltx_inputs  # noqa: E402
from tests.test_context_mmdit import flux_inputs, sd3_inputs  # noqa: E402
from tests.test_context_modes import tiny_wan_i2v  # noqa: E402
from tests.test_dit_families_joint import TINY, assert_grads, reference, stacked  # noqa: E402
from tests.tiny_models import tiny_flux, tiny_ltx, tiny_sd3, tiny_wan  # noqa: E402

Inputs = dict[str, Any]


#: family (its plan's name, then a variant) -> its tiny model and inputs
BUILD: dict[str, Callable[[], tuple[nn.Module, Inputs]]] = {
    "wan": lambda: (tiny_wan(heads=4, layers=1), wan_tests.inputs()),
    "wan-i2v": lambda: tiny_wan_i2v(layers=1),
    # SD3.5: a dual (image-only) attn2 in block 0, q/k RMS norms per head on both streams; the
    # last block context_pre_only (no to_add_out, no ff_context)
    "sd3": lambda: (tiny_sd3(dual_attention_layers=(0,), qk_norm="rms_norm"), sd3_inputs()),
    "flux": lambda: (tiny_flux(), flux_inputs()),
    **{name: TINY[name] for name in ("cogvideox", "qwen_image", "flux2", "hunyuan_video")},
    # q/k RMS norms and rotary tables over the width of all heads (cut to the rank's columns);
    # attn2 a cross-attention to masked text
    "ltx_video": lambda: (tiny_ltx(), ltx_inputs()),
}


def run_tp(case: str, mode: str = "ulysses", axes: dict[str, int] | None = None) -> None:
    """``case`` on a simulated mesh (sp 2 x tp 2; with ``"usp"``, cp 2 the ring's axis) against
    one device."""
    model, x = BUILD[case]()
    out, grads = reference(copy.deepcopy(model), x)
    mesh = fd.Mesh(axes or {"sp": 2, "tp": 2})
    kw: dict[str, Any] = {"mode": mode, "ring_axis": "cp" if mode == "usp" else None}
    pm = fd.nn.parallelize(model, mesh, dit_tp(case.split("-")[0], model, mesh, **kw))
    got = pm(**{k: stacked(v, mesh.size) for k, v in x.items()}).sample
    got.pow(2).sum().backward()
    for r in range(mesh.size):
        torch.testing.assert_close(got[r].detach(), out, rtol=0, atol=1e-12)
    # Wan computes its norms in float32: its tests' tolerance (1e-6); the others' 1e-9
    (wan_tests.assert_grads if case.startswith("wan") else assert_grads)(pm.grads(), grads)


@pytest.mark.parametrize("case", sorted(BUILD))
def test_tp_times_sp_equals_one_device(case: str) -> None:
    """Ulysses over sp (4 heads: 2 per tp rank, 1 per sp rank), heads and MLPs over tp."""
    run_tp(case)


@pytest.mark.parametrize("case", ["flux", "hunyuan_video", "qwen_image"])
def test_tp_times_ring_equals_one_device(case: str) -> None:
    run_tp(case, mode="ring")


@pytest.mark.parametrize("case", ["sd3", "flux2"])
def test_tp_times_usp_equals_one_device(case: str) -> None:
    """cp 2 (ring) x sp 2 (Ulysses) x tp 2: 8 simulated ranks, 1 head each."""
    run_tp(case, mode="usp", axes={"cp": 2, "sp": 2, "tp": 2})


def test_the_split_is_the_records() -> None:
    """After parallelize, each family's attention holds its rank's heads and its linear layers
    their columns or rows (fused parts each split); Wan's norms over all heads are
    `WidthRMSNorm`, the per-head norms stay."""
    mesh = fd.Mesh({"sp": 2, "tp": 2})
    model, _ = BUILD["flux2"]()
    fd.nn.parallelize(model, mesh, dit_tp("flux2", model, mesh))
    single = model.single_transformer_blocks[0].attn
    counts = (single.heads, single.inner_dim, single.mlp_hidden_dim, single.head_dim)
    assert counts == (2, 16, 48, 8)  # the rank's heads, their width, its MLP's; one head's
    assert tuple(single.to_qkv_mlp_proj.weight.shape[1:]) == (144, 32)  # (3 * 32 + 2 * 96) / 2
    assert tuple(single.to_out.weight.shape[1:]) == (32, 64)  # (32 + 96) / 2
    assert type(single.norm_q).__name__ == "RMSNorm"
    model, _ = BUILD["wan-i2v"]()
    fd.nn.parallelize(model, mesh, dit_tp("wan", model, mesh))
    attn2 = model.blocks[0].attn2
    assert isinstance(attn2.norm_added_k, WidthRMSNorm) and attn2.heads == 2
    assert tuple(attn2.add_k_proj.weight.shape[1:]) == (24, 48)


@pytest.mark.parametrize("family", ["sd3", "flux", "cogvideox", "hunyuan_video", "ltx_video"])
def test_auto_picks_the_tp_plan(family: str) -> None:
    model, _ = BUILD[family]()
    mesh = fd.Mesh({"sp": 2, "tp": 2})
    pm = fd.nn.parallelize(model, mesh, "auto", verify=False)
    assert pm.plan == dit_tp(family, mesh=mesh)


def test_every_family_with_a_context_plan_has_a_tp_split_or_a_reason() -> None:
    for name, fam in DIT_FAMILIES.items():
        assert fam.tp or fam.no_tp, name
        assert name in BUILD or fam.no_tp, f"{name}: no tp x sp test"


def test_refusals() -> None:
    mesh = fd.Mesh({"sp": 2, "tp": 2})
    # LTX-Video's tables over the width of all heads, left whole: refused at parallelize
    ltx_plan = dit_tp("ltx_video")[""]
    plan = {"": ContextTensorParallel(ltx_plan.context, split=ltx_plan.split)}
    with pytest.raises(ParallelizeError, match=r"LTXVideoAttnProcessor, which rotates"):
        fd.nn.parallelize(tiny_ltx(), mesh, plan)
    # and cut from a module whose tables are not over that width (Wan's are per head)
    model, x = BUILD["wan"]()
    pm = fd.nn.parallelize(model, mesh, {"": dataclasses.replace(wan_tp()[""], rotary="rope")})
    with pytest.raises(ParallelizeError, match=r"rotary='rope'.* not a table over the width"):
        pm(**{k: stacked(v, mesh.size) for k, v in x.items()})
    # a norm over all heads that is not a torch RMSNorm (CogVideoX's per-head LayerNorm made
    # one over the width): never split silently
    model, _ = BUILD["cogvideox"]()
    model.transformer_blocks[0].attn1.norm_q = nn.LayerNorm(32).double()
    with pytest.raises(ParallelizeError, match=r"attn1\.norm_q \(LayerNorm\) normalizes 32"):
        fd.nn.parallelize(model, mesh, dit_tp("cogvideox", model, mesh))
    # a split that leaves out an attention's projection (Flux's text projections)
    model, _ = BUILD["flux"]()
    double, single = DIT_FAMILIES["flux"].tp
    partial = TpSplit(
        double.blocks,
        double.attentions,
        tuple(c for c in double.column if "add_" not in c),
        double.row,
    )
    plan = {"": ContextTensorParallel(fd.nn.plans.flux()[""], split=(partial, single))}
    with pytest.raises(ParallelizeError, match=r"attn\.add_q_proj is a linear layer .* neither"):
        fd.nn.parallelize(model, mesh, plan)
    # an attention's projections split without its heads (the attention left out)
    model, _ = BUILD["hunyuan_video"]()
    double, single = DIT_FAMILIES["hunyuan_video"].tp
    headless = TpSplit(double.blocks, (), double.column, double.row)
    plan = {"": ContextTensorParallel(fd.nn.plans.hunyuan_video()[""], split=(headless, single))}
    with pytest.raises(ParallelizeError, match=r"attn\.to_q is split .* does not name"):
        fd.nn.parallelize(model, mesh, plan)
    # Ulysses needs the sp ranks to divide a tp rank's heads (4 heads / 2 / 4)
    model, _ = BUILD["qwen_image"]()
    big = fd.Mesh({"sp": 4, "tp": 2})
    with pytest.raises(ParallelizeError, match=r"2 per rank of 'tp'.*mode='ring'"):
        fd.nn.parallelize(model, big, dit_tp("qwen_image", model, big))
    with pytest.raises(ParallelizeError, match="not a diffusers FluxTransformer2DModel"):
        dit_tp("flux", tiny_sd3())


# ------------------------------------------------------------------ real ranks
def flux_tp_on_gloo() -> tuple[Tensor, dict[str, Tensor]]:
    """One gloo rank of sp 2 x tp 2 (Ulysses), Flux: the whole output and every gradient."""
    mesh = fd.connect(sp=2, tp=2, timeout=120)
    model = tiny_flux()
    pm = fd.nn.parallelize(model, mesh, dit_tp("flux", model, mesh))
    out = pm(**flux_inputs()).sample
    out.pow(2).sum().backward()
    return out.detach(), pm.grads()


def test_flux_tp_on_gloo() -> None:
    from tests.dist_harness import run_on_gloo

    out, grads = reference(tiny_flux(), flux_inputs())
    for got, got_grads in run_on_gloo(flux_tp_on_gloo, 4, timeout=300):
        torch.testing.assert_close(got, out, rtol=0, atol=1e-12)
        assert_grads(got_grads, grads)
