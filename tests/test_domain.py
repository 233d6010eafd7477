"""`fastdist.nn.DomainParallel`: unmodified conv nets split over H, H x W and T x H x W on
simulated ranks, against the same net on one device in float64, forward and backward (the output,
the input's gradient and every parameter's gradient), and the refusals."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fastdist as fd
from tests.domain_gloo_worker import TinyUNet, unet_and_inputs, unet_on_gloo

F64 = torch.float64
TOL = 1e-10
MESHES = {
    "h": ({"h": 2}, {-2: "h"}),
    "h3": ({"h": 3}, {-2: "h"}),
    "hw": ({"h": 2, "w": 2}, {-2: "h", -1: "w"}),
    "w": ({"w": 2}, {-1: "w"}),
    "thw": ({"t": 2, "h": 2, "w": 2}, {-3: "t", -2: "h", -1: "w"}),
}


def equal_to_one_device(
    net: nn.Module,
    shape: tuple[int, ...],
    split: str,
    *,
    call: Callable[[Any, Tensor], Tensor] | None = None,
    seed: int = 0,
    plan_key: str = "",
    **style: Any,
) -> fd.nn.ParallelModel:
    """``net`` domain-parallel over ``MESHES[split]`` equals ``net`` on one device: the output,
    the input's gradient (on every rank's copy) and every parameter's gradient (every rank's output
    weighted by the same cotangent, as every rank computing the same loss does)."""
    torch.manual_seed(seed)
    net = net.to(F64)
    ref = copy.deepcopy(net)
    axes, dims = MESHES[split]
    mesh = fd.Mesh(axes)
    x = torch.randn(*shape, dtype=F64)
    run = call or (lambda m, t: m(t))
    want = run(ref, xr := x.clone().requires_grad_())
    pm = fd.nn.parallelize(net, mesh, {plan_key: fd.nn.DomainParallel(dims, **style)})
    xs = x.expand(mesh.size, *shape).clone().requires_grad_()
    got = run(pm, xs)
    assert got.shape == (mesh.size, *want.shape)
    assert torch.allclose(got, want.expand_as(got), atol=TOL), (got - want).abs().max()
    cot = torch.randn(want.shape, dtype=F64)
    (want * cot).sum().backward()
    (got * cot).sum().backward()
    assert xs.grad is not None and xr.grad is not None
    # the field is replicated: every rank's copy gets the whole gradient (local_chunk's rule)
    assert torch.allclose(xs.grad, xr.grad.expand_as(xs.grad), atol=TOL)
    grads = pm.grads()  # checks every rank's replicated gradient agrees
    used = 0
    for name, p in ref.named_parameters():
        if p.grad is None:  # unused on one device too (Wan's time_conv without a frame cache)
            assert name not in grads or not grads[name].any(), name
            continue
        used += 1
        assert torch.allclose(grads[name], p.grad, atol=TOL), name
    assert len(grads) >= used == len([p for p in ref.parameters() if p.grad is not None])
    return pm


# ------------------------------------------------------------------ convolutions
CONVS = [
    ("h", nn.Conv2d(2, 4, 3, padding=1), (2, 2, 8, 5)),
    ("hw", nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect", groups=2), (1, 2, 6, 8)),
    ("hw", nn.Conv2d(2, 4, 3, padding=1, padding_mode="replicate", stride=2), (1, 2, 8, 8)),
    ("h3", nn.Conv2d(2, 4, 5, padding=4, dilation=2, padding_mode="circular"), (1, 2, 12, 5)),
    ("hw", nn.Conv2d(2, 4, (3, 5), padding="same", padding_mode="circular"), (1, 2, 6, 8)),
    ("h", nn.Conv2d(2, 4, 4, padding="same"), (1, 2, 8, 4)),
    ("hw", nn.Conv2d(2, 4, 2, stride=2), (1, 2, 8, 8)),
    ("w", nn.Conv1d(2, 3, 3, padding=1, padding_mode="reflect"), (2, 2, 8)),
    ("thw", nn.Conv3d(2, 3, 3, padding=1), (1, 2, 4, 4, 6)),
    ("thw", nn.Conv3d(2, 3, (1, 3, 3), padding=(0, 1, 1), stride=(1, 2, 2)), (1, 2, 4, 8, 4)),
]


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize(("split", "conv", "shape"), CONVS)
def test_convolutions(split: str, conv: nn.Module, shape: tuple[int, ...]) -> None:
    equal_to_one_device(conv, shape, split)


def test_a_padding_module_on_a_split_dim_is_refused() -> None:
    """A module that pads by itself would pad every rank's block: refused, named, unless it is a
    zero padding right before a convolution (folded into its halo, below)."""
    net = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.MaxPool2d(2))
    with pytest.raises(fd.nn.ParallelizeError, match=r"'0' \(ZeroPad2d\): a zero padding"):
        fd.nn.parallelize(net, fd.Mesh({"h": 2}), {"": fd.nn.DomainParallel({-2: "h"})})


# ------------------------------------------------------------------ causal convolutions (Wan)
def _wan_conv(cin: int, cout: int, k: int = 3, padding: int = 1) -> nn.Module:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return WanCausalConv3d(cin, cout, k, padding=padding)


class CachedWan(nn.Module):
    """Two causal convs and Wan's channel RMS norm; with ``cached``, the first conv gets the
    first two frames as ``cache_x`` (earlier frames, as Wan's chunked decode passes them) and
    the rest as its input."""

    def __init__(self, cached: bool) -> None:
        super().__init__()
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

        self.cached = cached
        self.conv1 = _wan_conv(2, 4)
        self.norm = WanRMS_norm(4, images=False)
        self.act = nn.SiLU()
        self.conv2 = _wan_conv(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(x[:, :, 2:], cache_x=x[:, :, :2]) if self.cached else self.conv1(x)
        return self.conv2(self.act(self.norm(h)))


def test_wan_causal_conv() -> None:
    """diffusers' ``WanCausalConv3d`` (causal T padding ``(2, 0)``) split over T x H x W, and
    over H x W with its frame cache; a cache with T split is refused."""
    equal_to_one_device(CachedWan(False), (1, 2, 4, 4, 4), "thw")
    equal_to_one_device(CachedWan(True), (1, 2, 5, 4, 4), "hw")
    net = CachedWan(True).double()
    pm = fd.nn.parallelize(net, fd.Mesh({"t": 2}), {"": fd.nn.DomainParallel({-3: "t"})})
    # the model slices the split T itself (x[:, :, 2:]): refused there, before the cache
    with pytest.raises(fd.nn.ParallelizeError, match=r"cache_x|a slice slice\(2, None, None\)"):
        pm(torch.zeros(2, 1, 2, 8, 4, 4, dtype=F64))


# ------------------------------------------------------------------ transposed convolutions
CONVTS = [
    ("h", nn.ConvTranspose2d(2, 3, 4, stride=2, padding=1), (1, 2, 4, 5)),
    ("hw", nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1), (1, 2, 4, 6)),
    ("hw", nn.ConvTranspose2d(4, 2, 2, stride=2, groups=2), (1, 4, 4, 4)),
    ("h3", nn.ConvTranspose2d(2, 2, 3, padding=1), (1, 2, 6, 3)),
    ("h", nn.ConvTranspose2d(2, 2, 3, stride=2, padding=2, dilation=2, output_padding=1),
     (1, 2, 4, 3)),
    ("w", nn.ConvTranspose1d(2, 3, 5, stride=3, padding=1), (2, 2, 4)),
    ("thw", nn.ConvTranspose3d(2, 2, (1, 4, 4), stride=(1, 2, 2), padding=(0, 1, 1)),
     (1, 2, 2, 4, 4)),
]  # fmt: skip


@pytest.mark.parametrize(("split", "conv", "shape"), CONVTS)
def test_transposed_convolutions(split: str, conv: nn.Module, shape: tuple[int, ...]) -> None:
    equal_to_one_device(conv, shape, split)


# ------------------------------------------------------------------ pooling
POOLS = [
    ("hw", nn.MaxPool2d(2), (1, 2, 8, 8)),
    ("hw", nn.MaxPool2d(3, 1, 1), (1, 2, 6, 6)),
    ("h", nn.MaxPool2d(3, 2, 1, dilation=1), (1, 2, 8, 5)),
    ("h", nn.MaxPool2d(2, 3, 1, dilation=2), (1, 2, 12, 5)),
    ("hw", nn.AvgPool2d(3, 1, 1), (1, 2, 6, 6)),
    ("hw", nn.AvgPool2d(3, 1, 1, count_include_pad=False), (1, 2, 6, 6)),
    ("h", nn.AvgPool2d(3, 2, 1, count_include_pad=False), (1, 2, 8, 5)),
    ("h", nn.AvgPool2d(3, 1, 1, divisor_override=2), (1, 2, 6, 4)),
    ("w", nn.AvgPool1d(3, 1, 1, count_include_pad=False), (2, 2, 8)),
    ("thw", nn.AvgPool3d(2), (1, 2, 4, 4, 4)),
    ("thw", nn.MaxPool3d(3, 1, 1), (1, 1, 4, 4, 4)),
]


@pytest.mark.parametrize(("split", "pool", "shape"), POOLS)
def test_pooling(split: str, pool: nn.Module, shape: tuple[int, ...]) -> None:
    equal_to_one_device(pool, shape, split)


class SqueezeExcite(nn.Module):
    """A conv, then the field scaled by a gate computed from its global average."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.gate = nn.Sequential(nn.Conv2d(4, 4, 1), nn.Sigmoid())

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv(x)
        return y * self.gate(self.pool(y))


def test_zero_padding_folded_into_the_next_convolution() -> None:
    """``Sequential(ZeroPad2d, Conv2d)`` (Wan's downsampling): the padding becomes the
    convolution's halo along the split dims (and its own padding along the others)."""
    net = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(2, 3, 3, stride=2))
    equal_to_one_device(net, (1, 2, 8, 12), "hw")
    net = nn.Sequential(nn.ConstantPad2d((1, 0, 2, 0), 0.0), nn.Conv2d(2, 3, 3, padding=(0, 1)))
    equal_to_one_device(net, (1, 2, 8, 6), "h")


