"""Pipeline parallelism (`fastdist.train.pipeline`) on simulated ranks against one device, in
float64: the loss and every gradient of a step for each schedule (GPipe, 1F1B, interleaved 1F1B)
over pp, pp x tp (with and without sequence parallelism), pp x dp x tp with different data per
data rank, and uneven stages; gradient accumulation over micro-batches equal to the whole batch
(also with ignored labels spread unevenly over the micro-batches); two AdamW steps; clipping by
the whole model's norm; the other families' ready plans; a tied model refused at pp > 1;
loading ``save_pretrained`` output into a model built on the meta device; the timeline the step
ran; and bad input as `fastdist.PipelineError`.

The one-device reference computes the loss by hand in float64 (transformers' own loss upcasts
the logits to float32): the mean cross entropy of the shifted logits over the whole batch's
predicted tokens. Gloo processes and faults are tested elsewhere (real ranks).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fastdist as fd
from fastdist import PipelineError
from tests import tiny_models

transformers = pytest.importorskip("transformers")

F64 = torch.float64
VOCAB = 64
#: loss and gradients against one device (float64 rounding is ~1e-16: anything a stage, a
#: transfer or a reduction got wrong is off by far more)
TOL = {"rtol": 0.0, "atol": 1e-9}
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]


# ============================================================================ models and data
def llama_config(layers: int = 4, **kw: Any) -> Any:
    """The tiny Llama's config at hidden 16 (intermediate 32), vocabulary 64, no q/k/v bias."""
    return tiny_models.config(
        "llama",
        vocab=VOCAB,
        layers=layers,
        hidden_size=16,
        intermediate_size=32,
        attention_bias=False,
        **kw,
    )


def llama(layers: int = 4, seed: int = 0) -> Any:
    """A tiny one-device Llama in float64 (untied embeddings, eval mode)."""
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(layers)).to(F64).eval()


