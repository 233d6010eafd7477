"""Pipeline parallelism on gloo processes: torch.distributed.pipelining's schedules on an HF Llama,
step time and the measured bubble against the schedule's theoretical one (issue 34, point 4).

    python benchmarks/pipeline.py            # pp 2 and 4; GPipe, 1F1B, interleaved 1F1B; m 4, 8, 16
    python benchmarks/pipeline.py --quick    # tiny sizes: each schedule at pp 2, 1F1B at pp 4; m 4
    python benchmarks/pipeline.py --only 4:1f1b:8   # one row (pp:schedule:m), repeatable
    python benchmarks/pipeline.py --only 4:1f1b:8 --profile  # and where fastdist's step goes

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
side of each row): the same model, stages, schedule and batch through `fastdist.train.pipeline`;
its loss must equal the one-device reference too (checked here to 1e-9), and its gradients
torch's (tests/test_pipeline_gloo.py checks them against one device). Its step is timed as
torch's: from the barrier to ``step()``'s return (the micro-batch split, the check that every
rank got the same batch and the loss's broadcast included).

``--profile`` also prints, per rank, where fastdist's step went (`_Breakdown`, which wraps the
transfer methods in this benchmark's processes only, nothing in ``src``): outside the
schedule's run, the actions' compute (and torch's on the same rank), blocked in receives,
sends, posting receives ahead, waiting for the sends at the end, and the rest (the schedule's
Python bookkeeping per action).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
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
    """``(pp, schedule, m, stages per rank)`` of each row (``--quick``: one row per schedule
    at pp 2, and 1F1B at pp 4)."""
    if quick:
        return [
            (2, "gpipe", 4, 1),
            (2, "1f1b", 4, 1),
            (2, "interleaved_1f1b", 4, V),
            (4, "1f1b", 4, 1),
        ]
    out = []
    for pp in (2, 4):
        for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
            for m in (4, 8, 16):
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
    profile: bool = False,
) -> dict[str, Any] | None:
    """fastdist's side of a row, on one rank: the same model (`build_model`, same seed), split
    into the same stages (rank ``r`` holds stages ``r, r + world, ...``) by
    `fastdist.train.pipeline` over a ``fastdist.connect(pp=world)``, the same schedule and
    micro-batches, the same batch with the same (aligned) labels (``shift_labels=``), timed the
    same way as `tests.pipeline_torch_ref.torch_pipeline_step`: gradients dropped before each
    step, a barrier, the slowest rank's wall time, the first step untimed. ``busy`` is the
    compute of this rank's actions (`Pipeline.events`: each action timed after its input
    arrived); ``bubble_replay`` re-runs the schedule's timeline with each stage's measured mean
    forward and backward and free transfers (`Schedule.timeline`)."""
    import torch
    import torch.distributed as dist

    import fastdist as fd
    from tests.pipeline_torch_ref import build_model, llama_config, make_batch

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = llama_config(**config_kwargs)
    mesh = fd.connect(pp=world, timeout=600)
    pipe = fd.train.pipeline(
        build_model(config, seed),
        mesh,
        schedule=schedule,
        microbatches=microbatches,
        virtual=stages_per_rank,
    )
    ids, labels = make_batch(config, batch, seq, seed)
    walls, busys, loss = [], [], None
    per_stage: dict[tuple[str, int], list[float]] = {}
    parts: list[dict[str, float]] = []
    with _Breakdown() if profile else contextlib.nullcontext() as clock:
        for _ in range(steps):
            pipe.zero_grad()
            dist.barrier()
            if clock is not None:
                clock.reset()
            t0 = time.perf_counter()  # as torch's side: from the barrier to step's return
            loss = pipe.step(input_ids=ids, shift_labels=labels)
            walls.append(time.perf_counter() - t0)
            busys.append(sum(e.end - e.start for e in pipe.events))
            if clock is not None:
                parts.append(clock.parts(walls[-1], pipe.span, busys[-1]))
            for e in pipe.events:
                per_stage.setdefault((e.kind, e.stage), []).append(e.end - e.start)
    wall = torch.tensor(walls, dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    # every stage's mean action times, from the rank that holds it
    mine = {k: statistics.mean(v) for k, v in per_stage.items()}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    means = {k: v for d in every for k, v in d.items()}
    sched = pipe.schedule
    fwd = [means[("F", j)] for j in range(sched.stages)]
    bwd = [means[("B", j)] for j in range(sched.stages)]
    slots = sched.timeline(fwd, bwd)
    span = max(x.end for x in slots)
    replay = 1 - sum(x.end - x.start for x in slots if x.rank == rank) / span
    timed = range(1, steps) if steps > 1 else range(steps)
    last = sched.rank_of(sched.stages - 1) == rank
    return {
        "rank": rank,
        "stages": list(sched.stages_of(rank)),
        "loss": None if not last or loss is None else loss.detach(),
        "grads": {n: p.grad for n, p in pipe.named_parameters()},
        "step_s": statistics.median(float(wall[i]) for i in timed),
        "busy_s": statistics.median(busys[i] for i in timed),
        "bubble": statistics.median(1 - busys[i] / float(wall[i]) for i in timed),
        "bubble_replay": replay,
        "parts": {k: statistics.median(p[k] for p in parts[1:]) for k in parts[0]}
        if len(parts) > 1
        else None,
    }


class _Breakdown:
    """``--profile``: where a fastdist step's wall time goes on this rank, by wrapping (in this
    benchmark's processes only, for the ``with`` block) the methods of
    `fastdist.train.pipeline.transfers.Transfers` that wait or send, and the step's checks.

    ``parts``: ``before`` and ``after`` (the step outside the schedule's run: the micro-batch
    split, the batch digest all-gather, the loss broadcast), ``compute`` (the actions, from
    `Pipeline.events`), ``recv`` (blocked in receives: waiting for a peer), ``send``, ``post``
    (posting receives ahead), ``finish`` (waiting for the step's sends), ``other`` (the rest of
    the schedule's run: Python bookkeeping per action), each in ms."""

    WRAPPED = ("recv", "send", "post", "finish", "swap")

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def __enter__(self) -> _Breakdown:
        from fastdist.train.pipeline.transfers import Transfers

        self.saved = {name: getattr(Transfers, name) for name in self.WRAPPED}
        for name, fn in self.saved.items():
            setattr(Transfers, name, self._timed(name, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        from fastdist.train.pipeline.transfers import Transfers

        for name, fn in self.saved.items():
            setattr(Transfers, name, fn)

    def _timed(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t0

        return timed

    def reset(self) -> None:
        self.spent = {}

    def parts(self, wall: float, span: float, busy: float) -> dict[str, float]:
        comm = {k: self.spent.get(k, 0.0) for k in self.WRAPPED}
        out = {"wall": wall, "outside": wall - span, "compute": busy, **comm}
        out["other"] = span - busy - sum(comm.values())
        return {k: 1e3 * v for k, v in out.items()}


def rank_fn(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One rank: for each case, torch's side then fastdist's, on these processes."""
    from tests.pipeline_torch_ref import torch_pipeline_step

    out = []
    for case in cases:
        base = {k: v for k, v in case.items() if k != "profile"}
        res = {"torch": torch_pipeline_step(**base), "fastdist": fastdist_pipeline_step(**case)}
        mine, theirs = res["fastdist"], res["torch"]
        if mine is not None:  # this rank holds the same stages on both sides
            assert set(mine["grads"]) == {n for n, g in theirs["grads"].items() if g is not None}
            mine["grad_diff"] = max(
                float((g - theirs["grads"][n]).abs().max()) for n, g in mine["grads"].items()
            )
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
        "parts": [r.get("parts") for r in per_rank],
        "busy_ms": [1e3 * r["busy_s"] for r in per_rank],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--only", action="append", default=[], help="run only these rows, pp:schedule:m")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print where fastdist's step time goes on each rank (ms): outside the "
        "schedule's run, compute, receives, sends, posts, the rest",
    )
    args = p.parse_args(argv)
    only = [tuple(x.split(":")) for x in args.only]
    chosen = [r for r in rows(args.quick) if not only or (str(r[0]), r[1], str(r[2])) in only]
    load_before = os.getloadavg()
    sys.path.insert(0, str(HERE.parent))
    from benchmarks.pipeline import rank_fn as fn  # importable by the gloo processes
    from fastdist.testing import run_on_gloo
    from tests.pipeline_torch_ref import bubble_theory, llama_config, make_batch, reference

    sz = sizes(args.quick)
    steps = 3 if args.quick else 6
    table = []
    for pp in sorted({r[0] for r in chosen}):
        mine = [r for r in chosen if r[0] == pp]
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
                profile=args.profile,
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
            if fd_side is not None:
                assert abs(fd_side["loss"] - loss_ref) < 1e-9, (schedule, pp, m, loss_ref)
                diff = max(ranks[i]["fastdist"]["grad_diff"] for ranks in per_rank)
                assert diff < 1e-9, ("fastdist and torch gradients differ", schedule, pp, m, diff)
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
        f"on {os.cpu_count()} CPU cores; median of {steps - 1} steps; load average (1, 5, 15 "
        f"min) {' '.join(f'{x:.2f}' for x in load_before)} before, "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} after"
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
    if args.profile:
        _print_parts(table)
    return 0


def _print_parts(table: list[dict[str, Any]]) -> None:
    """``--profile``: fastdist's step on each rank, in ms (median over the timed steps)."""
    keys = ("wall", "outside", "compute", "recv", "send", "post", "finish", "swap", "other")
    print("\nfastdist's step per rank, ms (`_Breakdown`), and torch's compute on that rank")
    print("| schedule | pp | m | rank | " + " | ".join(keys) + " | torch compute |")
    print("|---|---|---|---|" + "---|" * (len(keys) + 1))
    for r in table:
        f = r["fastdist"]
        for rank, parts in enumerate(f["parts"] if f is not None else []):
            if parts:
                cells = " | ".join(f"{parts[k]:.1f}" for k in keys)
                theirs = r["torch"]["busy_ms"][rank]
                print(
                    f"| {r['schedule']} | {r['pp']} | {r['m']} | {rank} | {cells} | {theirs:.1f} |"
                )


if __name__ == "__main__":
    sys.exit(main())
