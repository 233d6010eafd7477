"""The ready-made plans of the dense Hugging Face families (`fastdist.nn.plans.plan`), each
against the same model on one device in float64: logits, loss, every gradient and two AdamW steps,
tensor-parallel at tp=2 and tp=4, sequence-parallel, grouped-query / multi-query attention with
kv heads fewer than ranks, tied embeddings, loading ``save_pretrained`` output; the mistakes the
plans used to let through (issue 31's table) as `ParallelizeError`; and every family once on two
gloo processes.

``CASES`` is what runs; ``TABLE`` (derived from it) is what docs/models.md's family table must say.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fastdist as fd
from tests import tiny_models
from tests.test_hf_models import batch, full_logits, reference_loss, rep
from tests.tiny_models import VOCAB

transformers = pytest.importorskip("transformers")

F64 = torch.float64
ROOT = Path(__file__).resolve().parent.parent

#: model_type -> the family's name in the docs
NAMES = {
    "llama": "Llama 2/3/3.x",
    "mistral": "Mistral",
    "qwen2": "Qwen2/2.5",
    "qwen3": "Qwen3",
    "gemma": "Gemma",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 (text)",
    "phi3": "Phi-3/Phi-4",
    "gpt_neox": "GPT-NeoX/Pythia",
    "gpt2": "GPT-2",
    "falcon": "Falcon",
    "stablelm": "StableLM",
    "olmo": "OLMo",
    "olmo2": "OLMo-2",
}


def build(family: str, *, kv: int = 2, seed: int = 0) -> Any:
    """A small single-device model of ``family`` (a model_type; ``falcon:new``, ``falcon:mqa``,
    ``falcon:per_head`` pick Falcon's attention layout) in float64, eval mode."""
    return tiny_models.build(family, kv=kv, seed=seed)


def tolerance(family: str) -> dict[str, float]:
    """Exact to float64 rounding, except where the model itself computes in float32: Gemma's
    RMSNorms multiply by ``1 + weight`` in float32 (the weights' gradients are float32 sums, here
    summed per sequence shard or per head), OLMo-2's q/k norms take the mean of squares in
    float32 (here summed over ranks), Qwen3's per-head q/k norms round their input to float32
    (a column-parallel or per-head projection's last float64 bit can differ from one device's
    matmul, and then the float32 rounding does); AdamW's normalised update then carries these
    float32 differences of the gradients into the next step's weights. Measured: at most ~1e-6
    absolute; anything a plan got wrong is off by 1e-2 or more."""
    if family.startswith(("gemma", "olmo2", "qwen3")):
        return {"rtol": 1e-4, "atol": 1e-5}
    return {"rtol": 1e-10, "atol": 1e-10}


def _embeddings_tied(model: Any) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


# (family, tp, sequence parallel, kv heads, load save_pretrained output); heads are 4
CASES: list[tuple[str, int, bool, int, bool]] = [
    ("llama", 2, True, 2, True),
    ("llama", 4, False, 1, False),  # MQA
    ("mistral", 2, False, 2, True),
    ("mistral", 4, True, 2, False),  # kv heads < tp: replicated
    ("qwen2", 2, True, 2, True),
    ("qwen2", 4, False, 1, False),
    ("qwen3", 2, True, 2, True),
    ("qwen3", 4, True, 2, False),
    ("gemma", 2, True, 2, True),
    ("gemma", 4, False, 1, False),
    ("gemma2", 2, True, 2, True),
    ("gemma2", 4, False, 2, False),
    ("gemma3_text", 2, True, 2, True),
    ("gemma3_text", 4, True, 1, False),
    ("phi3", 2, True, 2, True),
    ("phi3", 4, False, 1, False),  # fused qkv_proj with kv heads < tp
    ("gpt_neox", 2, True, 4, True),  # save_pretrained writes lm_head as embed_out
    ("gpt_neox", 4, False, 4, False),
    ("gpt2", 2, False, 4, True),
    ("gpt2", 4, True, 4, False),
    ("falcon:new", 2, True, 2, True),
    ("falcon:new", 4, False, 2, False),  # grouped q|k|v with kv heads < tp
    ("falcon:mqa", 4, True, 1, False),
    ("falcon:per_head", 2, True, 4, False),
    ("stablelm", 2, True, 2, True),
    ("stablelm", 4, False, 1, False),
    ("olmo", 2, True, 2, True),
    ("olmo", 4, False, 2, False),
    ("olmo2", 2, True, 2, True),
    ("olmo2", 4, True, 1, False),
]


def _mesh(family: str, tp: int) -> fd.Mesh:
    """The mesh a case runs on (tp only: the dense families; Mixtral and the other MoE families
    are tests/test_moe_families.py's)."""
    return fd.Mesh({"tp": tp})


def _run_case(
    family: str, tp: int, sp: bool, kv: int, from_pretrained: bool, tmp_path: Path
) -> None:
    ref = build(family, kv=kv)
    if from_pretrained:
        ref.save_pretrained(tmp_path / "ckpt")
        # other weights: everything must come from the checkpoint
        model = build(family, kv=kv, seed=7)
    else:
        model = copy.deepcopy(ref)
    config = model.config
    heads_before = (config.num_attention_heads, getattr(config, "num_key_value_heads", None))
    mesh = _mesh(family, tp)
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=sp))
    if from_pretrained:
        fd.checkpoint.load(tmp_path / "ckpt", pm)
    # the user's config is untouched (per-rank values live in per-module views)
    assert model.config is config
    assert (config.num_attention_heads, getattr(config, "num_key_value_heads", None)) == (
        heads_before
    )
    assert _embeddings_tied(model) == _embeddings_tied(ref)
    tol = tolerance(family)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for step in range(2):
        ids, labels = batch(1 + step)
        ref_logits, ref_loss = reference_loss(ref, ids, labels)
        ref_loss.backward()
        out = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
        torch.testing.assert_close(full_logits(out.logits, mesh), ref_logits.detach(), **tol)
        torch.testing.assert_close(out.loss, rep(ref_loss.detach(), mesh), **tol)
        out.loss.sum().backward()
        grads = pm.grads()  # single-device view; replicas checked to agree
        want = {n: p.grad for n, p in ref.named_parameters()}
        assert grads.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(
                grads[name], want[name], **tol, msg=lambda m, name=name: f"{name}: {m}"
            )
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    state = pm.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            state[name], p.detach(), **tol, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize(
    "family, tp, sp, kv, from_pretrained",
    CASES,
    ids=[f"{f}-tp{tp}{'-sp' if sp else ''}-kv{kv}" for f, tp, sp, kv, _ in CASES],
)
def test_family_matches_one_device(
    tmp_path: Path, family: str, tp: int, sp: bool, kv: int, from_pretrained: bool
) -> None:
    _run_case(family, tp, sp, kv, from_pretrained, tmp_path)


