"""Command line: ``python -m fastdist demo [--dp 2] [--tp 4] [--compile]`` and
``python -m fastdist info``."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]

#: The most simulated ranks the demo runs (dp x tp): it prints one line per rank.
MAX_DEMO_RANKS = 1024


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


def _degree(text: str) -> int:
    """argparse type of ``--dp`` / ``--tp``: a whole number of ranks, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of ranks") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} ranks: the degree must be at least 1")
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); the exit status.

    Mistakes in the arguments exit with status 2 and argparse's usage message. ``--help`` and the
    argument checks import neither torch nor the rest of fastdist.
    """
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
    demo.add_argument("--dp", type=_degree, default=2, help="data-parallel degree (default 2)")
    demo.add_argument("--tp", type=_degree, default=4, help="tensor-parallel degree (default 4)")
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
    if args.command == "demo" and args.dp * args.tp > MAX_DEMO_RANKS:
        demo.error(
            f"--dp {args.dp} x --tp {args.tp} = {args.dp * args.tp} simulated ranks; the demo runs "
            f"at most {MAX_DEMO_RANKS} (it prints one line per rank)"
        )

    if args.command == "info":
        from fastdist.tools.info import report

        print(report(args.nccl_library, args.hccl_library))
        return 0

    import torch

    from fastdist.tools.demo import run_demo

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
        if res.ok:
            print(f"  OK: every rank matches the single device within {res.tolerance:g}\n")
        else:
            worst = ", ".join(f"{name} by {diff:.2e}" for name, diff in res.mismatches.items())
            print(
                f"  MISMATCH: the ranks differ from the single device beyond {res.tolerance:g}: "
                f"{worst}\n"
            )
        ok = ok and res.ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
