"""A user's review of pipelines (`fastdist.train.pipeline`) and expert parallelism
(`fastdist.nn.moe`) against one device in float64 (the unmodified transformers model, the loss
by hand as in ``tests/test_pipeline.py``), after ``tests/test_pipeline_moe_review.py``:

* ``Pipeline.step`` under ``torch.no_grad()`` / ``torch.inference_mode()`` (an evaluation
  between training steps) raised torch's ``element 0 of tensors does not require grad`` from
  the last stage's backward, after every forward had run; it now runs the forwards only and
  returns the batch's loss (Llama pp2: equal to one device's), leaving the gradients of the
  training steps as they were (bitwise);
* a first stage whose parameters are all frozen (embedding and bottom layers frozen for
  fine-tuning) raised the same torch error from that stage's backward (its output needs no
  gradient); it now skips that backward, and the step equals one device's;
* an MoE layer's ``dropped`` (``fastdist.nn.moe.dropped_counts``) after a pipeline step was
  the last micro-batch's count only (Mixtral pp2 x ep2, capacity factor 0.5, 2 micro-batches:
  16 per layer reported where the step dropped 16 + 16); it is now the step's, summed over its
  micro-batches, equal to a one-device model dropping the same assignments, whose loss and
  gradients the step's equal.

Also refused now, with `MoEError` / `PipelineError` naming the fix: a ``capacity_factor`` of 0
or below (it kept one assignment per expert, silently), ``load_balancing_loss`` inputs of other
shapes (a one-element mask counted the tokens as one: the loss T**2 times too large), and
``microbatches=`` / ``virtual=`` that a built ``Schedule`` would drop, and tied-embedding copies
an optimizer updated differently (param groups by name: 2.3e-4 apart after 3 steps, silently).

Real ranks: the forward-only step and the frozen first stage on 2 gloo processes
(``tests/review_moe_pipeline_worker.py``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import fastdist as fd
from fastdist.nn import moe as M
from tests.test_moe import drop_like_ep
from tests.test_pipeline import (
    TOL,
    VOCAB,
    assert_grads,
    family_model,
    hand_loss,
    llama,
    make_batch,
    rep,
)


# ============================================================================ evaluation
@pytest.mark.parametrize(
    "schedule, virtual, family",
    [("1f1b", 1, "llama"), ("gpipe", 1, "gpt2"), ("interleaved_1f1b", 2, "gpt2")],
)
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=lambda m: m.__name__)
def test_step_without_grad_is_an_evaluation(
    schedule: str, virtual: int, family: str, mode: Any
) -> None:
    """A training step, then a step of another batch under ``mode``: its loss is one device's
    for that batch, and every gradient (the tied embedding's copies too, gpt2) is still the
    training step's, bitwise. It raised torch's RuntimeError ('element 0 of tensors does not
    require grad') after running every forward."""
    ref = llama(4) if family == "llama" else family_model(family, tie=True, layers=4)
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    pipe = fd.train.pipeline(
        copy.deepcopy(ref), mesh, schedule=schedule, microbatches=2, virtual=virtual
    )
    ids, labels = make_batch(1)
    pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    hand_loss(ref, ids, labels).backward()
    before = {n: p.grad.clone() for n, p in pipe.named_parameters()}  # type: ignore[union-attr]
    ids, labels = make_batch(2)
    with mode():
        loss = pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    with torch.no_grad():
        want = hand_loss(ref, ids, labels)
    torch.testing.assert_close(loss, rep(want, mesh), **TOL)
    assert all(k == "F" for k in {e.kind for e in pipe.events})  # the forwards only
    assert all(torch.equal(p.grad, before[n]) for n, p in pipe.named_parameters())  # type: ignore[arg-type]
    # not replaced by inference tensors (the tied copies were), which in-place ops refuse
    assert not any(p.grad.is_inference() for p in pipe.parameters())  # type: ignore[union-attr]
    grads = pipe.grads()
    for alias, name in pipe.tied.items():  # gpt2: both copies hold the tied weight's gradient
        assert torch.equal(grads.pop(alias), grads[name])
    assert grads.keys() == {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL)


def test_a_dit_step_without_grad_is_an_evaluation() -> None:
    """A diffusers DiT's pipeline (LTX-Video, pp2, 1F1B) under ``torch.no_grad()``: the loss is one
    device's, no gradient is made (it raised torch's RuntimeError)."""
    from tests.pipeline_dit_worker import ltx_batch, one_device, tiny_ltx

    model, b = tiny_ltx(), ltx_batch()
    want = one_device(copy.deepcopy(model), b)  # (its backward on the copy)
    mesh = fd.Mesh({"pp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    with torch.no_grad():
        loss = pipe.step(**{k: rep(v, mesh) if isinstance(v, Tensor) else v for k, v in b.items()})
    torch.testing.assert_close(loss, rep(want, mesh), rtol=1e-12, atol=0)
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize("kw", [{"microbatches": 2}, {"virtual": 2}], ids=lambda kw: str(kw))
def test_counts_a_built_schedule_would_drop_are_refused(kw: dict[str, int]) -> None:
    """``schedule=`` a built `Schedule` (1F1B, 4 micro-batches) with ``microbatches=2`` or
    ``virtual=2``: the schedule's counts ran and the arguments were dropped without a word; now
    refused, naming both; the same counts are accepted."""
    from fastdist.train import schedules

    sched = schedules.one_f_one_b(pp=2, microbatches=4)
    with pytest.raises(fd.PipelineError, match=r"with a built schedule of 4 micro-batches and 1"):
        fd.train.pipeline(llama(4), fd.Mesh({"pp": 2}), schedule=sched, **kw)
    pipe = fd.train.pipeline(llama(4), fd.Mesh({"pp": 2}), schedule=sched, microbatches=4)
    assert pipe.schedule.microbatches == 4


# ============================================================================ frozen parameters
@pytest.mark.parametrize(
    "axes, frozen",
    [
        ({"pp": 2}, ("model.embed_tokens.", "model.layers.0.", "model.layers.1.")),
        ({"pp": 2, "tp": 2}, ("model.embed_tokens.", "model.layers.0.", "model.layers.1.")),
        ({"pp": 2, "tp": 2}, ("model.embed_tokens.", "model.layers.")),  # only the ends learn
    ],
    ids=["pp2-stage0", "pp2xtp2-stage0", "pp2xtp2-layers"],
)
def test_a_frozen_first_stage_trains_the_others(axes: dict[str, int], frozen: tuple[str]) -> None:
    """Every parameter of the first stage frozen (``requires_grad=False``): its output needs no
    gradient, and its backward raised torch's RuntimeError; the step's loss and gradients equal
    one device's, the frozen parameters get none."""
    ref = llama(4)
    for name, p in ref.named_parameters():
        p.requires_grad_(not name.startswith(frozen))
    mesh = fd.Mesh(axes)
    pipe = fd.train.pipeline(copy.deepcopy(ref), mesh, schedule="1f1b", microbatches=2)
    ids, labels = make_batch(3)
    want = hand_loss(ref, ids, labels)
    want.backward()
    loss = pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    torch.testing.assert_close(loss, rep(want.detach(), mesh), **TOL)
    learn = {n for n, p in ref.named_parameters() if p.requires_grad}
    assert {n for n, p in pipe.named_parameters() if p.grad is not None} == learn
    grads = pipe.grads()
    for name, p in ref.named_parameters():
        if name in learn:
            torch.testing.assert_close(grads[name], p.grad, **TOL)
    # the whole model's clip: torch's over the parameters with gradients
    want_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in ref.parameters() if p.requires_grad], 0.1
    )
    torch.testing.assert_close(pipe.clip_grad_norm_(0.1), rep(want_norm, mesh), **TOL)
    grads = pipe.grads()
    for name in learn:
        torch.testing.assert_close(grads[name], ref.get_parameter(name).grad, **TOL)


# ============================================================================ MoE drops
def micro_batched_loss(ref: Any, ids: Tensor, labels: Tensor, m: int) -> Tensor:
    """One device, the batch in ``m`` micro-batches (each a forward of its own, as the
    pipeline's): the sum of each one's cross entropy over the whole batch's predicted tokens."""
    count = (labels[:, 1:] != -100).sum()
    total = torch.zeros((), dtype=torch.float64)
    for i, l in zip(ids.chunk(m), labels.chunk(m), strict=True):
        logits = ref(input_ids=i).logits
        ce = F.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), l[:, 1:].reshape(-1), reduction="sum"
        )
        total = total + ce / count
    return total


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_moe_drops_after_a_step_are_the_steps(schedule: str) -> None:
    """Mixtral pp2 x ep2 with ``capacity_factor=0.5``, 2 micro-batches: each layer's ``dropped``
    after the step is the sum over the micro-batches (it was the last one's: 16 of 32), equal to
    a one-device model that drops the same assignments per micro-batch and ep share, whose loss
    and gradients the step's equal; a second step reports its own, not a running total."""
    ref = family_model("mixtral", layers=2)
    mesh = fd.Mesh({"pp": 2, "ep": 2})
    plan = fd.nn.plans.plan(ref, mesh.without("pp"), capacity_factor=0.5)
    pipe = fd.train.pipeline(copy.deepcopy(ref), mesh, schedule=schedule, microbatches=2, plan=plan)
    counts = drop_like_ep(ref, ep=2, capacity_factor=0.5)  # the one-device model drops alike
    for seed in (3, 4):
        ids, labels = make_batch(seed)
        for c in counts.values():
            c.clear()
        ref.zero_grad()
        pipe.zero_grad()
        want = micro_batched_loss(ref, ids, labels, 2)
        want.backward()
        loss = pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
        torch.testing.assert_close(loss, rep(want.detach(), mesh), **TOL)
        assert_grads(pipe, ref)
        got = {n: c for pm in pipe.stages.values() for n, c in M.dropped_counts(pm.module).items()}
        assert {n: c.tolist() for n, c in got.items()} == {
            n: [sum(c)] * pipe.stage_mesh.size for n, c in counts.items()
        }
        assert all(len(c) == 2 and min(c) > 0 for c in counts.values())  # drops in both


