"""fastdist.profile: counts and bytes of every op (forward and backward) against hand-computed
values, the TP MLP formula, a sequence-parallel attention block (ring and Ulysses), the MoE layer,
a 4096-rank dry run (time and resident memory), module attribution (blocks and a HF Llama),
record() of steps that really run (simulated and on gloo ranks) against trace, and the planner (tp
x sp x dp, ep) against closed-form cost models, its table and plot."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fastdist as fd
from fastdist.profile import (
    NETWORKS,
    Link,
    MeshLayout,
    Network,
    Profile,
    ProfileError,
    bus_factor,
    layouts,
    predict,
    rank_layouts,
    record,
    trace,
    trace_model,
)
from tests.dist_harness import run_on_gloo

MESH = fd.Mesh({"dp": 2, "tp": 4})
F4 = 4  # bytes per float32


def _rows(
    f: Callable[..., Any], *shapes: tuple[int, ...]
) -> list[tuple[str, str, str, str, int, float]]:
    """(op, axis, kind, phase, size, bus bytes) of f's collectives, forward and backward of
    y.sum()."""
    xs = [torch.ones(*s, requires_grad=True) for s in shapes]

    def step(*xs: torch.Tensor) -> None:
        y = f(*xs)
        (y[0] if isinstance(y, tuple) else y).sum().backward()

    return [
        (r.op, r.axis, r.kind, r.phase, r.size, r.bus_bytes) for r in trace(step, MESH, *xs).records
    ]


def _rata(x: torch.Tensor) -> Any:
    return fd.ragged_all_to_all(x, MESH, "tp", torch.ones(4, dtype=torch.long), capacity=8)


# bus factors for n = 4: all-reduce, all-gather / reduce-scatter / all-to-all
AR, AG = (
    2 * 3 / 4,
    3 / 4,
)
CASES: list[
    tuple[str, Callable[..., Any], tuple[int, ...], list[tuple[str, str, str, str, int, float]]]
] = [
    # x is [3, 2] float32 (24 bytes) unless said otherwise; n = 4 (tp)
    (
        "psum",
        lambda x: fd.psum(x, MESH, "tp"),
        (3, 2),
        [("psum", "tp", "allreduce", "forward", 24, 24 * AR)],
    ),
    (
        "pmean",
        lambda x: fd.pmean(x, MESH, "tp"),
        (3, 2),
        [("pmean", "tp", "allreduce", "forward", 24, 24 * AR)],
    ),
    (
        "pvary",
        lambda x: fd.pvary(x, MESH, "tp"),
        (3, 2),
        [("psum", "tp", "allreduce", "backward", 24, 24 * AR)],
    ),
    # pmax backward: all-reduce (min) of an int64 winner index per element
    (
        "pmax",
        lambda x: fd.pmax(x, MESH, "tp"),
        (3, 2),
        [
            ("pmax", "tp", "allreduce", "forward", 24, 24 * AR),
            ("select_extreme", "tp", "allreduce", "backward", 48, 48 * AR),
        ],
    ),
    (
        "pmin",
        lambda x: fd.pmin(x, MESH, "tp"),
        (3, 2),
        [
            ("pmin", "tp", "allreduce", "forward", 24, 24 * AR),
            ("select_extreme", "tp", "allreduce", "backward", 48, 48 * AR),
        ],
    ),
    # all_gather: S = the gathered output (4 x 24); backward reduce-scatter of the [12, 2] gradient
    (
        "all_gather",
        lambda x: fd.all_gather(x, MESH, "tp"),
        (3, 2),
        [
            ("all_gather", "tp", "allgather", "forward", 96, 96 * AG),
            ("psum_scatter", "tp", "reducescatter", "backward", 96, 96 * AG),
        ],
    ),
    (
        "all_gather_invariant",
        lambda x: fd.all_gather_invariant(x, MESH, "tp"),
        (3, 2),
        [("all_gather_invariant", "tp", "allgather", "forward", 96, 96 * AG)],
    ),  # backward: a local slice
    (
        "local_chunk",
        lambda x: fd.local_chunk(x, MESH, "tp"),
        (4, 2),  # forward local; backward gathers [1, 2] -> [4, 2]
        [("all_gather_invariant", "tp", "allgather", "backward", 32, 32 * AG)],
    ),
    (
        "psum_scatter",
        lambda x: fd.psum_scatter(x, MESH, "tp"),
        (4, 2),
        [
            ("psum_scatter", "tp", "reducescatter", "forward", 32, 32 * AG),
            ("all_gather", "tp", "allgather", "backward", 32, 32 * AG),
        ],
    ),
    (
        "all_to_all",
        lambda x: fd.all_to_all(x, MESH, "tp", 0, 1),
        (4, 2),
        [
            ("all_to_all", "tp", "alltoall", "forward", 32, 32 * AG),
            ("all_to_all", "tp", "alltoall", "backward", 32, 32 * AG),
        ],
    ),
    (
        "ring_shift",
        lambda x: fd.ring_shift(x, MESH, "tp"),
        (4, 2),
        [
            ("ppermute", "tp", "sendrecv", "forward", 32, 32.0),
            ("ppermute", "tp", "sendrecv", "backward", 32, 32.0),
        ],
    ),
    # a partial permutation: 1 of 4 members sends, so a rank sends a quarter of the buffer on
    # average
    (
        "ppermute",
        lambda x: fd.ppermute(x, MESH, "tp", [(0, 1)]),
        (4, 2),
        [
            ("ppermute", "tp", "sendrecv", "forward", 32, 8.0),
            ("ppermute", "tp", "sendrecv", "backward", 32, 8.0),
        ],
    ),
    # both edges of a width-1 halo along dim 0 ([2, 1, 2] floats) in one exchange, each way
    (
        "halo_exchange",
        lambda x: fd.halo_exchange(x, MESH, "tp", 0, 1),
        (4, 2),
        [
            ("halo_swap", "tp", "sendrecv", "forward", 16, 16.0),
            ("halo_swap", "tp", "sendrecv", "backward", 16, 16.0),
        ],
    ),
    (
        "broadcast",
        lambda x: fd.broadcast(x, MESH, "tp", 1),
        (4, 2),
        [("broadcast", "tp", "broadcast", "forward", 32, 32.0)],
    ),
    # v-ops: S = sum(sizes) rows of 8 bytes = 48
    (
        "all_gather_v",
        lambda x: fd.all_gather_v(x, MESH, "tp", [1, 2, 3, 0]),
        (3, 2),
        [
            ("all_gather_v", "tp", "allgather", "forward", 48, 48 * AG),
            ("reduce_scatter_v", "tp", "reducescatter", "backward", 48, 48 * AG),
        ],
    ),
    (
        "reduce_scatter_v",
        lambda x: fd.reduce_scatter_v(x, MESH, "tp", [1, 2, 3, 0], capacity=3),
        (6, 2),
        [
            ("reduce_scatter_v", "tp", "reducescatter", "forward", 48, 48 * AG),
            ("all_gather_v", "tp", "allgather", "backward", 48, 48 * AG),
        ],
    ),
    (
        "gather_v",
        lambda x: fd.gather_v(x, MESH, "tp", [1, 2, 3, 0], dst=0, capacity=6),
        (3, 2),
        [
            ("gather_v", "tp", "gather", "forward", 48, 48 * AG),
            ("scatter_v", "tp", "scatter", "backward", 48, 48 * AG),
        ],
    ),
    (
        "scatter_v",
        lambda x: fd.scatter_v(x, MESH, "tp", [1, 2, 3, 0], src=0, capacity=3),
        (6, 2),
        [
            ("scatter_v", "tp", "scatter", "forward", 48, 48 * AG),
            ("gather_v", "tp", "gather", "backward", 48, 48 * AG),
        ],
    ),
    # ragged: the size exchange (4 int64), the payload bounded by the send buffer, backward by the
    # capacity (8 rows)
    (
        "ragged_all_to_all",
        _rata,
        (4, 2),
        [
            ("all_to_all", "tp", "alltoall", "forward", 32, 32 * AG),
            ("ragged_all_to_all", "tp", "alltoall", "forward", 32, 32 * AG),
            ("ragged_all_to_all", "tp", "alltoall", "backward", 64, 64 * AG),
        ],
    ),
    # a tuple of axes: one group of 8
    (
        "psum dp+tp",
        lambda x: fd.psum(x, MESH, ("dp", "tp")),
        (3, 2),
        [("psum", "dp+tp", "allreduce", "forward", 24, 24 * 2 * 7 / 8)],
    ),
    (
        "all_gather dp",
        lambda x: fd.all_gather(x, MESH, "dp"),
        (3, 2),
        [
            ("all_gather", "dp", "allgather", "forward", 48, 24.0),
            ("psum_scatter", "dp", "reducescatter", "backward", 48, 24.0),
        ],
    ),
]


@pytest.mark.parametrize("name, f, shape, want", CASES, ids=[c[0] for c in CASES])
def test_every_op_counts_and_bytes(
    name: str, f: Callable[..., Any], shape: tuple[int, ...], want: list[Any]
) -> None:
    assert _rows(f, shape) == want


def test_bound_flag_and_bus_factors() -> None:
    prof = trace(lambda x: _rata(x)[0].sum().backward(), MESH, torch.ones(4, 2, requires_grad=True))
    assert [r.bound for r in prof.records] == [False, True, True]
    assert [
        bus_factor(k, 8)
        for k in ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast", "sendrecv")
    ] == [1.75, 0.875, 0.875, 0.875, 1.0, 1.0]
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
    assert (
        prof.count(axis="tp", phase="forward") == 1 and prof.count(axis="tp", phase="backward") == 1
    )
    assert prof.size(axis="tp") == 2 * act
    assert prof.bus_bytes(axis="tp") == pytest.approx(2 * act * 2 * (tp - 1) / tp)
    grads = 2 * d * (h // tp) * F4
    if dp > 1:
        assert prof.count(axis="dp") == 2 and prof.size(axis="dp") == grads
        assert prof.bus_bytes(axis="dp") == pytest.approx(grads * 2 * (dp - 1) / dp)
    else:
        assert prof.count(axis="dp") == 0


def test_dry_run_4096_ranks_is_fast_and_small() -> None:
    """A 4096-rank layout of a 8192 x 28672 sequence-parallel MLP block (fd.nn layers built on
    meta), dp gradient sums."""
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

    t0 = time.perf_counter()
    prof = trace(
        step, mesh, torch.empty(1, 512, d, device="meta", requires_grad=True), modules=[blk]
    )
    assert time.perf_counter() - t0 < 10  # resident memory: test_dry_run_4096_ranks_resident_memory
    # the [1, 512, d] per-rank tokens gathered over tp = 8 (S of an all-gather: the output)
    act = 8 * 512 * d * F4
    assert [(r.module, r.op, r.phase, r.size) for r in prof.filter(axis="tp").records] == [
        ("fc1", "all_gather", "forward", act),
        ("fc2", "psum_scatter", "forward", act),
        ("fc2", "psum", "backward", d * F4),  # the sequence-parallel bias gradient
        ("fc2", "all_gather", "backward", act),
        ("fc1", "psum_scatter", "backward", act),
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
    cfg = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg)
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=True))
    ids = torch.randint(0, 61, (2, 8))
    prof = trace_model(pm, input_ids=ids, labels=ids)
    act = 2 * 8 * 32 * F4  # [batch, tokens, hidden] gathered over tp (sequence parallel)
    for layer in (0, 1):
        down = f"model.layers.{layer}.mlp.down_proj"
        assert [(r.op, r.phase, r.size) for r in prof.filter(module=down).records] == [
            ("psum_scatter", "forward", act),
            ("all_gather", "backward", act),
        ]
    assert {r.axis for r in prof.records} == {"tp"}
    assert prof.count(phase="forward") > 0 and prof.count(phase="backward") > 0
    assert all(p.grad is None for p in pm.module.parameters())  # the model is untouched


def test_planner_ranks_like_closed_form() -> None:
    """Toy step: one psum of A bytes over tp and one of G bytes over dp; a 4-GPU node; times in
    closed form."""
    a_bytes, g_bytes = 4 << 20, 64 << 20
    net = Network("toy", 4, Link(100e9, 1e-6), Link(10e9, 20e-6))

    def build(mesh: fd.Mesh) -> Profile:
        names = mesh.axis_names

        def step(a: torch.Tensor, g: torch.Tensor) -> None:
            if "tp" in names:
                fd.psum(a, mesh, "tp")
            if "dp" in names:
                fd.psum(g, mesh, "dp")

        return trace(
            step,
            mesh,
            torch.empty(a_bytes // F4, device="meta"),
            torch.empty(g_bytes // F4, device="meta"),
        )

    def closed_form(layout: MeshLayout) -> float:
        sizes = dict(layout.axes)
        total, inner = 0.0, 1
        # innermost first: the group of rank 0 spans ranks 0 .. inner * (n - 1)
        for name, n in reversed(layout.axes):
            link = net.intra if inner * (n - 1) < net.gpus_per_node else net.inter
            s = a_bytes if name == "tp" else g_bytes
            total += 2 * (n - 1) * link.latency + s * 2 * (n - 1) / n / link.bandwidth
            inner *= n
        assert sizes  # every layout names an axis
        return total

    cands = layouts(16, ("dp", "tp"))
    assert {str(c) for c in cands} == {
        "tp16",
        "dp16",
        "dp2 x tp8",
        "tp8 x dp2",
        "dp4 x tp4",
        "tp4 x dp4",
        "dp8 x tp2",
        "tp2 x dp8",
    }
    p = rank_layouts(build, cands, net)
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
    with pytest.raises(ProfileError, match="rank_layouts"):
        rank_layouts(lambda m: prof, [], net)
    with pytest.raises(ProfileError, match="filter"):
        prof.filter(nope=1)


def _moe_step(
    mesh: fd.Mesh,
    strategy: str,
    axis: str = "ep",
    E: int = 8,
    T: int = 16,
    H: int = 6,
    I: int = 4,
    k: int = 2,
    dp: str | None = None,
    meta: bool = False,
) -> tuple[Callable[..., None], tuple[torch.Tensor, ...]]:
    """One rank's MoE layer step (fd.nn.moe, E experts over ``axis``, top-k of T tokens, SwiGLU
    experts H -> I -> H), forward and backward; with ``dp`` the expert weight gradients are then
    all-reduced over it. ``meta``: meta inputs."""
    import torch.nn.functional as F

    from fastdist.nn import moe as M

    ep = mesh.axis_size(axis)

    def step(x: torch.Tensor, logits: torch.Tensor, gu: torch.Tensor, dn: torch.Tensor) -> None:
        r = M.route(logits, k)

        def expert(rows: torch.Tensor, i: int) -> torch.Tensor:
            g, u = F.linear(rows, gu[i]).chunk(2, dim=-1)
            return F.linear(F.silu(g) * u, dn[i])

        M.moe(
            x, r.weights, r.experts, expert, mesh, axis, E, strategy=strategy
        ).out.sum().backward()  # type: ignore[arg-type,no-untyped-call]
        if dp is not None:
            assert gu.grad is not None and dn.grad is not None
            fd.psum(gu.grad, mesh, dp)
            fd.psum(dn.grad, mesh, dp)

    def new(*shape: int) -> torch.Tensor:
        return (
            torch.empty(*shape, device="meta", requires_grad=True)
            if meta
            else torch.randn(*shape, requires_grad=True)
        )

    return step, (new(T, H), new(T, E), new(E // ep, 2 * I, H), new(E // ep, H, I))


def _moe_rows(
    ep: int, E: int, T: int, H: int, k: int
) -> list[tuple[str, str, tuple[int, ...], torch.dtype, int, float, bool]]:
    """Hand-computed records (op, phase, shape, dtype, S, bus bytes, bound) of the all_to_all MoE
    layer on ``ep`` ranks."""
    a2a = (ep - 1) / ep
    # tokens per (rank, local expert)
    counts = (
        "all_to_all",
        "forward",
        (ep, E // ep),
        torch.int64,
        E * 8,
        E * 8 * a2a,
        False,
    )
    # each ragged exchange's row counts
    sizes = (
        "all_to_all",
        "forward",
        (ep, 1),
        torch.int64,
        ep * 8,
        ep * 8 * a2a,
        False,
    )
    # dispatch sends the T*k assignments; combine sends back from the ep*T*k-row receive buffer
    rows, cap = (
        T * k,
        ep * T * k,
    )
    send = (
        "ragged_all_to_all",
        "forward",
        (rows, H),
        torch.float32,
        rows * H * F4,
        rows * H * F4 * a2a,
        True,
    )
    back = (
        "ragged_all_to_all",
        "forward",
        (cap, H),
        torch.float32,
        cap * H * F4,
        cap * H * F4 * a2a,
        True,
    )
    return [
        counts,
        sizes,
        send,
        sizes,
        back,
        (
            "ragged_all_to_all",
            "backward",
            *send[2:],
        ),  # combine's transpose: the T*k gradient rows go back out
        ("ragged_all_to_all", "backward", *back[2:]),
    ]  # dispatch's transpose: from the receive buffer


@pytest.mark.parametrize("strategy", ["allgather", "all_to_all"])
def test_moe_layer_profile(strategy: str) -> None:
    """The expert-parallel MoE layer (fd.nn.moe) on ep=4: each dispatch strategy's collectives,
    forward and backward, by hand."""
    mesh, E, T, H, k, ep = fd.Mesh({"ep": 4}), 8, 16, 6, 2, 4
    step, args = _moe_step(mesh, strategy)
    prof = trace(step, mesh, *args)
    # gather tokens, expert ids and gates; reduce-scatter the outputs; the transposes backward
    if strategy == "allgather":
        rows = [(r.op, r.phase, r.shape, r.size) for r in prof.records]
        assert rows == [
            ("all_gather", "forward", (T, H), ep * T * H * F4),
            ("all_gather", "forward", (T, k), ep * T * k * 8),
            ("all_gather", "forward", (T, k), ep * T * k * F4),
            ("psum_scatter", "forward", (ep * T, H), ep * T * H * F4),
            ("all_gather", "backward", (T, H), ep * T * H * F4),
            ("psum_scatter", "backward", (ep * T, k), ep * T * k * F4),
            ("psum_scatter", "backward", (ep * T, H), ep * T * H * F4),
        ]
        assert prof.bus_bytes(phase="forward") == pytest.approx(
            (2 * T * H * F4 * ep + T * k * (8 + F4) * ep) * (ep - 1) / ep
        )
    else:
        # the size exchanges (int64), then the ragged dispatch of T*k rows and the combine from the
        # capacity buffer
        got = [
            (r.op, r.phase, r.shape, r.dtype, r.size, r.bus_bytes, r.bound) for r in prof.records
        ]
        assert got == _moe_rows(ep, E, T, H, k)
        # forward: E + 2 ep int64 counts, T*k rows out, ep*T*k rows back; each all-to-all sends
        # (ep-1)/ep of its buffer
        assert prof.bus_bytes(phase="forward") == pytest.approx(
            ((E + 2 * ep) * 8 + (T * k + ep * T * k) * H * F4) * (ep - 1) / ep
        )
        assert prof.bus_bytes(phase="backward") == pytest.approx(
            (T * k + ep * T * k) * H * F4 * (ep - 1) / ep
        )
    assert prof.count(axis="ep") == len(prof.records)


# ====================================================================== a sequence-parallel
# attention block
class SPBlock(nn.Module):
    """Pre-norm transformer block: tokens split over sp (ring or Ulysses attention), heads and MLP
    features over tp (merged column-parallel qkv, row-parallel out projection, column/row-parallel
    MLP)."""

    def __init__(self, d: int, heads: int, f: int, mesh: fd.Mesh, kind: str) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = fd.nn.MergedColumnParallelLinear(d, (d, d, d), mesh, "tp")
        self.o = fd.nn.RowParallelLinear(d, d, mesh, "tp")
        self.attn = (
            fd.nn.RingAttention(mesh, "sp", causal=True)
            if kind == "ring"
            else fd.nn.UlyssesAttention(mesh, "sp", causal=True)
        )
        self.fc1, self.fc2 = (
            fd.nn.ColumnParallelLinear(d, f, mesh, "tp"),
            fd.nn.RowParallelLinear(f, d, mesh, "tp"),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hd = x.shape[-1] // self.heads
        # (B, m, heads / tp, hd)
        q, k, v = (t.unflatten(-1, (-1, hd)) for t in self.qkv(self.ln1(x)))
        x = x + self.o(self.attn(q, k, v).flatten(-2))
        out: torch.Tensor = x + self.fc2(torch.tanh(self.fc1(self.ln2(x))))
        return out


def _sp_block_step(blk: nn.Module, mesh: fd.Mesh) -> Callable[[torch.Tensor], None]:
    def step(x: torch.Tensor) -> None:
        blk(x).sum().backward()
        if mesh.shape["dp"] > 1:
            for p in blk.parameters():
                assert p.grad is not None
                fd.psum(p.grad, mesh, "dp")

    return step


@pytest.mark.parametrize("kind", ["ring", "ulysses"])
def test_sp_attention_block_profile(kind: str) -> None:
    """Every collective of the block on dp2 x sp4 x tp2, per axis, module, op and phase, against
    hand-computed values."""
    dp, sp, tp, B, m, d, heads, f = 2, 4, 2, 2, 16, 64, 8, 128
    mesh = fd.Mesh({"dp": dp, "sp": sp, "tp": tp})
    with torch.device("meta"):
        blk = SPBlock(d, heads, f, mesh, kind)
    prof = trace(
        _sp_block_step(blk, mesh),
        mesh,
        torch.empty(B, m, d, device="meta", requires_grad=True),
        modules=[blk],
    )
    # a [B, m, d] activation: row-parallel outputs, column-parallel input gradients
    act = B * m * d * F4
    # one of q, k, v (or the attention output) on this rank: its heads / tp, its m tokens
    kv = B * m * (d // tp) * F4
    ar_tp, ar_dp, a2a = 2 * (tp - 1) / tp, 2 * (dp - 1) / dp, (sp - 1) / sp
    # ring: k and v travel sp - 1 hops forward; each hop's transpose is the opposite hop backward;
    # every member sends
    if kind == "ring":
        sp_rows: dict[tuple[str, str, str, str], tuple[int, int, float]] = {
            ("sp", "attn", "ppermute", ph): (2 * (sp - 1), 2 * (sp - 1) * kv, 2.0 * (sp - 1) * kv)
            for ph in ("forward", "backward")
        }
    else:  # q, k, v to heads and the output back: 4 all-to-alls forward, their inverses backward
        sp_rows = {
            ("sp", "attn", "all_to_all", ph): (4, 4 * kv, 4 * kv * a2a)
            for ph in ("forward", "backward")
        }
    # ln1, ln2 (weight, bias); qkv: 3 x (d/tp rows of d, bias d/tp); o: d x d/tp, bias d; fc1: f/tp
    # x d, bias f/tp; fc2: d x f/tp, bias d
    params = (
        2 * 2 * d
        + 3 * (d // tp) * (d + 1)
        + (d * (d // tp) + d)
        + (f // tp) * (d + 1)
        + (d * (f // tp) + d)
    )
    want = {
        **sp_rows,
        ("tp", "o", "psum", "forward"): (1, act, act * ar_tp),
        ("tp", "fc2", "psum", "forward"): (1, act, act * ar_tp),
        ("tp", "fc1", "psum", "backward"): (1, act, act * ar_tp),
        ("tp", "qkv", "psum", "backward"): (1, act, act * ar_tp),  # pvary's transposes
        ("dp", "", "psum", "forward"): (
            16,
            params * F4,
            params * F4 * ar_dp,
        ),  # 16 parameter gradients, after backward()
    }
    got = {
        (r["axis"], r["module"], r["op"], r["phase"]): (r["count"], r["size"], r["bus_bytes"])
        for r in prof.summary(by=("axis", "module", "op", "phase"))
    }
    assert got.keys() == want.keys() and all(
        got[key] == pytest.approx(want[key]) for key in want
    ), got
    sp_op, sp_count = ("ppermute", 2 * (sp - 1)) if kind == "ring" else ("all_to_all", 4)
    # issue order
    forward = [(r.module, r.op) for r in prof.filter(phase="forward").records if r.axis != "dp"]
    assert forward == [("attn", sp_op)] * sp_count + [("o", "psum"), ("fc2", "psum")]


# ====================================================================== dry run at scale: resident
# memory
_DRY_RUN = textwrap.dedent("""
    import json, time
    import torch, fastdist as fd
    from torch import nn
    from fastdist.profile import trace

    def run(mesh, d, f, tokens):
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = fd.nn.ColumnParallelLinear(d, f, mesh, "tp", sequence_parallel=True)
                self.fc2 = fd.nn.RowParallelLinear(f, d, mesh, "tp", sequence_parallel=True)
            def forward(self, x):
                return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        with torch.device("meta"):
            blk = Block()
        def step(x):
            blk(x).sum().backward()
            for p in blk.parameters():
                fd.psum(p.grad, mesh, "dp")
        x = torch.empty(1, tokens, d, device="meta", requires_grad=True)
        return trace(step, mesh, x, modules=[blk])

    def status(key):
        # bytes of the resident set now (VmRSS) or at its peak (VmHWM), torch's allocations included
        lines = open("/proc/self/status").read().splitlines()
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(key + ":"))

    def peak_of(fn):
        # how far the resident set rose above where it was, at its highest, while fn ran
        # the peak (VmHWM) back to the resident set now
        open("/proc/self/clear_refs", "w").write("5")
        before = status("VmRSS")
        out = fn()
        return status("VmHWM") - before, out

    run(fd.Mesh({"dp": 2, "sp": 1, "tp": 2}), 64, 256, 8)  # warm-up: lazy imports, caches
    t0 = time.perf_counter()
    extra, prof = peak_of(lambda: run(fd.Mesh({"dp": 64, "sp": 8, "tp": 8}), 8192, 28672, 512))
    seconds = time.perf_counter() - t0
    # 256 MiB really allocated (and freed)
    control, _ = peak_of(lambda: torch.empty(256 << 20, dtype=torch.uint8).fill_(1))
    out = {"seconds": seconds, "extra": extra, "control": control, "records": len(prof.records)}
    print(json.dumps(out))
