"""Review of generation (`fastdist.nn.generate`): what used to come out silently wrong now equals
one device or raises at the first call. Simulated ranks: the hidden states ``generate`` returns,
a KV cache passed in, a model in training mode with dropout. Gloo processes
(`tests/review_generate_worker.py`): a prompt passed as ``inputs=`` that differs across the
ranks, rank-dependent generation settings, dropout in training mode, and the scores, logits and
hidden states against one device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache

import fastdist as fd
from fastdist.errors import ParallelizeError
from tests import tiny_models as tm
from tests.dist_harness import run_on_gloo
from tests.review_generate_worker import OUTPUTS, PROMPT, on_ranks, one_device, outputs


def _close(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.shape == want.shape, (path, got, want.shape)
        if want.dtype.is_floating_point:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=path)
        else:
            assert torch.equal(got, want), (path, got, want)
        return
    if isinstance(want, dict):
        for k in want:
            _close(got[k], want[k], f"{path}.{k}")
        return
    assert len(got) == len(want), (path, len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        _close(g, w, f"{path}[{i}]")


@pytest.mark.parametrize("use_cache", [None, False])
def test_simulated_hidden_states_equal_one_device(use_cache: bool | None) -> None:
    """output_hidden_states on simulated ranks: each step's hidden states are one device's (rank
    0's, checked equal on every rank), cut to the positions one device's step computes with its
    KV cache (the prompt, then one token); with use_cache=False every position, as on one
    device. The old code returned every rank's stacked, ``(2, 1, 6, 32)`` for ``(1, 6, 32)``,
    and every position at every step."""
    extra = {} if use_cache is None else {"use_cache": use_cache}
    want = outputs(lambda ids, **kw: tm.build("llama").generate(ids, **kw, **extra))
    model = tm.build("llama")
    pm = fd.nn.parallelize(model, fd.Mesh({"tp": 2}))
    got = outputs(lambda ids, **kw: pm.generate(ids, **kw, **extra))
    _close(got, want)
    assert want["hidden_states"][1][0].shape[-2] == (1 if use_cache is None else 7)


def test_simulated_generate_refuses_a_kv_cache() -> None:
    """past_key_values on simulated ranks: refused, naming the fix. The old code ran with an
    empty DynamicCache and gave a wrong last token (41 where one device gives 54), silently."""
    model = tm.build("llama")
    pm = fd.nn.parallelize(model, fd.Mesh({"tp": 2}))
    with pytest.raises(ParallelizeError, match="past_key_values=DynamicCache cannot be used"):
        pm.generate(torch.tensor(PROMPT), past_key_values=DynamicCache(), max_new_tokens=5)


def test_simulated_generate_refuses_assisted_generation() -> None:
    """Assisted generation on simulated ranks: a fastdist error naming the fix (was
    transformers' ValueError asking for use_cache=True, which is itself refused there)."""
    pm = fd.nn.parallelize(tm.build("llama"), fd.Mesh({"tp": 2}))
    with pytest.raises(ParallelizeError, match="prompt_lookup_num_tokens= .*real ranks"):
        pm.generate(torch.tensor(PROMPT), prompt_lookup_num_tokens=2, max_new_tokens=3)


def test_simulated_generate_refuses_dropout_in_training_mode() -> None:
    """A model left in training mode with dropout: refused at the start of generate."""
    gpt = tm.build("gpt2", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    pm = fd.nn.parallelize(gpt, fd.Mesh({"tp": 2}))
    gpt.train()
    with pytest.raises(ParallelizeError, match=r"ParallelModel.generate: .*model.eval\(\)"):
        pm.generate(torch.tensor(PROMPT), max_new_tokens=2)
    gpt.eval()
    assert pm.generate(torch.tensor(PROMPT), max_new_tokens=2).shape == (1, 8)


def test_generate_on_gloo_refuses_what_differs_across_ranks() -> None:
    """Real ranks (tp 2). Each of these ran silently before: a prompt passed as ``inputs=``
    (generate's own name) that differs across ranks was not compared (rank 1 got tokens no
    device gives for its prompt); a rank-dependent temperature sampled different tokens on the
    two ranks ([42, 48, 12, 2] and [42, 32, 12, 2]); a rank-dependent max_new_tokens hung the
    longer rank in a collective; dropout in training mode generated; a KV cache another parallel
    model filled, passed positionally (Llama's fourth argument), was taken as inputs_embeds and
    not refused. Now each raises at the
    first call, on every rank; equal inputs still give one device's tokens, scores, logits and
    hidden states."""
    want = one_device()
    for rank, got in enumerate(run_on_gloo(on_ranks, 2, timeout=240)):
        assert "token inputs differ" in got["inputs_differ"], (rank, got["inputs_differ"])
        for key in ("temperature_differ", "max_new_tokens_differ"):
            assert "generation arguments differ" in got[key], (rank, key, got[key])
        assert "another parallel model filled" in got["foreign_cache_positional"], rank
        for key in ("dropout_generate", "dropout_direct"):
            assert "training mode with dropout" in got[key], (rank, key, got[key])
        _close({k: got[k] for k in want}, want, f"rank {rank}")
    assert OUTPUTS["output_hidden_states"]
