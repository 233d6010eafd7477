"""Unmodified Hugging Face models made parallel with fastdist.nn.parallelize, against the same model
on one device.

Models are built from small configs with random init (nothing is downloaded), in float64,
so logits, losses and every parameter gradient must match to 1e-10.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import fastdist as fd
from tests import tiny_models
from tests.tiny_models import VOCAB

transformers = pytest.importorskip("transformers")

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}


def build(family: str, *, kv: int = 2, layers: int = 2, seed: int = 0) -> Any:
    """A small single-device model of ``family`` in float64, eval mode (no dropout)."""
    return tiny_models.build(family, kv=kv, layers=layers, seed=seed)


def batch(seed: int = 1, B: int = 2, S: int = 8) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # padding: ignored by the loss
    labels[1, -2] = -100
    return ids, labels


def reference_loss(model: Any, ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(logits, loss) on one device; the loss in float64 (HF's own loss upcasts to float32 only)."""
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    return logits, loss


def rep(t: Tensor, mesh: fd.Mesh) -> Tensor:
    """A replicated input on every simulated rank: [world, *shape]."""
    return t.expand(mesh.size, *t.shape)


def full_logits(sharded: Tensor, mesh: fd.Mesh, axis: str = "tp") -> Tensor:
    """The whole vocabulary from rank-stacked vocabulary shards (rank 0's tp group), padding
    dropped."""
    return torch.cat(
        [
            sharded[mesh.rank_of({**{a: 0 for a in mesh.axis_names}, axis: i})]
            for i in range(mesh.axis_size(axis))
        ],
        -1,
    )[..., :VOCAB]


def run_parallel(family: str, tp: int, sp: bool, kv: int = 2, device: str = "cpu") -> None:
    ref = build(family, kv=kv).to(device)
    model = copy.deepcopy(ref)
    ids, labels = (t.to(device) for t in batch())
    ref_logits, ref_loss = reference_loss(ref, ids, labels)
    ref_loss.backward()
    mesh = fd.Mesh({"tp": tp})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=sp))
    out = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    torch.testing.assert_close(full_logits(out.logits, mesh), ref_logits.detach(), **TOL)
    # every rank: the whole loss
    torch.testing.assert_close(out.loss, rep(ref_loss.detach(), mesh), **TOL)
    out.loss.sum().backward()  # each rank's backward of its own loss
    grads = pm.grads()  # single-device view; replicas checked to agree
    want = {n: p.grad for n, p in ref.named_parameters()}
    assert grads.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(
            grads[name], want[name], **TOL, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize(
    "family, tp, sp, kv",
    [
        ("llama", 2, False, 2),
        ("llama", 2, True, 2),
        ("llama", 4, True, 2),  # kv heads < tp: replicated
        ("llama", 4, False, 1),  # MQA
        ("mistral", 2, True, 2),
        ("qwen2", 2, True, 2),  # q/k/v bias
        ("qwen3", 2, True, 4),  # per-head q/k norms
        ("gpt2", 2, True, 4),  # Conv1D, fused c_attn, vocabulary 61 padded to 62
        ("gpt2", 4, False, 4),
    ],
)
def test_parallel_model_matches_one_device(family: str, tp: int, sp: bool, kv: int) -> None:
    run_parallel(family, tp, sp, kv)


def test_dp_x_tp_mesh_with_sequence_parallelism() -> None:
    """dp x tp: each dp replica runs its own batch; losses and summed gradients equal one device's
    per batch."""
    ref = build("llama")
    model = copy.deepcopy(ref)
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    (ids0, lab0), (ids1, lab1) = batch(1), batch(2)
    pm = fd.nn.parallelize(
        model, mesh, fd.nn.plans.plan(model, family="llama", sequence_parallel=True)
    )
    ids = torch.stack([ids0, ids0, ids1, ids1])  # rank = dp * 2 + tp
    labels = torch.stack([lab0, lab0, lab1, lab1])
    out = pm(input_ids=ids, labels=labels)
    losses = [reference_loss(ref, i, lab)[1] for i, lab in ((ids0, lab0), (ids1, lab1))]
    torch.testing.assert_close(
        out.loss, torch.stack([losses[0], losses[0], losses[1], losses[1]]).detach(), **TOL
    )
    out.loss.sum().backward()
    sum(losses).backward()
    # dp replicas differ until reduced
    with pytest.raises(fd.nn.ReplicaMismatchError, match="pmean"):
        pm.grads()
    for p in pm.parameters():  # the data-parallel all-reduce
        p.grad = fd.simulate(lambda g: fd.psum(g, mesh, "dp"), mesh)(p.grad)
    grads = pm.grads()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL)


