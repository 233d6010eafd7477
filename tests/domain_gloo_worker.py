"""Domain-parallel scenarios on real gloo ranks (`tests/test_domain.py` runs them with
`fastdist.testing.run_on_gloo`) and the UNet-like model they share with the simulated tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fastdist as fd

F64 = torch.float64


class TinyUNet(nn.Module):
    """Conv, group norm, pooling down, batch norm, transposed conv up, a skip connection, average
    pooling, bilinear upsampling. ``track``: the batch norm keeps running statistics (updated in
    training mode: real ranks only)."""

    def __init__(self, track: bool = False) -> None:
        super().__init__()
        self.inc = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU())
        self.down = nn.Sequential(
            nn.MaxPool2d(2), nn.Conv2d(4, 8, 3, padding=1, padding_mode="reflect")
        )
        self.mid = nn.Sequential(nn.BatchNorm2d(8, track_running_stats=track), nn.GELU())
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.out = nn.Sequential(
            nn.Conv2d(8, 4, 3, padding=1, padding_mode="circular"),
            nn.AvgPool2d(3, 1, 1, count_include_pad=False),
            nn.Upsample(scale_factor=2, mode="bilinear"),
            nn.Conv2d(4, 2, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        a = self.inc(x)
        b = self.up(self.mid(self.down(a)))
        return self.out(torch.cat([a, b], dim=1))


def unet_and_inputs() -> tuple[nn.Module, Tensor, Tensor]:
    """The model (running statistics on), its input field and the output's cotangent."""
    torch.manual_seed(1)
    net = TinyUNet(track=True).to(F64)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 2, 8, 12, generator=g, dtype=F64)
    return net, x, torch.randn(2, 2, 16, 24, generator=g, dtype=F64)


def unet_on_gloo() -> dict[str, Any]:
    """One rank of a 2 x 2 mesh (H over ``h``, W over ``w``): the model forward and backward in
    training mode, with even blocks and with uneven W blocks (4 and 8 columns); the whole outputs,
    the input and parameter gradients, the running statistics."""
    mesh = fd.connect(dp=1, h=2, w=2, order=("dp", "h", "w"), timeout=120)
    results = {}
    for name, sizes in [("even", None), ("uneven", {-1: [4, 8]})]:
        net, x, cot = unet_and_inputs()
        style = fd.nn.DomainParallel({-2: "h", -1: "w"}, sizes=sizes)
        pm = fd.nn.parallelize(net, mesh, {"": style})
        xr = x.clone().requires_grad_()
        out = pm(xr)
        (out * cot).sum().backward()
        bn: Any = net.mid[0]
        results[name] = {
            "out": out.detach(),
            "dx": xr.grad,
            "grads": pm.grads(),
            "running": (bn.running_mean.clone(), bn.running_var.clone()),
        }
    return results


def vae_attention_inputs() -> tuple[nn.Module, Tensor, Tensor]:
    """A tiny diffusers ``AutoencoderKL`` decoder with its mid-block attention, a 4 x 6 latent and
    the output's cotangent."""
    from tests.test_domain_models import tiny_vae

    net = tiny_vae(attention=True).decoder.to(F64)
    g = torch.Generator().manual_seed(3)
    z = torch.randn(1, 4, 4, 6, generator=g, dtype=F64)
    return net, z, torch.randn(1, 3, 8, 12, generator=g, dtype=F64)


def vae_attention_on_gloo() -> dict[str, Any]:
    """One rank of 2 (W over ``w``, uneven blocks of 2 and 4 latent columns): the decoder's
    attention gathers keys of different lengths (``all_gather_v``), or passes them around a ring
    (padded to one length, the padding masked); output and gradients of each."""
    mesh = fd.connect(w=2, timeout=120)
    results = {}
    for form in ("gather", "ring"):  # the keys gathered, or passed around (padded to travel)
        net, z, cot = vae_attention_inputs()
        style = fd.nn.DomainParallel({-1: "w"}, sizes={-1: [2, 4]}, attention=form)
        pm = fd.nn.parallelize(net, mesh, {"": style})
        zr = z.clone().requires_grad_()
        out = pm(zr)
        (out * cot).sum().backward()
        results[form] = {"out": out.detach(), "dz": zr.grad, "grads": pm.grads()}
    return results


