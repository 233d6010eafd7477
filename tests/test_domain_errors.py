"""`fastdist.nn.DomainParallel` on odd and uneven blocks: the common conv-net layers either equal
one device (float64, forward and backward, simulated ranks) or raise a fastdist error at the first
call naming the op, the split dim, the blocks and the fix, never torch's raw error about a
block's size (which does not say the block is one rank's) and never a silent wrong answer."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fastdist as fd
from tests.test_domain import F64, MESHES, equal_to_one_device


class Fn(nn.Module):
    """``f`` in the model's own forward, after a 1 x 1 convolution (the guard watches it)."""

    def __init__(self, f: Callable[[Tensor], Tensor], channels: int = 2) -> None:
        super().__init__()
        self.f, self.c = f, nn.Conv2d(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.f(self.c(x))


def _first_call(net: nn.Module, shape: tuple[int, ...], split: str, **style: Any) -> None:
    """``net`` domain-parallel over ``MESHES[split]``, called once on a field of ``shape``."""
    axes, dims = MESHES[split]
    mesh = fd.Mesh(axes)
    pm = fd.nn.parallelize(net.to(F64), mesh, {"": fd.nn.DomainParallel(dims, **style)})
    pm(torch.zeros(mesh.size, *shape, dtype=F64))


def _unshuffle_module(r: int) -> nn.Module:
    c = 2 * r * r
    return nn.Sequential(nn.PixelUnshuffle(r), nn.Conv2d(c, c, 3, padding=1), nn.PixelShuffle(r))


def _unshuffle_fn(r: int) -> nn.Module:
    return Fn(lambda h: F.pixel_shuffle(F.pixel_unshuffle(h, r), r))


# (make, shape, split, sizes, the blocks the message names)
UNSHUFFLE_REFUSED = [
    (lambda: _unshuffle_module(2), (1, 2, 8, 6), "hw", None, r"split dim -1 .*\[3, 3\]"),
    (lambda: _unshuffle_fn(2), (1, 2, 8, 6), "w", None, r"split dim -1 .*\[3, 3\]"),
    (lambda: _unshuffle_module(3), (1, 2, 12, 6), "h3", None, r"split dim -2 .*\[4, 4, 4\]"),
    (lambda: _unshuffle_module(2), (1, 2, 8, 4), "h", {-2: [3, 5]}, r"split dim -2 .*\[3, 5\]"),
    (lambda: _unshuffle_fn(2), (1, 2, 8, 4), "h", {-2: [6, 2]}, None),  # [6, 2]: divides
]


@pytest.mark.parametrize(("make", "shape", "split", "sizes", "blocks"), UNSHUFFLE_REFUSED)
def test_pixel_unshuffle_needs_every_block_to_divide_by_its_factor(
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    split: str,
    sizes: dict[int, list[int]] | None,
    blocks: str | None,
) -> None:
    """One device needs only the whole length to divide by the factor; a rank's block must too
    (its pixel groups then are the whole domain's). Where one does not: a fastdist error at the
    first call naming the op, the factor, the split dim, the blocks and the fix (before: torch's
    "pixel_unshuffle expects width to be divisible by downscale_factor", naming a block's size
    as if it were the input's). Where every block divides: equal to one device."""
    style = {"sizes": sizes} if sizes else {}
    if blocks is None:
        equal_to_one_device(make(), shape, split, **style)
        return
    with pytest.raises(fd.nn.ParallelizeError, match=r"pixel_unshuffle .*downscale_factor=") as err:
        _first_call(make(), shape, split, **style)
    assert re.search(blocks, str(err.value)), str(err.value)
    assert "Fix: a domain length" in str(err.value)


@pytest.mark.parametrize(
    ("make", "shape", "split", "sizes"),
    [
        (lambda: _unshuffle_module(2), (1, 2, 12, 6), "h3", None),
        (lambda: _unshuffle_module(2), (1, 2, 8, 6), "h", {-2: [2, 6]}),
        (lambda: _unshuffle_fn(3), (1, 2, 6, 9), "w", {-1: [6, 3]}),
        # pixel shuffle multiplies each block: any block
        (lambda: nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.PixelShuffle(2),
                               nn.Conv2d(2, 2, 3, stride=2, padding=1)), (1, 2, 9, 7), "hw",
         {-2: [3, 6], -1: [5, 2]}),
    ],
)  # fmt: skip
def test_pixel_shuffles_on_blocks_that_divide_equal_one_device(
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    split: str,
    sizes: dict[int, list[int]] | None,
) -> None:
    equal_to_one_device(make(), shape, split, **({"sizes": sizes} if sizes else {}))