def test_attention_mask_and_training_mode_on_simulated_ranks() -> None:
    """A padding mask works (the same on every rank: passed unbatched); one that differs across
    ranks raises."""
    ref = build("llama")
    model = copy.deepcopy(ref)
    pm = fd.nn.parallelize(
        model,
        fd.Mesh({"dp": 2, "tp": 2}),
        fd.nn.plans.plan(model, family="llama", sequence_parallel=True),
    )
    ids, _ = batch()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    want = ref(input_ids=ids, attention_mask=mask).logits
    model.train()  # Llama has no dropout by default: training mode changes nothing
    got = pm(input_ids=rep(ids, pm.mesh), attention_mask=rep(mask, pm.mesh)).logits
    torch.testing.assert_close(full_logits(got, pm.mesh), want.detach(), **TOL)
    # dp replicas with other masks
    other = torch.stack([mask, mask, torch.ones_like(mask), torch.ones_like(mask)])
    with pytest.raises(fd.nn.ParallelizeError, match=r"differ.*attention_mask.*Fix"):
        pm(input_ids=rep(ids, pm.mesh), attention_mask=other)
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"sequence parallelism over 'tp'.*\(2, 7, 32\).*2 ranks.*Fix: pad",
    ):
        # sequence parallelism needs a sequence divisible by tp
        pm(input_ids=rep(ids[:, :7], pm.mesh))


def test_three_adamw_steps_equal_one_device() -> None:
    ref = build("llama", kv=1)
    model = copy.deepcopy(ref)
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(
        model, mesh, fd.nn.plans.plan(model, family="llama", sequence_parallel=True)
    )
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    # elementwise: the stacked update is every rank's update
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for step in range(3):
        ids, labels = batch(10 + step)
        loss_ref = reference_loss(ref, ids, labels)[1]
        loss_ref.backward()
        loss = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh)).loss
        loss.sum().backward()
        torch.testing.assert_close(loss, rep(loss_ref.detach(), mesh), **TOL)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    state = pm.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), **TOL)


def test_missing_pvary_is_caught_when_gradients_are_gathered() -> None:
    """A plan that forgets PvaryParams on sequence-parallel norms: parallelize refuses it; with
    the check off (verify=False), each rank keeps a partial gradient and grads() raises."""
    model = build("llama")
    mesh = fd.Mesh({"tp": 2})
    plan = fd.nn.plans.plan(model, family="llama", sequence_parallel=True)
    del plan["model.layers.*.input_layernorm"]
    with pytest.raises(fd.nn.ParallelizeError, match="input_layernorm"):
        fd.nn.parallelize(copy.deepcopy(model), mesh, plan)
    pm = fd.nn.parallelize(model, mesh, plan, verify=False)
    ids, labels = batch()
    pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh)).loss.sum().backward()
    with pytest.raises(
        fd.nn.ReplicaMismatchError, match=r"input_layernorm\.weight\.grad.*ranks 0 and 1.*pvary"
    ):
        pm.grads()
    assert "model.layers.0.input_layernorm.weight" in pm.grads(check=False)


def test_compiled_parallel_step_is_one_graph_and_equals_eager() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ref = build("llama", layers=1)
    model = copy.deepcopy(ref)
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(
        model, mesh, fd.nn.plans.plan(model, family="llama", sequence_parallel=True)
    )
    ids, labels = batch()

    def step(ids: Tensor, labels: Tensor) -> Tensor:
        return pm(input_ids=ids, labels=labels).loss

    eager = step(rep(ids, mesh), rep(labels, mesh))
    eager.sum().backward()
    want = {n: p.grad.clone() for n, p in pm.named_parameters()}
    pm.module.zero_grad(set_to_none=True)
    got = torch.compile(step, fullgraph=True)(rep(ids, mesh), rep(labels, mesh))
    got.sum().backward()
    assert not counters["graph_break"]
    # Llama's rotary embedding is computed in float32 by design: compiled and eager round it
    # differently
    torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-7)
    for name, p in pm.named_parameters():
        torch.testing.assert_close(
            p.grad,
            want[name],
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m: f"{name}: {m}",  # noqa: B023 (called at once)
        )


