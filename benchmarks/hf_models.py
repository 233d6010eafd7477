"""An unmodified Hugging Face Llama, parallelized (simulated tp=4 + sequence parallelism), against
the model on one device.

    python benchmarks/hf_models.py            # hidden 1024, seq 256 (a few minutes on 2 cores)
    python benchmarks/hf_models.py --quick    # tiny sizes: a smoke run
    python benchmarks/hf_models.py --device cuda --dtype bfloat16   # on a GPU

Both sides run a training step (forward with labels, backward) on the same batch, eager
and under ``torch.compile``; the ratio is fastdist's time over one device's, measured in
the same run with the two sides alternating (median of per-pair ratios). The simulated
step does the same arithmetic as one device (each rank a quarter of every matmul) plus
what tensor/sequence parallelism adds: the gathers and reduce-scatters (here copies and
sums over the rank dim), per-rank norms, and the vocabulary-parallel loss.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fastdist as fd

HERE = Path(__file__).resolve().parent


def _llama(quick: bool) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if quick:
        cfg = LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    else:
        cfg = LlamaConfig(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=2,
            num_attention_heads=16,
            num_key_value_heads=4,
            max_position_embeddings=1024,
        )
    return LlamaForCausalLM(cfg)


def _paired(
    base: Callable[[], Any], fn: Callable[[], Any], reps: int
) -> tuple[float, float, float]:
    """(median base s, median fn s, median of per-pair fn/base) with the two sides alternating."""
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
    return statistics.median(tb), statistics.median(tf), statistics.median(ratios)


def bench(
    quick: bool, tp: int = 4, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> list[dict[str, Any]]:
    one = _llama(quick).to(device=device, dtype=dtype)
    model = copy.deepcopy(one)
    mesh = fd.Mesh({"tp": tp})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=True))
    B, S = (2, 32) if quick else (2, 256)
    ids = torch.randint(
        0, one.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0)
    ).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    ids_r = ids.expand(tp, B, S)

    def one_loss(ids: torch.Tensor) -> torch.Tensor:
        return one(input_ids=ids, labels=ids).loss

    def par_loss(ids: torch.Tensor) -> torch.Tensor:
        return pm(input_ids=ids, labels=ids).loss.sum()

    def step(
        loss: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Any
    ) -> Callable[[], None]:
        def run() -> None:
            for p in params:
                p.grad = None
            loss(x).backward()
            sync()  # a device's work is asynchronous: time it done

        return run

    rows = []
    reps = 3 if quick else 7
    for mode in ("eager", "compiled"):
        f_one, f_par = (
            (one_loss, par_loss)
            if mode == "eager"
            else (torch.compile(one_loss), torch.compile(par_loss))
        )
        base, fn = (
            step(f_one, ids, list(one.parameters())),
            step(f_par, ids_r, list(pm.parameters())),
        )
        t0 = time.perf_counter()
        base(), fn()  # compile (timed apart)
        first = time.perf_counter() - t0
        tb, tf, ratio = _paired(base, fn, reps)
        rows.append(
            {
                "case": f"HF Llama fwd+bwd, {mode}"
                + ("" if device == "cpu" else f", {device} {str(dtype).removeprefix('torch.')}"),
                "hidden": one.config.hidden_size,
                "seq": S,
                "tp": tp,
                "one_device_ms": tb * 1e3,
                "fastdist_ms": tf * 1e3,
                "ratio": ratio,
                "first_call_s": first,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore", UserWarning)
    torch.set_num_threads(torch.get_num_threads())
    rows = bench(args.quick, device=args.device, dtype=getattr(torch, args.dtype))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_models.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "| case | hidden | seq | tp | one device ms | fastdist (all ranks) ms | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['case']} | {r['hidden']} | {r['seq']} | {r['tp']} | {r['one_device_ms']:.1f} | "
        f"{r['fastdist_ms']:.1f} | {r['ratio']:.3f} |"
        for r in rows
    ]
    (args.out / "hf_models.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