# common layers on odd and uneven blocks, each equal to one device
EXACT: list[tuple[str, Callable[[], nn.Module], tuple[int, ...], str, Any]] = [
    ("nearest x2, uneven", lambda: nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"),
                                                 nn.Conv2d(2, 2, 3, padding=1)),
     (1, 2, 8, 6), "h", {-2: [2, 6]}),
    ("nearest x2, odd", lambda: nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"),
                                              nn.Conv2d(2, 2, 3, padding=1)),
     (1, 2, 9, 7), "hw", {-2: [3, 6], -1: [5, 2]}),
    ("max pool k3 s1 p1, odd", lambda: nn.MaxPool2d(3, stride=1, padding=1), (1, 2, 9, 7), "hw",
     {-2: [3, 6], -1: [5, 2]}),
    ("max pool k3 p1 (stride 3)", lambda: nn.MaxPool2d(3, padding=1), (1, 2, 12, 6), "h", None),
    ("max pool k3 s2 p1, uneven", lambda: nn.MaxPool2d(3, stride=2, padding=1), (1, 2, 12, 4),
     "h", {-2: [4, 8]}),
    ("avg pool k3 s2 p1 excl, uneven",
     lambda: nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False), (1, 2, 12, 4), "h",
     {-2: [4, 8]}),
    ("same, dilation 2, odd", lambda: nn.Conv2d(2, 3, 3, padding="same", dilation=2),
     (1, 2, 9, 7), "hw", {-2: [3, 6], -1: [5, 2]}),
    ("same, dilation 3, even kernel, odd", lambda: nn.Conv2d(2, 3, 2, padding="same", dilation=3),
     (1, 2, 9, 7), "hw", {-2: [3, 6], -1: [5, 2]}),
    ("same, dilation 2, circular, uneven",
     lambda: nn.Conv2d(2, 3, 3, padding="same", dilation=2, padding_mode="circular"),
     (1, 2, 8, 6), "h", {-2: [2, 6]}),
    ("conv transpose output_padding 1, odd",
     lambda: nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1), (1, 2, 9, 7),
     "hw", {-2: [3, 6], -1: [5, 2]}),
    ("conv transpose k5 p2 output_padding 1, 3 ranks",
     lambda: nn.ConvTranspose2d(2, 3, 5, stride=2, padding=2, output_padding=1), (1, 2, 9, 4),
     "h3", {-2: [2, 3, 4]}),
    ("adaptive avg (3, 3), blocks of whole bins",
     lambda: nn.AdaptiveAvgPool2d((3, 3)), (1, 2, 9, 6), "h", {-2: [6, 3]}),
    ("adaptive max (3, 3), 3 ranks", lambda: nn.AdaptiveMaxPool2d((3, 3)), (1, 2, 12, 6), "h3",
     None),
]  # fmt: skip


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize(
    ("case", "make", "shape", "split", "sizes"), EXACT, ids=[c[0] for c in EXACT]
)
def test_common_layers_on_odd_and_uneven_blocks_equal_one_device(
    case: str,
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    split: str,
    sizes: dict[int, list[int]] | None,
) -> None:
    equal_to_one_device(make(), shape, split, **({"sizes": sizes} if sizes else {}))