def test_sharded_logits_and_causal_lm_loss_on_tied_gpt2() -> None:
    """GPT-2 ties its LM head to the token embedding: one parameter stays, sharded once, with both
    uses' gradients."""
    model = build("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    mesh = fd.Mesh({"tp": 4})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, family="gpt2"))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert tuple(model.lm_head.weight.shape) == (4, 16, 32)  # [rank, ceil(61 / 4), hidden]
    assert "lm_head.weight" not in pm.layouts and pm.layouts["transformer.wte.weight"].size == VOCAB


# ============================================================================ checkpoints
def test_load_from_save_pretrained_reads_slices_and_round_trips(tmp_path: Any) -> None:
    from safetensors.torch import load_file

    ref = build("gpt2", seed=3)
    ref.save_pretrained(tmp_path / "ckpt")
    model = build("gpt2", seed=4)  # other weights: everything must come from the checkpoint
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(
        model, mesh, fd.nn.plans.plan(model, family="gpt2", sequence_parallel=True)
    )
    fd.checkpoint.load(tmp_path / "ckpt", pm)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(pm.state_dict()[name], p.detach(), rtol=0, atol=0)
    ids, labels = batch()
    out = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    torch.testing.assert_close(out.loss[0], reference_loss(ref, ids, labels)[1].detach(), **TOL)
    fresh = build("gpt2", seed=5)
    # strict: tied lm_head.weight included, as nn.Module.state_dict gives it
    fresh.load_state_dict(pm.state_dict())
    fd.checkpoint.load(
        fresh.state_dict(), pm
    )  # and HF's own state dict (with the tied key) loads back
    (tmp_path / "back").mkdir()
    fd.checkpoint.save(
        tmp_path / "back", pm, format="safetensors"
    )  # a directory: model.safetensors in it
    saved = load_file(str(tmp_path / "back" / "model.safetensors"))
    original = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert saved.keys() == original.keys()
    for key in original:
        assert torch.equal(saved[key], original[key]), key


def test_load_checkpoint_is_strict(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    ref = build("llama", kv=1)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    model = build("llama", kv=1)
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, family="llama"))

    bad = dict(state, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(50, 32, dtype=F64)})
    save_file(bad, str(tmp_path / "shape.safetensors"))
    with pytest.raises(
        fd.nn.CheckpointError,
        match=(
            r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(50, 32\).*expects \(48, 32\) "
            r"\(each rank holds \(24, 32\)\)"
        ),
    ):
        fd.checkpoint.load(tmp_path / "shape.safetensors", pm)
    with pytest.raises(fd.nn.CheckpointError, match=r"unexpected keys \['extra\.weight'\]"):
        fd.checkpoint.load(dict(state, **{"extra.weight": torch.zeros(1)}), pm)
    missing = {k: v for k, v in state.items() if k != "lm_head.weight"}
    with pytest.raises(fd.nn.CheckpointError, match=r"missing keys \['lm_head\.weight'\]"):
        fd.checkpoint.load(missing, pm)
    fd.checkpoint.load(missing, pm, strict=False)  # explicitly partial
    renamed = {
        ("backbone." + k[len("model.") :] if k.startswith("model.") else k): v
        for k, v in state.items()
    }
    fd.checkpoint.load(
        renamed,
        pm,
        rename=lambda k: "backbone." + k[len("model.") :] if k.startswith("model.") else k,
    )
    torch.testing.assert_close(pm.state_dict()["model.norm.weight"], state["model.norm.weight"])


