"""What ``parallelize(..., verify=True)`` and ``plan="auto"`` cost: the time of ``parallelize`` on a
Hugging Face Llama (random init, float32, eval mode) with the ready plan and no check, with
``verify=True``, and with ``"auto"`` (which verifies its candidate), on simulated ranks.

Each case builds a fresh copy of the model (not timed) and times the call; the median of
``--repeat`` runs is printed with its ratio to the unchecked call.

    python benchmarks/verify_cost.py            # two sizes, tp 2 and 4
    python benchmarks/verify_cost.py --quick    # the small size, tp 2, 1 run
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch

import fastdist as fd


def build(hidden: int, layers: int, vocab: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(4, hidden // 64),
        num_key_value_heads=max(2, hidden // 256),
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg).eval()


def timed(model: Any, mesh: fd.Mesh, how: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        m = copy.deepcopy(model)
        start = time.perf_counter()
        if how == "auto":
            fd.nn.parallelize(m, mesh, "auto")
        else:
            fd.nn.parallelize(m, mesh, fd.nn.plans.llama(m), verify=how == "verify")
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    sizes = [(64, 2, 1000)] if args.quick else [(64, 2, 1000), (512, 4, 32000)]
    tps = [2] if args.quick else [2, 4]
    repeat = 1 if args.quick else args.repeat
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| model | params | tp | parallelize | verify=True | x | 'auto' | x |")
    print("|---|---|---|---|---|---|---|---|")
    for hidden, layers, vocab in sizes:
        model = build(hidden, layers, vocab)
        params = sum(p.numel() for p in model.parameters())
        for tp in tps:
            mesh = fd.Mesh({"tp": tp})
            base = timed(model, mesh, "plain", repeat)
            ver = timed(model, mesh, "verify", repeat)
            auto = timed(model, mesh, "auto", repeat)
            print(
                f"| Llama h={hidden} L={layers} V={vocab} | {params / 1e6:.1f}M | {tp} | "
                f"{base * 1e3:.0f} ms | {ver * 1e3:.0f} ms | {ver / base:.1f} | "
                f"{auto * 1e3:.0f} ms | {auto / base:.1f} |"
            )


if __name__ == "__main__":
    main()
