"""Helpers of tests/test_pipeline_checkpoint.py and its gloo rank function (importable by
``fastdist.testing.run_on_gloo``): a tiny float64 Llama, its batches, one AdamW step on one
device, on a pipeline or on a parallel model, and the single-device view of weights and AdamW
state of each."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fastdist as fd
from fastdist import checkpoint
from tests.tiny_models import tiny_llama

VOCAB, BATCH, SEQ = 64, 4, 8
LR = 1e-2

States = tuple[dict[str, Tensor], dict[str, dict[str, Tensor]]]
"""(weights, AdamW state by parameter name), single-device tensors."""


def llama(seed: int = 0) -> nn.Module:
    """The tiny float64 Llama: 4 layers, untied embeddings, no dropout."""
    return tiny_llama(4, seed=seed).eval()


def tied_llama(seed: int = 0) -> nn.Module:
    """`llama` with tied input and output embeddings."""
    from transformers import LlamaForCausalLM

    from tests.tiny_models import llama_config

    cfg = llama_config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


def batch(step: int) -> tuple[Tensor, Tensor]:
    """``(ids, labels)`` ``[BATCH, SEQ]`` of ``step``; a few labels ignored."""
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def hand_loss(model: nn.Module, ids: Tensor, labels: Tensor) -> Tensor:
    """One device: mean cross entropy of the shifted logits over the labels that are not -100."""
    logits = model(input_ids=ids).logits  # [b, s, V]
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB),  # [b * (s - 1), V]
        labels[:, 1:].reshape(-1),  # [b * (s - 1)]
        ignore_index=-100,
    )


def step(model: Any, opt: torch.optim.Optimizer, s: int, clip: float | None = None) -> Any:
    """One AdamW step on batch ``s`` (every rank the same batch): a pipeline (``pipe.step``), a
    parallel model (its plan's loss) or the plain model (by hand); with ``clip``, clipped by the
    whole model's norm first (returned)."""
    ids, labels = batch(s)
    if isinstance(model, fd.train.Pipeline):
        if model.simulated:
            ids, labels = (t.expand(model.mesh.size, *t.shape) for t in (ids, labels))
        model.step(input_ids=ids, labels=labels)
    elif isinstance(model, fd.nn.ParallelModel):
        if model.simulated:
            ids, labels = (t.expand(model.mesh.size, *t.shape) for t in (ids, labels))
        model(input_ids=ids, labels=labels).loss.sum().backward()
    else:
        hand_loss(model, ids, labels).backward()
    norm = None
    if clip is not None and isinstance(model, fd.train.Pipeline):
        norm = model.clip_grad_norm_(clip)
    elif clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    return norm


def states(model: Any, opt: torch.optim.Optimizer) -> States:
    """The single-device weights and AdamW state of what this process holds (a pipeline: its
    stages; on real ranks a collective over each stage's mesh)."""
    if isinstance(model, fd.train.Pipeline):
        parts = [model.stages[j] for j in sorted(model.stages)]
    else:
        parts = [model]
    weights: dict[str, Tensor] = {}
    optim: dict[str, dict[str, Tensor]] = {}
    for pm in parts:
        if isinstance(pm, fd.nn.ParallelModel):
            weights.update(pm.state_dict())
            named = pm.module.named_parameters()
        else:
            once = {n for n, _ in pm.named_parameters()} | {n for n, _ in pm.named_buffers()}
            state = pm.state_dict()  # a tied weight: under its first name only
            weights.update({k: v.detach().clone() for k, v in state.items() if k in once})
            named = pm.named_parameters()
        for name, p in named:
            optim[name] = {}
            for k, v in sorted(opt.state.get(p, {}).items()):
                if isinstance(pm, fd.nn.ParallelModel) and v.dim():
                    v = fd.nn.state.gather_full(v, pm.layouts[name], pm.mesh, name=name)
                optim[name][k] = v.detach().clone()
    return weights, optim


def on_four_ranks(src: str, out: str) -> dict[str, Any]:
    """4 gloo ranks: the one-device checkpoint ``src`` (after 2 steps) into pp=2 x tp=2 (1F1B),
    a step, saved to ``out/pp2tp2``; that into pp=4 (tp=1), a step, saved to ``out/pp4``; that
    into pp=2 x dp=2 interleaved (two stages per rank), saved to ``out/pp2dp2``; that into
    dp=2 x tp=2 without a pipeline. The states each layout holds after each load and step."""
    res: dict[str, Any] = {}
    mesh = fd.connect(pp=2, tp=2, timeout=60)
    pipe = fd.train.pipeline(llama(seed=3), mesh, schedule="1f1b", microbatches=2)
    opt = adamw(pipe.parameters())
    res["pp2tp2 extra"] = checkpoint.load(src, pipe, opt)
    res["pp2tp2"] = states(pipe, opt)
    step(pipe, opt, 2)
    res["pp2tp2 step"] = states(pipe, opt)
    checkpoint.save(f"{out}/pp2tp2", pipe, opt, extra={"step": 3})

    mesh = fd.connect(pp=4, timeout=60)
    pipe = fd.train.pipeline(llama(seed=4), mesh, schedule="1f1b", microbatches=4)
    opt = adamw(pipe.parameters())
    res["pp4 extra"] = checkpoint.load(f"{out}/pp2tp2", pipe, opt)
    res["pp4"] = states(pipe, opt)
    step(pipe, opt, 3)
    res["pp4 step"] = states(pipe, opt)
    checkpoint.save(f"{out}/pp4", pipe, opt, extra={"step": 4})

    mesh = fd.connect(pp=2, timeout=60)  # pp=2 x dp=2, two stages per rank
    pipe = fd.train.pipeline(llama(seed=7), mesh, schedule="interleaved_1f1b", microbatches=2)
    opt = adamw(pipe.parameters())
    res["pp2dp2 extra"] = checkpoint.load(f"{out}/pp4", pipe, opt)
    res["pp2dp2"] = states(pipe, opt)
    checkpoint.save(f"{out}/pp2dp2", pipe, opt, extra={"step": 4})

    mesh = fd.connect(tp=2, timeout=60)  # dp=2 x tp=2, no pipeline
    model = llama(seed=5)
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh))
    opt = adamw(pm.parameters())
    res["dp2tp2 extra"] = checkpoint.load(f"{out}/pp2dp2", pm, opt)
    res["dp2tp2"] = states(pm, opt)

    # tied embeddings across the stages: a one-device checkpoint in, a clipped step, saved
    mesh = fd.connect(pp=2, tp=2, timeout=60)
    pipe = fd.train.pipeline(tied_llama(seed=8), mesh, schedule="1f1b", microbatches=2)
    opt = adamw(pipe.parameters())
    checkpoint.load(f"{out}/tied_one", pipe, opt)
    res["tied"] = states(pipe, opt)
    res["tied norm"] = float(step(pipe, opt, 2, clip=0.5))
    res["tied step"] = states(pipe, opt)
    checkpoint.save(f"{out}/tied_pp", pipe, opt)

    # a checkpoint of another model (2 layers) refused on every rank, naming the keys
    mesh = fd.connect(pp=2, tp=2, timeout=60)
    pipe = fd.train.pipeline(llama(seed=6), mesh, schedule="1f1b", microbatches=2)
    try:
        checkpoint.load(f"{out}/other", pipe)
    except fd.nn.CheckpointError as e:
        res["other model"] = str(e)
    return res
