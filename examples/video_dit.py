"""A video diffusion transformer's denoising loop with classifier-free-guidance parallelism and
context parallelism: a tiny diffusers ``WanTransformer3DModel`` on a ``cfg`` x ``sp`` mesh (or
``cfg`` x ``cp`` x ``sp`` for USP), checked against the same loop on one device.

    python examples/video_dit.py                         # simulated ranks: cfg=2 x sp=2
    python examples/video_dit.py --sp 4 --mode ring      # simulated: cfg=2 x sp=4, ring attention
    torchrun --standalone --nproc-per-node 4 examples/video_dit.py             # gloo: cfg=2 x sp=2
    torchrun --standalone --nproc-per-node 8 examples/video_dit.py --mode usp  # cfg x cp=2 x sp=2

Every process builds the same seeded float64 model, keeps a copy for the one-device reference
and parallelizes the other with Wan's ready plan (`fastdist.nn.plans.wan`): the video's tokens
(2 frames x 3 x 3 patches = 18, which 4 ranks split 5+5+4+4) are split over ``sp`` (and ``cp``)
with Ulysses, ring or USP self-attention. `fastdist.nn.GuidedModel` runs the conditional branch
(the prompt's states) on ``cfg`` rank 0 and the unconditional one (the negative prompt's) on
``cfg`` rank 1 and combines them on every rank. diffusers' ``FlowMatchEulerDiscreteScheduler``
then steps the latents, the same on every rank.

At the end rank 0 compares the latents with the one-device loop's (the model run twice per step,
once per branch): ``OK`` (exit 0) or ``MISMATCH`` (exit 1). The scheduler steps in float32 (as
diffusers does), so the two loops may differ by float32 rounding: the tolerance is 1e-6.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

import fastdist as fd

TEXT_DIM, CHANNELS, TEXT_TOKENS = 16, 4, 5


def build_model(heads: int = 4, seed: int = 0) -> Any:
    """The tiny Wan text-to-video transformer, float64, the same on every rank (same seed)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=12,
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        text_dim=TEXT_DIM,
        freq_dim=16,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
    )
    return model.to(torch.float64).eval()


def make_inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The initial noise (1 video, 2 frames of 6 x 6 latents: 18 tokens) and the prompt's and
    negative prompt's text states (as a text encoder would give them)."""
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, CHANNELS, 2, 6, 6, generator=g, dtype=torch.float64)
    cond = torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=g, dtype=torch.float64)
    uncond = torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=g, dtype=torch.float64)
    return latents, cond, uncond


def denoise(
    predict: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    latents: torch.Tensor,
    steps: int,
) -> torch.Tensor:
    """``steps`` flow-matching Euler steps from ``latents``; ``predict(latents, t)`` is the
    guided velocity prediction."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(steps)
    for t in scheduler.timesteps:
        pred = predict(latents, t.expand(latents.shape[0]))
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    return latents


def one_device(
    model: Any, latents: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor, args: Any
) -> torch.Tensor:
    """The reference loop: both branches on one device."""

    def predict(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            c = model(hidden_states=x, timestep=t, encoder_hidden_states=cond).sample
            u = model(hidden_states=x, timestep=t, encoder_hidden_states=uncond).sample
        return u + args.guidance * (c - u)

    return denoise(predict, latents, args.steps)


def parallel(
    model: Any,
    mesh: fd.Mesh,
    latents: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor,
    args: Any,
) -> torch.Tensor:
    """The loop over ``mesh``: guidance over ``cfg``, the tokens over ``sp`` (and ``cp``)."""
    ring_axis = "cp" if args.mode == "usp" else None
    plan = fd.nn.plans.wan(model, mesh, mode=args.mode, ring_axis=ring_axis)
    guided = fd.nn.GuidedModel(fd.nn.parallelize(model, mesh, plan), args.guidance)

    def predict(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return guided(hidden_states=x, timestep=t, encoder_hidden_states=cond, uncond=uncond)

    return denoise(predict, latents, args.steps)


def mesh_for(args: Any, world: int | None) -> fd.Mesh:
    """cfg x sp (x cp for USP): from the world size under torchrun, else ``--sp``/``--cp``."""
    cp = 2 if args.mode == "usp" else 1
    if world is None:
        return fd.Mesh({"cfg": 2, "cp": cp, "sp": args.sp} if cp > 1 else {"cfg": 2, "sp": args.sp})
    sp = world // (2 * cp)
    if sp < 1 or 2 * cp * sp != world:
        sys.exit(
            f"video_dit: {world} processes do not make cfg=2 x cp={cp} x sp; use "
            f"{2 * cp * 2} (or another multiple of {2 * cp})"
        )
    sizes = {"cfg": 2, "cp": cp, "sp": sp} if cp > 1 else {"cfg": 2, "sp": sp}
    return fd.connect(timeout=120, **sizes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="denoising steps")
    parser.add_argument("--guidance", type=float, default=5.0, help="guidance scale")
    parser.add_argument("--mode", choices=["ulysses", "ring", "usp"], default="ulysses")
    parser.add_argument("--sp", type=int, default=2, help="sp size on simulated ranks")
    args = parser.parse_args(argv)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    torch.set_num_threads(1)
    if not torchrun:
        return run(args, mesh_for(args, None), torchrun)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        mesh = mesh_for(args, dist.get_world_size())
        try:
            return run(args, mesh, torchrun)
        finally:
            fd.comm.close(mesh)  # its groups released now, not torn down at interpreter exit
    finally:
        dist.destroy_process_group()


def run(args: Any, mesh: fd.Mesh, torchrun: bool) -> int:
    """Both loops; rank 0 prints the difference and OK / MISMATCH."""
    model = build_model()
    reference = copy.deepcopy(model)
    latents, cond, uncond = make_inputs()
    got = parallel(model, mesh, latents, cond, uncond, args)
    want = one_device(reference, latents, cond, uncond, args)
    err = float((got - want).abs().max())
    if int(os.environ.get("RANK", "0")) == 0:
        where = "gloo processes" if torchrun else "simulated ranks"
        print(
            f"{args.steps} guided steps on {mesh!r} ({where}, {args.mode}): "
            f"max |latents - one device| = {err:.1e}"
        )
        print("OK" if err < 1e-6 else "MISMATCH")
    return 0 if err < 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
