"""Review of LLM context parallelism (`CausalContextParallel`) as a new user: cases that gave
wrong logits with no error, each now equal to one device (float64) or refused at the first call
naming the module and the fix."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fastdist as fd
from fastdist.errors import ParallelizeError
from fastdist.nn.styles.context_llm import CausalContextParallel, PvaryTree
from tests import tiny_models
from tests.tiny_models import VOCAB

pytest.importorskip("transformers")

TOL = {"rtol": 1e-9, "atol": 1e-10}


def ids(S: int = 16, B: int = 2, seed: int = 0) -> Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def rep(t: Tensor, mesh: fd.Mesh) -> Tensor:
    return t.expand(mesh.size, *t.shape)


def equal_or_refused(ref: Any, pm: Any, mesh: fd.Mesh, match: str, **kw: Tensor) -> None:
    """``pm``'s logits on every rank equal ``ref``'s, or the call raises naming ``match``."""
    want = ref(**kw, use_cache=False).logits.detach()
    try:
        got = pm(**{k: rep(v, mesh) for k, v in kw.items()}, use_cache=False).logits
    except ParallelizeError as e:
        assert match in str(e), e
        return
    torch.testing.assert_close(got, rep(want, mesh), **TOL)


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_a_bidirectional_config_equals_one_device_or_raises(mode: str) -> None:
    """transformers' ``config.is_causal=False`` (a decoder used bidirectionally, e.g. for
    embeddings) makes ``create_causal_mask`` build a bidirectional mask; the split attention
    stayed causal: logits 0.24 off with no error (found in review)."""
    ref = tiny_models.build("llama")
    ref.config.is_causal = False
    model = copy.deepcopy(ref)
    mesh = fd.Mesh({"cp": 2})
    plan = fd.nn.plans.plan(model, mesh, context_parallel=CausalContextParallel("cp", mode))
    pm = fd.nn.parallelize(model, mesh, plan)
    equal_or_refused(ref, pm, mesh, "is_causal=False", input_ids=ids())


def _by_hand(model: nn.Module) -> dict[str, Any]:
    """The plan the style's docstring describes, for a model without a ready plan: the style
    on the base model, `PvaryTree` on its decoder layers and final norm."""
    base: Any = model.model
    norm = next(n for n, _ in base.named_children() if "norm" in n)
    return {
        "model": CausalContextParallel("cp"),
        "model.layers.*": PvaryTree("cp"),
        f"model.{norm}": PvaryTree("cp"),
    }


def _hybrid(kind: str) -> Any:
    """A tiny float64 model whose decoder layers are not all causal full or sliding-window
    attention: LFM2's short convolutions (a Conv1d over the tokens, as in Mamba and gated
    delta nets), Llama 4's chunked attention."""
    import transformers

    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    if kind == "lfm2":
        cfg = transformers.Lfm2Config(**sizes, layer_types=["conv", "full_attention"])
        return transformers.Lfm2ForCausalLM(cfg).double().eval()
    cfg = transformers.Llama4TextConfig(
        **sizes,
        intermediate_size_mlp=48,
        head_dim=8,
        attention_chunk_size=4,  # layer 0 attends within chunks of 4 tokens
        interleave_moe_layer_step=0,
        moe_layers=[],
        attn_temperature_tuning=False,
        no_rope_layers=[1, 0],
    )
    return transformers.Llama4ForCausalLM(cfg).double().eval()


@pytest.mark.parametrize("kind", ["lfm2", "llama4"])
def test_a_hybrid_model_equals_one_device_or_raises(kind: str) -> None:
    """Decoder layers that mix tokens other than by causal full or sliding-window attention ran
    on the rank's tokens as if they were the whole sequence, or with the causal mask in place
    of their own, with no error (found in review; float64): LFM2's convolution layers 9e-5
    off, Llama 4's chunked attention 0.17 off. Refused at parallelize, naming what."""
    ref = _hybrid(kind)
    model = copy.deepcopy(ref)
    mesh = fd.Mesh({"cp": 2})
    try:
        pm = fd.nn.parallelize(model, mesh, _by_hand(model), verify=False)
    except ParallelizeError as e:
        what = {"lfm2": "['conv']", "llama4": "['chunked_attention']"}[kind]
        assert f"layer_types hold {what}" in str(e), e
        return
    equal_or_refused(ref, pm, mesh, "decoder layer 0", input_ids=ids())


