"""physicsnemo's own networks (``physicsnemo.models``, tiny configs, random init) made
domain-parallel with `fastdist.nn.DomainParallel`, against the same network on one device in
float64, forward and backward: the 3-D ``UNet`` on simulated ranks (2 and 4; D, H, W, H x W and
D x H x W splits; even and uneven blocks; its padding, pooling and normalization options) and on
2 gloo processes; the ``FNO``'s refusal (its spectral convolutions transform every spatial dim);
and the benchmark's side by side with physicsnemo's ``ShardTensor`` on the same gloo ranks.

CI and the repository's ``.venv`` skip this whole file: ``nvidia-physicsnemo`` requires
``torchvision``, whose wheel cannot load beside the CPU torch of this repository and then breaks
``import transformers``, so physicsnemo is not installed there. The file runs in the separate
environment ``benchmarks/setup_physicsnemo_env.sh`` builds (physicsnemo without its
dependencies, a torchvision stub served by the benchmark's ``import_physicsnemo`` inside the
process only)::

    benchmarks/setup_physicsnemo_env.sh          # once: /tmp/pnvenv
    /tmp/pnvenv/bin/python -m pytest -p no:cacheprovider -n 0 tests/test_physicsnemo_models.py

(about 3 minutes on 2 cores). The skip asks only whether physicsnemo is installed (nothing is
imported, no stub is served where it is not): where it is, a broken import fails the file
instead of skipping it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

if importlib.util.find_spec("physicsnemo") is None:
    pytest.skip(
        "nvidia-physicsnemo is not installed (it needs torchvision, which breaks this CPU torch): "
        "run this file in the environment of benchmarks/setup_physicsnemo_env.sh",
        allow_module_level=True,
    )

import fastdist as fd  # noqa: E402
import tests.test_domain as test_domain  # noqa: E402
from tests.physicsnemo_gloo_worker import (  # noqa: E402
    GLOO_CASES,
    SIDE_BY_SIDE,
    GlooCase,
    one_device,
    shardtensor_benchmark,
    side_by_side_net,
    unet,
)

BENCH = shardtensor_benchmark()
F64 = torch.float64
TOL = 1e-10

#: meshes beyond tests/test_domain.py's MESHES: 4 ranks over one dim
MORE_MESHES = {"h4": ({"h": 4}, {-2: "h"}), "d": ({"t": 2}, {-3: "t"})}


@pytest.fixture
def meshes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``test_domain.equal_to_one_device`` with the meshes of ``MORE_MESHES`` too."""
    for name, mesh in MORE_MESHES.items():
        monkeypatch.setitem(test_domain.MESHES, name, mesh)


@pytest.mark.parametrize(
    ("split", "shape", "sizes"),
    [
        ("h", (1, 2, 4, 8, 6), None),  # 2 ranks, one split dim
        ("h", (1, 2, 4, 12, 6), {-2: [4, 8]}),
        ("d", (1, 2, 8, 4, 6), {-3: [6, 2]}),
        ("h4", (1, 2, 4, 16, 6), None),  # 4 ranks, one split dim
        ("h4", (1, 2, 4, 14, 6), {-2: [4, 2, 4, 4]}),
        ("hw", (1, 2, 4, 8, 12), None),  # 4 ranks, two split dims
        ("hw", (1, 2, 4, 12, 10), {-2: [8, 4], -1: [4, 6]}),
        ("thw", (1, 2, 4, 8, 8), None),  # 8 ranks, D x H x W
    ],
)
@pytest.mark.usefixtures("meshes")
def test_unet(split: str, shape: tuple[int, ...], sizes: Any) -> None:
    """physicsnemo's 3-D ``UNet``: ``Conv3d`` (zero padding), ``GroupNorm`` over the whole
    domain, ``MaxPool3d(2)``, ``ConvTranspose3d(3, stride=2, padding=1, output_padding=1)``, the
    skip connection's ``torch.cat``; the output, the input gradient and every parameter gradient
    equal to one device, even and uneven blocks (each a multiple of the pooling's 2 rows)."""
    test_domain.equal_to_one_device(unet(), shape, split, sizes=sizes)