ADAPTIVE = [
    ("h", nn.AdaptiveAvgPool2d((4, 3)), (1, 2, 10, 6)),  # bins of 3 rows overlapping by 1
    ("hw", nn.AdaptiveMaxPool2d((2, 4)), (1, 2, 6, 8)),
    ("h3", nn.AdaptiveAvgPool2d((6, None)), (1, 2, 9, 4)),
    ("hw", nn.AdaptiveAvgPool2d(1), (2, 2, 6, 4)),  # global: weighted psum
    ("hw", nn.AdaptiveMaxPool2d((1, 2)), (1, 2, 4, 6)),  # global over H (pmax), 2 bins over W
    ("thw", nn.AdaptiveAvgPool3d((2, 1, 4)), (1, 2, 4, 4, 8)),
    ("w", nn.AdaptiveMaxPool1d(1), (2, 3, 8)),
    ("hw", SqueezeExcite(), (1, 2, 4, 6)),  # the global result used with every rank's rows
]


@pytest.mark.parametrize(("split", "pool", "shape"), ADAPTIVE)
def test_adaptive_pooling(split: str, pool: nn.Module, shape: tuple[int, ...]) -> None:
    """Each rank pools its block to its share of the bins; pooled to one row (global pooling),
    the ranks' means (weighted by rows) or maxima are combined, and leave the region once."""
    equal_to_one_device(pool, shape, split)


def test_adaptive_pooling_refusals() -> None:
    """An output size whose bins straddle the blocks, and a halo read from a globally pooled
    field, raise at the first call."""
    x = torch.randn(1, 2, 8, 4, dtype=F64).expand(2, -1, -1, -1, -1)
    mesh, style = fd.Mesh({"h": 2}), {"": fd.nn.DomainParallel({-2: "h"})}
    pm = fd.nn.parallelize(nn.AdaptiveAvgPool2d(3), mesh, style)
    with pytest.raises(fd.nn.ParallelizeError, match=r"pools the split dim -2 .* to 3 rows"):
        pm(x)
    net = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(2, 2, 3, padding=1)).to(F64)
    with pytest.raises(fd.nn.ParallelizeError, match=r"global pooling reduced to one row"):
        fd.nn.parallelize(net, mesh, style)(x)


# ------------------------------------------------------------------ upsampling
UPSAMPLES = [
    ("hw", nn.Upsample(scale_factor=2), (1, 2, 4, 6)),
    ("h", nn.Upsample(scale_factor=3, mode="nearest-exact"), (1, 2, 4, 3)),
    ("hw", nn.Upsample(scale_factor=2, mode="bilinear"), (1, 2, 4, 6)),
    ("h3", nn.Upsample(scale_factor=(3, 2), mode="bilinear"), (1, 2, 3, 4)),
    ("hw", nn.Upsample(scale_factor=2, mode="bicubic"), (1, 2, 4, 4)),
    ("w", nn.Upsample(scale_factor=2, mode="linear"), (2, 2, 4)),
    ("thw", nn.Upsample(scale_factor=2, mode="trilinear"), (1, 1, 2, 4, 2)),
    ("thw", nn.Upsample(scale_factor=(1, 2, 2), mode="nearest"), (1, 1, 2, 4, 2)),
]


@pytest.mark.parametrize(("split", "up", "shape"), UPSAMPLES)
def test_upsampling(split: str, up: nn.Module, shape: tuple[int, ...]) -> None:
    """Bilinear (and linear, trilinear, bicubic) with ``align_corners=False`` read past the block:
    a replicated halo at the domain's ends gives the clamped edge rows exactly."""
    equal_to_one_device(up, shape, split)


class FunctionalUp(nn.Module):
    """``F.interpolate`` in the model's own code, by factor and by the whole domain's size (as
    diffusers' ``Upsample2D`` calls it, with ``output_size`` from a skip connection)."""

    def __init__(self, mode: str, by_size: bool) -> None:
        super().__init__()
        self.mode, self.by_size = mode, by_size
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        if self.by_size:
            whole = (8, 12)  # the whole field's H, W times 2
            return self.conv(F.interpolate(x, size=whole, mode=self.mode))
        return self.conv(F.interpolate(x, scale_factor=2.0, mode=self.mode))


@pytest.mark.parametrize(("mode", "by_size"), [("nearest", False), ("bilinear", True)])
def test_functional_interpolate(mode: str, by_size: bool) -> None:
    equal_to_one_device(FunctionalUp(mode, by_size), (1, 2, 4, 6), "hw")


