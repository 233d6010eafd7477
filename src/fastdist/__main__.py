"""Command line: ``python -m fastdist demo [--dp 2] [--tp 4] [--compile]`` and
``python -m fastdist info``."""

from __future__ import annotations

import argparse
import os
import sys

import torch

__all__ = ["main"]


DESCRIPTION = """fastdist's command line.

commands:
  demo   a tensor-parallel MLP on simulated ranks (a dp x tp mesh in this process, no GPU),
         its loss and gradients checked against the same MLP on one device
  info   torch version, devices, collective backends, and the NCCL / HCCL libraries found

examples:
  {prog} demo                    dp=2, tp=4, float64, eager
  {prog} demo --tp 8 --compile   also under torch.compile
  {prog} info                    what this machine can run
"""


def _prog(argv0: str) -> str:
    """How the user called us: ``python -m fastdist`` or the console script's name."""
    name = os.path.basename(argv0)
    return "python -m fastdist" if name in ("__main__.py", "") or name.startswith("-") else name


def main(argv: list[str] | None = None) -> int:
    prog = _prog(sys.argv[0] if sys.argv else "")
    parser = argparse.ArgumentParser(
        prog=prog,
        description=DESCRIPTION.format(prog=prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="tensor-parallel MLP on a simulated dp x tp mesh, checked against one device",
        description=(
            "A tensor-parallel MLP on a simulated dp x tp mesh, its loss and every gradient "
            "checked against one device. Exit status 0 when every rank matches, 1 otherwise."
        ),
    )
    demo.add_argument("--dp", type=int, default=2, help="data-parallel degree (default 2)")
    demo.add_argument("--tp", type=int, default=4, help="tensor-parallel degree (default 4)")
    demo.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    demo.add_argument(
        "--compile", action="store_true", help="also run the step under torch.compile"
    )
    info = sub.add_parser(
        "info",
        help=(
            "torch version, devices, available backends, the NCCL/HCCL libraries found "
            "(and why not)"
        ),
        description=(
            "torch version, devices, available collective backends, and the NCCL / HCCL "
            "libraries found (and, if none, every place tried)."
        ),
    )
    info.add_argument(
        "--nccl-library", help="check this NCCL shared object instead of discovering one"
    )
    info.add_argument(
        "--hccl-library", help="check this HCCL shared object instead of discovering one"
    )
    args = parser.parse_args(argv)

    if args.command == "info":
        from .info import report

        print(report(args.nccl_library, args.hccl_library))
        return 0

    from .demo import run_demo

    ok = True
    for compiled in (False, True) if args.compile else (False,):
        res = run_demo(args.dp, args.tp, dtype=getattr(torch, args.dtype), compile=compiled)
        mode = "torch.compile" if compiled else "eager"
        print(
            f"fastdist demo: tensor-parallel MLP on simulated {res.mesh!r} ({mode}, {args.dtype})"
        )
        for rank, loss in enumerate(res.rank_losses):
            coords = ", ".join(f"{k}={v}" for k, v in res.mesh.coords(rank).items())
            print(f"  rank {rank} ({coords}): loss {loss:.6f}")
        print(f"  global loss {res.loss:.10f}   single device {res.reference_loss:.10f}")
        for name, diff in res.max_grad_diff.items():
            print(f"  max |grad {name} - single-device grad {name}| over all ranks: {diff:.2e}")
        verdict = "OK" if res.ok else "MISMATCH"
        print(f"  {verdict}: every rank matches the single device within {res.tolerance:g}\n")
        ok = ok and res.ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
