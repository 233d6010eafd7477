"""An expert-parallel MoE layer (fastdist.nn.moe) on simulated ranks, ep=8, against the same layer
on one device.

    python benchmarks/moe.py            # 4096 tokens, hidden 256, 8 experts of 512, top-2
                                        # (about a minute on 2 cores)
    python benchmarks/moe.py --quick    # tiny sizes: a smoke run

One training step of the layer (forward, backward) on the same tokens and routing. One
device: transformers' Mixtral experts loop (each expert on its own tokens, ``index_add``).
Simulated ranks: the tokens split over 8 ranks, one expert per rank, every rank at once
(``fd.simulate``), with each dispatch strategy. The ratio is fastdist's time over one
device's, both measured in this run, alternating (median of per-pair ratios).

What the simulated side pays on top of the arithmetic: simulated ranks share one shape, so
``all_to_all`` fills a static receive buffer (default: the dropless worst case ``ep * T * k``
rows, every expert computed on all of them and masked) and ``allgather`` runs every rank's
expert on every gathered token. A ``capacity`` fitted to the batch (the most rows any rank
receives) is the third row. Real ranks compute exactly the rows that arrive.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import fastdist as fd
from fastdist.nn import moe as M

HERE = Path(__file__).resolve().parent


def _paired(
    base: Callable[[], Any], fn: Callable[[], Any], reps: int
) -> tuple[float, float, float]:
    """(median base s, median fn s, median of per-pair fn/base), the two sides alternating."""
    base(), fn()  # warm-up
    tb, tf, ratios = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        base()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        tb.append(t1 - t0)
        tf.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(tb), statistics.median(tf), statistics.median(ratios)


def one_device(
    x: torch.Tensor, w: torch.Tensor, e: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """transformers' MixtralExperts eager forward: (N, H)."""
    out = torch.zeros_like(x)
    for i in range(gate_up.shape[0]):
        tok, slot = torch.where(e == i)
        g, u = F.linear(x[tok], gate_up[i]).chunk(2, dim=-1)
        out = out.index_add(0, tok, F.linear(F.silu(g) * u, down[i]) * w[tok, slot, None])
    return out


def bench(quick: bool, ep: int = 8) -> list[dict[str, Any]]:
    N, H, I, E, k = (256, 32, 64, 8, 2) if quick else (4096, 256, 512, 8, 2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=g)
    r = M.route(torch.randn(N, E, generator=g), k)
    gate_up, down = (
        torch.randn(E, 2 * I, H, generator=g) / H**0.5,
        torch.randn(E, H, I, generator=g) / I**0.5,
    )
    leaves = [t.clone().requires_grad_() for t in (x, r.weights, gate_up, down)]
    mesh = fd.Mesh({"ep": ep})
    T, el = N // ep, E // ep
    xs, ws = (
        x.reshape(ep, T, H).clone().requires_grad_(),
        r.weights.reshape(ep, T, k).clone().requires_grad_(),
    )
    es = r.experts.reshape(ep, T, k)
    gus, dns = (
        gate_up.reshape(ep, el, 2 * I, H).clone().requires_grad_(),
        down.reshape(ep, el, H, I).clone().requires_grad_(),
    )
    # the most rows any rank receives
    fitted = int(torch.bincount(r.experts.reshape(-1) // el, minlength=ep).max())

    def base() -> None:
        for t in leaves:
            t.grad = None
        one_device(leaves[0], leaves[1], r.experts, leaves[2], leaves[3]).sum().backward()

    def simulated(strategy: str, capacity: int | None) -> Callable[..., torch.Tensor]:
        def layer(
            x: torch.Tensor, w: torch.Tensor, e: torch.Tensor, gu: torch.Tensor, dn: torch.Tensor
        ) -> torch.Tensor:
            def expert(rows: torch.Tensor, i: int) -> torch.Tensor:
                a, b = F.linear(rows, gu[i]).chunk(2, dim=-1)
                return F.linear(F.silu(a) * b, dn[i])

            return M.moe(x, w, e, expert, mesh, "ep", E, strategy=strategy, capacity=capacity).out  # type: ignore[arg-type]

        return fd.simulate(layer, mesh)

    def parallel(sim: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for t in (xs, ws, gus, dns):
                t.grad = None
            sim(xs, ws, es, gus, dns).sum().backward()

        return run

    want = one_device(x, r.weights, r.experts, gate_up, down)
    rows = []
    reps = 3 if quick else 7
    for strategy, capacity, label in (
        ("allgather", None, "allgather"),
        ("all_to_all", None, f"all_to_all, capacity ep*T*k = {ep * T * k} (dropless worst case)"),
        ("all_to_all", fitted, f"all_to_all, capacity {fitted} (fitted to the batch)"),
    ):
        sim = simulated(strategy, capacity)
        got = sim(xs.detach(), ws.detach(), es, gus.detach(), dns.detach())
        torch.testing.assert_close(got.reshape(N, H), want, rtol=1e-4, atol=1e-4)  # the same layer
        fn = parallel(sim)
        tb, tf, ratio = _paired(base, fn, reps)
        rows.append(
            {
                "case": f"MoE layer fwd+bwd, simulated ep={ep}, {label}",
                "tokens": N,
                "hidden": H,
                "experts": E,
                "top_k": k,
                "one_device_ms": tb * 1e3,
                "fastdist_ms": tf * 1e3,
                "ratio": ratio,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore", UserWarning)
    rows = bench(args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "| case | tokens | hidden | experts | top-k | one device ms | fastdist (all ranks) ms | "
        "ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['case']} | {r['tokens']} | {r['hidden']} | {r['experts']} | {r['top_k']} | "
        f"{r['one_device_ms']:.1f} | {r['fastdist_ms']:.1f} | {r['ratio']:.2f} |"
        for r in rows
    ]
    (args.out / "moe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