# ------------------------------------------------------------------ norms
class ChannelsLast(nn.Module):
    """LayerNorm and Linear over channels on a channels-last view: token-local."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)
        self.rms = nn.RMSNorm(4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x).permute(0, 2, 3, 1)  # [N, H, W, C]
        return self.rms(self.proj(self.norm(h))).permute(0, 3, 1, 2)


def _bn(track: bool) -> nn.Module:
    bn = nn.BatchNorm2d(4, track_running_stats=track)
    if track:  # non-trivial running statistics, eval mode
        bn.running_mean.normal_()  # type: ignore[union-attr]
        bn.running_var.uniform_(0.5, 2)  # type: ignore[union-attr]
        bn.eval()
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), bn)


NORMS = [
    ("hw", lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4)), (2, 2, 4, 6)),
    ("h3", lambda: nn.GroupNorm(1, 2), (2, 2, 6, 3)),
    ("thw", lambda: nn.GroupNorm(2, 4), (2, 4, 2, 4, 4)),
    ("hw", lambda: nn.InstanceNorm2d(2, affine=True), (2, 2, 4, 6)),
    ("hw", lambda: _bn(False), (2, 2, 4, 6)),
    ("h", lambda: _bn(True), (2, 2, 4, 6)),
    ("thw", lambda: nn.BatchNorm3d(4, track_running_stats=False), (2, 4, 2, 4, 4)),
    ("hw", ChannelsLast, (2, 2, 4, 6)),
]  # fmt: skip


@pytest.mark.parametrize(("split", "make", "shape"), NORMS)
def test_norms(split: str, make: Callable[[], nn.Module], shape: tuple[int, ...]) -> None:
    """GroupNorm / InstanceNorm / BatchNorm with statistics over the whole domain (a psum of the
    ranks' sums, pvary'd back: the gradient through the statistics is one device's);
    LayerNorm / RMSNorm / Linear over channels run as they are."""
    equal_to_one_device(make(), shape, split)


def test_batch_norm_training_with_running_stats_on_simulated_ranks_is_refused() -> None:
    net = nn.BatchNorm2d(2).double()
    pm = fd.nn.parallelize(net, fd.Mesh({"h": 2}), {"": fd.nn.DomainParallel({-2: "h"})})
    with pytest.raises(fd.nn.ParallelizeError, match="running statistics on simulated ranks"):
        pm(torch.zeros(2, 1, 2, 4, 4, dtype=F64))


# ------------------------------------------------------------------ a UNet-like stack
@pytest.mark.parametrize("split", ["h", "hw"])
def test_unet_like_stack(split: str) -> None:
    equal_to_one_device(TinyUNet(), (1, 2, 8, 12), split)


def test_output_split_leaves_each_rank_its_block() -> None:
    torch.manual_seed(0)
    net = nn.Conv2d(2, 2, 3, padding=1).double()
    ref = net(x := torch.randn(1, 2, 8, 6, dtype=F64))
    mesh = fd.Mesh({"h": 2, "w": 2})
    style = fd.nn.DomainParallel({-2: "h", -1: "w"}, output="split")
    out = fd.nn.parallelize(net, mesh, {"": style})(x.expand(4, *x.shape))
    want = torch.stack([b for rows in ref.chunk(2, 2) for b in rows.chunk(2, 3)])
    assert torch.allclose(out, want, atol=TOL)


# ------------------------------------------------------------------ refusals
class SpatialAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = nn.Linear(2, 2)


class Custom(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 2


REFUSED: list[tuple[Callable[[], nn.Module], str]] = [
    (lambda: nn.AdaptiveMaxPool2d(1, return_indices=True), "return_indices"),
    (lambda: nn.ReflectionPad2d(1), r"not known"),
    (lambda: nn.Sequential(nn.Flatten(), nn.Linear(8, 2)), r"'0' \(Flatten.*flattened field"),
    (lambda: nn.Sequential(SpatialAttention()), r"'0' \(SpatialAttention\): an attention module"),
    (lambda: nn.Sequential(Custom()), r"not known.*local=\(Custom,\)"),
    (lambda: nn.LayerNorm([2, 4, 4]), r"normalized_shape=\(2, 4, 4\)"),
    (lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), "align_corners"),
    (lambda: nn.Upsample(size=8), "size="),
    (lambda: nn.MaxPool2d(2, ceil_mode=True), "ceil_mode"),
]


@pytest.mark.parametrize(("make", "match"), REFUSED)
def test_modules_that_mix_the_domain_are_refused_at_parallelize_time(
    make: Callable[[], nn.Module], match: str
) -> None:
    net = make()
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(fd.nn.ParallelizeError, match=match):
        fd.nn.parallelize(net, fd.Mesh({"h": 2}), {"": fd.nn.DomainParallel({-2: "h"})})
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())  # unchanged


def test_local_declares_a_module_token_local() -> None:
    equal_to_one_device(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), Custom()), (1, 2, 4, 4),
                        "h", local=(Custom,))  # fmt: skip


class PixelAttention(nn.Module):
    """An attention gate local to each pixel (a 1x1 convolution, a sigmoid, ``x * gate``): its
    class name says Attention, so the style refuses it unless ``local=`` declares it."""

    def __init__(self, fn: Callable[[Tensor], Tensor] = torch.sigmoid) -> None:
        super().__init__()
        self.gate, self.fn = nn.Conv2d(2, 2, 1), fn

    def forward(self, x: Tensor) -> Tensor:
        return x * self.fn(self.gate(x))


def test_local_overrides_the_refusal_of_an_attention_by_name() -> None:
    """``local=`` declares a module named ...Attention token-local (run as it is, equal to one
    device over H x W); the guard still checks its own code (a softmax over the split dim
    raises at the first call)."""
    net = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), PixelAttention())
    with pytest.raises(fd.nn.ParallelizeError, match=r"local=\(PixelAttention,\)"):
        fd.nn.parallelize(
            copy.deepcopy(net), fd.Mesh({"h": 2}), {"": fd.nn.DomainParallel({-2: "h"})}
        )
    equal_to_one_device(net, (1, 2, 4, 6), "hw", local=(PixelAttention,))
    bad = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), PixelAttention(lambda g: g.softmax(-2)))
    style = fd.nn.DomainParallel({-2: "h"}, local=(PixelAttention,))
    pm = fd.nn.parallelize(bad.double(), fd.Mesh({"h": 2}), {"": style})
    with pytest.raises(fd.nn.ParallelizeError, match=r"split dim -2 itself \(softmax\)"):
        pm(torch.randn(1, 2, 8, 6, dtype=F64).expand(2, 1, 2, 8, 6))

    def spatial(g: Tensor) -> Tensor:  # attention over the pixels of each row: W's tokens
        t = g.permute(0, 2, 3, 1)
        return F.scaled_dot_product_attention(t, t, t).permute(0, 3, 1, 2)

    bad = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), PixelAttention(spatial))
    style = fd.nn.DomainParallel({-1: "w"}, local=(PixelAttention,))
    pm = fd.nn.parallelize(bad.double(), fd.Mesh({"w": 2}), {"": style})
    with pytest.raises(fd.nn.ParallelizeError, match=r"scaled_dot_product_attention itself"):
        pm(torch.randn(1, 2, 8, 6, dtype=F64).expand(2, 1, 2, 8, 6))


class PadsByHand(nn.Module):
    def __init__(self, fn: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.fn = fn
        self.conv = nn.Conv2d(2, 2, 3, stride=2)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(self.fn(x))


CALL_ERRORS: list[tuple[nn.Module, tuple[int, ...], Mapping[int, str], str]] = [
    (PadsByHand(lambda x: F.pad(x, (0, 1, 0, 1))), (1, 2, 8, 8), {-2: "h"},
     "pads the split dim -2"),
    (PadsByHand(lambda x: F.scaled_dot_product_attention(x, x, x)), (1, 2, 8, 8), {-2: "h"},
     "scaled_dot_product_attention"),
    (PadsByHand(lambda x: x.mean(1, keepdim=True) + F.adaptive_avg_pool2d(x, 1)), (1, 2, 8, 8),
     {-2: "h"}, "adaptive_avg_pool2d"),
    (PadsByHand(lambda x: x - x.mean((2, 3), keepdim=True)), (1, 2, 8, 8), {-2: "h"},
     r"reduces a tensor of shape \(1, 2, 4, 8\) over the split dim -2 itself \(mean\)"),
    (PadsByHand(lambda x: x / torch.amax(x)), (1, 2, 8, 8), {-1: "h"}, "split dim -1 itself"),
    (nn.Conv2d(2, 2, 3, stride=2, padding=1), (1, 2, 6, 6), {-2: "h"}, "multiple of 2 rows"),
    (nn.Conv2d(2, 2, 3), (1, 2, 6, 6), {-2: "h"}, "padding .0, 0. along the split dim"),
    (nn.Conv2d(2, 2, 3, padding=1), (1, 2, 5, 6), {-2: "h"}, "5 rows, not divisible by the 2"),
    (nn.Sequential(nn.Conv2d(2, 2, 1), nn.Linear(6, 6)), (1, 2, 6, 6), {-1: "h"},
     "in_features=6.*last dim is 3"),
    (nn.Conv2d(2, 2, 3, padding=1), (1, 2, 6, 6), {-2: "h"}, ""),  # the control: no error
]  # fmt: skip


@pytest.mark.parametrize(("net", "shape", "dims", "match"), CALL_ERRORS)
def test_what_cannot_be_right_raises_at_the_first_call(
    net: nn.Module, shape: tuple[int, ...], dims: Mapping[int, str], match: str
) -> None:
    pm = fd.nn.parallelize(net.double(), fd.Mesh({"h": 2}), {"": fd.nn.DomainParallel(dims)})
    x = torch.zeros(2, *shape, dtype=F64)
    if not match:
        pm(x)
        return
    with pytest.raises(fd.nn.ParallelizeError, match=match):
        pm(x)


def test_bad_styles_are_refused() -> None:
    mesh = fd.Mesh({"h": 2})
    for dims, match in [({2: "h"}, "counted from the end"), ({-1: "h", -2: "h"}, "one axis")]:
        with pytest.raises(fd.nn.ParallelizeError, match=match):
            fd.nn.parallelize(nn.Conv2d(1, 1, 1), mesh, {"": fd.nn.DomainParallel(dims)})
    with pytest.raises(fd.nn.ParallelizeError, match="output="):
        fd.nn.parallelize(
            nn.Conv2d(1, 1, 1), mesh, {"": fd.nn.DomainParallel({-1: "h"}, output="x")}
        )
    with pytest.raises(fd.MeshError):
        fd.nn.parallelize(nn.Conv2d(1, 1, 1), mesh, {"": fd.nn.DomainParallel({-1: "sp"})})


def test_unet_like_stack_on_gloo() -> None:
    """4 gloo processes (H x W over 2 x 2), training mode, even blocks and uneven W blocks (4 and
    8 columns: the norms' counts summed, the output gathered by each rank's own rows): outputs,
    gradients and the batch norm's running statistics (every rank updates them from the whole
    domain's statistics) equal one device."""
    from tests.dist_harness import run_on_gloo

    net, x, cot = unet_and_inputs()
    xr = x.clone().requires_grad_()
    out = net(xr)
    (out * cot).sum().backward()
    bn: Any = net.mid[0]
    for per_rank in run_on_gloo(unet_on_gloo, 4, timeout=180):
        for got in per_rank.values():
            assert torch.allclose(got["out"], out, atol=TOL)
            assert torch.allclose(got["dx"], xr.grad, atol=TOL)  # type: ignore[arg-type]
            for name, p in net.named_parameters():
                assert torch.allclose(got["grads"][name], p.grad, atol=TOL), name  # type: ignore[arg-type]
            assert torch.allclose(got["running"][0], bn.running_mean, atol=1e-12)
            assert torch.allclose(got["running"][1], bn.running_var, atol=1e-12)


UNEVEN: list[tuple[Callable[[], nn.Module], tuple[int, ...], str, dict[int, list[int]]]] = [
    (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(),
                           nn.Conv2d(4, 2, 3, padding=1)), (1, 2, 7, 5), "h", {-2: [3, 4]}),
    (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, stride=2), nn.MaxPool2d(3, 1, 1),
                           nn.AvgPool2d(3, 1, 1, count_include_pad=False),
                           nn.Upsample(scale_factor=2, mode="bicubic"), nn.InstanceNorm2d(4)),
     (1, 2, 18, 6), "h3", {-2: [4, 6, 8]}),
    (lambda: nn.Sequential(nn.Conv3d(2, 2, 3, padding=1, padding_mode="replicate"),
                           nn.BatchNorm3d(2, track_running_stats=False),
                           nn.Upsample(scale_factor=2, mode="trilinear")),
     (2, 2, 5, 4, 6), "thw", {-3: [2, 3], -1: [4, 2]}),
    (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.AdaptiveAvgPool2d((3, 1)),
                           nn.Conv2d(4, 4, 1)), (1, 2, 9, 5), "hw", {-2: [3, 6], -1: [2, 3]}),
    (SqueezeExcite, (1, 2, 5, 4), "h", {-2: [2, 3]}),
]  # fmt: skip