""")


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="Linux's /proc/self/status and clear_refs"
)
def test_dry_run_4096_ranks_resident_memory() -> None:
    """The 4096-rank dry run in a fresh process: its peak resident memory (what torch allocates
    included) stays within 64 MiB of what the process held before, while one rank's two weight
    shards alone would take 235 MB (and its gathered activation 134 MB); 256 MiB allocated (and
    freed) for real do show up in the same measure. Linux: the peak is /proc/self/status's VmHWM,
    reset through /proc/self/clear_refs."""
    proc = subprocess.run(
        [sys.executable, "-c", _DRY_RUN], capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["records"] == 9 and out["seconds"] < 10
    assert out["extra"] < 32 << 20, out
    assert out["control"] >= 256 << 20, out


# ====================================================================== record(): a step as it
# really runs
@pytest.mark.parametrize("name, f, shape, want", CASES, ids=[c[0] for c in CASES])
def test_record_under_simulate_equals_trace(
    name: str, f: Callable[..., Any], shape: tuple[int, ...], want: list[Any]
) -> None:
    """Every op run on the 8 simulated ranks (forward under simulate, backward outside) records
    what trace records."""
    xs = torch.ones(MESH.size, *shape, requires_grad=True)

    def fwd(x: torch.Tensor) -> torch.Tensor:
        y = f(x)
        out: torch.Tensor = y[0] if isinstance(y, tuple) else y
        return out

    with record(MESH) as rec:
        fd.simulate(fwd, MESH)(xs).sum().backward()  # type: ignore[no-untyped-call]
    assert [
        (r.op, r.axis, r.kind, r.phase, r.size, r.bus_bytes) for r in rec.profile.records
    ] == want
    assert rec.profile.records == trace(lambda x: fwd(x).sum().backward(), MESH, xs[0]).records  # type: ignore[no-untyped-call]


def test_record_scope_and_nesting() -> None:
    """Only what runs inside the block is recorded; nested recordings each see their part; a trace
    inside a recording stays out of it; afterwards the collectives are the plain methods again."""
    from fastdist.core.primitive import PRIMITIVES

    mesh, x = fd.Mesh({"tp": 4}), torch.ones(4, 3)

    def psum(t: torch.Tensor) -> torch.Tensor:
        return fd.psum(t, mesh, "tp")

    with record(mesh) as outer:
        fd.simulate(psum, mesh)(x)
        with record(mesh) as inner:
            fd.simulate(lambda t: fd.all_gather(t, mesh, "tp"), mesh)(x)
            assert len(trace(psum, mesh, x[0]).records) == 1
    fd.simulate(psum, mesh)(x)
    assert [r.op for r in outer.profile.records] == ["psum", "all_gather"]
    assert [r.op for r in inner.profile.records] == ["all_gather"]
    assert all("bind" not in vars(p) and "bind_stacked" not in vars(p) for p in PRIMITIVES.values())
    with pytest.raises(ProfileError, match="record"):
        with record("tp"):  # type: ignore[arg-type]
            pass


def gloo_profiles() -> list[Any]:
    """On 4 gloo ranks: the attention blocks recorded as they run on real ranks, and traced on the
    real mesh, equal their trace on a plain mesh of the same axes (module paths included); the MoE
    layer traces on a real mesh."""
    real, plain = (
        fd.connect(order=("dp", "sp", "tp"), sp=2, tp=2),
        fd.Mesh({"dp": 1, "sp": 2, "tp": 2}),
    )
    out: list[Any] = []
    for kind in ("ring", "ulysses"):
        profiles = []
        for mesh, run in ((plain, False), (real, False), (real, True)):
            torch.manual_seed(0)
            blk = SPBlock(16, 4, 32, mesh, kind)
            x = torch.randn(2, 4, 16, requires_grad=True)
            if run:
                with record(mesh, modules=[blk]) as rec:
                    _sp_block_step(blk, mesh)(x)
                profiles.append(rec.profile.records)
            else:
                profiles.append(trace(_sp_block_step(blk, mesh), mesh, x, modules=[blk]).records)
        out.append((kind, len(profiles[0]), profiles[1] == profiles[0], profiles[2] == profiles[0]))
    ep = fd.connect(ep=4)
    for strategy in ("allgather", "all_to_all"):
        step, args = _moe_step(ep, strategy)
        records = trace(step, ep, *args).records
        step, args = _moe_step(fd.Mesh({"ep": 4}), strategy)
        out.append((strategy, records == trace(step, fd.Mesh({"ep": 4}), *args).records, records))
    return out


def test_real_ranks_profile_like_plain_mesh() -> None:
    for rank in run_on_gloo(gloo_profiles, 4, timeout=300):
        # 4 tp psums, and over sp: k and v 1 hop each way (ring) / 4 all-to-alls each way (Ulysses)
        assert rank[:2] == [("ring", 4 + 4, True, True), ("ulysses", 4 + 8, True, True)]
        (_, allgather_same, _), (_, a2a_same, a2a) = rank[2:]
        assert allgather_same and a2a_same
        assert [
            (r.op, r.phase, r.shape, r.dtype, r.size, r.bus_bytes, r.bound) for r in a2a
        ] == _moe_rows(4, 8, 16, 6, 2)


# ====================================================================== the planner on tp x sp x dp
# and ep
TOY = Network("toy", 4, Link(100e9, 1e-6), Link(10e9, 20e-6))  # 4 GPUs a node


def _group_time(net: Network, layout: MeshLayout, axis: str, kind: str, size: float) -> float:
    """Alpha-beta time of one ring collective of S = ``size`` bytes over ``axis`` of ``layout``, by
    hand."""
    names = [a for a, _ in layout.axes]
    if axis not in names:
        return 0.0
    i = names.index(axis)
    n, inner = layout.axes[i][1], math.prod(s for _, s in layout.axes[i + 1 :])
    # rank 0's group spans ranks 0 .. (n-1) * inner
    link = net.intra if (n - 1) * inner < net.gpus_per_node else net.inter
    if kind == "allreduce":
        return 2 * (n - 1) * link.latency + size * 2 * (n - 1) / n / link.bandwidth
    if kind == "sendrecv":
        return link.latency + size / link.bandwidth
    return (n - 1) * link.latency + size * (
        n - 1
    ) / n / link.bandwidth  # all-gather, reduce-scatter, all-to-all


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta", requires_grad=True)


N_TOK, D_MODEL = 4096, 1024


def _tp_sp_dp_build(mesh: fd.Mesh) -> Profile:
    """Per rank: N/(dp*sp) tokens; a tp-sharded projection in (pvary) and out (psum); the projected
    block travels the sp ring (sp - 1 hops, as ring attention's k/v); the weight gradient is
    all-reduced over dp."""
    dp, sp, tp = (mesh.shape[a] for a in ("dp", "sp", "tp"))

    def step(x: torch.Tensor, w: torch.Tensor) -> None:
        blocks = [fd.pvary(x, mesh, "tp") @ w]  # (t, D/tp)
        for _ in range(sp - 1):
            blocks.append(fd.ring_shift(blocks[-1], mesh, "sp"))
        fd.psum(torch.stack(blocks).sum(0) @ w.T, mesh, "tp").sum().backward()  # type: ignore[no-untyped-call]
        assert w.grad is not None
        fd.psum(w.grad, mesh, "dp")

    return trace(step, mesh, _meta(N_TOK // (dp * sp), D_MODEL), _meta(D_MODEL, D_MODEL // tp))


def _tp_sp_dp_closed_form(layout: MeshLayout) -> float:
    sizes = {"dp": 1, "sp": 1, "tp": 1, **dict(layout.axes)}
    t, tp, sp = N_TOK // (sizes["dp"] * sizes["sp"]), sizes["tp"], sizes["sp"]
    return (
        2
        # the psum forward, pvary's psum backward
        * _group_time(TOY, layout, "tp", "allreduce", t * D_MODEL * F4)
        + 2
        * (sp - 1)
        # the hops and their transposes
        * _group_time(TOY, layout, "sp", "sendrecv", t * (D_MODEL // tp) * F4)
        + _group_time(TOY, layout, "dp", "allreduce", D_MODEL * (D_MODEL // tp) * F4)
    )


def test_planner_tp_sp_dp_closed_form() -> None:
    cands = layouts(16, ("dp", "sp", "tp"))
    assert len(cands) == len(set(cands)) and {str(c) for c in cands} >= {
        "dp2 x sp2 x tp4",
        "tp4 x sp2 x dp2",
        "sp16",
        "dp4 x tp4",
    }
    p = rank_layouts(_tp_sp_dp_build, cands, TOY)
    assert sorted(str(pr.layout) for pr in p.predictions) == sorted(map(str, cands))
    for pr in p.predictions:
        assert pr.time == pytest.approx(_tp_sp_dp_closed_form(pr.layout), rel=1e-9), str(pr.layout)
    assert [pr.time for pr in p.predictions] == sorted(pr.time for pr in p.predictions)
    assert p.best.time == pytest.approx(min(map(_tp_sp_dp_closed_form, cands)), rel=1e-9)
    # the convenience form: a world size (every order of the axes) and a network by name
    q = rank_layouts(_tp_sp_dp_build, 16, TOY, axes=("dp", "sp", "tp"))
    assert [(pr.layout, pr.time) for pr in q.predictions] == [
        (pr.layout, pr.time) for pr in p.predictions
    ]
    assert (
        rank_layouts(_tp_sp_dp_build, 8, "dgx-h100", axes=("dp", "sp", "tp")).network
        is NETWORKS["dgx-h100"]
    )
    with pytest.raises(ProfileError, match="no network named 'nvl72'"):
        rank_layouts(_tp_sp_dp_build, 8, "nvl72")
    with pytest.raises(ProfileError, match="not a Profile"):
        rank_layouts(lambda mesh: None, 4, TOY)  # type: ignore[arg-type,return-value]


def test_planner_moe_ep_dp_closed_form() -> None:
    """The MoE layer (all_to_all dispatch) over ep, its expert gradients all-reduced over dp: 8
    ranks, every layout."""
    E, k, H, I = 8, 2, 1024, 2048

    def build(mesh: fd.Mesh) -> Profile:
        dp, ep = mesh.shape["dp"], mesh.shape["ep"]
        step, args = _moe_step(
            mesh, "all_to_all", E=E, T=N_TOK // (dp * ep), H=H, I=I, k=k, dp="dp", meta=True
        )
        return trace(step, mesh, *args)

    def closed_form(layout: MeshLayout) -> float:
        sizes = {"dp": 1, "ep": 1, **dict(layout.axes)}
        ep, t = sizes["ep"], N_TOK // (sizes["dp"] * sizes["ep"])
        a2a = (
            sum(_group_time(TOY, layout, "ep", "alltoall", r[4]) for r in _moe_rows(ep, E, t, H, k))
            if ep > 1
            else 0.0
        )
        # this rank's experts' weight gradients
        gate_up, down = (
            (E // ep) * 2 * I * H * F4,
            (E // ep) * H * I * F4,
        )
        return (
            a2a
            + _group_time(TOY, layout, "dp", "allreduce", gate_up)
            + _group_time(TOY, layout, "dp", "allreduce", down)
        )

    p = rank_layouts(build, 8, TOY, axes=("dp", "ep"))
    assert {str(pr.layout) for pr in p.predictions} == {
        "ep8",
        "dp8",
        "dp2 x ep4",
        "ep4 x dp2",
        "dp4 x ep2",
        "ep2 x dp4",
    }
    for pr in p.predictions:
        assert pr.time == pytest.approx(closed_form(pr.layout), rel=1e-9), str(pr.layout)
        assert pr.profile is not None and {r.axis for r in pr.profile.records} <= {"dp", "ep"}
    assert [pr.time for pr in p.predictions] == sorted(pr.time for pr in p.predictions)
    assert p.best.time == pytest.approx(
        min(closed_form(c) for c in layouts(8, ("dp", "ep"))), rel=1e-9
    )
    # dp inside a node all-reduces 4 experts' gradients faster than ep8 sends its combine buffer
    # (charged whole: ep*T*k rows)
    assert [str(pr.layout) for pr in p.predictions][:2] == ["ep2 x dp4", "ep4 x dp2"] and str(
        p.predictions[-1].layout
    ) == "dp8"


def test_plan_plot_bars_and_labels() -> None:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = rank_layouts(_tp_sp_dp_build, 8, TOY, axes=("dp", "sp", "tp"))
    ax = p.plot()
    try:
        labels = [str(pr.layout) for pr in p.predictions]
        assert [
            t.get_text() for t in ax.get_yticklabels()
        ] == labels and ax.yaxis_inverted()  # fastest on top
        axes = sorted({a for pr in p.predictions for a in pr.by_axis})
        # one bar series per axis, stacked
        assert axes == ["dp", "sp", "tp"] and [c.get_label() for c in ax.containers] == axes
        assert [t.get_text() for t in ax.get_legend().get_texts()] == axes
        for i, pr in enumerate(p.predictions):
            bars = [c.patches[i] for c in ax.containers]
            assert [b.get_width() for b in bars] == pytest.approx(
                [pr.by_axis.get(a, 0.0) * 1e3 for a in axes]
            )  # ms per axis
            # the stack ends at the total
            assert bars[-1].get_x() + bars[-1].get_width() == pytest.approx(pr.time * 1e3)
            assert {b.get_y() for b in bars} == {bars[0].get_y()}  # one row
        assert ax.get_xlabel() == "predicted communication time (ms), toy"
    finally:
        plt.close(ax.figure)
