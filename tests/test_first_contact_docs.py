"""Docs that say what the code does (issue 32.14): the loss with gathered logits, a `Profile` read
as its records, Qwen2-MoE through the Mixtral plan, token dropping that depends on the ep size."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fastdist as fd
from fastdist.profile import Profile, Record

transformers = pytest.importorskip("transformers")

from tests import tiny_models  # noqa: E402
from tests.test_hf_models import VOCAB, batch, build, rep  # noqa: E402
from tests.test_moe import build_mixtral, lm_batch, reference, whole_logits  # noqa: E402

TOL = {"rtol": 1e-10, "atol": 1e-10}


@pytest.mark.parametrize("family, tp", [("llama", 2), ("gpt2", 4)])
def test_gathered_logits_keep_fastdists_float64_loss(family: str, tp: int) -> None:
    """``gather_logits=True``: the whole vocabulary on every rank, and the model's ``labels=`` loss
    is still fastdist's (float64 stays float64), not transformers' float32 one. GPT-2 at tp=4
    pads its 61 words to 64 and the gathered logits drop the padding."""
    ref = build(family, layers=1)
    model = copy.deepcopy(ref)
    ids, labels = batch()
    logits = ref(input_ids=ids).logits
    want = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    hf = ref(input_ids=ids, labels=labels).loss  # transformers' loss: float32
    assert hf.dtype == torch.float32 and (hf.double() - want).abs() > 1e-12
    want.backward()
    mesh = fd.Mesh({"tp": tp})
    plan = fd.nn.plans.plan(model, family=family, gather_logits=True)
    pm = fd.nn.parallelize(model, mesh, plan)
    out = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    assert out.logits.shape == (tp, *logits.shape)  # every rank: the whole vocabulary
    torch.testing.assert_close(out.logits, rep(logits.detach(), mesh), **TOL)
    assert out.loss.dtype == torch.float64
    torch.testing.assert_close(out.loss, rep(want.detach(), mesh), rtol=1e-13, atol=1e-13)
    out.loss.sum().backward()
    grads = pm.grads()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    # a bad label is fastdist's TargetError, naming the rank, not an index error from torch
    bad = labels.clone()
    bad[1, 3] = VOCAB
    with pytest.raises(fd.TargetError, match=r"simulated rank 0: 1 of 16 targets .* \[61\]"):
        pm(input_ids=rep(ids, mesh), labels=rep(bad, mesh))


def test_a_profile_reads_as_the_tuple_of_its_records() -> None:
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    f64 = torch.float64
    records = (
        Record("all_gather", "tp", 2, "allgather", 96, 48.0, 1, "forward", "", f64, (2, 3)),
        Record("psum", "dp", 2, "allreduce", 96, 96.0, 2, "forward", "", f64, (4, 3)),
    )
    prof = Profile(mesh, records)
    assert len(prof) == 2 and tuple(prof) == records and list(reversed(prof)) == [*records][::-1]
    assert [r.op for r in prof] == ["all_gather", "psum"]
    assert prof[0] is records[0] and prof[-1].axis == "dp"
    assert prof[:1] == records[:1] and isinstance(prof[:1], tuple)
    only_tp = prof.filter(axis="tp")
    assert isinstance(only_tp, Profile) and [r.op for r in only_tp] == ["all_gather"]
    assert prof.count(phase="forward") == 2 and prof.size(axis="dp") == 96
    assert len(Profile(mesh, ())) == 0 and list(Profile(mesh, ())) == []
    with pytest.raises(IndexError):
        prof[2]  # noqa: B018


def _qwen2_moe(seed: int = 0) -> Any:
    """Qwen2-MoE with every layer sparse (no dense ``mlp_only_layers``), all MLPs 16 wide."""
    return tiny_models.build(
        "qwen2_moe",
        seed=seed,
        intermediate_size=16,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        mlp_only_layers=None,
    )


def test_qwen2_moe_through_the_mixtral_plan_matches_one_device() -> None:
    """docs/moe.md: the Mixtral plan runs Qwen2-MoE's sparse block (shared expert replicated)."""
    ref = _qwen2_moe()
    model = copy.deepcopy(ref)
    ids, labels = lm_batch()
    want_logits, want_ce, want_aux = reference(ref, ids, labels)
    coef = ref.config.router_aux_loss_coef
    (want_ce + coef * want_aux).backward()
    mesh = fd.Mesh({"ep": 2, "tp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, family="mixtral", axis="tp"))
    out = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    torch.testing.assert_close(whole_logits(out.logits, mesh, "tp"), want_logits.detach(), **TOL)
    torch.testing.assert_close(out.aux_loss, rep(want_aux.detach(), mesh), **TOL)
    torch.testing.assert_close(out.loss, rep((want_ce + coef * want_aux).detach(), mesh), **TOL)
    out.loss.sum().backward()
    grads = pm.grads()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_which_assignments_are_dropped_depends_on_the_ep_size() -> None:
    """docs/moe.md: each ep rank applies the capacity to its own share of the tokens, so the same
    model, batch and capacity_factor drop differently at ep=1, 2, 4; dropless runs agree."""
    ref = build_mixtral()
    ids, _ = lm_batch()
    logits, dropped = {}, {}
    for capacity_factor in (0.5, None):
        for ep in (1, 2, 4):
            model = copy.deepcopy(ref)
            mesh = fd.Mesh({"ep": ep})
            plan = fd.nn.plans.plan(model, mesh, capacity_factor=capacity_factor)
            pm = fd.nn.parallelize(model, mesh, plan)
            out = pm(input_ids=rep(ids, mesh))
            logits[capacity_factor, ep] = whole_logits(out.logits, mesh, "ep").detach()
            counts = fd.nn.moe.dropped_counts(model)
            # the whole layer's count, the same on every rank
            assert all(bool((c == c[0]).all()) for c in counts.values())
            dropped[capacity_factor, ep] = [int(c[0]) for c in counts.values()]
    assert dropped[None, 1] == dropped[None, 2] == dropped[None, 4] == [0, 0]
    torch.testing.assert_close(logits[None, 2], logits[None, 1], **TOL)
    torch.testing.assert_close(logits[None, 4], logits[None, 1], **TOL)
    assert min(dropped[0.5, 1]) > 0 and dropped[0.5, 2] != dropped[0.5, 4]
    for a, b in ((1, 2), (2, 4), (1, 4)):
        assert (logits[0.5, a] - logits[0.5, b]).abs().max() > 1e-4, (a, b)
