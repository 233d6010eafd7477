"""The planner's pipelines (issue 34.6): ``predict(..., pipeline=Pipeline(...))`` and ``plan(...,
pipeline=...)`` against closed forms written by hand.

Toy model: ``L`` bias-free ``Linear(d, d)`` layers named ``layers.N`` (traced on meta tensors), a
network that charges matmul FLOPs only (no memory traffic, no per-kernel cost), so every time is
FLOPs / rate plus alpha-beta terms.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import fastdist as fd
from fastdist.profile import (
    CostModel,
    Fit,
    Layout,
    Link,
    Network,
    Pipeline,
    Profile,
    ProfileError,
    plan,
    predict,
    trace,
)
from fastdist.train.schedules import theoretical_bubble

F4 = 4  # bytes per float32
RATE = 1e9  # FLOP/s
NET = Network("toy", 2, Link(1e10, 1e-6), Link(1e8, 1e-5), flops=RATE)  # 2 GPUs a node


class Stack(nn.Module):
    """``scale`` (a per-feature gain, registered first), ``L`` layers, ``head`` (last)."""

    def __init__(self, layers: int, d: int, ends: bool = False) -> None:
        super().__init__()
        self.d, self.ends = d, ends
        if ends:
            self.scale = nn.Parameter(torch.empty(d))
        self.layers = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(layers))
        if ends:
            self.head = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ends:
            x = x * self.scale
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.ends else x


def _model(layers: int, d: int, ends: bool = False) -> Stack:
    with torch.device("meta"):
        return Stack(layers, d, ends)


def _chained(model: Stack, mesh: fd.Mesh, tokens: int) -> Profile:
    """Forward and backward of ``tokens`` rows (no input gradient for the first layer)."""
    x = torch.empty(tokens, model.d, device="meta")
    return trace(lambda x: model(x).sum().backward(), mesh, x, modules=[model])


def _detached(model: Stack, mesh: fd.Mesh, tokens: int) -> Profile:
    """Each layer's input detached: the backward computes weight gradients only, so it costs
    exactly the forward's FLOPs (equal F and B)."""

    def step(x: torch.Tensor) -> None:
        total = x.new_zeros(())
        for layer in model.layers:
            y = layer(x)
            total = total + y.sum()
            x = y.detach()
        total.backward()  # type: ignore[no-untyped-call]

    x = torch.empty(tokens, model.d, device="meta")
    return trace(step, mesh, x, modules=[model])


# ====================================================================== the step, by hand
@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_equal_costs_step_bubble_and_sends_closed_form(schedule: str, virtual: int) -> None:
    """F = B: the step is (v m + pp - 1) x 2 actions of (F + B) / (2 v) each, the bubble the
    textbook (pp - 1) / (v m + pp - 1), the sends 2 (stages - 1) per micro-batch."""
    L, d, t, pp, m = 4, 64, 32, 2, 4
    prof = _detached(_model(L, d), fd.Mesh({"pp": pp}), t)
    fwd_flops = L * 2 * t * d * d  # per micro-batch, whole model
    assert prof.flops("forward") == prof.flops("backward") == fwd_flops
    pred = predict(prof, NET, pipeline=Pipeline(m, schedule, virtual))
    cost = pred.pipeline
    assert cost is not None
    boundary = t * d * F4  # a layer's output, per micro-batch
    transfer = NET.intra.latency + boundary / NET.intra.bandwidth  # the pp pair is in one node
    c = fwd_flops / RATE / pp + virtual * transfer  # F = B per rank and micro-batch
    assert cost.boundary_bytes == boundary and cost.transfer == pytest.approx(transfer, rel=1e-12)
    assert cost.forward == pytest.approx(c, rel=1e-12) and cost.backward == cost.forward
    makespan = 2 * c * (virtual * m + pp - 1) / virtual
    assert pred.time == pytest.approx(makespan, rel=1e-12) == cost.makespan
    assert cost.bubble == pytest.approx((pp - 1) / (virtual * m + pp - 1), rel=1e-12)
    assert cost.bubble == pytest.approx(theoretical_bubble(schedule, pp, m, virtual), rel=1e-12)
    # the sends: (stages - 1) boundaries, forward and backward, per micro-batch
    stages = pp * virtual
    sends = pred.profile.filter(axis="pp") if pred.profile else None
    assert sends is not None
    assert [(r.op, r.phase, r.size, r.kind) for r in sends] == [
        *[("send", "forward", boundary, "sendrecv")] * (stages - 1),
        *[("send", "backward", boundary, "sendrecv")] * (stages - 1),
    ]
    assert m * sends.size() == 2 * (stages - 1) * m * boundary
    assert pred.by_axis == {"pp": pytest.approx(2 * m * virtual * transfer, rel=1e-12)}
    assert pred.compute == pytest.approx(m * 2 * fwd_flops / RATE / pp, rel=1e-12)
    assert pred.exposed == pytest.approx(pred.time - pred.compute, rel=1e-12)
    assert str(pred.layout) == f"pp2 ({Pipeline(m, schedule, virtual)})"


