"""The planner's cost model (issue 33): calibrate on gloo ranks (held-out sizes, JSON), the
group-size rule, FLOPs and memory of a traced step against closed forms, the overlapped
data-parallel reduction against the timeline written out by hand, memory budgets in plan."""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fastdist as fd
from fastdist.profile import (
    CostModel,
    Fit,
    GradReady,
    Link,
    MeshLayout,
    Network,
    ProfileError,
    Work,
    calibrate,
    predict,
    rank_layouts,
    trace,
)
from tests.dist_harness import run_on_gloo

# Held-out sizes, measured in the same sweep as the fitted ones (interleaved: the same load), are
# reproduced by the fit within these factors: their median within 2x, and all but OUTLIERS of the
# 12 points within 5x. Each point is a median over 5 bursts on a 2-core machine shared with other
# jobs (load averages of 10 to 20 while these tests were written): one point can be several times
# off while its neighbours are not (CI saw one point at 5.2x with the other 11 within 1.5x). A
# fitting error moves every point of a fit (3 axes x 2 sizes) and the median, so it still fails.
# The accuracy that matters, whole steps, is measured by benchmarks/planner_accuracy.py.
POINT_FACTOR, MEDIAN_FACTOR, OUTLIERS = 5.0, 2.0, 2
FITTED, HELD_OUT = (1 << 12, 1 << 16, 1 << 20), (1 << 14, 1 << 18)


def calibrate_ranks() -> Any:
    """On 4 gloo ranks (dp2 x tp2): one sweep over the fitted and the held-out sizes."""
    torch.set_num_threads(1)
    mesh = fd.connect(order=("dp", "tp"), tp=2, timeout=120)
    sizes = tuple(sorted(FITTED + HELD_OUT))
    return calibrate(mesh, kinds=("allreduce", "allgather"), sizes=sizes, reps=5, matmul=128)


def test_calibrate_on_gloo_reproduces_held_out_sizes(tmp_path: Path) -> None:
    from fastdist.profile.cost_model import fit_points

    results = run_on_gloo(calibrate_ranks, 4, timeout=300)
    full = results[0]
    # every rank fitted the same model from the slowest rank's medians
    assert all(r == full for r in results)
    # groups of 2 (dp, tp) and 4 (dp+tp), both kinds; 5 sizes x 3 axes
    assert {(f.kind, f.n) for f in full.fits} == {
        (k, n) for k in ("allreduce", "allgather") for n in (2, 4)
    }
    assert len(full.points) == 2 * 5 * 3 and {p.axis for p in full.points} == {"dp", "tp", "dp+tp"}
    assert full.flops > 0 and full.memory_bandwidth > 0 and full.kernel_latency > 0
    # S rounded to a multiple of the group size: the sizes asked for (all divisible here)
    assert {p.size for p in full.points} == set(FITTED + HELD_OUT)
    fitted = [p for p in full.points if p.size in FITTED]
    model = dataclasses.replace(full, fits=fit_points(fitted), points=tuple(fitted))
    for f in model.fits:  # the stated error bounds the fit on its own points
        assert f.latency >= 0 and f.per_byte >= 0
        for p in fitted:
            if (p.kind, p.n) == (f.kind, f.n):
                assert abs(f.time(p.size) / p.seconds - 1) <= f.error + 1e-12
    ratios = [
        model.fit(p.kind, p.n).time(p.size) / p.seconds for p in full.points if p.size in HELD_OUT
    ]
    assert len(ratios) == 2 * 2 * 3
    outside = [r for r in ratios if not 1 / POINT_FACTOR <= r <= POINT_FACTOR]
    assert len(outside) <= OUTLIERS, ratios
    assert 1 / MEDIAN_FACTOR <= statistics.median(ratios) <= MEDIAN_FACTOR, ratios
    # JSON round trip, through a file too
    assert CostModel.from_json(model.to_json()) == model
    model.save(tmp_path / "model.json")
    assert CostModel.load(tmp_path / "model.json") == model