class _ShortConv(nn.Module):
    """A causal depthwise Conv1d over the tokens before a layer's MLP (LFM2's and Mamba's
    short convolution, in a model whose config has no layer_types)."""

    def __init__(self, mlp: nn.Module, dim: int) -> None:
        super().__init__()
        self.mlp = mlp
        self.conv = nn.Conv1d(dim, dim, 3, groups=dim, padding=2, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        mixed = self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return self.mlp(x + mixed)


def test_a_convolution_over_the_tokens_equals_one_device_or_raises() -> None:
    """A Conv1d inside a decoder layer mixes neighbouring tokens, which the split does not
    exchange across ranks: a rank's first token saw zeros, not the tokens before it (found in
    review). Refused at parallelize, naming the module."""
    ref = tiny_models.build("llama")
    ref.model.layers[0].mlp = _ShortConv(ref.model.layers[0].mlp, 32)
    model = copy.deepcopy(ref)
    mesh = fd.Mesh({"cp": 2})
    try:
        pm = fd.nn.parallelize(model, mesh, _by_hand(model), verify=False)
    except ParallelizeError as e:
        assert "layers.0.mlp.conv is a Conv1d" in str(e), e
        return
    equal_or_refused(ref, pm, mesh, "Conv1d", input_ids=ids())


class _OwnAttention(nn.Module):
    """An attention that calls torch's SDPA itself, not transformers' registry (as custom and
    remote-code models do): it wraps a Llama attention and reuses its projections."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(
        self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor], **_: Any
    ) -> tuple[Tensor, None]:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        a = self.inner
        B, S, _h = hidden_states.shape
        q, k, v = (
            p(hidden_states).view(B, S, -1, a.head_dim).transpose(1, 2)
            for p in (a.q_proj, a.k_proj, a.v_proj)
        )
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a.o_proj(o.transpose(1, 2).reshape(B, S, -1)), None


def test_an_attention_outside_the_registry_equals_one_device_or_raises() -> None:
    """A decoder layer whose attention does not go through transformers' attention registry
    attended within the rank's tokens only: logits off with no error (found in review).
    Refused at the call, naming the layer."""
    ref = tiny_models.build("llama")
    ref.model.layers[0].self_attn = _OwnAttention(ref.model.layers[0].self_attn)
    model = copy.deepcopy(ref)
    mesh = fd.Mesh({"cp": 2})
    pm = fd.nn.parallelize(model, mesh, _by_hand(model), verify=False)
    equal_or_refused(ref, pm, mesh, "decoder layer 0 (LlamaDecoderLayer)", input_ids=ids())


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,cp,mode,bidirectional",
    [
        ("llama", 3, "ring", False),
        ("mistral", 2, "ulysses", False),
        ("mixtral", 2, "ring", False),  # the router's aux loss over the padding mask
        ("llama", 2, "ring", True),
    ],
)
def test_gloo_training_forward_equals_one_device_or_raises(
    family: str, cp: int, mode: str, bidirectional: bool
) -> None:
    """On gloo processes, a training forward as a user writes it (train mode, the KV cache at
    its default, a right-padded batch with an attention_mask, positions starting at 5, labels
    -100, cp = 3 and a sliding window of 3 tokens, shorter than a rank's chunk; Mixtral's
    load-balancing loss over the padding mask, which a simulation cannot run): the model's
    loss, logits and every gradient equal one device; a bidirectional config is refused on
    every rank."""
    from tests.dist_harness import run_on_gloo
    from tests.review_context_worker import on_ranks, one_device

    want = one_device(family, bidirectional)
    for got in run_on_gloo(on_ranks, cp, family, cp, mode, bidirectional, timeout=240):
        if bidirectional:
            assert "is_causal=False" in got.get("refused", ""), got.get("refused")
            continue
        assert "refused" not in got, got["refused"]
        torch.testing.assert_close(got["logits"], want["logits"], **TOL)
        torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-6, atol=1e-7)  # float32
        for name, g in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-6, atol=1e-8, msg=name)


@pytest.mark.slow
def test_gloo_ranks_given_different_batches_are_refused() -> None:
    """A data loader sharded over the context-parallel ranks too gives each rank its own
    batch: each cut its tokens out of its own batch, and the model's loss was a sequence
    stitched from several, with no error (found in review: 4.107 and 4.118 where the ranks'
    batches give 4.134 and 4.087). Refused at the first call, naming the fix."""
    from tests.dist_harness import run_on_gloo
    from tests.review_context_worker import rank_batches_on_ranks

    for got in run_on_gloo(rank_batches_on_ranks, 2, 2, timeout=240):
        assert "given other inputs on index 1 of the 'cp' group" in got.get("refused", ""), got
