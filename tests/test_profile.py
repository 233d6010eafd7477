"""fastdist.profile: counts and bytes of every op (forward and backward) against hand-computed values,
the TP MLP formula, a 4096-rank dry run, module attribution (a block and a HF Llama), and the planner
against a closed-form cost model."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fastdist as fd
from fastdist.profile import (
    Layout,
    Link,
    Network,
    Profile,
    ProfileError,
    bus_factor,
    layouts,
    plan,
    predict,
    trace,
    trace_model,
)

MESH = fd.Mesh({"dp": 2, "tp": 4})
F4 = 4  # bytes per float32


def _rows(f: Callable[..., Any], *shapes: tuple[int, ...]) -> list[tuple[str, str, str, str, int, float]]:
    """(op, axis, kind, phase, size, bus bytes) of f's collectives, forward and backward of y.sum()."""
    xs = [torch.ones(*s, requires_grad=True) for s in shapes]

    def step(*xs: torch.Tensor) -> None:
        y = f(*xs)
        (y[0] if isinstance(y, tuple) else y).sum().backward()

    return [(r.op, r.axis, r.kind, r.phase, r.size, r.bus_bytes) for r in trace(step, MESH, *xs).records]


def _rata(x: torch.Tensor) -> Any:
    return fd.ragged_all_to_all(x, MESH, "tp", torch.ones(4, dtype=torch.long), capacity=8)


AR, AG = 2 * 3 / 4, 3 / 4  # bus factors for n = 4: all-reduce, all-gather / reduce-scatter / all-to-all
CASES: list[tuple[str, Callable[..., Any], tuple[int, ...], list[tuple[str, str, str, str, int, float]]]] = [
    # x is [3, 2] float32 (24 bytes) unless said otherwise; n = 4 (tp)
    ("psum", lambda x: fd.psum(x, MESH, "tp"), (3, 2), [("psum", "tp", "allreduce", "forward", 24, 24 * AR)]),
    ("pmean", lambda x: fd.pmean(x, MESH, "tp"), (3, 2), [("pmean", "tp", "allreduce", "forward", 24, 24 * AR)]),
    ("pvary", lambda x: fd.pvary(x, MESH, "tp"), (3, 2), [("psum", "tp", "allreduce", "backward", 24, 24 * AR)]),
    # pmax backward: all-reduce (min) of an int64 winner index per element
    ("pmax", lambda x: fd.pmax(x, MESH, "tp"), (3, 2), [("pmax", "tp", "allreduce", "forward", 24, 24 * AR),
                                                        ("select_extreme", "tp", "allreduce", "backward", 48, 48 * AR)]),
    ("pmin", lambda x: fd.pmin(x, MESH, "tp"), (3, 2), [("pmin", "tp", "allreduce", "forward", 24, 24 * AR),
                                                        ("select_extreme", "tp", "allreduce", "backward", 48, 48 * AR)]),
    # all_gather: S = the gathered output (4 x 24); backward reduce-scatter of the [12, 2] gradient
    ("all_gather", lambda x: fd.all_gather(x, MESH, "tp"), (3, 2), [("all_gather", "tp", "allgather", "forward", 96, 96 * AG),
                                                                    ("psum_scatter", "tp", "reducescatter", "backward", 96, 96 * AG)]),
    ("all_gather_invariant", lambda x: fd.all_gather_invariant(x, MESH, "tp"), (3, 2),
     [("all_gather_invariant", "tp", "allgather", "forward", 96, 96 * AG)]),  # backward: a local slice
    ("local_chunk", lambda x: fd.local_chunk(x, MESH, "tp"), (4, 2),  # forward local; backward gathers [1, 2] -> [4, 2]
     [("all_gather_invariant", "tp", "allgather", "backward", 32, 32 * AG)]),
    ("psum_scatter", lambda x: fd.psum_scatter(x, MESH, "tp"), (4, 2), [("psum_scatter", "tp", "reducescatter", "forward", 32, 32 * AG),
                                                                        ("all_gather", "tp", "allgather", "backward", 32, 32 * AG)]),
    ("all_to_all", lambda x: fd.all_to_all(x, MESH, "tp", 0, 1), (4, 2), [("all_to_all", "tp", "alltoall", "forward", 32, 32 * AG),
                                                                          ("all_to_all", "tp", "alltoall", "backward", 32, 32 * AG)]),
    ("ring_shift", lambda x: fd.ring_shift(x, MESH, "tp"), (4, 2), [("ppermute", "tp", "sendrecv", "forward", 32, 32.0),
                                                                    ("ppermute", "tp", "sendrecv", "backward", 32, 32.0)]),
    # a partial permutation: 1 of 4 members sends, so a rank sends a quarter of the buffer on average
    ("ppermute", lambda x: fd.ppermute(x, MESH, "tp", [(0, 1)]), (4, 2), [("ppermute", "tp", "sendrecv", "forward", 32, 8.0),
                                                                          ("ppermute", "tp", "sendrecv", "backward", 32, 8.0)]),
    ("broadcast", lambda x: fd.broadcast(x, MESH, "tp", 1), (4, 2), [("broadcast", "tp", "broadcast", "forward", 32, 32.0)]),
    # v-ops: S = sum(sizes) rows of 8 bytes = 48
    ("all_gather_v", lambda x: fd.all_gather_v(x, MESH, "tp", [1, 2, 3, 0]), (3, 2),
     [("all_gather_v", "tp", "allgather", "forward", 48, 48 * AG), ("reduce_scatter_v", "tp", "reducescatter", "backward", 48, 48 * AG)]),
    ("reduce_scatter_v", lambda x: fd.reduce_scatter_v(x, MESH, "tp", [1, 2, 3, 0], capacity=3), (6, 2),
     [("reduce_scatter_v", "tp", "reducescatter", "forward", 48, 48 * AG), ("all_gather_v", "tp", "allgather", "backward", 48, 48 * AG)]),
    ("gather_v", lambda x: fd.gather_v(x, MESH, "tp", [1, 2, 3, 0], dst=0, capacity=6), (3, 2),
     [("gather_v", "tp", "gather", "forward", 48, 48 * AG), ("scatter_v", "tp", "scatter", "backward", 48, 48 * AG)]),
    ("scatter_v", lambda x: fd.scatter_v(x, MESH, "tp", [1, 2, 3, 0], src=0, capacity=3), (6, 2),
     [("scatter_v", "tp", "scatter", "forward", 48, 48 * AG), ("gather_v", "tp", "gather", "backward", 48, 48 * AG)]),
    # ragged: the size exchange (4 int64), the payload bounded by the send buffer, backward by the capacity (8 rows)
    ("ragged_all_to_all", _rata, (4, 2), [("all_to_all", "tp", "alltoall", "forward", 32, 32 * AG),
                                          ("ragged_all_to_all", "tp", "alltoall", "forward", 32, 32 * AG),
                                          ("ragged_all_to_all", "tp", "alltoall", "backward", 64, 64 * AG)]),
    # a tuple of axes: one group of 8
    ("psum dp+tp", lambda x: fd.psum(x, MESH, ("dp", "tp")), (3, 2), [("psum", "dp+tp", "allreduce", "forward", 24, 24 * 2 * 7 / 8)]),
    ("all_gather dp", lambda x: fd.all_gather(x, MESH, "dp"), (3, 2), [("all_gather", "dp", "allgather", "forward", 48, 24.0),
                                                                       ("psum_scatter", "dp", "reducescatter", "backward", 48, 24.0)]),
]


