"""Small-object broadcast: fastdist.serving.serving.MessageQueue vs fastdist.comm.broadcast_object
over gloo, 4 processes.

    python benchmarks/mq.py            # about 30 s
    python benchmarks/mq.py --quick    # few messages (the smoke test)
    python benchmarks/mq.py --socket   # rank 3 reads over TCP (as if on another host)

Two patterns, each timed in alternating rounds (mq, gloo, mq, gloo, ...) on the same 4
processes, the baseline measured in the same run:

1. stream: rank 0 broadcasts K small objects (a scheduler step: a dict of ~20 ints) one
   after another; per-message time = (time until every rank has all K) / K.
2. round trip: rank 0 broadcasts one object and waits for every other rank's reply (the
   engine step: inputs out, outputs back). mq: a broadcaster plus single-reader queues back;
   gloo: broadcast_object then all_gather_object.

Ratios are gloo time / mq time, medians over rounds. On one host every reader uses the
shared-memory ring; ``--socket`` makes rank 3 pretend to run on another host (the node info is
built with made-up hostnames), so it reads over TCP loopback: the cross-host path.
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
from fastdist import serving

WORLD = 4


def _obj(i: int) -> dict[str, Any]:
    return {
        "step": i,
        "req_ids": list(range(i, i + 16)),
        "finished": [],
        "sampling": {"temperature": 0.7},
    }


def _stream_mq(q: serving.MessageQueue, mesh: fd.Mesh, k: int) -> float:
    fd.comm.barrier(mesh)
    t0 = time.perf_counter()
    for i in range(k):
        q.broadcast_object(_obj(i) if q.is_writer else None)
    fd.comm.barrier(mesh)  # every rank has all k
    return (time.perf_counter() - t0) / k


def _stream_gloo(mesh: fd.Mesh, k: int) -> float:
    fd.comm.barrier(mesh)
    t0 = time.perf_counter()
    for i in range(k):
        fd.comm.broadcast_object(_obj(i) if mesh.rank == 0 else None, mesh, "tp", src=0)
    fd.comm.barrier(mesh)
    return (time.perf_counter() - t0) / k


def _rtt_mq(
    q: serving.MessageQueue,
    mine: serving.MessageQueue | None,
    theirs: list[serving.MessageQueue | None],
    mesh: fd.Mesh,
    k: int,
) -> float:
    fd.comm.barrier(mesh)
    t0 = time.perf_counter()
    for i in range(k):
        if q.is_writer:
            q.enqueue(_obj(i))
            for t in theirs:
                if t is not None:
                    t.dequeue()
        else:
            step = q.dequeue()
            assert mine is not None
            mine.enqueue(step["step"])
    fd.comm.barrier(mesh)
    return (time.perf_counter() - t0) / k


def _rtt_gloo(mesh: fd.Mesh, k: int) -> float:
    fd.comm.barrier(mesh)
    t0 = time.perf_counter()
    for i in range(k):
        step = fd.comm.broadcast_object(_obj(i) if mesh.rank == 0 else None, mesh, "tp", src=0)
        fd.comm.all_gather_object(step["step"], mesh, "tp")
    fd.comm.barrier(mesh)
    return (time.perf_counter() - t0) / k


def _worker(
    rank: int, init: str, out: str, k: int, rounds: int, socket_reader: bool = False
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    mesh = fd.connect(tp=WORLD, timeout=60)
    nodes = serving.node_info(
        mesh,
        "tp",
        hostname=("host-b" if rank == WORLD - 1 else "host-a") if socket_reader else None,
    )
    q = serving.MessageQueue.create(mesh, "tp", writer=0, nodes=nodes, timeout=60)
    mine, theirs = serving.create_single_reader_mq_broadcasters(
        mesh, "tp", reader=0, nodes=nodes, timeout=60
    )
    for _ in range(2):  # warm up both
        _stream_mq(q, mesh, 20)
        _stream_gloo(mesh, 20)
        _rtt_mq(q, mine, theirs, mesh, 10)
        _rtt_gloo(mesh, 10)
    rows: dict[str, list[float]] = {
        "stream_mq": [],
        "stream_gloo": [],
        "rtt_mq": [],
        "rtt_gloo": [],
    }
    for _ in range(rounds):
        rows["stream_mq"].append(_stream_mq(q, mesh, k))
        rows["stream_gloo"].append(_stream_gloo(mesh, k))
        rows["rtt_mq"].append(_rtt_mq(q, mine, theirs, mesh, k // 2))
        rows["rtt_gloo"].append(_rtt_gloo(mesh, k // 2))
    q.close()
    for t in [mine, *theirs]:
        if t is not None:
            t.close()
    every = fd.comm.all_gather_object(rows, mesh, "tp")
    if rank == 0:
        # per round, the slowest rank's time (a broadcast is done when every rank has it)
        agg = {key: [max(e[key][i] for e in every) for i in range(rounds)] for key in rows}
        Path(out).write_text(json.dumps(agg))
    dist.barrier()
    dist.destroy_process_group()
    # exit without the interpreter's teardown: torch's native gloo threads can abort in their
    # static destructors after everything is done (SIGABRT at exit, seen in CI)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="few messages, few rounds")
    ap.add_argument(
        "--socket",
        action="store_true",
        help=f"rank {WORLD - 1} reads over TCP (as if on another host)",
    )
    ap.add_argument("--out", type=Path, default=None, help="write mq.json here")
    args = ap.parse_args(argv)
    k, rounds = (40, 2) if args.quick else (400, 7)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.json")
        mp.spawn(
            _worker,
            args=(f"file://{tmp}/store", out, k, rounds, args.socket),
            nprocs=WORLD,
            join=True,
        )  # type: ignore[attr-defined,no-untyped-call]
        agg = json.loads(Path(out).read_text())
    res = []
    for case, label in (
        ("stream", f"stream of {k} small objects, per message"),
        ("rtt", "round trip: broadcast + a reply from every reader"),
    ):
        m, g = agg[f"{case}_mq"], agg[f"{case}_gloo"]
        ratio = statistics.median(gi / mi for gi, mi in zip(g, m))
        res.append(
            {
                "case": case,
                "label": label,
                "mq_us": statistics.median(m) * 1e6,
                "gloo_us": statistics.median(g) * 1e6,
                "ratio": ratio,
            }
        )
    where = (
        f"ranks 1, 2 through shared memory, rank {WORLD - 1} over TCP"
        if args.socket
        else "every reader through shared memory"
    )
    print(
        f"4 processes ({where}), torch {torch.__version__}, {os.cpu_count()} CPU cores, "
        f"{rounds} rounds (median)"
    )
    print("| pattern | MessageQueue µs | broadcast_object (gloo) µs | gloo / mq |")
    print("|---|---|---|---|")
    for r in res:
        print(f"| {r['label']} | {r['mq_us']:.1f} | {r['gloo_us']:.1f} | {r['ratio']:.1f}x |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mq.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
