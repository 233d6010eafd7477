"""The loss curves of ``examples/train.py`` at its default settings: one device (plain torch) and
a pp x dp x tp run on gloo processes, drawn on top of each other (``docs/loss_curves.svg``, shown
in docs/training.md).

    python examples/loss_curves.py                           # pp2 x dp2 x tp2: 8 processes
    python examples/loss_curves.py --nproc 4 --pp 2 --tp 2   # pp2 x dp1 x tp2
    python examples/loss_curves.py --out curves.png --steps 40 --lr 1e-2   # other train.py flags

Options this script does not know go to both runs of train.py. It exits 1, naming the reason
(and still draws the picture), if a curve does not fall clearly (the mean of its last quarter
at least ``--min-drop`` nats below the mean of its first quarter) or a parallel step's loss
differs from one device's by more than float32's 1e-4 (float64: 1e-6, the printed precision).
The picture keeps both curves' losses in its metadata (``Description``, JSON), so a test can say
whether it still shows what the example does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"


def train_example() -> Any:
    """``examples/train.py`` as a module."""
    spec = importlib.util.spec_from_file_location("train_example", TRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_device_losses(train_args: list[str]) -> list[float]:
    """Every step's loss of ``train.py``'s run on one device (plain torch, this process)."""
    ex = train_example()
    return [float(x) for x in ex.one_device(ex.parse(train_args))]


def parallel_losses(train_args: list[str], nproc: int, pp: int, tp: int) -> list[float]:
    """Every step's loss of ``train.py`` under torchrun on ``nproc`` gloo processes at
    ``pp x (nproc / pp / tp) x tp``, with ``--check`` (train.py exits 1 if a loss, norm or
    weight differs from its own one-device copy). Raises ``RuntimeError`` with the run's output
    if it fails."""
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *("--nproc-per-node", str(nproc), str(TRAIN), *train_args),
        *("--pp", str(pp), "--tp", str(tp), "--check", "--log-every", "1"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    # rank 0 prints "step   3  loss 5.605869  norm 2.3082" for every step
    return [float(m.group(1)) for m in re.finditer(r"^step +\d+  loss (\S+)", proc.stdout, re.M)]


def problems(one: list[float], par: list[float], tol: float, min_drop: float) -> list[str]:
    """Why the curves are not a first run that looks right: a curve that does not fall by
    ``min_drop`` nats (mean of its last quarter against its first), lengths that differ, or a
    step where the parallel loss is more than ``tol`` from one device's. Empty: all is well."""
    out = []
    for name, losses in (("one device", one), ("parallel", par)):
        q = max(1, len(losses) // 4)
        if len(losses) < 2:
            out.append(f"{name}: {len(losses)} losses; the run needs at least 2 steps")
            continue
        first, last = sum(losses[:q]) / q, sum(losses[-q:]) / q
        if not last <= first - min_drop:
            out.append(
                f"{name}: the loss does not fall: mean of the last {q} steps {last:.4f}, of the "
                f"first {q} {first:.4f} (wanted a drop of at least {min_drop})"
            )
    if len(one) != len(par):
        out.append(f"{len(par)} parallel losses, {len(one)} on one device")
    worst = max((abs(a - b), i) for i, (a, b) in enumerate(zip(one, par))) if one and par else None
    if worst is not None and not worst[0] <= tol:
        i = worst[1]
        out.append(
            f"step {i}: parallel loss {par[i]:.6f}, one device {one[i]:.6f} (difference "
            f"{worst[0]:.1e} > {tol:.0e})"
        )
    return out


def draw(one: list[float], par: list[float], label: str, path: Path) -> None:
    """Both curves on one axes, written to ``path`` (``.svg``: reproducible bytes for the same
    losses and matplotlib; the losses in its metadata as JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "fastdist-loss-curves"  # stable ids: no random salt
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    try:
        ax.plot(range(len(one)), one, color="0.6", linewidth=5, label="one device (plain torch)")
        ax.plot(range(len(par)), par, "o--", color="C0", markersize=4, label=label)
        worst = max((abs(a - b) for a, b in zip(one, par)), default=0.0)
        ax.set_title(f"examples/train.py: loss per step (largest difference {worst:.1e})")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats per byte)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        meta = {"Description": json.dumps({"one_device": one, "parallel": par, "label": label})}
        if path.suffix == ".svg":
            meta["Date"] = None  # type: ignore[assignment]
        fig.savefig(path, metadata=meta)
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "loss_curves.svg")
    p.add_argument("--nproc", type=int, default=8, help="gloo processes of the parallel run")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages of the parallel run")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (dp: the rest)")
    p.add_argument("--min-drop", type=float, default=1.0, help="nats the loss must fall")
    args, train_args = p.parse_known_args(argv)
    dp, rest = divmod(args.nproc, args.pp * args.tp)
    if rest or dp < 1:
        raise SystemExit(
            f"--nproc {args.nproc} must be a multiple of pp x tp = {args.pp * args.tp}"
        )
    one = one_device_losses(train_args)
    par = parallel_losses(train_args, args.nproc, args.pp, args.tp)
    label = f"pp{args.pp} x dp{dp} x tp{args.tp}, {args.nproc} gloo processes"
    draw(one, par, label, args.out)
    tol = 1e-6 if "float64" in train_args else 1e-4
    found = problems(one, par, tol, args.min_drop)
    for line in found:
        print(f"loss_curves: {line}", file=sys.stderr)
    if one and par:
        print(
            f"{args.out}: one device {one[0]:.3f} -> {one[-1]:.3f}, "
            f"{label} {par[0]:.3f} -> {par[-1]:.3f}"
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
