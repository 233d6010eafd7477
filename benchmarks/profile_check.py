"""Check fastdist.profile's alpha-beta predictions against measured gloo times on this machine.

    python benchmarks/profile_check.py            # 4 gloo processes, about 30 s
    python benchmarks/profile_check.py --quick    # small sizes (the smoke test)

1. Calibrate: time all-reduces of a small and a large buffer over groups of 2 and 4 ranks and
   fit one ``Link(bandwidth, latency)`` (one "node": every rank is on this machine).
2. For each layout of 4 ranks over (dp, tp) (tp4, dp2 x tp2, dp4), trace the step of a
   sequence-parallel TP MLP with its dp gradient all-reduce on meta tensors
   (``fastdist.profile.trace``), predict its communication time, then replay exactly the
   traced collectives on the real gloo mesh and time them.
3. Print predicted vs measured times and whether the rankings agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastdist as fd
from fastdist.profile import Link, MeshLayout, Network, Profile, Record, predict, trace

WORLD = 4
LAYOUTS = ({"tp": 4}, {"dp": 2, "tp": 2}, {"dp": 4})


def _step_profile(mesh: fd.Mesh, t: int, d: int, h: int) -> Profile:
    """Sequence-parallel TP MLP (tokens t, hidden d, ffn h) and the dp all-reduce of its weight
    gradients."""
    tp, dp = (mesh.axis_size(a) if a in mesh.axis_names else 1 for a in ("tp", "dp"))

    def step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> None:
        full = fd.all_gather(x, mesh, "tp") if tp > 1 else x
        y = torch.tanh(full @ w1) @ w2
        out = fd.psum_scatter(y, mesh, "tp") if tp > 1 else y
        out.sum().backward()  # type: ignore[no-untyped-call]
        if dp > 1:
            assert w1.grad is not None and w2.grad is not None
            fd.psum(w1.grad, mesh, "dp")
            fd.psum(w2.grad, mesh, "dp")

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, device="meta", requires_grad=True)

    return trace(step, mesh, meta(t // dp // tp, d), meta(d, h // tp), meta(h // tp, d))


def _replay(r: Record, mesh: fd.Mesh) -> None:
    axis = tuple(r.axis.split("+")) if "+" in r.axis else r.axis
    elems = r.size // r.dtype.itemsize
    if r.kind == "allreduce":
        fd.psum(torch.zeros(elems, dtype=r.dtype), mesh, axis)
    elif r.kind == "allgather":
        fd.all_gather(torch.zeros(elems // r.n, dtype=r.dtype), mesh, axis)
    elif r.kind == "reducescatter":
        fd.psum_scatter(torch.zeros(elems, dtype=r.dtype), mesh, axis)
    else:
        raise NotImplementedError(r.kind)


def _replay_all(prof: Profile, mesh: fd.Mesh) -> None:
    for r in prof.records:
        _replay(r, mesh)


def _time(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(
    rank: int, init: str, out: str, sizes: tuple[int, int, int], calib: tuple[int, int], reps: int
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    results: dict[str, Any] = {"calibration": [], "layouts": []}
    try:
        for n in (2, 4):  # calibration: all-reduce over n ranks of small and large buffers
            cmesh = fd.connect(tp=n, timeout=120)
            for elems in calib:
                buf = torch.zeros(elems)
                t = _time(lambda buf=buf, cmesh=cmesh: fd.psum(buf, cmesh, "tp"), reps)
                results["calibration"].append({"n": n, "bytes": elems * 4, "seconds": t})
        cases = []
        for degrees in LAYOUTS:
            mesh = fd.connect(order=("dp", "tp"), timeout=120, tp=degrees.get("tp", 1))
            # the trace takes precedence over the process group
            cases.append((degrees, mesh, _step_profile(mesh, *sizes)))
        times: list[list[float]] = [[] for _ in cases]
        for _ in range(reps):  # rounds over the layouts, interleaved: drifting load hits them alike
            for i, (_, mesh, prof) in enumerate(cases):
                times[i].append(_time(lambda mesh=mesh, prof=prof: _replay_all(prof, mesh), 1))
        results["layouts"] = [
            {"degrees": d, "seconds": statistics.median(ts)} for (d, _, _), ts in zip(cases, times)
        ]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    # exit without the interpreter's teardown: torch's native gloo threads can abort in their
    # static destructors after everything is done (SIGABRT at exit, seen in CI)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fit(calibration: list[dict[str, Any]]) -> Link:
    """Least squares of ``t = 2(n-1) * alpha + bytes * 2(n-1)/n / bandwidth`` over the calibration
    points."""
    a = torch.tensor(
        [[2.0 * (c["n"] - 1), c["bytes"] * 2 * (c["n"] - 1) / c["n"]] for c in calibration],
        dtype=torch.float64,
    )
    b = torch.tensor([c["seconds"] for c in calibration], dtype=torch.float64)
    alpha, inv_bw = torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1).tolist()
    return Link(1.0 / max(inv_bw, 1e-15), max(alpha, 0.0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    args = ap.parse_args(argv)
    sizes = (64, 128, 512) if args.quick else (512, 1024, 4096)  # tokens, hidden, ffn
    calib = (256, 1 << 14) if args.quick else (256, 1 << 20, 1 << 22)
    reps = 3 if args.quick else 15
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(  # type: ignore[attr-defined,no-untyped-call]
            _worker, args=(f"file://{tmp}/store", out, sizes, calib, reps), nprocs=WORLD, join=True
        )
        res = json.loads(Path(out).read_text())
    link = _fit(res["calibration"])
    net = Network("gloo on this machine (fitted)", WORLD, link, link)
    rows = []
    for entry in res["layouts"]:
        degrees = entry["degrees"]
        layout = MeshLayout(tuple((k, degrees[k]) for k in ("dp", "tp") if k in degrees))
        pred = predict(_step_profile(layout.mesh, *sizes), net)
        rows.append((str(layout), pred.time, entry["seconds"]))
    by_pred = [r[0] for r in sorted(rows, key=lambda r: r[1])]
    by_meas = [r[0] for r in sorted(rows, key=lambda r: r[2])]
    print(
        f"fitted link: {link.bandwidth / 1e9:.2f} GB/s, latency {link.latency * 1e6:.0f} us; "
        f"step: tokens={sizes[0]} hidden={sizes[1]} ffn={sizes[2]} float32, "
        f"{WORLD} gloo processes\n"
    )
    print("| layout | predicted ms | measured ms | measured / predicted |\n|---|---|---|---|")
    for name, p, m in rows:
        print(f"| {name} | {p * 1e3:.2f} | {m * 1e3:.2f} | {m / p:.2f} |")
    agree = by_pred == by_meas
    print(
        f"\nranking predicted: {' < '.join(by_pred)}\nranking measured:  "
        f"{' < '.join(by_meas)}\nagree: {agree}"
    )
    return 0 if agree or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
