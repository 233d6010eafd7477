"""MoE models in a pipeline (`fastdist.train.pipeline`), simulated ranks, float64, against one
device (the unmodified transformers model, loss by hand as in ``tests/test_pipeline.py``):

* the router load-balancing loss is refused at every step, not only when the pipeline is built:
  the stages share the model's config, and switching ``output_router_logits`` on afterwards
  gave the last stage's own layers' aux loss once per micro-batch added to the loss, with no
  error (Mixtral, coefficient 0.5, pp2 x tp2: 6.1477 against one device's 5.1455 with the aux
  loss and 4.1455 without);
* the default stage plan uses an ``ep`` axis without ``tp`` (it was ``{}`` there: the experts
  stayed transformers' own and torch's vmap raised ``aten::nonzero`` at the first step), and a
  mesh with neither is refused when the pipeline is built, naming the fix;
* options and call keywords the stages would drop are refused (``sequence_parallel`` without a
  ``tp`` axis or with ``plan=``; the model's switches given to ``step``).

Tolerance: the existing pipeline MoE tests' (``TOL`` of ``tests/test_pipeline.py``: Mixtral
computes its router softmax and RMSNorm in float32 inside the float64 model, measured exact to
float64 rounding here).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import fastdist as fd
from fastdist import PipelineError
from tests import tiny_models
from tests.test_pipeline import (
    TOL,
    VOCAB,
    assert_grads,
    family_model,
    hand_loss,
    make_batch,
    rep,
)


def _step_equals_one_device(ref: Any, pipe: Any, mesh: fd.Mesh, seed: int = 3) -> None:
    """A step of ``pipe`` (built from a copy of ``ref``): the loss and every gradient equal one
    device's (the cross entropy by hand, without the aux loss)."""
    ids, labels = make_batch(seed)
    loss_ref = hand_loss(ref, ids, labels)
    loss_ref.backward()
    loss = pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    torch.testing.assert_close(loss, rep(loss_ref.detach(), mesh), **TOL)
    assert_grads(pipe, ref)


# ============================================================================ router aux loss
def mixtral(coef: float, logits: bool, layers: int = 4) -> Any:
    """The tiny float64 Mixtral of ``tests/test_pipeline.py`` built with router aux loss
    coefficient ``coef`` and ``output_router_logits=logits`` in its config (transformers copies
    the coefficient into the model in ``__init__``)."""
    return tiny_models.build(
        "mixtral",
        vocab=VOCAB,
        layers=layers,
        seed=0,
        fill_zeros=True,
        output_router_logits=logits,
        router_aux_loss_coef=coef,
    )


REFUSED = (
    r"Pipeline\.step: MixtralForCausalLM adds the router load-balancing loss "
    r"\(config\.output_router_logits=True, its router_aux_loss_coef=0\.5\).*a wrong loss\. "
    r"Fix: model\.config\.output_router_logits = False"
)


@pytest.mark.parametrize("switch", ["output_router_logits", "coefficient"])
def test_router_aux_loss_switched_on_after_the_build_is_refused_at_the_step(switch: str) -> None:
    """``model.config.output_router_logits`` switched on after ``pipeline()`` (the stages share
    the config; the reviewer's case: pp2 x tp2 gave 6.1477, one device 5.1455 with the aux loss
    and 4.1455 without), or the last stage's coefficient set with the logits on and the
    coefficient 0 at the build: the step raises before anything runs, naming the setting and
    the fix; switched off again, the step equals one device's."""
    on_at_build = switch == "coefficient"
    model = mixtral(0.0 if on_at_build else 0.5, logits=on_at_build)
    ref = copy.deepcopy(model)
    ref.config.output_router_logits = False
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    if on_at_build:
        pipe.stages[max(pipe.stages)].module.router_aux_loss_coef = 0.5
    else:
        model.config.output_router_logits = True
    ids, labels = make_batch(3)
    with pytest.raises(PipelineError, match=REFUSED):
        pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    assert all(p.grad is None for p in pipe.parameters())  # refused before any forward
    model.config.output_router_logits = False
    _step_equals_one_device(ref, pipe, mesh)


def test_router_aux_loss_of_the_models_coefficient_is_refused_at_the_build() -> None:
    """transformers adds the model's own coefficient (copied from the config in ``__init__``):
    the config's set to 0 afterwards leaves the aux loss in. It was accepted (the check read the
    config's) and the step's loss was 0.004 off one device's (the last stage's aux loss at
    0.001)."""
    model = mixtral(0.5, logits=True)
    model.config.router_aux_loss_coef = 0.0
    with pytest.raises(PipelineError, match=REFUSED.replace("Pipeline\\.step", "pipeline")):
        fd.train.pipeline(model, fd.Mesh({"pp": 2, "tp": 2}), microbatches=2)


def test_router_logits_with_coefficient_zero_leave_the_loss_one_devices() -> None:
    """``output_router_logits=True`` with coefficient 0 adds nothing to the loss: accepted (the
    refusal is for the cases that change the loss), and the step equals one device's."""
    model = mixtral(0.0, logits=True)
    ref = copy.deepcopy(model)
    ref.config.output_router_logits = False
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="gpipe", microbatches=2)
    _step_equals_one_device(ref, pipe, mesh)


