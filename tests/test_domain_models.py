"""Real diffusers models (tiny configs, random init) made domain-parallel with
`fastdist.nn.DomainParallel`, against the same model on one device in float64, forward and
backward, on simulated ranks: ``AutoencoderKL``'s decoder and encoder (with and without their
mid-block attention over H x W), ``UNet2DModel`` (with attention blocks), Wan's video VAE decoder
(per-frame attention over H x W; its frame-cached ``decode`` split over H x W) and encoder."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fastdist as fd
from tests.test_domain import equal_to_one_device

pytest.importorskip("diffusers")


def tiny_vae(attention: bool = False) -> Any:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
        mid_block_add_attention=attention,
    )


@pytest.mark.parametrize("split", ["h", "hw"])
def test_autoencoder_kl_decoder(split: str) -> None:
    """GroupNorm over the whole domain, SiLU, 3x3 convs, ``Upsample2D``'s nearest
    ``F.interpolate``: a 4 x 6 latent decoded to 8 x 12, split over H and over H x W."""
    equal_to_one_device(tiny_vae().decoder, (1, 4, 4, 6), split)


def test_autoencoder_kl_encoder() -> None:
    """``Downsample2D`` pads ``(0, 1)`` by hand before its stride-2 conv: the style folds that
    padding into the conv's halo (the output half the length on every rank)."""
    equal_to_one_device(tiny_vae().encoder, (1, 3, 8, 12), "hw")


def test_unet2d_model() -> None:
    """``UNet2DModel`` without attention: time embedding (Linear over channels), skip
    connections, ``Upsample2D`` called with the skip's whole size, strided-conv downsampling."""
    from diffusers import UNet2DModel
    from diffusers.models.embeddings import Timesteps

    torch.manual_seed(0)
    unet = UNet2DModel(
        sample_size=8,
        in_channels=2,
        out_channels=2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
        add_attention=False,
    )
    equal_to_one_device(
        unet, (1, 2, 8, 12), "h", call=lambda m, x: m(x, 3.0).sample, local=(Timesteps,)
    )


def test_autoencoder_kl_mid_block_attention() -> None:
    """The mid-block ``Attention`` (its ``group_norm`` on the flattened tokens, whole-domain
    statistics) attends each rank's queries over the whole H x W's keys: decoder over H x W,
    encoder over H."""
    equal_to_one_device(tiny_vae(attention=True).decoder, (1, 4, 4, 6), "hw")
    equal_to_one_device(tiny_vae(attention=True).encoder, (1, 3, 8, 12), "h")


@pytest.mark.parametrize(
    ("shape", "split", "sizes"),
    [((1, 4, 5, 6), "h", {-2: [2, 3]}), ((1, 4, 5, 6), "hw", {-2: [3, 2], -1: [2, 4]})],
)
def test_autoencoder_kl_decoder_with_uneven_blocks(
    shape: tuple[int, ...], split: str, sizes: dict[int, list[int]]
) -> None:
    """A latent H the ranks do not divide (5 rows over 2 ranks): the blocks padded to one shape
    on simulated ranks, the mid-block attention's padding keys masked out, its group norm over
    the valid tokens only."""
    equal_to_one_device(tiny_vae(attention=True).decoder, shape, split, sizes=sizes)


def test_autoencoder_kl_encoder_with_uneven_blocks() -> None:
    """``Downsample2D``'s stride 2 on blocks of 4 and 6 rows (2 and 3 after it)."""
    equal_to_one_device(tiny_vae(attention=True).encoder, (1, 3, 10, 12), "h", sizes={-2: [4, 6]})


@pytest.mark.parametrize(
    ("shape", "split", "sizes"),
    [((1, 4, 4, 6), "hw", None), ((1, 4, 7, 6), "h3", {-2: [2, 2, 3]})],
)
def test_ring_attention(shape: tuple[int, ...], split: str, sizes: Any) -> None:
    """``attention="ring"``: the keys and values pass around the ranks of the split axes (H x W:
    one flattened ring of 4), merged with an online softmax; equal to one device, even and
    uneven blocks (the padding keys masked in every block)."""
    vae = tiny_vae(attention=True)
    equal_to_one_device(vae.decoder, shape, split, attention="ring", sizes=sizes)


