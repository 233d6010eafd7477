"""The ready plans for the mixture-of-experts families (the MoE rows of fastdist.nn.plans) against
one device, in float64 on simulated ranks: logits, the loss with the router's aux loss where the
model adds it, every gradient, and two AdamW steps, over tp, ep and ep x tp. Tiny configs: hidden
32, 2 layers, 4 experts, vocabulary 61 (padded)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import fastdist as fd
from tests import tiny_models
from tests.test_hf_models import VOCAB, batch, full_logits, rep

transformers = pytest.importorskip("transformers")

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss"]
MESHES = [{"tp": 2}, {"tp": 4}, {"ep": 2}, {"ep": 2, "tp": 2}]  # tp=4: 2 kv heads replicated
#: the families test_every_family_on_two_gloo_processes loads from save_pretrained output (all:
#: one tensor per expert read through fd.checkpoint.hf.fused_experts, GPT-OSS's fused as saved)
LOADS_SAVE_PRETRAINED = tuple(FAMILIES)
#: model_type -> the family's name in docs/models.md's table
NAMES = {
    "mixtral": "Mixtral",
    "qwen2_moe": "Qwen2-MoE",
    "qwen3_moe": "Qwen3-MoE",
    "olmoe": "OLMoE",
    "deepseek_v2": "DeepSeek-V2",
    "deepseek_v3": "DeepSeek-V3",
    "gpt_oss": "GPT-OSS",
}


def build(family: str, seed: int = 0) -> Any:
    """A small single-device model of ``family`` in float64, eval mode, eager experts; the
    parameters some inits leave zero (routers, biases, sinks) drawn at random."""
    return tiny_models.build(family, seed=seed, fill_zeros=True)


@contextlib.contextmanager
def float64_inside(family: str) -> Iterator[None]:
    """DeepSeek's routers and OLMoE's and Qwen3-MoE's q/k norms compute in float32 even in a
    float64 model (``hidden_states.type(torch.float32)``, ``.to(torch.float32)``): inside this
    block ``torch.float32`` is float64 for them, on both sides, so that everything must agree to
    1e-10 (test_float32_inside_float64_models: as shipped)."""
    if not (family.startswith("deepseek") or family in ("olmoe", "qwen3_moe")):
        yield
        return
    f32 = torch.float32
    torch.float32 = torch.float64  # type: ignore[misc]
    try:
        yield
    finally:
        torch.float32 = f32  # type: ignore[misc]


def weights_tolerance(family: str) -> dict[str, float]:
    """The weights after AdamW steps: 1e-10, but DeepSeek-V2's rotary embedding runs in complex64
    (``xq.float()``) on both sides, so the gradients of the rope features carry float32 rounding
    (~1e-7 relative; within 1e-10 absolute here), and AdamW's update lr * m / sqrt(v) is
    scale-free: the weights after two steps agree to lr * 1e-7."""
    return {"rtol": 1e-6, "atol": 1e-8} if family == "deepseek_v2" else TOL


def reference(model: Any, ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """(logits, loss, aux_loss) on one device; the cross-entropy in float64."""
    out = model(input_ids=ids)
    ce = F.cross_entropy(
        out.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    aux = getattr(out, "aux_loss", None)
    loss = ce if aux is None else ce + model.config.router_aux_loss_coef * aux
    return out.logits, loss, aux


@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "x".join(f"{k}{v}" for k, v in a.items()))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_one_device(family: str, axes: dict[str, int]) -> None:
    with float64_inside(family):
        check_family(family, axes, TOL, TOL, weights_tolerance(family))


@pytest.mark.parametrize("axes", [{"tp": 2}, {"ep": 2, "tp": 2}], ids=["tp2", "ep2xtp2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_sequence_parallel(family: str, axes: dict[str, int]) -> None:
    """Sequence parallelism over tp: norms and residuals on sequence shards, each MoE block on
    the whole sequence (its input gathered, its output cut back), so routing and the aux loss
    are still one device's."""
    with float64_inside(family):
        check_family(family, axes, TOL, TOL, weights_tolerance(family), sequence_parallel=True)