def test_unequal_costs_1f1b_and_gpipe_makespan() -> None:
    """B != F, and stages that differ: layer 0's backward has no input gradient (u = 2 t d^2
    FLOPs: forward u per layer, backward u on stage 0 and 2u on the others). Every rank is
    charged the slowest stage's; GPipe and 1F1B both take (m + pp - 1)(F + B), the bubble is
    still (pp - 1) / (m + pp - 1) (the timeline's, not a formula in predict)."""
    L, d, t, pp, m = 4, 64, 32, 4, 6
    prof = _chained(_model(L, d), fd.Mesh({"pp": pp}), t)
    u = 2 * t * d * d
    assert (prof.flops("forward"), prof.flops("backward")) == (L * u, L * u + (L - 1) * u)
    # pp4 over 2-GPU nodes: the group crosses nodes, sends go over the inter-node link
    transfer = NET.inter.latency + t * d * F4 / NET.inter.bandwidth
    F, B = u / RATE + transfer, 2 * u / RATE + transfer
    for name in ("gpipe", "1f1b"):
        pred = predict(prof, NET, pipeline=Pipeline(m, name))
        assert pred.time == pytest.approx((m + pp - 1) * (F + B), rel=1e-12), name
        assert pred.pipeline is not None
        assert pred.pipeline.bubble == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-12)
        assert pred.pipeline.finish[0] == pytest.approx(pred.time, rel=1e-12)
        want = [x for j in range(pp) for x in (u / RATE, (1 if j == 0 else 2) * u / RATE)]
        got = [x for stage in pred.pipeline.stages for x in stage]
        assert got == pytest.approx(want, rel=1e-12)


def test_stage_work_by_module_embedding_and_head_on_the_ends() -> None:
    """pp=2 over 2 layers, ``scale`` before them and ``head`` after: the first stage computes
    layer 0 (forward u, backward 2u: its input needs a gradient for ``scale``), the last layer 1
    and the head (forward 2u, backward 4u); the timeline charges every rank the last's."""
    d, t, m = 64, 32, 4
    prof = _chained(_model(2, d, ends=True), fd.Mesh({"pp": 2}), t)
    pred = predict(prof, NET, pipeline=Pipeline(m))
    assert pred.pipeline is not None
    u = 2 * t * d * d / RATE
    got = [x for stage in pred.pipeline.stages for x in stage]
    assert got == pytest.approx([u, 2 * u, 2 * u, 4 * u], rel=1e-12)
    transfer = NET.intra.latency + t * d * F4 / NET.intra.bandwidth
    assert pred.time == pytest.approx((m + 1) * (6 * u + 2 * transfer), rel=1e-12)
    # the rank that ends last is rank 0 (1F1B): its own compute, its sends
    assert pred.compute == pytest.approx(m * 3 * u, rel=1e-12)


def test_sends_priced_by_a_calibrated_cost_model() -> None:
    """With a CostModel the send costs the sendrecv fit of the pp group's size."""
    L, d, t, m = 2, 64, 32, 2
    prof = _detached(_model(L, d), fd.Mesh({"pp": 2}), t)
    fit = Fit("sendrecv", 2, True, latency=5e-5, per_byte=2e-9, error=0.0)
    model = CostModel("job", 2, (fit,), flops=RATE, memory_bandwidth=0.0, kernel_latency=0.0)
    pred = predict(prof, model, pipeline=Pipeline(m))
    assert pred.pipeline is not None
    assert pred.pipeline.transfer == pytest.approx(5e-5 + 2e-9 * t * d * F4, rel=1e-12)
    c = L * 2 * t * d * d / RATE / 2 + pred.pipeline.transfer
    assert pred.time == pytest.approx((m + 1) * 2 * c, rel=1e-12)


