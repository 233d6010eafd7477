"""`fastdist.nn.pvary_sites.PvarySites` on real ranks: a parameter listed for two axes, or twice
for one, keeps its slot and gets its gradient summed once over each axis."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import fastdist as fd
from fastdist.nn.pvary_sites import PvarySites
from tests.dist_harness import run_on_gloo


def listed_twice_on_gloo() -> dict[str, Any]:
    mesh = fd.connect(dp=1, tp=2)
    rank = mesh.index(mesh.rank, "tp")
    torch.manual_seed(0)
    lin = nn.Linear(3, 2, dtype=torch.float64)
    weight = lin.weight
    # weight over tp and dp, and over tp a second time: pvary'd once per axis
    PvarySites(mesh, [(lin, "weight", "tp"), (lin, "weight", "dp"), (lin, "weight", "tp")])
    xs = torch.randn(2, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    lin(xs[rank]).sum().backward()
    return {
        "same_parameter": lin.weight is weight and isinstance(lin.weight, nn.Parameter),
        "grad": weight.grad,
        "want": xs.sum(dim=(0, 1)).expand(2, 3),  # d/dW of sum(x W^T) summed over both ranks
    }


def test_a_parameter_listed_for_two_axes_and_twice_on_gloo() -> None:
    for r in run_on_gloo(listed_twice_on_gloo, 2):
        assert r["same_parameter"]
        torch.testing.assert_close(r["grad"], r["want"])