def test_buffers_load_and_gather_whole_also_into_a_meta_model() -> None:
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 6)
            self.register_buffer("scale", torch.tensor([2.0, 3.0]))  # persistent: in the state dict

        def forward(self, x: Tensor) -> Tensor:
            return self.lin(x) * self.scale[0]

    model, mesh = Scaled(), fd.Mesh({"tp": 2})
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pm = fd.nn.parallelize(
        model, mesh, {"lin": fd.nn.ColwiseParallel(input="replicated", gather_output=True)}
    )
    assert {k: torch.equal(v, state[k]) for k, v in pm.state_dict().items()} == {
        "lin.weight": True,
        "lin.bias": True,
        "scale": True,
    }
    fd.checkpoint.load({**state, "scale": torch.tensor([5.0, 6.0])}, pm)
    assert model.scale.tolist() == [5.0, 6.0]  # a buffer: whole, no rank dim
    x = torch.randn(3, 4)
    torch.testing.assert_close(
        pm(x.expand(2, 3, 4))[1],
        torch.nn.functional.linear(x, state["lin.weight"], state["lin.bias"]) * 5.0,
    )
    # built on the meta device: parallelize makes meta shards, load gives them (and the persistent
    # buffer) storage and values (more in tests/test_meta.py)
    with torch.device("meta"):
        meta = Scaled()
    pm = fd.nn.parallelize(
        meta, mesh, {"lin": fd.nn.ColwiseParallel(input="replicated", gather_output=True)}
    )
    assert meta.lin.weight.is_meta and tuple(meta.lin.weight.shape) == (2, 3, 4)
    fd.checkpoint.load({**state, "scale": torch.tensor([5.0, 6.0])}, pm)
    assert not meta.lin.weight.is_meta and meta.scale.tolist() == [5.0, 6.0]
    torch.testing.assert_close(
        pm(x.expand(2, 3, 4))[1],
        torch.nn.functional.linear(x, state["lin.weight"], state["lin.bias"]) * 5.0,
    )


# ============================================================================ errors
def test_plan_errors_name_the_module_and_the_fix() -> None:
    mesh = fd.Mesh({"tp": 3})
    with pytest.raises(
        fd.nn.ParallelizeError, match=r"'model\.layers\.0\.self_attn' has 4 query heads.*3 ranks"
    ):
        fd.nn.parallelize(build("llama"), mesh)
    with pytest.raises(fd.nn.ParallelizeError, match=r"3 kv heads.*2 ranks"):
        fd.nn.HeadParallelAttention(6, 3, 8).local_heads(2, "attn")
    with pytest.raises(fd.nn.ParallelizeError, match=r"match no module.*model\.embed_tokens"):
        fd.nn.parallelize(
            build("llama"), fd.Mesh({"tp": 2}), {"model.embed": fd.nn.VocabParallel()}
        )
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"'model\.norm' is a LlamaRMSNorm; ColwiseParallel\(axis='tp'\) needs "
        r"nn\.Linear.*Fix: ",
    ):
        fd.nn.parallelize(
            build("llama"), fd.Mesh({"tp": 2}), {"model.norm": fd.nn.ColwiseParallel()}
        )
    with pytest.raises(fd.nn.ParallelizeError, match=r"no ready-made plan for Linear"):
        fd.nn.parallelize(torch.nn.Linear(2, 2), fd.Mesh({"tp": 2}))


def test_mistakes_raise_before_anything_changes() -> None:
    """Each found by trying the feature as a new user: a subclass with its own forward, a plan from
    another config, a style class instead of an instance, parallelizing twice. The model is
    untouched when a plan is refused."""
    gemma_cfg = transformers.GemmaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    # its embedding scales by sqrt(hidden) in its own forward
    gemma = transformers.GemmaForCausalLM(gemma_cfg)
    before = {n: type(m) for n, m in gemma.named_modules()}
    mesh = fd.Mesh({"tp": 2})
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"'model\.embed_tokens' is a GemmaTextScaledWordEmbedding.*own forward",
    ):
        fd.nn.parallelize(gemma, mesh, fd.nn.plans.plan(gemma, family="llama"))
    assert {
        n: type(m) for n, m in gemma.named_modules()
    } == before and gemma.lm_head.weight.dim() == 2  # nothing swapped or sharded
    model = build("llama")
    other = copy.deepcopy(model.config)
    other.num_key_value_heads = 1
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"k_proj has 16 output features.*1 kv heads and head_dim 8 say 8",
    ):
        fd.nn.parallelize(model, mesh, fd.nn.plans.plan(other, family="llama"))
    with pytest.raises(
        fd.nn.ParallelizeError, match=r"the class itself: write ColwiseParallel\(\)"
    ):
        fd.nn.parallelize(model, mesh, {"lm_head": fd.nn.ColwiseParallel})  # type: ignore[dict-item]
    fd.nn.parallelize(model, mesh)
    with pytest.raises(fd.nn.ParallelizeError, match="already parallel"):
        fd.nn.parallelize(model, mesh)