@pytest.mark.parametrize(
    ("options", "split", "shape", "sizes"),
    [
        ({"padding_mode": "reflect", "pooling_type": "AvgPool3d"}, "hw", (1, 2, 4, 8, 12), None),
        ({"padding_mode": "circular"}, "h4", (1, 2, 4, 14, 6), {-2: [4, 2, 4, 4]}),
        ({"padding_mode": "replicate"}, "h", (1, 2, 4, 12, 6), {-2: [8, 4]}),
        ({"normalization": "layernorm"}, "hw", (1, 2, 4, 12, 10), {-2: [8, 4], -1: [4, 6]}),
        ({"normalization": "batchnorm"}, "hw", (1, 2, 4, 8, 12), None),
        ({"gradient_checkpointing": True}, "hw", (1, 2, 4, 8, 12), None),
        (
            {"model_depth": 3, "feature_map_channels": [4, 4, 8, 8, 8, 8]},
            "h",
            (1, 2, 4, 16, 8),
            {-2: [4, 12]},
        ),
    ],
)
@pytest.mark.usefixtures("meshes")
def test_unet_options(options: dict[str, Any], split: str, shape: Any, sizes: Any) -> None:
    """The ``UNet``'s other options: reflect, circular and replicate padding (the halo from the
    other end of the domain, or the domain's edge), average pooling, its ``ReshapedLayerNorm``
    (channels of each voxel: token-local), ``BatchNorm3d`` (in eval mode on simulated ranks,
    which refuse a training-mode one with running statistics), its own activation
    checkpointing (physicsnemo's default; recomputed on the simulated ranks), three levels."""
    net = unet(**options)
    if options.get("normalization") == "batchnorm":
        net.eval()
    test_domain.equal_to_one_device(net, shape, split, sizes=sizes)


def test_unet_refusals() -> None:
    """Blocks that a pooling window would straddle are refused at the first call (the pooling,
    the stride and the blocks named). (The ``UNet``'s attention gates, ``Attention3DBlock``,
    pointwise despite the name, run: ``test_unet_with_attention_gates``.)"""
    style = fd.nn.DomainParallel({-2: "h"}, sizes={-2: [3, 5]})
    pm = fd.nn.parallelize(unet(), fd.Mesh({"h": 2}), {"": style})
    x = torch.randn(1, 2, 4, 8, 6, dtype=F64)
    with pytest.raises(fd.nn.ParallelizeError, match=r"MaxPool3d.*stride 2.*blocks of \[3, 5\]"):
        pm(x.expand(2, *x.shape))


@pytest.mark.parametrize("split", ["h", "hw"])
@pytest.mark.usefixtures("meshes")
def test_unet_with_attention_gates(split: str) -> None:
    """The ``UNet`` with its attention gates (``Attention3DBlock``: 1 x 1 x 1 convolutions, its
    channel layer norm, a sigmoid and ``x * psi``: pointwise, a container of the style's layers
    despite its name) equals one device forward and backward."""
    gated = unet(
        use_attn_gate=True, attn_decoder_feature_maps=[8], attn_feature_map_channels=[4],
        attn_intermediate_channels=4,
    )  # fmt: skip
    test_domain.equal_to_one_device(gated, (1, 2, 4, 8, 8), split)