def _row_model(kind: str) -> tuple[Any, fd.Mesh, Any]:
    """A tiny model of ``kind``'s family (the builders of this file and of
    tests/test_moe_families.py), the mesh its row runs on, and the context it runs in."""
    if fd.nn.plans.TABLE[kind].moe:
        from tests import test_moe_families as moe

        return moe.build(kind), fd.Mesh({"ep": 2, "tp": 2}), moe.float64_inside(kind)
    return build("falcon:new" if kind == "falcon" else kind), fd.Mesh({"tp": 2}), nullcontext()


@pytest.mark.parametrize("kind", sorted(fd.nn.plans.TABLE))
def test_every_row_of_the_table_matches_one_device(kind: str) -> None:
    """Each row of `fastdist.nn.plans.TABLE`, by its model type: the plan on a tiny model of the
    family, tensor- and sequence-parallel, gives one device's logits (the families' full checks,
    gradients and optimizer steps included, are test_family_matches_one_device above and in
    tests/test_moe_families.py)."""
    ref, mesh, inside = _row_model(kind)
    model = copy.deepcopy(ref)
    with inside:
        pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=True))
        ids, _ = batch(3)
        want = ref(input_ids=ids).logits
        got = pm(input_ids=rep(ids, mesh)).logits
    ranks = [
        mesh.rank_of({"tp": i, **{a: 0 for a in mesh.axis_names if a != "tp"}}) for i in (0, 1)
    ]
    got = torch.cat([got[r] for r in ranks], -1)[..., : ref.config.vocab_size]
    torch.testing.assert_close(got, want.detach(), **tolerance(kind))