@pytest.mark.parametrize(("make", "shape", "split", "sizes"), UNEVEN)
def test_uneven_blocks_on_simulated_ranks(
    make: Callable[[], nn.Module], shape: tuple[int, ...], split: str, sizes: dict[int, list[int]]
) -> None:
    """Simulated ranks share one shape: each block is padded to the largest, every layer follows
    each rank's own rows (the halo after them, the padding rows zeroed after a window, masked
    out of the norms' statistics and the adaptive pooling's bins), and the output gathers each
    rank's own rows: equal to one device, forward and backward."""
    equal_to_one_device(make(), shape, split, sizes=sizes)


def test_unet_like_stack_with_uneven_blocks() -> None:
    """The UNet-like model (max pooling down, reflect and circular convolutions, a transposed
    convolution up, a batch norm) with uneven H and W blocks on a 2 x 2 grid."""
    equal_to_one_device(TinyUNet(), (1, 2, 12, 12), "hw", sizes={-2: [4, 8], -1: [8, 4]})


def test_uneven_blocks_refusals() -> None:
    mesh = fd.Mesh({"h": 2})
    for sizes, match, kw in [
        ({-2: [8]}, "1 blocks for the 2 ranks", {}),
        ({-1: [4, 4]}, "does not split", {}),
        ({-2: [2, 6]}, "output='split' with uneven blocks", {"output": "split"}),
    ]:
        style = fd.nn.DomainParallel({-2: "h"}, sizes=sizes, **kw)
        with pytest.raises(fd.nn.ParallelizeError, match=match):
            fd.nn.parallelize(nn.Conv2d(1, 1, 3, padding=1), mesh, {"": style})
    # a stride that does not divide a block: named at the call
    net = nn.Conv2d(1, 1, 3, stride=2, padding=1).double()
    style = fd.nn.DomainParallel({-2: "h"}, sizes={-2: [3, 5]})
    pm = fd.nn.parallelize(net, mesh, {"": style})
    with pytest.raises(fd.nn.ParallelizeError, match=r"stride 2 .* blocks of \[3, 5\] rows"):
        pm(torch.zeros(2, 1, 1, 8, 4, dtype=F64))


def test_a_layer_outside_its_region_raises_on_gloo() -> None:
    """2 gloo processes: a domain layer recomputed by activation checkpointing in the backward
    (outside the region, where it cannot know its block) raises instead of treating a block as
    the whole, and so does a layer called directly. (Simulated ranks refuse the checkpoint
    itself, and a direct call at its parameters' pvary.)"""
    from tests.dist_harness import run_on_gloo
    from tests.domain_gloo_worker import outside_region_on_gloo

    for errors in run_on_gloo(outside_region_on_gloo, 2, timeout=120):
        assert "'conv' (Conv2d) ran outside its DomainParallel region" in errors["direct"]
        # a reentrant checkpoint (issue 41.3: a non-reentrant one re-enters the region)
        assert "'conv' (Conv2d) is recomputed in the backward" in errors["checkpoint"]
        assert "reentrant checkpoint detaches them" in errors["checkpoint"]
    checkpointed_modules_on_gloo()


def checkpointed_modules_on_gloo() -> None:
    """Issue 41.3, 2 gloo processes: modules of the region checkpointed with
    ``use_reentrant=False`` (a conv block with a group norm, a module whose ``F.interpolate``
    the guard runs domain-parallel, a convolution) are recomputed in the backward inside their
    region: equal to one device (output, input and parameter gradients; even blocks and blocks
    of 2 and 6 rows), two convolutions recomputed; a checkpointed function that interpolates
    outside a module is refused at the forward, naming the reason."""
    from tests.dist_harness import run_on_gloo
    from tests.domain_gloo_worker import checkpointed_inputs, checkpointed_on_gloo

    net, x, cot = checkpointed_inputs()
    xr = x.clone().requires_grad_()
    want = net(xr)
    (want * cot).sum().backward()
    for got in run_on_gloo(checkpointed_on_gloo, 2, timeout=120):
        assert torch.allclose(got["out"], want, atol=TOL)
        assert torch.allclose(got["dx"], xr.grad, atol=TOL)  # type: ignore[arg-type]
        for name, p in net.named_parameters():
            assert torch.allclose(got["grads"][name], p.grad, atol=TOL), name  # type: ignore[arg-type]
        assert got["convolutions"] == 6, got["convolutions"]
        uneven = got["uneven"]  # blocks of 2 and 6 rows
        assert torch.allclose(uneven["out"], want, atol=TOL)
        assert torch.allclose(uneven["dx"], xr.grad, atol=TOL)  # type: ignore[arg-type]
        for name, p in net.named_parameters():
            assert torch.allclose(uneven["grads"][name], p.grad, atol=TOL), name  # type: ignore[arg-type]
        said = got["function"]
        assert said is not None and "F.interpolate inside a function that" in said, said
        assert "checkpoint a module" in said, said


