"""Context parallelism of an HF decoder LLM on gloo processes: a training step and greedy
generation (prefill split over the sequence, decoding steps against the split KV cache; the
sliding-window families' caches gathered) equal one device; mixture-of-experts training."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.context_llm_worker import (
    PROMPT,
    moe_on_ranks,
    moe_one_device,
    on_ranks,
    one_device,
    one_device_generations,
    split_logits_on_ranks,
    split_one_device,
)
from tests.dist_harness import run_on_gloo

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "family,degrees,mode,others",
    [
        ("llama", {"cp": 2}, "ring", ("mistral", "gemma2", "llama")),
        ("qwen3", {"cp": 2, "tp": 2}, "ulysses", ()),
    ],
)
def test_context_parallel_on_gloo_equals_one_device(
    family: str, degrees: dict[str, int], mode: str, others: tuple[str, ...]
) -> None:
    """A training step and greedy generation; with ``others``, greedy and left-padded generation
    of those families (Mistral and Gemma 2 with sliding-window KV caches)."""
    want = one_device(family)
    want_gen = {other: one_device_generations(other) for other in others}
    if "gemma2" in want_gen:
        # one device's eager Gemma 2 gives NaN logits for a left-padded row (its fully masked
        # padding queries), so its padded tokens are no reference
        del want_gen["gemma2"]["padded"]
    world = 1
    for n in degrees.values():
        world *= n
    tol = {"rtol": 1e-4, "atol": 1e-5} if family == "qwen3" else {"rtol": 1e-9, "atol": 1e-10}
    ranks = run_on_gloo(on_ranks, world, family, degrees, mode, others, timeout=240)
    for rank, got in enumerate(ranks):
        for other, cases in want_gen.items():
            for case, tokens in cases.items():
                assert torch.equal(got["others"][other][case], tokens), (rank, other, case)
        torch.testing.assert_close(got["logits"], want["logits"], **tol)
        torch.testing.assert_close(got["loss"], want["loss"], **tol)
        assert got["grads"].keys() == want["grads"].keys(), set(want["grads"]) - set(got["grads"])
        for name, g in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, **tol, msg=lambda m, n=name: n)
        assert torch.equal(got["greedy"], want["greedy"]), rank
        assert torch.equal(got["direct_greedy"], want["greedy"]), rank  # model.generate itself
        torch.testing.assert_close(got["gen_logits"], want["gen_logits"], **tol)
        # prefill: each rank's 8 / cp prompt tokens; then one token per step, on every rank
        assert got["layer_tokens"] == [len(PROMPT[0]) // degrees["cp"]] + [1] * 5, got
        # the cache stays split: each rank holds its 8 / cp prompt tokens' keys (of its kv
        # heads) and the 5 decoded tokens' (each step attends over every rank's shard)
        assert got["cache_keys"][2] == len(PROMPT[0]) // degrees["cp"] + 5, got["cache_keys"]


@pytest.mark.parametrize(
    "family,degrees,mode",
    [("mixtral", {"cp": 2}, "ring"), ("qwen3_moe", {"cp": 2, "ep": 2}, "ulysses")],
)
def test_mixture_of_experts_context_parallel_on_gloo_equals_one_device(
    family: str, degrees: dict[str, int], mode: str
) -> None:
    """Mixtral with its experts over cp itself (each rank's tokens to their experts' ranks,
    ragged all-to-all), Qwen3-MoE with experts and heads over ep: the model's loss with the
    router's aux loss, and every gradient, equal one device; so does greedy generation (the
    prefill split, decoding against the split KV cache)."""
    want = moe_one_device(family)
    world = 1
    for n in degrees.values():
        world *= n
    tol = {"rtol": 1e-5, "atol": 1e-6}  # transformers' aux loss is float32
    for rank, got in enumerate(run_on_gloo(moe_on_ranks, world, family, degrees, mode)):
        torch.testing.assert_close(got["aux"], want["aux"], **tol, msg=lambda m, r=rank: f"{r} {m}")
        torch.testing.assert_close(got["loss"], want["loss"].to(got["loss"].dtype), **tol)
        assert got["grads"].keys() == want["grads"].keys()
        for name, g in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, **tol, msg=lambda m, n=name: n)
        assert torch.equal(got["greedy"], want["greedy"]), rank


def _continue(generate: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens of `PROMPT`, then a second ``generate`` continuing from the returned cache
    (``past_key_values=``): its tokens and its steps' logits."""
    first = generate(
        torch.tensor(PROMPT), max_new_tokens=3, do_sample=False, return_dict_in_generate=True
    )
    more = generate(
        first.sequences,
        past_key_values=first.past_key_values,
        max_new_tokens=2,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return more.sequences, torch.stack(more.logits)


def continue_on_ranks(cache: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank of cp = 2 (ring): `_continue` through ParallelModel.generate."""
    import fastdist as fd
    from fastdist.nn.styles.context_llm import CausalContextParallel
    from tests import tiny_models as tm

    mesh = fd.connect(cp=2)
    model = tm.build("llama")
    cp = CausalContextParallel("cp", "ring", cache=cache)  # type: ignore[arg-type]
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, context_parallel=cp))
    return _continue(pm.generate)


@pytest.mark.parametrize("cache", ["split", "gathered"])
def test_continuing_generate_from_a_returned_cache_on_gloo(cache: str) -> None:
    """transformers' generate continuing from a returned cache feeds the tokens past its
    ``get_seq_length()``: a split cache (each rank its share of the prompt) reports the tokens
    on all ranks, so the continuation's tokens and logits equal one device's (it fed cached
    tokens again, at wrong positions, when the cache reported this rank's count); so do a
    gathered cache's."""
    from tests import tiny_models as tm

    want_tokens, want_logits = _continue(tm.build("llama").generate)
    for tokens, logits in run_on_gloo(continue_on_ranks, 2, cache, timeout=240):
        assert torch.equal(tokens, want_tokens), (tokens, want_tokens)
        torch.testing.assert_close(logits, want_logits, rtol=1e-9, atol=1e-10)


#: 6 tokens whose last bigram repeats: prompt lookup proposes 2 candidates, the first target
#: forward runs 8 tokens (split over cp = 2) and rejects them (a crop of the cache)
LOOKUP = [[3, 5, 7, 3, 5, 7]]


def assisted_on_ranks(cache: str) -> torch.Tensor | str:
    """One rank of cp = 2 (ring): prompt-lookup generation of `LOOKUP`; the tokens, or the
    error that refused it."""
    import fastdist as fd
    from fastdist.errors import ParallelizeError
    from fastdist.nn.styles.context_llm import CausalContextParallel
    from tests import tiny_models as tm

    mesh = fd.connect(cp=2)
    model = tm.build("llama")
    cp = CausalContextParallel("cp", "ring", cache=cache)  # type: ignore[arg-type]
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, context_parallel=cp))
    try:
        return pm.generate(
            torch.tensor(LOOKUP), prompt_lookup_num_tokens=2, max_new_tokens=6, do_sample=False
        )
    except ParallelizeError as e:
        return str(e)


def test_assisted_generation_refuses_a_split_cache_on_gloo() -> None:
    """Prompt-lookup generation rolls rejected candidates back with the cache's ``crop``: a split
    cache (its prefill of prompt and candidates split over the ranks) refuses it on every rank,
    naming cache="gathered"; with cache="gathered" the tokens equal one device's greedy ones."""
    from tests import tiny_models as tm

    want = tm.build("llama").generate(torch.tensor(LOOKUP), max_new_tokens=6, do_sample=False)
    for got in run_on_gloo(assisted_on_ranks, 2, "split", timeout=240):
        assert isinstance(got, str) and "crop(-2)" in got and 'cache="gathered"' in got, got
    for got in run_on_gloo(assisted_on_ranks, 2, "gathered", timeout=240):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), (got, want)


