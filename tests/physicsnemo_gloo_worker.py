"""physicsnemo's networks domain-parallel on real gloo ranks (`tests/test_physicsnemo_models.py`
runs these with `tests.dist_harness.run_on_gloo`), and the import of physicsnemo the simulated
tests share with them.

physicsnemo is never imported at this module's import: the repository's ``.venv`` (where
pytest's ``--doctest-modules`` imports every module under ``tests/``) has no physicsnemo. It is
imported through ``benchmarks/domain_vs_shardtensor.py``'s ``import_physicsnemo``, which serves
``torchvision`` as a stub where none is installed (the separate environment of
``benchmarks/setup_physicsnemo_env.sh``), in the calling process only; each gloo rank imports
it again the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

import fastdist as fd

ROOT = Path(__file__).resolve().parent.parent
F64 = torch.float64


def shardtensor_benchmark() -> ModuleType:
    """``benchmarks/domain_vs_shardtensor.py`` as a module, with physicsnemo imported (the
    torchvision stub where torchvision is missing) and its ``ShardTensor`` layer patches
    registered: its ``import_physicsnemo``, its nets (``conv_net``, ``physicsnemo_unet``) and
    its two-sided runner ``Sides`` are what the tests reuse."""
    path = str(ROOT / "benchmarks")
    if path not in sys.path:
        sys.path.insert(0, path)
    import domain_vs_shardtensor as bench  # type: ignore[import-not-found]

    bench.import_physicsnemo()
    return bench


def unet(**options: Any) -> nn.Module:
    """physicsnemo's 3-D ``UNet`` ([N, C, D, H, W]), small, float64, seeded: two levels of two
    ``Conv3d`` + ``GroupNorm`` + ReLU blocks, ``MaxPool3d(2)``, a ``ConvTranspose3d(3, stride=2,
    padding=1, output_padding=1)`` up, a skip connection; ``options`` override the config."""
    from physicsnemo.models.unet import UNet

    config: dict[str, Any] = {
        "in_channels": 2,
        "out_channels": 2,
        "model_depth": 2,
        "feature_map_channels": [4, 4, 8, 8],
        "num_conv_blocks": 2,
        "gradient_checkpointing": False,
    }
    torch.manual_seed(0)
    return UNet(**(config | options)).to(F64)


def field(shape: tuple[int, ...], seed: int) -> Tensor:
    """A float64 field of ``shape`` from its own generator."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


class GlooCase(NamedTuple):
    """One run of physicsnemo's ``UNet`` on the 2 gloo ranks (mesh axis ``h``)."""

    name: str
    split: dict[int, str]
    shape: tuple[int, ...]
    sizes: dict[int, list[int]] | None
    options: dict[str, Any]


GLOO_CASES = (
    GlooCase("H", {-2: "h"}, (1, 2, 4, 8, 6), None, {}),
    GlooCase("H uneven 4 + 8", {-2: "h"}, (1, 2, 4, 12, 6), {-2: [4, 8]}, {}),
    GlooCase("W", {-1: "h"}, (1, 2, 4, 6, 8), None, {}),
    GlooCase("D uneven 2 + 6", {-3: "h"}, (1, 2, 8, 4, 6), {-3: [2, 6]}, {}),
    GlooCase(
        "H, training-mode BatchNorm3d (running statistics)",
        {-2: "h"},
        (2, 2, 4, 8, 6),
        None,
        {"normalization": "batchnorm"},
    ),
)


def one_device(case: GlooCase) -> dict[str, Any]:
    """The case's model on one device: output, input gradient, parameter gradients and the
    batch norms' running statistics."""
    net = unet(**case.options)
    x = field(case.shape, 1).requires_grad_()
    out = net(x)
    (out * field(out.shape, 2)).sum().backward()
    return {
        "out": out.detach(),
        "dx": x.grad,
        "grads": {n: p.grad for n, p in net.named_parameters()},
        "running": running_statistics(net),
    }


def running_statistics(net: nn.Module) -> dict[str, Tensor]:
    """Every buffer named ``running_*`` (the batch norms'), cloned."""
    return {n: b.clone() for n, b in net.named_buffers() if n.rsplit(".", 1)[-1].startswith("run")}


def unet_on_gloo() -> dict[str, Any]:
    """One rank of 2: each of ``GLOO_CASES`` forward and backward (the whole field in, the whole
    output gathered), training mode; the output, input and parameter gradients and running
    statistics of each; and under ``"checkpointing"`` the ``UNet`` with its own activation
    checkpointing on (physicsnemo's default), split over H (``checkpointing_run``)."""
    shardtensor_benchmark()  # physicsnemo imported in this rank as in the parent
    mesh = fd.connect(h=2, timeout=180)
    results = {}
    for case in GLOO_CASES:
        net = unet(**case.options)
        pm = fd.nn.parallelize(net, mesh, {"": fd.nn.DomainParallel(case.split, sizes=case.sizes)})
        x = field(case.shape, 1).requires_grad_()
        out = pm(x)
        (out * field(out.shape, 2)).sum().backward()
        results[case.name] = {
            "out": out.detach(),
            "dx": x.grad,
            "grads": pm.grads(),
            "running": running_statistics(net),
        }
    results["checkpointing"] = checkpointing_run(mesh)
    return results


