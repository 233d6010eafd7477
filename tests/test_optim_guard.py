"""An optimizer built over a model before ``fastdist.nn.parallelize`` replaced its parameters
raises at its first step (it stepped the old tensors: the model trained nothing, no error)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import fastdist as fd
from fastdist.errors import ParallelizeError

F64 = torch.float64
PLAN = {"0": fd.nn.ColwiseParallel(), "2": fd.nn.RowwiseParallel()}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).to(F64)


def _loss(pm: fd.nn.ParallelModel) -> torch.Tensor:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    return pm(x.expand(2, 3, 4)).square().sum()


def test_an_optimizer_built_before_parallelize_raises_at_step() -> None:
    model = _mlp()
    early = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pm = fd.nn.parallelize(model, fd.Mesh({"tp": 2}), PLAN)
    _loss(pm).backward()
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    with pytest.raises(ParallelizeError, match=r"AdamW holds \['0.weight'.* Fix: build the opt"):
        early.step()  # before: it updated the dropped tensors and the model stayed as it was
    assert all(torch.equal(p, before[n]) for n, p in pm.named_parameters())
    torch.optim.AdamW(pm.parameters(), lr=1e-2).step()  # built after: trains
    assert not all(torch.equal(p, before[n]) for n, p in pm.named_parameters())


def test_optimizers_of_other_models_are_untouched() -> None:
    """Only the replaced tensors are refused: an optimizer over another model, or over the
    parallelized model's parameters, steps; once the replaced ones are gone the check is too."""
    other = _mlp()
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    pm = fd.nn.parallelize(_mlp(), fd.Mesh({"tp": 2}), PLAN)
    gc.collect()  # the replaced parameters had no other owner
    other(torch.ones(1, 4, dtype=F64)).sum().backward()
    opt.step()
    _loss(pm).backward()
    torch.optim.SGD(pm.parameters(), lr=0.1).step()