@pytest.mark.parametrize(
    "family,degrees,mode",
    [("llama", {"cp": 2}, "ring"), ("qwen3", {"cp": 2, "tp": 2}, "ulysses")],
)
def test_split_logits_on_gloo_equal_one_device(
    family: str, degrees: dict[str, int], mode: str
) -> None:
    """CausalContextParallel(logits='split') on real ranks: each rank's logits are its zig-zag
    chunks of one device's, the loss (left padding, ignored labels uneven over the shards) and
    every gradient are one device's."""
    want = split_one_device(family)
    world = 1
    for n in degrees.values():
        world *= n
    tol = {"rtol": 1e-4, "atol": 1e-5} if family == "qwen3" else {"rtol": 1e-9, "atol": 1e-10}
    n = degrees["cp"]
    chunks = want["logits"].chunk(2 * n, 1)
    ranks = run_on_gloo(split_logits_on_ranks, world, family, degrees, mode, timeout=240)
    for got in ranks:
        c = got["cp_rank"]
        mine = torch.cat([chunks[c], chunks[2 * n - 1 - c]], 1)
        torch.testing.assert_close(got["logits"], mine, **tol)
        torch.testing.assert_close(got["loss"], want["loss"], **tol)
        assert got["grads"].keys() == want["grads"].keys()
        for name, g in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, **tol, msg=lambda m, n=name: n)
