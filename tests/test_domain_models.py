"""Real diffusers models (tiny configs, random init) made domain-parallel with
`fastdist.nn.DomainParallel`, against the same model on one device in float64, forward and
backward, on simulated ranks: ``AutoencoderKL``'s decoder and encoder, ``UNet2DModel``; Wan's
video VAE decoder is refused (its mid-block attention spans the split H x W)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fastdist as fd
from tests.test_domain import equal_to_one_device

pytest.importorskip("diffusers")


def tiny_vae() -> Any:
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
        mid_block_add_attention=False,
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


def test_wan_decoder_attention_is_refused() -> None:
    """Wan's decoder attends over each frame's H x W tokens (``WanAttentionBlock``): refused at
    parallelize time, named, with the fix."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                           temperal_downsample=[True])  # fmt: skip
    with pytest.raises(fd.nn.ParallelizeError, match=r"mid_block.attentions.0.*self-attention"):
        fd.nn.parallelize(vae.decoder, fd.Mesh({"h": 2}), {"": fd.nn.DomainParallel({-2: "h"})})
