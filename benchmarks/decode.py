"""Decode throughput of a tensor-parallel Hugging Face Llama on gloo processes against the same
model on one device, measured in the same run; and the share of a step spent in fastdist's own
code.

    python benchmarks/decode.py          # tp = 2 and 4, hidden 512 and 1024 (~5 min on 2 cores)
    python benchmarks/decode.py --quick  # a tiny Llama, tp = 2: a smoke run

For each tp size one gloo job: every rank builds the same seeded float32 ``LlamaForCausalLM``,
keeps it whole (rank 0 times it: the one-device baseline, one thread like every rank) and
parallelizes a copy with the ready plan over ``fd.connect(tp=n)``. Before any timing the greedy
tokens of both are compared (they must be equal). Rows, each a pair timed alternately (A B,
B A, ...), every run after a barrier, a tp run's time its slowest rank's; the ratio is the
median of the per-pair ratios (tp tokens/s over one device's):

* **decode loop, batch B**: a prompt of ``P`` tokens prefilled once, then ``S`` greedy decode
  steps with the KV cache, calling the parallelized model itself (``pm.module``: whole logits,
  token inputs checked across the group); tokens/s = ``B * S`` / time. The cache is cut back to
  the prompt after each run.
* **HF generate**: ``pm.generate(prompt, max_new_tokens=S)`` (transformers' loop, the logits
  gathered) against ``model.generate`` on one device, prefill included.
* **input check**: the decode loop with and without the check of the token inputs across the
  group (``pm.direct_calls.trusted()`` skips it): what that check (one small all-gather per
  forward) costs per step (the median of the per-pair differences) and its share of the step
  (one minus the median of the per-pair ratios).

Then fastdist's own Python: the decode loop run under ``cProfile`` on every rank, and on rank 0
the sum of the functions' own time (``tottime``) in files under ``fastdist/`` over the total.
The profiler slows Python code more than kernels, so this share is an upper estimate of the
Python fastdist adds; collectives and matmuls it calls are counted outside it.

Nothing here asserts a time. The machine's load average is printed before and after.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import multiprocessing as mp
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fastdist as fd
from fastdist.testing import run_on_gloo

HERE = Path(__file__).resolve().parent

# (hidden, intermediate, heads, kv heads, layers, vocabulary, prompt, decode steps)
SIZES = {
    "quick": (64, 128, 4, 4, 1, 256, 8, 4),
    "512": (512, 1408, 8, 4, 4, 8192, 64, 16),
    "1024": (1024, 2816, 16, 4, 4, 16384, 64, 16),
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
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(cfg).eval()


def _decoder(model: Any, prompt: torch.Tensor, steps: int) -> Callable[[], list[int]]:
    """A decode loop of ``steps`` greedy steps after ``prompt`` (B, P), prefilled once here; each
    call returns the first sequence's tokens and cuts the cache back to the prompt."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        first = model(input_ids=prompt, past_key_values=cache).logits[:, -1].argmax(-1)  # (B,)

    def run() -> list[int]:
        token, out = first[:, None], []  # (B, 1)
        with torch.no_grad():
            for _ in range(steps):
                logits = model(input_ids=token, past_key_values=cache).logits  # (B, 1, V)
                token = logits[:, -1:].argmax(-1)  # (B, 1)
                out.append(int(token[0, 0]))
        cache.crop(-steps)
        return out

    return run


def _timed(fn: Callable[[], Any], alone: bool) -> float:
    """Seconds of ``fn()`` started after a barrier; ``alone``: rank 0 runs it, the others wait at
    the next barrier (0.0 for them)."""
    dist.barrier()
    t0 = time.perf_counter()
    if not alone or dist.get_rank() == 0:
        fn()
    took = time.perf_counter() - t0
    dist.barrier()
    return took if not alone or dist.get_rank() == 0 else 0.0


def _pairs(pairs: dict[str, tuple[Any, Any, bool]], reps: int, warmup: int) -> dict[str, Any]:
    """Time every pair (A, B, B runs on rank 0 alone) alternately; seconds per run."""
    times: dict[str, Any] = {}
    for name, (a, b, b_alone) in pairs.items():
        for _ in range(warmup):
            _timed(a, False), _timed(b, b_alone)
        got: tuple[list[float], list[float]] = ([], [])
        for i in range(reps):
            for j in (0, 1) if i % 2 == 0 else (1, 0):
                got[j].append(_timed((a, b)[j], (False, b_alone)[j]))
        times[name] = got
    return times


def _own_share(run: Callable[[], Any]) -> float:
    """The share of ``run()``'s profiled time spent in fastdist's own Python functions."""
    prof = cProfile.Profile()
    dist.barrier()
    prof.enable()
    run()
    prof.disable()
    dist.barrier()
    stats: Any = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, _)
    total = sum(v[2] for v in stats.values())
    own = sum(v[2] for k, v in stats.items() if "/fastdist/" in k[0].replace("\\", "/"))
    return own / total if total else 0.0


