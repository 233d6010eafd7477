"""fastdist's context parallelism against diffusers' own ``enable_parallelism`` on the same
unmodified diffusers ``WanTransformer3DModel``, 2 gloo processes.

    python benchmarks/dit_vs_diffusers.py          # 1024 and 2048 tokens (~10 min on 2 busy cores)
    python benchmarks/dit_vs_diffusers.py --quick  # tiny sizes: a smoke run (~30 s)
    python benchmarks/dit_vs_diffusers.py --only 1k --reps 7  # one size, fewer pairs (~3 min)
    python benchmarks/dit_vs_diffusers.py --case guided       # only the rows naming "guided"

fastdist: ``fd.nn.parallelize(model, fd.connect(sp=2))`` (Wan's ready plan, Ulysses; and
``plans.wan(mode="ring")``). diffusers: ``model.enable_parallelism(config=
ContextParallelConfig(ulysses_degree=2))`` (its ``_cp_plan`` for Wan, native attention backend,
the only one that runs on a CPU). Both split the same tokens at the same places (the input of
the first block, the rotary table; the output of ``proj_out`` gathered) and run the same SDPA
between two all-to-alls, so the arithmetic is the same; the difference is each library's own
machinery (hooks, autograd functions, the collectives' wrappers).

Rows (each a ratio fastdist / diffusers of two sides timed alternately in this run):

- **fwd+bwd**: forward, ``sample.square().mean()``, backward; then every rank holds the
  single-device gradients. fastdist's backward sums the split parameters' gradients over
  ``sp`` itself; diffusers leaves each rank the gradient of its own tokens (the sum over the
  ranks is the single-device one), so its side adds one all-reduce of every gradient, flattened
  into one buffer (what DDP-style code would do; without it the gradients are wrong). A row
  without that all-reduce is reported too.
- **denoising step**: ``torch.no_grad()`` forward plus ``FlowMatchEulerDiscreteScheduler.step``,
  a loop of 4 steps timed whole, divided by 4.
- **guided denoising step**: the step as ``WanPipeline`` runs it, with classifier-free guidance
  (scale 5, Wan's default): a conditional and an unconditional prediction (the negative
  prompt's text states), ``uncond + 5 (cond - uncond)``, then the scheduler. diffusers runs its
  Ulysses model twice per step, once per branch, as its pipeline does (``enable_parallelism``
  has no guidance parallelism). fastdist runs what it offers for this workload on the same 2
  processes: `fastdist.nn.GuidedModel` over a ``cfg`` axis of 2 (``fd.connect(cfg=2, sp=1)``:
  each rank one branch over the whole video, no all-to-all; one all-gather of the two
  predictions). The arithmetic per rank is the same (each rank projects all the tokens once
  and attends over all the heads once per step; diffusers' ranks half of each, twice); what
  differs is that each rank patch-embeds, embeds the condition and pays the per-call work once
  per step instead of twice, and exchanges one prediction instead of 4 all-to-alls per layer.
  A second row gives diffusers the other way a pipeline can run guidance: both branches as
  one batch of 2 through its Ulysses model (one forward per step).

diffusers' ring (``ring_degree=2``) is tried and refused on a CPU: its native backend raises
``Native attention does not support return_lse=True``; the other backends that support context
parallelism need CUDA kernels (flash, sage, cuDNN, NPU). The fastdist ring rows are timed
against diffusers' Ulysses, the only diffusers mode that runs here.

``enable_parallelism`` crashes without an accelerator: ``_resolve_parallel_config`` computes
``rank % torch.accelerator.device_count()``, and ``device_count()`` is 0 on a CPU-only machine
(a ZeroDivisionError). The benchmark patches ``torch.accelerator.device_count`` to return 1 inside
its own worker processes only (see ``_patch_diffusers_for_cpu``); nothing in fastdist patches
diffusers.

Before any timing, every rank checks both sides against the single-device model in float64
(output and every gradient) and the float32 denoising loops' latents against each other; the
differences are reported. A step's wall time is its slowest rank's (a barrier before each
step); its CPU time is both ranks' process CPU time added (the work done, without the time
spent waiting for a core or a peer: on a shared, loaded machine the steadier of the two). Each
ratio is the median of per-pair ratios. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fastdist as fd
from fastdist.testing import run_on_gloo

HERE = Path(__file__).resolve().parent
WORLD = 2
STEPS = 4  # denoising steps per timed loop
GUIDANCE = 5.0  # classifier-free guidance scale (Wan's default)

# (heads, head dim, ffn, layers, latent channels, frames, latent height = width, text tokens)
# tokens = frames x (height / 2) x (width / 2) (patch 1 x 2 x 2)
SIZES = {
    "quick": (2, 8, 32, 1, 4, 2, 4, 4),
    "1k": (4, 32, 512, 2, 16, 4, 32, 32),
    "2k": (4, 32, 512, 2, 16, 8, 32, 32),
}
TEXT_DIM = 64


def _patch_diffusers_for_cpu() -> None:
    """diffusers 0.42's ``enable_parallelism`` divides by ``torch.accelerator.device_count()``,
    which is 0 without an accelerator. Benchmark-only workaround (this worker process only): a
    CPU counts as one device, which is what diffusers then uses (``torch.device("cpu", 0)``)."""
    if torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1  # type: ignore[assignment]


def _wan(size: tuple[int, ...], dtype: torch.dtype) -> Any:
    from diffusers import WanTransformer3DModel

    heads, head_dim, ffn, layers, channels, *_ = size
    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=channels,
        out_channels=channels,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=ffn,
        num_layers=layers,
        rope_max_seq_len=64,
    )
    return model.to(dtype)


def _inputs(size: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    *_, channels, frames, hw, text = size
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, channels, frames, hw, hw, generator=g, dtype=dtype)
    e = torch.randn(1, text, TEXT_DIM, generator=g, dtype=dtype)
    return x, torch.tensor([500.0], dtype=dtype), e


def _sides(one: Any) -> dict[str, Any]:
    """fastdist Ulysses, fastdist ring, diffusers Ulysses: each a callable ``(x, t, e) ->
    sample`` over its own copy of ``one``, and the copy (for its gradients)."""
    from diffusers import ContextParallelConfig

    mesh = fd.connect(sp=WORLD, timeout=120)
    sides: dict[str, Any] = {}
    for name, mode in (("fastdist", "ulysses"), ("fastdist ring", "ring")):
        m = copy.deepcopy(one)
        pm = fd.nn.parallelize(m, mesh, fd.nn.plans.wan(m, mesh, mode=mode))
        sides[name] = (lambda x, t, e, pm=pm: pm(x, t, e).sample, m)
    m = copy.deepcopy(one)
    m.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD))
    sides["diffusers"] = (lambda x, t, e, m=m: m(x, t, e, return_dict=False)[0], m)
    return sides


def _diffusers_ring_error(one: Any, inputs: tuple[torch.Tensor, ...]) -> str:
    """What diffusers' ring mode does on this machine: ``"runs"`` or its error."""
    from diffusers import ContextParallelConfig

    m = copy.deepcopy(one)
    try:
        m.enable_parallelism(config=ContextParallelConfig(ring_degree=WORLD))
        m(*inputs, return_dict=False)[0].sum().backward()
    except Exception as e:  # noqa: BLE001 - reported, not handled
        return f"{type(e).__name__}: {e}"
    return "runs"