# ------------------------------------------------------------------ with data parallelism
def _dp_steps(net: nn.Module, steps: int = 2, **style: Any) -> None:
    """A dp x h mesh: H split over ``h`` by the style, each data rank its own batch of 2 and
    ``fastdist.train.DataParallel`` over ``dp``; SGD steps equal one device on the concatenated
    batch with the mean of the data ranks' losses (outputs and weights)."""
    net = net.to(F64)
    ref = copy.deepcopy(net)
    mesh = fd.Mesh({"dp": 2, "h": 2})
    pm = fd.nn.parallelize(net, mesh, {"": fd.nn.DomainParallel({-2: "h"}, **style)})
    dp = fd.train.DataParallel(pm, "dp")
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(2, 2, 2, 8, 12, generator=g, dtype=F64)  # [dp, batch, C, H, W]
        cot = torch.randn(2, 2, 2, 16, 24, generator=g, dtype=F64)
        out = pm(x.repeat_interleave(2, dim=0))  # ranks (dp, h): each h group one batch
        (out * cot.repeat_interleave(2, dim=0)).sum().backward()
        dp.finish()
        opt.step()
        opt.zero_grad()
        want = ref(x.flatten(0, 1))
        (want * cot.flatten(0, 1)).sum().div(2).backward()  # the mean over the data ranks
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.allclose(out[::2].flatten(0, 1), want, atol=TOL)
    state = pm.state_dict()
    for name, p in ref.named_parameters():
        assert torch.allclose(state[name], p, atol=TOL), name


def test_with_data_parallelism() -> None:
    """GroupNorm: statistics per sample, nothing to sync over ``dp``."""
    net = TinyUNet()
    net.mid[0] = nn.GroupNorm(2, 8)
    _dp_steps(net)


def test_with_data_parallelism_batch_norm_over_the_data_ranks() -> None:
    """BatchNorm over the whole batch: ``batch_axes=("dp",)`` sums its statistics over the data
    ranks too (SyncBatchNorm); without it the style refuses to choose."""
    _dp_steps(TinyUNet(), batch_axes=("dp",))
    mesh = fd.Mesh({"dp": 2, "h": 2})
    pm = fd.nn.parallelize(TinyUNet().to(F64), mesh, {"": fd.nn.DomainParallel({-2: "h"})})
    with pytest.raises(fd.nn.ParallelizeError, match=r"axes \['dp'\].*batch_axes=\('dp',\)"):
        pm(torch.randn(1, 2, 2, 8, 12, dtype=F64).expand(4, -1, -1, -1, -1, -1).flatten(1, 2))


def test_with_data_parallelism_on_gloo() -> None:
    """4 gloo processes, dp 2 x h 2, a training-mode BatchNorm with statistics over the data
    ranks too: the output, the weights after one SGD step and the running statistics equal one
    device on the whole batch."""
    from tests.dist_harness import run_on_gloo
    from tests.domain_gloo_worker import dp_inputs, dp_step_on_gloo

    net, x, cot = dp_inputs()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out = net(x.flatten(0, 1))
    (out * cot.flatten(0, 1)).sum().div(2).backward()  # the mean over the data ranks' losses
    opt.step()
    bn: Any = net.mid[0]
    for rank, got in enumerate(run_on_gloo(dp_step_on_gloo, 4, timeout=180)):
        assert torch.allclose(got["out"], out.unflatten(0, (2, 2))[rank // 2], atol=TOL)
        for name, p in net.named_parameters():
            assert torch.allclose(got["weights"][name], p, atol=TOL), name
        assert torch.allclose(got["running"][0], bn.running_mean, atol=1e-12)
        assert torch.allclose(got["running"][1], bn.running_var, atol=1e-12)


def test_region_state_is_per_thread() -> None:
    """The running region's state (depth, pooled axes, uneven blocks) is this thread's own: a
    model running in another thread neither sees nor changes it."""
    import threading

    from fastdist.nn.domain.windows import region

    mine = region()
    mine.ragged[-2] = (3, 2)
    seen: list[object] = []
    t = threading.Thread(target=lambda: seen.append(region()))
    t.start()
    t.join()
    try:
        assert seen[0] is not mine and not seen[0].ragged  # type: ignore[attr-defined]
        assert region() is mine
    finally:
        mine.ragged.clear()


class Transforms(nn.Module):
    """A convolution, then the model's own ``fn`` (an FFT, a roll, ...) on its output."""

    def __init__(self, fn: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.fn = fn
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(self.conv(x))


MIXING: list[tuple[Callable[[Tensor], Tensor], str | None]] = [
    (lambda y: torch.fft.fftn(y, dim=(-2, -1)).real, "fftn over the split dim -2"),
    (lambda y: torch.fft.fft2(y).real, "fft2 over the split dim -2"),
    (lambda y: torch.fft.irfft2(torch.fft.rfft2(y)), "rfft2 over the split dim -2"),
    (lambda y: torch.fft.fft(y, dim=2).imag, "fft over the split dim -2"),
    (lambda y: torch.fft.fftn(y).real, "fftn over the split dim -2"),
    (lambda y: torch.roll(y, 1, 2), "roll over the split dim -2"),
    (lambda y: y.flip(-2), "flip over the split dim -2"),
    (lambda y: y.cumsum(dim=-2), "cumsum over the split dim -2"),
    (lambda y: torch.sort(y, dim=2).values, "sort over the split dim -2"),
    # along dims that are not split: right on every rank's block, no error
    (lambda y: torch.fft.fft(y).real + y.flip(-1) + torch.sort(y).values, None),
    (lambda y: torch.fft.fftn(y, s=(4,)).real + y.cumsum(1), None),
]


@pytest.mark.parametrize(("fn", "match"), MIXING)
def test_ops_that_mix_a_split_dim_raise_at_the_first_call(
    fn: Callable[[Tensor], Tensor], match: str | None
) -> None:
    """An FFT, roll, flip, cumulative op or sort the model calls itself over a split dim raises
    (each rank would transform its block as if it were the whole domain); over the dims that
    are not split the model equals one device."""
    torch.manual_seed(0)
    net = Transforms(fn).double()
    x = torch.randn(1, 2, 8, 4, dtype=F64)
    want = net(x)
    pm = fd.nn.parallelize(net, fd.Mesh({"h": 2}), {"": fd.nn.DomainParallel({-2: "h"})})
    if match is None:
        got = pm(x.expand(2, *x.shape))
        torch.testing.assert_close(got[1], want, rtol=0, atol=1e-12)
        return
    with pytest.raises(fd.nn.ParallelizeError, match=match):
        pm(x.expand(2, *x.shape))


# ------------------------------------------------------------ issue 41.2: foreign pass-throughs
PHYSICSNEMO = "physicsnemo.nn.module.activations"


def foreign(name: str, forward: Callable[..., Tensor], module: str = PHYSICSNEMO) -> type:
    """A stand-in for another library's module class (physicsnemo is not installed here): the
    class named ``name`` in ``module``, with that ``forward``."""
    return type(name, (nn.Module,), {"forward": forward, "__module__": module})


def test_physicsnemo_pass_through_modules_need_no_local() -> None:
    """physicsnemo's Identity, Sin and SquarePlus (by exact class) run as they are, with no
    ``local=``: equal to one device."""
    identity = foreign("Identity", lambda self, x: x)
    sin = foreign("Sin", lambda self, x: torch.sin(x))
    square = foreign("SquarePlus", lambda self, x: 0.5 * (x + torch.sqrt(x * x + self.b)))
    plus = square()
    plus.b = 4
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), identity(), sin(), plus, nn.Conv2d(4, 2, 3, padding=1)
    )
    equal_to_one_device(net, (1, 2, 8, 6), "h")


@pytest.mark.parametrize(
    "case",
    ["Stan", "subclass", "other_module", "tensor_b", "with_parameter"],
)
def test_other_pass_through_lookalikes_are_refused(case: str) -> None:
    """Only the exact known classes pass: a subclass (its forward may differ), a same-named class
    of another package, a per-position ``b``, a parameter of its own, physicsnemo's ``Stan``
    (a learned ``beta`` broadcast over the last dim) are refused naming the class and the fix."""
    identity = foreign("Identity", lambda self, x: x)
    made: nn.Module
    if case == "Stan":
        made = foreign("Stan", lambda self, x: x)()
    elif case == "subclass":
        made = type("Identity", (identity,), {"forward": lambda self, x: x.flip(-2)})()
    elif case == "other_module":
        made = foreign("Identity", lambda self, x: x, module="somelib.layers")()
    elif case == "tensor_b":
        made = foreign("SquarePlus", lambda self, x: x + self.b)()
        made.b = torch.ones(8, 1)  # type: ignore[assignment]
    else:
        made = identity()
        made.scale = nn.Parameter(torch.ones(8, 1))
    net = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), made)
    with pytest.raises(fd.nn.ParallelizeError, match=r"not known to the domain-parallel style"):
        fd.nn.parallelize(net, fd.Mesh({"h": 2}), {"": fd.nn.DomainParallel({-2: "h"})})


