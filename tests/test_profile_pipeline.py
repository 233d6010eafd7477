"""The planner's pipelines (issue 34.6): ``predict(..., pipeline=PipelineSpec(...))`` and
``rank_layouts(..., pipeline=...)`` against closed forms written by hand.

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
    Link,
    MeshLayout,
    Network,
    PipelineSpec,
    Profile,
    ProfileError,
    predict,
    rank_layouts,
    trace,
)
from fastdist.train.schedules import Action, Schedule, theoretical_bubble

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
# Notation: f_j, b_j: one micro-batch's forward, backward through stage j; t: the transfer (a
# send from one rank to the next); m micro-batches. An action starts when its rank is free and
# what it waits for has ended (+ t from another rank), so the step is the longest chain of
# actions and transfers; each closed form below names that chain.
def _makespan_by_hand(schedule: str, pp: int, m: int, f: float, b: float, t: float) -> float:
    """Equal stages (f, b each), pp = 2 and m = 4 (v = 2 for the interleaved schedule).

    GPipe: micro-batch 0's forward reaches the last stage after (pp - 1)(f + t), which then
    runs its m forwards and m backwards without a gap, and micro-batch m - 1's backward climbs
    back: (pp - 1)(f + t) + m (f + b) + (pp - 1)(b + t) = (m + pp - 1)(f + b) + 2 (pp - 1) t.

    1F1B, pp = 2 (rank 0: F0 F1 B0 F2 B1 F3 B2 B3): B0 on rank 0 waits for micro-batch 0's
    round trip, f + t + f + b + t; rank 0 then runs F2 (its B1 comes later), micro-batch 2
    goes down (t), rank 1 runs F2 B2 F3 B3 back to back and B3 comes up (t + b):
    2 (f + b) + 2t + f + t + 2 (f + b) + t + b = 5 (f + b) + 4t: one round trip (2t) more
    than GPipe per pp micro-batches, (m + 1)(f + b) + 2 ceil(m / 2) t.

    Interleaved, pp = 2, v = 2 (stages 0, 2 on rank 0, 1, 3 on rank 1), t <= f / 2, f = b:
    micro-batch 0's forward down stages 0..3 (3 (f + t)), then rank 1 runs its 12 actions from
    F0 on stage 3 to B3 on stage 3 without a gap (checked action by action: each arrives while
    rank 1 is still busy when t <= f / 2), then micro-batch 3's backward up stages 2..0
    (3 (b + t)): 18 f + 6 t, i.e. (v m + pp - 1)(f + b) + 6 t.
    """
    assert (pp, m) == (2, 4)
    if schedule == "gpipe":
        return (m + pp - 1) * (f + b) + 2 * (pp - 1) * t
    if schedule == "1f1b":
        return (m + 1) * (f + b) + 2 * -(-m // 2) * t
    assert f == b and t <= f / 2
    return 3 * (f + t) + 12 * f + 3 * (b + t)


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_equal_costs_step_bubble_and_sends_closed_form(schedule: str, virtual: int) -> None:
    """f = b on every stage: the step by the chains above; the bubble is the idle share of
    pp x step (each rank computes m v (f + b)); with free links it is the textbook
    (pp - 1) / (v m + pp - 1); the sends are 2 (stages - 1) per micro-batch."""
    L, d, t, pp, m = 4, 64, 32, 2, 4
    prof = _detached(_model(L, d), fd.Mesh({"pp": pp}), t)
    fwd_flops = L * 2 * t * d * d  # per micro-batch, whole model
    assert prof.flops("forward") == prof.flops("backward") == fwd_flops
    pred = predict(prof, NET, pipeline=PipelineSpec(m, schedule, virtual))
    cost = pred.pipeline
    assert cost is not None
    stages = pp * virtual
    boundary = t * d * F4  # a layer's output, per micro-batch
    transfer = NET.intra.latency + boundary / NET.intra.bandwidth  # the pp pair is in one node
    f = fwd_flops / RATE / stages  # f = b on each stage
    assert cost.boundary_bytes == boundary and cost.transfer == pytest.approx(transfer, rel=1e-12)
    assert cost.forward == pytest.approx((f,) * stages, rel=1e-12)
    assert cost.backward == pytest.approx((f,) * stages, rel=1e-12)
    makespan = _makespan_by_hand(schedule, pp, m, f, f, transfer)
    assert pred.time == pytest.approx(makespan, rel=1e-12) == cost.makespan
    assert cost.bubble == pytest.approx(1 - m * virtual * 2 * f / makespan, rel=1e-12)
    slots = cost.timeline()
    assert max(s.end for s in slots) == cost.makespan and len(slots) == 2 * m * stages
    # free links: the textbook bubble, the step (v m + pp - 1)(f + b)
    free = Network("free links", 2, Link(1e30, 0.0), Link(1e30, 0.0), flops=RATE)
    ideal = predict(prof, free, pipeline=PipelineSpec(m, schedule, virtual))
    assert ideal.pipeline is not None and ideal.pipeline.transfer < 1e-25
    assert ideal.time == pytest.approx((virtual * m + pp - 1) * 2 * f, rel=1e-12)
    assert ideal.pipeline.bubble == pytest.approx((pp - 1) / (virtual * m + pp - 1), rel=1e-12)
    assert ideal.pipeline.bubble == pytest.approx(
        theoretical_bubble(schedule, pp, m, virtual), rel=1e-12
    )
    # the sends: (stages - 1) boundaries, forward and backward, per micro-batch
    sends = pred.profile.filter(axis="pp") if pred.profile else None
    assert sends is not None
    assert [(r.op, r.phase, r.size, r.kind) for r in sends] == [
        *[("send", "forward", boundary, "sendrecv")] * (stages - 1),
        *[("send", "backward", boundary, "sendrecv")] * (stages - 1),
    ]
    assert m * sends.size() == 2 * (stages - 1) * m * boundary
    # rank 0 ends last (B of the last micro-batch on stage 0); it sends forward out of its
    # stages but the last, backward out of its stages but stage 0: v = 1: 1 per micro-batch;
    # v = 2 (stages 0, 2 of 4): 2 forward + 1 backward
    assert pred.pipeline is not None and pred.pipeline.finish[0] == pred.time
    assert pred.by_axis == {"pp": pytest.approx(m * (1 if virtual == 1 else 3) * transfer)}
    assert pred.compute == pytest.approx(m * 2 * fwd_flops / RATE / pp, rel=1e-12)
    assert pred.exposed == pytest.approx(pred.time - pred.compute, rel=1e-12)
    assert str(pred.layout) == f"pp2 ({PipelineSpec(m, schedule, virtual)})"


def test_unequal_stages_gpipe_each_stage_at_its_own_pace() -> None:
    """Stages that differ: layer 0's backward has no input gradient (u = 2 t d^2 FLOPs: f_j = u,
    b_0 = u, b_j = 2u on the others). GPipe, pp = 4 across nodes (2 GPUs a node), m = 6:
    micro-batch 0 down stages 0..2 ((pp - 1)(u + t)), the last stage's m forwards and m
    backwards back to back (3 m u), micro-batch m - 1's backward up stages 2..1 at 2u each
    ((pp - 2)(2u + t): equal stages never wait for each other) and to stage 0 (t + u: faster,
    it waits for each gradient)."""
    L, d, t, pp, m = 4, 64, 32, 4, 6
    prof = _chained(_model(L, d), fd.Mesh({"pp": pp}), t)
    flops = 2 * t * d * d  # u in FLOPs
    assert (prof.flops("forward"), prof.flops("backward")) == (L * flops, (2 * L - 1) * flops)
    u = flops / RATE
    # pp4 over 2-GPU nodes: the group crosses nodes, sends go over the inter-node link
    tr = NET.inter.latency + t * d * F4 / NET.inter.bandwidth
    pred = predict(prof, NET, pipeline=PipelineSpec(m, "gpipe"))
    cost = pred.pipeline
    assert cost is not None and cost.transfer == pytest.approx(tr, rel=1e-12)
    assert cost.forward == pytest.approx((u,) * pp, rel=1e-12)
    assert cost.backward == pytest.approx((u, 2 * u, 2 * u, 2 * u), rel=1e-12)
    makespan = (pp - 1) * (u + tr) + 3 * m * u + (pp - 2) * (2 * u + tr) + tr + u
    assert pred.time == pytest.approx(makespan, rel=1e-12) == cost.makespan
    # every rank computes m (f_r + b_r): 2mu on rank 0, 3mu on the others
    busy = m * (2 * u + 3 * (pp - 1) * u)
    assert cost.bubble == pytest.approx(1 - busy / (pp * makespan), rel=1e-12)
    assert cost.finish[0] == pytest.approx(pred.time, rel=1e-12)


@pytest.mark.parametrize("slow", [False, True])
def test_unequal_stages_1f1b_round_trips_or_the_slow_stage(slow: bool) -> None:
    """1F1B, pp = 2, m = 6, stage 0 = layer 0 (f0 = b0 = u: no input gradient), stage 1 = layer 1
    (f1 = u, b1 = 2u). Rank 0 runs F0 F1 B0 F2 B1 ... F5 B4 B5. Two chains compete:

    - rank 1 never waits: F0 on stage 0, t, rank 1's 2m actions, t, B5 on stage 0:
      f0 + b0 + 2t + m (f1 + b1) = 2u + 2t + 3mu;
    - micro-batch 0's round trip (f0 + t + f1 + b1 + t + b0 = 5u + 2t, ending with B0 on rank 0),
      then F2 on rank 0 and micro-batch 2's round trip, ...: each round trip of 2 micro-batches
      costs 2t + (f0 + b0) - (f1 + b1) = 2t - u more than rank 1's 2 micro-batches, so with
      2t > u the step is ceil(m / 2) - 1 = 2 of them and then the first chain for the last 2:
      2 (5u + 2t) + f0 + t + 2 (f1 + b1) + t + b0 = 18u + 6t.

    A fast link (NET, inside a node: 2t << u) gives the first, a slow one (latency 0.3 ms,
    2t > u = 0.26 ms) the second."""
    L, d, t, m = 2, 64, 32, 6
    prof = _chained(_model(L, d), fd.Mesh({"pp": 2}), t)
    u = 2 * t * d * d / RATE
    net = Network("slow", 2, Link(1e10, 3e-4), Link(1e8, 1e-5), flops=RATE) if slow else NET
    tr = net.intra.latency + t * d * F4 / net.intra.bandwidth
    pred = predict(prof, net, pipeline=PipelineSpec(m))
    cost = pred.pipeline
    assert cost is not None and cost.transfer == pytest.approx(tr, rel=1e-12)
    assert cost.forward == pytest.approx((u, u)) and cost.backward == pytest.approx((u, 2 * u))
    assert (2 * tr > u) == slow
    makespan = 18 * u + 6 * tr if slow else 2 * u + 2 * tr + 3 * m * u
    assert pred.time == pytest.approx(makespan, rel=1e-12) == cost.makespan
    assert cost.bubble == pytest.approx(1 - m * 5 * u / (2 * makespan), rel=1e-12)
    assert pred.compute == pytest.approx(m * 2 * u, rel=1e-12)  # rank 0 ends last


def _longest_chain(
    sched: Schedule, fwd: tuple[float, ...], bwd: tuple[float, ...], tr: float
) -> float:
    """A reference for any schedule: every action ends at its cost after the later of the
    previous action on its rank and what it waits for (F on stage j - 1, B on stage j + 1, the
    last stage's B its F), + tr when that is on another rank; the step is the last end."""
    last = sched.stages - 1
    before = {a: acts[i - 1] for acts in sched.actions for i, a in enumerate(acts) if i}
    end: dict[Action, float] = {}

    def waits(a: Action) -> list[Action]:
        if a.kind == "F":
            return [Action("F", a.microbatch, a.stage - 1)] if a.stage else []
        s = a.stage + 1 if a.stage < last else a.stage
        return [Action("B" if a.stage < last else "F", a.microbatch, s)]

    def finish(a: Action) -> float:
        if a not in end:
            start = [finish(before[a])] if a in before else []
            for w in waits(a):
                start.append(finish(w) + (tr if w.stage % sched.pp != a.stage % sched.pp else 0))
            end[a] = max(start, default=0.0) + (fwd if a.kind == "F" else bwd)[a.stage]
        return end[a]

    return max(finish(a) for acts in sched.actions for a in acts)


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_unequal_stages_against_the_longest_chain(schedule: str, virtual: int) -> None:
    """pp = 4 with the first stage's backward cheaper (no input gradient for layer 0) and slow
    sends across nodes: no short closed form, so the chain is walked by the reference above."""
    L, d, t, pp, m = 8, 64, 32, 4, 8
    prof = _chained(_model(L, d), fd.Mesh({"pp": pp}), t)
    u = 2 * t * d * d / RATE
    per = L // (pp * virtual)  # layers a stage
    fwd = (per * u,) * (pp * virtual)
    bwd = ((2 * per - 1) * u, *((2 * per * u,) * (pp * virtual - 1)))
    tr = NET.inter.latency + t * d * F4 / NET.inter.bandwidth
    pred = predict(prof, NET, pipeline=PipelineSpec(m, schedule, virtual))
    cost = pred.pipeline
    assert cost is not None
    assert cost.forward == pytest.approx(fwd) and cost.backward == pytest.approx(bwd)
    want = _longest_chain(cost.schedule, fwd, bwd, tr)
    assert pred.time == pytest.approx(want, rel=1e-12) == cost.makespan
    # the transfers count: the same chain with free ones is shorter
    assert _longest_chain(cost.schedule, fwd, bwd, 0.0) < want


def test_stage_work_by_module_embedding_and_head_on_the_ends() -> None:
    """pp=2 over 2 layers, ``scale`` before them and ``head`` after: the first stage computes
    layer 0 (forward u, backward 2u: its input needs a gradient for ``scale``), the last layer 1
    and the head (forward 2u, backward 4u); 1F1B, the last stage paces (as in the 1F1B test:
    f0 + b0 + 2t + m (f1 + b1), the round trips cost less than the slow stage's work)."""
    d, t, m = 64, 32, 4
    prof = _chained(_model(2, d, ends=True), fd.Mesh({"pp": 2}), t)
    pred = predict(prof, NET, pipeline=PipelineSpec(m))
    assert pred.pipeline is not None
    u = 2 * t * d * d / RATE
    assert pred.pipeline.forward == pytest.approx((u, 2 * u), rel=1e-12)
    assert pred.pipeline.backward == pytest.approx((2 * u, 4 * u), rel=1e-12)
    transfer = NET.intra.latency + t * d * F4 / NET.intra.bandwidth
    assert pred.time == pytest.approx(3 * u + 2 * transfer + m * 6 * u, rel=1e-12)
    # the rank that ends last is rank 0 (1F1B): its own compute
    assert pred.compute == pytest.approx(m * 3 * u, rel=1e-12)


def test_sends_priced_by_a_calibrated_cost_model() -> None:
    """With a CostModel the send costs the sendrecv fit of the pp group's size; the step as in
    the equal-stage 1F1B chain, pp = 2, m = 2: (m + 1)(f + b) + 2 ceil(m / 2) t."""
    L, d, t, m = 2, 64, 32, 2
    prof = _detached(_model(L, d), fd.Mesh({"pp": 2}), t)
    fit = Fit("sendrecv", 2, True, latency=5e-5, per_byte=2e-9, error=0.0)
    model = CostModel("job", 2, (fit,), flops=RATE, memory_bandwidth=0.0, kernel_latency=0.0)
    pred = predict(prof, model, pipeline=PipelineSpec(m))
    assert pred.pipeline is not None
    tr = 5e-5 + 2e-9 * t * d * F4
    assert pred.pipeline.transfer == pytest.approx(tr, rel=1e-12)
    f = 2 * t * d * d / RATE  # one layer a stage, f = b
    assert pred.time == pytest.approx((m + 1) * 2 * f + 2 * tr, rel=1e-12)


def test_pipeline_over_one_rank_is_gradient_accumulation() -> None:
    """pp=1: m micro-batches one after another, no send, one micro-batch's activations held."""
    L, d, t, m = 2, 64, 16, 3
    prof = _chained(_model(L, d), fd.Mesh({"pp": 1, "dp": 1}), t)
    pred = predict(prof, NET, pipeline=PipelineSpec(m))
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
    pred = predict(prof, NET, pipeline=PipelineSpec(m, schedule), memory=budget)
    assert pred.pipeline is not None
    for r, mem in enumerate(pred.pipeline.memory):
        assert mem.params == mem.grads == params[r], r
        assert mem.optimizer == 2 * params[r]  # AdamW: two moments
        assert mem.activations == prof.activations * peaks[r] // pp, r
    assert pred.memory == max(pred.pipeline.memory, key=lambda mem: mem.total)
    assert pred.fits and pred.memory.total == budget
    assert not predict(prof, NET, pipeline=PipelineSpec(m, schedule), memory=budget - 1).fits


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
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, family="llama"))
    ids = torch.zeros(2, 8, dtype=torch.long)  # one micro-batch: 2 sequences of 8
    prof = trace_model(pm, input_ids=ids, labels=ids)
    pred = predict(prof, NET, pipeline=PipelineSpec(4))
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
    cost = predict(prof, free, pipeline=PipelineSpec(4)).pipeline
    assert cost is not None
    assert [x * RATE for x in cost.forward] == pytest.approx(
        [2 * layer_f, 2 * layer_f + head_f], rel=1e-9
    )
    assert [x * RATE for x in cost.backward] == pytest.approx(
        [2 * layer_b, 2 * layer_b + 2 * head_f], rel=1e-9
    )


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
    p = rank_layouts(
        _build(model, 64, m),
        4,
        NET,
        axes=("pp", "dp"),
        orders=False,
        data_parallel="dp",
        memory=3 * 2**20,
        pipeline=PipelineSpec(m),
    )
    by = {str(pr.layout): pr for pr in p.predictions}
    assert set(by) == {"dp4", "pp2 x dp2 (1f1b, 4 micro-batches)", "pp4 (1f1b, 4 micro-batches)"}
    assert by["dp4"].memory is not None and by["dp4"].memory.params == weights
    assert not by["dp4"].fits and p.predictions[-1] is by["dp4"]
    assert all(pr.fits for pr in p.predictions[:-1]) and p.best.layout.pipeline == PipelineSpec(m)
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
    # pp2 x dp2: 8 tokens a micro-batch, u = 2 x 8 d^2 FLOPs a layer; stage 0 (layers 0, 1):
    # f0 = 2u, b0 = 3u (layer 0 has no input gradient), stage 1: f1 = 2u, b1 = 4u; the pp pair
    # crosses nodes. 2t < (f1 + b1) - (f0 + b0) = u, so (the 1F1B chains, pp = 2) the step is
    # f0 + b0 + 2t + m (f1 + b1), and the ranks compute m (f0 + b0 + f1 + b1) in all
    u = 2 * 8 * d * d / RATE
    tr = NET.inter.latency + 8 * d * F4 / NET.inter.bandwidth
    assert 2 * tr < u
    makespan = 5 * u + 2 * tr + m * 6 * u
    bubble = 1 - m * 11 * u / (2 * makespan)
    piped = by["pp2 x dp2 (1f1b, 4 micro-batches)"].pipeline
    assert piped is not None and piped.makespan == pytest.approx(makespan, rel=1e-12)
    assert piped.bubble == pytest.approx(bubble, rel=1e-12)
    line = next(line for line in table.splitlines() if "pp2 x dp2" in line)
    assert line.endswith(f"{bubble:.3f}") and f"{bubble:.3f}" == "0.246"