def test_pipeline_over_one_rank_is_gradient_accumulation() -> None:
    """pp=1: m micro-batches one after another, no send, one micro-batch's activations held."""
    L, d, t, m = 2, 64, 16, 3
    prof = _chained(_model(L, d), fd.Mesh({"pp": 1, "dp": 1}), t)
    pred = predict(prof, NET, pipeline=Pipeline(m))
    fwd, bwd = L * 2 * t * d * d, L * 2 * t * d * d + (L - 1) * 2 * t * d * d
    assert pred.time == pytest.approx(m * (fwd + bwd) / RATE, rel=1e-12)
    assert pred.pipeline is not None and pred.pipeline.bubble == pytest.approx(0.0, abs=1e-12)
    assert pred.profile is not None and pred.profile.count(axis="pp") == 0
    assert pred.memory is not None and pred.memory.activations == prof.activations


# ====================================================================== memory per rank
@pytest.mark.parametrize("schedule, peaks", [("1f1b", [4, 3, 2, 1]), ("gpipe", [8] * 4)])
def test_memory_per_rank_stage_params_and_peak_in_flight(schedule: str, peaks: list[int]) -> None:
    """pp=4, one layer a stage: ``scale`` (registered before the layers) on the first stage,
    ``head`` (after them) on the last; activations: a stage's share x the micro-batches in
    flight (1F1B: pp - r; GPipe: all m)."""
    L, d, t, pp, m = 4, 32, 16, 4, 8
    prof = _chained(_model(L, d, ends=True), fd.Mesh({"pp": pp}), t)
    assert [p.name for p in prof.params] == [
        "scale",
        *(f"layers.{i}.weight" for i in range(L)),
        "head.weight",
    ]
    layer = d * d * F4
    params = [d * F4 + layer, layer, layer, layer + layer]
    # the worst rank's total, exactly: parameters, gradients, AdamW's two moments, activations
    budget = max(4 * params[r] + prof.activations * peaks[r] // pp for r in range(pp))
    pred = predict(prof, NET, pipeline=Pipeline(m, schedule), memory=budget)
    assert pred.pipeline is not None
    for r, mem in enumerate(pred.pipeline.memory):
        assert mem.params == mem.grads == params[r], r
        assert mem.optimizer == 2 * params[r]  # AdamW: two moments
        assert mem.activations == prof.activations * peaks[r] // pp, r
    assert pred.memory == max(pred.pipeline.memory, key=lambda mem: mem.total)
    assert pred.fits and pred.memory.total == budget
    assert not predict(prof, NET, pipeline=Pipeline(m, schedule), memory=budget - 1).fits


def test_hf_llama_stage_split_and_boundary_from_the_trace() -> None:
    """trace_model of a Llama on pp2 x tp2: the embedding on the first stage, the final norm and
    the LM head on the last, the layers halved; the boundary is a layer's output (the hidden
    states, whole on each tp rank without sequence parallelism)."""
    transformers = pytest.importorskip("transformers")
    from fastdist.profile import trace_model

    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.llama(model))
    ids = torch.zeros(2, 8, dtype=torch.long)  # one micro-batch: 2 sequences of 8
    prof = trace_model(pm, input_ids=ids, labels=ids)
    pred = predict(prof, NET, pipeline=Pipeline(4))
    assert pred.pipeline is not None
    assert pred.pipeline.boundary_bytes == 2 * 8 * 32 * F4

    def held(name: str) -> int:  # the stage by the name, written out
        if "embed_tokens" in name:
            return 0
        if ".layers." in name:
            return int(name.split(".layers.")[1].split(".")[0]) // 2
        assert "model.norm" in name or "lm_head" in name, name
        return 1

    for r in (0, 1):
        want = sum(p.bytes for p in prof.params if held(p.name) == r)
        assert pred.pipeline.memory[r].params == want > 0, r
    assert pred.profile is not None and {r.axis for r in pred.profile.records} == {"tp", "pp"}
    # the work by stage, matmul FLOPs only (links that cost nothing): per tp rank and micro-batch
    # of 16 tokens, a layer runs q 16384, k 8192, v 8192, o 16384, gate, up, down 32768 each and
    # attention 2 sequences x 2 heads x 2 x 8 x 8 x 16 = 8192 forward; its backward twice the
    # linears and 2.5 x the attention; the LM head (32 of the 64 vocabulary rows) 2 x 16 x 32 x
    # 32 forward, twice that backward, on the last stage
    layer_f = 16384 + 8192 + 8192 + 16384 + 3 * 32768 + 8192
    layer_b = 2 * (layer_f - 8192) + 2.5 * 8192
    head_f = 2 * 16 * 32 * 32
    free = Network("flops only", 4, Link(1e30, 0.0), Link(1e30, 0.0), flops=RATE)
    cost = predict(prof, free, pipeline=Pipeline(4)).pipeline
    assert cost is not None
    flops = [2 * layer_f, 2 * layer_b, 2 * layer_f + head_f, 2 * layer_b + 2 * head_f]
    assert [x * RATE for stage in cost.stages for x in stage] == pytest.approx(flops, rel=1e-9)