def test_fno_is_refused() -> None:
    """physicsnemo's 2-D ``FNO``: its spectral convolutions are an FFT over H and W, so no split
    of a spatial dim can be right; the style refuses it whatever ``local=`` says (the
    benchmark's ``fastdist_on_fno`` over H on 2 ranks: the unknown spectral convolutions;
    declared local, the
    model's ``F.pad`` of the split dim; without that padding, its ``rfft2`` over the split dim at
    the first call), and over H x W on 4 ranks. No physicsnemo FNO transforms fewer than all
    its spatial dims, so there is no split dim its spectral layers leave alone."""
    got = dict(BENCH.fastdist_on_fno())
    assert len(got) == 4, got
    assert all(v.startswith("ParallelizeError") for v in got.values()), got
    said = list(got.values())
    # the first modules the style does not know (physicsnemo's Identity, where it knows it not)
    assert "cannot split these modules" in said[0], said[0]
    assert "(SpectralConv2d)" in said[0] or "(Identity)" in said[0], said[0]
    assert "cannot split these modules" in said[1] and "(SpectralConv2d)" in said[1], said[1]
    assert "pads the split dim -2 itself" in said[2], said[2]
    assert "calls fft_rfft2 over the split dim -2" in said[3], said[3]
    from physicsnemo.models.fno import FNO
    from physicsnemo.nn import SpectralConv2d
    from physicsnemo.nn.module.activations import Identity

    torch.manual_seed(0)
    fno = FNO(
        in_channels=2, out_channels=2, dimension=2, latent_channels=8, num_fno_layers=2,
        num_fno_modes=4, padding=0, decoder_layers=1, decoder_layer_size=8,
    ).to(F64)  # fmt: skip
    style = fd.nn.DomainParallel({-2: "h", -1: "w"}, local=(Identity, SpectralConv2d))
    pm = fd.nn.parallelize(fno, fd.Mesh({"h": 2, "w": 2}), {"": style})
    x = torch.randn(1, 2, 16, 16, dtype=F64)
    # refused at its first op over the split dims: the FFT, or (the guard following the split
    # dims) the concatenation of its coordinate grid, whose split dims lie elsewhere
    with pytest.raises(
        fd.nn.ParallelizeError, match=r"fft_rfft2 over the split dim|calls torch.cat itself"
    ):
        pm(x.expand(4, *x.shape))


# --------------------------------------------------------------------------- gloo processes
@pytest.fixture(scope="module")
def unet_on_gloo() -> dict[str, Any]:
    """Every ``GLOO_CASES`` run on 2 gloo processes, once for the tests that check them."""
    from tests.dist_harness import run_on_gloo
    from tests.physicsnemo_gloo_worker import unet_on_gloo

    return {"ranks": run_on_gloo(unet_on_gloo, 2, timeout=300)}


@pytest.mark.parametrize("case", GLOO_CASES, ids=[c.name for c in GLOO_CASES])
def test_unet_on_gloo(case: GlooCase, unet_on_gloo: dict[str, Any]) -> None:
    """physicsnemo's ``UNet`` on 2 gloo processes (each the whole field in, the whole output
    out), training mode: every rank's output, input gradient, parameter gradients and batch
    norms' running statistics equal to one device's."""
    want = one_device(case)
    for rank, per_rank in enumerate(unet_on_gloo["ranks"]):
        got = per_rank[case.name]
        assert torch.allclose(got["out"], want["out"], atol=TOL), rank
        assert torch.allclose(got["dx"], want["dx"], atol=TOL), rank
        assert got["grads"].keys() == want["grads"].keys()
        for name, g in want["grads"].items():
            assert torch.allclose(got["grads"][name], g, atol=TOL), (rank, name)
        assert got["running"].keys() == want["running"].keys()
        for name, r in want["running"].items():
            assert torch.allclose(got["running"][name], r, atol=TOL), (rank, name)


def test_unet_over_h_and_w_on_4_gloo_processes() -> None:
    """physicsnemo's ``UNet`` on 4 gloo processes, H x W over a 2 x 2 mesh, even and with W
    uneven: every rank's output, input gradient and parameter gradients equal to one device's."""
    from tests.dist_harness import run_on_gloo
    from tests.physicsnemo_gloo_worker import GLOO_CASES_4, unet_on_gloo_4

    ranks = run_on_gloo(unet_on_gloo_4, 4, timeout=300)
    for case in GLOO_CASES_4:
        want = one_device(case)
        for rank, per_rank in enumerate(ranks):
            got = per_rank[case.name]
            assert torch.allclose(got["out"], want["out"], atol=TOL), (case.name, rank)
            assert torch.allclose(got["dx"], want["dx"], atol=TOL), (case.name, rank)
            for name, g in want["grads"].items():
                assert torch.allclose(got["grads"][name], g, atol=TOL), (case.name, rank, name)


