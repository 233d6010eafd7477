"""What ``parallelize(..., verify=True)`` and ``plan="auto"`` cost: the time of ``parallelize`` on a
Hugging Face Llama (random init, float32, eval mode) with the ready plan and no check, with
``verify=True``, and with ``"auto"`` (which verifies its candidate), on simulated ranks.

Each case builds a fresh copy of the model (not timed) and times the call, after one untimed
call of each case (warm-up): the CPU time of this process (``time.process_time``, all its
threads: what other processes on a shared machine disturb least) and the wall time, each the
least of ``--repeat`` runs, with the ratio of verify's and auto's CPU time to the unchecked
call's.

    python benchmarks/verify_cost.py            # two sizes, tp 2 and 4
    python benchmarks/verify_cost.py --quick    # the small size, tp 2, 1 run
"""

from __future__ import annotations

import argparse
import copy
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


def timed(model: Any, mesh: fd.Mesh, how: str, repeat: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one parallelize call, each the least of ``repeat``."""
    cpu, wall = [], []
    for _ in range(repeat + 1):
        m = copy.deepcopy(model)
        start, start_cpu = time.perf_counter(), time.process_time()
        if how == "auto":
            fd.nn.parallelize(m, mesh, "auto")
        else:
            fd.nn.parallelize(m, mesh, fd.nn.plans.plan(m, family="llama"), verify=how == "verify")
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return min(cpu[1:]), min(wall[1:])  # the first: warm-up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    sizes = [(64, 2, 1000)] if args.quick else [(64, 2, 1000), (512, 4, 32000)]
    tps = [2] if args.quick else [2, 4]
    repeat = 1 if args.quick else args.repeat
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("CPU time (wall time), least of the runs")
    print("| model | params | tp | parallelize | verify=True | x | 'auto' | x |")
    print("|---|---|---|---|---|---|---|---|")
    for hidden, layers, vocab in sizes:
        model = build(hidden, layers, vocab)
        params = sum(p.numel() for p in model.parameters())
        for tp in tps:
            mesh = fd.Mesh({"tp": tp})
            (base, base_w), (ver, ver_w), (auto, auto_w) = (
                timed(model, mesh, how, repeat) for how in ("plain", "verify", "auto")
            )
            print(
                f"| Llama h={hidden} L={layers} V={vocab} | {params / 1e6:.1f}M | {tp} | "
                f"{base * 1e3:.0f} ms ({base_w * 1e3:.0f}) | {ver * 1e3:.0f} ms "
                f"({ver_w * 1e3:.0f}) | {ver / base:.1f} | {auto * 1e3:.0f} ms "
                f"({auto_w * 1e3:.0f}) | {auto / base:.1f} |"
            )


if __name__ == "__main__":
    main()