# ============================================================================ tied copies
def test_tied_copies_an_optimizer_drifted_apart_are_refused() -> None:
    """gpt2's tied embedding at pp2 x tp2, AdamW with param groups by name (no weight decay for
    ``wte`` and biases, as training scripts write them: on one device the tied weight is one
    parameter, named ``transformer.wte.weight``): the last stage's copy ``lm_head.weight`` was
    decayed, the first's not, and after 3 steps the copies differed by 2.3e-4 with no error (the
    model trained two weights and a checkpoint keeps the first). The next step now raises,
    naming both copies and the fix; with the same settings for both, steps run."""
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    for split in (True, False):
        pipe = fd.train.pipeline(
            family_model("gpt2", tie=True, layers=4), mesh, schedule="1f1b", microbatches=2
        )
        named = list(pipe.named_parameters())
        plain = [p for n, p in named if not (split and ("wte" in n or "bias" in n))]
        rest = [p for n, p in named if split and ("wte" in n or "bias" in n)]
        groups = [{"params": plain, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-2)
        ids, labels = make_batch(1)
        pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
        opt.step()
        pipe.zero_grad()
        if split:
            with pytest.raises(
                fd.PipelineError,
                match=r"copies of the tied weight transformer\.wte\.weight \(first stage\) and "
                r"lm_head\.weight \(last stage\) differ.*Fix: give both names the same",
            ):
                pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
        else:
            pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))