def make_batch(seed: int, B: int = 4, S: int = 8) -> tuple[Tensor, Tensor]:
    """(input_ids, labels) [B, S]; a few labels ignored (-100), unevenly over the rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    labels[B - 1, -2] = -100
    return ids, labels


def hand_loss(model: nn.Module, ids: Tensor, labels: Tensor) -> Tensor:
    """The whole batch's loss on one device, in float64: mean cross entropy over its predicted
    tokens (shifted labels, -100 ignored)."""
    logits = model(input_ids=ids).logits
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def rep(t: Tensor, mesh: fd.Mesh) -> Tensor:
    """The same tensor on every simulated rank: [mesh.size, ...]."""
    return t.expand(mesh.size, *t.shape)


def per_data_rank(
    mesh: fd.Mesh, seed: int, axis: str = "dp"
) -> tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]]]:
    """(ids, labels) [mesh.size, B, S] with a different batch per index along ``axis`` (the same
    over the other axes), and the batches in index order."""
    n = mesh.axis_size(axis) if axis in mesh.axis_names else 1
    batches = [make_batch(seed + 17 * i) for i in range(n)]
    index = [mesh.coords(r).get(axis, 0) for r in range(mesh.size)]
    ids = torch.stack([batches[i][0] for i in index])
    labels = torch.stack([batches[i][1] for i in index])
    return ids, labels, batches


def assert_grads(pipe: Any, ref: nn.Module, tol: dict[str, float] = TOL) -> None:
    """Every parameter's single-device gradient equals the reference's."""
    grads = pipe.grads()
    want = {n: p.grad for n, p in ref.named_parameters()}
    assert grads.keys() == want.keys()
    for name, g in want.items():
        assert g is not None, name
        torch.testing.assert_close(grads[name], g, **tol, msg=lambda m, n=name: f"{n}: {m}")


def check_left_padding(
    ref: nn.Module,
    ids: Tensor,
    labels: Tensor,
    pads: dict[int, int],
    mesh: fd.Mesh,
    pipeline: Any,
) -> None:
    """Rows left-padded (``pads``: row -> padding tokens, their labels ignored) with their
    position ids: the step of ``pipeline(copy of ref)`` on ``mesh`` gets the mask and positions
    and must equal one device's masked loss and gradients (accumulated into ``ref``); the mask
    must matter (the unmasked loss differs by more than 1e-3)."""
    mask = torch.ones_like(ids)
    for row, n in pads.items():
        mask[row, :n] = 0
    labels = labels.masked_fill(mask == 0, -100)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    loss_ref = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    loss_ref.backward()
    assert (hand_loss(copy.deepcopy(ref), ids, labels) - loss_ref).abs() > 1e-3  # it matters
    pipe = pipeline(copy.deepcopy(ref))
    loss = pipe.step(
        input_ids=rep(ids, mesh),
        labels=rep(labels, mesh),
        attention_mask=rep(mask, mesh),
        position_ids=rep(pos, mesh),
    )
    torch.testing.assert_close(loss, rep(loss_ref.detach(), mesh), **TOL)
    assert_grads(pipe, ref)


def assert_weights(pipe: Any, ref: nn.Module, tol: dict[str, float] = TOL) -> None:
    state = pipe.state_dict()
    assert state.keys() >= {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            state[name], p.detach(), **tol, msg=lambda m, n=name: f"{n}: {m}"
        )


# ============================================================================ 1. every layout
#: name -> (mesh axes, layers, pipeline keywords for one stage per rank, for interleaved
#: (two per rank), data parallel over dp). pp alone is also written pp x tp=1 (a tp axis of size
#: 1): the ready plan applies then; test_pipeline_axis_alone_keeps_the_float64_loss covers pp alone
LAYOUTS: dict[str, tuple[dict[str, int], int, dict[str, Any], dict[str, Any], bool]] = {
    "pp2": ({"pp": 2, "tp": 1}, 4, {}, {}, False),
    "pp4": ({"pp": 4, "tp": 1}, 8, {}, {}, False),
    "pp2xtp2": ({"pp": 2, "tp": 2}, 4, {}, {}, False),
    "pp2xtp2-sp": (
        {"pp": 2, "tp": 2},
        4,
        {"sequence_parallel": True},
        {"sequence_parallel": True},
        False,
    ),
    "pp2xdp2xtp2-dp": ({"pp": 2, "dp": 2, "tp": 2}, 4, {}, {}, True),
    "pp2-uneven": (
        {"pp": 2, "tp": 2},
        5,
        {"layers_per_stage": [1, 4]},
        {"layers_per_stage": [2, 1, 1, 1]},
        False,
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name, virtual", SCHEDULES, ids=[s for s, _ in SCHEDULES])
def test_step_equals_one_device(name: str, virtual: int, layout: str) -> None:
    axes, layers, kw, kw_interleaved, dp = LAYOUTS[layout]
    ref = llama(layers)
    mesh = fd.Mesh(axes)
    pp = axes["pp"]
    pipe = fd.train.pipeline(
        copy.deepcopy(ref),
        mesh,
        schedule=name,
        microbatches=4,
        virtual=virtual,
        **(kw_interleaved if virtual > 1 else kw),
    )
    assert pipe.schedule.stages == pp * virtual
    if "layers_per_stage" in kw:
        sizes = kw_interleaved["layers_per_stage"] if virtual > 1 else kw["layers_per_stage"]
        assert [len(r) for r in pipe.layers] == sizes
    if dp:
        fd.train.DataParallel(pipe, "dp")
    ids, labels, batches = per_data_rank(mesh, seed=1)
    loss = pipe.step(input_ids=ids, labels=labels)

    # one device: each data rank's whole-batch loss; the gradient of their mean
    losses = [hand_loss(ref, i, lab) for i, lab in batches]
    (sum(losses) / len(losses)).backward()
    want = torch.stack([losses[mesh.coords(r).get("dp", 0)].detach() for r in range(mesh.size)])
    assert loss.shape == (mesh.size,) and loss.dtype == F64
    torch.testing.assert_close(loss, want, **TOL)
    assert_grads(pipe, ref)


def test_pipeline_axis_alone_keeps_the_float64_loss() -> None:
    """A stage mesh without tp gets no plan; the last stage still computes fastdist's loss, whose
    float64 logits stay float64 (transformers' own upcasts them to float32)."""
    ref = llama()
    mesh = fd.Mesh({"pp": 2})
    pipe = fd.train.pipeline(copy.deepcopy(ref), mesh, schedule="1f1b", microbatches=2)
    ids, labels = make_batch(1)
    loss = pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    loss_ref = hand_loss(ref, ids, labels)
    loss_ref.backward()
    assert loss.dtype == F64
    torch.testing.assert_close(loss, rep(loss_ref.detach(), mesh), **TOL)
    assert_grads(pipe, ref)


# ============================================================================ accumulation
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_micro_batches_accumulate_to_the_whole_batch(name: str) -> None:
    """1, 2 and 4 micro-batches give the same gradients (and one device's), with ignored labels
    counted unevenly per micro-batch: micro-batch 0 predicts 1 token, the others 6 or 7."""
    ref = llama()
    ids, labels = make_batch(3)
    labels[0, :7] = -100  # row 0: one predicted token
    labels[1, 2:4] = -100
    hand_loss(ref, ids, labels).backward()
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    got = []
    for m in (1, 2, 4) if name != "interleaved_1f1b" else (2, 4):
        pipe = fd.train.pipeline(copy.deepcopy(ref), mesh, schedule=name, microbatches=m)
        assert pipe.schedule.microbatches == m
        loss = pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
        torch.testing.assert_close(loss, rep(hand_loss(ref, ids, labels).detach(), mesh), **TOL)
        assert_grads(pipe, ref)
        got.append(pipe.grads())
    for other in got[1:]:
        for n, g in got[0].items():
            torch.testing.assert_close(other[n], g, rtol=0.0, atol=1e-12, msg=n)


def test_two_steps_accumulate_like_two_backwards() -> None:
    """step() adds to .grad as loss.backward() does; zero_grad drops them."""
    ref = llama()
    mesh = fd.Mesh({"pp": 2, "tp": 1})
    pipe = fd.train.pipeline(copy.deepcopy(ref), mesh, schedule="1f1b", microbatches=2)
    for seed in (1, 2):
        ids, labels = make_batch(seed)
        hand_loss(ref, ids, labels).backward()
        pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    assert_grads(pipe, ref)
    pipe.zero_grad()
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_attention_mask_and_position_ids_reach_every_stage(name: str, sp: bool) -> None:
    """Left-padded rows: the mask and the positions are split into micro-batches with the ids
    and every stage uses them (a stage that ignored them would attend to the padding)."""
    ref = llama()
    ids, labels = make_batch(3)
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    check_left_padding(
        ref,
        ids,
        labels,
        {0: 3, 2: 2},
        mesh,
        lambda model: fd.train.pipeline(
            model, mesh, schedule=name, microbatches=2, sequence_parallel=sp
        ),
    )


# ============================================================================ optimizer, clipping
@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b"])
def test_two_adamw_steps_equal_one_device(name: str) -> None:
    ref = llama()
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    pipe = fd.train.pipeline(copy.deepcopy(ref), mesh, schedule=name, microbatches=2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for step in range(2):
        ids, labels = make_batch(10 + step)
        loss_ref = hand_loss(ref, ids, labels)
        loss_ref.backward()
        loss = pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
        torch.testing.assert_close(loss, rep(loss_ref.detach(), mesh), **TOL)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    assert_weights(pipe, ref)
    moved = max(
        (p.detach() - q.detach()).abs().max().item()
        for p, q in zip(ref.parameters(), llama().parameters(), strict=True)
    )
    assert moved > 1e-3  # the steps changed the weights


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize(
    "name, axes",
    [
        ("1f1b", {"pp": 2, "tp": 2}),
        ("interleaved_1f1b", {"pp": 2, "tp": 2}),  # two stages on each rank
        ("gpipe", {"pp": 2, "dp": 2, "tp": 2}),
    ],
    ids=["1f1b", "interleaved", "gpipe-dp"],
)
def test_clip_grad_norm_equals_torch_on_one_device(
    name: str, axes: dict[str, int], norm_type: float
) -> None:
    ref = llama()
    mesh = fd.Mesh(axes)
    pipe = fd.train.pipeline(copy.deepcopy(ref), mesh, schedule=name, microbatches=2)
    if "dp" in axes:
        fd.train.DataParallel(pipe, "dp")
    ids, labels, batches = per_data_rank(mesh, seed=5)
    pipe.step(input_ids=ids, labels=labels)
    losses = [hand_loss(ref, i, lab) for i, lab in batches]
    (sum(losses) / len(losses)).backward()
    torch.testing.assert_close(
        pipe.grad_norm(norm_type),
        rep(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type), mesh),
        **TOL,
    )
    max_norm = 0.05
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    assert want > 2 * max_norm  # the clip scales the gradients down
    got = pipe.clip_grad_norm_(max_norm, norm_type)
    torch.testing.assert_close(got, rep(want, mesh), **TOL)
    assert_grads(pipe, ref)  # clipped by the same factor on every stage


# ============================================================================ families
#: family -> its overrides of the tiny_models row here (untied unless ``tie``)
_FAMILY = {
    "llama": dict(attention_bias=False),
    "qwen3": {},
    "gemma": {},
    "gpt2": {},
    "gpt_neox": {},
    "falcon": {},
    "mixtral": dict(output_router_logits=False, router_aux_loss_coef=0.001),
}


def family_model(family: str, *, tie: bool = False, layers: int = 2, seed: int = 0) -> Any:
    """A tiny float64 model of ``family`` (eval mode); ``tie``: the family's default tied
    embeddings (gemma, gpt2, falcon), else untied. Zero-initialised weights (routers, biases):
    random values."""
    untie = (
        {} if tie or family not in ("gemma", "gpt2", "falcon") else {"tie_word_embeddings": False}
    )
    return tiny_models.build(
        family, vocab=VOCAB, layers=layers, seed=seed, fill_zeros=True, **_FAMILY[family], **untie
    )


#: family -> (schedule, tolerance). Exact to float64 rounding (measured <= 2e-16 on the loss and
#: every gradient) except Gemma: its RMSNorm multiplies by ``1 + weight`` in float32 inside the
#: float64 model (docs/models.md, caveats), so the norm weights' gradients are float32-rounded
#: sums, summed here per micro-batch and per stage: measured up to 4.7e-10 absolute (6e-8
#: relative) over 5 seeds, hence 1e-8. Qwen3's per-head q/k norms round their input to float32
#: too (tests/test_families.py allows 1e-5 there, after AdamW), but at pp2 x tp2 the gradients
#: measured bit-for-bit close (5.6e-17), so it keeps the strict tolerance.
FAMILIES: dict[str, tuple[str, dict[str, float]]] = {
    "qwen3": ("1f1b", TOL),
    "gemma": ("gpipe", {"rtol": 0.0, "atol": 1e-8}),
    "gpt2": ("interleaved_1f1b", TOL),
    "gpt_neox": ("1f1b", TOL),
    "falcon": ("gpipe", TOL),
    "mixtral": ("interleaved_1f1b", TOL),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_at_pp2_tp2_equals_one_device(family: str) -> None:
    name, tol = FAMILIES[family]
    layers = 4 if name == "interleaved_1f1b" else 2
    ref = family_model(family, layers=layers)
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    pipe = fd.train.pipeline(copy.deepcopy(ref), mesh, schedule=name, microbatches=2)
    ids, labels = make_batch(7)
    loss_ref = hand_loss(ref, ids, labels)
    loss_ref.backward()
    loss = pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    torch.testing.assert_close(loss, rep(loss_ref.detach(), mesh), **tol)
    assert_grads(pipe, ref, tol)


@pytest.mark.parametrize("family", ["gemma", "gpt2"])
def test_tied_embeddings_across_stages_equal_one_device(family: str) -> None:
    """Tied input and output embeddings at pp=2 x tp=2: the first and the last stage each hold
    a copy and a step sums their gradients (Megatron's embedding group): the loss and every
    gradient equal one device's, both copies get the tied weight's gradient. At pp=1 the tie
    stays one parameter."""
    ref = family_model(family, tie=True)
    first = next(n for n, p in ref.named_parameters() if p is ref.get_input_embeddings().weight)
    assert ref.get_output_embeddings().weight is ref.get_input_embeddings().weight
    tol = FAMILIES[family][1]
    for mesh, tied in (
        (fd.Mesh({"pp": 2, "tp": 2}), {"lm_head.weight": first}),
        (fd.Mesh({"pp": 1, "tp": 2}), {}),
    ):
        one = copy.deepcopy(ref)
        pipe = fd.train.pipeline(copy.deepcopy(ref), mesh, schedule="1f1b", microbatches=2)
        assert pipe.tied == tied
        ids, labels = make_batch(8)
        loss_ref = hand_loss(one, ids, labels)
        loss_ref.backward()
        loss = pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
        torch.testing.assert_close(loss, rep(loss_ref.detach(), mesh), **tol)
        grads = pipe.grads()
        for alias, name in tied.items():
            assert torch.equal(grads.pop(alias), grads[name])
        want = {n: p.grad for n, p in one.named_parameters()}
        assert grads.keys() == want.keys()
        for name, g in want.items():
            torch.testing.assert_close(grads[name], g, **tol, msg=lambda m, n=name: f"{n}: {m}")


# ============================================================================ loading
@pytest.mark.parametrize("dtype_at", ["build", "load"])
def test_meta_model_loads_save_pretrained_per_stage(tmp_path: Path, dtype_at: str) -> None:
    """save_pretrained output into a model built on the meta device (float64 there, or given
    to load): each stage reads its slices, and a step matches one device."""
    ref = llama(4)
    ref.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(4))
    if dtype_at == "build":
        model = model.to(F64)
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="interleaved_1f1b", microbatches=2)
    assert all(p.is_meta for p in pipe.parameters())
    fd.checkpoint.load(tmp_path, pipe, **({"dtype": F64} if dtype_at == "load" else {}))
    assert not any(p.is_meta for p in pipe.parameters())
    # each stage holds only its layers (and the ends it owns)
    for j, pm in pipe.stages.items():
        names = {n for n, _ in pm.named_parameters()}
        own = {f"model.layers.{i}." for i in pipe.layers[j]}
        assert all(
            any(n.startswith(o) for o in own) or not n.startswith("model.layers.") for n in names
        )
        assert ("model.embed_tokens.weight" in names) == (j == 0)
        assert ("lm_head.weight" in names) == (j == pipe.schedule.stages - 1)
    assert_weights(pipe, ref)
    ids, labels = make_batch(9)
    loss_ref = hand_loss(ref, ids, labels)
    loss_ref.backward()
    loss = pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    torch.testing.assert_close(loss, rep(loss_ref.detach(), mesh), **TOL)
    assert_grads(pipe, ref)