def test_calibrate_refuses_a_simulated_mesh() -> None:
    with pytest.raises(ProfileError, match="nothing to measure|no links or devices to measure"):
        calibrate(fd.Mesh({"dp": 2, "tp": 2}))
    with pytest.raises(ProfileError, match="fastdist.connect"):
        calibrate("tp")  # type: ignore[arg-type]
    with pytest.raises(ProfileError, match="not a saved CostModel"):
        CostModel.from_json('{"format": "something else"}')


def test_group_size_rule() -> None:
    fits = (
        Fit("allreduce", 2, True, 1e-3, 1e-9, 0.1),
        Fit("allreduce", 4, True, 3e-3, 2e-9, 0.2),
        Fit("allgather", 2, True, 5e-4, 1e-9, 0.1),
    )
    m = CostModel("toy", 8, fits, 1e9, 1e9, 1e-6)
    assert m.fit("allreduce", 2) == fits[0]
    mid = m.fit("allreduce", 3)  # halfway between 2 and 4
    assert math.isclose(mid.latency, 2e-3) and math.isclose(mid.per_byte, 1.5e-9)
    big = m.fit("allreduce", 8)  # ring scaling from n=4: steps 14/6, bus factor 1.75/1.5
    assert math.isclose(big.latency, 3e-3 * 14 / 6) and math.isclose(
        big.per_byte, 2e-9 * 1.75 / 1.5
    )
    small = m.fit("allgather", 4)  # from n=2: steps 3/1, bus factor 0.75/0.5
    assert math.isclose(small.latency, 1.5e-3) and math.isclose(small.per_byte, 1.5e-9)
    assert m.fit("broadcast", 2) == dataclasses.replace(fits[2])  # priced as allgather
    with pytest.raises(ProfileError, match="no measurement of alltoall"):
        m.fit("alltoall", 2)
    with pytest.raises(ProfileError, match="across nodes"):
        m.fit("allreduce", 2, intra=False)


# ====================================================================== FLOPs and memory
def _mlp_flops(b: int, d: int, h: int, o: int, x_grad: bool) -> float:
    f1, f2 = 2 * b * d * h, 2 * b * h * o
    # forward f1 + f2; backward: layer 2 dX and dW (2 f2), layer 1 dW (f1) and dX if x needs it
    return f1 + f2 + 2 * f2 + f1 + (f1 if x_grad else 0)


@pytest.mark.parametrize("x_grad", [False, True])
def test_flops_of_an_mlp_are_exact(x_grad: bool) -> None:
    mesh = fd.Mesh({"tp": 1})
    mlp = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    x = torch.randn(4, 16, requires_grad=x_grad)
    prof = trace(lambda x: mlp(x).sum().backward(), mesh, x, modules=[mlp])
    assert prof.flops() == _mlp_flops(4, 16, 32, 8, x_grad)
    assert prof.flops("forward") == 2 * 4 * 16 * 32 + 2 * 4 * 32 * 8
    # 3-d input: linear's matmul on [batch * seq, features]
    x3 = torch.randn(2, 3, 16)
    prof3 = trace(lambda x: mlp(x).sum().backward(), mesh, x3, modules=[mlp])
    assert prof3.flops() == _mlp_flops(6, 16, 32, 8, False)


