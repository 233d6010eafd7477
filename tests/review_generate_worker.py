"""Generation scenarios for tests/test_review_generate.py, run on every rank of a 2-process gloo
job (`fastdist.testing.run_on_gloo`): what ``ParallelModel.generate`` must refuse on real ranks
(a prompt passed as ``inputs=`` that differs across ranks, rank-dependent generation settings, a
model left in training mode with dropout) and what it must give (scores and hidden states equal
to one device's)."""

from __future__ import annotations

from typing import Any

import torch

import fastdist as fd
from fastdist.errors import ParallelizeError
from tests import tiny_models as tm

PROMPT = [[3, 5, 7, 11, 13, 17]]
GREEDY: dict[str, Any] = dict(max_new_tokens=4, do_sample=False)
#: generate's outputs beyond the tokens (each rank's must be one device's)
OUTPUTS: dict[str, Any] = dict(
    max_new_tokens=3,
    do_sample=False,
    return_dict_in_generate=True,
    output_scores=True,
    output_logits=True,
    output_hidden_states=True,
)


def outputs(generate: Any) -> dict[str, Any]:
    """The tokens, scores, logits and hidden states of `OUTPUTS` (tensors)."""
    res = generate(torch.tensor(PROMPT), **OUTPUTS)
    return {
        "sequences": res.sequences,
        "scores": torch.stack(res.scores),
        "logits": torch.stack(res.logits),
        "hidden_states": [list(step) for step in res.hidden_states],
    }


def one_device() -> dict[str, Any]:
    model = tm.build("llama")
    return {"greedy": model.generate(torch.tensor(PROMPT), **GREEDY), **outputs(model.generate)}


def _error(fn: Any) -> str:
    try:
        fn()
    except ParallelizeError as e:
        return str(e)
    return "no error"


def on_ranks() -> dict[str, Any]:
    """One rank of ``fd.connect(tp=2)``: the refusals' messages and the outputs."""
    mesh = fd.connect(tp=2)
    model = tm.build("llama")
    pm = fd.nn.parallelize(model, mesh)
    mine = torch.tensor(PROMPT) + mesh.rank  # rank 1's prompt differs
    same = torch.tensor(PROMPT)
    out: dict[str, Any] = {
        "inputs_differ": _error(lambda: pm.generate(inputs=mine, **GREEDY)),
        "temperature_differ": _error(
            lambda: pm.generate(same, max_new_tokens=4, do_sample=True, temperature=0.5 + mesh.rank)
        ),
        "max_new_tokens_differ": _error(lambda: pm.generate(same, max_new_tokens=3 + mesh.rank)),
        "greedy": pm.generate(inputs=same, **GREEDY),
        **outputs(pm.generate),
    }
    # a KV cache another parallel model filled, passed positionally (Llama's forward takes it
    # fourth: input_ids, attention_mask, position_ids, past_key_values)
    res = pm.generate(same, return_dict_in_generate=True, **GREEDY)
    other = tm.build("llama")
    fd.nn.parallelize(other, mesh)
    last = res.sequences[:, -1:]
    out["foreign_cache_positional"] = _error(lambda: other(last, None, None, res.past_key_values))
    # a model left in training mode with dropout: HF generate does not call eval()
    gpt = tm.build("gpt2", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    pmd = fd.nn.parallelize(gpt, mesh)
    gpt.train()
    out["dropout_generate"] = _error(lambda: pmd.generate(same, **GREEDY))
    out["dropout_direct"] = _error(lambda: gpt.generate(same, **GREEDY))
    return out
