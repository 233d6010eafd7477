"""Gloo workers for tests/test_review_moe_pipeline.py: a pipeline's forward-only step under
``torch.no_grad()`` / ``torch.inference_mode()`` and a frozen first stage on real ranks, each
against one device computed in the worker (loss by hand, float64)."""

from __future__ import annotations

import copy
from typing import Any

import torch

import fastdist as fd
from tests.pipeline_worker import _setup, batch, loss_by_hand
from tests.tiny_models import tiny_llama

FROZEN = ("model.embed_tokens.", "model.layers.0.", "model.layers.1.")  # stage 0 of 2 (4 layers)


def evaluation_and_frozen_on_2() -> dict[str, Any]:
    """pp=2 (1F1B, and interleaved with two stages per rank): a training step, then a step of
    another batch under no_grad and under inference_mode (the loss against one device, the
    gradients the training step's, bitwise); then a step with stage 0's parameters frozen (the
    loss and gradients against one device)."""
    _setup()
    mesh = fd.connect(pp=2, timeout=60)
    model = tiny_llama(4, seed=2)
    out: dict[str, Any] = {}
    for name, virtual in (("1f1b", 1), ("interleaved_1f1b", 2)):
        pipe = fd.train.pipeline(
            copy.deepcopy(model), mesh, schedule=name, microbatches=2, virtual=virtual
        )
        pipe.step(input_ids=batch(1)[0], labels=batch(1)[1])
        before = {n: p.grad.clone() for n, p in pipe.named_parameters()}  # type: ignore[union-attr]
        with torch.no_grad():
            want = loss_by_hand(copy.deepcopy(model), *batch(2)).item()
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                loss = pipe.step(input_ids=batch(2)[0], labels=batch(2)[1])
            out[f"{name}-{mode.__name__}"] = {
                "loss_err": abs(loss.item() - want),
                "grads_kept": all(
                    torch.equal(g, before[n]) and not g.is_inference()
                    for n, g in ((n, p.grad) for n, p in pipe.named_parameters())
                    if g is not None
                )
                and all(p.grad is not None for p in pipe.parameters()),
                "kinds": sorted({e.kind for e in pipe.events}),
            }
    ref = copy.deepcopy(model)
    for n, p in ref.named_parameters():
        p.requires_grad_(not n.startswith(FROZEN))
    pipe = fd.train.pipeline(copy.deepcopy(ref), mesh, schedule="1f1b", microbatches=2)
    want_loss = loss_by_hand(ref, *batch(3))
    want_loss.backward()
    loss = pipe.step(input_ids=batch(3)[0], labels=batch(3)[1])
    got = {n: p.grad for n, p in pipe.named_parameters() if p.grad is not None}
    want = {n: p.grad for n, p in ref.named_parameters()}
    out["frozen"] = {
        "loss_err": abs(loss.item() - want_loss.item()),
        "grad_err": max(((g - want[n]).abs().max().item() for n, g in got.items()), default=0.0),
        "with_grad": sorted(got),
        "held": sorted(n for n, _ in pipe.named_parameters()),
        "trainable": sorted(n for n, p in ref.named_parameters() if p.requires_grad),
    }
    out["tied"] = tied_copies(mesh)
    return out


def tied_copies(mesh: fd.Mesh) -> list[str]:
    """gpt2's tied embedding over pp=2 (the copies on two processes): AdamW steps with the same
    settings for both copies run; with ``wte`` in a group without weight decay the copies drift
    apart, and the next step raises on both ranks (the digests swapped). Each step's outcome."""
    from tests.test_pipeline import family_model, make_batch

    got = []
    for split in (False, True):
        pipe = fd.train.pipeline(
            family_model("gpt2", tie=True, layers=4), mesh, schedule="1f1b", microbatches=2
        )
        named = list(pipe.named_parameters())
        decay = [p for n, p in named if not (split and "wte" in n)]
        rest = [p for n, p in named if split and "wte" in n]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-2)
        ids, labels = make_batch(1)
        for _ in range(2):
            try:
                pipe.step(input_ids=ids, labels=labels)
            except fd.PipelineError as e:
                got.append(str(e))
                break
            opt.step()
            pipe.zero_grad()
            got.append("ok")
    return got