# ====================================================================== plan: pp against no pp
def _build(model: Stack, tokens: int, m: int) -> Callable[[fd.Mesh], Profile]:
    """The step for a layout: ``tokens`` per step split over dp, and over ``m`` micro-batches
    when the layout has a pipeline (pp > 1)."""

    def build(mesh: fd.Mesh) -> Profile:
        per_rank = tokens // mesh.shape["dp"]
        return _chained(model, mesh, per_rank // (m if mesh.shape["pp"] > 1 else 1))

    return build


def test_plan_memory_budget_only_fits_with_pp() -> None:
    """4 layers of 1 MiB in all: dp4 holds 4 MiB of weights, grads and AdamW state per rank;
    pp2 halves it, pp4 quarters it. A 3 MiB budget: every pp layout fits, dp4 does not."""
    L, d, m = 4, 256, 4
    model = _model(L, d)
    weights = L * d * d * F4
    p = plan(
        _build(model, 64, m),
        4,
        NET,
        axes=("pp", "dp"),
        orders=False,
        data_parallel="dp",
        memory=3 * 2**20,
        pipeline=Pipeline(m),
    )
    by = {str(pr.layout): pr for pr in p.predictions}
    assert set(by) == {"dp4", "pp2 x dp2 (1f1b, 4 micro-batches)", "pp4 (1f1b, 4 micro-batches)"}
    assert by["dp4"].memory is not None and by["dp4"].memory.params == weights
    assert not by["dp4"].fits and p.predictions[-1] is by["dp4"]
    assert all(pr.fits for pr in p.predictions[:-1]) and p.best.layout.pipeline == Pipeline(m)
    for pr in p.predictions:  # plan gives what predict gives for the layout
        again = predict(
            _build(model, 64, m)(pr.layout.mesh),
            NET,
            data_parallel=[a for a in ("dp",) if a in pr.layout.mesh.axis_names],
            memory=3 * 2**20,
            pipeline=pr.layout.pipeline,
        )
        assert (again.time, again.memory) == (pr.time, pr.memory), str(pr.layout)
    table = p.table()
    assert "bubble" in table.splitlines()[1] and "pp (ms)" in table.splitlines()[1]
    assert "0.200" in next(line for line in table.splitlines() if "pp2 x dp2" in line)


def test_plan_slow_network_across_nodes_pp_wins() -> None:
    """2 GPUs a node, a slow network between nodes. dp4 all-reduces 1 MiB of gradients across
    nodes; pp2 x dp2 (stages across nodes, dp inside) sends 8 KiB hidden states across nodes and
    reduces each stage's 512 KiB inside a node: it wins, by the closed forms below."""
    L, d, m, tokens = 4, 256, 4, 64
    model = _model(L, d)
    fwd_tok, bwd_tok = L * 2 * d * d, (2 * L - 1) * 2 * d * d  # FLOPs per token
    # per token and stage of 2 layers: forward 2 x 2d^2; backward 3 x 2d^2 on the first stage
    # (layer 0 has no input gradient), 4 x 2d^2 on the second: the slowest paces the pipeline
    stage_fwd, stage_bwd = 2 * 2 * d * d, 4 * 2 * d * d

    def allreduce(link: Link, n: int, nbytes: float) -> float:
        return 2 * (n - 1) * link.latency + nbytes * 2 * (n - 1) / n / link.bandwidth

    # dp4: 16 tokens a rank; one 1 MiB bucket, ready when the backward ends, across nodes
    dp4 = tokens // 4 * (fwd_tok + bwd_tok) / RATE + allreduce(NET.inter, 4, L * d * d * F4)

    def piped(pp_link: Link, dp_link: Link) -> float:  # pp2 x dp2 in either order
        mb = tokens // 2 // m  # tokens per micro-batch
        send = pp_link.latency + mb * d * F4 / pp_link.bandwidth
        F, B = mb * stage_fwd / RATE + send, mb * stage_bwd / RATE + send
        # rank 0 ends last (1F1B): then its stage's gradients (2 layers) over dp
        return (m + 1) * (F + B) + allreduce(dp_link, 2, L // 2 * d * d * F4)

    cands = [
        Layout((("dp", 4),), unit=("pp",)),
        Layout((("pp", 2), ("dp", 2))),  # stages across nodes, dp inside a node
        Layout((("dp", 2), ("pp", 2))),  # stages inside a node, dp across nodes
    ]
    want = {
        "dp4": dp4,
        "pp2 x dp2 (1f1b, 4 micro-batches)": piped(NET.inter, NET.intra),
        "dp2 x pp2 (1f1b, 4 micro-batches)": piped(NET.intra, NET.inter),
    }
    p = plan(_build(model, tokens, m), cands, NET, data_parallel="dp", pipeline=Pipeline(m))
    got = {str(pr.layout): pr.time for pr in p.predictions}
    assert got == {k: pytest.approx(v, rel=1e-12) for k, v in want.items()}
    assert [str(pr.layout) for pr in p.predictions] == sorted(want, key=want.__getitem__)
    assert str(p.best.layout) == "pp2 x dp2 (1f1b, 4 micro-batches)" and dp4 > 1.15 * p.best.time
    best = p.best
    assert best.profile is not None and best.by_axis["dp"] > 0 and best.by_axis["pp"] > 0
    rows = {(r["axis"], r["op"], r["phase"]): r for r in best.profile.summary()}
    assert rows[("pp", "send", "forward")]["size"] == tokens // 2 // m * d * F4


# ====================================================================== bad input
def test_bad_pipelines_raise_profile_errors_with_a_fix() -> None:
    prof = _chained(_model(4, 32), fd.Mesh({"pp": 2, "dp": 2}), 8)

    def refused(match: str, make: Callable[[], object]) -> None:
        with pytest.raises(ProfileError, match=match) as e:
            make()
        assert e.value.fix and str(e.value).endswith(e.value.fix)

    refused("microbatches=0", lambda: Pipeline(0))
    refused("microbatches=True", lambda: Pipeline(True))
    refused("schedule 'zb' is not known", lambda: Pipeline(4, "zb"))
    refused("'interleaved_1f1b' with virtual=1", lambda: Pipeline(4, "interleaved_1f1b"))
    refused("'1f1b' with virtual=2", lambda: Pipeline(4, "1f1b", virtual=2))
    refused("boundary_bytes=-1", lambda: Pipeline(4, boundary_bytes=-1))
    refused(
        "'stage' is not a non-data axis",
        lambda: predict(prof, NET, pipeline=Pipeline(4, axis="stage")),
    )
    refused(
        "'pp' is not a non-data axis",
        lambda: predict(prof, NET, data_parallel=("dp", "pp"), pipeline=Pipeline(4)),
    )
    # interleaving runs micro-batches in rounds of pp: the schedule's refusal, as a ProfileError
    with pytest.raises(ProfileError, match=r"pipeline over pp=2: .*3 micro-batches") as e:
        predict(prof, NET, pipeline=Pipeline(3, "interleaved_1f1b", 2))
    assert "use 2 or 4 micro-batches" in e.value.fix
    # 4 layers into pp4 x virtual 2 = 8 stages
    prof8 = _chained(_model(4, 32), fd.Mesh({"pp": 4}), 8)
    with pytest.raises(ProfileError, match="4 layers .* into 8 pipeline stages") as e:
        predict(prof8, NET, pipeline=Pipeline(4, "interleaved_1f1b", 2))
    assert "1, 2, 4" in e.value.fix
    # a plain function's trace has no layer module: the boundary must be given
    mesh = fd.Mesh({"pp": 2})
    w = torch.empty(32, 32, device="meta", requires_grad=True)
    plain = trace(lambda x, w: (x @ w).sum().backward(), mesh, torch.empty(8, 32), w)
    refused("no numbered layer module", lambda: predict(plain, NET, pipeline=Pipeline(2)))
    assert predict(plain, NET, pipeline=Pipeline(2, boundary_bytes=1024)).time > 0
    # collectives over the pipeline axis in the traced step
    over = trace(lambda x: fd.psum(x, mesh, "pp").sum(), mesh, torch.empty(8, device="meta"))
    refused(
        "issues psum over the pipeline axis",
        lambda: predict(over, NET, pipeline=Pipeline(2, boundary_bytes=8)),
    )
    # nothing charged: no compute rate and no sends (pp=1)
    one = _chained(_model(2, 32), fd.Mesh({"pp": 1}), 8)
    free = Network("free", 2, Link(1e9, 0.0), Link(1e9, 0.0))
    refused("costs nothing", lambda: predict(one, free, pipeline=Pipeline(2)))
