"""Unmodified Hugging Face models, parallelized with their ready plans on simulated ranks, against
the same model on one device: the training step's time ratio, family beside family.

    python benchmarks/hf_models.py            # hidden 1024, seq 256, tp=4 (minutes on 2 cores)
    python benchmarks/hf_models.py --quick    # tiny sizes: a smoke run
    python benchmarks/hf_models.py --device cuda --dtype bfloat16   # on a GPU

Both sides run a training step (forward with labels, backward) on the same batch; the ratio is
fastdist's time over one device's, measured in the same run with the two sides alternating
(median of per-pair ratios, their quartiles beside it; ``--reps`` pairs); the losses are checked
to agree first. The simulated step does the same arithmetic as one device (each rank a quarter
of every matmul) plus what tensor/sequence parallelism adds: the gathers and reduce-scatters
(here copies and sums over the rank dim), per-rank norms, and the vocabulary-parallel loss.

``ROWS`` is the table of families: a `Row` per model (its builder, the mesh, the plan's keywords,
whether it is also timed under ``torch.compile``). The machine's load average is printed before
and after: compare ratios of one run only.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import fastdist as fd

HERE = Path(__file__).resolve().parent


def _sizes(quick: bool) -> dict[str, Any]:
    """Every family at the Llama's sizes (the MoE families split the MLP into experts)."""
    return dict(
        vocab_size=256 if quick else 32000,
        hidden_size=64 if quick else 1024,
        intermediate_size=128 if quick else 2816,
        num_hidden_layers=1 if quick else 2,
        num_attention_heads=4 if quick else 16,
        num_key_value_heads=2 if quick else 4,
        max_position_embeddings=1024,
    )


def llama(quick: bool) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_sizes(quick)))


def gemma2(quick: bool) -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    s = _sizes(quick)
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    cfg = Gemma2Config(**s, head_dim=head_dim, sliding_window=128, query_pre_attn_scalar=head_dim)
    return Gemma2ForCausalLM(cfg)  # soft-capped logits and attention, eager attention


def qwen3_moe(quick: bool) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    s = _sizes(quick)
    cfg = Qwen3MoeConfig(
        **s,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=s["intermediate_size"] // 4,
        head_dim=s["hidden_size"] // s["num_attention_heads"],
    )
    return Qwen3MoeForCausalLM(cfg)  # one device: transformers' default experts implementation