def _rank(size: tuple[int, ...], batches: tuple[int, ...], reps: int, warmup: int) -> Any:
    """One rank of a tp job: check, then time every pair; returns the times (seconds)."""
    warnings.simplefilter("ignore", UserWarning)
    torch.set_num_threads(1)
    world = dist.get_world_size()
    *_, vocab, prompt_len, steps = size
    one = _llama(size)
    pm = fd.nn.parallelize(copy.deepcopy(one), fd.connect(tp=world, timeout=600))
    gen = torch.Generator().manual_seed(0)
    pairs: dict[str, tuple[Any, Any, bool]] = {}
    for b in batches:
        prompt = torch.randint(0, vocab, (b, prompt_len), generator=gen)  # (B, P)
        tp, base = _decoder(pm.module, prompt, steps), _decoder(one, prompt, steps)
        if tp() != base():  # greedy tokens of the first sequence
            raise AssertionError(f"rank {dist.get_rank()}: tp={world} decodes other tokens")
        pairs[f"decode loop, batch {b}"] = (tp, base, True)
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=gen)  # (1, P)
    kw = dict(max_new_tokens=steps, do_sample=False)
    want = one.generate(prompt, **kw)
    if not torch.equal(pm.generate(prompt, **kw), want):
        raise AssertionError(f"rank {dist.get_rank()}: pm.generate differs from one device")
    pairs["HF generate, batch 1"] = (
        lambda: pm.generate(prompt, **kw),
        lambda: one.generate(prompt, **kw),
        True,
    )
    checked = _decoder(pm.module, prompt, steps)

    def trusted() -> list[int]:
        with pm.direct_calls.trusted():
            return checked()

    pairs["input check"] = (checked, trusted, False)
    times = _pairs(pairs, reps, warmup)
    share = _own_share(checked)
    dist.barrier()
    return {"times": times, "own_share": share}


def bench(quick: bool, worlds: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for name in ("quick",) if quick else ("512", "1024"):
        size = SIZES[name]
        reps, warmup = (3, 1) if quick else (7, 1)
        batches = (1,) if quick else (1, 8)
        *_, prompt_len, steps = size
        for world in worlds:
            # each rank forks from one server that imported these once (not a fresh interpreter)
            mp.set_forkserver_preload(["torch", "fastdist", "transformers"])
            per_rank = run_on_gloo(
                _rank, world, size, batches, reps, warmup, start_method="forkserver", timeout=1800
            )
            for case in per_rank[0]["times"]:
                a, b = (
                    [max(r["times"][case][side][i] for r in per_rank) for i in range(reps)]
                    for side in (0, 1)
                )
                tokens = steps * (int(case.rsplit(" ", 1)[1]) if "batch" in case else 1)
                rows.append(
                    {
                        "model": f"hidden {size[0]}, {size[4]} layers, vocabulary {size[5]}",
                        "tp": world,
                        "case": case,
                        "prompt": prompt_len,
                        "steps": steps,
                        "tokens": tokens,
                        "a_ms": statistics.median(a) * 1e3,
                        "b_ms": statistics.median(b) * 1e3,
                        "ratio": statistics.median(y / x for x, y in zip(a, b)),  # B time / A
                        "diff_ms": statistics.median(x - y for x, y in zip(a, b)) * 1e3,
                        "own_share": per_rank[0]["own_share"],
                    }
                )
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | tp | case | tp tokens/s | one device tokens/s | tp / one device |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["case"] == "input check":
            continue
        lines.append(
            f"| {r['model']} | {r['tp']} | {r['case']} | "
            f"{r['tokens'] / r['a_ms'] * 1e3:.1f} | {r['tokens'] / r['b_ms'] * 1e3:.1f} | "
            f"{r['ratio']:.2f} |"
        )
    lines += [
        "",
        "| model | tp | decode step ms (batch 1) | without the input check ms | check ms per "
        "step | check's share of the step | fastdist's own Python (cProfile) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["case"] != "input check":
            continue
        per_step = r["diff_ms"] / r["steps"]  # the median of the per-pair differences
        lines.append(
            f"| {r['model']} | {r['tp']} | {r['a_ms'] / r['steps']:.2f} | "
            f"{r['b_ms'] / r['steps']:.2f} | {per_step:.2f} | "
            f"{(1 - r['ratio']) * 100:.1f} % | {r['own_share'] * 100:.1f} % |"
        )
    return "\n".join(lines)


def _load() -> str:
    path = Path("/proc/loadavg")
    return " ".join(path.read_text().split()[:3]) if path.exists() else "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="a tiny Llama, tp=2 (a smoke run)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    before = _load()
    rows = bench(args.quick, (2,) if args.quick else (2, 4))
    after = _load()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(
        json.dumps({"rows": rows, "loadavg": [before, after]}, indent=1)
    )
    text = _table(rows)
    (args.out / "decode.md").write_text(text + "\n")
    print(text)
    print(f"/proc/loadavg before: {before}; after: {after}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
