"""Pipeline parallelism on gloo processes: torch.distributed.pipelining's schedules on an HF Llama,
step time and the measured bubble against the schedule's theoretical one (issue 34, point 4).

    python benchmarks/pipeline.py            # pp 2 and 4; GPipe, 1F1B, interleaved 1F1B; m 4, 8, 16
    python benchmarks/pipeline.py --quick    # tiny sizes: each schedule at pp 2, 1F1B at pp 4; m 4
    python benchmarks/pipeline.py --only 4:1f1b:8   # one row (pp:schedule:m), repeatable
    python benchmarks/pipeline.py --only 4:1f1b:8 --profile  # and where fastdist's step goes

Each row: the same float64 model (tests/pipeline_torch_ref.py: `llama_config`, seed 0) split
into ``pp`` stages (``pp * v`` for interleaved, ``v = 2``) by layer index, one micro-batch of
``MB`` sequences, ``m`` micro-batches per step; torch's side (``torch.distributed.pipelining``:
the stages of `tests.pipeline_torch_ref.split_llama` in ``PipelineStage`` s with static
metadata, the schedule with the loss on every rank) and fastdist's (`fastdist.train.pipeline`
on a ``fastdist.connect(pp=world)``, the same stages: rank ``r`` holds stages ``r, r + world,
...``) built on the same processes. Both losses must equal the one-device reference (1e-9) and
each rank's gradients on the two sides each other (1e-9).

Timing, paired (`paired_case`): the two sides' steps alternate (torch then fastdist, then
fastdist then torch, ...), ``--steps`` timed pairs (default 10) after one untimed pair, each
step from a barrier to the slowest rank's return (the step's ``step()``: for fastdist the
micro-batch split, the batch check and the loss reaching every rank included). A step of one
side and the next of the other share the machine's load of that moment, so the table's
``fastdist / torch`` is the median of the per-pair ratios (with their quartiles), not a ratio of
medians; the step columns are medians. CPU: each rank's main-thread CPU time per step
(``time.thread_time``, which a blocked wait does not advance), summed over the ranks, the median
and the median of the paired ratios: what each side computes and spends on bookkeeping,
whatever else runs on the machine.

Bubble, measured: ``1 - busy / step`` per rank, where ``busy`` is the wall time the rank spends
in the stages' compute: torch's actions (``forward_one_chunk``, ``backward_one_chunk``) and the
loss (`tests.pipeline_torch_ref.StageTimer`), fastdist's `Pipeline.events` (each action's
compute, after its input arrived); the rest is waiting for a peer plus communication and
bookkeeping. The table gives the mean over ranks (and torch's range). Replayed: the same
step's actions with their measured durations re-run with free communication (torch:
`tests.pipeline_torch_ref.replay_bubble`; fastdist: `Schedule.timeline` with each stage's mean
forward and backward): the bubble the schedule leaves given the stages' real (unequal) times.
Theory: ``(pp - 1) / (m + pp - 1)`` for GPipe and 1F1B, ``(pp - 1) / (v m + pp - 1)`` for
interleaved 1F1B, which assumes equal stages and free communication (and, with more processes
than cores, no time given to the other ranks).

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
import multiprocessing as mp
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


def _torch_side(config: Any, case: dict[str, Any]) -> dict[str, Any]:
    """torch's side of a row on this rank: `tests.pipeline_torch_ref`'s model and stages
    (``split_llama``; rank ``r`` holds stages ``r, r + world, ...``) in torch's
    ``PipelineStage`` with static metadata (examples that require grad, as
    `tests.pipeline_torch_ref.torch_pipeline_step` makes them), its schedule with the loss on
    every rank, a `StageTimer`; ``run()`` is one step (gradients dropped first)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    from tests.pipeline_torch_ref import (
        SCHEDULES,
        StageTimer,
        build_model,
        lm_loss,
        make_batch,
        split_llama,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    v, m, seq = case["stages_per_rank"], case["microbatches"], case["seq"]
    mb = case["batch"] // m
    model = build_model(config, case["seed"])
    n_stages = world * v
    modules = split_llama(model, n_stages)
    mine = list(range(rank, n_stages, world))
    stages = []
    for j in mine:
        x = (
            torch.zeros(mb, seq, dtype=torch.long)
            if j == 0
            else torch.zeros(mb, seq, config.hidden_size, dtype=torch.float64, requires_grad=True)
        )
        width = config.vocab_size if j == n_stages - 1 else config.hidden_size
        y = torch.zeros(mb, seq, width, dtype=torch.float64, requires_grad=True)
        stages.append(
            pipelining.PipelineStage(
                modules[j], j, n_stages, torch.device("cpu"), input_args=x, output_args=y
            )
        )
    timer = StageTimer(stages)
    cls_name, needs = SCHEDULES[case["schedule"]]
    sched = getattr(pipelining, cls_name)(
        stages if needs is None else stages[0], m, loss_fn=timer.wrap_loss(lm_loss)
    )
    ids, labels = make_batch(config, case["batch"], seq, case["seed"])
    has_first, has_last = 0 in mine, n_stages - 1 in mine
    side: dict[str, Any] = {"timer": timer, "loss": None, "mine": mine}

    def run() -> None:
        model.zero_grad(set_to_none=True)
        losses: list[Any] = []
        timer.reset()
        sched.step(
            *((ids,) if has_first else ()),
            **({"target": labels, "losses": losses} if has_last else {}),
        )
        if has_last:
            side["loss"] = torch.stack(losses).mean().detach()

    def grads() -> dict[str, Any]:
        return {
            modules[j].hf_names[n]: None if p.grad is None else p.grad.detach().clone()
            for j in mine
            for n, p in modules[j].named_parameters()
        }

    side.update(run=run, grads=grads)
    return side


def _fastdist_side(config: Any, case: dict[str, Any]) -> dict[str, Any]:
    """fastdist's side of a row on this rank: the same model (`build_model`, same seed), split
    into the same stages by `fastdist.train.pipeline` over a ``fastdist.connect(pp=world)``,
    the same schedule, micro-batches and batch with the same (aligned) labels
    (``shift_labels=``); ``run()`` is one step (gradients dropped first)."""
    import torch.distributed as dist

    import fastdist as fd
    from tests.pipeline_torch_ref import build_model, make_batch

    mesh = fd.connect(pp=dist.get_world_size(), timeout=600)
    pipe = fd.train.pipeline(
        build_model(config, case["seed"]),
        mesh,
        schedule=case["schedule"],
        microbatches=case["microbatches"],
        virtual=case["stages_per_rank"],
    )
    ids, labels = make_batch(config, case["batch"], case["seq"], case["seed"])
    side: dict[str, Any] = {"pipe": pipe, "loss": None}

    def run() -> None:
        pipe.zero_grad()
        side["loss"] = pipe.step(input_ids=ids, shift_labels=labels)

    side["run"] = run
    return side


def paired_case(
    config_kwargs: dict[str, Any],
    schedule: str,
    microbatches: int,
    seed: int,
    batch: int,
    seq: int,
    stages_per_rank: int = 1,
    steps: int = 10,
    profile: bool = False,
) -> dict[str, Any]:
    """One row on this rank: torch's and fastdist's steps alternated on the same processes
    (``steps + 1`` of each; pair ``i`` is torch's ``i``-th step and fastdist's, run back to
    back, torch first in even pairs; the first pair, which infers shapes, is not timed), each
    timed from a barrier to the slowest rank's return (``walls``), with this rank's CPU time
    (``cpu``: the main thread's, which a blocked wait does not advance; ``proc``: the process's,
    with c10d's and gloo's threads) and its busy time (the stages' compute: `StageTimer` for
    torch, `Pipeline.events` for fastdist). Returns ``{"torch": ..., "fastdist": ...}``: per
    side the lists, the medians (``step_s``, ``busy_s``, ``bubble``), the replayed bubble, the
    loss (last stage's rank, else None) and this rank's gradients after the last step."""
    import torch
    import torch.distributed as dist

    from tests.pipeline_torch_ref import llama_config, replay_bubble

    torch.set_num_threads(1)
    case = dict(
        schedule=schedule,
        microbatches=microbatches,
        seed=seed,
        batch=batch,
        seq=seq,
        stages_per_rank=stages_per_rank,
    )
    config = llama_config(**config_kwargs)
    sides = {"torch": _torch_side(config, case), "fastdist": _fastdist_side(config, case)}
    pipe = sides["fastdist"]["pipe"]
    rec: dict[str, dict[str, list[Any]]] = {
        k: {"walls": [], "cpu": [], "proc": [], "busy": [], "actions": [], "parts": []}
        for k in sides
    }
    with _Breakdown() if profile else contextlib.nullcontext() as clock:
        for i in range(steps + 1):
            for name in ("torch", "fastdist") if i % 2 == 0 else ("fastdist", "torch"):
                dist.barrier()
                if clock is not None:
                    clock.reset()
                c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
                sides[name]["run"]()
                wall = time.perf_counter() - t0
                r = rec[name]
                r["walls"].append(wall)
                r["cpu"].append(time.thread_time() - c0)
                r["proc"].append(time.process_time() - p0)
                if name == "torch":
                    timer = sides["torch"]["timer"]
                    r["busy"].append(timer.busy)
                    r["actions"].append(list(timer.actions))
                else:
                    r["busy"].append(sum(e.end - e.start for e in pipe.events))
                    r["actions"].append([(e.kind, e.stage, e.end - e.start) for e in pipe.events])
                    if clock is not None:
                        r["parts"].append(clock.parts(wall, pipe.span, r["busy"][-1]))
    out: dict[str, Any] = {}
    timed = range(1, steps + 1)
    for name, r in rec.items():
        wall = torch.tensor(r["walls"], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slowest rank's
        walls = [float(wall[i]) for i in timed]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, r["actions"])
        if name == "torch":
            replay = [replay_bubble([a[i] for a in every])[dist.get_rank()] for i in timed]
        else:
            replay = [_fastdist_replay(pipe, [a[i] for a in every]) for i in timed]
        busy = [r["busy"][i] for i in timed]
        side = sides[name]
        out[name] = {
            "rank": dist.get_rank(),
            "loss": side["loss"] if side["loss"] is not None else None,
            "walls": walls,
            "cpu": [r["cpu"][i] for i in timed],
            "proc": [r["proc"][i] for i in timed],
            "step_s": statistics.median(walls),
            "busy_s": statistics.median(busy),
            "bubble": statistics.median(1 - b / w for b, w in zip(busy, walls)),
            "bubble_replay": statistics.median(replay),
            "parts": _median_step(r["parts"][1:]) if len(r["parts"]) > 1 else None,
        }
    last = pipe.schedule.rank_of(pipe.schedule.stages - 1) == dist.get_rank()
    if not last:
        out["fastdist"]["loss"] = None
    out["torch"]["grads"] = sides["torch"]["grads"]()
    out["fastdist"]["grads"] = {n: p.grad for n, p in pipe.named_parameters()}
    return out


def _fastdist_replay(pipe: Any, every: list[list[tuple[str, int, float]]]) -> float:
    """This rank's bubble when the schedule's timeline re-runs with each stage's mean forward
    and backward of the step (``every[rank]``: that rank's ``(kind, stage, seconds)``) and
    free transfers (`Schedule.timeline`)."""
    import torch.distributed as dist

    per: dict[tuple[str, int], list[float]] = {}
    for acts in every:
        for kind, stage, dt in acts:
            per.setdefault((kind, stage), []).append(dt)
    sched = pipe.schedule
    fwd = [statistics.mean(per[("F", j)]) for j in range(sched.stages)]
    bwd = [statistics.mean(per[("B", j)]) for j in range(sched.stages)]
    slots = sched.timeline(fwd, bwd)
    span = max(x.end for x in slots)
    rank = dist.get_rank()
    return 1 - sum(x.end - x.start for x in slots if x.rank == rank) / span


def _median_step(parts: list[dict[str, float]]) -> dict[str, float]:
    """The parts of the step whose wall time is the median of the timed steps': one step's, so
    they add up to its wall (a median per part would not: medians do not add)."""
    by_wall = sorted(parts, key=lambda p: p["wall"])
    return by_wall[(len(by_wall) - 1) // 2]


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
    """One rank: `paired_case` for each case, on these processes; fastdist's gradients compared
    with torch's here (the largest difference), the gradients not sent back."""
    out = []
    for case in cases:
        res = paired_case(**case)
        mine, theirs = res["fastdist"], res["torch"]
        assert set(mine["grads"]) == {n for n, g in theirs["grads"].items() if g is not None}
        mine["grad_diff"] = max(
            float((g - theirs["grads"][n]).abs().max()) for n, g in mine["grads"].items()
        )
        for side in res.values():  # gradients are checked by tests/test_pipeline_torch.py
            side.pop("grads", None)
        out.append(res)
    return out


def _summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One side of a row over the ranks: step ms, the mean bubble and its range, the loss, the
    per-step walls (the slowest rank's) and CPU (summed over the ranks)."""
    bubbles = [r["bubble"] for r in per_rank]
    (loss,) = [float(r["loss"]) for r in per_rank if r["loss"] is not None]
    n = len(per_rank[0]["walls"])
    return {
        "step_ms": 1e3 * per_rank[0]["step_s"],  # the slowest rank's: the same on every rank
        "bubble": statistics.mean(bubbles),
        "bubble_min": min(bubbles),
        "bubble_max": max(bubbles),
        "bubble_replay": statistics.mean(r["bubble_replay"] for r in per_rank),
        "loss": loss,
        "parts": [r.get("parts") for r in per_rank],
        "busy_ms": [1e3 * r["busy_s"] for r in per_rank],
        "walls_ms": [1e3 * w for w in per_rank[0]["walls"]],
        "cpu_ms": [1e3 * sum(r["cpu"][i] for r in per_rank) for i in range(n)],
        "proc_ms": [1e3 * sum(r["proc"][i] for r in per_rank) for i in range(n)],
    }


def _paired(mine: list[float], theirs: list[float]) -> tuple[float, float, float]:
    """The median and the quartiles of the per-step ratios ``mine[i] / theirs[i]``."""
    ratios = sorted(a / b for a, b in zip(mine, theirs))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return statistics.median(ratios), q[0], q[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--only", action="append", default=[], help="run only these rows, pp:schedule:m")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps (pairs) per side and row (default 10; --quick 3)",
    )
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
    steps = args.steps or (3 if args.quick else 10)
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
        # each rank forks from one server that imported these once (not a fresh interpreter)
        mp.set_forkserver_preload(["torch", "fastdist"])
        per_rank = run_on_gloo(fn, pp, cases, start_method="forkserver", timeout=1800)
        for i, ((_, schedule, m, v), case) in enumerate(zip(mine, cases)):
            torch_side = _summary([ranks[i]["torch"] for ranks in per_rank])
            fd_side = _summary([ranks[i]["fastdist"] for ranks in per_rank])
            config = llama_config(**sz["config"])
            ids, labels = make_batch(config, case["batch"], sz["seq"], SEED)
            loss_ref = float(reference(config, ids, labels, SEED)[0])
            assert abs(torch_side["loss"] - loss_ref) < 1e-9, (schedule, pp, m, loss_ref)
            assert abs(fd_side["loss"] - loss_ref) < 1e-9, (schedule, pp, m, loss_ref)
            diff = max(ranks[i]["fastdist"]["grad_diff"] for ranks in per_rank)
            assert diff < 1e-9, ("fastdist and torch gradients differ", schedule, pp, m, diff)
            ratio, q1, q3 = _paired(fd_side["walls_ms"], torch_side["walls_ms"])
            cpu, c1, c3 = _paired(fd_side["cpu_ms"], torch_side["cpu_ms"])
            table.append(
                {
                    "schedule": schedule if v == 1 else f"{schedule} (v={v})",
                    "pp": pp,
                    "m": m,
                    "torch": torch_side,
                    "fastdist": fd_side,
                    "bubble_theory": bubble_theory(schedule, pp, m, v),
                    "ratio": ratio,  # median of the per-step paired ratios of wall time
                    "ratio_quartiles": [q1, q3],
                    "cpu_ratio": cpu,  # the same of the main threads' CPU, summed over ranks
                    "cpu_ratio_quartiles": [c1, c3],
                }
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline.json").write_text(json.dumps(table, indent=2))
    _print_table(table, sz, steps, load_before)
    if args.profile:
        _print_parts(table)
    return 0


def _print_table(
    table: list[dict[str, Any]], sz: dict[str, Any], steps: int, load_before: tuple[float, ...]
) -> None:
    """The main table: one row per case (the first block of the output, before a blank line)."""
    c = sz["config"]
    print(
        f"HF Llama, float64, hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
        f"vocab {c['vocab_size']}; micro-batch {sz['mb']} x {sz['seq']} tokens; gloo processes "
        f"on {os.cpu_count()} CPU cores; {steps} timed steps per side, torch's and fastdist's "
        f"alternated; load average (1, 5, 15 min) {' '.join(f'{x:.2f}' for x in load_before)} "
        f"before, {' '.join(f'{x:.2f}' for x in os.getloadavg())} after"
    )
    print(
        "| schedule | pp | m | torch step ms | bubble measured (range over ranks) | "
        "bubble replayed, free comm | bubble theory | fastdist step ms | fastdist / torch "
        "(quartiles) | fastdist bubble (replayed) | CPU ms torch / fastdist | CPU fastdist / "
        "torch (quartiles) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        t, f = r["torch"], r["fastdist"]
        q, cq = r["ratio_quartiles"], r["cpu_ratio_quartiles"]
        cpu_t, cpu_f = statistics.median(t["cpu_ms"]), statistics.median(f["cpu_ms"])
        print(
            f"| {r['schedule']} | {r['pp']} | {r['m']} | {t['step_ms']:.1f} | "
            f"{t['bubble']:.3f} ({t['bubble_min']:.3f}–{t['bubble_max']:.3f}) | "
            f"{t['bubble_replay']:.3f} | {r['bubble_theory']:.3f} | {f['step_ms']:.1f} | "
            f"{r['ratio']:.2f} ({q[0]:.2f}–{q[1]:.2f}) | {f['bubble']:.3f} "
            f"({f['bubble_replay']:.3f}) | {cpu_t:.0f} / {cpu_f:.0f} | {r['cpu_ratio']:.2f} "
            f"({cq[0]:.2f}–{cq[1]:.2f}) |"
        )


def _print_parts(table: list[dict[str, Any]]) -> None:
    """``--profile``: fastdist's step on each rank, in ms (median over the timed steps)."""
    keys = ("wall", "outside", "compute", "recv", "send", "post", "finish", "swap", "other")
    print("\nfastdist's step per rank, ms (`_Breakdown`), and torch's compute on that rank")
    print("| schedule | pp | m | rank | " + " | ".join(keys) + " | torch compute |")
    print("|---|---|---|---|" + "---|" * (len(keys) + 1))
    for r in table:
        for rank, parts in enumerate(r["fastdist"]["parts"]):
            if parts:
                cells = " | ".join(f"{parts[k]:.1f}" for k in keys)
                theirs = r["torch"]["busy_ms"][rank]
                print(
                    f"| {r['schedule']} | {r['pp']} | {r['m']} | {rank} | {cells} | {theirs:.1f} |"
                )


if __name__ == "__main__":
    sys.exit(main())
