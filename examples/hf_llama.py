"""Train an unmodified Hugging Face Llama with tensor + sequence parallelism on real ranks.

    torchrun --standalone --nproc-per-node 2 examples/hf_llama.py

Every rank builds the same small model (same seed; a real job would load a checkpoint
with ``fd.checkpoint.load("path/to/save_pretrained_dir", pm)``, each rank reading only its slices),
parallelizes it with the ready-made Llama plan, and trains a few AdamW steps. Each
rank also trains the single-device model and checks that losses and weights agree;
the script exits non-zero on a mismatch.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import fastdist as fd


def main() -> int:
    dist.init_process_group("gloo")
    mesh = fd.connect(tp=dist.get_world_size(), timeout=60)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).double()
    reference = copy.deepcopy(model)  # the same model on one device, for the check

    pm = fd.nn.parallelize(
        model, mesh, fd.nn.plans.plan(model, family="llama", sequence_parallel=True)
    )
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    worst = 0.0
    for step in range(3):
        ids = torch.randint(
            0, config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(step)
        )
        loss = pm(
            input_ids=ids, labels=ids
        ).loss  # vocabulary-parallel loss of the whole vocabulary
        loss.backward()
        opt.step()
        opt.zero_grad()
        logits = reference(
            input_ids=ids
        ).logits  # one device; the loss in float64 (HF's own upcasts to float32)
        loss_ref = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
        )
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        worst = max(worst, abs(loss.item() - loss_ref.item()))
        if mesh.rank == 0:
            print(f"step {step}: loss {loss.item():.6f} (one device: {loss_ref.item():.6f})")
    state = pm.state_dict()  # gathered back to single-device names and shapes
    weight_diff = max(
        (state[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()
    )
    ok = worst < 1e-10 and weight_diff < 1e-10
    if mesh.rank == 0:
        print(
            f"hf_llama on {mesh!r}: max loss diff {worst:.2e}, max weight diff {weight_diff:.2e}: "
            f"{'OK' if ok else 'MISMATCH'}"
        )
    fd.comm.close(mesh)  # its groups released now, not torn down at interpreter exit
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
