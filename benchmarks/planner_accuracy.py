"""Does the planner predict what a user measures? Predicted against measured step times of
several layouts on gloo processes, with the cost model calibrated on the same job.

    python benchmarks/planner_accuracy.py            # 4 processes, about 2 minutes
    python benchmarks/planner_accuracy.py --quick    # tiny models, 2 rounds: a smoke run

In every process (one thread each):

1. ``fastdist.profile.calibrate`` on a dp2 x tp2 mesh of the job (tp, dp and dp+tp: groups of
   2 and 4 ranks): every collective kind over a sweep of sizes, a matmul, an elementwise kernel,
   a chain of tiny kernels. One :class:`fastdist.profile.CostModel` (the same on every rank).
2. For an HF Llama (from a config, random weights) and a TP MLP (residual blocks of
   up/GELU/down projections), the layouts dp4, tp4, dp2 x tp2, tp4 + sp, dp2 x tp2 + sp (sp:
   Megatron sequence parallelism over the tp axis); for an HF Mixtral (4 experts, top-2,
   dropless) dp4, ep4, dp2 x ep2, ep2 x tp2, tp4 (``fd.nn.plans.plan``; the trace charges
   each expert a balanced router's expected load, ``trace_model``'s default; the worst case,
   ``routing="bound"``, is predicted too for comparison): parallelize on the real mesh,
   ``trace_model`` one step (fake tensors; before the data-parallel engine is attached); then
   attach ``DataParallel`` over dp and run 2 warm-up steps per layout.
3. ``fastdist.profile.calibrate_kernels``: every distinct kernel of the traced steps (matmuls,
   attention, elementwise, forward and backward, with their shapes) replayed and timed on
   every rank at once, 5 interleaved rounds; then ``predict`` every layout with that model,
   the dp gradient reduction overlapped as ``fastdist.train.DataParallel`` does it (and with
   step 1's rates only, for comparison).
4. Time the step (forward + backward + the dp gradient reduction; no optimizer) in rounds over
   the layouts, interleaved (drifting load hits every layout alike); each round's time is the
   slowest rank's; the measured step is the median over rounds.

Printed: per layout the prediction (compute and exposed communication), the measured median
with the spread over rounds, measured / predicted, and whether the rankings agree and the
predicted best is within 10% of the measured best. ``--out DIR`` writes ``planner_accuracy.json``
(and the calibrated models, ``cost_model.json`` and ``cost_model_kernels.json``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
DENSE = (  # (dp, ep, tp, sequence parallel) on the mesh (dp, ep, tp)
    (4, 1, 1, False),
    (1, 1, 4, False),
    (2, 1, 2, False),
    (1, 1, 4, True),
    (2, 1, 2, True),
)
MOE = ((4, 1, 1, False), (1, 4, 1, False), (2, 2, 1, False), (1, 2, 2, False), (1, 1, 4, False))


def _name(dp: int, ep: int, tp: int, sp: bool) -> str:
    parts = [f"{a}{n}" for a, n in (("dp", dp), ("ep", ep), ("tp", tp)) if n > 1]
    return " x ".join(parts) + (" + sp" if sp else "")


class Block(nn.Module):
    """``x + down(gelu(up(x)))``."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class MLP(nn.Module):
    """Residual MLP blocks and a final LayerNorm; input ``[batch, seq, d]``."""

    def __init__(self, d: int, h: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def _mlp_plan(sp: bool) -> dict[str, Any]:
    import fastdist as fd

    if not sp:
        return {
            "blocks.*.up": fd.nn.ColwiseParallel(input="replicated"),
            "blocks.*.down": fd.nn.RowwiseParallel(),
        }
    return {
        "blocks.0": fd.nn.SequenceShard(),
        "blocks.*.up": fd.nn.ColwiseParallel(input="sequence"),
        "blocks.*.down": fd.nn.RowwiseParallel(output="sequence"),
        "norm": fd.nn.GatherSequence(),
    }


def _models(quick: bool) -> dict[str, Any]:
    """name -> (base model, plan for sp, inputs for a global batch of `dp` ranks, description,
    layouts)."""
    import transformers

    import fastdist as fd

    torch.manual_seed(0)
    if quick:
        lcfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, vocab_size=256)
        lbatch, lseq, (d, h, n), mbatch, mseq = 4, 16, (64, 128, 1), 4, 16
        xcfg, xbatch, xseq = dict(lcfg), 4, 16
    else:
        lcfg = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, vocab_size=4000)
        lbatch, lseq, (d, h, n), mbatch, mseq = 8, 128, (256, 1024, 2), 4, 256
        xcfg = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=4000)
        xbatch, xseq = 8, 64
    config = transformers.LlamaConfig(**lcfg, num_attention_heads=8, num_key_value_heads=4)
    llama = transformers.LlamaForCausalLM(config).float().train()
    mlp = MLP(d, h, n).train()
    mcfg = transformers.MixtralConfig(
        **xcfg,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
    )
    mixtral = transformers.MixtralForCausalLM(mcfg).float().train()

    def llama_inputs(dp: int, dp_rank: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(dp_rank)
        ids = torch.randint(0, config.vocab_size, (lbatch // dp, lseq), generator=g)
        return {"input_ids": ids, "labels": ids}

    def mixtral_inputs(dp: int, dp_rank: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(dp_rank)
        ids = torch.randint(0, mcfg.vocab_size, (xbatch // dp, xseq), generator=g)
        return {"input_ids": ids, "labels": ids}

    def mlp_inputs(dp: int, dp_rank: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(dp_rank)
        return {"x": torch.randn(mbatch // dp, mseq, d, generator=g)}

    return {
        "HF Llama": (
            llama,
            lambda sp: fd.nn.plans.plan(llama, family="llama", sequence_parallel=sp),
            llama_inputs,
            f"hidden {lcfg['hidden_size']}, {lcfg['num_hidden_layers']} layers, vocab "
            f"{lcfg['vocab_size']}, {sum(p.numel() for p in llama.parameters()) / 1e6:.1f}M "
            f"parameters, batch {lbatch} x {lseq} tokens",
            DENSE,
        ),
        "TP MLP": (
            mlp,
            _mlp_plan,
            mlp_inputs,
            f"{n} residual blocks d={d} h={h}, "
            f"{sum(p.numel() for p in mlp.parameters()) / 1e6:.1f}M parameters, batch "
            f"{mbatch} x {mseq} tokens",
            DENSE,
        ),
        "HF Mixtral (MoE)": (
            mixtral,
            lambda sp: fd.nn.plans.plan(mixtral, family="mixtral"),
            mixtral_inputs,
            f"hidden {xcfg['hidden_size']}, {xcfg['num_hidden_layers']} layers, 4 experts top-2 "
            f"(dropless, all-to-all dispatch), vocab {xcfg['vocab_size']}, "
            f"{sum(p.numel() for p in mixtral.parameters()) / 1e6:.1f}M parameters, batch "
            f"{xbatch} x {xseq} tokens",
            MOE,
        ),
    }


def _median_model(models: list[Any]) -> Any:
    """One model from several ``calibrate_kernels`` results: each kernel's median time (over the
    models that timed it) and the median overhead."""
    times: dict[str, list[float]] = {}
    for m in models:
        for k, t in m.kernel_times:
            times.setdefault(k, []).append(t)
    return dataclasses.replace(
        models[0],
        kernel_times=tuple((k, statistics.median(v)) for k, v in times.items()),
        kernel_overhead=statistics.median(m.kernel_overhead for m in models),
    )


def _loss(pm: Any, inputs: dict[str, Any]) -> torch.Tensor:
    if "x" in inputs:
        return pm(inputs["x"]).sum()  # trace_model's backward of a tensor output: its sum
    return pm(**inputs).loss


def rank_fn(quick: bool, rounds: int, out: str | None) -> dict[str, Any]:
    """One rank: calibrate, then predict and time every layout of every model."""
    import torch.distributed as dist

    import fastdist as fd
    from fastdist.profile import (
        calibrate,
        calibrate_kernels,
        calibrate_step,
        predict,
        trace_model,
    )

    torch.set_num_threads(1)
    world = dist.get_world_size()
    t0 = time.perf_counter()
    cal_mesh = fd.connect(order=("dp", "tp"), tp=2, timeout=600)
    model = calibrate(
        cal_mesh,
        sizes=(1 << 12, 1 << 16, 1 << 20) if quick else (1 << 12, 1 << 16, 1 << 20, 1 << 22),
        reps=2 if quick else 7,
        matmul=128 if quick else 512,
        name=f"gloo, {world} processes on this machine (calibrated)",
    )
    calibrate_s = time.perf_counter() - t0
    if out and dist.get_rank() == 0:
        model.save(Path(out) / "cost_model.json")
    cases = []
    for mname, (base, plan_of, inputs_for, desc, layouts) in _models(quick).items():
        for dp, ep, tp, sp in layouts:
            if dp * ep * tp != world:
                continue
            mesh = fd.connect(order=("dp", "ep", "tp"), ep=ep, tp=tp, timeout=600)
            pm = fd.nn.parallelize(copy.deepcopy(base), mesh, plan_of(sp))
            dp_rank = mesh.rank // (ep * tp)
            inputs = inputs_for(dp, dp_rank)
            # the trace: the same model parallelized on a plain mesh of the layout (one rank's
            # shapes on fake tensors)
            plain = fd.nn.parallelize(
                copy.deepcopy(base), fd.Mesh({"dp": dp, "ep": ep, "tp": tp}), plan_of(sp)
            )
            prof = trace_model(plain, **inputs)  # MoE: balanced routing (the default)
            # the MoE's worst case too, for comparison
            bound = trace_model(plain, **inputs, routing="bound") if layouts is MOE else None
            del plain
            if dp > 1:
                fd.train.DataParallel(pm, "dp", bucket_mb=25.0)

            def step(pm: Any = pm, inputs: dict[str, Any] = inputs) -> None:
                _loss(pm, inputs).backward()  # type: ignore[no-untyped-call]
                pm.module.zero_grad(set_to_none=True)

            cases.append(
                {
                    "model": mname,
                    "desc": desc,
                    "layout": _name(dp, ep, tp, sp),
                    "step": step,
                    "profile": prof,
                    "bound_profile": bound,
                    "dp": dp,
                    "gflops": prof.flops() / 1e9,
                }
            )
    for c in cases:  # warm-up: process groups, buckets, allocator
        for _ in range(1 if quick else 2):
            dist.barrier()
            c["step"]()
    profiles = [c["profile"] for c in cases]
    # the traced steps' own kernels, timed on this job just before the rounds (once, as a user
    # would) ...
    t0 = time.perf_counter()
    before = calibrate_kernels(cal_mesh, profiles, model, reps=2 if quick else 5)
    kernels_s = time.perf_counter() - t0
    # ... and once more in every round, before its steps: the same load as the measurements
    # ... and the overhead of each model's real steps fitted to one layout's step (the model's
    # first layout: that row is fitted, the others are predictions)
    fitted = {c["model"]: c for c in reversed(cases)}
    times = torch.zeros(rounds, len(cases), dtype=torch.float64)
    load = [os.getloadavg()[0]]
    per_round = []
    overheads: dict[str, list[float]] = {m: [] for m in fitted}
    for r in range(rounds):
        per_round.append(calibrate_kernels(cal_mesh, profiles, model, reps=1))
        for m, c in fitted.items():
            dp_axis = "dp" if c["dp"] > 1 else None
            got = calibrate_step(
                cal_mesh, c["step"], c["profile"], per_round[-1], data_parallel=dp_axis, reps=1
            )
            overheads[m].append(got.kernel_overhead)
        for i, c in enumerate(cases):
            dist.barrier()
            t = time.perf_counter()
            c["step"]()
            times[r, i] = time.perf_counter() - t
        load.append(os.getloadavg()[0])
    kmodel = _median_model(per_round)
    if out and dist.get_rank() == 0:
        kmodel.save(Path(out) / "cost_model_kernels.json")
    for c in cases:
        dp_axis = "dp" if c.pop("dp") > 1 else None
        prof, bound = c.pop("profile"), c.pop("bound_profile")
        mine = dataclasses.replace(kmodel, kernel_overhead=statistics.median(overheads[c["model"]]))
        pred = predict(prof, mine, data_parallel=dp_axis, bucket_mb=25.0)
        c.update(
            fitted=c is fitted[c["model"]],
            step_overhead_us=mine.kernel_overhead * 1e6,
            kernels_only_ms=predict(prof, kmodel, data_parallel=dp_axis, bucket_mb=25.0).time * 1e3,
            predicted_ms=pred.time * 1e3,
            compute_ms=pred.compute * 1e3,
            exposed_ms=pred.exposed * 1e3,
            comm_ms=pred.comm * 1e3,
            memory_MB=pred.memory.total / 1e6 if pred.memory else 0.0,
            before_ms=predict(prof, before, data_parallel=dp_axis, bucket_mb=25.0).time * 1e3,
            generic_ms=predict(prof, model, data_parallel=dp_axis, bucket_mb=25.0).time * 1e3,
            bound_ms=(
                predict(bound, mine, data_parallel=dp_axis, bucket_mb=25.0).time * 1e3
                if bound is not None
                else None
            ),
        )
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # each round: the slowest rank
    rows = []
    for i, c in enumerate(cases):
        col = sorted(times[:, i].tolist())
        rows.append(
            {
                **{k: v for k, v in c.items() if k != "step"},
                "measured_ms": 1e3 * statistics.median(col),
                "min_ms": 1e3 * col[0],
                "max_ms": 1e3 * col[-1],
                "rounds_ms": [1e3 * x for x in times[:, i].tolist()],
            }
        )
    return {
        "rows": rows,
        "calibrate_s": calibrate_s,
        "kernels_s": kernels_s,
        "kernels": len(kmodel.kernel_times),
        "kernel_overhead": kmodel.kernel_overhead,
        "kernel_overhead_before": before.kernel_overhead,
        "load": load,
        "model": json.loads(model.to_json()),
    }


def _report(res: dict[str, Any], world: int, rounds: int) -> tuple[str, dict[str, Any]]:
    rows = res["rows"]
    m = res["model"]
    lines = [
        f"{world} gloo processes (1 thread each) on this machine; calibrate took "
        f"{res['calibrate_s']:.1f} s: matmul {m['flops'] / 1e9:.1f} GFLOP/s per rank, "
        f"{m['memory_bandwidth'] / 1e9:.1f} GB/s, {m['kernel_latency'] * 1e6:.1f} us per kernel; "
        f"calibrate_kernels before the rounds took {res['kernels_s']:.1f} s: "
        f"{res['kernels']} distinct kernels, {res['kernel_overhead_before'] * 1e6:.1f} us "
        f"overhead per kernel (in the rounds, median: {res['kernel_overhead'] * 1e6:.1f} us); "
        f"{rounds} interleaved rounds; 1-minute load average during the rounds "
        f"{min(res['load']):.1f}-{max(res['load']):.1f}",
        "",
    ]
    summary: dict[str, Any] = {}
    for mname in dict.fromkeys(r["model"] for r in rows):
        sub = [r for r in rows if r["model"] == mname]
        by_pred = sorted(sub, key=lambda r: r["predicted_ms"])
        by_meas = sorted(sub, key=lambda r: r["measured_ms"])
        best_gap = by_pred[0]["measured_ms"] / by_meas[0]["measured_ms"] - 1
        worst = max(abs(r["measured_ms"] / r["predicted_ms"] - 1) for r in sub if not r["fitted"])
        held = [r for r in sub if not r["fitted"]]
        ratios = [r["measured_ms"] / r["predicted_ms"] for r in held]
        generic = [r["measured_ms"] / r["generic_ms"] for r in sub]
        once = [r["measured_ms"] / r["before_ms"] for r in sub]
        kernels_only = [r["measured_ms"] / r["kernels_only_ms"] for r in sub]
        summary[mname] = {
            "ranking_agrees": [r["layout"] for r in by_pred] == [r["layout"] for r in by_meas],
            "predicted_best": by_pred[0]["layout"],
            "measured_best": by_meas[0]["layout"],
            "best_gap": best_gap,
            "worst_error": worst,
            "within_30": sum(abs(x - 1) <= 0.3 for x in ratios),
            "held_out": len(held),
            "ratios": [min(ratios), max(ratios)],
            "kernels_only_ratios": [min(kernels_only), max(kernels_only)],
            "kernels_only_within_30": sum(abs(x - 1) <= 0.3 for x in kernels_only),
            "overhead_us": sub[0]["step_overhead_us"],
            "generic_ratios": [min(generic), max(generic)],
            "before_ratios": [min(once), max(once)],
            "before_within_30": sum(abs(x - 1) <= 0.3 for x in once),
        }
        has_bound = any(r.get("bound_ms") for r in sub)
        lines += [
            f"{mname} ({sub[0]['desc']})",
            "",
            "| layout | predicted ms (compute + exposed comm) | measured ms, median [min-max] "
            "| measured / predicted | rank predicted | rank measured | memory/rank MB "
            "| measured / predicted, kernels only (no step fit) "
            "| measured / predicted, kernels timed once before the rounds (no step fit) "
            "| measured / predicted, calibrate's rates only"
            + (" | measured / predicted, MoE upper bound |" if has_bound else " |"),
            "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if has_bound else ""),
        ]
        for r in sub:
            lines.append(
                f"| {r['layout']}{' (fitted)' if r['fitted'] else ''} | "
                f"{r['predicted_ms']:.1f} ({r['compute_ms']:.1f} + "
                f"{r['exposed_ms']:.1f}) | {r['measured_ms']:.1f} [{r['min_ms']:.1f}-"
                f"{r['max_ms']:.1f}] | {r['measured_ms'] / r['predicted_ms']:.2f} | "
                f"{by_pred.index(r) + 1} | {by_meas.index(r) + 1} | {r['memory_MB']:.1f} | "
                f"{r['measured_ms'] / r['kernels_only_ms']:.2f} | "
                f"{r['measured_ms'] / r['before_ms']:.2f} | "
                f"{r['measured_ms'] / r['generic_ms']:.2f} |"
                + (f" {r['measured_ms'] / r['bound_ms']:.2f} |" if has_bound else "")
            )
        s = summary[mname]
        lines += [
            "",
            f"overhead fitted on {next(r['layout'] for r in sub if r['fitted'])}: "
            f"{s['overhead_us']:.1f} us per kernel; within +-30%: {s['within_30']} of the "
            f"{s['held_out']} other layouts (kernels only, all {len(sub)}: "
            f"{s['kernels_only_within_30']}; kernels timed once before the rounds: "
            f"{s['before_within_30']}); ranking agrees: "
            f"{s['ranking_agrees']}; predicted best {s['predicted_best']}, "
            f"measured best {s['measured_best']} (the predicted best is "
            f"{100 * s['best_gap']:.0f}% slower than the measured best); largest "
            f"|measured / predicted - 1| = {100 * worst:.0f}% (the other layouts)",
            "",
        ]
    return "\n".join(lines), summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny models, 2 rounds (a smoke run)")
    ap.add_argument("--world", type=int, default=4, help="gloo processes (4 or 8)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 9)")
    ap.add_argument("--out", type=Path, default=None, help="directory for the JSON results")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    from benchmarks.planner_accuracy import rank_fn as fn  # importable by the gloo processes
    from fastdist.testing import run_on_gloo

    rounds = args.rounds or (2 if args.quick else 9)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    before = Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "?"
    # each rank forks from one server that imported these once (not a fresh interpreter)
    mp.set_forkserver_preload(["torch", "fastdist", "transformers"])
    res = run_on_gloo(
        fn,
        args.world,
        args.quick,
        rounds,
        str(args.out) if args.out else None,
        start_method="forkserver",
        timeout=1800,
    )[0]
    after = Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "?"
    text, summary = _report(res, args.world, rounds)
    print(text)
    print(f"/proc/loadavg before: {before}; after: {after}")
    if args.out:
        (args.out / "planner_accuracy.json").write_text(
            json.dumps(
                {
                    **res,
                    "summary": summary,
                    "loadavg": [before, after],
                    "world": args.world,
                    "rounds": rounds,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