def test_gpt_neox_loads_save_pretrained_whose_head_is_embed_out(tmp_path: Path) -> None:
    """save_pretrained writes GPT-NeoX's lm_head as embed_out: the last stage reads it under the
    model's name (and SPLITS names the module, lm_head)."""
    ref = family_model("gpt_neox")
    ref.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.GPTNeoXForCausalLM(ref.config).to(F64)
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    fd.checkpoint.load(tmp_path, pipe)
    assert_weights(pipe, ref)
    ids, labels = make_batch(4)
    loss_ref = hand_loss(ref, ids, labels)
    loss_ref.backward()
    loss = pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    torch.testing.assert_close(loss, rep(loss_ref.detach(), mesh), **TOL)
    assert_grads(pipe, ref)


# ============================================================================ the timeline
@pytest.mark.parametrize("name, virtual", SCHEDULES, ids=[s for s, _ in SCHEDULES])
def test_events_are_the_schedule_in_order(name: str, virtual: int) -> None:
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    pipe = fd.train.pipeline(llama(), mesh, schedule=name, microbatches=4, virtual=virtual)
    assert pipe.show() == pipe.schedule.show()
    assert pipe.events == []
    ids, labels = make_batch(4)
    pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    s = pipe.schedule
    assert [(e.rank, e.kind, e.microbatch, e.stage) for e in pipe.events] == [
        (s.rank_of(a.stage), a.kind, a.microbatch, a.stage) for a in s.order()
    ]
    assert all(0 <= e.start <= e.end for e in pipe.events)
    starts = [e.start for e in pipe.events]
    assert starts == sorted(starts)
    with pytest.raises(PipelineError, match="simulated mesh.*Fix: pipe.schedule.bubble"):
        pipe.measured_bubble()  # one process runs every stage: no idle time to measure
    # a second step replaces the events
    pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    assert len(pipe.events) == 2 * s.microbatches * s.stages