# ------------------------------------------------------------------ the model's own code: the guard
class OwnCode(nn.Module):
    """A convolution, the model's own code ``fn`` on its output, a convolution: what ``fn``
    does between the style's layers is the functional guard's."""

    def __init__(self, fn: Callable[[Tensor], Tensor], dims: int = 2) -> None:
        super().__init__()
        conv = nn.Conv3d if dims == 3 else nn.Conv2d
        self.c1, self.c2, self.fn = conv(2, 4, 3, padding=1), conv(4, 2, 3, padding=1), fn

    def forward(self, x: Tensor) -> Tensor:
        return self.c2(self.fn(self.c1(x)))


class FramesAsBatch(nn.Module):
    """Wan's per-frame 2-d layers: ``[N, C, T, H, W]`` -> ``[N * T, C, H, W]`` (T merged into
    the batch), a 2-d convolution and an upsampling, and back."""

    def __init__(self) -> None:
        super().__init__()
        self.c3, self.c2 = nn.Conv3d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.up, self.out = nn.Upsample(scale_factor=2), nn.Conv3d(4, 2, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.c3(x)
        n, c, t, hh, ww = h.shape
        h = h.permute(0, 2, 1, 3, 4).reshape(n * t, c, hh, ww)
        h = self.c2(F.silu(self.up(h)))
        h = h.view(n, t, c, 2 * hh, 2 * ww).permute(0, 2, 1, 3, 4)
        return self.out(h)


#: model code the guard follows exactly: equal to one device
FOLLOWED: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], str]] = {
    "softmax over channels, channels-last": (
        lambda: OwnCode(lambda h: h.permute(0, 2, 3, 1).softmax(-1).permute(0, 3, 1, 2)),
        (1, 2, 4, 6), "hw",
    ),
    "W and C swapped, a layer norm over C, swapped back": (
        lambda: OwnCode(lambda h: F.layer_norm(h.transpose(1, 3), (4,)).transpose(1, 3)),
        (1, 2, 4, 6), "w",
    ),
    "channel mean [N, H, W] as a gate": (
        lambda: OwnCode(lambda h: h * torch.sigmoid(h.mean(1))[:, None]), (1, 2, 4, 6), "hw",
    ),
    "elementwise torch.max(x, y) / torch.min(x, y)": (
        lambda: OwnCode(lambda h: torch.max(h, h.flip(1)) - torch.min(h, 0.5 * h)),
        (1, 2, 4, 6), "hw",
    ),
    "max / norm / softmax over channels": (
        lambda: OwnCode(
            lambda h: F.normalize(h, dim=1) + h.amax(1, keepdim=True) + h.softmax(1)
            + torch.linalg.vector_norm(h, dim=1, keepdim=True)
        ),
        (1, 2, 4, 6), "hw",
    ),
    "frames merged into the batch and back (T split)": (FramesAsBatch, (1, 2, 4, 4, 4), "thw"),
    "cat, chunk and repeat along channels, tile of a channel": (
        lambda: OwnCode(
            lambda h: torch.cat([*h.chunk(2, dim=1)[::-1]], dim=1)
            + h.repeat(1, 2, 1, 1)[:, 4:] + torch.tile(h[:, :1], (4, 1, 1))
        ),
        (1, 2, 4, 6), "hw",
    ),
    "channels-last, cat along channels, a layer norm, back": (
        lambda: OwnCode(
            lambda h: F.layer_norm(
                torch.cat([h.permute(0, 2, 3, 1), h.permute(0, 2, 3, 1)], -1), (8,)
            )[..., :4].permute(0, 3, 1, 2)
        ),
        (1, 2, 4, 6), "hw",
    ),
    "channels-last plus new_ones / new_zeros made from it": (
        lambda: OwnCode(
            lambda h: (lambda c: c * c.new_ones(()) + c.new_zeros(4))(
                h.permute(0, 2, 3, 1)
            ).permute(0, 3, 1, 2)
        ),
        (1, 2, 4, 6), "hw",
    ),
    "unsqueeze, squeeze, full slices": (
        lambda: OwnCode(lambda h: h[:, :, :, :].unsqueeze(2).squeeze(2)[None][0]),
        (1, 2, 4, 6), "hw",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(FOLLOWED))
def test_model_code_the_guard_follows_equals_one_device(case: str) -> None:
    make, shape, split = FOLLOWED[case]
    equal_to_one_device(make(), shape, split)


def _fold_then(fn: Callable[[Tensor], Tensor]) -> nn.Module:
    """T merged into the batch (``[N * T, C, H, W]``), then ``fn``, then back."""

    def run(h: Tensor) -> Tensor:
        n, c, t, hh, ww = h.shape
        y = fn(h.permute(0, 2, 1, 3, 4).reshape(n * t, c, hh, ww))
        return y.reshape(n, t, c, hh, ww).permute(0, 2, 1, 3, 4)

    net = OwnCode(run, dims=3)
    if isinstance(fn, nn.Module):
        net.inner = fn  # a child: the style runs it
    return net


#: model code that would act on the block as if it were the domain: ``(net, field, dims, match)``
F86, F88, F44, V444 = (1, 2, 8, 6), (1, 2, 8, 8), (1, 2, 4, 4), (1, 2, 4, 4, 4)
OWN_REFUSED = [
    (OwnCode(lambda h: h.softmax(2)), F86, {-2: "h"},
     r"over the split dim -2 itself \(softmax\)"),
    (OwnCode(lambda h: F.log_softmax(h, dim=-1)), F86, {-1: "w"},
     r"split dim -1 itself \(log_softmax\)"),
    (OwnCode(lambda h: h - h.argmax(2, keepdim=True)), F86, {-2: "h"},
     r"\(argmax\)"),
    (OwnCode(lambda h: h - h.median(2, keepdim=True).values), F86, {-2: "h"},
     r"\(median\)"),
    (OwnCode(lambda h: h - torch.nanmedian(h)), F86, {-2: "h"},
     r"\(nanmedian\)"),
    (OwnCode(lambda h: h.topk(2, dim=2).values.sum() + h), F86, {-2: "h"},
     r"\(topk\)"),
    (OwnCode(lambda h: h - h.quantile(0.5, dim=-1, keepdim=True)), F86, {-1: "w"},
     r"\(quantile\)"),
    (OwnCode(lambda h: h - h.logsumexp((2, 3), keepdim=True)), F86, {-2: "h"},
     r"\(logsumexp\)"),
    (OwnCode(lambda h: h - torch.aminmax(h).max), F86, {-2: "h"},
     r"\(aminmax\)"),
    (OwnCode(lambda h: h / torch.count_nonzero(h)), F86, {-2: "h"},
     r"\(count_nonzero\)"),
    (OwnCode(lambda h: h - torch.std_mean(h, dim=3, keepdim=True)[1]), F86, {-1: "w"},
     r"\(std_mean\)"),
    (OwnCode(lambda h: h / h.norm(dim=2, keepdim=True)), F86, {-2: "h"},
     r"\(norm\)"),
    (OwnCode(lambda h: h / torch.linalg.matrix_norm(h)[..., None, None]), F86, {-2: "h"},
     r"\(linalg_matrix_norm\)"),
    (OwnCode(lambda h: h / torch.linalg.norm(h)), F86, {-1: "w"},
     r"\(linalg_norm\)"),
    (OwnCode(lambda h: F.pad(torch.diff(h, dim=2), (0, 0, 0, 1))), F86, {-2: "h"},
     r"diff over the split dim -2"),
    (OwnCode(lambda h: h.rot90(1, (2, 3))), F88, {-2: "h"},
     r"rot90 over the split dim -2"),
    (OwnCode(lambda h: F.rms_norm(h, h.shape[2:])), F86, {-2: "h"},
     r"\(rms_norm\)"),
    # the channel mean [N, H, W] holds H at dim 1: a max over it is over the split dim
    (OwnCode(lambda h: h - h.mean(1).amax(1)[:, None, None]), F86, {-2: "h"},
     r"split dim -2 itself \(amax\), dim 1"),
    (OwnCode(lambda h: F.pad(h[:, :, 1:], (0, 0, 1, 0))), F86, {-2: "h"},
     r"a slice slice\(1, None, None\) of dim 2"),
    (OwnCode(lambda h: h[:, :, :1].expand_as(h)), F86, {-2: "h"},
     r"a slice"),
    (OwnCode(lambda h: h[:, :, 0][:, :, None] + h), F86, {-2: "h"},
     r"an integer index of dim 2"),
    (OwnCode(lambda h: h.flatten(2).softmax(-1).view_as(h)), F86, {-2: "h"},
     r"flatten.*merges a split dim with another dim"),
    (OwnCode(lambda h: h.unflatten(2, (2, -1)).flatten(2, 3)), F86, {-2: "h"},
     r"cuts a split dim into several"),
    (OwnCode(lambda h: h @ torch.ones(6, 6, dtype=h.dtype)), F86, {-1: "w"},
     r"contracts a dim that holds split rows"),
    (OwnCode(lambda h: h.transpose(2, 3).contiguous()), F88, {-1: "w"},
     r"'c2' \(Conv2d\) gets a tensor .* moved"),
    (OwnCode(lambda h: h.transpose(2, 3) + h), F44, {-2: "h", -1: "w"},
     r"combines it with a tensor"),
    (OwnCode(lambda h: h.transpose(2, 3).mean(2, keepdim=True).expand_as(h)), F88, {-1: "w"},
     r"split dim -1 itself \(mean\), dim 2"),
    (_fold_then(lambda y: y - y.mean(0, keepdim=True)), V444, {-3: "t"},
     r"split dim -3 itself \(mean\), dim 0 of this tensor, folded"),
    (OwnCode(lambda h: torch.cat([h, h], 2)[:, :, ::2]), F86, {-2: "h"},
     r"cat over the split dim -2"),
    (OwnCode(lambda h: torch.cat(h.chunk(2, dim=-1)[::-1], -1)), F86, {-1: "w"},
     r"chunk over the split dim -1"),
    (OwnCode(lambda h: h.repeat(1, 1, 2, 1)[:, :, ::2]), F86, {-2: "h"},
     r"repeat over the split dim -2"),
    (OwnCode(lambda h: torch.cat([h.mT, h.mT], 1).mean(2, keepdim=True).expand(-1, 4, -1, -1).mT),
     F88, {-1: "w"}, r"split dim -1 itself \(mean\), dim 2"),
    (_fold_then(nn.GroupNorm(2, 4)), V444, {-3: "t"},
     r"'inner' \(GroupNorm\) gets a tensor"),
]  # fmt: skip


@pytest.mark.parametrize(("net", "shape", "dims", "match"), OWN_REFUSED)
def test_model_code_over_or_moving_a_split_dim_raises_at_the_first_call(
    net: nn.Module, shape: tuple[int, ...], dims: Mapping[int, str], match: str
) -> None:
    """Each call would act on the rank's block as if it were the whole domain (or cannot be
    followed): it raises at the first call, naming the op and the split dim."""
    mesh = fd.Mesh({a: 2 for a in dims.values()})
    pm = fd.nn.parallelize(net.double(), mesh, {"": fd.nn.DomainParallel(dims)})
    x = torch.randn(*shape, dtype=F64)
    with pytest.raises(fd.nn.ParallelizeError, match=match):
        pm(x.expand(mesh.size, *shape))


def test_region_returning_moved_split_dims_is_refused() -> None:
    net = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1))
    net.register_forward_hook(lambda m, a, out: out.transpose(2, 3))
    pm = fd.nn.parallelize(net.double(), fd.Mesh({"h": 2}), {"": fd.nn.DomainParallel({-2: "h"})})
    with pytest.raises(fd.nn.ParallelizeError, match="the region returns a tensor of shape"):
        pm(torch.randn(1, 2, 8, 8, dtype=F64).expand(2, 1, 2, 8, 8))