def test_bad_inputs_raise_instead_of_computing_something_else() -> None:
    model = build("llama")
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(model, mesh)
    ids, labels = batch()
    bad = ids.clone()
    bad[0, 0] = (
        5000  # nn.Embedding raises IndexError; a vocabulary-parallel lookup would give a zero row
    )
    with pytest.raises(
        fd.TargetError,
        match=r"VocabParallelEmbedding.*token ids are out of range, bad values \[5000\]",
    ):
        pm(input_ids=rep(bad, mesh))
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"'input_ids' differs between ranks 0 and 1, which form one 'tp' group",
    ):
        pm(input_ids=torch.stack([ids, batch(5)[0]]))  # a data loader keyed on the global rank
    # transformers' Trainer passes num_items_in_batch as a 0-d tensor: it goes to every rank as is
    out = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh), num_items_in_batch=torch.tensor(5))
    logits = build("llama")(input_ids=ids).logits
    want = (
        F.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB),
            labels[:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        / 5
    )
    torch.testing.assert_close(out.loss, rep(want.detach(), mesh), **TOL)
    # no KV cache in the tuple
    assert isinstance(pm(input_ids=rep(ids, mesh), return_dict=False)[0], Tensor)
    # transformers' models call loss_function(logits, labels, vocab_size, ...) by position too
    sharded = pm(input_ids=rep(ids, mesh)).logits
    by_position = fd.simulate(lambda lg, lab: model.loss_function(lg, lab, VOCAB), mesh)(
        sharded, rep(labels, mesh)
    )
    torch.testing.assert_close(
        by_position, rep(reference_loss(build("llama"), ids, labels)[1].detach(), mesh), **TOL
    )


def test_training_mode_with_dropout_is_refused() -> None:
    # dropout 0.1 by default
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg).to(F64)
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(model, mesh)
    ids, _ = batch()
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"training mode with dropout \(transformer\.drop.*model\.eval\(\)",
    ):
        pm(input_ids=rep(ids, mesh))
    model.eval()
    assert pm(input_ids=rep(ids, mesh)).logits.shape == (2, 2, 8, 31)


def test_no_batching_warning_from_a_simulated_model() -> None:
    model = build("llama", layers=1)
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(model, mesh)
    ids, labels = batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh)).loss.sum().backward()
    assert not [w for w in caught if "batching rule" in str(w.message)], [
        str(w.message)[:120] for w in caught
    ]


# ============================================================================ real processes
@pytest.mark.parametrize(
    "family, world, sp, compiled",
    [
        ("llama", 4, True, False),
        ("gpt2", 2, True, False),
        ("qwen2", 2, False, False),
        ("llama", 2, True, True),
    ],
)
def test_parallel_training_on_gloo_from_save_pretrained(
    tmp_path: Any, family: str, world: int, sp: bool, compiled: bool
) -> None:
    """Each gloo rank reads its slices of a save_pretrained checkpoint, trains 3 AdamW steps,
    matches one device; rank 0 saves. With ``compiled``, a torch.compile(fullgraph=True) step on the
    real ranks equals eager."""
    from safetensors import safe_open

    from tests.dist_harness import run_on_gloo
    from tests.hf_worker import parallel_training_on_gloo

    ref = build(family, kv=2)  # llama on 4 ranks: 2 kv heads, replicated
    ref.save_pretrained(tmp_path)
    assert (
        run_on_gloo(
            parallel_training_on_gloo,
            world,
            family,
            str(tmp_path),
            sp,
            1 if compiled else 3,
            compiled,
            timeout=400,
        )
        == ["ok"] * world
    )
    with safe_open(str(tmp_path / "trained.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(ref.state_dict()) - (
            {"lm_head.weight"} if family == "gpt2" else set()
        )