def checkpointing_run(mesh: fd.Mesh) -> dict[str, Any]:
    """The ``UNet`` with ``gradient_checkpointing=True`` (physicsnemo's default:
    ``checkpoint(layer, x, use_reentrant=False)`` around each layer) split over H, forward and
    backward: the output, input and parameter gradients, or ``{"error": ...}`` if it raised."""
    net = unet(gradient_checkpointing=True)
    pm = fd.nn.parallelize(net, mesh, {"": fd.nn.DomainParallel({-2: "h"})})
    x = field((1, 2, 4, 8, 6), 1).requires_grad_()
    try:
        out = pm(x)
        (out * field(out.shape, 2)).sum().backward()
    except fd.nn.ParallelizeError as e:
        return {"error": str(e)}
    return {"out": out.detach(), "dx": x.grad, "grads": pm.grads()}


#: the benchmark's two rows checked side by side: name, its net, the field ([N, C, (D,) H, W])
SIDE_BY_SIDE = (("conv net", (1, 4, 16, 16)), ("physicsnemo UNet (3-D)", (1, 2, 8, 16, 8)))


def side_by_side_net(name: str, bench: ModuleType) -> nn.Module:
    """The benchmark's net of row ``name``, seeded, float64."""
    torch.manual_seed(0)
    make = (lambda: bench.conv_net(4, 8)) if name == "conv net" else bench.physicsnemo_unet
    net: nn.Module = make().to(F64)
    return net


def shardtensor_on_gloo() -> dict[str, Any]:
    """One rank of 2, H split in two: each ``SIDE_BY_SIDE`` net run by fastdist
    (``DomainParallel``, ``output="split"``) and by physicsnemo's ``ShardTensor`` through the
    benchmark's ``Sides``; per side this rank's output block, input-gradient block and the
    parameter gradients, or the error the side raised."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    bench = shardtensor_benchmark()
    pdp = bench.import_physicsnemo()
    dmesh = init_device_mesh("cpu", (2,), mesh_dim_names=("h",))
    mesh = fd.connect(h=2, timeout=180)
    results: dict[str, Any] = {}
    for name, shape in SIDE_BY_SIDE:
        sides = bench.Sides(side_by_side_net(name, bench), pdp, dmesh, mesh, len(shape))
        x, cot = field(shape, 1), field(shape, 2)
        got: dict[str, Any] = {}
        for side, run, module in (
            ("fastdist", sides.run_fd, sides.fd_module),
            ("ShardTensor", sides.run_st, sides.st),
        ):
            xr = x.clone().requires_grad_()
            try:
                out = run(xr)
                (out * sides.block(cot)).sum().backward()
            except Exception as e:  # noqa: BLE001 (a side that refuses the net: its error)
                got[side] = {"error": f"{type(e).__name__}: {e}"}
                dist.barrier()
                continue
            got[side] = {
                "out": out.detach(),
                "dx": sides.block(xr.grad),
                "grads": {n: p.grad.clone() for n, p in module.named_parameters()},
            }
        results[name] = got
    dist.barrier()  # both sides' collectives done on both ranks before either tears down
    return results


#: runs on 4 gloo processes, a 2 x 2 mesh (``h`` x ``w``): H x W even, and H x W with W uneven
GLOO_CASES_4 = (
    GlooCase("H x W", {-2: "h", -1: "w"}, (1, 2, 4, 8, 8), None, {}),
    GlooCase("H x W, W uneven 4 + 8", {-2: "h", -1: "w"}, (1, 2, 4, 8, 12), {-1: [4, 8]}, {}),
)


def unet_on_gloo_4() -> dict[str, Any]:
    """One rank of 4 (``h`` x ``w`` = 2 x 2): each of ``GLOO_CASES_4`` forward and backward as
    `unet_on_gloo` does."""
    shardtensor_benchmark()  # physicsnemo imported in this rank as in the parent
    mesh = fd.connect(h=2, w=2, timeout=180)
    results = {}
    for case in GLOO_CASES_4:
        net = unet(**case.options)
        pm = fd.nn.parallelize(net, mesh, {"": fd.nn.DomainParallel(case.split, sizes=case.sizes)})
        x = field(case.shape, 1).requires_grad_()
        out = pm(x)
        (out * field(out.shape, 2)).sum().backward()
        results[case.name] = {"out": out.detach(), "dx": x.grad, "grads": pm.grads()}
    return results