def test_a_model_type_in_two_rows_is_refused() -> None:
    """The table is built by `fastdist.nn.plans.table`, which refuses a model type claimed twice
    (at import), instead of one row silently replacing the other."""
    llama = fd.nn.plans.TABLE["llama"]
    with pytest.raises(ValueError, match="two family rows for model_type 'mistral'"):
        fd.nn.plans.table(
            llama, dataclasses.replace(fd.nn.plans.TABLE["olmo"], model_types=("mistral",))
        )


@pytest.mark.parametrize("family", ["gemma2", "olmo2", "falcon:mqa", "stablelm"])
def test_family_built_on_the_meta_device_loads_save_pretrained(tmp_path: Path, family: str) -> None:
    """The new pieces (the scaled embedding's buffer, the full-width norm's shards, a fused
    projection held whole, per-head norm lists) on a model that never sat whole on one rank."""
    ref = build(family)
    ref.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = tiny_models.instantiate(family)
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=True))
    fd.checkpoint.load(tmp_path, pm, dtype=F64)
    ids, labels = batch()
    out = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    want_logits, want_loss = reference_loss(ref, ids, labels)
    tol = tolerance(family)
    torch.testing.assert_close(full_logits(out.logits, mesh), want_logits.detach(), **tol)
    torch.testing.assert_close(out.loss, rep(want_loss.detach(), mesh), **tol)


# ============================================================================ the docs' table
def _features() -> dict[str, dict[str, str]]:
    """What CASES exercise, per model_type: the docs table's cells."""
    rows: dict[str, dict[str, str]] = {}
    for family, tp, sp, kv, pretrained in CASES:
        kind = family.partition(":")[0]
        row = rows.setdefault(
            kind, {"TP": "", "SP": "", "GQA/MQA": "", "tied": "", "MoE": "", "save_pretrained": ""}
        )
        axes = _mesh(family, tp).shape
        if "ep" in axes:
            moe = {
                *filter(None, row["MoE"].split(", ")),
                "×".join(f"{a}={n}" for a, n in axes.items()),
            }
            row["MoE"] = ", ".join(sorted(moe))
        else:
            row["MoE"] = row["MoE"] or "—"
        row["TP"] = ", ".join(sorted({*filter(None, row["TP"].split(", ")), f"tp={tp}"}))
        row["SP"] = "✓" if sp or row["SP"] == "✓" else "—"
        kinds = set(filter(None, row["GQA/MQA"].replace("—", "").split(", ")))
        if kv == 1:
            kinds.add("MQA")
        elif kv < 4:
            kinds.add("GQA")
        if kv < tp:
            kinds.add("kv < tp")
        row["GQA/MQA"] = ", ".join(sorted(kinds)) or "—"
        row["tied"] = "✓" if row["tied"] == "✓" or _ties_by_default(family) else "—"
        row["save_pretrained"] = "✓" if pretrained or row["save_pretrained"] == "✓" else "—"
    return rows


def _ties_by_default(family: str) -> bool:
    with torch.device("meta"):
        return _embeddings_tied(tiny_models.instantiate(family))


TABLE = _features()
COLUMNS = ("TP", "SP", "GQA/MQA", "tied", "MoE", "save_pretrained")


def _docs_table() -> dict[str, dict[str, str]]:
    """docs/models.md's family table: model_type -> column -> cell."""
    text = (ROOT / "docs" / "models.md").read_text()
    start = text.index("<!-- families table -->")
    rows: dict[str, dict[str, str]] = {}
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        match = re.fullmatch(r"`(\w+)`", cells[1])
        if match is None:
            continue  # the header and its rule
        rows[match.group(1)] = dict(zip(COLUMNS, cells[2:], strict=True))
    return rows