# (case, make, shape, split, sizes, match): refused, naming the op and the fix
REFUSED: list[tuple[str, Callable[[], nn.Module], tuple[int, ...], str, Any, str]] = [
    ("avg pool ceil_mode", lambda: nn.AvgPool2d(2, ceil_mode=True), (1, 2, 8, 6), "h", None,
     r"AvgPool2d\): ceil_mode=True .* not built. Fix"),
    ("max pool k2 p1", lambda: nn.MaxPool2d(2, padding=1), (1, 2, 8, 6), "h", None,
     r"MaxPool2d\) has kernel 2, stride 2, dilation 1 and padding \(1, 1\) .* Fix"),
    ("stride 2 conv, blocks of 3", lambda: nn.Conv2d(2, 2, 3, stride=2, padding=1),
     (1, 2, 8, 6), "w", None, r"Conv2d\) has stride 2 along the split dim -1 and blocks of "
     r"\[3\] rows.* Fix"),
    ("stride 2 max pool, uneven", lambda: nn.MaxPool2d(2), (1, 2, 9, 4), "h", {-2: [3, 6]},
     r"MaxPool2d\) has stride 2 along the split dim -2 and blocks of \[3, 6\] rows"),
    ("stride 3 avg pool, 3 ranks", lambda: nn.AvgPool2d(3), (1, 2, 12, 6), "h3", None,
     r"AvgPool2d\) has stride 3 along the split dim -2 and blocks of \[4\] rows"),
    ("interpolate x0.5, odd", lambda: Fn(lambda h: F.interpolate(h, scale_factor=0.5)),
     (1, 2, 9, 7), "hw", {-2: [3, 6], -1: [5, 2]}, r"F.interpolate\(mode='nearest'.*factors "
     r"\[0.5, 0.5\]\) .* integer factors >= 1"),
    ("interpolate area x0.5", lambda: Fn(lambda h: F.interpolate(h, scale_factor=0.5,
                                                                 mode="area")),
     (1, 2, 8, 6), "h", None, r"mode='area'.* Fix"),
    ("adaptive (3, 3), uneven", lambda: nn.AdaptiveAvgPool2d((3, 3)), (1, 2, 8, 6), "h",
     {-2: [2, 6]}, r"pools the split dim -2 \(8 rows in blocks of \[2, 6\]\) to 3 rows.* Fix"),
    ("functional max pool", lambda: Fn(lambda h: F.max_pool2d(h, 2)), (1, 2, 8, 6), "h", None,
     r"calls F\.max_pool2d itself"),
    ("channel dropout in training",
     lambda: Fn(lambda h: F.dropout2d(h, 0.5, training=True)), (1, 2, 8, 6), "h", None,
     r"F\.dropout2d itself .* a channel dropout in training \(p=0.5\).* Fix"),
]  # fmt: skip


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize(
    ("case", "make", "shape", "split", "sizes", "match"), REFUSED, ids=[c[0] for c in REFUSED]
)
def test_odd_blocks_a_layer_cannot_split_raise_a_clear_error(
    case: str,
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    split: str,
    sizes: dict[int, list[int]] | None,
    match: str,
) -> None:
    """At ``parallelize`` or at the first call, a fastdist error naming the module (or op), the
    split dim and the fix."""
    with pytest.raises(fd.nn.ParallelizeError, match=match):
        _first_call(make(), shape, split, **({"sizes": sizes} if sizes else {}))


def test_channel_dropout_in_eval_runs() -> None:
    """``F.dropout2d(training=False)`` (and ``p=0``) is the identity: it runs."""
    equal_to_one_device(Fn(lambda h: F.dropout2d(h, 0.5, training=False)), (1, 2, 8, 6), "h")
    equal_to_one_device(Fn(lambda h: F.dropout2d(h, 0.0)), (1, 2, 8, 6), "h")
