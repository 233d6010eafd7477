"""Gloo workers for tests/test_pipeline_ckpt_gloo.py (issue 40, the last gaps of points 1 and 4):
transformers' activation checkpointing inside a pipeline on real ranks, and FSDP2 under a
pipeline. Run through ``tests.dist_harness.run_on_gloo``; each rank builds the tiny float64
Llama of tests/pipeline_worker.py and its one-device reference itself."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import fastdist as fd
from tests.pipeline_worker import batch, compare, reference
from tests.tiny_models import tiny_llama


def checkpointing_on_4() -> dict[str, Any]:
    """4 ranks, pp2 x tp2 under 1F1B: transformers' gradient checkpointing (reentrant and not)
    enabled on the model the pipeline splits; per case this rank's loss and gradient errors
    against the unmodified model on one device (no checkpointing)."""
    torch.set_num_threads(1)
    mesh = fd.connect(pp=2, tp=2, timeout=90)
    out: dict[str, Any] = {"pp": mesh.index(mesh.rank, "pp")}
    for reentrant in (True, False):
        model = tiny_llama(4, seed=4)
        losses, grads = reference(model, [20])
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
        pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
        calls = count_layer_calls(pipe)
        ids, labels = batch(20)
        loss = pipe.step(input_ids=ids, labels=labels)
        out[f"reentrant={reentrant}"] = {**compare(pipe, loss, losses[0], grads), "calls": calls}
    return out


def count_layer_calls(pipe: Any) -> list[int]:
    """Forward pre-hooks on the attention of this rank's own decoder layers (transformers
    checkpoints a layer's ``forward``, so its submodules run again in the recomputation); the
    returned list gets one entry per call (2 micro-batches: 2 calls per layer, 4 when
    checkpointing recomputes them)."""
    calls: list[int] = []
    for stage in pipe.stages.values():
        for layer in stage.module.model.layers:
            if isinstance(layer, LlamaDecoderLayer):
                layer.self_attn.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def fsdp_on_4() -> dict[str, Any]:
    """4 ranks, pp2 x dp2: ``fd.train.DataParallel(pipe, "dp", engine="fsdp")``; what it raises
    (type, message) on this rank."""
    torch.set_num_threads(1)
    mesh = fd.connect(pp=2, timeout=90)  # dp = 2
    model = tiny_llama(4, seed=5)
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    try:
        fd.train.DataParallel(pipe, "dp", engine="fsdp")
    except fd.FastdistError as e:
        return {"type": type(e).__name__, "msg": str(e), "rank": dist.get_rank()}
    return {"type": None, "msg": None, "rank": dist.get_rank()}