def test_docs_table_rows_are_what_the_tests_check() -> None:
    docs = _docs_table()
    for kind, row in TABLE.items():
        assert kind in fd.nn.plans.TABLE, kind
        assert docs.get(kind) == row, f"{kind}: docs say {docs.get(kind)}, the tests check {row}"


def test_docs_table_has_a_row_for_every_ready_plan() -> None:
    """Every model_type in fd.nn.plans.TABLE has its row (the MoE families' rows are checked
    against their own tests in tests/test_moe_families.py, where they define TABLE)."""
    docs = _docs_table()
    assert set(docs) == set(fd.nn.plans.TABLE), (
        "docs/models.md's family table and fastdist.nn.plans.TABLE differ: "
        f"{sorted(set(docs) ^ set(fd.nn.plans.TABLE))}"
    )
    from tests import test_moe_families

    for kind, row in getattr(test_moe_families, "TABLE", {}).items():
        assert docs[kind] == row, f"{kind}: docs say {docs[kind]}, the tests check {row}"


# ============================================================================ refusals (issue 31)
def _attention(model: Any) -> Any:
    return next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn"))


def test_phi3_attention_sees_a_per_rank_config_view_and_the_users_config_is_untouched() -> None:
    """Phi-3 slices its fused qkv with self.config.num_attention_heads (a raw RuntimeError before):
    each attention module gets a shallow copy with this rank's head counts; the model's config
    and the modules that share it keep theirs."""
    model = build("phi3")
    config = model.config
    mesh = fd.Mesh({"tp": 2})
    fd.nn.parallelize(model, mesh)
    attn = _attention(model)
    assert attn.config is not config and attn.config.num_attention_heads == 2
    assert attn.config.num_key_value_heads == 1 and attn.num_key_value_heads == 1
    assert config.num_attention_heads == 4 and config.num_key_value_heads == 2
    assert model.model.config is config and model.model.layers[0].mlp.config is config
    assert attn.config.hidden_size == 32 and attn.config.vocab_size == VOCAB  # the rest shared
    views = {id(m.self_attn.config) for m in model.model.layers}
    assert len(views) == 2  # one view per module: nothing one of them changes leaks
    # a plan written by hand from the documented styles (issue 31's case) now equals one device
    ref = build("phi3")
    hand = copy.deepcopy(ref)
    plan = {"model.layers.*.self_attn": fd.nn.HeadParallelAttention(4, 2, 8, qkv="qkv_proj")}
    pm = fd.nn.parallelize(hand, mesh, plan)
    ids, _ = batch()
    got = pm(input_ids=rep(ids, mesh)).logits
    torch.testing.assert_close(
        got, rep(ref(input_ids=ids).logits.detach(), mesh), **tolerance("phi3")
    )


def test_stablelm_heads_are_set_per_rank_and_per_head_norm_lists_are_named() -> None:
    """StableLM reads self.num_heads / num_key_value_heads (a raw reshape error with the Llama
    plan before): set per rank; its per-head q/k LayerNorm lists, which the Llama plan would
    apply as the first heads' norms on every rank, are refused with the fix."""
    model = build("stablelm")
    mesh = fd.Mesh({"tp": 2})
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=(
            r"'model\.layers\.0\.self_attn' \(StableLmAttention\): its child 'q_layernorm' "
            r"\(StableLmLayerNormPerHead\).*Fix: HeadParallelAttention\(\.\.\., "
            r"head_norm_lists=\(\('q_layernorm', 'q'\),\)"
        ),
    ):
        fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, family="llama"))
    fd.nn.parallelize(model, mesh)
    attn = _attention(model)
    assert (attn.num_heads, attn.num_key_value_heads, attn.num_key_value_groups) == (2, 1, 2)
    # without per-head norms the Llama plan fits StableLM (a raw reshape error before)
    ref = tiny_models.build("stablelm", qk_layernorm=False)
    plain = copy.deepcopy(ref)
    pm = fd.nn.parallelize(
        plain, mesh, fd.nn.plans.plan(plain, family="llama", sequence_parallel=True)
    )
    ids, labels = batch()
    out = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    want_logits, want_loss = reference_loss(ref, ids, labels)
    torch.testing.assert_close(
        full_logits(out.logits, mesh), want_logits.detach(), **tolerance("stablelm")
    )
    torch.testing.assert_close(out.loss, rep(want_loss.detach(), mesh), **tolerance("stablelm"))