# ============================================================================ capacity factor
@pytest.mark.parametrize("factor", [0.0, -1.0, float("nan"), float("inf")])
def test_a_capacity_factor_that_is_not_positive_is_refused(factor: float) -> None:
    """``capacity_factor=0`` (a config's "off", where fastdist's off is ``None``) kept one
    assignment per expert and dropped the rest, silently (ep=2, 6 tokens a rank, top-2 of 4
    experts: 8 of 12 assignments dropped per rank, the output changed); a negative factor did
    the same, nan and inf raised Python's conversion errors. Now `moe` raises `MoEError` at its
    first call and `parallelize` with the plan's factor before any forward, naming the layer
    and the fix; ``None`` stays dropless."""
    mesh = fd.Mesh({"ep": 2})
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 4, generator=g, dtype=torch.float64)
    x = torch.randn(2, 6, 3, generator=g, dtype=torch.float64)
    scale = torch.tensor([[1.0, 10.0], [100.0, 1000.0]], dtype=torch.float64)

    def layer(x: Tensor, lg: Tensor, s: Tensor, cf: float | None) -> Tensor:
        r = M.route(lg, 2)
        out = M.moe(x, r.weights, r.experts, lambda rows, e: rows * s[e], mesh, "ep", 4,
                    capacity_factor=cf)  # fmt: skip
        return out.out

    match = rf"MoE layer 'moe': capacity_factor={factor!r}.*Fix: capacity_factor=None"
    with pytest.raises(fd.nn.MoEError, match=match):
        fd.simulate(lambda *a: layer(*a, factor), mesh)(x, logits, scale)
    dropless = fd.simulate(lambda *a: layer(*a, None), mesh)(x, logits, scale)
    r = M.route(logits.reshape(12, 4), 2)
    want = r.weights.unsqueeze(-1) * x.reshape(12, 1, 3) * scale.reshape(4)[r.experts].unsqueeze(-1)
    torch.testing.assert_close(dropless.reshape(12, 3), want.sum(1), **TOL)
    model = family_model("mixtral", layers=2)
    mesh = fd.Mesh({"ep": 2})
    with pytest.raises(fd.nn.MoEError, match=r"'model\.layers\.0\.mlp\.experts': capacity_fac"):
        fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, capacity_factor=factor))


