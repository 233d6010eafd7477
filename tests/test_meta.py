"""Models that never sit whole on one rank: built on the meta device, parallelized, then
materialised shard by shard (``fd.checkpoint.load`` from a save_pretrained checkpoint, or
``fd.nn.init_weights(pm)``), against the same model on one device in float64.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fastdist as fd

pytest.importorskip("transformers")

from tests.test_hf_models import (  # noqa: E402
    TOL,
    batch,
    build,
    full_logits,
    reference_loss,
    rep,
)


def on_meta(family: str, **kw: Any) -> Any:
    """``build(family)`` under ``torch.device("meta")``: shapes, no values."""
    with torch.device("meta"):
        return build(family, **kw)


def meta_left(model: nn.Module) -> list[str]:
    return [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]


def check_against(pm: fd.nn.ParallelModel, ref: nn.Module, mesh: fd.Mesh) -> None:
    """Logits, loss and every gradient of ``pm`` equal the one-device ``ref``'s to 1e-10."""
    ids, labels = batch()
    out = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    want_logits, want_loss = reference_loss(ref, ids, labels)
    torch.testing.assert_close(full_logits(out.logits, mesh), want_logits.detach(), **TOL)
    torch.testing.assert_close(out.loss, rep(want_loss.detach(), mesh), **TOL)
    out.loss.sum().backward()
    want_loss.backward()
    grads = pm.grads()
    assert grads.keys() == {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


# ============================================================================ load
@pytest.mark.parametrize(
    "family, tp, sp",
    [("llama", 2, False), ("llama", 4, True), ("gpt2", 2, True)],  # llama tp=4: kv heads replicated
)
def test_meta_model_loads_its_shards_and_matches_one_device(
    tmp_path: Any, family: str, tp: int, sp: bool
) -> None:
    ref = build(family, seed=3)
    ref.save_pretrained(tmp_path)
    model = on_meta(family)
    mesh = fd.Mesh({"tp": tp})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=sp))
    if family == "gpt2":  # tied, vocabulary 61 padded: meta shards of the local shape, still tied
        assert model.lm_head.weight is model.transformer.wte.weight
        assert model.lm_head.weight.is_meta and tuple(model.lm_head.weight.shape) == (2, 31, 32)
    else:  # stacked (in, out)-contiguous as from a real model
        q = model.model.layers[0].self_attn.q_proj.weight
        assert (
            q.is_meta
            and tuple(q.shape) == (tp, 32 // tp, 32)
            and q.stride() == (1024 // tp, 1, 32 // tp)
        )
    fd.checkpoint.load(tmp_path, pm)
    assert meta_left(model) == []
    if family == "llama":  # a non-persistent buffer: recomputed by the model's own init
        assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    if family == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight
    check_against(pm, ref, mesh)


def test_meta_mixtral_loads_through_its_ready_plan() -> None:
    """Experts over ep, attention and each expert's features over tp, from a state dict
    (transformers 5 saves Mixtral in the per-expert layout of older checkpoints, which the model's
    own names do not match)."""
    from tests.test_moe import build_mixtral, lm_batch, reference, whole_logits

    ref = build_mixtral(seed=3)
    with torch.device("meta"):
        model = build_mixtral()
    mesh = fd.Mesh({"ep": 2, "tp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, family="mixtral", axis="tp"))
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    assert experts.is_meta and tuple(experts.shape) == (4, 2, 16, 32)
    fd.checkpoint.load(ref.state_dict(), pm)
    assert meta_left(model) == []
    ids, labels = lm_batch()
    out = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    logits, _, aux = reference(ref, ids, labels)
    torch.testing.assert_close(whole_logits(out.logits, mesh, "tp"), logits.detach(), **TOL)
    torch.testing.assert_close(out.aux_loss, rep(aux.detach(), mesh), **TOL)


@contextmanager
def params_on_meta() -> Iterator[None]:
    """accelerate's ``init_empty_weights()`` (include_buffers=False): every parameter registered
    on the meta device, buffers real."""
    register = nn.Module.register_parameter

    def to_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None:
            p = self._parameters[name]
            assert p is not None
            self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = to_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def test_init_empty_weights_style_and_dtype(tmp_path: Any) -> None:
    """Parameters on meta, buffers real (accelerate's way); load(dtype=) sets the parameters' dtype,
    buffers keep theirs."""
    ref = build("llama", seed=3)
    ref.save_pretrained(tmp_path)
    with params_on_meta():
        model = build("llama")
    assert model.lm_head.weight.is_meta and not model.model.rotary_emb.inv_freq.is_meta
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(
        model, mesh, fd.nn.plans.plan(model, family="llama", sequence_parallel=True)
    )
    fd.checkpoint.load(tmp_path, pm)
    assert meta_left(model) == []
    check_against(pm, ref, mesh)

    model32 = on_meta("llama")
    pm32 = fd.nn.parallelize(model32, mesh, fd.nn.plans.plan(model32, family="llama"))
    fd.checkpoint.load(tmp_path, pm32, dtype=torch.float32)
    assert {p.dtype for p in model32.parameters()} == {torch.float32}
    assert model32.model.rotary_emb.inv_freq.dtype == torch.float64  # as built
    want = ref.model.layers[1].mlp.down_proj.weight.detach().float()
    torch.testing.assert_close(pm32.state_dict()["model.layers.1.mlp.down_proj.weight"], want)


# ============================================================================ init_weights
def by_hand(model: Any, seed: int) -> Any:
    """The procedure the docs state, written out on a real one-device model: every module,
    children first, its init (transformers' ``_init_weights``) seeded with module_seed."""
    order: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, name: str) -> None:
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)
        order.append((name, module))

    visit(model, "")
    for name, module in order:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(fd.nn.module_seed(seed, name))
            model._init_weights(module)
    return model


def test_module_seed_is_the_documented_hash() -> None:
    digest = hashlib.sha256(b"7/model.layers.0.mlp").digest()
    assert fd.nn.module_seed(7, "model.layers.0.mlp") == int.from_bytes(digest[:8], "big") >> 1


@pytest.mark.parametrize("family, axes", [("llama", {"tp": 4}), ("gpt2", {"tp": 2})])
def test_init_weights_on_shards_equals_one_device(family: str, axes: dict[str, int]) -> None:
    """Each rank's shards are slices of what the one-device helper gives (bitwise); the helper is
    the documented procedure (by hand, on a real model); the parallel model then computes what
    the helper's model computes. GPT-2's attention re-initialises its c_proj child (scaled):
    that write wins, as on one device."""
    model = on_meta(family)
    mesh = fd.Mesh(axes)
    pm = fd.nn.parallelize(model, mesh)
    state = torch.get_rng_state()
    fd.nn.init_weights(pm, seed=7)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is left as it was
    assert meta_left(model) == []
    one = fd.nn.init_weights(on_meta(family), seed=7)
    by_hand_state = by_hand(build(family), 7).state_dict()
    got, want = pm.state_dict(), one.state_dict()
    assert got.keys() == want.keys() == by_hand_state.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
        assert torch.equal(want[name], by_hand_state[name]), name
    if family == "gpt2":
        std = want["transformer.h.0.attn.c_proj.weight"].std().item()
        assert abs(std - 0.02 / 2) < 0.003, std  # initializer_range / sqrt(2 * n_layer)
    else:  # every module its own seed: layers differ
        up = [want[f"model.layers.{i}.mlp.up_proj.weight"] for i in (0, 1)]
        assert not torch.equal(*up)
    check_against(pm, one.eval(), mesh)


def test_init_weights_mixtral_and_a_plain_torch_model() -> None:
    """Mixtral's experts and router through its ready plan; a model that is not a transformers
    model gets each module's reset_parameters (torch's own init), seeded the same way."""
    from tests.test_moe import build_mixtral

    with torch.device("meta"):
        model = build_mixtral()
    pm = fd.nn.parallelize(
        model, fd.Mesh({"ep": 2, "tp": 2}), fd.nn.plans.plan(model, family="mixtral")
    )
    fd.nn.init_weights(pm, seed=3)
    with torch.device("meta"):
        one = build_mixtral()
    fd.nn.init_weights(one, seed=3, device="cpu")
    got = pm.state_dict()
    assert all(torch.equal(got[n], v) for n, v in one.state_dict().items())

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    with torch.device("meta"):
        meta = mlp()
    plan = {"0": fd.nn.ColwiseParallel(input="replicated"), "2": fd.nn.RowwiseParallel()}
    pm = fd.nn.parallelize(meta, fd.Mesh({"tp": 2}), plan)
    fd.nn.init_weights(pm, seed=1)
    ref = mlp()
    for i in (0, 2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(fd.nn.module_seed(1, str(i)))
            ref[i].reset_parameters()
    got = pm.state_dict()
    assert all(torch.equal(got[n], v) for n, v in ref.state_dict().items())


# ============================================================================ errors
def test_a_meta_model_refuses_to_run_and_partial_loads(tmp_path: Any) -> None:
    ref = build("llama", seed=3)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    model = on_meta("llama")
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(
        model, mesh, fd.nn.plans.plan(model, family="llama", sequence_parallel=True)
    )
    ids, _ = batch()
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"called with \['model\.embed_tokens\.weight'.*meta device.*"
        r"Fix: .*fastdist\.checkpoint\.load\(path, pm\) or fastdist\.nn\.init_weights\(pm",
    ):
        pm(input_ids=rep(ids, mesh))
    with pytest.raises(fd.nn.CheckpointError, match=r"meta device.*Fix: materialise"):
        pm.state_dict()
    partial = {k: v for k, v in state.items() if k != "lm_head.weight"}
    with pytest.raises(fd.nn.CheckpointError, match=r"missing keys \['lm_head\.weight'\]"):
        fd.checkpoint.load(partial, pm)
    with pytest.raises(
        fd.nn.CheckpointError,
        match=r"\['lm_head\.weight'\] are on the meta device and the checkpoint has no key.*"
        r"init_weights",
    ):
        fd.checkpoint.load(partial, pm, strict=False)
    assert model.model.embed_tokens.weight.is_meta  # refused before anything was read
    # the way to load part of a model: initialise, then load what the checkpoint has
    fd.nn.init_weights(pm, seed=1)
    fd.checkpoint.load(partial, pm, strict=False)
    got = pm.state_dict()
    head = fd.nn.init_weights(on_meta("llama"), seed=1).lm_head.weight
    assert torch.equal(got["lm_head.weight"], head)
    assert torch.equal(
        got["model.layers.1.mlp.up_proj.weight"], state["model.layers.1.mlp.up_proj.weight"]
    )
    with pytest.raises(fd.nn.CheckpointError, match=r"device='cuda'.*none on the meta device"):
        fd.checkpoint.load(state, pm, device="cuda")
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"holds per-rank parameters.*Fix: pass the ParallelModel itself, "
        r"fastdist\.nn\.init_weights\(pm",
    ):
        fd.nn.init_weights(model)


class Table(nn.Module):
    """A buffer computed at construction that no init recomputes, and a parameter no init
    writes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.gain = nn.Parameter(torch.ones(6))
        self.register_buffer("table", torch.arange(6.0), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * self.gain + self.table


def test_what_cannot_be_recomputed_is_named() -> None:
    with torch.device("meta"):
        model = Table()
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(
        model, mesh, {"lin": fd.nn.ColwiseParallel(input="replicated", gather_output=True)}
    )
    state = {k: v for k, v in Table().state_dict().items()}
    with pytest.raises(
        fd.nn.CheckpointError,
        match=r"non-persistent buffers \['table'\].*no init of the model computes them.*"
        r"Fix: .*register_buffer",
    ):
        fd.checkpoint.load(state, pm)
    with pytest.raises(
        fd.nn.ParallelizeError, match=r"no init of Table writes \['gain', 'table'\].*Fix"
    ):
        fd.nn.init_weights(pm)
    assert model.lin.weight.is_meta  # refused before anything changed
    model.register_buffer("table", torch.arange(6.0), persistent=False)  # the fix
    fd.checkpoint.load(state, pm)
    x = torch.randn(3, 4)
    want = Table()
    want.load_state_dict(state)
    torch.testing.assert_close(pm(x.expand(2, 3, 4))[0], want(x).detach())


# ============================================================================ real processes
def test_meta_llama_on_two_gloo_processes(tmp_path: Any) -> None:
    """Each rank allocates and reads only its shards of a save_pretrained checkpoint and matches
    one device; init_weights on ranks equals the one-device helper."""
    from tests.dist_harness import run_on_gloo
    from tests.meta_worker import meta_llama_on_gloo

    build("llama", seed=3).save_pretrained(tmp_path)
    assert run_on_gloo(meta_llama_on_gloo, 2, str(tmp_path), timeout=300) == ["ok", "ok"]