def test_olmo2_full_width_norms_with_a_head_plan_are_refused_with_the_fix() -> None:
    """OLMo-2's q_norm/k_norm normalise the whole projection (a raw RuntimeError with the Llama
    plan before); the ready plan sums their statistics over tp (checked in CASES)."""
    model = build("olmo2")
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=(
            r"'model\.layers\.0\.self_attn' \(Olmo2Attention\): its child 'q_norm' "
            r"\(Olmo2RMSNorm\) is sized by the whole model's query heads.*"
            r"Fix: HeadParallelAttention\(\.\.\., full_width_norms=\(\('q_norm', 'q'\),\)"
        ),
    ):
        fd.nn.parallelize(model, fd.Mesh({"tp": 2}), fd.nn.plans.plan(model, family="llama"))
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear  # nothing changed


def test_gemma_scaled_embedding_needs_the_scale_style_and_stays_tied() -> None:
    model = build("gemma2")
    mesh = fd.Mesh({"tp": 2})
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"Gemma2TextScaledWordEmbedding.*own forward.*VocabParallel\(scale='embed_scale'\)",
    ):
        fd.nn.parallelize(model, mesh, {"model.embed_tokens": fd.nn.VocabParallel()})
    with pytest.raises(fd.nn.ParallelizeError, match=r"no scalar attribute 'scale'"):
        fd.nn.parallelize(model, mesh, {"model.embed_tokens": fd.nn.VocabParallel(scale="scale")})
    fd.nn.parallelize(model, mesh)
    emb = model.model.embed_tokens
    assert type(emb).__name__ == "ScaledVocabParallelEmbedding"
    assert float(emb.embed_scale) == pytest.approx(32**0.5)
    assert model.lm_head.weight is emb.weight


def test_falcon_alibi_is_refused_with_the_reason_and_the_fix() -> None:
    cfg = transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, alibi=True
    )
    with pytest.raises(fd.nn.ParallelizeError, match=r"Falcon plan.*alibi=True.*Fix: "):
        fd.nn.plans.plan(cfg, family="falcon")


def test_an_unknown_head_count_attribute_is_refused_by_value_unless_named() -> None:
    """A module whose forward reads a head count under a name no plan knows: found by value and
    refused (a silent wrong result otherwise); attrs= gives its per-rank value, keep= says it is
    not one."""

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(16, 16) for _ in range(3))
            self.o_proj = nn.Linear(16, 16)
            self.heads_here, self.window = 4, 4

        def forward(self, x: Tensor) -> Tensor:
            b, s, _ = x.shape
            q, k, v = (
                p(x).view(b, s, self.heads_here, 4).transpose(1, 2)
                for p in (self.q_proj, self.k_proj, self.v_proj)
            )  # (b, heads, s, 4)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.window > 0)
            return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))  # (b, s, heads * 4)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attn()

        def forward(self, x: Tensor) -> Tensor:
            return self.attn(x)

    torch.manual_seed(0)
    ref = Model().to(F64)
    x = torch.randn(2, 5, 16, dtype=F64)
    mesh = fd.Mesh({"tp": 2})
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=(
            r"'attn' \(Attn\) reads self\.heads_here = 4, the whole model's query heads.*"
            r"Fix: HeadParallelAttention\(\.\.\., attrs=\(\('heads_here', lambda hq, hkv, d: "
        ),
    ):
        fd.nn.parallelize(copy.deepcopy(ref), mesh, {"attn": fd.nn.HeadParallelAttention(4, 4, 4)})
    named = (("heads_here", lambda hq, hkv, d: hq),)
    with pytest.raises(fd.nn.ParallelizeError, match=r"reads self\.window = 4.*keep=\('window',\)"):
        fd.nn.parallelize(
            copy.deepcopy(ref), mesh, {"attn": fd.nn.HeadParallelAttention(4, 4, 4, attrs=named)}
        )
    style = fd.nn.HeadParallelAttention(4, 4, 4, attrs=named, keep=("window",))
    model = copy.deepcopy(ref)
    pm = fd.nn.parallelize(model, mesh, {"attn": style})
    assert model.attn.heads_here == 2 and model.attn.window == 4
    torch.testing.assert_close(pm(rep(x, mesh)), rep(ref(x).detach(), mesh), rtol=1e-12, atol=1e-12)