def test_load_balancing_loss_refuses_logits_and_masks_of_other_shapes() -> None:
    """(T, E) logits per layer and a (T,) mask: (batch, seq, E) logits (Switch Transformers'
    layout, whose loss is per sequence) raised torch's cat error; a one-element mask broadcast
    over the tokens and counted them as 1, silently (loss 214.3 where the unmasked one is
    2.14: T**2 times).
    Both now raise `MoEError` naming the shapes and the fix; a (T,) mask of ones is the
    unmasked loss."""
    g = torch.Generator().manual_seed(0)
    lg = torch.randn(2, 5, 4, dtype=torch.float64, generator=g)
    flat = lg.reshape(10, 4)
    match = r"load_balancing_loss takes \(T, E\) router logits per layer and a \(T,\) atten"
    with pytest.raises(fd.nn.MoEError, match=match + r".*got \(2, 5, 4\) and None"):
        M.load_balancing_loss(lg, 2)
    with pytest.raises(fd.nn.MoEError, match=match + r".*got \(10, 4\) and \(1,\)"):
        M.load_balancing_loss(flat, 2, attention_mask=torch.ones(1))
    with pytest.raises(fd.nn.MoEError, match=match):
        M.load_balancing_loss([flat, flat[:, :3]], 2)
    torch.testing.assert_close(
        M.load_balancing_loss(flat, 2, attention_mask=torch.ones(2, 5)),
        M.load_balancing_loss(flat, 2),
        **TOL,
    )


# ============================================================================ real ranks
def test_evaluation_and_a_frozen_first_stage_on_gloo() -> None:
    """2 gloo processes (pp=2): the forward-only step under no_grad and inference_mode (1F1B and
    interleaved) and a frozen stage 0, each equal to one device; the training step's gradients
    kept bitwise; the rank of the frozen stage holds no gradient; tied copies an optimizer
    drifted apart refused on both ranks at the next step, copies kept alike accepted."""
    from tests import review_moe_pipeline_worker as W
    from tests.dist_harness import run_on_gloo

    for rank, got in enumerate(run_on_gloo(W.evaluation_and_frozen_on_2, 2, timeout=300)):
        for case, r in got.items():
            if case == "tied":
                continue
            assert r["loss_err"] <= 1e-12, (rank, case, r["loss_err"])
            if case != "frozen":
                assert r["grads_kept"] and r["kinds"] == ["F"], (rank, case)
        frozen = got["frozen"]
        assert frozen["grad_err"] <= 1e-12, rank
        assert frozen["with_grad"] == [n for n in frozen["held"] if n in frozen["trainable"]]
        assert bool(frozen["with_grad"]) == (rank == 1)  # stage 0 is all frozen
        same, drifted = got["tied"][:2], got["tied"][2:]
        assert same == ["ok", "ok"] and drifted[0] == "ok", (rank, got["tied"])
        assert "copies of the tied weight transformer.wte.weight" in drifted[1], rank
