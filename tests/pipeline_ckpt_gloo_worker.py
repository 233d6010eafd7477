"""Gloo workers for tests/test_pipeline_ckpt_gloo.py (issue 40, the last gaps of points 1 and 4):
transformers' activation checkpointing inside a pipeline on real ranks, and FSDP2 under a
pipeline. Run through ``tests.dist_harness.run_on_gloo``; each rank builds the tiny float64
Llama of tests/pipeline_worker.py and its one-device reference itself."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import fastdist as fd
from tests.pipeline_checkpoint_worker import tied_llama
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


def fsdp_on_4(directory: str) -> dict[str, Any]:
    """4 ranks, pp2 x dp2: FSDP2 on each stage (``fd.train.DataParallel(pipe, "dp",
    engine="fsdp")``), each dp rank its own batch, 2 micro-batches, under 1F1B and GPipe; this
    rank's loss and gradient errors against one device (the mean gradient over both batches),
    then the whole-model clip's norm and an AdamW step's weights, written by
    ``pipe.save_pretrained(directory)`` (GPipe's; this rank's weights returned); and what DDP
    and a tied model raise."""
    torch.set_num_threads(1)
    mesh = fd.connect(pp=2, timeout=90)  # dp = 2
    dp = mesh.index(mesh.rank, "dp")
    out: dict[str, Any] = {"pp": mesh.index(mesh.rank, "pp"), "dp": dp}
    for schedule in ("1f1b", "gpipe"):
        model = tiny_llama(4, seed=5)
        ref = copy.deepcopy(model)
        losses, grads = reference(model, [30, 31])
        pipe = fd.train.pipeline(model, mesh, schedule=schedule, microbatches=2)
        fd.train.DataParallel(pipe, "dp", engine="fsdp")
        ids, labels = batch(30 + dp)
        loss = pipe.step(input_ids=ids, labels=labels)
        res = compare(pipe, loss, losses[dp], grads)
        res["dtensor"] = all(hasattr(p, "full_tensor") for p in pipe.parameters())
        # the clip and an AdamW step against torch's on one device
        for n, p in ref.named_parameters():
            p.grad = grads[n].clone()
        res["ref_total"] = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item()
        res["total"] = pipe.clip_grad_norm_(0.05).item()
        torch.optim.AdamW(ref.parameters(), lr=1e-2).step()
        torch.optim.AdamW(pipe.parameters(), lr=1e-2).step()
        want = dict(ref.named_parameters())
        res["weight_err"] = max(
            (w - want[n].detach()).abs().max().item() for n, w in pipe.state_dict().items()
        )
        out[schedule] = res
    pipe.save_pretrained(directory)
    out["weights"] = pipe.state_dict()
    for name, build, engine in (
        ("ddp", lambda: tiny_llama(4, seed=5), "ddp"),
        ("tied", lambda: tied_llama(5), "fsdp"),
    ):
        pipe = fd.train.pipeline(build(), mesh, schedule="1f1b", microbatches=2)
        try:
            fd.train.DataParallel(pipe, "dp", engine=engine)
            out[name] = None
        except fd.FastdistError as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def tied_moe_save_pretrained_on_4(directory: str) -> dict[str, Any]:
    """4 ranks, pp2 x tp2: a tied tiny Qwen3-MoE after a step and an SGD step;
    ``pipe.save_pretrained(directory)`` (a collective: rank 0 writes); this rank's weights (the
    stages it holds, single-device), and whether a fresh pipeline loading the directory with
    ``fd.checkpoint.load`` holds them bitwise."""
    from tests import tiny_models

    torch.set_num_threads(1)
    mesh = fd.connect(pp=2, tp=2, timeout=90)

    def build() -> Any:
        return tiny_models.build(
            "qwen3_moe",
            kv=2,
            seed=3,
            fill_zeros=True,
            tie_word_embeddings=True,
            output_router_logits=False,  # a pipeline refuses the load-balancing loss
        ).train()

    pipe = fd.train.pipeline(build(), mesh, schedule="1f1b", microbatches=2)
    ids = torch.randint(0, tiny_models.VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    pipe.step(input_ids=ids, labels=ids)
    torch.optim.SGD(pipe.parameters(), lr=0.5).step()
    pipe.save_pretrained(directory)
    want = pipe.state_dict()
    again = fd.train.pipeline(build(), mesh, schedule="1f1b", microbatches=2)
    fd.checkpoint.load(directory, again)
    got = again.state_dict()
    return {
        "weights": want,
        "reloaded": got.keys() == want.keys()
        and all(torch.equal(got[k], w) for k, w in want.items()),
    }


def fsdp_tp_on_8() -> dict[str, Any]:
    """8 ranks, pp2 x dp2 x tp2 with sequence parallelism, FSDP2 over dp on each stage
    (torchtitan's pp x FSDP x tp), each dp rank its own batch: this rank's loss and gradient
    errors against one device."""
    torch.set_num_threads(1)
    mesh = fd.connect(pp=2, tp=2, timeout=120)  # dp = 2
    dp = mesh.index(mesh.rank, "dp")
    model = tiny_llama(4, seed=6)
    losses, grads = reference(model, [40, 41])
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2, sequence_parallel=True)
    fd.train.DataParallel(pipe, "dp", engine="fsdp")
    ids, labels = batch(40 + dp)
    loss = pipe.step(input_ids=ids, labels=labels)
    res = compare(pipe, loss, losses[dp], grads)
    res["dtensor"] = all(hasattr(p, "full_tensor") for p in pipe.parameters())
    res["model"] = sorted(grads)
    return res


def fsdp_checkpoint_on_4(directory: str) -> dict[str, float]:
    """4 ranks, pp2 x dp2 under FSDP2: a step and an AdamW step, ``fd.checkpoint.save`` of the
    pipeline and optimizer; another pipeline (other weights, its own AdamW step) loads it; then
    the same step on both: the largest weight difference after the load and after that step."""
    torch.set_num_threads(1)
    mesh = fd.connect(pp=2, timeout=90)  # dp = 2
    ids, labels = batch(30 + mesh.index(mesh.rank, "dp"))

    def trained(seed: int) -> tuple[Any, torch.optim.Optimizer]:
        pipe = fd.train.pipeline(tiny_llama(4, seed=seed), mesh, schedule="1f1b", microbatches=2)
        fd.train.DataParallel(pipe, "dp", engine="fsdp")
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        pipe.step(input_ids=ids, labels=labels)
        opt.step()
        opt.zero_grad()
        return pipe, opt

    def diff(a: Any, b: Any) -> float:
        sa, sb = a.state_dict(), b.state_dict()
        return max((sa[k] - w).abs().max().item() for k, w in sb.items())

    pipe, opt = trained(5)
    fd.checkpoint.save(directory, pipe, opt)
    other, other_opt = trained(9)
    fd.checkpoint.load(directory, other, other_opt)
    out = {"loaded": diff(other, pipe)}
    for p, o in ((pipe, opt), (other, other_opt)):
        p.step(input_ids=ids, labels=labels)
        o.step()
    out["stepped"] = diff(other, pipe)
    return out
