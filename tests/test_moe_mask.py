"""A mixture-of-experts model called with an attention mask and the router's load-balancing
loss (``output_router_logits=True``): transformers' ``load_balancing_loss_func`` weights the
tokens by the mask with an in-place ``scatter_add_`` into a tensor it makes, which torch.vmap
(simulated ranks) cannot run: refused there at the first call, naming the fixes. What runs
instead, each against one device in float64: the same call on real ranks (2 gloo processes,
Mixtral over ``ep=2``), and on simulated ranks the call with ``output_router_logits=False``
(the masked loss without the auxiliary term)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fastdist as fd
from fastdist.errors import NoBackendError
from tests.test_moe import TOL, VOCAB, build_mixtral, compare_grads, lm_batch, rep, whole_logits

pytest.importorskip("transformers")


def test_masked_call_without_router_logits_on_simulated_ranks() -> None:
    """ep=2 simulated, a left-padded row: logits, the masked cross-entropy and every gradient
    equal one device's (the mask matters: the unmasked logits differ)."""
    ref = build_mixtral()
    model = copy.deepcopy(ref)
    ids, labels = lm_batch()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = labels.masked_fill(mask == 0, -100)
    want = ref(input_ids=ids, attention_mask=mask, output_router_logits=False).logits
    assert (want - ref(input_ids=ids, output_router_logits=False).logits).abs().max() > 1e-3
    ce = F.cross_entropy(want[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    ce.backward()
    mesh = fd.Mesh({"ep": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, family="mixtral", axis="ep"))
    out = pm(
        input_ids=rep(ids, mesh),
        attention_mask=rep(mask, mesh),
        labels=rep(labels, mesh),
        output_router_logits=False,
    )
    assert out.aux_loss is None
    torch.testing.assert_close(whole_logits(out.logits, mesh, "ep"), want.detach(), **TOL)
    torch.testing.assert_close(out.loss, rep(ce.detach(), mesh), **TOL)
    out.loss.sum().backward()
    compare_grads(pm, ref, **TOL)


def test_masked_call_with_router_logits_is_refused_on_simulated_ranks() -> None:
    """ep=2 simulated, an attention mask and output_router_logits=True: the first call raises a
    fastdist error naming transformers' masked aux loss and the fixes (real ranks, or
    output_router_logits=False), not torch's vmap message."""
    model = copy.deepcopy(build_mixtral())
    ids, _ = lm_batch()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mesh = fd.Mesh({"ep": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, family="mixtral", axis="ep"))
    with pytest.raises(
        NoBackendError,
        match=r"scatter_add_ writes values that differ by rank.*output_router_logits=True and an "
        r"attention_mask.*run_on_gloo.*output_router_logits=False",
    ):
        pm(input_ids=rep(ids, mesh), attention_mask=rep(mask, mesh), output_router_logits=True)


def test_masked_call_with_router_logits_on_gloo() -> None:
    """The same batch with ``output_router_logits=True`` on 2 gloo processes (ep=2): logits,
    the mask-weighted aux loss, the loss and every gradient equal one device's
    (tests/moe_mask_worker.py)."""
    from tests.dist_harness import run_on_gloo
    from tests.moe_mask_worker import masked_mixtral_on_gloo

    assert run_on_gloo(masked_mixtral_on_gloo, 2, timeout=300) == ["ok"] * 2
