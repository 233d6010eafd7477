"""A hand plan that runs a sparse-MoE block whole on every rank behind a ``PrepareInput`` (a
``pvary``): refused at ``parallelize``.

The bug: a Qwen2-MoE (``mlp_only_layers=[0]``) whose expert block got only
``PrepareInput("tp")`` passed ``verify=True`` on two gloo processes (the forward is one
device's), and every gradient before the block came out summed over tp (2x). The replication
tracker of `fastdist.nn.replicas` did see the block's parameters meet varying values; but the
block's output, typed varying, then broke ``lm_head``'s ``pvary`` of its replicated input (a
`ReplicationError`), and `unreduced` dropped everything it had found when the forward raised.
On simulated ranks the default ``parallelize`` (no ``verify``) passed the same way (the
experts' ``nonzero`` raised under vmap), and the first call raised the bare vmap error.

The same swallowed `ReplicationError` with nothing found before it: a ``PrepareInput`` on a
module whose input a ``ColwiseParallel`` already split passed ``verify=True`` on simulated
ranks, its forward one device's and the first layer's gradients all wrong (the extra pvary's
backward sums the ranks' gradients of different columns).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fastdist as fd

pytest.importorskip("transformers")

from tests.review_replicas_moe_worker import (  # noqa: E402
    pvary_moe_on_gloo,
    pvary_moe_plan,
    qwen_dense_then_experts,
)

#: what every refusal names: the block's parameters, and the fixes that are right for it
NAMES = ("model.layers.1.mlp.", "PrepareInput('tp')", "ExpertParallel", "out of the plan")


def test_moe_block_behind_pvary_refused_on_simulated_ranks() -> None:
    ref = qwen_dense_then_experts()
    with pytest.raises(fd.nn.ParallelizeError) as info:
        fd.nn.parallelize(copy.deepcopy(ref), fd.Mesh({"tp": 2}), pvary_moe_plan(ref))
    for name in NAMES:
        assert name in str(info.value), (name, str(info.value))


def test_moe_block_behind_pvary_refused_on_two_gloo_processes() -> None:
    """Real ranks: the plan gives 2x gradients before the block (checked with verify=False),
    and parallelize refuses it with verify=True and by default."""
    from tests.dist_harness import run_on_gloo

    for found in run_on_gloo(pvary_moe_on_gloo, 2, timeout=300):
        assert found["ratio"] == pytest.approx(2.0, rel=1e-6), found["ratio"]
        for key in ("verify", "default"):
            for name in NAMES:
                assert name in found[key], (key, name, found[key])


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16, dtype=torch.float64)
        self.inner = nn.Sequential(nn.Linear(16, 8, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.a(x)).sum(-1)


def test_prepare_input_on_a_split_input_refused() -> None:
    torch.manual_seed(0)
    model = _TwoLayers()
    x = torch.randn(3, 8, dtype=torch.float64)
    mesh = fd.Mesh({"tp": 2})
    plan = {
        "a": fd.nn.ColwiseParallel("tp", input="replicated"),
        "inner": fd.nn.PrepareInput("tp"),
        "inner.0": fd.nn.RowwiseParallel("tp"),
    }
    # what the plan gives: the forward is one device's, a's gradients are not
    pm = fd.nn.parallelize(copy.deepcopy(model), mesh, plan, verify=False)
    model(x).sum().backward()
    out = pm(x=x.expand(2, *x.shape))
    torch.testing.assert_close(out[0], model(x).detach(), rtol=1e-12, atol=1e-12)
    out.sum().backward()
    grads = pm.grads()
    want = model.a.weight.grad
    assert want is not None
    assert float((grads["a.weight"] - want).abs().max()) > 0.1 * float(want.abs().max())
    torch.testing.assert_close(grads["inner.0.weight"], model.inner[0].weight.grad)
    with pytest.raises(fd.nn.ParallelizeError, match=r"in 'inner' \(Sequential\).*pvary"):
        fd.nn.parallelize(copy.deepcopy(model), mesh, plan, verify={"x": x})
