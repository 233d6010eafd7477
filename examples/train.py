"""A whole training run: tensor (+ sequence) parallel x data parallel x pipeline stages, with the
pieces a real run needs, on real ranks or on a simulated mesh with the same code.

    torchrun --standalone --nproc-per-node 4 examples/train.py --tp 2 --steps 20
    torchrun --standalone --nproc-per-node 4 examples/train.py --tp 4 --resume ckpt/step_10
    torchrun --standalone --nproc-per-node 8 examples/train.py --pp 2 --tp 2     # dp 2
    python examples/train.py --simulate --dp 2 --tp 2 --steps 20        # one process, no GPU

An HF Llama (``--model mixtral``: a Mixtral, experts over the ``tp`` ranks as ``ep``) built
from a small config; AdamW with linear warmup and cosine decay; gradient accumulation
(``--accum``) with the data-parallel reduction only on the last micro-batch; global-norm
clipping that every rank agrees on; bf16 autocast where the device has it (``--bf16``); a
distributed checkpoint every ``--ckpt-every`` steps (each rank writes its own slices); and
``--resume`` from any such checkpoint, at any tp / dp / pp. ``--pp`` splits the model into
pipeline stages (`fastdist.train.pipeline`, 1F1B over ``--accum`` micro-batches). ``--check``
trains the same model on one device alongside (the whole global batch) and exits non-zero if a
loss or a weight differs.

The data is text the model can learn: the Zen of Python (it ships with every Python, as the
``this`` module), one token per byte, windows of ``--seq`` bytes at random offsets. The loss
starts near ln(503) = 6.2 (uniform over the vocabulary) and falls to about 3.6 in the 20
default steps, the same at every layout (``examples/loss_curves.py`` draws it). The global
batch of every step is the same whatever the layout: ``--batch`` windows, split over the data
ranks, then into ``--accum`` micro-batches. Every sequence has the same length and no ignored
labels, so the mean of the per-rank losses is the single-device loss.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import copy
import io
import math
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

import fastdist as fd


def build_model(kind: str, dtype: torch.dtype, seed: int = 0) -> Any:
    """The single-device model, the same on every rank (same seed)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=503,  # prime: the vocabulary-parallel head pads it; the bytes use 0..255
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,  # a tied weight would span the first and the last stage
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "mixtral":
        config = transformers.MixtralConfig(
            **common,
            num_local_experts=4,
            num_experts_per_tok=2,
            output_router_logits=False,  # the aux loss of a batch is not the mean over ranks
            experts_implementation="eager",
        )
        model = transformers.MixtralForCausalLM(config)
    else:
        raise SystemExit(f"--model {kind!r}: use llama or mixtral")
    return model.to(dtype).train()


def corpus() -> torch.Tensor:
    """The training text as token ids, one per byte (0..255): the Zen of Python, which ships
    with every Python as the module ``this`` (ROT13-encoded; importing it prints it)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return torch.tensor(list(codecs.decode(this.s, "rot13").encode()), dtype=torch.long)


def global_batch(step: int, args: argparse.Namespace, text: torch.Tensor) -> torch.Tensor:
    """Step ``step``'s ``--batch`` windows of ``--seq`` tokens of ``text`` at random offsets
    (the same on every rank): ``[batch, seq]``."""
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, len(text) - args.seq + 1, (args.batch,), generator=g)
    return torch.stack([text[s : s + args.seq] for s in starts.tolist()])


def lr_lambda(args: argparse.Namespace) -> Any:
    """Linear warmup over ``--warmup`` steps, then cosine decay to 10% at ``--steps``."""

    def f(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        done = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))

    return f


def make_mesh(args: argparse.Namespace) -> fd.Mesh:
    """``dp x tp`` (``ep`` for Mixtral), with ``--pp`` > 1 ``pp x dp x tp``; real ranks: the
    world is ``dp`` times the others."""
    inner = {"ep" if args.model == "mixtral" else "tp": args.tp}
    pp = {"pp": args.pp} if args.pp > 1 else {}
    if args.simulate:
        return fd.Mesh({**pp, "dp": args.dp, **inner})
    import torch.distributed as dist

    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    return fd.connect(**pp, **inner, timeout=120)


def rank_slices(mesh: fd.Mesh, ids: torch.Tensor, accum: int) -> list[torch.Tensor]:
    """The ``accum`` micro-batches of every rank: [world, b, S] stacked on a simulated mesh, this
    rank's [b, S] on real ranks. Data rank ``i`` takes the ``i``-th slice of the global batch."""
    dp = mesh.axis_size("dp")
    per = ids.shape[0] // (dp * accum)
    # [batch, S] -> [dp, accum, per, S]: data rank, micro-batch, sequences
    split = ids.view(dp, accum, per, ids.shape[-1])
    ranks = range(mesh.size) if mesh.backend is None else [mesh.rank]
    micro = []
    for a in range(accum):
        rows = [split[mesh.coords(r)["dp"], a] for r in ranks]
        micro.append(torch.stack(rows) if mesh.backend is None else rows[0])
    return micro