def check_family(
    family: str,
    axes: dict[str, int],
    forward: dict[str, float],
    grads_tol: dict[str, float],
    weights: dict[str, float] | None,
    sequence_parallel: bool = False,
    plan: dict[str, Any] | None = None,
) -> None:
    """Logits, loss (+ aux loss), every gradient and two AdamW steps against one device, to the
    given tolerances (``weights=None``: one step's forward and gradients only), with the family's
    ready plan or ``plan``."""
    ref = build(family)
    model = copy.deepcopy(ref)
    mesh = fd.Mesh(axes)
    if plan is None:
        plan = fd.nn.plans.plan(model, mesh, sequence_parallel=sequence_parallel)
    pm = fd.nn.parallelize(model, mesh, plan)  # the row of model_type
    vocab_axis = "tp" if "tp" in axes else "ep"
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for step in range(2 if weights is not None else 1):
        ids, labels = batch(10 + step)
        want_logits, want_loss, want_aux = reference(ref, ids, labels)
        out = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
        torch.testing.assert_close(
            full_logits(out.logits, mesh, vocab_axis), want_logits.detach(), **forward
        )
        if want_aux is not None:
            torch.testing.assert_close(out.aux_loss, rep(want_aux.detach(), mesh), **forward)
        torch.testing.assert_close(out.loss, rep(want_loss.detach(), mesh), **forward)
        want_loss.backward()
        out.loss.sum().backward()  # each rank's backward of its own (equal) loss
        grads = pm.grads()  # single-device view; replicas checked to agree
        assert grads.keys() == {n for n, _ in ref.named_parameters()}
        for name, p in ref.named_parameters():
            torch.testing.assert_close(
                grads[name],
                p.grad,
                **grads_tol,
                msg=lambda m, name=name, step=step: f"step {step} {name}: {m}",
            )
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    if weights is None:
        return
    state = pm.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            state[name], p.detach(), **weights, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("axes", [{"ep": 4}, {"ep": 2, "tp": 2}], ids=["ep4", "ep2xtp2"])
def test_another_familys_plan_leaving_per_rank_gradients_is_refused(axes: dict[str, int]) -> None:
    """Mixtral's plan on a Qwen3-MoE model leaves its per-head q/k norms (which Mixtral has not)
    replicated on each rank's heads: the forward is exact, but each rank's norm gradient is its
    own heads' only (ranks differ; silently so in ``p.grad``). parallelize refuses it, naming the
    parameter and the fix (verify=True: on a copy, the model unchanged); the fix applied matches
    one device."""
    mesh = fd.Mesh(axes)
    with float64_inside("qwen3_moe"):
        model = build("qwen3_moe")
        plan = fd.nn.plans.plan(model, mesh, family="mixtral")
        axis = plan["model.layers.*.self_attn"].axis
        refused = (
            rf"replicated parameter 'model\.layers\.0\.self_attn\.q_norm\.weight' .* vary over "
            rf"'{axis}'.*k_norm\.weight.*Fix: pvary it over '{axis}': plan\['model\.layers\.\*\."
            rf"self_attn\.q_norm'\] = fastdist\.nn\.PvaryParams\('{axis}'\)"
        )
        with pytest.raises(fd.nn.ParallelizeError, match=refused + ".*was not changed"):
            fd.nn.parallelize(model, mesh, plan, verify=True)
        assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
        with pytest.raises(fd.nn.ParallelizeError, match=refused + ".*has been changed"):
            fd.nn.parallelize(model, mesh, plan)
        # what the refusal prevents (verify=False: no check): the replicas' gradients differ
        model = build("qwen3_moe")
        pm = fd.nn.parallelize(model, mesh, plan, verify=False)
        ids, labels = batch(10)
        pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh)).loss.sum().backward()
        g = model.model.layers[0].self_attn.q_norm.weight.grad  # [world, head_dim]
        assert (g - g[:1]).abs().max() > 1e-4
        fixed = {
            **plan,
            **{
                f"model.layers.*.self_attn.{n}": fd.nn.PvaryParams(axis)
                for n in ("q_norm", "k_norm")
            },
        }
        check_family("qwen3_moe", axes, TOL, TOL, None, plan=fixed)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "olmoe", "qwen3_moe"])
