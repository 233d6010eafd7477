"""Pipeline parallelism on gloo processes: torch.distributed.pipelining's schedules on an HF Llama,
step time and the measured bubble against the schedule's theoretical one (issue 34, point 4).

    python benchmarks/pipeline.py            # pp 2 and 4; GPipe, 1F1B, interleaved 1F1B; m 4, 8, 16
    python benchmarks/pipeline.py --quick    # tiny sizes, pp 2 and 4, GPipe and 1F1B, m 4 and 8

Each row: the same float64 model (tests/pipeline_torch_ref.py: `llama_config`, seed 0) split
into ``pp`` stages (``pp * v`` for interleaved, ``v = 2``) by layer index, one micro-batch of
``MB`` sequences, ``m`` micro-batches per step. Step = the schedule's ``step()`` (forward,
loss, backward of every micro-batch), timed from a barrier to the slowest rank's return; the
median over the timed steps (the first is not timed).

Bubble, measured: ``1 - busy / step`` per rank, where ``busy`` is the wall time the rank spends
in the stages' compute actions (``forward_one_chunk``, ``backward_one_chunk``) and the loss
(`tests.pipeline_torch_ref.StageTimer`); torch's schedules post and wait for every send and
receive outside those, so the rest is waiting for a peer plus communication and bookkeeping.
The table gives the mean over ranks (and the range). Replayed: the same ranks' recorded
actions with their measured durations, re-run with free communication
(`tests.pipeline_torch_ref.replay_bubble`): the bubble the schedule itself leaves given the
stages' real (unequal) times; measured minus replayed is what communication, the schedule's
bookkeeping and the OS (more processes than cores) add. Theory: ``(pp - 1) / (m + pp - 1)`` for
GPipe and 1F1B, ``(pp - 1) / (v m + pp - 1)`` for interleaved 1F1B, which assumes equal
stages and free communication: the measured value is that plus the overheads (and, with more
processes than cores, plus the time the OS gives the other ranks).

The fastdist columns come from `fastdist_pipeline_step` (same arguments as
`tests.pipeline_torch_ref.torch_pipeline_step`, run on the same processes right after torch's
side of each row); it returns None until fastdist's pipeline exists, and the columns say so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SEED = 0
V = 2  # stages per rank of the interleaved rows


def sizes(quick: bool) -> dict[str, Any]:
    """Model sizes (``llama_config`` overrides), the sequence length and the sequences per
    micro-batch."""
    if quick:
        model = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, vocab_size=256)
        return dict(config=model, seq=32, mb=2)
    model = dict(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1024,
    )
    return dict(config=model, seq=64, mb=2)


def rows(quick: bool) -> list[tuple[int, str, int, int]]:
    """``(pp, schedule, m, stages per rank)`` of each row."""
    out = []
    for pp in (2, 4):
        for schedule in ("gpipe", "1f1b") if quick else ("gpipe", "1f1b", "interleaved_1f1b"):
            for m in (4, 8) if quick else (4, 8, 16):
                out.append((pp, schedule, m, V if schedule == "interleaved_1f1b" else 1))
    return out


def fastdist_pipeline_step(
    config_kwargs: dict[str, Any],
    schedule: str,
    microbatches: int,
    seed: int,
    batch: int,
    seq: int,
    stages_per_rank: int = 1,
    steps: int = 3,
) -> dict[str, Any] | None:
    """fastdist's side of a row, on one rank: the same model, split and schedule through
    fastdist's pipeline (src/fastdist/train/pipeline.py). Must return what
    `tests.pipeline_torch_ref.torch_pipeline_step` returns (at least ``loss``, ``step_s`` and
    ``bubble``), measured the same way. None until that pipeline exists."""
    return None


def rank_fn(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One rank: for each case, torch's side then fastdist's, on these processes."""
    from tests.pipeline_torch_ref import torch_pipeline_step

    out = []
    for case in cases:
        res = {"torch": torch_pipeline_step(**case), "fastdist": fastdist_pipeline_step(**case)}
        for side in res.values():  # gradients are checked by tests/test_pipeline_torch.py
            if side is not None:
                side.pop("grads", None)
                side.pop("actions", None)
        out.append(res)
    return out