def test_ring_attention_holds_one_block_of_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The largest key / value tensor a rank receives in the mid-block attention's forward and
    backward (an 8 x 8 latent over a 2 x 2 grid, 16 tokens per rank): gathered, the whole
    domain's 64 tokens; ring, one block of 16 (each received block, never a concatenation). And
    the ring's backward keeps fewer bytes: its own blocks, not the gathered keys."""
    import fastdist.nn.domain.attention as attention

    held: list[int] = []
    for name in ("all_gather", "ring_shift"):
        fn = getattr(attention, name)

        def record(t: torch.Tensor, *args: Any, _fn: Any = fn, **kwargs: Any) -> torch.Tensor:
            out: torch.Tensor = _fn(t, *args, **kwargs)
            if out.dim() == 4:  # [N, heads, tokens, head_dim] (not the key mask, the counts)
                held.append(out.shape[-2])
            return out

        monkeypatch.setattr(attention, name, record)
    most, saved = {}, {}
    z = torch.randn(1, 4, 8, 8, dtype=torch.float64).expand(4, -1, -1, -1, -1)
    for form in ("gather", "ring"):
        held.clear()
        mesh = fd.Mesh({"h": 2, "w": 2})
        style = fd.nn.DomainParallel({-2: "h", -1: "w"}, attention=form)
        pm = fd.nn.parallelize(tiny_vae(attention=True).decoder.double(), mesh, {"": style})
        sizes: dict[int, int] = {}

        def pack(t: torch.Tensor, _sizes: dict[int, int] = sizes) -> torch.Tensor:
            _sizes[id(t)] = t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = pm(z)
        out.sum().backward()
        most[form], saved[form] = max(held), sum(sizes.values())
    assert most == {"gather": 64, "ring": 16}
    assert saved["ring"] < saved["gather"], saved


def test_unet2d_model_with_attention() -> None:
    """``AttnDownBlock2D`` / ``AttnUpBlock2D`` (several heads) over H x W."""
    from diffusers import UNet2DModel
    from diffusers.models.embeddings import Timesteps

    torch.manual_seed(0)
    unet = UNet2DModel(
        sample_size=8,
        in_channels=2,
        out_channels=2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
        attention_head_dim=4,
    )
    equal_to_one_device(
        unet, (1, 2, 8, 12), "hw", call=lambda m, x: m(x, 3.0).sample, local=(Timesteps,)
    )


def tiny_wan() -> Any:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                            temperal_downsample=[True])  # fmt: skip


@pytest.mark.parametrize("split", ["hw", "thw"])
def test_wan_decoder(split: str) -> None:
    """Wan's decoder called on a whole latent video (no frame cache): causal 3-d convs, RMS norms,
    ``WanUpsample`` (float32 nearest-exact), per-frame attention over H x W (a T split is in its
    batch)."""
    frames = 4 if split == "thw" else 2  # the causal halo (2 frames) fits a block
    equal_to_one_device(tiny_wan().decoder, (1, 4, frames, 4, 6), split)


class WanDecode(torch.nn.Module):
    """``AutoencoderKLWan.decode``: frame by frame through the decoder, with its frame cache."""

    def __init__(self, vae: Any) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.vae.decode(z).sample
        return out


def test_wan_decode_with_frame_cache() -> None:
    """The real decode (one latent frame at a time, the causal convs' frame cache held as each
    rank's block), the decoder split over H x W, equal to one device forward and backward."""
    equal_to_one_device(WanDecode(tiny_wan()), (1, 4, 3, 4, 6), "hw", plan_key="vae.decoder")


class WanEncode(torch.nn.Module):
    """``AutoencoderKLWan.encode``: the first frame, then chunks of 4, with the frame cache."""

    def __init__(self, vae: Any) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.vae.encode(x).latent_dist.mean
        return out


def test_wan_encoder() -> None:
    """Wan's encoder over H x W: its downsampling ``Sequential(ZeroPad2d((0, 1, 0, 1)),
    Conv2d(stride=2))`` (the padding folded into the convolution's halo), called on one frame,
    and the real ``encode`` (5 frames: 1 then 4, with the frame cache and the strided temporal
    convolution)."""
    equal_to_one_device(tiny_wan().encoder, (1, 3, 1, 8, 12), "hw")
    equal_to_one_device(WanEncode(tiny_wan()), (1, 3, 5, 8, 12), "hw", plan_key="vae.encoder")


