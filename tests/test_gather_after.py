"""`GatherSequence(after=True)`: a per-token module (the final norm) on this rank's sequence shard,
its output gathered, equals one device (values and gradients, float64); a module whose output
is not a tensor is refused at the first call."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fastdist as fd


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.norm, self.head = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.body(x))
        return self.head(h)


class _PairNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return super().forward(x), x


class _PairToy(_Toy):
    """`_Toy` whose norm returns a pair (the hidden states first)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = _PairNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x))[0])


def _plan(after: bool) -> dict[str, object]:
    return {
        "body": (fd.nn.SequenceShard("tp"), fd.nn.PvaryParams("tp")),
        "norm": fd.nn.GatherSequence("tp", after=after),
        "head": fd.nn.ColwiseParallel("tp", input="replicated", gather_output=True),
    }


@pytest.mark.parametrize("after", [False, True], ids=["input", "output"])
def test_final_norm_on_the_shards_equals_one_device(after: bool) -> None:
    torch.manual_seed(0)
    one = _Toy().double()
    with torch.no_grad():
        one.norm.weight.normal_()
        one.norm.bias.normal_()
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(copy.deepcopy(one), mesh, _plan(after))
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    out = pm(x.expand(2, *x.shape))
    want = one(x)
    torch.testing.assert_close(out, want.expand(2, *want.shape), rtol=1e-12, atol=1e-12)
    (out**2).sum().backward()
    (want**2).sum().backward()
    got = pm.grads()  # checks the replicas agree (a norm weight not pvary'd would not)
    for name, p in one.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-12, atol=1e-12)


def test_gather_after_a_module_returning_a_tuple_is_refused() -> None:
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(_PairToy().double(), mesh, _plan(True), verify=False)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    with pytest.raises(fd.nn.ParallelizeError, match=r"GatherSequence\(after=True\) on 'norm'"):
        pm(x.expand(2, *x.shape))
