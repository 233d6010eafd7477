"""Gloo ranks for tests/test_review_replicas_moe.py: a hand plan that runs a Qwen2-MoE's sparse
expert block whole on every rank behind a ``PrepareInput`` (a ``pvary``)."""

from __future__ import annotations

import copy
from typing import Any

import torch.nn.functional as F

import fastdist as fd
from tests.test_review_auto_families import V, batch
from tests.test_review_auto_families import qwen_dense_then_experts as dense_then_experts


def qwen_dense_then_experts() -> Any:
    """A tiny float64 Qwen2-MoE (random init, seed 0): layer 0 a dense MLP, layer 1 a sparse
    expert block (4 experts, top-2, a shared expert)."""
    return dense_then_experts(num_experts_per_tok=2)


def pvary_moe_plan(ref: Any) -> dict[str, Any]:
    """The auto plan of ``ref`` with its expert block's entries replaced by one
    ``PrepareInput("tp")`` on the block: the block runs whole and replicated on every rank."""
    plan = fd.nn.plans.plan(ref, family="auto")
    plan = {k: v for k, v in plan.items() if not k.startswith("model.layers.1.mlp")}
    plan["model.layers.1.mlp"] = fd.nn.PrepareInput("tp")
    return plan


def _refusal(ref: Any, mesh: fd.Mesh, verify: bool | None) -> str:
    """The `ParallelizeError`'s message of parallelizing with `pvary_moe_plan`, or ``""``."""
    try:
        fd.nn.parallelize(copy.deepcopy(ref), mesh, pvary_moe_plan(ref), verify=verify)
    except fd.nn.ParallelizeError as e:
        return str(e)
    return ""


def pvary_moe_on_gloo() -> dict[str, Any]:
    """One gloo rank: the refusals with ``verify=True`` and by default (``None``), and, with
    ``verify=False``, ``model.layers.1.post_attention_layernorm.weight``'s gradient over one
    device's (what the plan would silently give)."""
    ref = qwen_dense_then_experts()
    mesh = fd.connect(tp=2, timeout=60)
    found = {"verify": _refusal(ref, mesh, True), "default": _refusal(ref, mesh, None)}
    pm = fd.nn.parallelize(copy.deepcopy(ref), mesh, pvary_moe_plan(ref), verify=False)
    ids, labels = batch()
    logits = ref(input_ids=ids).logits
    F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1)).backward()
    pm(input_ids=ids, labels=labels).loss.backward()
    name = "model.layers.1.post_attention_layernorm.weight"
    want = dict(ref.named_parameters())[name].grad
    got = pm.grads()[name]
    found["ratio"] = float((got * want).sum() / (want * want).sum())
    return found