def test_float32_inside_float64_models(family: str) -> None:
    """As transformers ships them, DeepSeek's routers and OLMoE's and Qwen3-MoE's q/k norms run
    in float32 in a float64 model. float32 rounds differently in the simulation's batched
    kernels (and in a norm's sum of squares summed over tp) than on one device, so the parallel
    model agrees
    with one device to float32's precision: logits, loss and gradients (not the weights after
    AdamW, whose first update lr * g / |g| flips with the sign of a gradient within float32
    noise of 0)."""
    f32 = {"rtol": 1e-5, "atol": 1e-6}
    check_family(family, {"ep": 2, "tp": 4}, f32, f32, None)


def test_plan_mistakes_raise_parallelize_errors_naming_the_module_and_the_fix() -> None:
    # GPT-OSS's attention sinks (one per head) left whole: refused before anything changes,
    # instead of torch's "Sizes of tensors must match" from inside the model
    model = build("gpt_oss")
    plan = fd.nn.plans.plan(model)
    # the Mixtral row's attention: no head_params
    plan["model.layers.*.self_attn"] = fd.nn.plans.plan(model, family="mixtral")[
        "model.layers.*.self_attn"
    ]
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"'model\.layers\.0\.self_attn' \(GptOssAttention\): its own parameter 'sinks' .*"
        r"Fix: HeadParallelAttention\(\.\.\., head_params=\('sinks',\)\)",
    ):
        fd.nn.parallelize(model, fd.Mesh({"ep": 2, "tp": 2}), plan)
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)  # unchanged
    # MLA heads that do not split
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"attention 'model\.layers\.0\.self_attn' has 4 heads, not divisible by the 3 "
        r"ranks of 'tp'\. Fix",
    ):
        fd.nn.parallelize(build("deepseek_v3"), fd.Mesh({"tp": 3, "ep": 2}))
    # GPT-OSS experts' 8 features over 3 tp ranks
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"'model\.layers\.0\.mlp\.experts' has experts of 8 intermediate features, not "
        r"divisible by the 3 ranks of 'tp'\. Fix",
    ):
        fd.nn.parallelize(
            build("gpt_oss"),
            fd.Mesh({"ep": 2, "tp": 3}),
            {"model.layers.*.mlp.experts": fd.nn.moe.ExpertParallel(tp_axis="tp")},
        )
    # the style on the router instead of the experts
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"'model\.layers\.0\.mlp\.router' \(GptOssTopKRouter\) is not a 3-D-parameter "
        r"experts module.*Fix: apply ExpertParallel to the experts module",
    ):
        fd.nn.parallelize(
            build("gpt_oss"),
            fd.Mesh({"ep": 2}),
            {"model.layers.0.mlp.router": fd.nn.moe.ExpertParallel()},
        )
    # sinks that do not split
    with pytest.raises(
        fd.nn.ParallelizeError, match=r"self_attn\.sinks has 4 heads, not divisible by the 3"
    ):
        fd.nn.parallelize(
            build("gpt_oss"),
            fd.Mesh({"tp": 3}),
            {"model.layers.0.self_attn": fd.nn.styles.HeadParams("tp", ("sinks",))},
        )
    # experts that do not divide over ep
    with pytest.raises(
        fd.nn.MoEError, match=r"4 experts do not divide over the 3 ranks of 'ep'.*Fix"
    ):
        fd.nn.parallelize(
            build("qwen3_moe"),
            fd.Mesh({"ep": 3}),
            {"model.layers.*.mlp.experts": fd.nn.moe.ExpertParallel()},
        )


