"""fastdist benchmarks: ratios against baselines measured in the same run.

    python benchmarks/run.py                  # the CPU suite (a few minutes), writes
                                              # benchmarks/results/
    python benchmarks/run.py --quick          # tiny sizes: a smoke run (CI runs this)
    python benchmarks/run.py --only sim --device cuda   # simulated ranks vs one device on a GPU

Sections:
  sim       simulated 8-rank tensor-parallel MLP (forward + backward) vs the same unsharded MLP on
            one device (eager and torch.compile), vs a naive Python loop over ranks, vs JAX
            (optional); and a tensor x sequence parallel transformer block (hidden 1024) on
            per-rank parameters and through fd.spmd vs one device (eager and torch.compile),
            once more in a child process whose glibc malloc keeps freed memory
  overhead  per-call time on 2 gloo processes, fastdist vs torch.distributed (c10d) vs torch's
            functional collectives, for psum / all_gather / psum_scatter / all_to_all / ppermute
            over message sizes (interleaved, barrier-aligned; wall and thread CPU time); added
            microseconds, bus bandwidth (nccl-tests definition), and fastdist's own work per
            call with the transport replaced by local stand-ins
  groups    process-group creation at world 8 on gloo: each rank creating only its own groups
            (local synchronisation) vs every rank creating every group
  mesh      rank-group layout for meshes up to 4096 ranks (pure computation)

Output: results.json, results.md (tables) and overhead.png (ratio vs message size).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch

import fastdist as fd

HERE = Path(__file__).resolve().parent


def _timeit(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """Median seconds per call over ``reps`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# what both sides call
_C10D_COLLECTIVES = (
    "all_reduce",
    "all_gather_single",
    "reduce_scatter_single",
    "all_to_all_single",
)


@contextlib.contextmanager
def _replaced_collectives(
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> Iterator[None]:
    """torch.distributed's collectives replaced by ``make(original)`` for the block, restored
    after."""
    import torch.distributed as dist

    saved = {k: getattr(dist, k) for k in _C10D_COLLECTIVES}
    try:
        for k, f in saved.items():
            setattr(dist, k, make(f))
        yield
    finally:
        for k, f in saved.items():
            setattr(dist, k, f)


def _own_work_us(
    cases: dict[str, dict[str, Callable[[], Any]]], reps: int, calls: int = 100
) -> dict[str, dict[str, float]]:
    """CPU time per call of the fastdist and c10d calls with torch.distributed's collectives stubbed
    out.

    Both sides then do only their own Python and tensor work (fastdist: argument checks, the
    group spec, the rule, the transport, the output allocation; c10d: the output
    allocation), so the difference is what fastdist adds, free of gloo's jitter. Measured
    as thread CPU time over batches of ``calls`` calls, the two sides' batches alternating; the
    added time (``"added"``) is the median of the per-pair differences, so a slow phase of
    the machine lands on both sides of a pair.
    """
    out: dict[str, dict[str, float]] = {}

    def batch_us(fn: Callable[[], Any]) -> float:
        t = time.thread_time()
        for _ in range(calls):
            fn()
        return (time.thread_time() - t) / calls * 1e6

    with _replaced_collectives(lambda f: lambda *a, **kw: None):
        for op, impls in cases.items():
            fd_fn, c10d_fn = impls["fastdist"], impls["c10d"]
            for _ in range(2):  # warm-up
                batch_us(fd_fn), batch_us(c10d_fn)
            pairs = []
            for i in range(reps):
                if i % 2 == 0:
                    f = batch_us(fd_fn)
                    c = batch_us(c10d_fn)
                else:
                    c = batch_us(c10d_fn)
                    f = batch_us(fd_fn)
                pairs.append((f, c))
            out[op] = {
                "fastdist": statistics.median(f for f, _ in pairs),
                "c10d": statistics.median(c for _, c in pairs),
                "added": statistics.median(f - c for f, c in pairs),
            }
    return out


def _outside_us(
    cases: dict[str, dict[str, Callable[[], Any]]], group: Any, rounds: int
) -> dict[str, dict[str, float]]:
    """Cold calls (one after a barrier): CPU time per call spent outside the c10d collective it
    makes.

    torch.distributed's collectives are wrapped to add up the time spent inside them; what
    is left is each side's own work with caches as a real call finds them after a gloo
    round trip, without gloo's jitter. Both sides pay the same wrapper, so it cancels in
    the difference.
    """
    import torch.distributed as dist

    inside = [0]

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            t = time.thread_time_ns()
            try:
                return f(*a, **kw)
            finally:
                inside[0] += time.thread_time_ns() - t

        return call

    samples: dict[str, dict[str, list[float]]] = {op: {"fastdist": [], "c10d": []} for op in cases}
    with _replaced_collectives(wrap):
        for rnd in range(rounds + 2):
            for op, impls in cases.items():
                for impl in ("fastdist", "c10d"):
                    dist.barrier(group)
                    inside[0] = 0
                    t = time.thread_time_ns()
                    impls[impl]()
                    t = time.thread_time_ns() - t
                    if rnd >= 2:  # warm-up
                        samples[op][impl].append((t - inside[0]) / 1e3)
    return {op: {impl: statistics.median(v) for impl, v in d.items()} for op, d in samples.items()}


# ==================================================================== simulated ranks vs one device
# A benchmark case: (label, one device, simulated, compiled one device, compiled simulated, a
# fifth variant: the per-rank loop for the MLP, the stacked-weights run for the block); each
# callable runs one forward and backward step.
_Case = tuple[
    str,
    Callable[[], Any],
    Callable[[], Any],
    Callable[[], Any],
    Callable[[], Any],
    Callable[[], Any],
]


def compile_for(quick: bool) -> Callable[..., Any]:
    """``torch.compile`` for the timed rows; the smoke run (``--quick``) compiles with
    ``backend="aot_eager"``: dynamo and AOTAutograd trace forward and backward as in a real run
    (a graph break or a missing rule still fails), inductor's C++ code generation is skipped."""
    return functools.partial(torch.compile, backend="aot_eager") if quick else torch.compile


def _mlp_case(quick: bool, device: str = "cpu") -> _Case:
    """Tensor-parallel MLP on 8 simulated ranks: (label, one device, simulated, compiled one device,
    compiled simulated, loop)."""
    W = 8
    B, D, H = (8, 64, 256) if quick else (64, 1024, 4096)
    mesh = fd.Mesh({"tp": W})
    x, W1, W2 = (
        t.to(device)
        for t in (torch.randn(B, D), torch.randn(D, H) / D**0.5, torch.randn(H, D) / H**0.5)
    )
    xs = x.expand(W, B, D).contiguous()
    w1s = W1.reshape(D, W, H // W).permute(1, 0, 2).contiguous()  # [rank, D, H/W]: column shards
    w2s = W2.reshape(W, H // W, D).contiguous()  # [rank, H/W, D]: row shards

    def one(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(x @ w1) @ w2).sum()

    sim = fd.simulate(
        lambda x, w1, w2: fd.psum(torch.tanh(fd.pvary(x, mesh, "tp") @ w1) @ w2, mesh, "tp").sum(),
        mesh,
    )
    one_c, sim_c = compile_for(quick)(one), compile_for(quick)(sim)

    def run(f: Callable[..., torch.Tensor], *ts: torch.Tensor) -> Callable[[], None]:
        return _step(lambda *ls: f(*ls).sum(), ts)

    def loop_loss(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return sum(torch.tanh(a[r] @ b[r]) @ c[r] for r in range(W)).sum() * W  # type: ignore[union-attr]

    loop = _step(loop_loss, (xs, w1s, w2s))

    return (
        f"TP MLP B={B} D={D} H={H}, {W} ranks",
        run(one, x, W1, W2),
        run(sim, xs, w1s, w2s),
        run(one_c, x, W1, W2),
        run(sim_c, xs, w1s, w2s),
        loop,
    )


def _step(loss: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor]) -> Callable[[], None]:
    """One training step's forward + backward: ``loss(*leaves).backward()`` on leaves made once.

    As a training loop does (``zero_grad(set_to_none=True)``), each step drops the last
    gradients and allocates new ones; the parameters themselves are not copied per step.
    """
    leaves = [t.detach().clone().requires_grad_() for t in tensors]

    def step() -> None:
        for t in leaves:
            t.grad = None
        torch.autograd.backward([loss(*leaves)])

    return step


def _block_case(
    quick: bool,
    device: str = "cpu",
    sequence_parallel: bool = True,
    size: tuple[int, int, int, int, int] = (8, 256, 1024, 16, 4096),
) -> _Case:
    """A pre-norm transformer block (attention + MLP), TP=4 x SP=2 via fd.spmd, vs one device.

    ``sequence_parallel``: Megatron's sequence parallelism over tp (the layer norms and
    residual adds see 1/8 of the tokens on each rank, so the ranks' work adds up to one
    device's). Without it those run on every tp rank: 4x their single-device work.
    """
    from torch import nn

    # batch, sequence, hidden, heads, MLP hidden
    B, S, D, heads, Fh = (2, 8, 32, 4, 64) if quick else size
    mesh = fd.Mesh({"sp": 2, "tp": 4})

    class Block(nn.Module):
        def __init__(self, par: bool) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            if par:
                sp = sequence_parallel
                # one gather of h for q, k and v
                self.qkv: nn.Module = fd.nn.MergedColumnParallelLinear(
                    D, (D, D, D), mesh, "tp", sequence_parallel=sp
                )
                self.attn = fd.nn.RingAttention(mesh, "sp", causal=True)
                self.o: nn.Module = fd.nn.RowParallelLinear(D, D, mesh, "tp", sequence_parallel=sp)
                self.fc1: nn.Module = fd.nn.ColumnParallelLinear(
                    D, Fh, mesh, "tp", sequence_parallel=sp
                )
                self.fc2: nn.Module = fd.nn.RowParallelLinear(
                    Fh, D, mesh, "tp", sequence_parallel=sp
                )
            else:
                # the parameter names of the merged layer
                self.qkv = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
                self.o, self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, Fh), nn.Linear(Fh, D)
            self.par = par

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln1(x)
            if self.par:
                qkv = self.qkv(h)
            else:  # a fused QKV on one device too: one GEMM with the three weights side by side
                projs = [cast(nn.Linear, proj) for proj in cast(nn.ModuleList, self.qkv)]
                w, b = torch.cat([p.weight for p in projs]), torch.cat([p.bias for p in projs])
                qkv = torch.split(torch.nn.functional.linear(h, w, b), D, dim=-1)
            q, k, v = (t.unflatten(-1, (-1, D // heads)) for t in qkv)  # (B, S, heads here, hd)
            a = self.attn(q, k, v) if self.par else fd.nn.local_attention(q, k, v, causal=True)
            x = x + self.o(a.flatten(-2))
            return cast(torch.Tensor, x + self.fc2(torch.tanh(self.fc1(self.ln2(x)))))

    full, par = Block(False).to(device), Block(True).to(device)
    specs = fd.nn.param_specs(par)
    names = list(specs)
    state = {n: p.detach() for n, p in full.named_parameters()}
    x = torch.randn(B, S, D, device=device)
    # tokens over sp (ring), and over tp with sequence parallelism
    xspec = fd.P(None, ("sp", "tp") if sequence_parallel else "sp", None)
    step = fd.spmd(
        lambda x, *ps: torch.func.functional_call(par, dict(zip(names, ps)), (x,)),
        mesh,
        in_specs=(xspec, *(specs[n] for n in names)),
        out_specs=xspec,
        check=False,
    )

    def full_fn(x: torch.Tensor, ps: dict[str, torch.Tensor]) -> torch.Tensor:
        return cast(torch.Tensor, torch.func.functional_call(full, ps, (x,)))

    def make(f: Callable[..., torch.Tensor], per_name: bool) -> Callable[[], None]:
        if per_name:
            return _step(lambda *ps: f(x, dict(zip(names, ps))).sum(), [state[n] for n in names])
        return _step(lambda *ps: f(x, *ps).sum(), [state[n] for n in names])

    one, simulated = make(full_fn, True), make(step, False)
    compiled = compile_for(quick)
    one_c, sim_c = make(compiled(full_fn), True), make(compiled(step), False)

    # The way a sharded model trains: parameters live as per-rank shards (stacked), nothing is
    # sharded or gathered per step.
    stacked = fd.nn.stack_state(state, specs, mesh)  # name -> [world, *local shard]
    xs = fd.nn.stack_state({"x": x}, {"x": xspec}, mesh)["x"]  # [world, B, local tokens, D]
    per_rank = fd.simulate(
        lambda x, *ps: torch.func.functional_call(par, dict(zip(names, ps)), (x,)), mesh
    )

    sim_stacked = _step(lambda *ps: per_rank(xs, *ps).sum(), [stacked[n] for n in names])

    label = f"transformer block B={B} S={S} D={D} heads={heads}, tp=4 x sp=2" + (
        ", sequence parallel" if sequence_parallel else ", layer norms replicated over tp"
    )
    return label, one, simulated, one_c, sim_c, sim_stacked


def _jax_rows(
    quick: bool,
    reps: int,
    fastdist_eager: Callable[[], Any],
    fastdist_compiled: Callable[[], Any],
    torch_one: Callable[[], Any],
) -> list[dict[str, Any]]:
    """JAX's simulation of the same TP MLP (jit(vmap(grad), axis_name) with psum), if JAX is
    installed (bench-only)."""
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np
    except ImportError:
        return [
            {
                "case": "JAX: not installed (pip install jax jaxlib to compare)",
                "ms": float("nan"),
                "ratio": float("nan"),
            }
        ]
    W = 8
    B, D, H = (8, 64, 256) if quick else (64, 1024, 4096)
    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in [(B, D), (D, H), (H, D)])
    xs, w1s, w2s = (
        np.broadcast_to(x, (W, B, D)).copy(),
        w1.reshape(D, W, H // W).transpose(1, 0, 2).copy(),
        w2.reshape(W, H // W, D).copy(),
    )

    def per_rank(x: Any, w1: Any, w2: Any) -> Any:
        return jax.lax.psum(jnp.tanh(x @ w1) @ w2, "tp").sum()  # type: ignore[no-untyped-call]

    sim = jax.jit(jax.vmap(jax.grad(per_rank, argnums=(0, 1, 2)), axis_name="tp"))
    one = jax.jit(jax.grad(lambda x, w1, w2: (jnp.tanh(x @ w1) @ w2).sum(), argnums=(0, 1, 2)))

    def jax_sim() -> None:
        jax.block_until_ready(sim(xs, w1s, w2s))  # type: ignore[no-untyped-call]

    t_one, t_sim, r_sim = _paired(lambda: jax.block_until_ready(one(x, w1, w2)), jax_sim, reps)  # type: ignore[no-untyped-call]
    _, t_eager, r_eager = _paired(jax_sim, fastdist_eager, reps)
    _, t_comp, r_comp = _paired(jax_sim, fastdist_compiled, reps)
    _, t_torch, r_torch = _paired(jax_sim, torch_one, reps)
    return [
        {
            "case": f"JAX {jax.__version__} simulated (jit vmap grad) vs JAX one device",
            "ms": t_sim * 1e3,
            "ratio": r_sim,
            "baseline_ms": t_one * 1e3,
        },
        {
            "case": "fastdist eager / JAX simulated",
            "ms": t_eager * 1e3,
            "ratio": r_eager,
            "baseline_ms": t_sim * 1e3,
        },
        {
            "case": "fastdist compiled / JAX simulated",
            "ms": t_comp * 1e3,
            "ratio": r_comp,
            "baseline_ms": t_sim * 1e3,
        },
        # fastdist's simulation does the single-device work and more, so this is its floor against
        # JAX
        {
            "case": "torch one device (eager) / JAX simulated: the floor of fastdist / JAX",
            "ms": t_torch * 1e3,
            "ratio": r_torch,
            "baseline_ms": t_sim * 1e3,
        },
    ]


def _paired(
    base: Callable[[], Any], fn: Callable[[], Any], reps: int, warmup: int = 2
) -> tuple[float, float, float]:
    """(median s of ``base``, median s of ``fn``, median of the per-pair ratios fn / base).

    The two are timed alternately (base, fn; then fn, base; ...), so a slow phase of a noisy
    machine (this 2-core VM's matmuls swing up to 2x within a minute) lands on both sides
    of a pair instead of on whichever ran second.
    """
    for _ in range(warmup):
        base(), fn()
    tb: list[float] = []
    tf: list[float] = []
    for i in range(reps):
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            t = time.perf_counter()
            (base, fn)[which]()
            (tb, tf)[which].append(time.perf_counter() - t)
    return (
        statistics.median(tb),
        statistics.median(tf),
        statistics.median(f / b for b, f in zip(tb, tf)),
    )


def _row(
    case: str, base: Callable[[], Any], fn: Callable[[], Any], reps: int, device: str
) -> dict[str, Any]:
    """One table row: ``fn`` against ``base`` (:func:`_paired`), each call waiting for the
    device."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    # synchronize is untyped
    t_base, t, ratio = _paired(lambda: (base(), sync()), lambda: (fn(), sync()), reps)  # type: ignore[no-untyped-call]
    return {"case": case, "ms": t * 1e3, "ratio": ratio, "baseline_ms": t_base * 1e3}


def bench_sim(quick: bool, device: str = "cpu") -> list[dict[str, Any]]:
    reps = 3 if quick else 12

    def row(case: str, base: Callable[[], Any], fn: Callable[[], Any]) -> dict[str, Any]:
        return _row(case, base, fn, reps, device)

    label, one, sim, one_c, sim_c, loop = _mlp_case(quick, device)
    rows = [
        row("simulate, eager", one, sim),
        row("Python loop over ranks", one, loop),
        row("simulate, torch.compile (vs one device compiled)", one_c, sim_c),
    ]
    rows.insert(0, {"case": label, "baseline": "one device", "baseline_ms": rows[0]["baseline_ms"]})
    rows += _jax_rows(quick, reps, sim, sim_c, one) if device == "cpu" else []
    rows += block_rows(quick, device, replicated=True)
    if device == "cpu" and not quick and sys.platform.startswith("linux"):
        rows += _block_rows_keeping_memory()
    return rows


#: glibc's malloc otherwise hands every buffer above 32 MiB back to the kernel when it is freed
#: and takes page faults to get it again (the default jemalloc/tcmalloc behaviour, which
#: PyTorch's CPU performance guide recommends, is to keep it)
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def block_rows(
    quick: bool, device: str = "cpu", replicated: bool = False, suffix: str = ""
) -> list[dict[str, Any]]:
    """The transformer-block rows at the issue's realistic size (:func:`_block_case`'s default:
    hidden 1024, 8 x 256 tokens)."""
    reps = 3 if quick else 8  # a step takes about a second here

    def row(case: str, base: Callable[[], Any], fn: Callable[[], Any]) -> dict[str, Any]:
        return _row(case + suffix, base, fn, reps, device)

    rows = []
    if replicated:
        label, one, _, _, _, sim_stacked = _block_case(quick, device, sequence_parallel=False)
        rows.append(
            row(f"{label}: simulate on per-rank (stacked) parameters, eager", one, sim_stacked)
        )
    label, one, sim, one_c, sim_c, sim_stacked = _block_case(quick, device)
    rows.append(row(f"{label}: simulate on per-rank (stacked) parameters, eager", one, sim_stacked))
    rows.append(row(f"{label}: spmd, eager", one, sim))
    rows.append(row(f"{label}: spmd, torch.compile (vs one device compiled)", one_c, sim_c))
    return rows


def _block_rows_keeping_memory() -> list[dict[str, Any]]:
    """:func:`block_rows` again in a child process whose malloc keeps freed memory (both sides
    alike)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--block-rows-to", str(out)]
        proc = subprocess.run(
            cmd,
            env={**os.environ, **KEEP_FREED_MEMORY},
            capture_output=True,
            text=True,
            timeout=900,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                "benchmark: the block rows with glibc keeping freed memory "
                f"failed:\n{proc.stderr[-3000:]}"
            )
        return cast(list[dict[str, Any]], json.loads(out.read_text()))


# ======================================================================== per-call overhead on gloo
SIZES_QUICK = [4, 4096]
SIZES_FULL = [4, 256, 4096, 65536, 1 << 20, 1 << 22, 1 << 24, 1 << 26]


BURST = 20  # back-to-back calls per timed sample for messages up to 64 KiB


def _time_impls(
    impls: dict[str, Callable[[], Any]], group: Any, rounds: int, burst: int
) -> dict[str, float]:
    """Per-call wall and thread-CPU microseconds of each implementation (medians over rounds).

    Every round runs each implementation once, in an order that rotates between rounds,
    both ranks lined up by a barrier first, so drift and peer skew hit all of them alike.
    A sample is ``burst`` back-to-back calls (the OSU/nccl-tests latency method), divided
    by ``burst``; ``burst=1`` is one call right after the barrier.
    """
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    names = list(impls)
    samples: dict[str, list[float]] = {
        k: [] for name in names for k in (f"{name}_us", f"{name}_cpu_us")
    }
    for rnd in range(rounds + 2):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            fn = impls[name]
            dist.barrier(group)
            w, c = time.perf_counter(), time.thread_time()
            for _ in range(burst):
                r = fn()
                if isinstance(r, funcol.AsyncCollectiveTensor):
                    r.wait()  # funcol returns before the data is there; the others return done
            w, c = time.perf_counter() - w, time.thread_time() - c
            if rnd >= 2:  # warm-up
                samples[f"{name}_us"].append(w / burst * 1e6)
                samples[f"{name}_cpu_us"].append(c / burst * 1e6)
    out = {k: statistics.median(v) for k, v in samples.items()}
    # ratios within each round (both sides under the same conditions), then their median
    for base in (
        "c10d",
        "funcol",
    ):
        if base in impls:
            for name in names:
                out[f"{name}_per_round_vs_{base}"] = statistics.median(
                    a / b for a, b in zip(samples[f"{name}_us"], samples[f"{base}_us"])
                )
    return out


def _autograd_cases(
    mesh: fd.Mesh, group: Any, x: torch.Tensor
) -> dict[str, dict[str, Callable[[], Any]]]:
    """The differentiable path (an input that requires grad): fastdist vs
    ``torch.distributed.nn.functional``.

    Under the key ``"c10d"`` (what :func:`_own_work_us` compares against) is torch's own
    autograd-aware collective. The backward conventions differ (torch's all-reduce backward
    all-reduces the gradient again; fastdist's psum backward is the identity, see
    docs/gradients.md), so the forward-and-backward rows compare each library's whole cost.
    """
    import torch.distributed.nn.functional as tdnn

    xg = x.detach().clone().requires_grad_()
    n = x.numel()
    fwd: dict[str, tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]] = {
        "psum": (lambda: fd.psum(xg, mesh, "tp"), lambda: tdnn.all_reduce(xg, group=group)),  # type: ignore[no-untyped-call]
        "all_to_all": (
            lambda: fd.all_to_all(xg, mesh, "tp", 0, 0),
            lambda: tdnn.all_to_all_single(torch.empty(n), xg, group=group),  # type: ignore[no-untyped-call]
        ),
    }
    cases: dict[str, dict[str, Callable[[], Any]]] = {}
    for op, (f, t) in fwd.items():
        cases[f"{op} forward"] = {"fastdist": f, "c10d": t}
        cases[f"{op} forward_backward"] = {
            "fastdist": lambda f=f: f().sum().backward(),  # type: ignore[misc]
            "c10d": lambda t=t: t().sum().backward(),  # type: ignore[misc]
        }
    return cases


def _gloo_cases(
    x: torch.Tensor, mesh: fd.Mesh, group: Any, rank: int, world: int
) -> dict[str, dict[str, Callable[[], Any]]]:
    """Each collective on ``x`` three ways: fastdist, c10d and funcol (on the same group)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    n = x.numel()
    chunk = n // world
    return {
        "psum": {
            "fastdist": lambda: fd.psum(x, mesh, "tp"),
            "c10d": lambda: dist.all_reduce(x.clone(), group=group),
            "funcol": lambda: funcol.all_reduce(x, "sum", group),
        },
        "all_gather": {
            "fastdist": lambda: fd.all_gather(x[:chunk], mesh, "tp"),
            "c10d": lambda: dist.all_gather_single(
                torch.empty(n), x[:chunk].contiguous(), group=group
            ),
            "funcol": lambda: funcol.all_gather_tensor(x[:chunk], 0, group),
        },
        "psum_scatter": {
            "fastdist": lambda: fd.psum_scatter(x, mesh, "tp"),
            "c10d": lambda: dist.reduce_scatter_single(torch.empty(chunk), x, group=group),
            "funcol": lambda: funcol.reduce_scatter_tensor(x, "sum", 0, group),
        },
        "all_to_all": {
            "fastdist": lambda: fd.all_to_all(x, mesh, "tp", 0, 0),
            "c10d": lambda: dist.all_to_all_single(torch.empty(n), x, group=group),
            "funcol": lambda: funcol.all_to_all_single(x, None, None, group),
        },
        "ppermute": {
            "fastdist": lambda: fd.ring_shift(x, mesh, "tp"),
            "c10d": lambda: dist.all_to_all_single(
                torch.empty(n),
                x,
                [n if j == (rank + 1) % world else 0 for j in range(world)],
                [n if i == (rank - 1) % world else 0 for i in range(world)],
                group=group,
            ),
            "funcol": lambda: funcol.all_to_all_single(
                x,
                [n if i == (rank - 1) % world else 0 for i in range(world)],
                [n if j == (rank + 1) % world else 0 for j in range(world)],
                group,
            ),
        },
    }


def _overhead_worker(
    rank: int, world: int, port: int, sizes: list[int], reps: int, out: Any
) -> None:
    import warnings

    import torch.distributed as dist

    # torch renames some c10d/funcol entry points
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    mesh = fd.connect(tp=world)
    fd.comm.create_groups(mesh, "tp")
    group = mesh._comm.group(mesh._comm.axis((mesh.axis_names.index("tp"),)), "gloo", "bench")
    results: list[dict[str, Any]] = []
    for nbytes in sizes:
        n = max(world, nbytes // 4 // world * world)  # float32 elements, divisible by the world
        x = torch.randn(n)
        cases = _gloo_cases(x, mesh, group, rank, world)
        rows: list[dict[str, Any]] = []
        for op, impls in cases.items():
            # an A/A control: how far two identical implementations' medians land apart
            impls["c10d_again"] = impls["c10d"]
            rows.append(
                {
                    "op": op,
                    "bytes": n * 4,
                    **_time_impls(impls, group, reps, burst=BURST if nbytes <= 65536 else 1),
                }
            )
            # the smallest message: also one call right after a barrier (cold caches)
            if nbytes == sizes[0]:
                rows[-1].update(
                    {
                        f"{k}_cold": v
                        for k, v in _time_impls(impls, group, reps * 5, burst=1).items()
                    }
                )
        # Own work at every size: both sides make the same c10d call on the same buffers, so
        # what fastdist adds is its own work, measured here without gloo's jitter. Needs no
        # peer (the collectives are stubbed): rank 0 alone, rank 1 waiting in a barrier.
        # batches of 100 small calls, of 2 64 MiB copies
        calls = 100 if nbytes <= 65536 else 10 if nbytes <= 4 << 20 else 2
        # at least 15 pairs: cheap (about 1 ms a pair at small sizes), and the smoke run's 5 left
        # its medians at the mercy of one slow phase of a shared machine
        own = _own_work_us(cases, max(reps, 15), calls) if rank == 0 else {}
        for r in rows if rank == 0 else []:
            r["own_fastdist_us"], r["own_c10d_us"] = own[r["op"]]["fastdist"], own[r["op"]]["c10d"]
            r["own_added_us"] = own[r["op"]]["added"]  # the median of per-pair differences
        grad = (
            _own_work_us(_autograd_cases(mesh, group, x), max(reps, 15))
            if rank == 0 and nbytes == sizes[0]
            else {}
        )
        dist.barrier(group)
        if nbytes == sizes[0]:
            outside = _outside_us(cases, group, reps * 5)
            for r in rows if rank == 0 else []:
                r["outside_fastdist_us"], r["outside_c10d_us"] = (
                    outside[r["op"]]["fastdist"],
                    outside[r["op"]]["c10d"],
                )
                r["outside_added_us"] = r["outside_fastdist_us"] - r["outside_c10d_us"]
                for kind in ("forward", "forward_backward"):
                    if f"{r['op']} {kind}" in grad:
                        g = grad[f"{r['op']} {kind}"]
                        (
                            r[f"grad_{kind}_fastdist_us"],
                            r[f"grad_{kind}_torch_us"],
                            r[f"grad_{kind}_added_us"],
                        ) = g["fastdist"], g["c10d"], g["added"]
        results += rows
    if rank == 0:
        out.put(results)
    dist.barrier(group)
    dist.destroy_process_group()


def _spawn(target: Callable[..., None], world: int, *args: Any, timeout: float = 900) -> Any:
    """Run ``target(rank, world, port, *args, queue)`` on ``world`` spawned processes; return what
    rank 0 puts."""
    import multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    import queue

    deadline = time.monotonic() + timeout
    while True:  # wait for rank 0's result, but give up as soon as a rank dies
        try:
            result = q.get(timeout=1.0)
            break
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                why = (
                    f"rank {procs.index(dead[0])} exited with {dead[0].exitcode}"
                    if dead
                    else f"no result within {timeout:g} s"
                )
                raise RuntimeError(f"benchmark {target.__name__}: {why}") from None
    for p in procs:
        p.join(timeout=60)
    return result


def bench_overhead(quick: bool, world: int = 2) -> list[dict[str, Any]]:
    sizes = SIZES_QUICK if quick else SIZES_FULL
    rows: list[dict[str, Any]] = _spawn(_overhead_worker, world, sizes, 5 if quick else 20)
    bus = {
        "psum": 2 * (world - 1) / world,
        "all_gather": (world - 1) / world,
        "psum_scatter": (world - 1) / world,
        "all_to_all": (world - 1) / world,
        "ppermute": 1.0,
    }
    for r in rows:
        r["ratio_vs_c10d"] = r["fastdist_per_round_vs_c10d"]  # the median of per-round ratios
        r["ratio_vs_funcol"] = r["fastdist_per_round_vs_funcol"]
        r["added_us_vs_c10d"] = r["fastdist_us"] - r["c10d_us"]
        r["added_cpu_us_vs_c10d"] = r["fastdist_cpu_us"] - r["c10d_cpu_us"]
        if "fastdist_us_cold" in r:
            r["added_us_vs_c10d_cold"] = r["fastdist_us_cold"] - r["c10d_us_cold"]
            r["added_cpu_us_vs_c10d_cold"] = r["fastdist_cpu_us_cold"] - r["c10d_cpu_us_cold"]
        r["busbw_GBps"] = r["bytes"] / (r["fastdist_us"] * 1e-6) * bus[r["op"]] / 1e9
        r["c10d_vs_itself"] = r["c10d_again_per_round_vs_c10d"]
        # The same c10d call plus fastdist's own work: the ratio that timing alone cannot resolve
        # (see the A/A column).
        r["ratio_from_own_work"] = (r["c10d_us"] + r["own_added_us"]) / r["c10d_us"]
    return rows


# =========================================================================== process-group creation
def _groups_worker(rank: int, world: int, port: int, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    mesh = fd.connect(tp=2, sp=2)
    dist.barrier()
    t = time.perf_counter()
    fd.comm.create_groups(mesh)  # this rank's group per axis, created only by its members
    dist.barrier()
    t_fd = time.perf_counter() - t
    t = time.perf_counter()
    for axis in mesh.axis_names:  # the classic way: every rank creates every group of every axis
        for g in mesh.groups(axis):
            dist.new_group(g)
    dist.barrier()
    t_all = time.perf_counter() - t
    if rank == 0:
        out.put(
            {
                "world": world,
                "mesh": repr(mesh),
                "fastdist_ms": t_fd * 1e3,
                "every_group_every_rank_ms": t_all * 1e3,
                "ratio": t_fd / t_all,
            }
        )
    dist.destroy_process_group()


def bench_groups(quick: bool) -> list[dict[str, Any]]:
    return [_spawn(_groups_worker, 4 if quick else 8, timeout=600)]


# ============================================================================ mesh layout
def _all_groups(mesh: fd.Mesh) -> list[Any]:
    return [mesh.groups(a) for a in mesh.axis_names]


def _naive_scan(mesh: fd.Mesh, world: int) -> list[list[int]]:
    return [
        [
            r
            for r in range(world)
            if all(mesh.coords(r)[b] == mesh.coords(g)[b] for b in mesh.axis_names if b != a)
        ]
        for a in mesh.axis_names
        for g in range(0, world, max(1, world // 8))
    ]


def bench_mesh(quick: bool) -> list[dict[str, Any]]:
    rows = []
    for world in [64, 512] if quick else [64, 512, 4096]:
        mesh = fd.Mesh.from_world_size(world, tp=8, sp=2)
        t = _timeit(functools.partial(_all_groups, mesh), 3)
        naive = (
            _timeit(functools.partial(_naive_scan, mesh, world), 1, warmup=0)
            if world <= 512
            else float("nan")
        )
        rows.append(
            {"world": world, "groups_all_axes_ms": t * 1e3, "naive_scan_8_groups_ms": naive * 1e3}
        )
    return rows


# ============================================================================ report
def markdown(res: dict[str, Any]) -> str:
    out = [
        f"# fastdist benchmarks\n\n`{res['command']}` on {res['machine']}, torch {res['torch']}, "
        f"{res['date']}\n"
    ]
    sim = res["sim"]
    out.append(
        f"## Simulated ranks vs one device\n\n{sim[0]['case']}: one device "
        f"{sim[0]['baseline_ms']:.2f} ms per step (forward + backward)\n"
    )
    out.append("| implementation | ms | baseline ms | ratio to baseline |\n|---|---|---|---|")
    out += [
        f"| {r['case']} | {r['ms']:.2f} | {r['baseline_ms']:.2f} | {r['ratio']:.2f} |"
        if "baseline_ms" in r
        else f"| {r['case']} | {r['ms']:.2f} | | {r['ratio']:.2f} |"
        for r in sim[1:]
    ]
    out.append(
        "\nEach ratio is the median of per-pair ratios, the two sides timed alternately (medians "
        "of the times beside it). The baseline is one device (compiled for the compiled rows), "
        "except in the JAX rows: JAX simulated / JAX one device, then fastdist / JAX simulated."
    )
    out.append("\n## Per-call overhead on 2 gloo processes (fastdist / baseline)\n")
    out.append(
        "Times are medians over rounds; ratios are medians of the ratios within each round "
        "(every round runs each implementation once, order rotating, after a barrier).\n"
    )
    out.append(
        "The last two columns take gloo's jitter out: fastdist's own work per call (both sides' "
        "collectives stubbed out, CPU time, the median of per-pair differences; batches of 100, "
        "10 or 2 calls by size), and the ratio it implies, (c10d + added own work) / c10d, since "
        "both sides make the same c10d call on the same buffers.\n"
    )
    out.append(
        "| op | bytes | fastdist µs | c10d µs | funcol µs | vs c10d | vs funcol | c10d vs itself "
        "(A/A) | added µs | bus GB/s | added own work µs | ratio from own work "
        "|\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    out += [
        f"| {r['op']} | {r['bytes']} | {r['fastdist_us']:.1f} | {r['c10d_us']:.1f} | "
        f"{r['funcol_us']:.1f} | {r['ratio_vs_c10d']:.2f} | {r['ratio_vs_funcol']:.2f} | "
        f"{r['c10d_vs_itself']:.2f} | {r['added_us_vs_c10d']:.1f} | {r['busbw_GBps']:.3f} | "
        f"{r['own_added_us']:.1f} | {r['ratio_from_own_work']:.3f} |"
        for r in res["overhead"]
    ]
    small = [r for r in res["overhead"] if r["bytes"] == min(q["bytes"] for q in res["overhead"])]
    out.append(
        f"\n### What fastdist adds per call at {small[0]['bytes']} bytes "
        "(µs, fastdist minus c10d)\n"
    )
    out.append(
        "Own work, hot: CPU time per call with torch.distributed's collectives stubbed out, so "
        "only each side's own Python and allocation runs (batches of 100 calls). Outside the "
        "collective, cold: CPU time of one call right after a barrier minus the time inside the "
        "c10d collective it makes. End to end: wall and CPU time on gloo, back-to-back (bursts "
        f"of {BURST} calls) and cold (one call after a barrier); gloo's jitter is of the same "
        "order (see the A/A column above).\n"
    )
    out.append(
        "| op | added own work, hot | added outside the collective, cold | added wall, "
        "back-to-back | added CPU, back-to-back | added wall, cold | added CPU, cold "
        "|\n|---|---|---|---|---|---|---|"
    )
    out += [
        f"| {r['op']} | {r['own_added_us']:.1f} | {r['outside_added_us']:.1f} | "
        f"{r['added_us_vs_c10d']:.1f} | {r['added_cpu_us_vs_c10d']:.1f} | "
        f"{r['added_us_vs_c10d_cold']:.1f} | {r['added_cpu_us_vs_c10d_cold']:.1f} |"
        for r in small
    ]
    grad = [r for r in small if "grad_forward_added_us" in r]
    if grad:
        out.append(
            "\nWith autograd (the input requires grad, as in a training step's forward): "
            "fastdist against `torch.distributed.nn.functional`, torch's autograd-aware "
            "collectives; own work, hot, as above (µs per call). The backward conventions differ "
            "(torch's all-reduce backward all-reduces again; fastdist's psum backward is the "
            "identity), so forward + backward compares each library's whole cost.\n"
        )
        out.append(
            "| op | fastdist forward | torch forward | added | fastdist forward + backward | "
            "torch forward + backward | added |\n|---|---|---|---|---|---|---|"
        )
        out += [
            f"| {r['op']} | {r['grad_forward_fastdist_us']:.1f} | "
            f"{r['grad_forward_torch_us']:.1f} | {r['grad_forward_added_us']:.1f} | "
            f"{r['grad_forward_backward_fastdist_us']:.1f} | "
            f"{r['grad_forward_backward_torch_us']:.1f} | "
            f"{r['grad_forward_backward_added_us']:.1f} |"
            for r in grad
        ]
    out.append(
        "\n## Process-group creation on gloo\n\n| world | mesh | fastdist (own groups, local "
        "sync) ms | every group on every rank ms | ratio |\n|---|---|---|---|---|"
    )
    out += [
        f"| {r['world']} | {r['mesh']} | {r['fastdist_ms']:.1f} | "
        f"{r['every_group_every_rank_ms']:.1f} | {r['ratio']:.2f} |"
        for r in res["groups"]
    ]
    out.append(
        "\n## Mesh layout\n\n| world | all groups of all axes (ms) | naive coordinate scan, 8 "
        "groups per axis (ms) |\n|---|---|---|"
    )
    out += [
        f"| {r['world']} | {r['groups_all_axes_ms']:.3f} | {r['naive_scan_8_groups_ms']:.3f} |"
        for r in res["mesh"]
    ]
    return "\n".join(out) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for op in sorted({r["op"] for r in res["overhead"]}):
        pts = [r for r in res["overhead"] if r["op"] == op]
        ax.plot([r["bytes"] for r in pts], [r["ratio_vs_c10d"] for r in pts], marker="o", label=op)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("message bytes")
    ax.set_ylabel("fastdist time / c10d time")
    ax.set_title("per-call overhead on 2 gloo processes", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--only", choices=["sim", "overhead", "groups", "mesh"], action="append")
    ap.add_argument(
        "--device",
        default="cpu",
        help="device of the simulated-rank section, e.g. cuda (the other sections are CPU/gloo)",
    )
    # internal: the block rows only, as JSON (see _block_rows_keeping_memory)
    ap.add_argument("--block-rows-to", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.block_rows_to is not None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1)))
        args.block_rows_to.write_text(
            json.dumps(block_rows(False, suffix=", glibc malloc keeping freed memory"))
        )
        return 0
    sections = args.only or ["sim", "overhead", "groups", "mesh"]
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    res: dict[str, Any] = {
        "command": "python benchmarks/run.py" + (" --quick" if args.quick else ""),
        "torch": torch.__version__,
        "machine": f"{os.cpu_count()} CPU cores"
        + (f", simulated ranks on {args.device}" if args.device != "cpu" else ""),
        "date": datetime.date.today().isoformat(),
        "sim": [],
        "overhead": [],
        "groups": [],
        "mesh": [],
    }
    for name in sections:
        t = time.perf_counter()
        res[name] = (
            bench_sim(args.quick, args.device)
            if name == "sim"
            else {"overhead": bench_overhead, "groups": bench_groups, "mesh": bench_mesh}[name](
                args.quick
            )
        )
        print(f"[{name}] done in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=1))
    md = (
        markdown(res)
        if set(sections) == {"sim", "overhead", "groups", "mesh"}
        else json.dumps(res, indent=1)
    )
    (args.out / "results.md").write_text(md)
    if res["overhead"]:
        plot(res, args.out / "overhead.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
