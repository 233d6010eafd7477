"""Domain parallelism on gloo processes: a conv net and the Wan VAE decoder split over H
(`fastdist.nn.DomainParallel`) at 2 and 4 ranks, against the same model on one device: time per
forward + backward and the activation memory per rank.

    python benchmarks/domain.py            # 128 x 128 conv net, a 16 x 16 latent Wan decode
    python benchmarks/domain.py --quick    # tiny sizes, 2 ranks (the smoke test, seconds)

Every rank gets the whole field (the same on every rank), runs the model domain-parallel (each
holding its block of rows plus the halos), and the whole output is gathered; a step is forward,
backward of ``sum(out * cot)``, gradients dropped. Before timing, each rank checks its output
against the single-device model's (float32). The one-device row runs in this process, one
thread, in the same run; each gloo process runs one thread too. A step's time is its slowest
rank's (the ranks start it after a barrier), the median over the repetitions.

Activation memory: the bytes of the tensors autograd saves during one forward (as
``context_memory.saved_bytes`` counts them, each storage once, but without the model's
parameters, which a convolution saves too), on each real rank, the largest rank's:
that is what a training step holds at the end of its forward, without gradient buffers or the
allocator's slack. Not a CUDA peak: nothing here has run on a GPU. The goal is ~1/ranks of one
device's plus the halos; the field itself (whole on every rank here, as the style's input)
is not an activation. More ranks than cores time the machine's oversubscription, not the
method: the cores and the load average are printed with the table. Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fastdist as fd
from fastdist.testing import run_on_gloo

HERE = Path(__file__).resolve().parent


#: the ranks of each gloo job (quick: the smoke run)
RANKS = {True: (2,), False: (2, 4)}
# model: its input field's shape, per size
SIZES = {
    "quick": {"conv net": (1, 4, 16, 16), "Wan VAE decoder": (1, 4, 1, 4, 4)},
    "full": {"conv net": (1, 8, 128, 128), "Wan VAE decoder": (1, 4, 2, 16, 16)},
}


def activation_bytes(run: Any, model: nn.Module) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` executes a forward, the
    model's parameters (which a convolution saves for its backward too; on the ranks, their
    ``pvary``'d copies: tensors of a parameter's shape) left out."""
    shapes = {tuple(p.shape) for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if tuple(t.shape) not in shapes:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def build(name: str, quick: bool) -> nn.Module:
    """The model (float32, seeded: the same weights in every process)."""
    torch.manual_seed(0)
    if name == "conv net":
        width = 8 if quick else 32
        cin = 4 if quick else 8
        return nn.Sequential(
            nn.Conv2d(cin, width, 3, padding=1), nn.GroupNorm(4, width), nn.SiLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.GroupNorm(4, width), nn.SiLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.SiLU(),
            nn.Conv2d(width, cin, 3, padding=1),
        )  # fmt: skip
    from diffusers import AutoencoderKLWan

    base = 8 if quick else 16
    vae: Any = AutoencoderKLWan(  # type: ignore[no-untyped-call]
        base_dim=base, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True]
    )
    decoder: nn.Module = vae.decoder
    return decoder


def field(shape: tuple[int, ...], model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The input field and a cotangent of the output's shape."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g)
    with torch.no_grad():
        out = model(x)
    return x, torch.randn(out.shape, generator=g)


def _step(model: Any, x: torch.Tensor, cot: torch.Tensor) -> float:
    t0 = time.perf_counter()
    (model(x) * cot).sum().backward()
    for p in model.parameters():
        p.grad = None
    return time.perf_counter() - t0


def _rank(quick: bool, reps: int, warmup: int) -> dict[str, dict[str, Any]]:
    """One gloo rank: each model split over H across every rank; its output difference from the
    single-device model, its saved-activation bytes, and its step times."""
    torch.set_num_threads(1)
    n = dist.get_world_size()
    mesh = fd.connect(h=n, timeout=600)
    results = {}
    for name, shape in SIZES["quick" if quick else "full"].items():
        net = build(name, quick)
        ref = copy.deepcopy(net)
        x, cot = field(shape, ref)
        pm = fd.nn.parallelize(net, mesh, {"": fd.nn.DomainParallel({-2: "h"})})
        with torch.no_grad():
            diff = float((pm(x) - ref(x)).abs().max())
        mem = activation_bytes(lambda pm=pm, x=x: pm(x), net)
        for _ in range(warmup):
            _step(pm, x, cot)
        times = []
        for _ in range(reps):
            dist.barrier()
            times.append(_step(pm, x, cot))
        results[name] = {"diff": diff, "mem": mem, "times": times}
    return results


def one_device(name: str, quick: bool, reps: int, warmup: int) -> dict[str, Any]:
    """The single-device row, in this process with one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = build(name, quick)
        x, cot = field(SIZES["quick" if quick else "full"][name], net)
        mem = activation_bytes(lambda: net(x), net)
        for _ in range(warmup):
            _step(net, x, cot)
        return {"mem": mem, "times": [_step(net, x, cot) for _ in range(reps)]}
    finally:
        torch.set_num_threads(threads)


def bench(quick: bool) -> list[dict[str, Any]]:
    reps, warmup = (2, 1) if quick else (7, 2)
    base = {name: one_device(name, quick, reps, warmup) for name in SIZES["quick"]}
    jobs = {n: run_on_gloo(_rank, n, quick, reps, warmup, timeout=3000) for n in RANKS[quick]}
    rows = []
    for name, one in base.items():
        t1 = statistics.median(one["times"])
        rows.append({"model": name, "ranks": 1, "ms": t1 * 1e3, "time_ratio": 1.0,
                     "mib": one["mem"] / 2**20, "mem_ratio": 1.0, "diff": 0.0})  # fmt: skip
        for n, job in jobs.items():
            per_rank = [r[name] for r in job]
            t = statistics.median(max(r["times"][i] for r in per_rank) for i in range(reps))
            mem = max(r["mem"] for r in per_rank)
            rows.append({
                "model": name, "ranks": n, "ms": t * 1e3, "time_ratio": t / t1,
                "mib": mem / 2**20, "mem_ratio": mem / one["mem"],
                "diff": max(r["diff"] for r in per_rank),
            })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 2 ranks (a smoke run)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    load = [os.getloadavg()]
    rows = bench(args.quick)
    load.append(os.getloadavg())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "domain.json").write_text(json.dumps({"rows": rows, "loadavg": load}, indent=1))
    sizes = SIZES["quick" if args.quick else "full"]
    lines = [
        f"load average before {load[0][0]:.2f}, after {load[1][0]:.2f} (1 min); "
        f"{os.cpu_count()} cores; torch {torch.__version__}; gloo processes, 1 thread each; "
        f"fields: " + ", ".join(f"{k} {list(v)}" for k, v in sizes.items()),
        "",
        "| model | ranks (H split) | fwd+bwd ms | / one device | activations MiB per rank "
        "| / one device | max diff vs one device |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['model']} | {r['ranks']} | {r['ms']:.1f} | {r['time_ratio']:.2f} | "
        f"{r['mib']:.2f} | {r['mem_ratio']:.2f} | {r['diff']:.0e} |"
        for r in rows
    ]
    (args.out / "domain.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