def _summary(per_rank: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One side of a row over the ranks: step ms, the mean bubble and its range, the loss."""
    if any(r is None for r in per_rank):
        return None
    bubbles = [r["bubble"] for r in per_rank]
    (loss,) = [float(r["loss"]) for r in per_rank if r["loss"] is not None]
    return {
        "step_ms": 1e3 * per_rank[0]["step_s"],  # the slowest rank's: the same on every rank
        "bubble": statistics.mean(bubbles),
        "bubble_min": min(bubbles),
        "bubble_max": max(bubbles),
        "bubble_replay": statistics.mean(r["bubble_replay"] for r in per_rank),
        "loss": loss,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    from benchmarks.pipeline import rank_fn as fn  # importable by the gloo processes
    from fastdist.testing import run_on_gloo
    from tests.pipeline_torch_ref import bubble_theory, llama_config, make_batch, reference

    sz = sizes(args.quick)
    steps = 3 if args.quick else 6
    table = []
    for pp in sorted({r[0] for r in rows(args.quick)}):
        mine = [r for r in rows(args.quick) if r[0] == pp]
        cases = [
            dict(
                config_kwargs=sz["config"],
                schedule=schedule,
                microbatches=m,
                seed=SEED,
                batch=m * sz["mb"],
                seq=sz["seq"],
                stages_per_rank=v,
                steps=steps,
            )
            for _, schedule, m, v in mine
        ]
        per_rank = run_on_gloo(fn, pp, cases, timeout=1200)
        for i, ((_, schedule, m, v), case) in enumerate(zip(mine, cases)):
            torch_side = _summary([ranks[i]["torch"] for ranks in per_rank])
            fd_side = _summary([ranks[i]["fastdist"] for ranks in per_rank])
            assert torch_side is not None
            config = llama_config(**sz["config"])
            ids, labels = make_batch(config, case["batch"], sz["seq"], SEED)
            loss_ref = float(reference(config, ids, labels, SEED)[0])
            assert abs(torch_side["loss"] - loss_ref) < 1e-9, (schedule, pp, m, loss_ref)
            row = {
                "schedule": schedule if v == 1 else f"{schedule} (v={v})",
                "pp": pp,
                "m": m,
                "torch": torch_side,
                "fastdist": fd_side,
                "bubble_theory": bubble_theory(schedule, pp, m, v),
            }
            if fd_side is not None:
                row["ratio"] = fd_side["step_ms"] / torch_side["step_ms"]
            table.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline.json").write_text(json.dumps(table, indent=2))
    c = sz["config"]
    print(
        f"HF Llama, float64, hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
        f"vocab {c['vocab_size']}; micro-batch {sz['mb']} x {sz['seq']} tokens; gloo processes "
        f"on {os.cpu_count()} CPU cores; median of {steps - 1} steps"
    )
    print(
        "| schedule | pp | m | torch step ms | bubble measured (range over ranks) | "
        "bubble replayed, free comm | bubble theory | fastdist step ms | fastdist / torch | "
        "fastdist bubble |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        t, f = r["torch"], r["fastdist"]
        fd_cols = (
            f"{f['step_ms']:.1f} | {r['ratio']:.2f} | {f['bubble']:.3f}"
            if f is not None
            else "not built yet | — | —"
        )
        print(
            f"| {r['schedule']} | {r['pp']} | {r['m']} | {t['step_ms']:.1f} | "
            f"{t['bubble']:.3f} ({t['bubble_min']:.3f}–{t['bubble_max']:.3f}) | "
            f"{t['bubble_replay']:.3f} | {r['bubble_theory']:.3f} | {fd_cols} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