# ============================================================================ real processes
#: (builder "module:function", family) run by one pair of gloo processes, in sequence; the
#: builder is called as ``fn(family, seed=...)`` and returns a float64 eval-mode model
GLOO_FAMILIES: list[tuple[str, str]] = [
    ("tests.test_families:build", f)
    for f in (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "phi3",
        "gpt_neox",
        "gpt2",
        "falcon:new",
        "falcon:mqa",
        "stablelm",
        "olmo",
        "olmo2",
    )
]


def builder(ref: str) -> Callable[..., Any]:
    import importlib

    module, _, fn = ref.partition(":")
    return getattr(importlib.import_module(module), fn)  # type: ignore[no-any-return]


def test_every_family_on_two_gloo_processes(tmp_path: Path) -> None:
    """Each family saved with save_pretrained; on 2 gloo ranks each rank loads its slices, runs a
    sequence-parallel forward/backward and an AdamW step, and matches one device."""
    from tests.dist_harness import run_on_gloo
    from tests.families_worker import families_on_gloo

    for i, (ref, family) in enumerate(GLOO_FAMILIES):
        builder(ref)(family).save_pretrained(tmp_path / str(i))
    assert (
        run_on_gloo(families_on_gloo, 2, GLOO_FAMILIES, str(tmp_path), timeout=600)
        == [[f for _, f in GLOO_FAMILIES]] * 2
    )


@pytest.mark.parametrize("sp", [False, True], ids=["no-prepare-input", "sp-norms-not-pvaryd"])
def test_a_hand_plan_leaving_per_rank_gradients_is_refused_naming_the_fix(sp: bool) -> None:
    """A hand-edited Llama plan whose replicated values would get per-rank gradients: the MLP's
    ColwiseParallel() layers without the PrepareInput before them (the hidden states' gradient,
    and with it every parameter before, would be each rank's own share), or sequence parallelism
    without the norms' PvaryParams (each norm sees its sequence shard). The forward of either is
    exact; parallelize refuses both, naming the parameter or module and the fix; without the
    check (verify=False) the replicas' gradients differ."""
    mesh = fd.Mesh({"tp": 2})
    model = build("llama")
    plan = fd.nn.plans.plan(model, mesh, sequence_parallel=sp)
    if sp:
        for norm in ("input_layernorm", "post_attention_layernorm"):
            del plan[f"model.layers.*.{norm}"]
        message = (
            r"replicated parameter 'model\.layers\.0\.input_layernorm\.weight'.*"
            r"Fix: pvary it over 'tp': plan\['model\.layers\.\*\.input_layernorm'\] = "
            r"fastdist\.nn\.PvaryParams\('tp'\)"
        )
        drifting = "model.layers.0.input_layernorm.weight"
    else:
        del plan["model.layers.*.mlp"]
        message = (
            r"a replicated input of 'model\.layers\.0\.mlp\.gate_proj' \(ParallelLinear\) meets "
            r"values that vary over 'tp'.*Fix: prepare the input: plan\[<its parent>\] = "
            r"fastdist\.nn\.PrepareInput\('tp'\)"
        )
        drifting = "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(fd.nn.ParallelizeError, match=message):
        fd.nn.parallelize(copy.deepcopy(model), mesh, plan)
    pm = fd.nn.parallelize(model, mesh, plan, verify=False)
    ids, labels = batch(1)
    pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh)).loss.sum().backward()
    g = model.get_parameter(drifting).grad  # [world, hidden]
    assert (g - g[:1]).abs().max() > 1e-4