# ------------------------------------------------- ops that gave a silent wrong answer before
def _stack_last(h: Tensor) -> Tensor:
    """``torch.stack`` along a new last dim moves H to dim 2 of five: a softmax over dim 2 is
    over the split dim (read as W by the number of dims before the guard followed stacks)."""
    return torch.stack([h, 2 * h], -1).softmax(2).unbind(-1)[0]


#: each ran on the block as if it were the whole domain, silently, before the guard read it:
#: ``(fn on the first convolution's output, split, match)``
SILENT_BEFORE: list[tuple[Callable[[Tensor], Tensor], str, str]] = [
    (lambda h: torch.einsum("nchw->ncw", h)[:, :, None].expand_as(h), "h",
     r"einsum\('nchw->ncw'\).*sums over subscript 'h'"),
    (lambda h: h * torch.einsum("nchw,nchw->nc", h, h)[..., None, None], "hw",
     r"einsum.*sums over subscript"),
    (lambda h: torch.einsum("nchw,nciw->nchi", h, h)[..., :6], "h",
     r"einsum.*subscript 'i' here, elsewhere another"),
    (lambda h: torch.gather(h, 2, torch.zeros_like(h, dtype=torch.long)), "h",
     r"gather over the split dim -2"),
    (lambda h: h.index_select(2, torch.tensor([0] * 8)), "h", r"index_select over the split dim"),
    (lambda h: torch.take_along_dim(h, torch.zeros_like(h, dtype=torch.long), 2), "h",
     r"take_along_dim over the split dim"),
    (lambda h: torch.zeros_like(h).scatter(2, torch.zeros_like(h, dtype=torch.long), h), "h",
     r"scatter over the split dim"),
    (lambda h: torch.ops.aten.sum.dim_IntList(h, [2], True).expand_as(h), "h",
     r"torch.ops.aten.sum.dim_IntList .*a direct aten call"),
    (lambda h: torch.ops.aten.flip(h, [2]), "h", r"torch.ops.aten.flip .*direct aten call"),
    (lambda h: torch.diagonal(h[:, :, :6], dim1=2, dim2=3)[..., None, :].expand(-1, -1, 8, -1),
     "h", r"diagonal over the split dim"),
    (lambda h: torch.trapezoid(h, dim=2)[:, :, None].expand_as(h), "h", r"\(trapezoid\)"),
    (lambda h: h * torch.histc(h, 4).sum(), "h", r"\(histc\)"),
    (lambda h: torch.renorm(h, 2, 1, 1.0), "h", r"\(renorm\)"),
    (lambda h: torch.cdist(h, h)[..., :6], "h", r"cdist over the split dim"),
    (lambda h: F.cosine_similarity(h, h.flip(3), dim=2)[:, :, None].expand_as(h), "h",
     r"\(cosine_similarity\)"),
    (lambda h: h * F.mse_loss(h, h.flip(1)), "h", r"\(mse_loss\)"),
    (lambda h: F.glu(h, 2).repeat_interleave(2, dim=2), "h", r"glu over the split dim"),
    (lambda h: h * torch.linalg.svdvals(h).sum(), "h", r"svdvals over the split dim"),
    (_stack_last, "h", r"split dim -2 itself \(softmax\), dim 2 of this tensor"),
    # torch's own spellings of the functional layers, and ops the tables lacked
    (lambda h: torch.layer_norm(h, h.shape[2:]), "h", r"\(layer_norm\)"),
    (lambda h: torch.group_norm(h, 2), "h", r"torch.group_norm itself"),
    (lambda h: torch.batch_norm(h, None, None, None, None, True, 0.1, 1e-5, False), "h",
     r"torch.batch_norm itself"),
    (lambda h: torch.max_pool2d(h, 3, 1, 1), "h", r"torch.max_pool2d itself"),
    (lambda h: torch.special.softmax(h, 2), "h", r"\(special_softmax\)"),
    (lambda h: h - torch.special.logsumexp(h, 2, keepdim=True), "h", r"\(special_logsumexp\)"),
    (lambda h: h.sum_to_size(1, 4, 1, 6).expand_as(h), "h", r"\(sum_to_size\)"),
    (lambda h: h.clone().cumsum_(2), "h", r"cumsum_ over the split dim"),
    (lambda h: h.clone().tril_(), "h", r"tril_ over the split dim"),
    (lambda h: h.triu(), "h", r"triu over the split dim"),
    (lambda h: h * torch.norm_except_dim(h, 2, 1), "h", r"\(norm_except_dim\)"),
    (lambda h: h.select(2, 0)[:, :, None].expand_as(h), "h", r"select over the split dim"),
    (lambda h: F.local_response_norm(h.transpose(1, 2), 2).transpose(1, 2), "h",
     r"local_response_norm over the split dim -2 .*dim 1 of this tensor"),
    # a size computed from the block's shape, read as the whole domain's: H not upsampled
    (lambda h: F.interpolate(h, size=(2 * h.shape[2], 2 * h.shape[3])), "h",
     r"F.interpolate\(size=...\) .*factors \[1.0, 2.0\].*split dim -2 \(2 ranks\)"),
    (lambda h: F.interpolate(h, size=(2 * h.shape[2], 2 * h.shape[3])), "hw",
     r"F.interpolate\(size=...\) .*factors \[1.0, 1.0\]"),
]  # fmt: skip