def test_flops_of_a_tensor_parallel_mlp_per_rank() -> None:
    mesh = fd.Mesh({"tp": 4})
    w1 = torch.empty(16, 32 // 4, device="meta", requires_grad=True)
    w2 = torch.empty(32 // 4, 8, device="meta", requires_grad=True)
    x = torch.empty(4, 16, device="meta")

    def step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> None:
        y = fd.psum(torch.tanh(fd.pvary(x, mesh, "tp") @ w1) @ w2, mesh, "tp")
        y.sum().backward()  # type: ignore[no-untyped-call]

    # each rank: a quarter of the hidden features
    assert trace(step, mesh, x, w1, w2).flops() == _mlp_flops(4, 16, 32, 8, False) / 4


def test_flops_of_attention() -> None:
    mesh = fd.Mesh({"tp": 1})
    b, h, lq, s, e = 2, 3, 5, 7, 4
    q = torch.randn(b, h, lq, e, requires_grad=True)
    k, v = torch.randn(b, h, s, e, requires_grad=True), torch.randn(b, h, s, e, requires_grad=True)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()  # type: ignore[no-untyped-call]

    prof = trace(step, mesh, q, k, v)
    fwd = 2 * b * h * lq * s * e * 2  # q k^T and p v
    assert prof.flops("forward") == fwd and prof.flops("backward") == 2.5 * fwd


def test_memory_of_an_mlp() -> None:
    mesh = fd.Mesh({"tp": 1})
    mlp = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    prof = trace(lambda x: mlp(x).sum().backward(), mesh, x, modules=[mlp])
    params = 4 * (16 * 32 + 32 + 32 * 8 + 8)
    assert [p.name for p in prof.params] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    mem = prof.memory()  # AdamW: two moments
    assert (mem.params, mem.grads, mem.optimizer) == (params, params, 2 * params)
    # saved for backward: x (layer 1's weight gradient) and tanh's output (tanh's backward and
    # layer 2's weight gradient); the weights are parameters, not activations
    assert mem.activations == 4 * (4 * 16 + 4 * 32)
    assert mem.total == 4 * params + mem.activations
    assert prof.memory("sgd").optimizer == 0 and prof.memory(1.0).optimizer == params
    with pytest.raises(ProfileError, match="unknown optimizer"):
        prof.memory("lion")


def _tp_mlp(mesh: fd.Mesh, tokens: int = 64, d: int = 256, h: int = 1024) -> Any:
    dp, tp = mesh.shape["dp"], mesh.shape["tp"]
    w1 = torch.empty(d, h // tp, device="meta", requires_grad=True)
    w2 = torch.empty(h // tp, d, device="meta", requires_grad=True)
    x = torch.empty(tokens // dp, d, device="meta")

    def step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> None:
        y = fd.psum(torch.tanh(fd.pvary(x, mesh, "tp") @ w1) @ w2, mesh, "tp")
        y.sum().backward()  # type: ignore[no-untyped-call]

    return trace(step, mesh, x, w1, w2)


def test_plan_marks_layouts_over_the_memory_budget() -> None:
    net = Network("toy", 8, Link(1e9, 1e-6), Link(1e8, 1e-5), flops=1e9)
    free = rank_layouts(_tp_mlp, 4, net, axes=("dp", "tp"), orders=False, data_parallel="dp")
    # parameters 2 x 256 x 1024 floats / tp, x4 with grads and AdamW: dp4 holds 8 MiB
    mem = {str(p.layout): p.memory for p in free.predictions}
    assert all(m is not None for m in mem.values())
    params = {k: 2 * 256 * 1024 * 4 // t for k, t in (("tp4", 4), ("dp2 x tp2", 2), ("dp4", 1))}
    assert {k: m.params for k, m in mem.items() if m} == params
    budget = 5e6  # fits tp4 (2 MiB of parameters x 4 + activations), not dp4
    p = rank_layouts(
        _tp_mlp, 4, net, axes=("dp", "tp"), orders=False, data_parallel="dp", memory=budget
    )
    fits = {str(q.layout): q.fits for q in p.predictions}
    assert fits == {k: (mem[k].total <= budget) for k in mem if mem[k]}  # type: ignore[union-attr]
    assert fits["tp4"] and not fits["dp4"]
    ranked = [q.fits for q in p.predictions]
    assert ranked == sorted(ranked, reverse=True)  # those that fit first
    assert "fits" in p.table() and " no" in p.table()


# ====================================================================== overlap
def test_dp_reduction_overlaps_backward_as_written_out() -> None:
    """Two weights, one bucket each: w2's all-reduce starts when its gradient is ready and runs
    beside the rest of backward; w1's starts when both its gradient and the channel are free;
    the end of backward waits for it."""
    mesh = fd.Mesh({"dp": 2, "tp": 1})
    x = torch.empty(64, 128, device="meta")
    w1 = torch.empty(128, 256, device="meta", requires_grad=True)
    w2 = torch.empty(256, 128, device="meta", requires_grad=True)

    def step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> None:
        (torch.tanh(x @ w1) @ w2).sum().backward()  # type: ignore[no-untyped-call]

    prof = trace(step, mesh, x, w1, w2)
    assert [e.param for e in prof.events if isinstance(e, GradReady)] == [1, 0]  # w2 first
    bucket_mb = 0.15  # w1 and w2 (128 KiB each) in separate buckets
    for latency in (1e-6, 1e-4, 1e-2):  # all-reduce hidden, partly, not at all
        net = Network("toy", 8, Link(1e9, latency), Link(1e9, latency), flops=1e9)
        pred = predict(prof, net, data_parallel="dp", bucket_mb=bucket_mb)
        # by hand: FLOPs up to each gradient, then the two buckets in order on one channel
        flops, at = 0.0, {}
        for e in prof.events:
            if isinstance(e, Work):
                flops += e.flops
            elif isinstance(e, GradReady):
                at[e.param] = flops / 1e9
        end = flops / 1e9
        cost = 2 * latency + 256 * 128 * 4 / 1e9  # ring all-reduce of 128 KiB over 2 ranks
        done2 = at[1] + cost
        done1 = max(at[0], done2) + cost
        assert math.isclose(pred.time, max(end, done1), rel_tol=1e-9)
        assert math.isclose(pred.compute, end, rel_tol=1e-9)
        assert math.isclose(pred.comm, 2 * cost, rel_tol=1e-9)
        assert math.isclose(pred.exposed, max(end, done1) - end, abs_tol=1e-15)
        assert pred.time <= end + 2 * cost + 1e-15  # never worse than in series
    # the same step with no data_parallel: compute only
    assert math.isclose(predict(prof, net).time, end, rel_tol=1e-9)
    with pytest.raises(ProfileError, match="data_parallel axis 'data'"):
        predict(prof, net, data_parallel="data")


def test_tp_collectives_are_on_the_critical_path() -> None:
    net = Network("toy", 8, Link(1e9, 1e-5), Link(1e9, 1e-5), flops=1e9)
    prof = _tp_mlp(MeshLayout((("tp", 4),), unit=("dp",)).mesh)
    pred = predict(prof, net)
    assert pred.comm > 0 and math.isclose(pred.time, pred.compute + pred.comm, rel_tol=1e-12)
    assert math.isclose(pred.compute, prof.flops() / 1e9, rel_tol=1e-12)


def test_trace_of_a_tied_meta_model() -> None:
    """A model on the meta device whose head is tied to its embedding (GPT-2) traces: the tied
    weight is one fake tensor, counted once in the parameters."""
    import transformers

    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=16)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    per_rank = sum(p.numel() for p in model.parameters()) * 4  # tied: once
    pm = fd.nn.parallelize(model, fd.Mesh({"tp": 2}), fd.nn.plans.plan(model, family="gpt2"))
    ids = torch.zeros(2, 8, dtype=torch.long)
    prof = fd.profile.trace_model(pm, input_ids=ids, labels=ids)
    assert prof.count(axis="tp") > 0 and prof.flops() > 0
    # replicated (position embedding, norms, biases of row-parallel layers) plus tp shards
    assert 0 < sum(p.bytes for p in prof.params) < per_rank
    assert len({p.name for p in prof.params}) == len(prof.params)


def test_predict_of_a_filtered_profile_charges_the_kept_collectives() -> None:
    net = Network("toy", 8, Link(1e9, 1e-5), Link(1e9, 1e-5), flops=1e9)
    prof = _tp_mlp(MeshLayout((("tp", 4),), unit=("dp",)).mesh)
    whole, fwd = predict(prof, net), predict(prof.filter(phase="forward"), net)
    assert math.isclose(fwd.comm, whole.by_phase["forward"], rel_tol=1e-12)
    assert math.isclose(fwd.time, whole.compute + whole.by_phase["forward"], rel_tol=1e-12)
