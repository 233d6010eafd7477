"""Ready plans of several Hugging Face families on simulated ranks: the training step's time ratio
(parallel step / one-device step), family beside family.

    python benchmarks/families.py            # hidden 1024, seq 256, tp=4 (a few minutes on 2 cores)
    python benchmarks/families.py --quick    # tiny sizes: a smoke run

Each family: the same model (float32, eval mode, 2 layers) on one device and parallelized with
its ready plan (`fastdist.nn.plans.plan`, tensor + sequence parallel) on a simulated
``tp`` mesh; both run forward with labels and backward on the same batch, alternating (median
of per-pair ratios). Before timing, the two losses are checked to agree. ``ROWS`` lists the
families: add a ``(label, builder, mesh axes, plan keywords)`` entry for another one (the MoE
families' row goes here too).
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


def _sizes(quick: bool) -> dict[str, Any]:
    # the sizes of benchmarks/hf_models.py's Llama, so the Llama rows compare
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


#: (label, builder(quick) -> model, mesh axes given tp, plan keywords)
ROWS: list[tuple[str, Callable[[bool], Any], Callable[[int], dict[str, int]], dict[str, Any]]] = [
    ("Llama", llama, lambda tp: {"tp": tp}, {"sequence_parallel": True}),
    ("Gemma 2", gemma2, lambda tp: {"tp": tp}, {"sequence_parallel": True}),
    # experts over ep, attention and each expert's features over tp (no sequence parallelism)
    ("Qwen3-MoE", qwen3_moe, lambda tp: {"ep": 2, "tp": max(tp // 2, 1)}, {}),
]


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


def bench(quick: bool, tp: int = 4) -> list[dict[str, Any]]:
    rows = []
    B, S = (2, 16) if quick else (2, 256)
    for label, build, axes, plan_kwargs in ROWS:
        torch.manual_seed(0)
        one = build(quick).eval()
        model = copy.deepcopy(one)
        mesh = fd.Mesh(axes(tp))
        pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, **plan_kwargs))
        ids = torch.randint(
            0, one.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0)
        )
        ids_r = ids.expand(mesh.size, B, S)
        with torch.no_grad():  # the parallel model is the same model
            want = one(input_ids=ids, labels=ids).loss
            got = pm(input_ids=ids_r, labels=ids_r).loss
        torch.testing.assert_close(got, want.expand(mesh.size), rtol=1e-4, atol=1e-4)

        def base(one: Any = one, ids: torch.Tensor = ids) -> None:
            one.zero_grad(set_to_none=True)
            one(input_ids=ids, labels=ids).loss.backward()

        def par(pm: Any = pm, ids: torch.Tensor = ids_r) -> None:
            pm.module.zero_grad(set_to_none=True)
            pm(input_ids=ids, labels=ids).loss.sum().backward()

        tb, tf, ratio = _paired(base, par, 3 if quick else 7)
        rows.append(
            {
                "case": f"HF {label} fwd+bwd, eager",
                "family": one.config.model_type,
                "hidden": one.config.hidden_size,
                "seq": S,
                "mesh": axes(tp),
                "one_device_ms": tb * 1e3,
                "fastdist_ms": tf * 1e3,
                "ratio": ratio,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--out", type=Path, default=HERE / "results", help="output directory")
    args = ap.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = bench(args.quick, args.tp)
    lines = [
        "| case | hidden | seq | mesh | one device ms | fastdist ms | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['hidden']} | {r['seq']} | {r['mesh']} | "
            f"{r['one_device_ms']:.1f} | {r['fastdist_ms']:.1f} | {r['ratio']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "families.json").write_text(json.dumps(rows, indent=2))
    (args.out / "families.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