def dp_inputs() -> tuple[nn.Module, Tensor, Tensor]:
    """The UNet-like model (running statistics on), a batch of 2 per data rank
    ``[dp, batch, C, H, W]`` and the output's cotangent."""
    torch.manual_seed(4)
    net = TinyUNet(track=True).to(F64)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 2, 2, 8, 12, generator=g, dtype=F64)
    return net, x, torch.randn(2, 2, 2, 16, 24, generator=g, dtype=F64)


def dp_step_on_gloo() -> dict[str, Any]:
    """One rank of dp 2 x h 2: H split over ``h``, ``fastdist.train.DataParallel`` over ``dp``,
    the batch norm's statistics over both (``batch_axes=("dp",)``); one SGD step in training
    mode: the output, the weights after the step, the running statistics."""
    mesh = fd.connect(dp=2, h=2, order=("dp", "h"), timeout=120)
    net, x, cot = dp_inputs()
    r = mesh.rank // 2  # this rank's data index (dp, h row-major)
    style = fd.nn.DomainParallel({-2: "h"}, batch_axes=("dp",))
    pm = fd.nn.parallelize(net, mesh, {"": style})
    dp = fd.train.DataParallel(pm, "dp")
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    out = pm(x[r])
    (out * cot[r]).sum().backward()
    dp.finish()
    opt.step()
    bn: Any = net.mid[0]
    return {
        "out": out.detach(),
        "weights": {n: p.detach().clone() for n, p in net.named_parameters()},
        "running": (bn.running_mean.clone(), bn.running_var.clone()),
    }


def dp_engines_on_gloo() -> dict[str, Any]:
    """One rank of dp 2 x h 2: H split over ``h``, torch's DDP and FSDP2 engines over ``dp``
    (``fastdist.train.DataParallel(engine=...)``), a group norm (statistics per sample); one SGD
    step each: the output and the whole weights after the step (``pm.state_dict()``)."""
    mesh = fd.connect(dp=2, h=2, order=("dp", "h"), timeout=120)
    r = mesh.rank // 2  # this rank's data index (dp, h row-major)
    results = {}
    for engine in ("ddp", "fsdp"):
        net, x, cot = dp_inputs()
        net.mid[0] = nn.GroupNorm(2, 8).to(F64)
        pm = fd.nn.parallelize(net, mesh, {"": fd.nn.DomainParallel({-2: "h"})})
        kwargs = {"blocks": ["Sequential"]} if engine == "fsdp" else {}
        fd.train.DataParallel(pm, "dp", engine=engine, **kwargs)
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        out = pm(x[r])
        (out * cot[r]).sum().backward()
        opt.step()
        results[engine] = {
            "out": out.detach(),
            "weights": {n: v.detach().clone() for n, v in pm.state_dict().items()},
        }
    return results


def text_to_video_on_gloo() -> dict[str, Any]:
    """One rank of sp 2: the Wan DiT context-parallel over ``sp`` then the Wan VAE decoder split
    by frames over the same ranks (`tests/test_domain_compose.py`'s step); the latents, the
    video and the gradients of a loss on the video."""
    from tests.test_domain_compose import t2v_inputs, text_to_video_step

    mesh = fd.connect(sp=2, timeout=120)
    dit, decoder, (z, t, text), cot = t2v_inputs()
    pm_dit = fd.nn.parallelize(dit, mesh, fd.nn.plans.wan(axis="sp"))
    pm_vae = fd.nn.parallelize(decoder, mesh, {"": fd.nn.DomainParallel({-3: "sp"})})
    lat, video = text_to_video_step(pm_dit, pm_vae, z, t, text)
    (video * cot).sum().backward()
    return {"lat": lat.detach(), "video": video.detach(), "dit": pm_dit.grads(),
            "vae": pm_vae.grads()}  # fmt: skip


def vae_ring_grid_on_gloo() -> dict[str, Any]:
    """One rank of a 2 x 2 grid (H over ``h``, W over ``w``, uneven W blocks of 2 and 4 latent
    columns): the decoder's attention as one ring over both axes (``ring_shift`` over the pair,
    each block padded to the largest to travel); output and gradients."""
    mesh = fd.connect(h=2, w=2, timeout=120)
    net, z, cot = vae_attention_inputs()
    style = fd.nn.DomainParallel({-2: "h", -1: "w"}, sizes={-1: [2, 4]}, attention="ring")
    pm = fd.nn.parallelize(net, mesh, {"": style})
    zr = z.clone().requires_grad_()
    out = pm(zr)
    (out * cot).sum().backward()
    return {"out": out.detach(), "dz": zr.grad, "grads": pm.grads()}