def test_wan_decode_with_frame_cache_refuses_a_t_split() -> None:
    """The decode runs the decoder one latent frame at a time (then a cache of the frames before):
    a T split is refused at the first call, naming the one-frame field."""
    pm = fd.nn.parallelize(
        WanDecode(tiny_wan()).double(), fd.Mesh({"t": 2}),
        {"vae.decoder": fd.nn.DomainParallel({-3: "t"})},
    )  # fmt: skip
    with pytest.raises(fd.nn.ParallelizeError, match=r"dim -3 of the field has 1 rows"):
        pm(torch.randn(1, 4, 4, 4, 4, dtype=torch.float64).expand(2, -1, -1, -1, -1, -1))


def test_attention_refusals() -> None:
    """An attention processor without ``F.scaled_dot_product_attention`` raises at the first call
    (its keys would be this rank's only); ``nn.MultiheadAttention`` is refused at parallelize
    time."""
    from diffusers.models.attention_processor import AttnProcessor

    vae = tiny_vae(attention=True).double()
    vae.decoder.mid_block.attentions[0].set_processor(AttnProcessor())
    pm = fd.nn.parallelize(vae.decoder, fd.Mesh({"h": 2}), {"": fd.nn.DomainParallel({-2: "h"})})
    with pytest.raises(fd.nn.ParallelizeError, match=r"ran no F.scaled_dot_product_attention"):
        pm(torch.randn(1, 4, 4, 6, dtype=torch.float64).expand(2, -1, -1, -1, -1))
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 1), torch.nn.MultiheadAttention(4, 1))
    with pytest.raises(fd.nn.ParallelizeError, match=r"'1' \(MultiheadAttention\): an attention"):
        fd.nn.parallelize(net, fd.Mesh({"h": 2}), {"": fd.nn.DomainParallel({-2: "h"})})


def test_attention_with_uneven_blocks_on_gloo() -> None:
    """2 gloo processes, W split into 2 and 4 latent columns: the mid-block attention gathers
    keys of 8 and 16 tokens (``all_gather_v``), or passes them around a ring (``attention="ring"``:
    padded to 16, the padding masked), equal to one device forward and backward."""
    from tests.dist_harness import run_on_gloo
    from tests.domain_gloo_worker import vae_attention_inputs, vae_attention_on_gloo

    net, z, cot = vae_attention_inputs()
    zr = z.clone().requires_grad_()
    out = net(zr)
    (out * cot).sum().backward()
    results = run_on_gloo(vae_attention_on_gloo, 2, timeout=180)
    for got in (g for per_rank in results for g in per_rank.values()):
        assert torch.allclose(got["out"], out, atol=1e-10)
        assert torch.allclose(got["dz"], zr.grad, atol=1e-10)  # type: ignore[arg-type]
        for name, p in net.named_parameters():
            assert torch.allclose(got["grads"][name], p.grad, atol=1e-10), name  # type: ignore[arg-type]


def test_ring_attention_over_a_grid_on_gloo() -> None:
    """4 gloo processes, H x W over 2 x 2 with uneven W blocks: the ring runs over both axes as
    one flattened ring (its own backward passing the blocks around again), equal to one device
    forward and backward."""
    from tests.dist_harness import run_on_gloo
    from tests.domain_gloo_worker import vae_attention_inputs, vae_ring_grid_on_gloo

    net, z, cot = vae_attention_inputs()
    zr = z.clone().requires_grad_()
    out = net(zr)
    (out * cot).sum().backward()
    for got in run_on_gloo(vae_ring_grid_on_gloo, 4, timeout=180):
        assert torch.allclose(got["out"], out, atol=1e-10)
        assert torch.allclose(got["dz"], zr.grad, atol=1e-10)  # type: ignore[arg-type]
        for name, p in net.named_parameters():
            assert torch.allclose(got["grads"][name], p.grad, atol=1e-10), name  # type: ignore[arg-type]


def tiny_hunyuan_video(attention: bool = False) -> Any:
    """``AutoencoderKLHunyuanVideo``, tiny: 3 blocks (spatial compression 4, temporal 4), 4 latent
    channels, the mid-block attention (over every frame's tokens, a frame-causal mask) on or
    off."""
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(0)
    return AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16),
        down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3, layers_per_block=1, norm_num_groups=4,
        spatial_compression_ratio=4, temporal_compression_ratio=4,
        mid_block_add_attention=attention,
    )  # fmt: skip


