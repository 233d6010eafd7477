"""The model's OWN ``generate`` (``model.generate(...)`` on the module ``parallelize`` changed, not
``pm.generate``) sampling on real ranks whose random states differ (2 gloo processes, tp 2,
`tests/generate_real_sampling_worker.py`).

The old code compared each step's token inputs across the ranks, but the token sampled last is
fed to no forward, so it was never compared: with one new token, rank 0 returned
``[..., 17, 32]`` and rank 1 ``[..., 17, 26]``, silently. Now the model's own ``generate``
runs as ``pm.generate`` does on real ranks: every rank samples with the random state of its
group's first rank (one device's tokens with rank 0's seed, on every rank; the other ranks' own
random state is left as it was), and the prompt and settings are compared at the call (a
rank-dependent temperature sampled silently before when the ranks' seeds happened to agree)."""

from __future__ import annotations

import copy

import pytest
import torch

import fastdist as fd
from fastdist.errors import ParallelizeError
from tests import tiny_models as tm
from tests.dist_harness import run_on_gloo
from tests.generate_real_sampling_worker import PROMPT, SEED, on_ranks, one_device


def test_model_generate_samples_one_devices_tokens_on_every_rank() -> None:
    results = run_on_gloo(on_ranks, 2, timeout=240)
    for n in (1, 4):
        want = one_device(n)
        for rank, got in enumerate(results):
            tokens = got[f"tokens_{n}"]
            assert isinstance(tokens, torch.Tensor), (rank, n, tokens)
            assert torch.equal(tokens, want), (rank, n, tokens, want)
    # every rank's own random stream continues as if generate had drawn nothing on it except
    # on the group's first rank (whose stream advances as on one device)
    for rank, got in enumerate(results):
        for n in (1, 4):
            gen = torch.Generator().manual_seed(SEED + rank)
            if rank == 0:
                torch.manual_seed(SEED)
                one_device(n)
                gen.set_state(torch.get_rng_state())
            want = torch.rand(3, dtype=torch.float64, generator=gen)
            assert torch.equal(got[f"after_{n}"], want), (rank, n)
    for rank, got in enumerate(results):
        assert "generation arguments differ" in str(got["temperature_differ"]), (rank, got)
        assert "LlamaForCausalLM.generate on real ranks: the token inputs differ" in str(
            got["prompt_differ"]
        ), (rank, got["prompt_differ"])


def test_model_generate_on_a_simulated_mesh_names_pm_generate() -> None:
    """A simulated mesh: the model's own generate raises at the call, naming pm.generate."""
    model = tm.build("llama")
    fd.nn.parallelize(model, fd.Mesh({"tp": 2}))
    with pytest.raises(ParallelizeError, match=r"LlamaForCausalLM\.generate .*pm\.generate"):
        model.generate(torch.tensor(PROMPT), max_new_tokens=2, do_sample=True)


def test_deepcopy_of_a_parallel_model_generates_with_the_copy() -> None:
    """The model's own generate is an attribute holding the model: a deep copy's runs the copy
    (and the copy's hooks), not the original."""
    model = tm.build("llama")
    fd.nn.parallelize(model, fd.Mesh({"tp": 2}))
    twin = copy.deepcopy(model)
    assert twin.generate.model is twin and model.generate.model is model
    assert twin.generate.calls is not model.generate.calls
    with pytest.raises(ParallelizeError, match=r"pm\.generate"):
        twin.generate(torch.tensor(PROMPT), max_new_tokens=1)
