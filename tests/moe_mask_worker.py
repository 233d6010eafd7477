"""Rank function for tests/test_moe_mask.py (importable by fastdist.testing.run_on_gloo):
Mixtral expert-parallel over ``ep=2`` gloo processes, called with an attention mask and
``output_router_logits=True`` (transformers' load-balancing loss weighted by the mask, which
simulated ranks cannot run), against one device in float64."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import fastdist as fd
from tests.moe_worker import AUX_TOL, TOL, snapshot
from tests.test_moe import VOCAB, build_mixtral, lm_batch


def masked_mixtral_on_gloo() -> str:
    """One rank of 2: the logits, the aux loss (padding excluded), the loss and every gradient
    of a left-padded batch equal one device's."""
    mesh = fd.connect(ep=2, timeout=60)
    ref = build_mixtral()
    model = copy.deepcopy(ref)
    ids, labels = lm_batch()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = labels.masked_fill(mask == 0, -100)
    want = ref(input_ids=ids, attention_mask=mask)
    assert bool(want.aux_loss != ref(input_ids=ids, attention_mask=None).aux_loss)  # it matters
    ce = F.cross_entropy(want.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    coef = ref.config.router_aux_loss_coef
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, family="mixtral", axis="ep"))
    out = pm(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    logits = fd.all_gather_invariant(out.logits, mesh, "ep", dim=-1)[..., :VOCAB]
    torch.testing.assert_close(logits, want.logits.detach(), **TOL)
    torch.testing.assert_close(out.aux_loss, want.aux_loss.detach(), **AUX_TOL)
    torch.testing.assert_close(
        out.loss, (ce + coef * want.aux_loss).detach(), rtol=0, atol=1e-10 + coef * 1e-6
    )
    (ce + coef * want.aux_loss).backward()
    out.loss.backward()
    got = pm.grads()
    for n, g in snapshot(ref).items():
        torch.testing.assert_close(got[n], g, **TOL, msg=lambda m, n=n: f"grad {n}: {m}")
    return "ok"
