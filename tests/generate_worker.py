"""Generation cases for tests/test_generate.py: each runs on one device (`one_device`) and on
every rank of a gloo job (`on_ranks`, through `fastdist.testing.run_on_gloo`)."""

from __future__ import annotations

from typing import Any

import torch

import fastdist as fd
from fastdist.errors import ParallelizeError
from tests import tiny_models as tm

PROMPT = [[3, 5, 7, 11, 13]]
#: a left-padded batch of two prompts
PADDED = dict(prompt=[[0, 0, 3, 5, 7, 9], [1, 2, 3, 4, 5, 6]], mask=[[0, 0, 1, 1, 1, 1], [1] * 6])
#: name -> generate's arguments (``prompt``/``mask``: the inputs); each starts from seed 1
CASES: dict[str, dict[str, Any]] = {
    "greedy": dict(max_new_tokens=6, do_sample=False),
    "sample": dict(max_new_tokens=6, do_sample=True, top_k=20, top_p=0.9, temperature=0.8),
    "beam": dict(max_new_tokens=5, num_beams=3, do_sample=False),
    "padded_eos": dict(max_new_tokens=5, do_sample=False, eos_token_id=48, **PADDED),
}


def run_case(fn: Any, family: str, gen: dict[str, Any], seed: int = 1) -> Any:
    gen = dict(gen)
    ids = torch.tensor(gen.pop("prompt", PROMPT))
    mask = gen.pop("mask", None)
    kw = {"attention_mask": torch.tensor(mask)} if mask is not None else {}
    if family == "mixtral":  # transformers' router loss breaks on a padded batch in generate
        kw["output_router_logits"] = False
    torch.manual_seed(seed)
    return fn(ids, **kw, **gen)


def one_device(family: str) -> dict[str, list[list[int]]]:
    """Every case's tokens from the unmodified model on one device."""
    model = tm.build(family)
    return {name: run_case(model.generate, family, gen).tolist() for name, gen in CASES.items()}


def on_ranks(family: str, degrees: dict[str, int], sequence_parallel: bool) -> dict[str, Any]:
    """One rank: the model parallelized with its ready plan; every case through
    ``ParallelModel.generate`` with this rank's random state made different from rank 0's (the
    tokens must still be one device's), plus the KV cache's key shape, greedy decoding through
    the model's own ``generate``, and sampling through it with the ranks' random states apart
    (every rank must return rank 0's tokens, the last one included)."""
    mesh = fd.connect(**degrees)
    model = tm.build(family)
    plan = fd.nn.plans.plan(model, mesh, sequence_parallel=sequence_parallel)
    pm = fd.nn.parallelize(model, mesh, plan)
    out: dict[str, Any] = {}
    seed = 1 + 1000 * mesh.rank  # pm.generate draws with rank 0's random state
    for name, gen in CASES.items():
        out[name] = run_case(pm.generate, family, gen, seed).tolist()
    res = run_case(pm.generate, family, {**CASES["greedy"], "return_dict_in_generate": True})
    out["cache_keys"] = tuple(res.past_key_values.layers[0].keys.shape)
    # the cache is this model's: another parallel model (the same shapes here) refuses it
    other = tm.build(family)
    fd.nn.parallelize(other, mesh, fd.nn.plans.plan(other, mesh))
    try:
        other(input_ids=res.sequences[:, -1:], past_key_values=res.past_key_values)
        out["foreign_cache"] = "no error"
    except ParallelizeError as e:
        out["foreign_cache"] = str(e)
    out["direct_greedy"] = run_case(model.generate, family, CASES["greedy"]).tolist()
    # the model's own generate samples as pm.generate does: rank 0's random state on every rank
    out["direct_sample"] = run_case(
        model.generate, family, {**CASES["sample"], "max_new_tokens": 3}, seed
    ).tolist()
    return out
