"""Training-step time and activation memory per rank of an HF Llama on 2 gloo processes:
Megatron sequence parallelism (tp = 2, ``sequence_parallel=True``) against context parallelism
(cp = 2, ring and Ulysses), and torch's ``context_parallel`` where it runs.

    python benchmarks/context_step.py          # 1024 and 2048 tokens (~10 min on 2 busy cores)
    python benchmarks/context_step.py --quick  # tiny sizes: a smoke run (~30 s)

All three fastdist layouts are ``fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh,
...))`` on the same float32 ``LlamaForCausalLM`` (``attn_implementation="sdpa"``, the
transformers default). Megatron SP splits the heads and the MLP over ``tp`` and the sequence
between them (norms, residuals), gathering the whole sequence before each attention and MLP;
context parallelism keeps every weight whole on every rank and splits the tokens through every
layer (zig-zag), running the attention as a ring (k/v passed around, fastdist's PyTorch online
softmax) or Ulysses (heads <-> tokens all-to-all around the same PyTorch attention over the
whole sequence of a head shard). fastdist's context-parallel attention is plain PyTorch (it
materializes each block's scores, like transformers' ``eager`` attention), not a fused kernel,
so Megatron SP is timed twice: with SDPA (torch's fused CPU kernel, what a user gets) and with
``attn_implementation="eager"`` (the same kind of attention as the CP side).

A step is forward with ``labels``, backward, gradients then dropped (``p.grad = None``); after
warm-up the layouts run in turn (the order rotating every round), each step after a barrier; a
step's wall time is its slowest rank's, its CPU time both ranks' process CPU time added (the
work done, without waiting for a core or a peer: the steadier on a loaded machine); each ratio
is the median of per-round ratios against Megatron SP. Before timing, every layout's loss is
checked against the single-device model's (float32, 1e-4). The activation memory is the bytes
autograd saves during one forward on a real rank (``context_memory.saved_bytes``): not a CUDA
peak, and nothing here has run on a GPU.

torch's ``torch.distributed.tensor.experimental.context_parallel`` is tried on the same model
(``buffers=[input_ids, position_ids, labels]``); on a CPU it does not run: its ring replaces
only the CUDA SDPA ops (``_scaled_dot_product_flash_attention``, ``..._efficient_attention``,
``..._cudnn_attention``), and a CPU's SDPA dispatches to
``_scaled_dot_product_flash_attention_for_cpu``, which has no sharding strategy (the error is
reported in the output). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import copy
import json
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

import fastdist as fd
from fastdist.testing import run_on_gloo

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from context_memory import saved_bytes  # noqa: E402  (the measure of benchmarks/context_memory.py)

WORLD = 2
# (hidden, intermediate, heads, kv heads, layers, vocabulary, sequence)
SIZES = {
    "quick": (32, 64, 4, 2, 1, 128, 32),
    "1k": (256, 688, 8, 4, 2, 4096, 1024),
    "2k": (256, 688, 8, 4, 2, 4096, 2048),
}
LAYOUTS = (
    "Megatron SP (tp=2)",
    "Megatron SP (tp=2), eager attention",
    "CP ring (cp=2)",
    "CP Ulysses (cp=2)",
)


def _llama(size: tuple[int, ...]) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, heads, kv, layers, vocab, seq = size
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max(seq, 64),
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def _layout(one: Any, name: str) -> Any:
    model = copy.deepcopy(one)
    if "eager" in name:  # the S x S scores materialized, as fastdist's CP attention does
        model.set_attn_implementation("eager")
    if name.startswith("Megatron"):
        mesh = fd.connect(tp=WORLD, timeout=120)
        plan = fd.nn.plans.plan(model, mesh, sequence_parallel=True)
    else:
        mesh = fd.connect(cp=WORLD, timeout=120)
        mode = "ulysses" if "Ulysses" in name else "ring"
        cp = fd.nn.CausalContextParallel("cp", mode)
        plan = fd.nn.plans.plan(model, mesh, context_parallel=cp)
    return fd.nn.parallelize(model, mesh, plan)


def _torch_context_parallel(size: tuple[int, ...]) -> str:
    """One rank: try torch's ``context_parallel`` on the model: ``"runs"`` or the error. In
    processes of its own: on a CPU the ranks fail at different collectives, which leaves the
    group unusable."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    warnings.simplefilter("ignore")
    model = _llama(size)
    ids = torch.randint(0, size[5], (1, size[6]), generator=torch.Generator().manual_seed(0))
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    ids, labels = ids.clone(), ids.clone()
    pos = torch.arange(ids.shape[1])[None].clone()
    try:
        with context_parallel(mesh, buffers=[ids, pos, labels], buffer_seq_dims=[1, 1, 1]):
            model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss.backward()
    except Exception as e:  # noqa: BLE001 - reported, not handled
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return "runs"