@pytest.mark.parametrize("name, f, shape, want", CASES, ids=[c[0] for c in CASES])
def test_every_op_counts_and_bytes(name: str, f: Callable[..., Any], shape: tuple[int, ...], want: list[Any]) -> None:
    assert _rows(f, shape) == want


def test_bound_flag_and_bus_factors() -> None:
    prof = trace(lambda x: _rata(x)[0].sum().backward(), MESH, torch.ones(4, 2, requires_grad=True))
    assert [r.bound for r in prof.records] == [False, True, True]
    assert [bus_factor(k, 8) for k in ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast", "sendrecv")] == [1.75, 0.875, 0.875, 0.875, 1.0, 1.0]
    with pytest.raises(ProfileError, match="bus_factor"):
        bus_factor("reduce", 4)


def _tp_mlp_profile(mesh: fd.Mesh, t: int, d: int, h: int) -> Profile:
    tp, dp = mesh.axis_size("tp"), mesh.axis_size("dp")

    def step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> None:
        y = fd.psum(torch.tanh(fd.pvary(x, mesh, "tp") @ w1) @ w2, mesh, "tp")
        y.sum().backward()  # type: ignore[no-untyped-call]
        assert w1.grad is not None and w2.grad is not None
        fd.psum(w1.grad, mesh, "dp")
        fd.psum(w2.grad, mesh, "dp")

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, device="meta", requires_grad=True)

    return trace(step, mesh, meta(t // dp, d), meta(d, h // tp), meta(h // tp, d))


@pytest.mark.parametrize("dp, tp", [(2, 4), (4, 2), (1, 8)])
def test_tp_mlp_equals_formula(dp: int, tp: int) -> None:
    t, d, h = 64, 32, 128
    prof = _tp_mlp_profile(fd.Mesh({"dp": dp, "tp": tp}), t, d, h)
    act = (t // dp) * d * F4  # x and y per rank
    assert prof.count(axis="tp", phase="forward") == 1 and prof.count(axis="tp", phase="backward") == 1
    assert prof.size(axis="tp") == 2 * act
    assert prof.bus_bytes(axis="tp") == pytest.approx(2 * act * 2 * (tp - 1) / tp)
    grads = 2 * d * (h // tp) * F4
    if dp > 1:
        assert prof.count(axis="dp") == 2 and prof.size(axis="dp") == grads
        assert prof.bus_bytes(axis="dp") == pytest.approx(grads * 2 * (dp - 1) / dp)
    else:
        assert prof.count(axis="dp") == 0


def test_dry_run_4096_ranks_is_fast_and_small() -> None:
    """A 4096-rank layout of a 8192 x 28672 sequence-parallel MLP block (fd.nn layers built on meta), dp gradient sums."""
    mesh = fd.Mesh({"dp": 64, "sp": 8, "tp": 8})
    d, f = 8192, 28672

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = fd.nn.ColumnParallelLinear(d, f, mesh, "tp", sequence_parallel=True)
            self.fc2 = fd.nn.RowParallelLinear(f, d, mesh, "tp", sequence_parallel=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y: torch.Tensor = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
            return x + y

    with torch.device("meta"):
        blk = Block()

    def step(x: torch.Tensor) -> None:
        blk(x).sum().backward()
        for p in blk.parameters():
            assert p.grad is not None
            fd.psum(p.grad, mesh, "dp")

    tracemalloc.start()
    t0 = time.perf_counter()
    prof = trace(step, mesh, torch.empty(1, 512, d, device="meta", requires_grad=True), modules=[blk])
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 10 and peak < 64 << 20  # one 1.9 GB weight shard per rank, 4096 ranks: nothing allocated
    act = 8 * 512 * d * F4  # the [1, 512, d] per-rank tokens gathered over tp = 8 (S of an all-gather: the output)
    assert [(r.module, r.op, r.phase, r.size) for r in prof.filter(axis="tp").records] == [
        ("fc1", "all_gather", "forward", act), ("fc2", "psum_scatter", "forward", act),
        ("fc2", "psum", "backward", d * F4),  # the sequence-parallel bias gradient
        ("fc2", "all_gather", "backward", act), ("fc1", "psum_scatter", "backward", act),
    ]
    params = (2 * d * (f // 8) + f // 8 + d) * F4
    assert prof.size(axis="dp") == params and prof.records[-1].n == 64
    assert all(p.device.type == "meta" for p in blk.parameters())  # the module is left as it was


def test_trace_refuses_inside_simulate() -> None:
    mesh = fd.Mesh({"tp": 2})

    def inner(x: torch.Tensor) -> torch.Tensor:
        trace(lambda y: fd.psum(y, mesh, "tp"), mesh, torch.ones(2))
        return x

    with pytest.raises(ProfileError, match="being simulated"):
        fd.simulate(inner, mesh)(torch.ones(2, 1))


def test_hf_llama_modules_and_phases() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.llama(model, sequence_parallel=True))
    ids = torch.randint(0, 61, (2, 8))
    prof = trace_model(pm, input_ids=ids, labels=ids)
    act = 2 * 8 * 32 * F4  # [batch, tokens, hidden] gathered over tp (sequence parallel)
    for layer in (0, 1):
        down = f"model.layers.{layer}.mlp.down_proj"
        assert [(r.op, r.phase, r.size) for r in prof.filter(module=down).records] == [
            ("psum_scatter", "forward", act), ("all_gather", "backward", act)]
    assert {r.axis for r in prof.records} == {"tp"}
    assert prof.count(phase="forward") > 0 and prof.count(phase="backward") > 0
    assert all(p.grad is None for p in pm.module.parameters())  # the model is untouched


def test_planner_ranks_like_closed_form() -> None:
    """Toy step: one psum of A bytes over tp and one of G bytes over dp; a 4-GPU node; times in closed form."""
    a_bytes, g_bytes = 4 << 20, 64 << 20
    net = Network("toy", 4, Link(100e9, 1e-6), Link(10e9, 20e-6))

    def build(mesh: fd.Mesh) -> Profile:
        names = mesh.axis_names

        def step(a: torch.Tensor, g: torch.Tensor) -> None:
            if "tp" in names:
                fd.psum(a, mesh, "tp")
            if "dp" in names:
                fd.psum(g, mesh, "dp")

        return trace(step, mesh, torch.empty(a_bytes // F4, device="meta"), torch.empty(g_bytes // F4, device="meta"))

    def closed_form(layout: Layout) -> float:
        sizes = dict(layout.axes)
        total, inner = 0.0, 1
        for name, n in reversed(layout.axes):  # innermost first: the group of rank 0 spans ranks 0 .. inner * (n - 1)
            link = net.intra if inner * (n - 1) < net.gpus_per_node else net.inter
            s = a_bytes if name == "tp" else g_bytes
            total += 2 * (n - 1) * link.latency + s * 2 * (n - 1) / n / link.bandwidth
            inner *= n
        assert sizes  # every layout names an axis
        return total

    cands = layouts(16, ("dp", "tp"))
    assert {str(c) for c in cands} == {"tp16", "dp16", "dp2 x tp8", "tp8 x dp2", "dp4 x tp4", "tp4 x dp4", "dp8 x tp2", "tp2 x dp8"}
    p = plan(build, cands, net)
    want = sorted(cands, key=closed_form)
    assert [pr.layout for pr in p.predictions] == want
    for pr in p.predictions:
        assert pr.time == pytest.approx(closed_form(pr.layout))
    assert p.best.layout == want[0] and str(want[0]) in p.table().splitlines()[2]
    # among layouts that split over both axes, the big gradient sum stays inside a node
    assert next(pr.layout for pr in p.predictions if len(pr.layout.axes) == 2).axes[-1][0] == "dp"


def test_predict_and_layout_errors() -> None:
    mesh = fd.Mesh({"tp": 4})
    prof = trace(lambda x: fd.all_gather(x, mesh, "tp"), mesh, torch.empty(250, device="meta"))
    net = Network("toy", 4, Link(1e9, 1e-6), Link(1e8, 1e-5))
    assert predict(prof, net).time == pytest.approx(3 * 1e-6 + 4000 * 0.75 / 1e9)
    with pytest.raises(ProfileError, match="layouts"):
        layouts(0, ("dp",))
    with pytest.raises(ProfileError, match="plan"):
        plan(lambda m: prof, [], net)
    with pytest.raises(ProfileError, match="filter"):
        prof.filter(nope=1)


@pytest.mark.parametrize("strategy", ["allgather", "all_to_all"])
def test_moe_layer_profile(strategy: str) -> None:
    """The expert-parallel MoE layer (fd.nn.moe) on ep=4: each dispatch strategy's collectives, forward and backward, by hand."""
    import torch.nn.functional as F

    from fastdist.nn import moe as M

    mesh, E, T, H, I, k, ep = fd.Mesh({"ep": 4}), 8, 16, 6, 4, 2, 4

    def step(x: torch.Tensor, logits: torch.Tensor, gu: torch.Tensor, dn: torch.Tensor) -> None:
        r = M.route(logits, k)

        def expert(rows: torch.Tensor, i: int) -> torch.Tensor:
            g, u = F.linear(rows, gu[i]).chunk(2, dim=-1)
            return F.linear(F.silu(g) * u, dn[i])

        M.moe(x, r.weights, r.experts, expert, mesh, "ep", E, strategy=strategy).out.sum().backward()  # type: ignore[arg-type]

    args = (torch.randn(T, H, requires_grad=True), torch.randn(T, E, requires_grad=True),
            torch.randn(E // ep, 2 * I, H, requires_grad=True), torch.randn(E // ep, H, I, requires_grad=True))
    prof = trace(step, mesh, *args)
    rows = [(r.op, r.phase, r.shape, r.size) for r in prof.records]
    if strategy == "allgather":  # gather tokens, expert ids and gates; reduce-scatter the outputs; the transposes backward
        assert rows == [
            ("all_gather", "forward", (T, H), ep * T * H * F4), ("all_gather", "forward", (T, k), ep * T * k * 8),
            ("all_gather", "forward", (T, k), ep * T * k * F4), ("psum_scatter", "forward", (ep * T, H), ep * T * H * F4),
            ("all_gather", "backward", (T, H), ep * T * H * F4), ("psum_scatter", "backward", (ep * T, k), ep * T * k * F4),
            ("psum_scatter", "backward", (ep * T, H), ep * T * H * F4),
        ]
        assert prof.bus_bytes(phase="forward") == pytest.approx((2 * T * H * F4 * ep + T * k * (8 + F4) * ep) * (ep - 1) / ep)
    else:  # the size exchanges (int64), then the ragged dispatch of T*k rows and the combine from the capacity buffer
        ragged = [r for r in prof.records if r.op == "ragged_all_to_all"]
        assert [(r.phase, r.shape, r.bound) for r in ragged] == [
            ("forward", (T * k, H), True), ("forward", (ep * T * k, H), True), ("backward", (T * k, H), True), ("backward", (ep * T * k, H), True),
        ]
        sizes = [r for r in prof.records if r.op == "all_to_all"]
        assert sizes and all(r.dtype == torch.int64 and r.phase == "forward" for r in sizes)
    assert prof.count(axis="ep") == len(prof.records)
