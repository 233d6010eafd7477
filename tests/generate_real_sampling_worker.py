"""Sampling through the model's OWN ``generate`` (not ``pm.generate``) on real ranks, for
tests/test_generate_real_sampling.py: every rank of a 2-process gloo job (tp 2) seeds its random
state differently (``SEED + rank``), as independent processes do, and samples."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import fastdist as fd
from fastdist.errors import ParallelizeError
from tests import tiny_models as tm

PROMPT = [[3, 5, 7, 11, 13, 17]]
#: rank r seeds ``SEED + r`` before each generate
SEED = 100
#: the sampling settings (a high temperature: near-uniform draws, so two seeds differ)
SAMPLE: dict[str, Any] = dict(do_sample=True, temperature=3.0, top_k=0)


def one_device(max_new_tokens: int) -> Tensor:
    """The unmodified model's sampled tokens with rank 0's seed."""
    model = tm.build("llama")
    torch.manual_seed(SEED)
    return model.generate(torch.tensor(PROMPT), max_new_tokens=max_new_tokens, **SAMPLE)


def _run(fn: Any) -> Any:
    try:
        return fn()
    except ParallelizeError as e:
        return f"ParallelizeError: {e}"


def on_ranks() -> dict[str, Any]:
    """One rank of ``fd.connect(tp=2)``: the model's own generate, sampling with this rank's
    seed (the last token alone: 1 new token; several: 4), then this rank's next random draw
    (its own stream must be left as it was on ranks other than the group's first)."""
    mesh = fd.connect(tp=2)
    model = tm.build("llama")
    fd.nn.parallelize(model, mesh)
    prompt = torch.tensor(PROMPT)
    out: dict[str, Any] = {}
    for n in (1, 4):
        torch.manual_seed(SEED + mesh.rank)
        out[f"tokens_{n}"] = _run(lambda n=n: model.generate(prompt, max_new_tokens=n, **SAMPLE))
        out[f"after_{n}"] = torch.rand(3, dtype=torch.float64)
    torch.manual_seed(SEED)
    out["temperature_differ"] = _run(
        lambda: model.generate(
            prompt, max_new_tokens=1, do_sample=True, temperature=1.0 + mesh.rank
        )
    )
    out["prompt_differ"] = _run(lambda: model.generate(prompt + mesh.rank, max_new_tokens=1))
    return out