def _step(model: Any, ids: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        for p in model.parameters():
            p.grad = None

    return run


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    """Wall seconds (after a barrier: a step's time is then its slowest rank's) and this
    process's CPU seconds (its own work, without the time it waited for a core or a peer)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _rank(size: tuple[int, ...], reps: int, warmup: int) -> dict[str, Any]:
    """One rank: check each layout's loss, measure its saved activations, time the rounds."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    one = _llama(size)
    ids = torch.randint(0, size[5], (1, size[6]), generator=torch.Generator().manual_seed(0))
    ref = one(input_ids=ids, labels=ids, use_cache=False).loss.item()
    models = {name: _layout(one, name) for name in LAYOUTS}
    diffs, mem = {}, {}
    for name, m in models.items():
        diffs[name] = abs(m(input_ids=ids, labels=ids, use_cache=False).loss.item() - ref)
        if not diffs[name] < 1e-4:
            raise AssertionError(f"rank {dist.get_rank()}: {name} loss off by {diffs[name]:.3g}")
        mem[name] = saved_bytes(lambda m=m: m(input_ids=ids, labels=ids, use_cache=False).loss)
    mem["one device"] = saved_bytes(lambda: one(input_ids=ids, labels=ids, use_cache=False).loss)
    one.set_attn_implementation("eager")
    mem["one device, eager"] = saved_bytes(
        lambda: one(input_ids=ids, labels=ids, use_cache=False).loss
    )
    steps = [_step(models[name], ids) for name in LAYOUTS]
    for _ in range(warmup):
        for f in steps:
            f()
    times: list[list[tuple[float, float]]] = [[] for _ in LAYOUTS]
    for i in range(reps):
        for j in range(len(LAYOUTS)):
            k = (i + j) % len(LAYOUTS)  # the order rotates: no layout always first
            times[k].append(_timed(steps[k]))
    dist.barrier()
    return {"diffs": diffs, "mem": mem, "times": times}


def bench(quick: bool, only: list[str] | None = None) -> dict[str, Any]:
    rows, torch_cp = [], ""
    for name in ("quick",) if quick else only or ("1k", "2k"):
        size = SIZES[name]
        reps, warmup = (3, 1) if quick else (11, 1)
        per_rank = run_on_gloo(_rank, WORLD, size, reps, warmup, timeout=3000)
        tried = run_on_gloo(_torch_context_parallel, WORLD, size, timeout=600)
        # a rank whose peer failed first reports a closed connection: the other's error is the cause
        torch_cp = min(tried, key=lambda e: "closed by peer" in e)
        # wall: a step is over when its slowest rank is; CPU: the ranks' work added
        n = len(LAYOUTS)
        t = [[max(r["times"][k][i][0] for r in per_rank) for i in range(reps)] for k in range(n)]
        c = [[sum(r["times"][k][i][1] for r in per_rank) for i in range(reps)] for k in range(n)]
        for k, layout in enumerate(LAYOUTS):
            rows.append(
                {
                    "layout": layout,
                    "tokens": size[6],
                    "model": f"hidden {size[0]}, {size[4]} layers, {size[2]}/{size[3]} heads",
                    "ms": statistics.median(t[k]) * 1e3,
                    "ratio_vs_sp": statistics.median(a / b for a, b in zip(t[k], t[0])),
                    "cpu_ms": statistics.median(c[k]) * 1e3,
                    "cpu_ratio_vs_sp": statistics.median(a / b for a, b in zip(c[k], c[0])),
                    "activation_mib": max(r["mem"][layout] for r in per_rank) / 2**20,
                    "one_device_mib": per_rank[0]["mem"]["one device"] / 2**20,
                    "one_device_eager_mib": per_rank[0]["mem"]["one device, eager"] / 2**20,
                    "loss_diff": max(r["diffs"][layout] for r in per_rank),
                }
            )
    return {"rows": rows, "torch_context_parallel": torch_cp}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--only", nargs="+", choices=[k for k in SIZES if k != "quick"])
    args = ap.parse_args(argv)
    load = [os.getloadavg()]
    res = bench(args.quick, args.only)
    load.append(os.getloadavg())
    res["loadavg"] = load
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "context_step.json").write_text(json.dumps(res, indent=1))
    lines = [
        f"load average before {load[0][0]:.2f}, after {load[1][0]:.2f} (1 min); "
        f"torch {torch.__version__}, 2 gloo processes, 1 thread each",
        "",
        "| tokens | layout | step ms | / Megatron SP | CPU ms, both ranks | / Megatron SP (CPU) "
        "| activations MiB per rank (one device: SDPA / eager) | loss diff vs one device |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['tokens']} | {r['layout']} | {r['ms']:.1f} | {r['ratio_vs_sp']:.3f} | "
        f"{r['cpu_ms']:.1f} | {r['cpu_ratio_vs_sp']:.3f} | "
        f"{r['activation_mib']:.1f} ({r['one_device_mib']:.1f} / {r['one_device_eager_mib']:.1f}) "
        f"| {r['loss_diff']:.0e} |"
        for r in res["rows"]
    ]
    lines += ["", f"torch context_parallel (cp=2): {res['torch_context_parallel']}"]
    (args.out / "context_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