def test_a_custom_schedule_runs() -> None:
    from fastdist.train.schedules import Action, Schedule

    acts = (
        (Action("F", 0, 0), Action("F", 1, 0), Action("B", 1, 0), Action("B", 0, 0)),
        (Action("F", 0, 1), Action("F", 1, 1), Action("B", 1, 1), Action("B", 0, 1)),
    )
    sched = Schedule("reversed", 2, 2, 1, acts)
    ref = llama()
    mesh = fd.Mesh({"pp": 2, "tp": 1})
    pipe = fd.train.pipeline(copy.deepcopy(ref), mesh, schedule=sched)
    ids, labels = make_batch(6)
    loss_ref = hand_loss(ref, ids, labels)
    loss_ref.backward()
    torch.testing.assert_close(
        pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh)),
        rep(loss_ref.detach(), mesh),
        **TOL,
    )
    assert_grads(pipe, ref)


# ============================================================================ bad input
def _pipe(**kw: Any) -> Any:
    return fd.train.pipeline(llama(), fd.Mesh({"pp": 2, "tp": 2}), **kw)


@pytest.mark.parametrize(
    "build, fragments",
    [
        (
            lambda: _pipe(schedule="interleaved_1f1b", microbatches=3),
            ["3 micro-batches over pp=2", "Fix: use 2 or 4 micro-batches"],
        ),
        (
            lambda: fd.train.pipeline(llama(5), fd.Mesh({"pp": 2})),
            ["5 layers do not split evenly into 2 stages", "Fix:", "1, 5"],
        ),
        (
            lambda: fd.train.pipeline(
                llama(6), fd.Mesh({"pp": 2}), schedule="interleaved_1f1b", virtual=4, microbatches=2
            ),
            ["6 layers do not split evenly into 8 stages"],
        ),
        (lambda: _pipe(layers_per_stage=[1, 2]), ["sums to 3, the model has 4", "Fix:"]),
        (lambda: _pipe(layers_per_stage=[1, 1, 2]), ["for 2 stages. Fix: 2 positive ints"]),
        (lambda: _pipe(schedule="zb_v"), ["'zb_v' is not known", "Fix: use one of gpipe"]),
        (lambda: _pipe(schedule=3), ["schedule=3", "Fix: a name"]),
        (
            lambda: _pipe(schedule="gpipe", virtual=2),
            ["holds one stage per rank, not virtual=2", "Fix:"],
        ),
        (
            lambda: _pipe(schedule=fd.train.schedules.gpipe(4, 4)),
            ["the schedule is for pp=4", "'pp' has 2", "Fix:"],
        ),
        (
            lambda: fd.train.pipeline(llama(), fd.Mesh({"dp": 2, "tp": 2})),
            ["has no axis 'pp'", "Fix:", "axis= one of"],
        ),
        (lambda: fd.train.pipeline(llama(), "pp"), ["is not a fastdist.Mesh", "Fix:"]),
        (
            lambda: fd.train.pipeline(
                nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), fd.Mesh({"pp": 2})
            ),
            ["no stage split for Sequential", "model_type=None", "Fix:", "split="],
        ),
        (
            lambda: fd.train.pipeline(_bloom(), fd.Mesh({"pp": 2})),
            ["no stage split for BloomForCausalLM", "model_type='bloom'", "Fix:"],
        ),
        (
            lambda: _pipe(microbatches=0),
            ["microbatches=0. Fix: a positive int"],
        ),
    ],
    ids=[
        "interleaved-micro",
        "layers-undivided",
        "layers-undivided-virtual",
        "sizes-sum",
        "sizes-length",
        "unknown-schedule",
        "schedule-type",
        "virtual-gpipe",
        "schedule-pp",
        "no-axis",
        "not-a-mesh",
        "sequential",
        "bloom",
        "micro-zero",
    ],
)
def test_bad_pipeline_raises(build: Any, fragments: list[str]) -> None:
    with pytest.raises(PipelineError) as e:
        build()
    msg = str(e.value)
    for f in fragments:
        assert f in msg, (f, msg)
    assert "Fix:" in msg