def test_unet_checkpointing_on_gloo(unet_on_gloo: dict[str, Any]) -> None:
    """On real ranks the ``UNet``'s own activation checkpointing (``gradient_checkpointing=True``,
    physicsnemo's default, non-reentrant) recomputes its layers in the backward, where each
    re-enters its domain-parallel region: every rank's output, input gradient and parameter
    gradients equal to one device's (the simulated ranks: ``test_unet_options``)."""
    case = GlooCase("checkpointing", {-2: "h"}, (1, 2, 4, 8, 6), None, {})
    want = one_device(case)
    for rank, got in enumerate(r["checkpointing"] for r in unet_on_gloo["ranks"]):
        assert "error" not in got, got.get("error")
        assert torch.allclose(got["out"], want["out"], atol=TOL), rank
        assert torch.allclose(got["dx"], want["dx"], atol=TOL), rank
        assert got["grads"].keys() == want["grads"].keys()
        for name, g in want["grads"].items():
            assert torch.allclose(got["grads"][name], g, atol=TOL), (rank, name)


def test_side_by_side_with_shardtensor_on_gloo() -> None:
    """The benchmark's float64 check (``benchmarks/domain_vs_shardtensor.py``) as a test: on the
    same 2 gloo ranks, H split in two, its conv net run by fastdist's ``DomainParallel`` and by
    physicsnemo's ``ShardTensor`` gives the same output blocks, input gradient and parameter
    gradients, both equal to one device; physicsnemo's 3-D ``UNet`` runs under fastdist equal
    to one device, and where ``ShardTensor`` runs it (2.2.2 refuses its
    ``ConvTranspose3d(3, stride=2, padding=1)``), equal to fastdist."""
    from tests.dist_harness import run_on_gloo
    from tests.physicsnemo_gloo_worker import shardtensor_on_gloo

    per_rank = run_on_gloo(shardtensor_on_gloo, 2, timeout=300)
    for name, shape in SIDE_BY_SIDE:
        want = _whole_on_one_device(side_by_side_net(name, BENCH), shape)
        fastdist = _whole([r[name]["fastdist"] for r in per_rank], dim=len(shape) - 2)
        _assert_equal(fastdist, want, f"{name}: fastdist vs one device")
        st = [r[name]["ShardTensor"] for r in per_rank]
        if name == "conv net" or "error" not in st[0]:
            _assert_equal(_whole(st, dim=len(shape) - 2), fastdist, f"{name}: fastdist vs ST")


def _whole_on_one_device(net: torch.nn.Module, shape: tuple[int, ...]) -> dict[str, Any]:
    from tests.physicsnemo_gloo_worker import field

    x = field(shape, 1).requires_grad_()
    out = net(x)
    (out * field(shape, 2)).sum().backward()
    return {
        "out": out.detach(),
        "dx": x.grad,
        "grads": [{n: p.grad for n, p in net.named_parameters()}],
    }


def _whole(ranks: list[dict[str, Any]], dim: int) -> dict[str, Any]:
    """The ranks' blocks (H: ``dim``) put together; each rank's parameter gradients as they are
    (each should be the whole gradient)."""
    errors = [r["error"] for r in ranks if "error" in r]
    assert not errors, errors[0]
    return {
        "out": torch.cat([r["out"] for r in ranks], dim=dim),
        "dx": torch.cat([r["dx"] for r in ranks], dim=dim),
        "grads": [r["grads"] for r in ranks],
    }


def _assert_equal(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert torch.allclose(got["out"], want["out"], atol=TOL), what
    assert torch.allclose(got["dx"], want["dx"], atol=TOL), what
    reference = want["grads"][0]
    for grads in got["grads"]:
        assert grads.keys() == reference.keys(), what
        for n, g in reference.items():
            assert torch.allclose(grads[n], g, atol=TOL), (what, n)
