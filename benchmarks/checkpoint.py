"""Checkpoints on gloo processes: each rank writing its own slices through
``torch.distributed.checkpoint`` (`fastdist.checkpoint.save` / `load`, ``format="dcp"``) against
``format="safetensors"`` (every parameter all-gathered, rank 0 writes one safetensors file; each
rank reads its slices of that file).

    python benchmarks/checkpoint.py            # 4 processes, tp=4, an HF Llama of ~28M parameters
    python benchmarks/checkpoint.py --quick    # tiny sizes, 2 processes: a smoke run

Per rank and operation: the wall time (the slowest rank's, between barriers) and the peak
resident memory above the resident memory before the call (Linux's ``VmHWM``, reset through
``/proc/self/clear_refs`` before each call). The two saves alternate in every round, then the
two loads; ratios are medians of per-round ratios (DCP / today). DCP ``fsync``s its files
(``FileSystemWriter``'s default); ``safetensors.save_file`` does not. One extra row: the DCP
save with the AdamW state (3x the bytes), which today's path cannot save at all.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable
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
        else dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, vocab_size=8192)
    )
    config = transformers.LlamaConfig(**size, num_attention_heads=8, num_key_value_heads=4)
    return transformers.LlamaForCausalLM(config).float().eval()


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    text = Path("/proc/self/status").read_text()
    m = re.search(rf"{field}:\s+(\d+) kB", text)
    return int(m.group(1)) * 1024 if m else 0


def _measure(fn: Callable[[], Any]) -> tuple[float, int]:
    """(seconds, peak resident bytes above the start) of ``fn()``, between barriers."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - before
    del out
    dist.barrier()
    return seconds, peak


def rank_fn(quick: bool, reps: int, root: str) -> dict[str, Any]:
    """One rank: alternate the two saves, then the two loads, ``reps`` rounds."""
    import fastdist as fd

    torch.set_num_threads(1)
    world = torch.distributed.get_world_size()
    mesh = fd.connect(tp=world, timeout=600)
    base = _model(quick)
    params = sum(p.numel() for p in base.parameters())
    pm = fd.nn.parallelize(base, mesh, fd.nn.plans.plan(base, family="llama"))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    for p in pm.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # AdamW state exists
    st, dcp, dcp_opt = f"{root}/st", f"{root}/dcp", f"{root}/dcp_opt"
    if mesh.rank == 0:
        Path(st).mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    cases: dict[str, Callable[[], Any]] = {
        "save: safetensors (gather, rank 0 writes)": lambda: fd.checkpoint.save(
            st, pm, format="safetensors"
        ),
        "save: fastdist.checkpoint.save (DCP)": lambda: fd.checkpoint.save(dcp, pm),
        "load: safetensors (slices)": lambda: fd.checkpoint.load(st, pm, format="safetensors"),
        "load: fastdist.checkpoint.load (DCP)": lambda: fd.checkpoint.load(dcp, pm),
        "save with AdamW state: fastdist.checkpoint.save (DCP)": lambda: fd.checkpoint.save(
            dcp_opt, pm, opt
        ),
    }
    names = list(cases)
    out: dict[str, Any] = {n: {"s": [], "peak": []} for n in names}
    for r in range(reps):
        for pair in ((0, 1), (2, 3), (4,)):
            order = pair if r % 2 == 0 else pair[::-1]
            for i in order:
                s, peak = _measure(cases[names[i]])
                out[names[i]]["s"].append(s)
                out[names[i]]["peak"].append(peak)
    out["params"] = params
    out["local_bytes"] = sum(p.numel() * p.element_size() for p in pm.parameters())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--world", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: a tmp)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    import tempfile

    from benchmarks.checkpoint import rank_fn as fn  # importable by the gloo processes
    from fastdist.testing import run_on_gloo

    world = args.world or (2 if args.quick else 4)
    reps = args.reps or (1 if args.quick else 3)
    root = Path(tempfile.mkdtemp(prefix="fastdist-ckpt-", dir=args.dir))
    try:
        rows = run_on_gloo(fn, world, args.quick, reps, str(root), timeout=1200)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    names = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    table = []
    for name in names:
        per_round = [max(r[name]["s"][i] for r in rows) for i in range(reps)]  # slowest rank
        table.append(
            {
                "case": name,
                "s": statistics.median(per_round),
                "per_round_s": per_round,
                "peak_mb_per_rank": [max(r[name]["peak"]) / 2**20 for r in rows],
            }
        )
    by = {t["case"]: t for t in table}
    for old, new in ((names[0], names[1]), (names[2], names[3])):
        by[new]["time_ratio"] = statistics.median(
            n / o for n, o in zip(by[new]["per_round_s"], by[old]["per_round_s"])
        )
        by[new]["peak_ratio"] = max(by[new]["peak_mb_per_rank"]) / max(
            max(by[old]["peak_mb_per_rank"]), 1e-9
        )
    result = {
        "world": world,
        "params": rows[0]["params"],
        "model_mb": rows[0]["params"] * 4 / 2**20,
        "local_mb": rows[0]["local_bytes"] / 2**20,
        "reps": reps,
        "rows": table,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint.json").write_text(json.dumps(result, indent=2))
    print(
        f"tp={world} gloo processes, HF Llama of {result['params'] / 1e6:.1f}M parameters "
        f"({result['model_mb']:.0f} MB float32, {result['local_mb']:.0f} MB per rank), "
        f"median of {reps} rounds"
    )
    print("| operation | s (slowest rank) | DCP / today | peak MB above start, per rank |")
    print("|---|---|---|---|")
    for t in table:
        ratio = (
            f"{t['time_ratio']:.2f}x time, {t['peak_ratio']:.2f}x peak" if "time_ratio" in t else ""
        )
        peaks = " / ".join(f"{m:.0f}" for m in t["peak_mb_per_rank"])
        print(f"| {t['case']} | {t['s']:.3f} | {ratio} | {peaks} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