def test_plan_picks_the_axes_from_the_mesh() -> None:
    """Experts over ep when the mesh has it, else over tp itself; attention over tp, else ep."""
    model = build("qwen2_moe")
    for axes, attn, experts, inside in (
        ({"tp": 2}, "tp", "tp", None),
        ({"ep": 2}, "ep", "ep", None),
        ({"ep": 2, "tp": 2}, "tp", "ep", "tp"),
    ):
        plan = fd.nn.plans.plan(model, fd.Mesh(axes))
        assert plan["model.layers.*.self_attn"].axis == attn
        style = plan["model.layers.1.mlp.experts"]
        assert (style.axis, style.tp_axis) == (experts, inside)
        assert plan["model.layers.1.mlp.shared_expert.gate_proj"].axis == attn
        assert plan["model.layers.0.mlp.gate_proj"].axis == attn  # the dense layer


def test_every_family_on_two_gloo_processes(tmp_path: Path) -> None:
    """Every family on 2 gloo processes (experts over the tp ranks), GPT-OSS loaded from its
    save_pretrained output by slices: logits, loss, every gradient and an AdamW step against one
    device."""
    from tests.dist_harness import run_on_gloo
    from tests.moe_families_worker import moe_families_on_gloo

    for family in LOADS_SAVE_PRETRAINED:
        build(family).save_pretrained(tmp_path / family)
    done = run_on_gloo(moe_families_on_gloo, 2, FAMILIES, str(tmp_path), timeout=600)
    assert done == [FAMILIES] * 2


# ============================================================================ the docs' table
def _row(family: str) -> dict[str, str]:
    """docs/models.md's family-table cells for ``family``, from what this file tests."""
    with torch.device("meta"):
        model = build(family)
    cfg = model.config
    if family.startswith("deepseek"):
        attention = "MLA"
    else:
        kinds = ["GQA"] if cfg.num_key_value_heads < cfg.num_attention_heads else []
        if any(cfg.num_key_value_heads < a.get("tp", 1) for a in MESHES):
            kinds.append("kv < tp")
        attention = ", ".join(kinds) or "—"
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    moe = [
        "×".join(f"{a}={n}" for a, n in axes.items())
        + (" (experts over tp)" if "ep" not in axes else "")
        for axes in MESHES
    ]
    return {
        "TP": ", ".join(sorted({f"tp={a['tp']}" for a in MESHES if "tp" in a})),
        "SP": "✓",  # test_family_sequence_parallel
        "GQA/MQA": attention,
        "tied": "✓" if tied else "—",
        "MoE": ", ".join(moe),
        "save_pretrained": "✓" if family in LOADS_SAVE_PRETRAINED else "—",
    }


#: model_type -> column -> cell: what docs/models.md's family table must say for these families
TABLE = {family: _row(family) for family in FAMILIES}