def parallel_model(args: argparse.Namespace, mesh: fd.Mesh, model: Any) -> tuple[Any, Any]:
    """``(the parallel model, its data-parallel reducer)``: a `fastdist.nn.ParallelModel`, or
    with ``--pp`` > 1 a `fastdist.train.Pipeline` over ``--accum`` micro-batches (its reducer
    reduces in the backward of each stage's last micro-batch; None at ``dp`` 1)."""
    if "pp" in mesh.shape:
        pipe = fd.train.pipeline(
            model, mesh, schedule="1f1b", microbatches=args.accum, sequence_parallel=args.sp
        )
        dp = mesh.axis_size("dp") > 1
        return pipe, fd.train.DataParallel(pipe, "dp", engine=args.engine) if dp else None
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=args.sp))
    return pm, fd.train.DataParallel(pm, "dp", engine=args.engine)


def parallel_step(
    args: argparse.Namespace, mesh: fd.Mesh, pm: Any, reducer: Any, ids: torch.Tensor
) -> tuple[float, torch.Tensor]:
    """Forward and backward of one step's global batch ``ids`` on the parallel model, then the
    clip: ``(the global batch's mean loss, the single-device gradient norm before clipping)``."""
    simulated = mesh.backend is None
    use_bf16 = args.bf16 and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if "pp" in mesh.shape:  # the pipeline runs the micro-batches itself; same batch along pp
        local = rank_slices(mesh, ids, 1)[0]
        with torch.autocast("cuda", torch.bfloat16, enabled=use_bf16):
            loss = pm.step(input_ids=local, labels=local)  # [world] simulated
        # the mean over the data ranks (the ranks of a data rank's pp x tp hold the same loss)
        mean = loss.mean() if simulated else fd.pmean(loss, mesh, "dp")
        return float(mean), pm.clip_grad_norm_(args.clip)
    total = 0.0
    for i, micro in enumerate(rank_slices(mesh, ids, args.accum)):
        last = i == args.accum - 1
        with (
            torch.autocast("cuda", torch.bfloat16, enabled=use_bf16),
            reducer.no_sync() if not last else contextlib.nullcontext(),
        ):
            loss = pm(input_ids=micro, labels=micro).loss  # [world] simulated
            (loss.sum() if simulated else loss).div(args.accum).backward()
        # the mean over the data ranks (tp ranks hold the same loss)
        mean = loss.detach().mean() if simulated else fd.pmean(loss.detach(), mesh, "dp")
        total += float(mean) / args.accum
    return total, fd.nn.clip_grad_norm_(pm, args.clip)


def one_device_step(
    model: Any, opt: torch.optim.Optimizer, sched: Any, ids: torch.Tensor, clip: float
) -> tuple[float, float]:
    """One device's step on the whole global batch ``ids`` (plain torch: the model's loss in
    its dtype, torch's clip, AdamW, the schedule): ``(loss, norm before clipping)``."""
    vocab = model.config.vocab_size
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    sched.step()
    opt.zero_grad()
    return float(loss.detach()), float(norm)


