"""Findings of a new user's review (review_g): each test compares a parallel model with the
unmodified model on one device in float64, or checks the refusal's type and message, and fails
on the code before the fix (a partial result returned silently, a raw error, a leak)."""

from __future__ import annotations

import copy

import pytest
import torch

import fastdist as fd
from fastdist.errors import ParallelizeError

pytest.importorskip("transformers")

IDS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 23]])


def _tiny(**kw: object) -> torch.nn.Module:
    from tests import tiny_models as tm

    return tm.build("llama", **kw)


# ============================================================== partial outputs of TP / SP plans
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("where", ["call", "config"])
def test_tp_plans_refuse_output_attentions(sp: bool, where: str) -> None:
    """Under a tensor-parallel plan each rank's attention weights are its heads only ((1, 2, 8,
    8) of the model's (1, 4, 8, 8)): refused at the call, asked by argument or by config."""
    model = _tiny(attn_implementation="eager")
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=sp))
    kw = {"output_attentions": True} if where == "call" else {}
    if where == "config":
        model.config.output_attentions = True
    with pytest.raises(ParallelizeError, match=r"output_attentions=True under the .*this rank's heads"):
        pm(input_ids=IDS.expand(2, *IDS.shape), **kw)


def test_sequence_parallel_refuses_output_hidden_states_tp_alone_gives_them_whole() -> None:
    """With sequence parallelism every layer's hidden states but the last are the rank's
    sequence half: refused, naming the plan; without it they equal one device's."""
    ref = _tiny().double()
    want = ref(input_ids=IDS, output_hidden_states=True).hidden_states
    mesh = fd.Mesh({"tp": 2})
    model = copy.deepcopy(ref)
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=True))
    with pytest.raises(ParallelizeError, match=r"output_hidden_states=True under the sequence-"):
        pm(input_ids=IDS.expand(2, *IDS.shape), output_hidden_states=True)
    assert pm(input_ids=IDS.expand(2, *IDS.shape)).logits.shape[:3] == (2, 1, 8)  # still runs
    model = copy.deepcopy(ref)
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh))
    got = pm(input_ids=IDS.expand(2, *IDS.shape), output_hidden_states=True).hidden_states
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g[0], w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g[1], w, rtol=1e-12, atol=1e-12)


# ============================================================== generate on simulated ranks
def test_simulated_generate_with_use_cache_false_equals_one_device() -> None:
    """``use_cache=False`` (what the simulation runs anyway) is taken, not a TypeError."""
    ref = _tiny()
    prompt = IDS[:, :5]
    want = ref.generate(prompt, max_new_tokens=3, do_sample=False, use_cache=False)
    model = copy.deepcopy(ref)
    pm = fd.nn.parallelize(model, fd.Mesh({"tp": 2}))
    got = pm.generate(prompt, max_new_tokens=3, do_sample=False, use_cache=False)
    assert got.tolist() == want.tolist()


# ============================================================== context parallelism: fixed caches
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("kind", ["static", "offloaded"])
def test_context_parallel_refuses_a_static_or_offloaded_cache_at_the_prefill(
    mode: str, kind: str
) -> None:
    """A static cache's update returns every slot, not the rank's tokens (a raw size error in
    the attention before): refused when the split prefill starts, with the fix."""
    from transformers import DynamicCache, StaticCache

    from fastdist.nn.styles.context_llm import CausalContextParallel

    model = _tiny()
    mesh = fd.Mesh({"cp": 2})
    plan = fd.nn.plans.plan(model, mesh, context_parallel=CausalContextParallel("cp", mode))
    pm = fd.nn.parallelize(model, mesh, plan)
    cache = (
        StaticCache(config=model.config, max_cache_len=16)
        if kind == "static"
        else DynamicCache(config=model.config, offloading=True)
    )
    with pytest.raises(ParallelizeError, match=r"cannot be filled by a split prefill.*dynamic"):
        pm(input_ids=IDS.expand(2, *IDS.shape), past_key_values=cache, use_cache=True)