def _allreduce_grads(model: Any) -> None:
    """diffusers leaves each rank its own tokens' gradient: one flat all-reduce sums them."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(f)


def _train_step(side: tuple[Any, Any], inputs: Any, allreduce: bool) -> Callable[[], None]:
    fn, model = side

    def run() -> None:
        fn(*inputs).square().mean().backward()
        if allreduce:
            _allreduce_grads(model)
        for p in model.parameters():
            p.grad = None

    return run


def _denoise(fn: Callable[..., torch.Tensor], x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(STEPS)
    with torch.no_grad():
        for t in scheduler.timesteps:
            pred = fn(x, t.expand(1).to(x.dtype), e)
            x = scheduler.step(pred, t, x, return_dict=False)[0]
    return x


def _guided_denoise(
    guided: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """``STEPS`` guided flow-matching steps: ``guided(x, t)`` is the guided prediction."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(STEPS)
    with torch.no_grad():
        for t in scheduler.timesteps:
            pred = guided(x, t.expand(1).to(x.dtype))
            x = scheduler.step(pred, t, x, return_dict=False)[0]
    return x


def _guided_sides(one: Any, e: torch.Tensor, neg: torch.Tensor) -> dict[str, Any]:
    """The guided prediction ``(x, t) -> uncond + GUIDANCE (cond - uncond)`` per side: diffusers'
    Ulysses model run once per branch (as ``WanPipeline`` does); fastdist's ``GuidedModel`` over
    ``cfg`` = 2 (each rank one branch, the video whole)."""
    from diffusers import ContextParallelConfig

    m = copy.deepcopy(one)
    m.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD))

    def diffusers_guided(x: torch.Tensor, t: torch.Tensor, m: Any = m) -> torch.Tensor:
        cond = m(x, t, e, return_dict=False)[0]
        uncond = m(x, t, neg, return_dict=False)[0]
        return uncond + GUIDANCE * (cond - uncond)

    def diffusers_batched(x: torch.Tensor, t: torch.Tensor, m: Any = m) -> torch.Tensor:
        both = m(x.expand(2, *x.shape[1:]), t.expand(2), torch.cat([e, neg]), return_dict=False)[0]
        return both[1:] + GUIDANCE * (both[:1] - both[1:])  # (1, C, F, H, W)

    mesh = fd.connect(cfg=WORLD, sp=1, timeout=120)
    f = copy.deepcopy(one)
    guided = fd.nn.GuidedModel(fd.nn.parallelize(f, mesh, fd.nn.plans.wan(f, mesh)), GUIDANCE)

    def fastdist_guided(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return guided(hidden_states=x, timestep=t, encoder_hidden_states=e, uncond=neg)

    return {
        "fastdist cfg": fastdist_guided,
        "diffusers": diffusers_guided,
        "diffusers batched": diffusers_batched,
    }


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _check(size: tuple[int, ...]) -> dict[str, float]:
    """float64: each side's output and gradients against the single-device model."""
    one = _wan(size, torch.float64)
    inputs = _inputs(size, torch.float64)
    ref = one(*inputs).sample
    ref.square().mean().backward()
    ref_grads = dict(one.named_parameters())
    diffs = {}
    for name, (fn, m) in _sides(one).items():
        for p in m.parameters():
            p.grad = None
        out = fn(*inputs)
        out.square().mean().backward()
        if name == "diffusers":
            diffs["diffusers grads before all-reduce"] = max(
                _max_diff(p.grad, ref_grads[n].grad) for n, p in m.named_parameters()
            )
            _allreduce_grads(m)
        diffs[f"{name} output"] = _max_diff(out, ref)
        diffs[f"{name} grads"] = max(
            _max_diff(p.grad, ref_grads[n].grad) for n, p in m.named_parameters()
        )
    return diffs


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall seconds (after a barrier: a step's time is then its slowest rank's) and this
    process's CPU seconds (its own work, without the time it waited for a core or a peer)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


# (row name, fastdist side, diffusers side, what): "train" fwd+bwd, "denoise" a denoising step
PAIRS = (
    ("fwd+bwd, Ulysses", "fastdist", "diffusers", "train"),
    ("fwd+bwd, Ulysses; diffusers without the gradient all-reduce", "fastdist", "diffusers", "raw"),
    ("fwd+bwd, fastdist ring vs diffusers Ulysses", "fastdist ring", "diffusers", "train"),
    ("denoising step, Ulysses", "fastdist", "diffusers", "denoise"),
    ("denoising step, fastdist ring vs diffusers Ulysses", "fastdist ring", "diffusers", "denoise"),
    (
        "guided denoising step (scale 5): fastdist cfg 2 vs diffusers Ulysses twice",
        "fastdist cfg",
        "diffusers",
        "guided",
    ),
    (
        "guided denoising step (scale 5): fastdist cfg 2 vs diffusers Ulysses, a batch of 2",
        "fastdist cfg",
        "diffusers batched",
        "guided",
    ),
)


def _rank(
    size: tuple[int, ...], reps: int, warmup: int, cases: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One rank: check in float64, then time the pairs in float32."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    _patch_diffusers_for_cpu()
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    diffs = _check(size)
    one = _wan(size, torch.float32)
    inputs = _inputs(size, torch.float32)
    ring = _diffusers_ring_error(one, inputs)
    sides = _sides(one)
    x, _, e = inputs
    latents = {k: _denoise(fn, x, e) for k, (fn, _) in sides.items()}
    diffs["denoised latents, fastdist vs diffusers (float32)"] = _max_diff(
        latents["fastdist"], latents["diffusers"]
    )
    diffs["denoised latents, fastdist ring vs diffusers (float32)"] = _max_diff(
        latents["fastdist ring"], latents["diffusers"]
    )
    neg = torch.randn(e.shape, generator=torch.Generator().manual_seed(2), dtype=e.dtype)
    guided = _guided_sides(one, e, neg)
    guided_latents = {k: _guided_denoise(fn, x) for k, fn in guided.items()}
    for base in ("diffusers", "diffusers batched"):
        diffs[f"guided latents, fastdist cfg vs {base} (float32)"] = _max_diff(
            guided_latents["fastdist cfg"], guided_latents[base]
        )
    times = []
    for _, fast, base, what in _pairs(cases):
        if what == "guided":
            pair = tuple(lambda s=s: _guided_denoise(guided[s], x) for s in (fast, base))
        elif what == "denoise":
            pair = tuple(lambda s=s: _denoise(sides[s][0], x, e) for s in (fast, base))
        else:
            pair = (
                _train_step(sides[fast], inputs, False),
                _train_step(sides[base], inputs, what == "train"),
            )
        for _ in range(warmup):
            for f in pair:
                f()
        got: tuple[list[tuple[float, float]], list[tuple[float, float]]] = ([], [])
        for i in range(reps):
            for j in (0, 1) if i % 2 == 0 else (1, 0):  # A B, B A, ...: neither always first
                got[j].append(_timed(pair[j]))
        times.append(got)
    dist.barrier()
    return {"diffs": diffs, "times": times, "diffusers_ring": ring}


def _pairs(cases: tuple[str, ...]) -> list[tuple[str, str, str, str]]:
    """The rows of ``PAIRS`` whose name contains one of ``cases`` (all when empty)."""
    return [p for p in PAIRS if not cases or any(c in p[0] for c in cases)]


def bench(
    quick: bool,
    only: list[str] | None = None,
    reps: int | None = None,
    cases: tuple[str, ...] = (),
) -> dict[str, Any]:
    rows, checks, ring = [], {}, ""
    for name in ("quick",) if quick else only or ("1k", "2k"):
        size = SIZES[name]
        pairs, warmup = reps or (3 if quick else 15), 1
        per_rank = run_on_gloo(_rank, WORLD, size, pairs, warmup, cases, timeout=3000)
        heads, head_dim, ffn, layers, _, frames, hw, text = size
        tokens = frames * (hw // 2) ** 2
        ring = per_rank[0]["diffusers_ring"]
        checks[name] = {k: max(r["diffs"][k] for r in per_rank) for k in per_rank[0]["diffs"]}
        for n, (case, _, _, what) in enumerate(_pairs(cases)):
            # wall: a step is over when its slowest rank is; CPU: the ranks' work added
            f, d = (
                [max(r["times"][n][side][i][0] for r in per_rank) for i in range(pairs)]
                for side in (0, 1)
            )
            fc, dc = (
                [sum(r["times"][n][side][i][1] for r in per_rank) for i in range(pairs)]
                for side in (0, 1)
            )
            per = STEPS if what in ("denoise", "guided") else 1
            rows.append(
                {
                    "case": case,
                    "tokens": tokens,
                    "model": f"{layers} layers, {heads}x{head_dim} heads, ffn {ffn}, "
                    f"{text} text tokens",
                    "fastdist_ms": statistics.median(f) * 1e3 / per,
                    "diffusers_ms": statistics.median(d) * 1e3 / per,
                    "ratio": statistics.median(a / b for a, b in zip(f, d)),
                    "fastdist_cpu_ms": statistics.median(fc) * 1e3 / per,
                    "diffusers_cpu_ms": statistics.median(dc) * 1e3 / per,
                    "cpu_ratio": statistics.median(a / b for a, b in zip(fc, dc)),
                }
            )
    return {"rows": rows, "checks": checks, "diffusers_ring": ring}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--only", nargs="+", choices=[k for k in SIZES if k != "quick"])
    ap.add_argument("--reps", type=int, help="timed pairs per row (default 15; --quick 3)")
    ap.add_argument("--case", nargs="+", help="only the rows whose name contains one of these")
    args = ap.parse_args(argv)
    load = [os.getloadavg()]
    res = bench(args.quick, args.only, args.reps, tuple(args.case or ()))
    load.append(os.getloadavg())
    res["loadavg"] = load
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dit_vs_diffusers.json").write_text(json.dumps(res, indent=1))
    lines = [
        f"load average before {load[0][0]:.2f}, after {load[1][0]:.2f} (1 min); "
        f"torch {torch.__version__}, 2 gloo processes, 1 thread each",
        "",
        "| case | tokens | fastdist ms | diffusers ms | fastdist / diffusers (wall) "
        "| CPU ms, both ranks (fastdist / diffusers) | fastdist / diffusers (CPU) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['case']} | {r['tokens']} | {r['fastdist_ms']:.1f} | {r['diffusers_ms']:.1f} | "
        f"{r['ratio']:.3f} | {r['fastdist_cpu_ms']:.1f} / {r['diffusers_cpu_ms']:.1f} | "
        f"{r['cpu_ratio']:.3f} |"
        for r in res["rows"]
    ]
    lines += ["", "| max difference | " + " | ".join(res["checks"]) + " |"]
    lines += ["|---|" + "---:|" * len(res["checks"])]
    first = next(iter(res["checks"].values()))
    lines += [
        f"| {k} | " + " | ".join(f"{c[k]:.1e}" for c in res["checks"].values()) + " |"
        for k in first
    ]
    lines += ["", f"diffusers ring (ring_degree={WORLD}): {res['diffusers_ring']}"]
    (args.out / "dit_vs_diffusers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
