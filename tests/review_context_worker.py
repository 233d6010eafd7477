"""Context-parallel LLM cases of tests/test_review_context.py run on every rank of a gloo job
(`fastdist.testing.run_on_gloo`), compared there with one device."""

from __future__ import annotations

from typing import Any

import torch

import fastdist as fd
from fastdist.errors import ParallelizeError
from fastdist.nn.styles.context_llm import CausalContextParallel
from tests import tiny_models as tm
from tests.tiny_models import VOCAB

S = 24  # 2 x cp divides it for cp = 2 and 3


def batch() -> dict[str, torch.Tensor]:
    """A right-padded batch whose positions start at 5, labels -100 on the padding and a
    prompt."""
    ids = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, -7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :4] = -100
    positions = torch.arange(5, 5 + S).expand(2, S)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": labels}


def build(family: str, bidirectional: bool) -> Any:
    model = tm.build(family, sliding_window=3) if family == "mistral" else tm.build(family)
    model.config.is_causal = not bidirectional
    return model.train()  # no dropout in these configs; the cache left at its default


def step(model: Any) -> dict[str, Any]:
    """The model's loss (its own, labels -100 ignored), logits and every gradient."""
    out = model(**batch())
    out.loss.backward()
    grads = getattr(model, "grads", None)
    return {
        "loss": out.loss.detach(),
        "logits": out.logits.detach(),
        "grads": grads() if grads else {n: p.grad for n, p in model.named_parameters()},
    }


def one_device(family: str, bidirectional: bool = False) -> dict[str, Any]:
    return step(build(family, bidirectional))


def on_ranks(family: str, cp: int, mode: str, bidirectional: bool = False) -> dict[str, Any]:
    """One training forward and backward with the tokens split over ``cp`` ranks; a refusal's
    message instead when the style refuses the model."""
    model = build(family, bidirectional)
    mesh = fd.connect(cp=cp)
    style = CausalContextParallel("cp", mode)  # type: ignore[arg-type]
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, context_parallel=style))
    try:
        return step(pm)
    except ParallelizeError as e:
        return {"refused": str(e)}


def rank_batches_on_ranks(cp: int) -> dict[str, Any]:
    """Each rank its own batch (a data loader sharded over the cp ranks too: a user's mistake):
    the loss, or the refusal."""
    import torch.distributed as dist

    model = tm.build("llama").train()
    mesh = fd.connect(cp=cp)
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, context_parallel="cp"))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    try:
        out = pm(input_ids=ids, labels=ids, use_cache=False)
    except ParallelizeError as e:
        return {"refused": str(e)}
    return {"loss": out.loss.detach(), "ids": ids}