def mixtral(quick: bool) -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    s = _sizes(quick)
    cfg = MixtralConfig(
        **{**s, "intermediate_size": s["intermediate_size"] // 4}, num_local_experts=8
    )
    return MixtralForCausalLM(cfg)  # 8 experts of a quarter of the MLP, top-2


@dataclass(frozen=True)
class Row:
    """One family of the table."""

    label: str
    build: Callable[[bool], Any]  # quick -> the model on one device
    axes: Callable[[int], dict[str, int]]  # tp -> the mesh's axes
    plan: dict[str, Any] = field(default_factory=dict)  # keywords of fd.nn.plans.plan
    compiled: bool = False  # also timed under torch.compile


ROWS: list[Row] = [
    Row("Llama", llama, lambda tp: {"tp": tp}, {"sequence_parallel": True}, compiled=True),
    Row("Gemma 2", gemma2, lambda tp: {"tp": tp}, {"sequence_parallel": True}),
    # experts over ep, attention and each expert's features over tp (no sequence parallelism)
    Row("Qwen3-MoE", qwen3_moe, lambda tp: {"ep": 2, "tp": max(tp // 2, 1)}),
    # every expert whole on one of tp ranks: attention over tp, experts over ep
    Row("Mixtral", mixtral, lambda tp: {"ep": tp}),
]


def _paired(
    base: Callable[[], Any], fn: Callable[[], Any], reps: int
) -> tuple[float, float, list[float]]:
    """(median base s, median fn s, every pair's fn/base, sorted) with the two sides
    alternating."""
    for _ in range(2):
        base(), fn()
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
    return statistics.median(tb), statistics.median(tf), sorted(ratios)


def _quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``xs`` (linear between neighbours)."""
    at = q * (len(xs) - 1)
    lo = int(at)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (at - lo)


def _step(
    loss: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: list[Any], sync: Any
) -> Callable[[], None]:
    def run() -> None:
        for p in params:
            p.grad = None
        loss(x).backward()
        sync()  # a device's work is asynchronous: time it done

    return run


def bench_row(
    row: Row, quick: bool, tp: int, device: str, dtype: torch.dtype, reps: int = 7
) -> list[dict[str, Any]]:
    """The row's eager (and compiled) step ratios."""
    torch.manual_seed(0)
    one = row.build(quick).to(device=device, dtype=dtype).eval()
    model = copy.deepcopy(one)
    mesh = fd.Mesh(row.axes(tp))
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, **row.plan))
    B, S = (2, 16) if quick else (2, 256)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, one.config.vocab_size, (B, S), generator=gen).to(device)
    ids_r = ids.expand(mesh.size, B, S)  # every rank the same batch
    with torch.no_grad():  # the parallel model is the same model
        want = one(input_ids=ids, labels=ids).loss
        got = pm(input_ids=ids_r, labels=ids_r).loss
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want.expand(mesh.size), rtol=tol, atol=tol)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def one_loss(x: torch.Tensor) -> torch.Tensor:
        return one(input_ids=x, labels=x).loss

    def par_loss(x: torch.Tensor) -> torch.Tensor:
        return pm(input_ids=x, labels=x).loss.sum()

    rows = []
    for mode in ("eager", "compiled") if row.compiled else ("eager",):
        # the smoke run traces with aot_eager: dynamo and AOTAutograd as in a real run, no
        # inductor code generation
        compiled = functools.partial(torch.compile, backend="aot_eager" if quick else "inductor")
        f_one, f_par = (
            (one_loss, par_loss) if mode == "eager" else (compiled(one_loss), compiled(par_loss))
        )
        base = _step(f_one, ids, list(one.parameters()), sync)
        fn = _step(f_par, ids_r, list(pm.parameters()), sync)
        t0 = time.perf_counter()
        base(), fn()  # compile (timed apart)
        first = time.perf_counter() - t0
        tb, tf, ratios = _paired(base, fn, 3 if quick else reps)
        where = "" if device == "cpu" else f", {device} {str(dtype).removeprefix('torch.')}"
        rows.append(
            {
                "case": f"HF {row.label} fwd+bwd, {mode}{where}",
                "family": one.config.model_type,
                "hidden": one.config.hidden_size,
                "seq": S,
                "mesh": row.axes(tp),
                "one_device_ms": tb * 1e3,
                "fastdist_ms": tf * 1e3,
                "ratio": statistics.median(ratios),
                # the per-pair ratios' quartiles: how far one run's median can move on this load
                "ratio_q1": _quantile(ratios, 0.25),
                "ratio_q3": _quantile(ratios, 0.75),
                "first_call_s": first,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--only", nargs="*", default=None, help="labels of ROWS to run (default all)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=7, help="timed pairs per row (default 7)")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore", UserWarning)
    load_before = os.getloadavg()
    rows = [
        r
        for row in ROWS
        if args.only is None or row.label in args.only
        for r in bench_row(
            row, args.quick, args.tp, args.device, getattr(torch, args.dtype), args.reps
        )
    ]
    load_after = os.getloadavg()
    lines = [
        "| case | hidden | seq | mesh | one device ms | fastdist (all ranks) ms | ratio | "
        "pairs' quartiles |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['case']} | {r['hidden']} | {r['seq']} | {r['mesh']} | {r['one_device_ms']:.1f} | "
        f"{r['fastdist_ms']:.1f} | {r['ratio']:.3f} | {r['ratio_q1']:.3f}-{r['ratio_q3']:.3f} |"
        for r in rows
    ]
    table = "\n".join(lines)
    load = f"load average (1 min) before {load_before[0]:.1f}, after {load_after[0]:.1f}"
    print(table + "\n\n" + load)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_models.json").write_text(
        json.dumps({"rows": rows, "loadavg": [load_before[0], load_after[0]]}, indent=1)
    )
    (args.out / "hf_models.md").write_text(table + "\n\n" + load + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
