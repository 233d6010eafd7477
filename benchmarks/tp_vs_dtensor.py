"""fastdist tensor parallelism against torch DTensor's ``parallelize_module`` on the same unmodified
Hugging Face Llama, 2 gloo processes.

    python benchmarks/tp_vs_dtensor.py          # hidden 512 and 1024, 2 layers (~4 min on 2 cores)
    python benchmarks/tp_vs_dtensor.py --quick  # tiny sizes: a smoke run
    python -m benchmarks.tp_vs_dtensor          # the same, as a module from the repository root

Both sides split the same layers the same way (Megatron's tensor parallelism): q, k, v and
gate, up column-parallel, o and down row-parallel (an all-reduce after each); the norms, the
embedding and the LM head replicated. fastdist: ``fd.nn.parallelize`` with the Llama plan
minus its two vocabulary entries. DTensor: ``torch.distributed.tensor.parallel.
parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` (``use_local_output=True``:
the model's own code sees plain local tensors) and, as torch's Llama tutorial does,
``PrepareModuleInput`` on the attention and the MLP, so that q, k, v (gate, up) share one
replicated input and the backward all-reduces its gradient once: 4 all-reduces per layer on
both sides. transformers' Llama attention reshapes with ``view(..., -1, head_dim)`` and keeps
only the ratio ``num_key_value_groups`` (the same on a shard), so DTensor needs no head-count
patch.

Rows: fwd+bwd and fwd+bwd+AdamW with the vocabulary replicated on both sides; the same with
fastdist's own plan (embedding and LM head split over the vocabulary, the vocabulary-parallel
loss) against the same replicated DTensor model; fwd+bwd against DTensor with the column
and row styles alone (no ``PrepareModuleInput``: each column-parallel linear wraps its own
input, so the backward all-reduces three, then two, gradients: 7 all-reduces per layer); and
the vocabulary split on both sides: fastdist's plan against DTensor's own split as torch's
Llama tutorial makes it (the embedding ``RowwiseParallel(input_layouts=Replicate())``, the
head ``ColwiseParallel(use_local_output=False)``, the step under ``loss_parallel()`` so that
transformers' own ``F.cross_entropy`` is DTensor's vocabulary-parallel loss). ``--vocab-only``
runs those two rows alone; ``--breakdown`` adds, for each side of them, where a fwd+bwd step's CPU
goes (the products, the loss, the embedding, the collectives, views, the model's own ops, gloo's
threads, Python; per aten op under a dispatch mode, both ranks).

Before any timing, each rank checks that every model's loss (and, with the vocabulary
replicated, the embedding's gradient, which every layer's backward reaches) equals the
single-device model's on the same batch to 1e-4 (float32). A step is forward with labels and
backward (``+AdamW``: then ``optimizer.step()``); after warm-up the two sides alternate step by
step (the order swapping every pair), each step after a barrier; a step's time is its slowest
rank's, and the ratio is the median of the per-pair ratios fastdist / DTensor, both measured in
this run. The CPU columns add up both ranks' process CPU time of each step (every thread): on
cores shared with other jobs the wall time also holds the time slices the OS gave them, the CPU
time does not. The matmul-floor columns time the step's products alone (each linear's forward
and its two backward products, one thread, the shapes of a rank's shard) before the ranks start:
what neither side can go below without less arithmetic. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import fastdist as fd
from fastdist.testing import run_on_gloo

HERE = Path(__file__).resolve().parent
WORLD = 2

# (hidden, intermediate, heads, kv heads, layers, vocabulary, batch, sequence)
SIZES = {
    "quick": (64, 128, 4, 2, 1, 256, 2, 16),
    "512": (512, 1408, 8, 4, 2, 8192, 4, 128),
    "1024": (1024, 2816, 16, 4, 2, 8192, 2, 256),
}


def _llama(size: tuple[int, ...]) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, heads, kv, layers, vocab, _, _ = size
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=1024,
    )
    return LlamaForCausalLM(cfg)


def _dtensor(model: Any, mesh: Any, prepare_inputs: bool) -> Any:
    """``model`` made tensor parallel with torch's DTensor styles, vocabulary replicated.

    ``prepare_inputs``: the attention's and the MLP's input become a replicated DTensor once
    (``PrepareModuleInput``, as torch's Llama tutorial does), so q, k, v (gate, up) share it and
    the backward all-reduces its gradient once, as fastdist does. Without it each column-parallel
    linear wraps its own input, and the backward all-reduces three (two) gradients."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {
        f"model.layers.*.{name}": style()
        for style, names in (
            (ColwiseParallel, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            (ColwiseParallel, ("mlp.gate_proj", "mlp.up_proj")),
            (RowwiseParallel, ("self_attn.o_proj", "mlp.down_proj")),
        )
        for name in names
    }
    if prepare_inputs:
        plan["model.layers.*.self_attn"] = PrepareModuleInput(  # called with hidden_states=
            input_kwarg_layouts={"hidden_states": Replicate()},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        )
        plan["model.layers.*.mlp"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
        )
    return parallelize_module(model, mesh, plan)


def _dtensor_vocab(model: Any, mesh: Any) -> Any:
    """``model`` as `_dtensor` makes it, plus the vocabulary split as torch's Llama tutorial splits
    it: the embedding ``RowwiseParallel(input_layouts=Replicate())`` (an all-reduce of its output)
    and the LM head ``ColwiseParallel(use_local_output=False)``: the logits stay a DTensor
    sharded over the vocabulary, and the step runs under ``loss_parallel()`` so that transformers'
    own ``F.cross_entropy`` on them is DTensor's vocabulary-parallel loss."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = _dtensor(model, mesh, prepare_inputs=True)
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(use_local_output=False),
    }
    return parallelize_module(model, mesh, plan)


def _fastdist(model: Any, vocab_parallel: bool) -> Any:
    mesh = fd.connect(tp=WORLD, timeout=120)
    plan = fd.nn.plans.plan(model, family="llama")
    if not vocab_parallel:  # the embedding and the head stay replicated, as on the DTensor side
        del plan["model.embed_tokens"], plan["lm_head"]
    return fd.nn.parallelize(model, mesh, plan)


def _step(
    model: Any, ids: torch.Tensor, opt: torch.optim.Optimizer | None, loss_parallel: bool
) -> Callable[[], None]:
    from torch.distributed.tensor.parallel import loss_parallel as lp

    def run() -> None:
        with lp() if loss_parallel else contextlib.nullcontext():  # forward and backward in it
            model(input_ids=ids, labels=ids).loss.backward()
        if opt is not None:
            opt.step()
        _zero_grad(model)

    return run


def _zero_grad(model: Any) -> None:
    for p in model.parameters():
        p.grad = None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _check(one: Any, sides: dict[str, Any], ids: torch.Tensor) -> dict[str, float]:
    """The largest loss (and replicated embedding-gradient) difference of each side against one
    device; raises above the float32 tolerance."""
    ref = one(input_ids=ids, labels=ids).loss
    ref.backward()
    ref_g = one.model.embed_tokens.weight.grad
    one.zero_grad(set_to_none=True)
    diffs = {}
    for name, m in sides.items():
        with _loss_ctx(name):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
        loss = _local(loss.detach())  # DTensor's loss_parallel: a replicated DTensor
        d = abs(loss.item() - ref.item())
        if name not in VOCAB:  # a vocabulary shard: the loss alone
            g = _local(getattr(m, "module", m).model.embed_tokens.weight.grad)
            d = max(d, (g - ref_g).abs().max().item())
        _zero_grad(m)
        if not d < 1e-4:
            raise AssertionError(
                f"rank {dist.get_rank()}: {name} differs from one device by {d:.3g} "
                f"(loss {loss.item():.6f}, one device {ref.item():.6f})"
            )
        diffs[name] = d
    return diffs


def _loss_ctx(name: str) -> Any:
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if name == "dtensor_vocab" else contextlib.nullcontext()


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall, CPU) seconds of one step on this rank; CPU: this process's, all its threads."""
    dist.barrier()  # both ranks start together; a step's time is then its slowest rank's
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


# (fastdist side, DTensor side, with AdamW): the pairs timed, one row each
PAIRS = (
    ("fastdist", "dtensor", False),
    ("fastdist", "dtensor", True),
    ("fastdist_vocab", "dtensor", False),
    ("fastdist_vocab", "dtensor", True),
    ("fastdist", "dtensor_per_linear", False),
    ("fastdist_vocab", "dtensor_vocab", False),
    ("fastdist_vocab", "dtensor_vocab", True),
)
VOCAB = ("fastdist_vocab", "dtensor_vocab")  # sides whose embedding holds a vocabulary shard
CASES = {
    "fastdist": "vocabulary replicated",
    "fastdist_vocab": "fastdist vocabulary-parallel, DTensor replicated",
    "dtensor_vocab": "vocabulary-parallel on both sides (DTensor: loss_parallel)",
    "dtensor_per_linear": "vocabulary replicated, DTensor without PrepareModuleInput",
}


# what each aten op of a step is, for --breakdown: the first rule that matches names it
LOSS_OPS = ("log_softmax", "nll_loss", "check_targets", "all_gather", "scatter_add", "gather")
VIEW_OPS = ("view", ".t.", "transpose", "slice.Tensor", "detach", "unsqueeze", "expand", "alias")


def _category(op: str, shapes: tuple[tuple[int, ...], ...], vocab_cols: set[int]) -> str:
    """The part of a step an aten op belongs to: the products, the loss (an op on logits-wide
    tensors, or a loss op), the embedding, the collectives (and fastdist's clone before gloo's
    in-place all-reduce), shape and view metadata, or the model's own ops (norms, rotary,
    attention, SiLU, residuals: the same on both sides)."""
    if op == "aten.mm.default":
        return "products (mm)"
    if any(k in op for k in LOSS_OPS) or any(s and s[-1] in vocab_cols for s in shapes):
        return "loss"
    if "embedding" in op or "index_put" in op:
        return "embedding"
    if "c10d" in op:
        return "collectives"
    if op == "aten.clone.default":
        return "clones (collectives)"
    if any(k in op for k in VIEW_OPS):
        return "views, metadata"
    return "model's own ops"


class _OpClock(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The calling thread's CPU time inside each aten op, summed by `_category`. On DTensor's side
    the mode sees the DTensor-level op, so its dispatch (placement propagation, redistribution)
    counts with the op."""

    def __init__(self, vocab_cols: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.vocab_cols, self.cpu = vocab_cols, collections.defaultdict[str, float](float)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        c0 = time.thread_time()
        out = func(*args, **(kwargs or {}))
        spent = time.thread_time() - c0
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.cpu[_category(str(func), shapes, self.vocab_cols)] += spent
        return out


def _breakdown(step: Callable[[], None], reps: int, vocab_cols: set[int]) -> dict[str, float]:
    """CPU seconds of one step of this rank, by part: the process, the calling thread, the other
    threads (gloo's), each `_category` (``reps`` more steps under `_OpClock`) and what the
    calling thread spends outside aten ops (Python, autograd, hooks)."""
    proc, main = [], []
    for _ in range(reps):
        dist.barrier()
        p0, t0 = time.process_time(), time.thread_time()
        step()
        proc.append(time.process_time() - p0)
        main.append(time.thread_time() - t0)
    clock = _OpClock(vocab_cols)
    for _ in range(reps):
        dist.barrier()
        with clock:
            step()
    parts = {k: v / reps for k, v in clock.cpu.items()}
    p, m = statistics.median(proc), statistics.median(main)
    return {
        "step (process)": p,
        "other threads (gloo)": p - m,
        **parts,
        "outside aten ops (Python, autograd)": m - sum(parts.values()),
    }


def _rank(
    size: tuple[int, ...],
    reps: int,
    warmup: int,
    pairs: tuple[tuple[str, str, bool], ...],
    breakdown: bool = False,
) -> dict[str, Any]:
    """One rank: build the single-device model and the parallel copies, check them, time the
    pairs (and with ``breakdown`` each vocabulary-split side's step by part, `_breakdown`).
    Returns the differences against one device, this rank's step times (seconds) and the
    breakdowns."""
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore", UserWarning)
    *_, vocab, batch, seq = size
    one = _llama(size)
    dmesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    sides = {
        "fastdist": _fastdist(copy.deepcopy(one), vocab_parallel=False),
        "fastdist_vocab": _fastdist(copy.deepcopy(one), vocab_parallel=True),
        "dtensor": _dtensor(copy.deepcopy(one), dmesh, prepare_inputs=True),
        "dtensor_per_linear": _dtensor(copy.deepcopy(one), dmesh, prepare_inputs=False),
        "dtensor_vocab": _dtensor_vocab(copy.deepcopy(one), dmesh),
    }
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    diffs = _check(one, sides, ids)
    del one
    steps = {
        (k, adamw): _step(
            m,
            ids,
            torch.optim.AdamW(m.parameters(), lr=1e-4) if adamw else None,
            loss_parallel=k == "dtensor_vocab",
        )
        for k, m in sides.items()
        for adamw in (False, True)
    }
    times = []
    for fast, base, adamw in pairs:
        pair = (steps[fast, adamw], steps[base, adamw])
        for _ in range(warmup):
            for f in pair:
                f()
        got: tuple[list[tuple[float, float]], list[tuple[float, float]]] = ([], [])
        for i in range(reps):
            for j in (0, 1) if i % 2 == 0 else (1, 0):  # A B, B A, ...: neither always first
                got[j].append(_timed(pair[j]))
        times.append(got)
    parts = {}
    if breakdown:  # the logits' last dims: each side's vocabulary shard and the whole vocabulary
        cols = {vocab, vocab // WORLD}
        parts = {k: _breakdown(steps[k, False], reps, cols) for k in VOCAB}
    dist.barrier()  # every collective done on both ranks before either tears down
    return {"diffs": diffs, "times": times, "breakdown": parts}


def _matmul_floor(size: tuple[int, ...], vocab_split: bool, reps: int = 3) -> float:
    """CPU seconds, both ranks together, of one step's products alone on one thread: for every
    linear of a rank's shard (q, k, v, o, gate, up, down of each layer; the LM head, its
    vocabulary halved when split) the forward ``x @ W.t()`` and the backward's ``g @ W`` and
    ``g.t() @ x`` on random float32 tensors of the step's shapes (median of ``reps``). What a step
    of either side cannot go below without doing less arithmetic: the rest of a step is the
    model's elementwise ops, attention, the collectives and the framework's own work."""
    hidden, inter, heads, kv, layers, vocab, batch, seq = size
    head_dim, tokens = hidden // heads, batch * seq
    linears = [
        (hidden, heads * head_dim // WORLD),
        (hidden, kv * head_dim // WORLD),
        (hidden, kv * head_dim // WORLD),
        (heads * head_dim // WORLD, hidden),
        (hidden, inter // WORLD),
        (hidden, inter // WORLD),
        (inter // WORLD, hidden),
    ] * layers + [(hidden, vocab // WORLD if vocab_split else vocab)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        total = 0.0
        for n_in, n_out in linears:
            x, w = torch.randn(tokens, n_in), torch.randn(n_out, n_in)
            g = torch.randn(tokens, n_out)
            for lhs, rhs in ((x, w.t()), (g, w), (g.t(), x)):  # forward, input and weight grads
                torch.mm(lhs, rhs)  # warm
                times = []
                for _ in range(reps):
                    c0 = time.process_time()
                    torch.mm(lhs, rhs)
                    times.append(time.process_time() - c0)
                total += statistics.median(times)
    finally:
        torch.set_num_threads(threads)
    return total * WORLD


def bench(
    quick: bool, vocab_only: bool = False, reps_full: int = 11, breakdown: bool = False
) -> list[dict[str, Any]]:
    rows = []
    pairs = tuple(p for p in PAIRS if p[1] == "dtensor_vocab" or not vocab_only)
    for name in ("quick",) if quick else ("512", "1024"):
        size = SIZES[name]
        reps, warmup = (3, 1) if quick else (reps_full, 2)
        # each rank forks from one server that imported these once (not a fresh interpreter)
        mp.set_forkserver_preload(["torch", "fastdist", "transformers"])
        per_rank = run_on_gloo(
            _rank,
            WORLD,
            size,
            reps,
            warmup,
            pairs,
            breakdown,
            start_method="forkserver",
            timeout=1800,
        )
        floors = {split: _matmul_floor(size, split) for split in (False, True)}
        hidden, inter, heads, kv, layers, vocab, batch, seq = size
        for n, (fast, base, adamw) in enumerate(pairs):
            # a step is over when its slowest rank is; its CPU time is both ranks' together
            f, d = (
                [max(r["times"][n][side][i][0] for r in per_rank) for i in range(reps)]
                for side in (0, 1)
            )
            fc, dc = (
                [sum(r["times"][n][side][i][1] for r in per_rank) for i in range(reps)]
                for side in (0, 1)
            )
            rows.append(
                {
                    "case": f"fwd+bwd{'+AdamW' if adamw else ''}, "
                    + CASES[base if base != "dtensor" else fast],
                    "load_average": list(os.getloadavg()),
                    "hidden": hidden,
                    "intermediate": inter,
                    "heads": f"{heads}/{kv}",
                    "layers": layers,
                    "vocab": vocab,
                    "tokens": f"{batch}x{seq}",
                    "fastdist_ms": statistics.median(f) * 1e3,
                    "dtensor_ms": statistics.median(d) * 1e3,
                    "ratio": statistics.median(a / b for a, b in zip(f, d)),
                    "fastdist_cpu_ms": statistics.median(fc) * 1e3,
                    "dtensor_cpu_ms": statistics.median(dc) * 1e3,
                    "cpu_ratio": statistics.median(a / b for a, b in zip(fc, dc)),
                    "fastdist_floor_cpu_ms": floors[fast in VOCAB] * 1e3,
                    "dtensor_floor_cpu_ms": floors[base in VOCAB] * 1e3,
                    "fastdist_diff": max(r["diffs"][fast] for r in per_rank),
                    "dtensor_diff": max(r["diffs"][base] for r in per_rank),
                }
            )
            if breakdown and (fast, base, adamw) == ("fastdist_vocab", "dtensor_vocab", False):
                rows[-1]["breakdown_cpu_ms"] = {  # both ranks together, per step
                    side: {
                        k: sum(r["breakdown"][side].get(k, 0.0) for r in per_rank) * 1e3
                        for k in per_rank[0]["breakdown"][side]
                    }
                    for side in VOCAB
                }
    return rows


def _breakdown_lines(rows: list[dict[str, Any]]) -> list[str]:
    """A markdown table per size of the rows' ``breakdown_cpu_ms`` (none without --breakdown)."""
    lines = []
    for r in rows:
        if "breakdown_cpu_ms" not in r:
            continue
        f, d = r["breakdown_cpu_ms"]["fastdist_vocab"], r["breakdown_cpu_ms"]["dtensor_vocab"]
        lines += [
            "",
            f"hidden {r['hidden']}, vocabulary split on both sides, fwd+bwd: CPU ms per step, "
            "both ranks",
            "",
            "| part | fastdist | DTensor (loss_parallel) |",
            "|---|---|---|",
        ]
        lines += [
            f"| {k} | {f.get(k, 0.0):.1f} | {d.get(k, 0.0):.1f} |" for k in dict.fromkeys([*f, *d])
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument(
        "--vocab-only",
        action="store_true",
        help="only the rows with the vocabulary split on both sides (DTensor's loss_parallel)",
    )
    ap.add_argument("--reps", type=int, default=11, help="timed pairs per row (default 11)")
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="also each vocabulary-split side's step by part (CPU per aten op, both ranks)",
    )
    args = ap.parse_args(argv)
    print(f"load average before: {os.getloadavg()}")
    rows = bench(args.quick, args.vocab_only, args.reps, args.breakdown)
    print(f"load average after: {os.getloadavg()}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tp_vs_dtensor.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "| case | hidden | layers | tokens | fastdist ms | DTensor ms | fastdist / DTensor | "
        "CPU ms, both ranks (fastdist / DTensor) | CPU fastdist / DTensor | "
        "matmul floor, CPU ms both ranks (fastdist / DTensor) | "
        "diff vs one device (fastdist / DTensor) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['case']} | {r['hidden']} | {r['layers']} | {r['tokens']} | "
        f"{r['fastdist_ms']:.1f} | {r['dtensor_ms']:.1f} | {r['ratio']:.3f} | "
        f"{r['fastdist_cpu_ms']:.1f} / {r['dtensor_cpu_ms']:.1f} | {r['cpu_ratio']:.3f} | "
        f"{r['fastdist_floor_cpu_ms']:.1f} / {r['dtensor_floor_cpu_ms']:.1f} | "
        f"{r['fastdist_diff']:.0e} / {r['dtensor_diff']:.0e} |"
        for r in rows
    ]
    lines += _breakdown_lines(rows)
    (args.out / "tp_vs_dtensor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
