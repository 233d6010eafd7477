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
    with pytest.raises(
        ParallelizeError, match=r"output_attentions=True under the .*this rank's heads"
    ):
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


# ============================================================== context parallelism: shared config
@pytest.mark.parametrize("logits", ["gathered", "split"])
def test_context_parallel_leaves_a_shared_config_alone(logits: str) -> None:
    """Two models from one config object: the context-parallel plan of one sets its attention
    function on its own copy (every module of it holding the config points to the copy), so the
    other, plain model still runs (it raised "belongs to no parallel model" before) and the
    parallel one still equals one device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastdist.nn.styles.context_llm import CausalContextParallel

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    plain = LlamaForCausalLM(cfg).double()
    other = LlamaForCausalLM(cfg).double()
    other.load_state_dict(plain.state_dict())
    want = plain(input_ids=IDS).logits
    mesh = fd.Mesh({"cp": 2})
    cp = CausalContextParallel("cp", logits=logits)  # type: ignore[arg-type]
    pm = fd.nn.parallelize(other, mesh, fd.nn.plans.plan(other, mesh, context_parallel=cp))
    assert cfg._attn_implementation == "sdpa"
    configs = {id(m.__dict__["config"]) for m in other.modules() if "config" in m.__dict__}
    assert configs == {id(other.config)} and other.config is not cfg
    torch.testing.assert_close(plain(input_ids=IDS).logits, want, rtol=0, atol=0)
    if logits == "gathered":
        got = pm(input_ids=IDS.expand(2, *IDS.shape)).logits
        torch.testing.assert_close(got[0], want, rtol=1e-12, atol=1e-12)


# ============================================================== DiT context parallelism: arguments
def test_dit_context_parallel_refuses_controlnet_residuals() -> None:
    """SD3's ControlNet residuals (a row per image token, added after each block) were added
    to the rank's tokens: a raw size error. Refused at the call, naming the argument; the same
    call without them still equals one device."""
    pytest.importorskip("diffusers")
    from tests import tiny_models as tm

    g = torch.Generator().manual_seed(1)
    x = {
        "hidden_states": torch.randn(1, 4, 2, 2, generator=g, dtype=torch.float64),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=g, dtype=torch.float64),
        "pooled_projections": torch.randn(1, 8, generator=g, dtype=torch.float64),
        "timestep": torch.tensor([500.0], dtype=torch.float64),
    }
    ctrl = [torch.randn(1, 4, 32, generator=g, dtype=torch.float64) for _ in range(2)]
    ref = tm.tiny_sd3()
    with torch.no_grad():
        want = ref(**x).sample
    mesh = fd.Mesh({"sp": 2})
    model = copy.deepcopy(ref)
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.sd3(model, mesh))
    rep = {k: v.expand(2, *v.shape) for k, v in x.items()}
    with torch.no_grad():
        got = pm(**rep).sample
        torch.testing.assert_close(got[0], want, rtol=1e-10, atol=1e-10)
        with pytest.raises(ParallelizeError, match=r"block_controlnet_hidden_states=.*Fix"):
            pm(**rep, block_controlnet_hidden_states=[c.expand(2, *c.shape) for c in ctrl])


def test_dit_context_parallel_refuses_ltx_per_token_timesteps() -> None:
    """LTX-Video's per-token timestep (batch, tokens) gave every rank every token's
    modulation: a raw size error. Refused; one timestep per sample ((batch, 1)) still runs."""
    pytest.importorskip("diffusers")
    from tests import tiny_models as tm

    ref = tm.tiny_ltx(layers=1)
    g = torch.Generator().manual_seed(1)
    x = {
        "hidden_states": torch.randn(1, 4, 4, generator=g, dtype=torch.float64),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=g, dtype=torch.float64),
        "encoder_attention_mask": torch.ones(1, 5, dtype=torch.float64),
    }
    size = {"num_frames": 4, "height": 1, "width": 1}
    per_sample = torch.tensor([[700.0]], dtype=torch.float64)
    with torch.no_grad():
        want = ref(**x, timestep=per_sample, **size).sample
    mesh = fd.Mesh({"sp": 2})
    model = copy.deepcopy(ref)
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.ltx_video(model, mesh))
    rep = {k: v.expand(2, *v.shape) for k, v in x.items()}
    with torch.no_grad():
        got = pm(**rep, timestep=per_sample.expand(2, 1, 1), **size).sample
        torch.testing.assert_close(got[0], want, rtol=1e-10, atol=1e-10)
        per_token = torch.rand(1, 4, generator=g, dtype=torch.float64) * 1000
        with pytest.raises(ParallelizeError, match=r"timestep=.*per token"):
            pm(**rep, timestep=per_token.expand(2, 1, 4), **size)


def test_context_parallel_refuses_hidden_states_asked_by_the_config() -> None:
    """The context-parallel plan refused ``output_hidden_states=True`` as an argument only; set
    in the config it returned the rank's tokens silently."""
    from fastdist.nn.styles.context_llm import CausalContextParallel

    model = _tiny()
    model.config.output_hidden_states = True
    mesh = fd.Mesh({"cp": 2})
    cp = CausalContextParallel("cp")
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, context_parallel=cp))
    with pytest.raises(ParallelizeError, match="output_hidden_states would return this rank"):
        pm(input_ids=IDS.expand(2, *IDS.shape))


def static_cache_on_ranks(impl: str, mode: str) -> str:
    """One gloo rank: ``pm.generate(cache_implementation=impl)`` under context parallelism; the
    error's type and message (or "ran")."""
    from fastdist.nn.styles.context_llm import CausalContextParallel

    mesh = fd.connect(cp=2)
    model = _tiny()
    cp = CausalContextParallel("cp", mode)  # type: ignore[arg-type]
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, context_parallel=cp))
    try:
        pm.generate(IDS, max_new_tokens=2, do_sample=False, cache_implementation=impl)
    except Exception as e:  # noqa: BLE001 - the type is what is checked
        return f"{type(e).__name__}: {e}"
    return "ran"


def test_context_parallel_generate_with_a_static_cache_on_gloo_is_refused() -> None:
    """The reviewer's path: generate on 2 gloo ranks with ``cache_implementation="static"`` (a
    raw RuntimeError of sizes 4 vs 10 inside the attention before)."""
    from tests.dist_harness import run_on_gloo

    for mode in ("ring", "ulysses"):
        for got in run_on_gloo(static_cache_on_ranks, 2, "static", mode, timeout=240):
            assert got.startswith("ParallelizeError"), got
            assert "StaticLayer" in got and "cannot be filled by a split prefill" in got, got
