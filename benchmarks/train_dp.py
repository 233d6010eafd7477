"""Data parallelism on gloo processes: fastdist's bucketed reduction during backward against
reducing after backward, and ZeRO-1's optimizer state per rank against replicated AdamW.

    python benchmarks/train_dp.py            # 4 processes, dp=4, an HF Llama of ~6M parameters
    python benchmarks/train_dp.py --quick    # tiny sizes: a smoke run

Step = forward + backward + gradient reduction over dp (+ AdamW). Two copies of the same
model in every process, stepped alternately on the same batch:

* ``overlapped``: `fastdist.train.DataParallel` (buckets all-reduced asynchronously as
  backward produces them, waited for at the end of backward);
* ``after``: backward first, then one all-reduce of all gradients flattened together (the
  simplest correct reduction; the usual hand-written loop).

Ratios are medians of per-pair ratios measured in this run. ZeRO-1 rows count the optimizer
state elements per rank after one step of `fastdist.train.ZeroOptimizer` against
``torch.optim.AdamW`` on the same parameters (goal: 1/dp).
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def _model(quick: bool) -> Any:
    import transformers

    torch.manual_seed(0)
    size = (
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=101)
        if quick
        else dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, vocab_size=4001)
    )
    config = transformers.LlamaConfig(**size, num_attention_heads=8, num_key_value_heads=4)
    return transformers.LlamaForCausalLM(config).float().train()


def rank_fn(quick: bool, reps: int, bucket_mb: float) -> dict[str, Any]:
    """One rank: the paired timing, and the state counts."""
    import torch.distributed as dist

    import fastdist as fd

    torch.set_num_threads(1)
    mesh = fd.connect(tp=1, timeout=300)  # dp = world
    base = _model(quick)
    a = fd.nn.parallelize(copy.deepcopy(base), mesh, fd.nn.plans.plan(base, family="llama"))
    b = fd.nn.parallelize(copy.deepcopy(base), mesh, fd.nn.plans.plan(base, family="llama"))
    fd.train.DataParallel(a, "dp", bucket_mb=bucket_mb)
    group = fd.comm.to_device_mesh(mesh)["dp"].get_group()
    g = torch.Generator().manual_seed(mesh.rank)
    ids = torch.randint(
        0, base.config.vocab_size, (2 if quick else 4, 16 if quick else 128), generator=g
    )

    def overlapped() -> None:
        a(input_ids=ids, labels=ids).loss.backward()
        a.module.zero_grad()

    def after() -> None:
        b(input_ids=ids, labels=ids).loss.backward()
        grads = [p.grad for p in b.parameters()]
        flat = torch.cat([x.reshape(-1) for x in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(mesh.size)
        offset = 0
        for x in grads:
            x.copy_(flat[offset : offset + x.numel()].view_as(x))
            offset += x.numel()
        b.module.zero_grad()

    overlapped(), after()  # warm-up (groups, buckets)
    ta, tb, ratios = [], [], []
    for _ in range(reps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        after()
        t1 = time.perf_counter()
        dist.barrier(group=group)
        t2 = time.perf_counter()
        overlapped()
        t3 = time.perf_counter()
        tb.append(t1 - t0)
        ta.append(t3 - t2)
        ratios.append((t3 - t2) / (t1 - t0))
    # ZeRO-1 against replicated AdamW: optimizer state elements on this rank after one step
    zero = fd.train.ZeroOptimizer(a, torch.optim.AdamW, lr=1e-3)
    plain = torch.optim.AdamW(b.parameters(), lr=1e-3)
    for pm, opt in ((a, zero), (b, plain)):
        pm(input_ids=ids, labels=ids).loss.backward()
        if pm is b:
            for p in b.parameters():
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(mesh.size)
        opt.step()
    plain_numel = sum(v.numel() for s in plain.state.values() for v in s.values() if v.dim() > 0)
    return {
        "after_ms": 1e3 * statistics.median(tb),
        "overlapped_ms": 1e3 * statistics.median(ta),
        "ratio": statistics.median(ratios),
        "params": sum(p.numel() for p in base.parameters()),
        "zero_state": zero.state_numel(),
        "adamw_state": plain_numel,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    from benchmarks.train_dp import rank_fn as fn  # importable by the gloo processes
    from fastdist.testing import run_on_gloo

    reps, bucket = (2, 0.01) if args.quick else (10, 4.0)
    # each rank forks from one server that imported these once (not a fresh interpreter)
    mp.set_forkserver_preload(["torch", "fastdist"])
    rows = run_on_gloo(
        fn, args.world, args.quick, reps, bucket, start_method="forkserver", timeout=900
    )
    r0 = rows[0]
    result = {
        "world": args.world,
        "params": r0["params"],
        "after_ms": statistics.median(r["after_ms"] for r in rows),
        "overlapped_ms": statistics.median(r["overlapped_ms"] for r in rows),
        "ratio": statistics.median(r["ratio"] for r in rows),
        "zero_state_per_rank": max(r["zero_state"] for r in rows),
        "adamw_state_per_rank": r0["adamw_state"],
    }
    result["zero_ratio"] = result["zero_state_per_rank"] / result["adamw_state_per_rank"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_dp.json").write_text(json.dumps(result, indent=2))
    print(f"dp={args.world} gloo processes, HF Llama of {result['params'] / 1e6:.1f}M parameters")
    print("| step (fwd + bwd + dp reduction) | ms | ratio |")
    print("|---|---|---|")
    print(f"| reduce after backward (one flat all-reduce) | {result['after_ms']:.1f} | 1.00 |")
    print(
        f"| fastdist.train.DataParallel (buckets during backward) | "
        f"{result['overlapped_ms']:.1f} | {result['ratio']:.2f} |"
    )
    print(
        f"\nAdamW state per rank: replicated {result['adamw_state_per_rank']:,} elements, ZeRO-1 "
        f"{result['zero_state_per_rank']:,} ({result['zero_ratio']:.3f}; 1/dp = "
        f"{1 / args.world:.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
