"""Activation memory per rank against sequence length: an HF Llama on one device, with Megatron
sequence parallelism (tp = n, ``sequence_parallel=True``) and with context parallelism (cp = n,
ring and Ulysses), on simulated ranks.

How it is measured: the bytes of the tensors autograd saves for backward during one forward
(``torch.autograd.graph.saved_tensors_hooks``), each storage counted once. On simulated ranks a
saved tensor holds every rank's slice (``[world, ...]``), so the per-rank figure is the total
divided by the world size. This is the activation memory a training step holds at the end of
its forward (its peak, without gradient buffers or the allocator's slack); it is not a CUDA
measurement (nothing here has run on a GPU). Every model uses eager attention, so one device
keeps its ``S x S`` scores; context parallelism's attention keeps ``S/n x S`` per rank.

    python benchmarks/context_memory.py            # n = 4, S = 128 .. 1024, ~1 min on 2 cores
    python benchmarks/context_memory.py --quick    # tiny sizes (the smoke test)
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fastdist as fd


def saved_bytes(run: Any) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` executes a forward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a vmapped tensor: its physical storage
            seen[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def model(hidden: int, layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


def measure(seq: int, n: int, hidden: int, layers: int) -> dict[str, float]:
    """Activation MiB per rank at sequence length ``seq`` for each layout."""
    base = model(hidden, layers)
    ids = torch.randint(0, 128, (1, seq))
    out: dict[str, float] = {
        "one device": saved_bytes(lambda: base(input_ids=ids, use_cache=False).logits)
    }
    layouts: dict[str, tuple[fd.Mesh, dict[str, Any]]] = {
        f"Megatron SP (tp={n})": (fd.Mesh({"tp": n}), {"sequence_parallel": True}),
        f"CP ring (cp={n})": (fd.Mesh({"cp": n}), {"context_parallel": "cp"}),
        f"CP Ulysses (cp={n})": (
            fd.Mesh({"cp": n}),
            {"context_parallel": fd.nn.CausalContextParallel("cp", "ulysses")},
        ),
    }
    for name, (mesh, opts) in layouts.items():
        m = copy.deepcopy(base)
        pm = fd.nn.parallelize(m, mesh, fd.nn.plans.plan(m, mesh, **opts), verify=False)
        batch = ids.expand(mesh.size, *ids.shape)
        total = saved_bytes(lambda pm=pm, batch=batch: pm(input_ids=batch, use_cache=False))
        out[name] = total / mesh.size
    return {k: v / 2**20 for k, v in out.items()}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--n", type=int, default=4, help="ranks of tp / cp")
    args = parser.parse_args(argv)
    seqs = [32] if args.quick else [128, 256, 512, 1024]
    hidden, layers = (32, 1) if args.quick else (64, 2)
    rows = []
    for seq in seqs:
        row = measure(seq, args.n, hidden, layers)
        rows.append({"seq": seq, **row})
    names = list(rows[0])[1:]
    print(f"activation MiB per rank (saved for backward), Llama hidden {hidden}, {layers} layers")
    print("| seq | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for r in rows:
        one = r["one device"]
        cells = [
            f"{r[k]:.2f}" + ("" if k == "one device" else f" ({r[k] / one:.2f}x)") for k in names
        ]
        print(f"| {r['seq']} | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    main()
