"""Context parallelism of an HF decoder LLM on gloo processes: a training step and greedy
generation (prefill split over the sequence, decoding steps whole) equal one device."""

from __future__ import annotations

import pytest
import torch

from fastdist.testing import run_on_gloo
from tests.context_llm_worker import PROMPT, on_ranks, one_device

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "family,degrees,mode",
    [("llama", {"cp": 2}, "ring"), ("qwen3", {"cp": 2, "tp": 2}, "ulysses")],
)
def test_context_parallel_on_gloo_equals_one_device(
    family: str, degrees: dict[str, int], mode: str
) -> None:
    want = one_device(family)
    world = 1
    for n in degrees.values():
        world *= n
    tol = {"rtol": 1e-4, "atol": 1e-5} if family == "qwen3" else {"rtol": 1e-9, "atol": 1e-10}
    for rank, got in enumerate(run_on_gloo(on_ranks, world, family, degrees, mode, timeout=240)):
        torch.testing.assert_close(got["logits"], want["logits"], **tol)
        torch.testing.assert_close(got["loss"], want["loss"], **tol)
        assert got["grads"].keys() == want["grads"].keys(), set(want["grads"]) - set(got["grads"])
        for name, g in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, **tol, msg=lambda m, n=name: n)
        assert torch.equal(got["greedy"], want["greedy"]), rank
        # prefill: each rank's 8 / cp prompt tokens; then one token per step, whole
        assert got["layer_tokens"] == [len(PROMPT[0]) // degrees["cp"]] + [1] * 5, got
        # after the prefill every rank holds every token's keys (of its kv heads)
        assert got["cache_keys"][2] == len(PROMPT[0]) + 5, got["cache_keys"]