def test_docs_table_rows_are_what_the_tests_check() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "models.md").read_text()
    table = text[text.index("<!-- families table -->") :]
    columns = ("TP", "SP", "GQA/MQA", "tied", "MoE", "save_pretrained")
    for family, row in TABLE.items():
        want = f"| {NAMES[family]} | `{family}` | " + " | ".join(row[c] for c in columns) + " |"
        assert want in table, f"docs/models.md's family table lacks: {want}"


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_loads_by_slices_with_fused_experts(family: str, tmp_path: Path) -> None:
    """save_pretrained writes one tensor per expert (all but GPT-OSS); fd.checkpoint.load reads
    them under the model's fused names (fused_experts), each rank its own experts' slices; a state
    dict of per-expert tensors is not fused (strict: the missing fused tensors are named)."""
    ref = build(family)
    ref.save_pretrained(tmp_path)
    mesh = fd.Mesh({"ep": 2, "tp": 2})
    for explicit in (False, True):
        model = build(family, seed=7)
        pm = fd.nn.parallelize(model, mesh)
        if explicit:
            with fd.checkpoint.hf.fused_experts(pm.module, tmp_path) as checkpoint:
                fd.checkpoint.load(checkpoint, pm)
        else:
            fd.checkpoint.load(tmp_path, pm)
        state = pm.state_dict()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(state[name], p.detach(), rtol=0, atol=0, msg=name)
    if family != "gpt_oss":
        from safetensors.torch import load_file

        per_expert = load_file(str(tmp_path / "model.safetensors"))
        with pytest.raises(fd.nn.CheckpointError, match=r"missing keys.*experts\.gate_up_proj"):
            fd.checkpoint.load(per_expert, pm)


class _Experts(torch.nn.Module):
    """A gated experts module in any of the layouts transformers' flags describe, with a plain
    one-device forward (the reference)."""

    def __init__(self, transposed: bool, concatenated: bool, bias: bool) -> None:
        super().__init__()
        E, H, I = 4, 6, 4
        g = torch.Generator().manual_seed(0)
        self.is_transposed, self.is_concatenated, self.has_bias = transposed, concatenated, bias
        gu, dn = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
        self.gate_up_proj = torch.nn.Parameter(gu.transpose(1, 2) if transposed else gu)
        self.down_proj = torch.nn.Parameter(dn.transpose(1, 2) if transposed else dn)
        if bias:
            self.gate_up_proj_bias = torch.nn.Parameter(torch.randn(E, 2 * I, generator=g))
            self.down_proj_bias = torch.nn.Parameter(torch.randn(E, H, generator=g))
        self.act_fn = torch.nn.SiLU()

    def _apply_gate(self, h: Tensor) -> Tensor:
        gate, up = h.chunk(2, -1) if self.is_concatenated else (h[..., ::2], h[..., 1::2])
        return self.act_fn(gate) * torch.tanh(up)  # not act(gate) * up: the class's own gate

    def forward(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            tok, slot = torch.where(idx == e)
            w1, w2 = self.gate_up_proj[e], self.down_proj[e]
            h = x[tok] @ w1 if self.is_transposed else x[tok] @ w1.T
            h = h + self.gate_up_proj_bias[e] if self.has_bias else h
            h = self._apply_gate(h)
            y = h @ w2 if self.is_transposed else h @ w2.T
            y = y + self.down_proj_bias[e] if self.has_bias else y
            out = out.index_add(0, tok, y * w[tok, slot, None])
        return out


class _Holder(torch.nn.Module):
    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        return self.experts(x, idx, w)  # type: ignore[no-any-return]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("concatenated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_every_expert_layout_over_ep_and_tp(
    transposed: bool, concatenated: bool, bias: bool
) -> None:
    """Each combination of transformers' experts flags (transposed, gate|up concatenated or
    interleaved, biases), with the class's own gate, at ep=2 x tp=2 against one device."""
    ref = _Holder(_Experts(transposed, concatenated, bias).to(F64))
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 6, dtype=F64, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(10)])  # (10, 2)
    w = torch.rand(10, 2, dtype=F64, generator=g)
    mesh = fd.Mesh({"ep": 2, "tp": 2})
    pm = fd.nn.parallelize(model, mesh, {"experts": fd.nn.moe.ExpertParallel("ep", tp_axis="tp")})
    c = torch.arange(60, dtype=F64).reshape(10, 6) / 10
    want = ref(x, idx, w)
    (want * c).sum().backward()
    got = pm(rep(x, mesh), rep(idx, mesh), rep(w, mesh))
    torch.testing.assert_close(got, rep(want.detach(), mesh), **TOL)
    (got * c).sum().backward()
    grads = pm.grads()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=name)
