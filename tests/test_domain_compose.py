"""Domain parallelism composed with the rest of fastdist, against the unmodified models on one
device: a whole text-to-video step on one set of ranks (a tiny diffusers Wan DiT context-parallel
over ``sp``, then the Wan VAE decoding its latents domain-parallel over the same ``sp`` ranks,
split by frames or by height), on simulated ranks; and ``fastdist.train.DataParallel``'s DDP and
FSDP2 engines over ``dp`` x ``h`` on gloo processes.

Wan's DiT computes its norms and modulation in float32 on purpose, so what flows through it is
compared relative to each tensor's largest entry (1e-6), as in ``tests/test_context_parallel.py``.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fastdist as fd
from tests.test_context_parallel import inputs
from tests.test_domain_models import WanDecode
from tests.test_domain_models import tiny_wan as tiny_wan_vae
from tests.tiny_models import tiny_wan

F64 = torch.float64


def close(got: Tensor, want: Tensor, tol: float = 1e-6) -> None:
    """Equal relative to ``want``'s largest entry."""
    err = float((got.detach() - want).abs().max() / want.abs().max())
    assert err < tol, f"{err:.2e}"


def text_to_video_step(dit: Any, decode: Any, z: Tensor, t: Tensor, text: Tensor) -> Any:
    """One denoising step, then the decode: the DiT's velocity at ``t``, an Euler step of the
    latents ``z - dt * v``, and the VAE's decode of the new latents. ``dit`` and ``decode``: the
    single-device modules, or their ParallelModels (on simulated ranks every tensor has a leading
    rank dim, and the step between them runs on each rank's copy)."""
    v = dit(hidden_states=z, timestep=t, encoder_hidden_states=text).sample
    latents = z - 0.1 * v  # [(ranks,) N, 4, T, H, W]
    return latents, decode(latents)


def t2v_inputs() -> tuple[nn.Module, nn.Module, tuple[Tensor, Tensor, Tensor], Tensor]:
    """The one-layer Wan DiT, the tiny Wan VAE's decoder, the step's inputs (latents of 4
    frames, timesteps, text) and the decoded video's cotangent (float64)."""
    x = inputs(frames=4)
    dit, decoder = tiny_wan(layers=1), tiny_wan_vae().to(F64).decoder
    g = torch.Generator().manual_seed(7)
    cot = torch.randn(2, 3, 4, 8, 8, generator=g, dtype=F64)  # the decoded video
    return dit, decoder, (x["hidden_states"], x["timestep"], x["encoder_hidden_states"]), cot


@pytest.mark.parametrize(
    ("cached", "dims"), [(False, {-3: "sp"}), (True, {-2: "sp"})], ids=["frames", "height-cached"]
)
def test_text_to_video_step_dit_then_vae_on_the_same_ranks(
    cached: bool, dims: dict[int, str]
) -> None:
    """sp = 2 simulated ranks: the DiT's tokens split over ``sp`` (``parallelize(..., "auto")``:
    Wan's context-parallel plan), then the VAE decoder domain-parallel over the same ``sp`` ranks
    (by frames: 4 latent frames, 2 per rank; or by height through Wan's frame-cached
    ``decode``). The new latents, the decoded video and every gradient of a loss on the video
    (the DiT's parameters through the decode, the VAE's) equal one device's."""
    x = inputs(frames=4)
    z, t, text = x["hidden_states"], x["timestep"], x["encoder_hidden_states"]
    dit, vae = tiny_wan(layers=1), tiny_wan_vae().to(F64)
    decode: nn.Module = WanDecode(vae) if cached else vae.decoder
    ref_dit, ref_decode = copy.deepcopy(dit), copy.deepcopy(decode)
    want_lat, want_video = text_to_video_step(ref_dit, ref_decode, z, t, text)
    cot = torch.randn(want_video.shape, dtype=F64)
    (want_video * cot).sum().backward()

    mesh = fd.Mesh({"sp": 2})
    pm_dit = fd.nn.parallelize(dit, mesh, "auto", verify=x)
    assert pm_dit.plan == fd.nn.plans.wan(axis="sp")
    where = "vae.decoder" if cached else ""
    pm_vae = fd.nn.parallelize(decode, mesh, {where: fd.nn.DomainParallel(dims)})
    on_ranks = [a.expand(2, *a.shape) for a in (z, t, text)]
    lat, video = text_to_video_step(pm_dit, pm_vae, *on_ranks)
    for r in range(2):
        close(lat[r], want_lat)
        close(video[r], want_video)
    (video * cot).sum().backward()  # every rank's loss: the same video
    for pm, ref in ((pm_dit, ref_dit), (pm_vae, ref_decode)):
        grads = pm.grads()
        for name, p in ref.named_parameters():
            if p.grad is not None:
                close(grads[name], p.grad)


def test_ddp_and_fsdp_engines_over_dp_times_h_on_gloo() -> None:
    """4 gloo processes, dp 2 x h 2: the UNet-like model with H split over ``h`` and torch's DDP,
    then FSDP2 (its Sequential blocks, then the root, sharded over ``dp``), over ``dp``: the
    outputs and the weights after one SGD step equal one device on the whole batch with the
    mean of the data ranks' losses."""
    from tests.dist_harness import run_on_gloo
    from tests.domain_gloo_worker import dp_engines_on_gloo, dp_inputs

    net, x, cot = dp_inputs()
    net.mid[0] = nn.GroupNorm(2, 8).to(F64)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out = net(x.flatten(0, 1))
    (out * cot.flatten(0, 1)).sum().div(2).backward()  # the mean over the data ranks' losses
    opt.step()
    for rank, per_engine in enumerate(run_on_gloo(dp_engines_on_gloo, 4, timeout=240)):
        for engine, got in per_engine.items():
            assert torch.allclose(got["out"], out.unflatten(0, (2, 2))[rank // 2], atol=1e-10)
            for name, p in net.named_parameters():
                assert torch.allclose(got["weights"][name], p, atol=1e-10), (engine, name)


def test_domain_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/domain.py --quick: the conv net and the Wan VAE decoder at 2 gloo ranks against
    one device: every rank's output equal to one device's (float32), each rank's saved
    activations fewer than one device's, the ratios and the load reported."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/domain.py", "--quick", "--out", str(tmp_path)],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "domain.json").read_text())
    assert [(r["model"], r["ranks"]) for r in res["rows"]] == [
        ("conv net", 1), ("conv net", 2), ("Wan VAE decoder", 1), ("Wan VAE decoder", 2)
    ]  # fmt: skip
    for r in res["rows"][1::2]:
        assert r["diff"] < 1e-4 and 0 < r["mem_ratio"] < 1 and r["time_ratio"] > 0, r
    assert len(res["loadavg"]) == 2 and "| / one device |" in proc.stdout


def test_text_to_video_step_on_gloo() -> None:
    """2 gloo processes: the DiT over ``sp`` then the VAE decoder split by frames over the same
    ranks; latents, video and gradients equal one device's."""
    from tests.dist_harness import run_on_gloo
    from tests.domain_gloo_worker import text_to_video_on_gloo

    dit, decoder, (z, t, text), cot = t2v_inputs()
    lat, video = text_to_video_step(dit, decoder, z, t, text)
    assert video.shape == cot.shape
    (video * cot).sum().backward()
    for got in run_on_gloo(text_to_video_on_gloo, 2, timeout=300):
        close(got["lat"], lat)
        close(got["video"], video)
        for key, ref in (("dit", dit), ("vae", decoder)):
            for name, p in ref.named_parameters():
                if p.grad is not None:
                    close(got[key][name], p.grad)