def _bloom() -> Any:
    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=2, n_head=4)
    with torch.device("meta"):
        return transformers.BloomForCausalLM(cfg)


@pytest.fixture(scope="module")
def pipe22() -> Any:
    return fd.train.pipeline(llama(), fd.Mesh({"pp": 2, "tp": 2}), schedule="1f1b", microbatches=2)


@pytest.mark.parametrize(
    "inputs, fragments",
    [
        (
            lambda ids, lab: {"input_ids": ids[:, :3], "labels": lab[:, :3]},
            ["a batch of 3 sequences does not split into 2 micro-batches", "Fix:", "1, 3"],
        ),
        (lambda ids, lab: {"input_ids": ids}, ["labels= is required", "Fix:"]),
        (lambda ids, lab: {"labels": lab}, ["input_ids= is required", "Fix:"]),
        (lambda ids, lab: {"input_ids": ids, "labels": lab.tolist()}, ["labels= is required"]),
        (
            lambda ids, lab: {"input_ids": ids, "labels": lab, "inputs_embeds": ids},
            ["inputs ['inputs_embeds'] are not supported", "Fix:"],
        ),
        (
            lambda ids, lab: {"input_ids": ids[0, :2], "labels": lab[0, :2]},
            ["input_ids of shape (2, 8)", "leading rank dim", "Fix: pass [4, batch, seq]"],
        ),
        (
            lambda ids, lab: {"input_ids": ids[:2], "labels": lab[:2]},
            ["input_ids of shape (2, 4, 8)", "leading rank dim"],
        ),
        (
            lambda ids, lab: {"input_ids": ids, "labels": lab[..., 0]},
            ["labels of shape (4, 4)", "Fix: [batch, seq]"],
        ),
    ],
    ids=[
        "batch-undivided",
        "no-labels",
        "no-ids",
        "labels-list",
        "unknown-key",
        "no-rank-dim",
        "wrong-rank-dim",
        "labels-shape",
    ],
)
def test_bad_step_input_raises(pipe22: Any, inputs: Any, fragments: list[str]) -> None:
    ids, labels = make_batch(2)
    mesh = pipe22.mesh
    with pytest.raises(PipelineError) as e:
        pipe22.step(**inputs(rep(ids, mesh), rep(labels, mesh)))
    msg = str(e.value)
    for f in fragments:
        assert f in msg, (f, msg)
    assert "Fix:" in msg