class Checkpointed(nn.Module):
    """A convolution recomputed by activation checkpointing in the backward (``reentrant``: a
    reentrant checkpoint, which detaches its inputs)."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.reentrant = reentrant

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = torch.utils.checkpoint.checkpoint(self.conv, x, use_reentrant=self.reentrant)
        return out


class Up(nn.Module):
    """A convolution, then the model's own bilinear ``F.interpolate`` (run domain-parallel by
    the style's functional guard), then a sine (which saves the interpolation for the backward:
    a checkpoint must recompute it)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(F.interpolate(self.conv(x), scale_factor=2, mode="bilinear"))


class CheckpointedNet(nn.Module):
    """Modules of a domain-parallel region checkpointed (``use_reentrant=False``): a conv block
    with a group norm, an upsampling module whose ``F.interpolate`` the guard converts, a
    convolution; ``how="function"``: a checkpointed function that calls ``F.interpolate``
    itself, outside a module (refused at the forward)."""

    def __init__(self, how: str = "modules") -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU())
        self.up = Up()
        self.out = nn.Conv2d(4, 2, 3, padding=1)
        self.how = how

    def forward(self, x: Tensor) -> Tensor:
        def ck(f: Any, t: Tensor) -> Tensor:
            out: Tensor = torch.utils.checkpoint.checkpoint(f, t, use_reentrant=False)
            return out

        if self.how == "function":
            y = ck(lambda t: F.interpolate(self.block(t), scale_factor=2, mode="bilinear"), x)
        else:
            y = ck(self.up, ck(self.block, x))
        return ck(self.out, y)


def checkpointed_inputs() -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(4)
    net = CheckpointedNet().to(F64)
    x = torch.randn(2, 2, 8, 6, generator=g, dtype=F64)
    return net, x, torch.randn(2, 2, 16, 12, generator=g, dtype=F64)


def checkpointed_on_gloo() -> dict[str, Any]:
    """One rank of 2 (H over ``h``): `CheckpointedNet` forward and backward, its modules
    recomputed in the backward inside the region; and the refusal of a checkpointed function
    that interpolates outside a module."""
    mesh = fd.connect(h=2, timeout=120)
    net, x, cot = checkpointed_inputs()
    pm = fd.nn.parallelize(net, mesh, {"": fd.nn.DomainParallel({-2: "h"})})
    xr = x.clone().requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = pm(xr)
        (out * cot).sum().backward()
    # 4 in the forward, 2 recomputed (the block's and up's: the last convolution saves only its
    # input, so its checkpoint recomputes nothing)
    convs = sum(e.name == "aten::convolution" for e in prof.events())
    result: dict[str, Any] = {"out": out.detach(), "dx": xr.grad, "grads": pm.grads()}
    result["convolutions"] = convs
    net, x, cot = checkpointed_inputs()  # uneven blocks: rank 0 2 rows of H, rank 1 6
    pm = fd.nn.parallelize(net, mesh, {"": fd.nn.DomainParallel({-2: "h"}, sizes={-2: [2, 6]})})
    xr = x.clone().requires_grad_()
    out = pm(xr)
    (out * cot).sum().backward()
    result["uneven"] = {"out": out.detach(), "dx": xr.grad, "grads": pm.grads()}
    bad = CheckpointedNet("function").to(F64)
    pm2 = fd.nn.parallelize(bad, mesh, {"": fd.nn.DomainParallel({-2: "h"})})
    try:
        pm2(x.clone().requires_grad_())
        result["function"] = None
    except fd.nn.ParallelizeError as e:
        result["function"] = str(e)
    return result


def outside_region_on_gloo() -> dict[str, str]:
    """One rank of 2 (H over ``h``): the errors of a layer called directly and of one recomputed
    by activation checkpointing in the backward."""
    mesh = fd.connect(h=2, timeout=60)
    net = Checkpointed(reentrant=True).to(F64)
    pm = fd.nn.parallelize(net, mesh, {"": fd.nn.DomainParallel({-2: "h"})})
    errors = {}
    try:
        net.conv(torch.zeros(1, 2, 4, 4, dtype=F64))
    except fd.nn.ParallelizeError as e:
        errors["direct"] = str(e)
    out = pm(torch.randn(1, 2, 8, 4, dtype=F64, requires_grad=True))
    try:
        out.sum().backward()
    except fd.nn.ParallelizeError as e:
        errors["checkpoint"] = str(e)
    return errors
