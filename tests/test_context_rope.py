"""Context parallelism with a rotary embedding whose tables depend on the largest position it is
given (transformers' ``"dynamic"`` NTK scaling and ``"longrope"``: Phi-3 128k, Phi-4-mini).

On a rank's own positions such an embedding builds other tables than one device's (the middle
chunks of the zig-zag layout see a smaller largest position), so `CausalContextParallel` gives
it the whole sequence's positions and cuts its tables. Every check compares against the
unmodified model on one device in float64; each fails on the old code (wrong logits on real
ranks, a refusal naming no cause on simulated ones).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import fastdist as fd
from fastdist.errors import ParallelizeError
from fastdist.nn.styles.context_llm import CausalContextParallel
from tests.dist_harness import run_on_gloo

#: rope_parameters by case; "longrope": original 10 positions and 12 tokens, so the whole
#: sequence is long (long factors) while rank 1's zig-zag chunks (positions 3-8) are short
ROPES = {
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 8, 16),
    "longrope": (
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 4,
            "long_factor": [3.0] * 4,
            "original_max_position_embeddings": 10,
        },
        10,
        12,
    ),
}


def build(rope: str, layers: int = 2) -> torch.nn.Module:
    """A tiny float64 Llama with the case's rotary embedding (random init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    params, positions, _ = ROPES[rope]
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
        max_position_embeddings=positions,
        rope_scaling={**params, "rope_theta": 10000.0},
    )
    return LlamaForCausalLM(cfg).double()


def tokens(rope: str, batch: int = 2) -> Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 64, (batch, ROPES[rope][2]), generator=g)


def parallel(model: torch.nn.Module, mesh: fd.Mesh, mode: str) -> fd.nn.ParallelModel:
    style = CausalContextParallel("cp", mode)  # type: ignore[arg-type]
    return fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, context_parallel=style))


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_simulated_logits_and_gradients_match_one_device(rope: str, mode: str) -> None:
    ref, model = build(rope), build(rope)
    mesh = fd.Mesh({"cp": 2})
    pm = parallel(model, mesh, mode)
    ids = tokens(rope)
    want = ref(input_ids=ids, labels=ids, use_cache=False)
    want.loss.backward()
    got = pm(input_ids=ids.expand(2, *ids.shape), labels=ids.expand(2, *ids.shape), use_cache=False)
    got.loss.sum().backward()
    torch.testing.assert_close(got.logits[1], want.logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.loss[0], want.loss, rtol=1e-12, atol=1e-12)
    full = dict(pm.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full[name].grad[0], p.grad, rtol=1e-9, atol=1e-12)


def test_dynamic_tables_follow_one_device_over_calls_of_several_lengths() -> None:
    """The dynamic embedding's cached frequencies grow and reset as on one device."""
    ref, model = build("dynamic").eval(), build("dynamic").eval()
    pm = parallel(model, fd.Mesh({"cp": 2}), "ring")
    g = torch.Generator().manual_seed(5)
    for length in (16, 8, 20, 4):
        ids = torch.randint(0, 64, (1, length), generator=g)
        want = ref(input_ids=ids, use_cache=False).logits
        got = pm(input_ids=ids.expand(2, 1, length), use_cache=False).logits
        torch.testing.assert_close(got[0], want, rtol=1e-12, atol=1e-12)


def test_simulated_generate_needs_use_cache_false_with_such_an_embedding() -> None:
    """Without a cache HF's dynamic embedding re-rotates earlier keys (other tokens than one
    device's cached generate): a simulated generate, which has no cache, refuses it unless
    asked for use_cache=False, and then equals one device's generate(use_cache=False)."""
    ref, model = build("dynamic").eval(), build("dynamic").eval()
    pm = parallel(model, fd.Mesh({"cp": 2}), "ring")
    ids = tokens("dynamic", batch=1)
    with pytest.raises(ParallelizeError, match="use_cache=False"):
        pm.generate(ids, max_new_tokens=3, do_sample=False)
    opts = dict(max_new_tokens=3, do_sample=False, use_cache=False)
    want = ref.generate(ids, output_logits=True, return_dict_in_generate=True, **opts)
    got = pm.generate(ids, output_logits=True, return_dict_in_generate=True, **opts)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits))


def gloo_ranks(rope: str, mode: str) -> tuple[Tensor, Tensor, Tensor]:
    mesh = fd.connect(cp=2)
    pm = parallel(build(rope).eval(), mesh, mode)
    logits = pm(input_ids=tokens(rope), use_cache=False).logits.detach()
    pm = parallel(build(rope).eval(), mesh, mode)  # fresh dynamic state, as the reference's
    out = pm.generate(
        tokens(rope),
        max_new_tokens=4,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return logits, out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("rope, mode", [("dynamic", "ulysses"), ("longrope", "ring")])
def test_gloo_logits_and_generate_match_one_device(rope: str, mode: str) -> None:
    want = build(rope).eval()(input_ids=tokens(rope), use_cache=False).logits
    gen = (
        build(rope)
        .eval()
        .generate(
            tokens(rope),
            max_new_tokens=4,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    )
    for logits, sequences, steps in run_on_gloo(gloo_ranks, 2, rope, mode, timeout=240):
        torch.testing.assert_close(logits, want.detach(), rtol=1e-12, atol=1e-12)
        assert torch.equal(sequences, gen.sequences)
        torch.testing.assert_close(steps, torch.stack(gen.logits), rtol=1e-12, atol=1e-12)


def test_pipeline_stages_get_one_devices_tables() -> None:
    """pp 2 x cp 2 (the pipeline tests' 16-token batch): every stage's base model gives its
    dynamic rotary embedding the whole positions; loss and gradients equal one device."""
    from tests.test_pipeline_context import check_step

    check_step(build("dynamic", layers=4), fd.Mesh({"pp": 2, "cp": 2}), "1f1b", mode="ring")
