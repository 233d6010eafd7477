"""Pipeline parallelism on real ranks: an HF Llama split into stages over ``pp``, each stage
tensor parallel over ``tp``, trained for a few AdamW steps and checked against one device.

    torchrun --standalone --nproc-per-node 4 examples/train_pipeline.py
    torchrun --standalone --nproc-per-node 4 examples/train_pipeline.py --schedule interleaved_1f1b
    torchrun --standalone --nproc-per-node 8 examples/train_pipeline.py --microbatches 8   # dp=2

The mesh is ``fastdist.connect(pp=2, tp=2)`` (``--pp``, ``--tp``; the rest of the world is
``dp``). Every process builds the same seeded float64 model, keeps a copy as its one-device
reference, and hands the model to `fd.train.pipeline`, which keeps only this process's stages.
Each step runs the schedule over ``--microbatches`` micro-batches (`Pipeline.step`), clips the
gradients by the whole model's norm (`Pipeline.clip_grad_norm_`) and takes an AdamW step; the
reference trains on the whole global batch with torch's own clipping.

At the end every rank compares the weights of its stages with the reference's, and rank 0 prints
the largest differences of loss, clipped norm and weights over all ranks, then ``OK`` (exit 0) or
``MISMATCH`` (exit 1). With ``--dp`` > 1 each data rank runs its slice of the global batch and
the stages' gradients are averaged over ``dp`` (`fastdist.train.DataParallel`).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fastdist as fd


def build_model(layers: int, seed: int = 0) -> Any:
    """The single-device model, the same on every rank (same seed), in float64."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,  # a tied weight would span the first and the last stage
    )
    return transformers.LlamaForCausalLM(config).to(torch.float64).train()


def global_batch(step: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Step ``step``'s ``batch`` sequences of ``seq`` tokens (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def reference_step(
    model: Any, opt: torch.optim.Optimizer, ids: torch.Tensor, clip: float
) -> tuple[float, float]:
    """One device's step on the whole global batch: float64 loss, torch's clip, AdamW."""
    vocab = model.config.vocab_size
    logits = model(input_ids=ids).logits
    # float64 cross entropy (transformers' own loss upcasts the logits to float32 only)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    return float(loss.detach()), float(norm)


def train(args: argparse.Namespace, mesh: fd.Mesh) -> dict[str, Any]:
    """The run on this rank; returns its losses, norms and largest differences from one
    device."""
    model = build_model(args.layers)
    reference = copy.deepcopy(model)
    pipe = fd.train.pipeline(
        model, mesh, schedule=args.schedule, microbatches=args.microbatches, virtual=args.virtual
    )
    dp = mesh.axis_size("dp")
    if dp > 1:
        fd.train.DataParallel(pipe, "dp")
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.1)
    vocab = model.config.vocab_size
    per = args.batch // dp
    mine = mesh.index(mesh.rank, "dp")
    out: dict[str, Any] = {"losses": [], "norms": [], "loss": 0.0, "norm": 0.0}
    for step in range(args.steps):
        ids = global_batch(step, args.batch, args.seq, vocab)
        local = ids[mine * per : (mine + 1) * per]  # this data rank's slice of the batch
        loss = pipe.step(input_ids=local, labels=local)  # the same on every rank of pp
        if dp > 1:  # the mean over the data ranks: the whole batch's loss (equal token counts)
            loss = fd.pmean(loss, mesh, "dp")
        norm = pipe.clip_grad_norm_(args.clip)  # the whole model's norm, on every rank
        opt.step()
        opt.zero_grad()
        ref_loss, ref_norm = reference_step(reference, ref_opt, ids, args.clip)
        out["losses"].append(float(loss))
        out["norms"].append(float(norm))
        out["loss"] = max(out["loss"], abs(float(loss) - ref_loss))
        out["norm"] = max(out["norm"], abs(float(norm) - ref_norm))
        if mesh.rank == 0:
            print(f"step {step}  loss {float(loss):.10f}  norm {float(norm):.10f}", flush=True)
    ref_state = reference.state_dict()
    state = pipe.state_dict()  # this rank's stages, by the model's own names (whole tensors)
    out["weight"] = max(float((v - ref_state[k]).abs().max()) for k, v in state.items())
    out["names"] = len(state)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks in each stage")
    p.add_argument(
        "--schedule", default="1f1b", choices=list(fd.train.schedules.NAMES), help="the schedule"
    )
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    p.add_argument("--virtual", type=int, default=1, help="stages per rank (interleaved: 2)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (global)")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=0.5, help="max gradient norm")
    p.add_argument("--tol", type=float, default=1e-9, help="largest difference accepted")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if "RANK" not in os.environ:
        raise SystemExit(
            "examples/train_pipeline.py runs on real ranks: launch it with torchrun --standalone "
            "--nproc-per-node 4 examples/train_pipeline.py (pp x tp processes, or a multiple)"
        )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = fd.connect(pp=args.pp, tp=args.tp, timeout=120)
    dp = mesh.axis_size("dp")
    if args.batch % (dp * args.microbatches):
        raise SystemExit(
            f"--batch {args.batch} must divide by dp x microbatches = {dp * args.microbatches}"
        )
    out = train(args, mesh)
    # the largest differences over every rank (each compared the stages it holds)
    worst = torch.tensor([out["loss"], out["norm"], out["weight"]], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = bool(worst.max() <= args.tol)
    if mesh.rank == 0:
        print(
            f"pipeline {args.schedule} on {mesh!r}, {args.microbatches} micro-batches: max "
            f"differences from one device: loss {worst[0]:.1e}, norm {worst[1]:.1e}, "
            f"weights {worst[2]:.1e}: {'OK' if ok else 'MISMATCH'}",
            flush=True,
        )
    fd.comm.close(mesh)
    dist.destroy_process_group()
    # exit without the interpreter's teardown: torch's native gloo threads can abort in their
    # static destructors after everything is done (see examples/train.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