def one_device(args: argparse.Namespace) -> list[float]:
    """The same run on one device, no fastdist: every step's loss on the whole global batch."""
    model = build_model(
        args.model, {"float64": torch.float64, "float32": torch.float32}[args.dtype]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    text = corpus()
    steps = range(args.steps)
    return [
        one_device_step(model, opt, sched, global_batch(s, args, text), args.clip)[0] for s in steps
    ]


def train(args: argparse.Namespace, mesh: fd.Mesh) -> dict[str, Any]:
    """The run; returns the losses and, with ``--check``, the one-device losses and the largest
    differences from one device."""
    dtype = {"float64": torch.float64, "float32": torch.float32}[args.dtype]
    model = build_model(args.model, dtype)
    for m in model.modules():  # no dropout in these configs; say so if a config adds one
        assert not isinstance(m, torch.nn.Dropout) or m.p == 0
    reference = copy.deepcopy(model) if args.check else None
    pm, reducer = parallel_model(args, mesh, model)
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    if reference is not None:
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.1)
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lr_lambda(args))
    start = 0
    if args.resume:
        extra = fd.checkpoint.load(args.resume, pm, opt)
        start = int(extra["step"])
        sched.load_state_dict(extra["scheduler"])
        if reference is not None:  # the one-device run resumes from the same checkpoint
            fd.checkpoint.load(args.resume, reference, ref_opt)
            ref_sched.load_state_dict(extra["scheduler"])
    text = corpus()
    out: dict[str, Any] = {"losses": [], "one_device_losses": []}
    worst = {"loss": 0.0, "norm": 0.0}
    for step in range(start, args.steps):
        ids = global_batch(step, args, text)
        loss, norm = parallel_step(args, mesh, pm, reducer, ids)
        opt.step()
        sched.step()
        opt.zero_grad()
        out["losses"].append(loss)
        if reference is not None:
            ref_loss, ref_norm = one_device_step(reference, ref_opt, ref_sched, ids, args.clip)
            out["one_device_losses"].append(ref_loss)
            worst["norm"] = max(worst["norm"], abs(float(norm.reshape(-1)[0]) - ref_norm))
            worst["loss"] = max(worst["loss"], abs(loss - ref_loss))
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            path = os.path.join(args.ckpt_dir, f"step_{step + 1}")
            fd.checkpoint.save(
                path, pm, opt, extra={"step": step + 1, "scheduler": sched.state_dict()}
            )
        if _is_first(mesh) and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss:.6f}  norm {float(norm.reshape(-1)[0]):.4f}")
    out["state"] = pm.state_dict()  # a pipeline: the stages held here
    if reference is not None:
        ref_state = reference.state_dict()
        out["max_weight_diff"] = max(
            float((v - ref_state[k]).abs().max()) for k, v in out["state"].items()
        )
        out["max_norm_diff"], out["max_loss_diff"] = worst["norm"], worst["loss"]
    return out


def _is_first(mesh: fd.Mesh) -> bool:
    return mesh.backend is None or mesh.rank == 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama", choices=["llama", "mixtral"])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (ep for mixtral)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (1: no pipeline)")
    p.add_argument(
        "--dp", type=int, default=2, help="data-parallel ranks (--simulate; real ranks: the rest)"
    )
    p.add_argument(
        "--sp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sequence parallelism (default: on for llama; the Mixtral plan has none)",
    )
    p.add_argument("--engine", default="fastdist", choices=["fastdist", "ddp", "fsdp"])
    p.add_argument("--simulate", action="store_true", help="simulated ranks in this process")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (global)")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument(
        "--accum", type=int, default=2, help="micro-batches per step (--pp: the pipeline's)"
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (where the device has it)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--resume", default="")
    p.add_argument("--check", action="store_true", help="compare with one device; exit 1 if off")
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args(argv)
    if args.sp is None:
        args.sp = args.model == "llama"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.pp > 1 and args.engine == "ddp":
        raise SystemExit(
            f"--pp {args.pp} --engine ddp: a pipeline takes fastdist's engine or fsdp (DDP's "
            "hooks do not fit a stage's micro-batches)"
        )
    if args.pp > 1 and args.model == "mixtral":
        raise SystemExit(
            f"--pp {args.pp} --model mixtral: the pipeline's plan has no ep axis for the experts; "
            "use --pp with llama, or mixtral without --pp"
        )
    mesh = make_mesh(args)
    dp = mesh.axis_size("dp")
    if args.batch % (dp * args.accum):
        raise SystemExit(f"--batch {args.batch} must divide by dp x accum = {dp * args.accum}")
    out = train(args, mesh)
    ok = True
    if args.check:
        tol = 1e-9 if args.dtype == "float64" else 1e-4
        diffs = {k: out[f"max_{k}_diff"] for k in ("loss", "norm", "weight")}
        if not args.simulate:  # each rank compared the weights it holds (a pipeline: its stages)
            import torch.distributed as dist

            worst = torch.tensor(list(diffs.values()), dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            diffs = dict(zip(diffs, worst.tolist()))
        ok = max(diffs.values()) <= tol
        if _is_first(mesh):
            print(
                f"train on {mesh!r}: max differences from one device: "
                + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())
                + f": {'OK' if ok else 'MISMATCH'}"
            )
    if not args.simulate:
        import torch.distributed as dist

        fd.comm.close(mesh)
        dist.destroy_process_group()
        # exit without the interpreter's teardown: torch's native gloo threads can abort in their
        # static destructors after everything is done (SIGABRT at exit, seen on 8 ranks)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if ok else 1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