#: (the VAE's call, its plan key, the field, the split): the real ``decode`` / ``encode`` (the
#: calls of ``WanDecode`` / ``WanEncode``) over H (2 and 3 ranks) and H x W
HUNYUAN_VIDEO_CASES = [
    (WanDecode, "vae.decoder", (1, 4, 2, 4, 6), "h"),
    (WanEncode, "vae.encoder", (1, 3, 5, 8, 12), "h"),
    (WanDecode, "vae.decoder", (1, 4, 2, 6, 6), "h3"),
    (WanDecode, "vae.decoder", (1, 4, 2, 4, 6), "hw"),
    (WanEncode, "vae.encoder", (1, 3, 5, 8, 16), "hw"),
]


@pytest.mark.parametrize(("call", "key", "shape", "split"), HUNYUAN_VIDEO_CASES)
def test_hunyuan_video_vae(call: Any, key: str, shape: tuple[int, ...], split: str) -> None:
    """``AutoencoderKLHunyuanVideo``'s decode and encode equal to one device forward and
    backward: every convolution is a ``HunyuanVideoCausalConv3d``, which pads H and W
    (replicate) and T (causal, 2 frames before) by hand with ``F.pad`` before a ``padding=0``
    ``Conv3d``; the style runs that padding as the convolution's halo (before, each rank padded
    its own block's edges: refused)."""
    equal_to_one_device(call(tiny_hunyuan_video()), shape, split, plan_key=key)


@pytest.mark.parametrize(
    ("split", "attention", "match"),
    [("thw", False, "split over the split dim -3"), ("hw", True, "Tensor.flatten")],
)
def test_hunyuan_video_vae_refusals(split: str, attention: bool, match: str) -> None:
    """Not built, refused at the first call: a T split (``HunyuanVideoUpsampleCausal3D``
    upsamples the first frame of its input apart from the others: per rank that would be each
    block's first frame, a silently wrong frame count); the mid-block attention (over the
    tokens the model flattens itself, T x H x W, with a frame-causal mask)."""
    from tests.test_domain import MESHES

    axes, dims = MESHES[split]
    mesh = fd.Mesh(axes)
    vae = tiny_hunyuan_video(attention).double()
    pm = fd.nn.parallelize(WanDecode(vae), mesh, {"vae.decoder": fd.nn.DomainParallel(dims)})
    shape = (1, 4, 4, 4, 6)
    with pytest.raises(fd.nn.ParallelizeError, match=rf"DomainParallel on 'vae.decoder'.*{match}"):
        pm(torch.randn(*shape, dtype=torch.float64).expand(mesh.size, *shape))


def hunyuan_decode_on_gloo() -> dict[str, Any]:
    """One gloo rank of H over 2 (6 latent rows: 3 + 3; W of 5 unsplit): the whole decoded
    video, the latents' gradient and every parameter's gradient."""
    mesh = fd.connect(h=2, timeout=120)
    net = WanDecode(tiny_hunyuan_video()).double()
    pm = fd.nn.parallelize(net, mesh, {"vae.decoder": fd.nn.DomainParallel({-2: "h"})})
    z = torch.randn(1, 4, 2, 6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    zr = z.clone().requires_grad_()
    out = pm(zr)
    (out * out.detach().cos()).sum().backward()
    return {"out": out.detach(), "dz": zr.grad, "grads": pm.grads()}


def test_hunyuan_video_decode_on_gloo() -> None:
    """2 gloo processes: ``AutoencoderKLHunyuanVideo``'s decode over H (its causal
    convolutions' replicate padding as the halo at the domain's edges) equals one device
    forward and backward."""
    from tests.dist_harness import run_on_gloo

    net = WanDecode(tiny_hunyuan_video()).double()
    z = torch.randn(1, 4, 2, 6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    zr = z.clone().requires_grad_()
    out = net(zr)
    (out * out.detach().cos()).sum().backward()
    used = [(n, p.grad) for n, p in net.named_parameters() if p.grad is not None]  # the decoder's
    assert len(used) > 20
    for got in run_on_gloo(hunyuan_decode_on_gloo, 2, timeout=180):
        assert torch.allclose(got["out"], out, atol=1e-10)
        assert torch.allclose(got["dz"], zr.grad, atol=1e-10)  # type: ignore[arg-type]
        for name, g in used:
            assert torch.allclose(got["grads"][name], g, atol=1e-10), name
