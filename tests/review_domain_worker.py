"""Gloo ranks for tests/test_review_domain.py: a few conv nets under ``DomainParallel`` on real
ranks (uneven blocks), each rank's whole output and gradients, or the error it raised."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fastdist as fd

F64 = torch.float64


class Interp(nn.Module):
    """A convolution, the model's own ``F.interpolate(size=)`` (the whole domain's), a conv."""

    def __init__(self, size: tuple[int, int]) -> None:
        super().__init__()
        self.size = size
        self.a, self.b = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(F.interpolate(self.a(x), size=self.size, mode="bilinear"))


def _se() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.AdaptiveAvgPool2d(1),
        nn.Conv2d(4, 2, 1),
    )  # fmt: skip


#: (name, model, field shape, dims, sizes)
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], dict[int, str], Any]] = {
    "interp_size_uneven": (lambda: Interp((14, 10)), (1, 2, 7, 5), {-2: "h"}, {-2: [3, 4]}),
    "pool_norm_uneven": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect"), nn.InstanceNorm2d(4),
            nn.MaxPool2d(3, 2, 1), nn.AvgPool2d(3, 1, 1, count_include_pad=False),
            nn.ConvTranspose2d(4, 2, 4, 2, 1),
        ),
        (1, 2, 10, 6), {-2: "h"}, {-2: [4, 6]},
    ),
    "global_pool_uneven": (_se, (2, 2, 7, 5), {-1: "h"}, {-1: [2, 3]}),
    # refused (REFUSED): an unbatched field; one row per rank beside a global pooling
    "unbatched": (lambda: nn.Conv2d(2, 2, 3, padding=1), (2, 8, 6), {-2: "h"}, None),
    "thin_pooled": (
        lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.AdaptiveAvgPool2d(1)),
        (1, 2, 2, 6), {-2: "h"}, None,
    ),
}  # fmt: skip

#: the cases refused on every rank, and what the message says
REFUSED = {
    "unbatched": "not a batched [N, C, *spatial] tensor",
    "thin_pooled": "a rank holds a block of one row and a global pooling",
}


def build(case: str) -> tuple[nn.Module, Tensor, dict[int, str], Any]:
    """The model (float64, seeded) and its field for ``case``."""
    make, shape, dims, sizes = CASES[case]
    torch.manual_seed(0)
    net = make().to(F64)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    return net, x, dims, sizes


def run_case(case: str) -> dict[str, Any]:
    """One rank: ``case`` forward and backward (loss: the sum of the output times a fixed
    cotangent) on a 2-rank mesh; the output, the field's and parameters' gradients, or the
    error."""
    mesh = fd.connect(h=2, timeout=60)
    net, x, dims, sizes = build(case)
    pm = fd.nn.parallelize(net, mesh, {"": fd.nn.DomainParallel(dims, sizes=sizes)})
    xr = x.clone().requires_grad_()
    try:
        out = pm(xr)
    except fd.nn.ParallelizeError as e:
        return {"error": str(e)}
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    (out * cot).sum().backward()
    return {"out": out.detach(), "dx": xr.grad, "grads": pm.grads()}
