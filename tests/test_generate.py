"""Generation with a parallel model equals the unmodified model's on one device: greedy, beam
search, sampling, a left-padded batch with a stop token, on gloo processes and simulated
ranks; what cannot be right raises (`fastdist.nn.generate`)."""

from __future__ import annotations

import pytest
import torch

import fastdist as fd
from fastdist.errors import ParallelizeError
from tests import tiny_models as tm
from tests.dist_harness import run_on_gloo
from tests.generate_worker import CASES, PROMPT, on_ranks, one_device, run_case


@pytest.mark.parametrize(
    "family,degrees,sp",
    [
        ("llama", {"tp": 4}, False),
        ("qwen3", {"tp": 2}, False),
        ("mixtral", {"tp": 2}, False),
        ("llama", {"tp": 4}, True),
        ("qwen3", {"tp": 2}, True),
        ("qwen3", {"tp": 4}, True),
        ("mixtral", {"tp": 2}, True),
        ("mixtral", {"tp": 4}, False),
    ],
)
def test_generate_on_gloo_equals_one_device(family: str, degrees: dict[str, int], sp: bool) -> None:
    want = one_device(family)
    world = degrees["tp"]
    ranks = run_on_gloo(on_ranks, world, family, degrees, sp, timeout=240)
    kv = tm.config(family).num_key_value_heads
    for rank, got in enumerate(ranks):
        for name in CASES:
            assert got[name] == want[name], (rank, name)
        assert got["direct_greedy"] == want["greedy"], rank
        # the KV cache holds this rank's kv heads only
        assert got["cache_keys"][1] == max(kv // world, 1), got["cache_keys"]
        assert "another parallel model filled" in got["foreign_cache"], got["foreign_cache"]
        # sampling through the model's own generate with unequal random states: every rank
        # draws rank 0's tokens (the last one included), one device's
        assert got["direct_sample"] == [want["sample"][0][: len(PROMPT[0]) + 3]], rank


def test_generate_on_simulated_ranks_equals_one_device() -> None:
    want = one_device("llama")
    model = tm.build("llama")
    pm = fd.nn.parallelize(model, fd.Mesh({"tp": 2}))
    for name, gen in CASES.items():
        assert run_case(pm.generate, "llama", gen).tolist() == want[name], name
    # the model itself cannot run outside the simulation: a clear error naming pm.generate
    with pytest.raises(ParallelizeError, match=r"pm\.generate"):
        model.generate(torch.tensor(PROMPT), max_new_tokens=2)
    with pytest.raises(ParallelizeError, match="use_cache=True"):
        pm.generate(torch.tensor(PROMPT), max_new_tokens=2, use_cache=True)
    # ParallelModel's own calls still give each rank its share of the vocabulary
    logits = pm(input_ids=torch.tensor(PROMPT).expand(2, 1, 5)).logits
    assert logits.shape[-1] == 31  # the 61 tokens padded to 62, over 2 ranks


def test_generate_refuses_a_model_without_generate() -> None:
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    plan = {"0": fd.nn.ColwiseParallel(input="replicated"), "1": fd.nn.RowwiseParallel()}
    pm = fd.nn.parallelize(mlp, fd.Mesh({"tp": 2}), plan)
    with pytest.raises(ParallelizeError, match="no generate method"):
        pm.generate(torch.zeros(1, 4))


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "gemma2"])
def test_generate_sequence_parallel_on_simulated_ranks_equals_one_device(family: str) -> None:
    """Megatron sequence parallelism: a step whose tokens divide the ranks runs split, the others
    on the whole sequence on every rank (fastdist.nn.styles.whole_sequence); outside generate a
    length that does not divide is still refused (training must pad). Gemma 2: its left-padded
    row is NaN on one device (fully masked padding); the ranks' equal NaNs are not a mismatch."""
    want = one_device(family)
    model = tm.build(family)
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=True))
    for name, gen in CASES.items():
        assert run_case(pm.generate, family, gen).tolist() == want[name], (family, name)
    with pytest.raises(ParallelizeError, match="does not divide by the 2 ranks"):
        pm(input_ids=torch.tensor(PROMPT).expand(2, 1, 5))


@pytest.mark.parametrize("degrees,mode", [({"cp": 2}, "ring"), ({"cp": 2, "tp": 2}, "ulysses")])
def test_generate_context_parallel_on_simulated_ranks_equals_one_device(
    degrees: dict[str, int], mode: str
) -> None:
    """A context-parallel plan generates one device's tokens: a step whose length divides by
    2 x cp runs split, the others whole (no KV cache on simulated ranks)."""
    want = one_device("llama")
    model = tm.build("llama")
    mesh = fd.Mesh(degrees)
    cp = fd.nn.styles.context_llm.CausalContextParallel("cp", mode)
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, context_parallel=cp))
    for name, gen in CASES.items():
        assert run_case(pm.generate, "llama", gen).tolist() == want[name], name
    # outside generate, a length the zig-zag chunks do not divide is refused, not run whole
    with pytest.raises(ParallelizeError, match="zigzag layout"):
        pm(input_ids=torch.tensor(PROMPT).expand(mesh.size, 1, 5))


def test_generate_refuses_logits_it_cannot_gather() -> None:
    """A plan that splits an output head generation cannot gather (here: the model does not
    name it as its output embeddings) raises at the first step, naming the fix, instead of
    taking the argmax of each rank's shard."""
    model = tm.build("llama")
    mesh = fd.Mesh({"tp": 2})
    plan = fd.nn.plans.plan(model, mesh)
    model.get_output_embeddings = lambda: None  # type: ignore[method-assign]
    pm = fd.nn.parallelize(model, mesh, plan)
    with pytest.raises(ParallelizeError, match=r"logits have 31 columns, not the vocabulary's 61"):
        pm.generate(torch.tensor(PROMPT), max_new_tokens=2)


@pytest.mark.parametrize("family", ["qwen3", "mixtral"])
@pytest.mark.parametrize("sp", [False, True])
def test_generate_at_tp4_on_simulated_ranks_equals_one_device(family: str, sp: bool) -> None:
    """Qwen3 and Mixtral at tp 4 (one kv head per two ranks), with and without sequence
    parallelism: every case equals one device."""
    want = one_device(family)
    model = tm.build(family)
    mesh = fd.Mesh({"tp": 4})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=sp))
    for name, gen in CASES.items():
        assert run_case(pm.generate, family, gen).tolist() == want[name], (family, sp, name)
