"""``parallelize(..., verify=True)`` and the automatic plan (``family="auto"``, ``plan="auto"``).

Every model is built from a tiny config with random init in float64 (nothing downloaded) and run
on simulated ranks; results are compared with the same model on one device.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fastdist as fd
from tests import tiny_models
from tests.tiny_models import VOCAB as V

T = pytest.importorskip("transformers")

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}


def build(family: str) -> Any:
    """A tiny float64 model of ``family`` in eval mode."""
    return tiny_models.auto_zoo(family)


def ids(seed: int = 5) -> Tensor:
    return torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(seed))


def gathered_logits(logits: Tensor, mesh: fd.Mesh) -> Tensor:
    """Rank 0's tp group's vocabulary shards side by side, padding dropped."""
    n = mesh.axis_size("tp")
    return torch.cat([logits[mesh.rank_of({"tp": i})] for i in range(n)], -1)[..., :V]


def assert_matches_one_device(
    pm: Any, ref: nn.Module, mesh: fd.Mesh, tol: dict[str, float] = TOL
) -> None:
    x = ids()
    want = ref(input_ids=x).logits
    got = pm(input_ids=x.expand(mesh.size, *x.shape)).logits
    torch.testing.assert_close(gathered_logits(got, mesh), want, **tol)


def snapshot(model: nn.Module) -> dict[str, Any]:
    """What must be exactly as before after a refused plan."""
    return {
        "modules": {n: m for n, m in model.named_modules()},
        "params": {n: (p, p.detach().clone()) for n, p in model.named_parameters()},
        "dict": {n: dict(vars(m)) for n, m in model.named_modules()},
        "config": copy.deepcopy(model.config.to_dict()) if hasattr(model, "config") else None,
        "training": {n: m.training for n, m in model.named_modules()},
    }


def assert_unchanged(model: nn.Module, before: dict[str, Any]) -> None:
    now = dict(model.named_modules())
    assert now.keys() == before["modules"].keys()
    assert all(now[n] is m for n, m in before["modules"].items())
    for n, p in model.named_parameters():
        old, values = before["params"][n]
        assert p is old and (p.is_meta or torch.equal(p, values)), n
    for n, m in now.items():
        assert not m._forward_hooks and not m._forward_pre_hooks, n
        assert vars(m).keys() == before["dict"][n].keys(), n
        for k, v in vars(m).items():
            assert v is before["dict"][n][k] or v == before["dict"][n][k], (n, k)
        assert m.training == before["training"][n]
    if before["config"] is not None:
        assert model.config.to_dict() == before["config"]


# ============================================================================ verify
@pytest.mark.parametrize(
    ("family", "tp", "sp"),
    [("llama", 2, True), ("mistral", 2, False), ("qwen2", 4, False), ("qwen3", 2, True)]
    + [("gpt2", 2, True), ("mixtral", 2, False)],
)
def test_verify_accepts_every_ready_plan(family: str, tp: int, sp: bool) -> None:
    model = build(family)
    ref = copy.deepcopy(model)
    mesh = fd.Mesh({"ep": tp} if family == "mixtral" else {"tp": tp})
    plan = fd.nn.plans.plan(model, mesh, sequence_parallel=sp)
    pm = fd.nn.parallelize(model, mesh, plan, verify=True)
    if family == "mixtral":
        x = ids()
        got = pm(input_ids=x.expand(mesh.size, *x.shape)).logits
        cat = torch.cat([got[i] for i in range(tp)], -1)[..., :V]
        torch.testing.assert_close(cat, ref(input_ids=x).logits, **TOL)
    else:
        assert_matches_one_device(pm, ref, mesh)


READY = ["gemma", "gemma2", "gemma3", "phi3", "gpt_neox", "falcon", "falcon_new"]
READY += ["stablelm", "olmo", "olmo2", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"]


@pytest.mark.parametrize("family", READY)
def test_verify_accepts_the_other_ready_plans(family: str) -> None:
    """Every family's ready plan passes verify at tp=4 (2 kv heads: replicated over the ranks)
    and, where it has sequence parallelism, at tp=2 with it (tests/test_families.py checks
    the plans themselves against one device)."""
    for tp, sp in ((4, False), (2, True)):
        model = build(family)
        mesh = fd.Mesh({"tp": tp})
        try:
            plan = fd.nn.plans.plan(model, mesh, sequence_parallel=sp)
        except fd.nn.ParallelizeError as e:
            assert sp and "no sequence parallelism" in str(e)  # the MoE plans
            continue
        fd.nn.parallelize(model, mesh, plan, verify=True)


def _gpt2_without_split_size() -> tuple[Any, dict[str, Any], str]:
    model = build("gpt2")
    plan = fd.nn.plans.plan(model, family="gpt2")
    attn = plan["transformer.h.*.attn"]
    # the style is told split_size is not a width (keep=) and patches nothing: the forward
    # splits the fused projection by the whole model's width
    plan["transformer.h.*.attn"] = dataclasses.replace(attn, attrs=(), keep=("split_size",))
    return model, plan, r"'transformer\.h\.0\.attn' .*raised .*split_size"


def _llama_colwise_down() -> tuple[Any, dict[str, Any], str]:
    model = build("llama")
    plan = fd.nn.plans.plan(model, family="llama")
    plan["model.layers.*.mlp.down_proj"] = fd.nn.ColwiseParallel()  # its input is already split
    return model, plan, r"'model\.layers\.0\.mlp\.down_proj' \(ParallelLinear\) .*raised"


def _llama_wrong_scaling() -> tuple[Any, dict[str, Any], str]:
    model = build("llama")
    plan = fd.nn.plans.plan(model, family="llama")
    attn = plan["model.layers.*.self_attn"]
    # silently wrong: no exception, only other numbers
    plan["model.layers.*.self_attn"] = dataclasses.replace(
        attn, attrs=(("scaling", lambda hq, hkv, d: 1.0),)
    )
    return (
        model,
        plan,
        r"'model\.layers\.0\.self_attn\.o_proj' .*differs .*max \|difference\| \S+ .*"
        r"sets scaling per rank",
    )


def _llama_columns_in_parts() -> tuple[Any, dict[str, Any], str]:
    model = build("llama")
    plan = fd.nn.plans.plan(model, family="llama")
    # up_proj is not fused: splitting it as two parts gives each rank other columns than
    # gate_proj's, silently
    plan["model.layers.*.mlp.up_proj"] = fd.nn.ColwiseParallel(parts=(24, 24))
    return (
        model,
        plan,
        r"'model\.layers\.0\.mlp\.down_proj' \(ParallelLinear\) .*differs .*Its input already "
        r"differs .*Fix: check the styles of the layers that feed it",
    )


def _phi3_config_heads() -> tuple[Any, dict[str, Any], str]:
    model = build("phi3")
    # Phi-3 slices its fused q|k|v by self.config.num_attention_heads: keep= it whole
    plan = {
        "model.layers.*.self_attn": fd.nn.HeadParallelAttention(
            4, 2, 8, qkv="qkv_proj", keep=("num_attention_heads",)
        )
    }
    return model, plan, r"'model\.layers\.0\.self_attn.* reads .*self\.config\.num_attention_heads"


@pytest.mark.parametrize(
    "case",
    [
        _gpt2_without_split_size,
        _llama_colwise_down,
        _llama_wrong_scaling,
        _llama_columns_in_parts,
        _phi3_config_heads,
    ],
)
def test_verify_names_the_first_module_that_differs_and_leaves_the_model(case: Any) -> None:
    model, plan, message = case()
    before = snapshot(model)
    with pytest.raises(fd.nn.ParallelizeError, match=message) as info:
        fd.nn.parallelize(model, fd.Mesh({"tp": 2}), plan, verify=True)
    assert "The model was not changed" in str(info.value)
    assert_unchanged(model, before)
    # the same plan without verify: wrong (an exception or other logits), as verify said
    if case is _llama_wrong_scaling:
        ref = copy.deepcopy(model)
        pm = fd.nn.parallelize(model, fd.Mesh({"tp": 2}), plan)
        with pytest.raises(AssertionError):
            assert_matches_one_device(pm, ref, fd.Mesh({"tp": 2}))


def test_verify_runs_eval_copies_of_a_model_in_training_mode() -> None:
    model = build("gpt2")
    model.config.resid_pdrop = 0.0
    ref = copy.deepcopy(model)
    model.train()  # dropout on: verify compares eval-mode copies, the model stays in train mode
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, family="gpt2"), verify=True)
    assert model.training and model.transformer.h[0].attn.attn_dropout.training
    model.eval()
    assert_matches_one_device(pm, ref, mesh)


def test_verify_takes_example_inputs_as_a_dict_or_a_callable() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).to(F64)
    mesh = fd.Mesh({"tp": 2})
    good = {"0": fd.nn.ColwiseParallel(input="replicated"), "2": fd.nn.RowwiseParallel()}
    bad = {"0": fd.nn.RowwiseParallel(), "2": fd.nn.ColwiseParallel(input="replicated")}
    x = torch.randn(3, 4, dtype=F64)
    with pytest.raises(fd.nn.ParallelizeError, match="takes no input_ids.*Fix: pass the example"):
        fd.nn.parallelize(copy.deepcopy(mlp), mesh, good, verify=True)
    before = snapshot(mlp)
    # the activation between the layers sees the row layer's summed output; the column
    # layer's output differs from one device
    with pytest.raises(fd.nn.ParallelizeError, match=r"'0' \(ParallelLinear\)|'2'|'1'|the model"):
        fd.nn.parallelize(mlp, mesh, bad, verify={"input": x})
    assert_unchanged(mlp, before)
    ref = copy.deepcopy(mlp)
    pm = fd.nn.parallelize(mlp, mesh, good, verify=lambda m: {"input": x})
    torch.testing.assert_close(pm(x.expand(2, 3, 4))[1], ref(x), **TOL)
    with pytest.raises(fd.nn.ParallelizeError, match="itself raised on the example inputs"):
        fd.nn.parallelize(copy.deepcopy(ref), mesh, good, verify={"input": torch.randn(3, 5)})


def test_verify_a_meta_model_on_a_small_model_of_its_family() -> None:
    cfg = T.LlamaConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.device("meta"):
        model = T.LlamaForCausalLM(cfg)
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, family="llama"), verify=True)
    assert pm.module.model.layers[5].mlp.up_proj.weight.is_meta  # still on meta: checked only
    with torch.device("meta"):
        model = T.LlamaForCausalLM(cfg)
    before = snapshot(model)
    plan = fd.nn.plans.plan(model, family="llama")
    plan["model.layers.*.self_attn"] = dataclasses.replace(
        plan["model.layers.*.self_attn"], attrs=(("scaling", lambda hq, hkv, d: 1.0),)
    )
    with pytest.raises(fd.nn.ParallelizeError, match=r"self_attn\.o_proj.*differs"):
        fd.nn.parallelize(model, mesh, plan, verify=True)
    assert_unchanged(model, before)
    with pytest.raises(fd.nn.ParallelizeError, match="does not fit the small LlamaForCausalLM"):
        fd.nn.parallelize(
            model, mesh, {"model.layers.5.mlp": fd.nn.PrepareInput("tp")}, verify=True
        )
    with torch.device("meta"):
        plain = nn.Linear(4, 8)
    with pytest.raises(fd.nn.ParallelizeError, match="no transformers config"):
        fd.nn.parallelize(plain, mesh, {"": fd.nn.ColwiseParallel(input="replicated")}, verify=True)


def test_small_config_keeps_heads_and_shrinks_the_rest() -> None:
    cfg = T.Gemma2Config(num_hidden_layers=26, vocab_size=256000, intermediate_size=9216)
    small = fd.nn.verify.small_config(cfg, fd.Mesh({"tp": 4}))
    assert (small.num_hidden_layers, small.vocab_size, small.intermediate_size) == (2, 128, 32)
    assert small.layer_types == cfg.layer_types[:2]
    assert (small.num_attention_heads, small.head_dim, small.hidden_size) == (
        cfg.num_attention_heads,
        cfg.head_dim,
        cfg.hidden_size,
    )
    assert cfg.num_hidden_layers == 26  # the model's own config untouched


# ============================================================================ auto
#: family -> None (auto's plan verifies and matches one device) or the refusal it gives
AUTO: dict[str, str | None] = {
    "llama": None,
    "mistral": None,
    "qwen2": None,
    "qwen3": None,
    "gemma": None,
    "gemma2": None,
    "phi3": None,
    "gpt_neox": None,
    "gpt2": None,
    "falcon": None,  # multi-query, fused [q | k | v]
    "falcon_new": None,  # new decoder architecture, q/k/v grouped per kv head
    "stablelm": None,
    "olmo": None,
    "olmo2": None,
    "mixtral": None,
    "qwen2_moe": None,
    "gemma3": None,
    "qwen3_moe": None,
    "olmoe": None,  # full-width q/k norms too
    "gpt_oss": None,  # attention sinks split with the heads; transposed, biased experts
    # q|k|v fused in 4 model-parallel groups (mp_num): neither [q | k | v], per head nor per
    # kv group, so no candidate verifies
    "codegen": r"'transformer\.h\.0\.attn' \(CodeGenAttention\) .*raised RuntimeError",
    # ALiBi slopes computed for all heads inside the attention
    "bloom": r"'transformer\.h\.0\.self_attention' \(BloomAttention\) .*raised RuntimeError",
    # fc1/fc2 sit in the decoder layer itself, beside the attention
    "opt": r"no MLP found in model\.decoder\.layers\.0",
    # MLA: low-rank q and kv projections
    "deepseek_v3": r"no attention found in model\.layers\.0 .*q_a_proj",
}


MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")


@pytest.mark.parametrize("family", list(AUTO))
def test_auto_plan_per_family(family: str) -> None:
    """The table: at tp=2 each family works or is refused as AUTO says; those that work also
    work at tp=4 (2 kv heads: replicated) and, without experts, at tp=2 with sequence
    parallelism."""
    refusal = AUTO[family]
    if refusal is not None:
        model = build(family)
        before = snapshot(model)
        with pytest.raises(fd.nn.ParallelizeError, match=refusal):
            fd.nn.parallelize(model, fd.Mesh({"tp": 2}), "auto")
        assert_unchanged(model, before)
        return
    # OLMo-2's and OLMoE's q/k norms compute their statistics in float32 (the model's own
    # upcast): the sum over ranks rounds differently from one sum
    tol = {"rtol": 1e-6, "atol": 1e-6} if family in ("olmo2", "olmoe") else TOL
    for tp, sp in ((2, False), (4, False), (2, True)):
        if sp and family in MOE_FAMILIES:
            continue
        model = build(family)
        ref = copy.deepcopy(model)
        mesh = fd.Mesh({"tp": tp})
        if sp:
            plan = fd.nn.plans.plan(model, family="auto", sequence_parallel=True)
            pm = fd.nn.parallelize(model, mesh, plan, verify=True)
        else:
            pm = fd.nn.parallelize(model, mesh, "auto")
        assert_matches_one_device(pm, ref, mesh, tol)


def test_auto_finds_the_pieces() -> None:
    plan = fd.nn.plans.plan(build("phi3"), family="auto")
    attn = plan["model.layers.*.self_attn"]
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.qkv) == (4, 2, 8, "qkv_proj")
    assert plan["model.layers.*.mlp.gate_up_proj"].parts == (48, 48)  # fused gate|up
    assert plan["model.embed_tokens"] == fd.nn.VocabParallel("tp")
    plan = fd.nn.plans.plan(build("qwen2_moe"), family="auto")
    assert isinstance(plan["model.layers.*.mlp.shared_expert.down_proj"], fd.nn.RowwiseParallel)
    assert plan["model.layers.*.mlp.experts"].axis == "tp"
    assert "model.layers.*.mlp.gate" not in plan  # the router stays replicated
    plan = fd.nn.plans.plan(build("olmo2"), family="auto")
    assert plan["model.layers.*.self_attn"].full_width_norms == (("q_norm", "q"), ("k_norm", "k"))


def test_auto_keeps_the_first_candidate_that_verifies() -> None:
    """Falcon's new decoder fuses q|k|v per kv group: the first guess ([q | k | v]) is wrong,
    and only verification tells."""
    model = build("falcon_new")
    ref = copy.deepcopy(model)
    mesh = fd.Mesh({"tp": 2})
    where = "transformer.h.*.self_attention"
    plan = fd.nn.plans.plan(model, family="auto")
    assert plan[where].qkv_layout == "concat"  # the first guess, unchecked
    assert [c[where].qkv_layout for c in plan.candidates] == ["concat", "grouped"]
    unchecked = fd.nn.parallelize(copy.deepcopy(model), mesh, "auto", verify=False)
    with pytest.raises(AssertionError):
        assert_matches_one_device(unchecked, ref, mesh)
    with pytest.raises(fd.nn.ParallelizeError, match="self_attention"):
        fd.nn.parallelize(copy.deepcopy(model), mesh, dict(plan), verify=True)  # concat alone
    pm = fd.nn.parallelize(model, mesh, "auto")
    assert pm.plan[where].qkv_layout == "grouped"
    assert_matches_one_device(pm, ref, mesh)


def test_auto_with_sequence_parallelism_and_replicated_kv_heads() -> None:
    for family, tp, sp in (("gemma2", 2, True), ("falcon_new", 2, True), ("stablelm", 4, False)):
        model = build(family)
        ref = copy.deepcopy(model)
        mesh = fd.Mesh({"tp": tp})
        plan = fd.nn.plans.plan(model, family="auto", sequence_parallel=sp)
        assert any(isinstance(s, fd.nn.SequenceShard) for s in plan.values()) == sp
        pm = fd.nn.parallelize(model, mesh, plan, verify=True)
        assert_matches_one_device(pm, ref, mesh)
    with pytest.raises(fd.nn.ParallelizeError, match="experts .*no sequence parallelism"):
        fd.nn.plans.plan(build("mixtral"), family="auto", sequence_parallel=True)


def test_auto_refuses_a_model_without_blocks_and_a_bad_plan_string() -> None:
    mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    with pytest.raises(fd.nn.ParallelizeError, match="no list of repeated blocks"):
        fd.nn.plans.plan(mlp, family="auto")
    with pytest.raises(fd.nn.ParallelizeError, match="no ready-made plan for .*'nonesuch'"):
        fd.nn.parallelize(mlp, fd.Mesh({"tp": 2}), "nonesuch")


# ============================================================================ real processes
def test_verify_and_auto_on_two_gloo_processes() -> None:
    """Real ranks: each compares its own blocks, and the ranks agree on the verdict."""
    from tests.dist_harness import run_on_gloo
    from tests.verify_worker import verify_on_gloo

    (layout0, msg0), (layout1, msg1) = run_on_gloo(verify_on_gloo, 2, timeout=300)
    assert layout0 == layout1 == "'grouped'"  # the second candidate, as on simulated ranks
    assert msg0 == msg1  # the same error on every rank
    assert re.search(r"'model\.layers\.0\.self_attn\.o_proj' .*differs .*on rank [01]", msg0)