def test_plan_slow_network_across_nodes_pp_wins() -> None:
    """2 GPUs a node, a slow network between nodes. dp4 all-reduces 1 MiB of gradients across
    nodes; pp2 x dp2 (stages across nodes, dp inside) sends 8 KiB hidden states across nodes and
    reduces each stage's 512 KiB inside a node: it wins, by the closed forms below."""
    L, d, m, tokens = 4, 256, 4, 64
    model = _model(L, d)
    fwd_tok, bwd_tok = L * 2 * d * d, (2 * L - 1) * 2 * d * d  # FLOPs per token
    # per token and stage of 2 layers: forward 2 x 2d^2; backward 3 x 2d^2 on the first stage
    # (layer 0 has no input gradient), 4 x 2d^2 on the second
    f0, b0, f1, b1 = 2 * 2 * d * d, 3 * 2 * d * d, 2 * 2 * d * d, 4 * 2 * d * d

    def allreduce(link: Link, n: int, nbytes: float) -> float:
        return 2 * (n - 1) * link.latency + nbytes * 2 * (n - 1) / n / link.bandwidth

    # dp4: 16 tokens a rank; one 1 MiB bucket, ready when the backward ends, across nodes
    dp4 = tokens // 4 * (fwd_tok + bwd_tok) / RATE + allreduce(NET.inter, 4, L * d * d * F4)

    def piped(pp_link: Link, dp_link: Link) -> float:  # pp2 x dp2 in either order
        mb = tokens // 2 // m  # tokens per micro-batch
        send = pp_link.latency + mb * d * F4 / pp_link.bandwidth
        slow = mb * (f1 + b1 - f0 - b0) / RATE  # the last stage's extra work per micro-batch
        assert 2 * send < slow  # round trips cost less: the last stage paces (1F1B, pp = 2)
        step = mb * (f0 + b0 + m * (f1 + b1)) / RATE + 2 * send
        # rank 0 ends last (1F1B): then its stage's gradients (2 layers) over dp
        return step + allreduce(dp_link, 2, L // 2 * d * d * F4)

    cands = [
        MeshLayout((("dp", 4),), unit=("pp",)),
        MeshLayout((("pp", 2), ("dp", 2))),  # stages across nodes, dp inside a node
        MeshLayout((("dp", 2), ("pp", 2))),  # stages inside a node, dp across nodes
    ]
    want = {
        "dp4": dp4,
        "pp2 x dp2 (1f1b, 4 micro-batches)": piped(NET.inter, NET.intra),
        "dp2 x pp2 (1f1b, 4 micro-batches)": piped(NET.intra, NET.inter),
    }
    p = rank_layouts(
        _build(model, tokens, m), cands, NET, data_parallel="dp", pipeline=PipelineSpec(m)
    )
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

    refused("microbatches=0", lambda: PipelineSpec(0))
    refused("microbatches=True", lambda: PipelineSpec(True))
    refused("schedule 'zb' is not known", lambda: PipelineSpec(4, "zb"))
    refused("'interleaved_1f1b' with virtual=1", lambda: PipelineSpec(4, "interleaved_1f1b"))
    refused("'1f1b' with virtual=2", lambda: PipelineSpec(4, "1f1b", virtual=2))
    refused("boundary_bytes=-1", lambda: PipelineSpec(4, boundary_bytes=-1))
    refused(
        "'stage' is not a non-data axis",
        lambda: predict(prof, NET, pipeline=PipelineSpec(4, axis="stage")),
    )
    refused(
        "'pp' is not a non-data axis",
        lambda: predict(prof, NET, data_parallel=("dp", "pp"), pipeline=PipelineSpec(4)),
    )
    # interleaving runs micro-batches in rounds of pp: the schedule's refusal, as a ProfileError
    with pytest.raises(ProfileError, match=r"pipeline over pp=2: .*3 micro-batches") as e:
        predict(prof, NET, pipeline=PipelineSpec(3, "interleaved_1f1b", 2))
    assert "use 2 or 4 micro-batches" in e.value.fix
    # 4 layers into pp4 x virtual 2 = 8 stages
    prof8 = _chained(_model(4, 32), fd.Mesh({"pp": 4}), 8)
    with pytest.raises(ProfileError, match="4 layers .* into 8 pipeline stages") as e:
        predict(prof8, NET, pipeline=PipelineSpec(4, "interleaved_1f1b", 2))
    assert "1, 2, 4" in e.value.fix
    # a plain function's trace has no layer module: the boundary must be given
    mesh = fd.Mesh({"pp": 2})
    w = torch.empty(32, 32, device="meta", requires_grad=True)
    plain = trace(lambda x, w: (x @ w).sum().backward(), mesh, torch.empty(8, 32), w)
    refused("no numbered layer module", lambda: predict(plain, NET, pipeline=PipelineSpec(2)))
    assert predict(plain, NET, pipeline=PipelineSpec(2, boundary_bytes=1024)).time > 0
    # collectives over the pipeline axis in the traced step
    over = trace(lambda x: fd.psum(x, mesh, "pp").sum(), mesh, torch.empty(8, device="meta"))
    refused(
        "issues psum over the pipeline axis",
        lambda: predict(over, NET, pipeline=PipelineSpec(2, boundary_bytes=8)),
    )
    # nothing charged: no compute rate and no sends (pp=1)
    one = _chained(_model(2, 32), fd.Mesh({"pp": 1}), 8)
    free = Network("free", 2, Link(1e9, 0.0), Link(1e9, 0.0))
    refused(
        r"pipeline stage 0 \(rank 0 of pp\).*costs nothing",
        lambda: predict(one, free, pipeline=PipelineSpec(2)),
    )
