"""``fd.nn.plans.plan(model, mesh, context_parallel=...)`` for the families context parallelism
cannot split (`fastdist.nn.plans.family.NO_CONTEXT_PARALLEL`): GPT-2 (learned absolute position
embeddings added to the whole sequence inside the base model) and Falcon in its three attention
layouts (an attention that does not go through transformers' attention registry). The old code
returned a plan whose parallelize raised "has no ModuleList 'layers' of decoder layers. Fix:
CausalContextParallel(layers=...)", and that fix led to raw errors (GPT-2: "The size of tensor a
(8) must match the size of tensor b (4)"; Falcon: "unsupported operand type(s) for +: 'Tensor'
and 'NoneType'"). Now ``plans.plan`` refuses them with the reason and what to run instead; the
families it splits are unchanged (GPT-NeoX, the other ``h``-less fused-qkv family, still plans
and equals one device)."""

from __future__ import annotations

import pytest
import torch

import fastdist as fd
from fastdist.errors import ParallelizeError
from fastdist.nn import CausalContextParallel
from tests import tiny_models as tm

REASONS = {
    "gpt2": r"absolute position embeddings \(transformer\.wpe",
    "falcon:new": "instead of calling transformers' attention registry",
    "falcon:mqa": "instead of calling transformers' attention registry",
    "falcon:per_head": "instead of calling transformers' attention registry",
}
MESHES = [{"cp": 2}, {"tp": 2, "cp": 2}]


@pytest.mark.parametrize("family", list(REASONS))
@pytest.mark.parametrize("degrees", MESHES, ids=["cp2", "tp2xcp2"])
@pytest.mark.parametrize("layers", [None, "h"])
def test_plan_refuses_context_parallel_with_the_reason(
    family: str, degrees: dict[str, int], layers: str | None
) -> None:
    model = tm.build(family)
    cp = (
        CausalContextParallel("cp")
        if layers is None
        else CausalContextParallel("cp", layers=layers)
    )
    with pytest.raises(ParallelizeError, match=REASONS[family]) as err:
        fd.nn.plans.plan(model, fd.Mesh(degrees), context_parallel=cp)
    message = str(err.value)
    assert message.startswith("plans.plan: context_parallel cannot split")
    assert "Fix: run it without context_parallel" in message
    assert "CausalContextParallel(layers=" not in message
    # the string form of the option too
    with pytest.raises(ParallelizeError, match=REASONS[family]):
        fd.nn.plans.plan(model, fd.Mesh(degrees), context_parallel="cp")


@pytest.mark.parametrize("family", list(REASONS))
def test_plans_without_context_parallel_are_unchanged(family: str) -> None:
    """The same families still plan (tensor parallelism) without context_parallel."""
    plan = fd.nn.plans.plan(tm.build(family), fd.Mesh({"tp": 2}))
    assert plan and not any(isinstance(s, CausalContextParallel) for s in plan.values())


def test_gpt_neox_context_parallel_still_equals_one_device() -> None:
    """A family that is not refused still splits, equal to one device in float64."""
    ids = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 23]])
    want = tm.build("gpt_neox")(input_ids=ids, use_cache=False).logits
    model = tm.build("gpt_neox")
    mesh = fd.Mesh({"cp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, context_parallel="cp"))
    got = pm(input_ids=ids.expand(2, 1, 8), use_cache=False).logits
    for rank in range(2):
        torch.testing.assert_close(got[rank], want, rtol=1e-12, atol=1e-12)