@pytest.mark.parametrize("switch", ["output_hidden_states", "use_cache"])
def test_config_switches_that_leave_the_loss_are_followed_after_the_build(switch: str) -> None:
    """Other switches of the shared config, set after ``pipeline()``, that one device's loss
    does not depend on: the step still equals one device's (``use_cache``: every stage is
    called with ``use_cache=False``; a guard, as before the review's fixes)."""
    ref = family_model("mixtral", layers=4)
    model = copy.deepcopy(ref)
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    setattr(model.config, switch, True)
    _step_equals_one_device(ref, pipe, mesh)


@pytest.mark.parametrize(
    "keyword",
    [
        {"output_router_logits": True},
        {"use_cache": True},
        {"return_dict": False},
        {"output_hidden_states": True},
        {"output_attentions": True},
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_model_switches_given_to_the_step_are_refused(keyword: dict[str, Any]) -> None:
    """The model's switches as ``step`` keywords are refused by name, not dropped by the
    stages (a guard: this passed before the review's fixes as well)."""
    model = family_model("mixtral", layers=2)
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    ids, labels = make_batch(3)
    with pytest.raises(PipelineError, match=rf"inputs \['{next(iter(keyword))}'\] are not supp"):
        pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh), **keyword)


# ============================================================================ the stage plan
@pytest.mark.parametrize(
    "axes, sp",
    [
        ({"pp": 2, "ep": 2}, False),
        ({"pp": 2, "ep": 1}, False),
        ({"pp": 2, "dp": 2, "ep": 2}, False),
        ({"pp": 2, "ep": 2}, True),
    ],
    ids=["pp2xep2", "pp2xep1", "pp2xdp2xep2", "pp2xep2-sp"],
)
def test_moe_default_plan_uses_ep_without_tp(axes: dict[str, int], sp: bool) -> None:
    """A Mixtral pipeline over ``ep`` without ``tp``: the default stage plan is the family's
    over ``ep`` (experts and attention split over it, as ``fastdist.nn.parallelize``'s default
    on that mesh, with sequence parallelism over it too if asked; it was none, and torch's vmap
    raised at ``aten::nonzero``); the step equals one device's."""
    ref = family_model("mixtral", layers=4)
    mesh = fd.Mesh(axes)
    pipe = fd.train.pipeline(
        copy.deepcopy(ref), mesh, schedule="1f1b", microbatches=2, sequence_parallel=sp
    )
    for pm in pipe.stages.values():
        for layer in pm.module.model.layers:
            if len(list(layer.parameters())):  # the stage's own layers
                assert type(layer.mlp.experts).__name__ == "ExpertParallelExperts"
    _step_equals_one_device(ref, pipe, mesh)


@pytest.mark.parametrize(
    "axes, plan",
    [({"pp": 2}, None), ({"pp": 2, "dp": 2}, None), ({"pp": 2, "tp": 2}, {})],
    ids=["pp2", "pp2xdp2", "pp2xtp2-plan{}"],
)
def test_moe_experts_without_a_plan_entry_on_simulated_ranks_are_refused(
    axes: dict[str, int], plan: dict[str, Any] | None
) -> None:
    """Simulated ranks cannot run transformers' experts (data-dependent shapes under vmap): a
    mesh with neither ``ep`` nor ``tp`` (or a plan without an entry for the experts) is refused
    when the pipeline is built, saying why and the fix; the model is not taken apart. It used
    to build, then raise torch's ``vmap ... aten::nonzero`` at the first step."""
    model = family_model("mixtral", layers=2)
    with pytest.raises(
        PipelineError,
        match=r"MixtralForCausalLM's experts \(model\.layers\.0\.mlp\.experts, \.\.\.: "
        r"transformers' MixtralExperts\).*simulated ranks.*torch\.nonzero.*Fix: add one to the "
        r"mesh \(e\.g\. Mesh\(\{'pp': 2, 'ep': 2\}\)",
    ):
        fd.train.pipeline(model, fd.Mesh(axes), microbatches=2, plan=plan)
    ids, _ = make_batch(1)
    model(input_ids=ids)  # not taken apart


@pytest.mark.parametrize("with_plan", [False, True], ids=["no-tp", "plan-given"])
def test_sequence_parallel_that_would_be_dropped_is_refused(with_plan: bool) -> None:
    """``sequence_parallel=True`` splits the sequence over ``tp`` in the default plan: without a
    ``tp`` axis, or with ``plan=`` given, it was dropped without a word."""
    model = family_model("llama", layers=2)
    mesh = fd.Mesh({"pp": 2, "tp": 2} if with_plan else {"pp": 2})
    plan = fd.nn.plans.plan(model, mesh.without("pp")) if with_plan else None
    match = r"sequence_parallel=True with plan= given" if with_plan else r"no 'tp' axis"
    with pytest.raises(PipelineError, match=match):
        fd.train.pipeline(model, mesh, microbatches=2, plan=plan, sequence_parallel=True)
