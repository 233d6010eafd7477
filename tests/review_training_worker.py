"""Gloo scenarios of tests/test_review_training.py: the documented recipe for uneven padding
(each rank's summed token loss over ``num_items_in_batch = global count / D``) with ``no_sync``
accumulation, small buckets, clipping and ZeRO-1, against one device in every process."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

import fastdist as fd


def uneven_batches(step: int, dp: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[micro][dp rank] -> (ids, labels)``: two micro-batches; padding differs across ranks and
    micro-batches, and on the first step dp rank 1's second micro-batch ignores every token."""
    from tests.test_hf_models import batch

    out = []
    for micro in range(2):
        row = []
        for r in range(dp):
            ids, labels = batch(100 * step + 10 * micro + r)
            labels[:, : 2 + 2 * r + micro] = -100
            if step == 0 and micro == 1 and r == 1:
                labels[:] = -100
            row.append((ids, labels))
        out.append(row)
    return out


def counted(labels: torch.Tensor) -> int:
    """Tokens the causal-LM loss counts (labels shifted left by one)."""
    return int((labels[:, 1:] != -100).sum())


def one_device_step(ref: Any, batches: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
    """The single-device gradient: every token of the global batch, summed, over their count."""
    from tests.test_hf_models import VOCAB

    total = sum(counted(lab) for row in batches for _, lab in row)
    for row in batches:
        for ids, labels in row:
            logits = ref(input_ids=ids).logits[:, :-1].reshape(-1, VOCAB)
            loss = torch.nn.functional.cross_entropy(
                logits, labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
            )
            (loss / total).backward()


def uneven_padding_zero_on_gloo() -> str:
    """2 ranks, dp=2: three steps of AdamW (ZeRO-1) with clipping, buckets of ~1 KiB."""
    from tests import tiny_models

    mesh = fd.connect(tp=1, timeout=120)
    ref = tiny_models.build("llama", tie_word_embeddings=True)
    pm = fd.nn.parallelize(copy.deepcopy(ref), mesh, fd.nn.plans.plan(ref, family="llama"))
    dp = fd.train.DataParallel(pm, "dp", bucket_mb=1e-3)
    opt = fd.train.ZeroOptimizer(pm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    D, r = mesh.axis_size("dp"), mesh.coords(mesh.rank)["dp"]
    # every micro-batch under no_sync: the gradients were never reduced; clipping (here, on real
    # ranks, no norm comparison would notice) and stepping raise on every rank
    ids, labels = uneven_batches(9, D)[0][r]
    with dp.no_sync():
        pm(input_ids=ids, labels=labels).loss.backward()
    for refused in (lambda: fd.nn.clip_grad_norm_(pm, 0.5), opt.step):
        try:
            refused()
            return "a step on unreduced gradients was not refused"
        except fd.errors.MeshError as e:
            assert "never reduced" in str(e), e
    opt.zero_grad()
    for step in range(3):
        batches = uneven_batches(step, D)
        total = sum(counted(lab) for row in batches for _, lab in row)
        for micro, row in enumerate(batches):
            ids, labels = row[r]
            with dp.no_sync() if micro == 0 else contextlib.nullcontext():
                n = torch.tensor(total / D, dtype=torch.float64)
                pm(input_ids=ids, labels=labels, num_items_in_batch=n).loss.backward()
        one_device_step(ref, batches)
        norm = fd.nn.clip_grad_norm_(pm, 0.5)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch.testing.assert_close(norm, want, rtol=1e-10, atol=1e-12)
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    state = pm.state_dict()
    worst = max(float((state[k] - v).abs().max()) for k, v in ref.state_dict().items())
    return "ok" if worst < 1e-10 else f"weights differ by {worst}"


def optimizer_before_fsdp() -> str:
    """An optimizer built before ``DataParallel(engine="fsdp")`` holds the parameters FSDP2
    replaced with DTensor shards: its ``step()`` raises (before: it updated nothing, every
    weight unchanged, max change 0.0); one built after trains."""
    from tests import tiny_models
    from tests.test_hf_models import batch

    mesh = fd.connect(tp=1, timeout=120)
    ref = tiny_models.build("llama")
    pm = fd.nn.parallelize(copy.deepcopy(ref), mesh, fd.nn.plans.plan(ref, family="llama"))
    early = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    fd.train.DataParallel(pm, "dp", engine="fsdp")
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    ids, labels = batch(mesh.rank)
    pm(input_ids=ids, labels=labels).loss.backward()
    try:
        early.step()
        return "an optimizer over the replaced parameters stepped"
    except fd.errors.MeshError as e:
        assert "fully_shard replaced" in str(e) and "embed_tokens" in str(e), e
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    opt.step()
    after = pm.state_dict()
    moved = min(float((after[k] - v).abs().max()) for k, v in before.items())
    return "ok" if moved > 0 else f"a weight did not move ({moved})"