@pytest.mark.parametrize(("fn", "split", "match"), SILENT_BEFORE)
def test_ops_that_were_silently_wrong_raise_at_the_first_call(
    fn: Callable[[Tensor], Tensor], split: str, match: str
) -> None:
    """Each acts on the split dims (an einsum summing one, an index along one, an aten call the
    guard does not read, a norm or distance over one, a stack that moves one): refused at the
    first call, naming the op, where it gave a wrong answer with no error before."""
    axes, dims = MESHES[split]
    mesh = fd.Mesh(axes)
    pm = fd.nn.parallelize(OwnCode(fn).double(), mesh, {"": fd.nn.DomainParallel(dims)})
    x = torch.randn(1, 2, 8, 6, dtype=F64)
    with pytest.raises(fd.nn.ParallelizeError, match=match):
        pm(x.expand(mesh.size, *x.shape))


#: the same ops over dims that are not split, followed exactly: equal to one device (the
#: unfold along channels and the einsum with a new dim were refused before, falsely)
READ_EXACTLY: dict[str, tuple[Callable[[Tensor], Tensor], str]] = {
    "einsum over channels": (
        lambda h: torch.einsum("nchw,cd->ndhw", h, torch.linspace(0, 1, 16).view(4, 4).to(h)),
        "hw"),
    "einsum with an ellipsis and a new dim": (
        lambda h: torch.einsum("...hw,k->...hwk", h, torch.ones(3).to(h)).softmax(-1).sum(-1)
        + h.mean(1, keepdim=True), "hw"),
    "stack along a new last dim, softmax over it": (
        lambda h: torch.stack([h, h * h], -1).softmax(-1)[..., 0], "hw"),
    "unfold along channels": (lambda h: h.unfold(1, 2, 2).mean(-1).repeat_interleave(2, 1), "h"),
    "gather / index_select along channels": (
        lambda h: torch.gather(h, 1, torch.ones_like(h, dtype=torch.long))
        + h.index_select(1, torch.tensor([3, 2, 1, 0])), "hw"),
    "an elementwise aten call": (lambda h: torch.ops.aten.mul(h, h), "h"),
    "expand to a new leading dim, mean over it": (
        lambda h: h.expand(3, *h.shape).mean(0) + torch.broadcast_to(h, (2, *h.shape))[1], "hw"),
    "unbind channels, stack them back": (lambda h: torch.stack(h.unbind(1)[::-1], 1), "hw"),
    "pixel unshuffle and shuffle, channels-first and with H and W swapped": (
        lambda h: F.pixel_shuffle(F.pixel_unshuffle(h, 2), 2)
        + F.pixel_shuffle(F.pixel_unshuffle(h.transpose(2, 3), 2), 2).transpose(2, 3), "h"),
    "repeat_interleave by an int along a split dim (each row where it is)": (
        lambda h: h.repeat_interleave(2, dim=2), "h"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(READ_EXACTLY))
def test_ops_over_dims_that_are_not_split_equal_one_device(case: str) -> None:
    fn, split = READ_EXACTLY[case]
    equal_to_one_device(OwnCode(fn), (1, 2, 8, 6), split)


class WithEmbedding(nn.Module):
    """A conv net given a text embedding ``[N, L, C]`` besides the field: a softmax and a layer
    norm over its last dim, a Linear, a mean over L, added to the field as a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)
        self.proj = nn.Linear(5, 4)

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        e = self.proj(F.layer_norm(emb.softmax(-1), (5,))).mean(1)
        return self.c2(self.c1(x) + e[:, :, None, None])


def test_an_embedding_beside_the_field_holds_no_split_dims() -> None:
    """The region's inputs other than the field are whole on every rank: a softmax over the
    last dim of a ``[N, L, C]`` embedding runs with W split (refused before: read by its number
    of dims as holding W); equal to one device. A convolution of such an input is refused (its
    halos would be exchanged as if it were a block)."""
    emb = torch.randn(1, 3, 5, dtype=F64)
    for split in ("w", "hw"):
        n = fd.Mesh(MESHES[split][0]).size

        def call(m: Any, t: Tensor, n: int = n) -> Tensor:
            return m(t, emb) if t.dim() == 4 else m(t, emb.expand(n, *emb.shape))

        equal_to_one_device(WithEmbedding(), (1, 2, 4, 6), split, call=call)

    class ConvOfInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x: Tensor, cond: Tensor) -> Tensor:
            return self.c(x) + self.c(cond).mean()

    pm = fd.nn.parallelize(
        ConvOfInput().double(), fd.Mesh({"h": 2}), {"": fd.nn.DomainParallel({-2: "h"})}
    )
    x = torch.randn(1, 2, 8, 6, dtype=F64).expand(2, 1, 2, 8, 6)
    with pytest.raises(fd.nn.ParallelizeError, match="'c' .*holds no split rows"):
        pm(x, x.clone())


class Conditioned(nn.Module):
    """A conv net given a per-image condition ``[N, C]`` expanded to the feature map's size
    (``h.shape``) and concatenated, or a mask resized to it."""

    def __init__(self, resize: bool) -> None:
        super().__init__()
        self.c1, self.c2, self.resize = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(6, 2, 1), resize

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        h = self.c1(x)
        if self.resize:  # the whole mask to this rank's block's size: refused
            return self.c2(torch.cat([h, F.interpolate(cond, size=h.shape[-2:])], 1))
        c = cond[:, :, None, None].expand(-1, -1, h.shape[2], h.shape[3])
        return self.c2(torch.cat([h, c], 1))


def test_an_input_sized_to_the_block_is_refused_or_taken_to_hold_its_rows() -> None:
    """A condition expanded to ``h.shape`` is constant along the rows: equal to one device; a
    whole mask resized to ``h.shape`` would be paired with the block's rows: refused."""
    cond = torch.randn(1, 2, dtype=F64)
    equal_to_one_device(
        Conditioned(False), (1, 2, 8, 6), "hw",
        call=lambda m, t: m(t, cond) if t.dim() == 4 else m(t, cond.expand(4, 1, 2)),
    )  # fmt: skip
    mask = torch.randn(1, 2, 2, 3, dtype=F64)
    pm = fd.nn.parallelize(
        Conditioned(True).double(), fd.Mesh({"h": 2}), {"": fd.nn.DomainParallel({-2: "h"})}
    )
    x = torch.randn(1, 2, 8, 6, dtype=F64).expand(2, 1, 2, 8, 6)
    with pytest.raises(fd.nn.ParallelizeError, match=r"F.interpolate .*sizes a tensor that holds"):
        pm(x, mask.expand(2, *mask.shape))