def test_dropout_in_training_mode_is_refused_as_on_a_parallel_model() -> None:
    """A stage in training mode with dropout would draw different masks on the ranks of a tp
    group (silently diverging): the step raises as `ParallelModel.__call__` does; in eval mode
    it runs."""
    model = transformers.LlamaForCausalLM(llama_config(4, attention_dropout=0.1)).to(F64).train()
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    ids, labels = make_batch(3)
    with pytest.raises(fd.nn.ParallelizeError, match="training mode with dropout"):
        pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    assert pipe.eval() is pipe and not any(pm.module.training for pm in pipe.stages.values())
    loss = pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    assert torch.isfinite(loss).all()
    assert all(m.training for pm in pipe.train().stages.values() for m in pm.module.modules())


def test_plans_the_stages_cannot_apply_are_refused() -> None:
    """A diffusion transformer's token split (`ContextParallel`: at the first block and the
    output module, which no stage runs in one piece) and a pattern matching no module (each
    stage dropped it) raise at build time, naming the fix; the model is untouched. (A decoder
    LLM's `CausalContextParallel` composes with the stages: tests/test_pipeline_context.py.)"""
    model = llama(4)
    plan = {"model": fd.nn.ContextParallel("cp", blocks="layers")}
    with pytest.raises(PipelineError, match="ContextParallel.*CausalContextParallel"):
        fd.train.pipeline(model, fd.Mesh({"pp": 2, "cp": 2}), plan=plan)
    plan = {
        **fd.nn.plans.plan(model, fd.Mesh({"tp": 2})),
        "model.nothing.*": fd.nn.ColwiseParallel(),
    }
    with pytest.raises(PipelineError, match=r"\['model.nothing.\*'\] match no module"):
        fd.train.pipeline(model, fd.Mesh({"pp": 2, "tp": 2}), plan=plan)
    ids, _ = make_batch(1)
    model(input_ids=ids)  # not taken apart


def test_the_router_load_balancing_loss_is_refused() -> None:
    """An MoE model whose loss adds the load-balancing term: the last stage would compute it
    from its own layers' router logits, per micro-batch (Mixtral, coefficient 0.1, pp x tp gave
    4.37492 against one device's 4.37416): refused at build time, naming the fix."""
    model = family_model("mixtral")
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.1
    with pytest.raises(PipelineError, match=r"load-balancing loss.*output_router_logits = False"):
        fd.train.pipeline(model, fd.Mesh({"pp": 2}))
    model.config.output_router_logits = False
    fd.train.pipeline(model, fd.Mesh({"pp": 2, "ep": 1}))  # experts whole (pp alone: refused)


def test_the_model_given_to_pipeline_refuses_calls() -> None:
    """Its layers belong to the stages now (parallelized in place): calling it raises, naming
    the fix (and the optimizer rule)."""
    model = llama(4)
    fd.train.pipeline(model, fd.Mesh({"pp": 2, "tp": 2}), schedule="1f1b", microbatches=2)
    ids, _ = make_batch(1)
    with pytest.raises(PipelineError, match=r"taken apart.*pipe\.parameters\(\)"):
        model(input_ids=ids)


def test_different_inputs_along_pp_are_refused() -> None:
    """Every stage reads its own copy of the batch: copies that differ along pp (here the
    attention mask of the pp=1 ranks) would mix two batches into one loss, so the step refuses;
    differing along tp is refused by the stage's own check."""
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    pipe = fd.train.pipeline(llama(4), mesh, schedule="1f1b", microbatches=2)
    ids, labels = make_batch(2)
    mask = rep(torch.ones_like(ids), mesh).clone()
    mask[2:, 0, :3] = 0  # ranks 2, 3 (pp=1)
    with pytest.raises(PipelineError, match="ranks along 'pp' were given different attention_mask"):
        pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh), attention_mask=mask)
    other = rep(labels, mesh).clone()
    other[3, 1, 4] = (other[3, 1, 4] + 1) % VOCAB
    with pytest.raises(PipelineError, match="different labels"):
        pipe.step(input_ids=rep(ids, mesh), labels=other)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"attention_mask": "no rank dim"}, "attention_mask of shape"),
        ({"attention_mask": "short"}, "attention_mask of shape"),
        ({"position_ids": "short"}, "position_ids of shape"),
        ({"input_ids": "float"}, "input_ids of dtype torch.float64"),
    ],
)
def test_inputs_of_the_wrong_shape_or_dtype_are_refused(bad: dict[str, str], match: str) -> None:
    mesh = fd.Mesh({"pp": 2})
    pipe = fd.train.pipeline(llama(4), mesh, schedule="1f1b", microbatches=2)
    ids, labels = make_batch(2)
    kw: dict[str, Any] = {"input_ids": rep(ids, mesh), "labels": rep(labels, mesh)}
    (key, how) = next(iter(bad.items()))
    if how == "no rank dim":
        kw[key] = torch.ones_like(ids)
    elif how == "short":
        kw[key] = rep(torch.ones_like(ids), mesh)[..., :6]
    else:
        kw[key] = kw[key].to(F64)
    with pytest.raises(PipelineError, match=match):
        pipe.step(**kw)


# ============================================================================ checkpointing
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_in_a_pipeline_equals_one_device(reentrant: bool) -> None:
    """transformers' gradient checkpointing enabled on the model a pipeline splits (pp2 x tp2):
    the step's gradients are one device's (simulated ranks run each layer once)."""
    ref = llama()
    model = copy.deepcopy(ref)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    ids, labels = make_batch(1)
    loss = pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    loss_ref = hand_loss(ref, ids, labels)
    loss_ref.backward()
    torch.testing.assert_close(loss, rep(loss_ref.detach(), mesh), **TOL)
    assert_grads(pipe, ref)
