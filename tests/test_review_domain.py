"""Review of `fastdist.nn.DomainParallel` as a new user: fields and pooled tensors whose split
dims the region used to lose track of, silently (float64, simulated ranks and 2 gloo ranks).

Each case here returned a wrong answer with no error before:

- an unbatched field (``[C, H, W]``, ``[N, L]``): the field was cut, but the layers' layout, the
  functional guard and the output's gather count ``2 + |d|`` dims, so the output came back as each
  rank's block (``[C, H / 2, W]`` for ``[C, H, W]``), a global pooling's gradient counted once per
  rank (2x), and a reduction of the field in the model's code ran on the block unchecked;
- a field a global pooling reduced to one row (the same on every rank), upsampled
  (``Upsample``, ``F.interpolate``, ``ConvTranspose``): gathered as if each rank held a block of
  it (``ranks x`` the rows);
- a block of one row per rank in a region with a global pooling over the same axis: the one-row
  block taken for the pooled field (``pmean``'d in place of gathered: the ranks' rows averaged
  into one).

Now each raises a `ParallelizeError` at the first call naming the field or the module and the fix.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fastdist as fd
from tests.test_domain import F64, MESHES, equal_to_one_device

C = 4


class Fn(nn.Module):
    """A convolution, then ``f`` in the model's own code."""

    def __init__(self, f: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.f, self.c = f, nn.Conv2d(C, C, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.f(self.c(x))


class Signal(nn.Module):
    """A ``[N, L]`` signal centred in the model's code, then a channel added for a ``Conv1d``."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv1d(1, 2, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.c((x - x.mean(-1, keepdim=True)).unsqueeze(1))


class SqueezeThenDown(nn.Module):
    """A squeeze-excitation gate (global pooling over H), then a max pooling that leaves each
    rank one row of H."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.q = nn.Conv2d(C, C, 3, padding=1), nn.Conv2d(C, C, 1)
        self.p, self.m = nn.AdaptiveAvgPool2d(1), nn.MaxPool2d(2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.c(x)
        return self.m(h * torch.sigmoid(self.q(self.p(h))))


class SqueezeThenDownConv(SqueezeThenDown):
    """`SqueezeThenDown`, then a 3 x 3 convolution of the one-row blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.d = nn.Conv2d(C, C, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.d(super().forward(x))


class DownPlusGlobal(nn.Module):
    """A block pooled to one row per rank plus the field's global mean (broadcast)."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.p, self.m = (
            nn.Conv2d(C, C, 3, padding=1),
            nn.AdaptiveAvgPool2d(1),
            nn.AvgPool2d(2),
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.c(x)
        return self.m(h) + self.p(h)


class PooledInterp(nn.Module):
    """A global pooling, then the model's own ``F.interpolate`` by 3."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.p = nn.Conv2d(C, C, 3, padding=1), nn.AdaptiveAvgPool2d(1)

    def forward(self, x: Tensor) -> Tensor:
        return F.interpolate(self.p(self.c(x)), scale_factor=3)


def _global_then(*after: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.AdaptiveAvgPool2d(1), *after)


def _pyramid_nearest() -> nn.Module:
    """PSPNet's pooled branch: the global mean interpolated back to the block's size."""

    class Psp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c, self.p = nn.Conv2d(C, C, 3, padding=1), nn.AdaptiveAvgPool2d(1)
            self.o = nn.Conv2d(2 * C, C, 3, padding=1)

        def forward(self, x: Tensor) -> Tensor:
            h = self.c(x)
            up = F.interpolate(self.p(h), size=h.shape[2:], mode="nearest")
            return self.o(torch.cat([h, up], 1))

    return Psp()


def _run(net: nn.Module, shape: tuple[int, ...], split: str) -> tuple[Tensor, Tensor, Tensor]:
    """``net`` domain-parallel on a field of ``shape``: (its output, one device's output, the
    largest difference of the field's gradients), no shape check."""
    torch.manual_seed(0)
    net = net.to(F64)
    ref = copy.deepcopy(net)
    axes, dims = MESHES[split]
    mesh = fd.Mesh(axes)
    x = torch.randn(*shape, dtype=F64)
    want = ref(xr := x.clone().requires_grad_())
    pm = fd.nn.parallelize(net, mesh, {"": fd.nn.DomainParallel(dims)})
    xs = x.expand(mesh.size, *shape).clone().requires_grad_()
    got = pm(xs)
    got.sum().backward()
    want.sum().backward()
    assert xs.grad is not None and xr.grad is not None
    return got, want, (xs.grad - xr.grad).abs().max()


# (case, make, field shape, split, what the message names)
UNBATCHED: list[tuple[str, Callable[[], nn.Module], tuple[int, ...], str]] = [
    ("conv [C, H, W] over H", lambda: nn.Sequential(nn.Conv2d(C, C, 3, padding=1)), (C, 12, 8),
     "h"),
    ("global pooling [C, H, W] over H x W",
     lambda: nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.AdaptiveAvgPool2d(1)), (C, 12, 8),
     "hw"),
    ("[N, L] signal centred in the model's code", Signal, (2, 12), "w"),
    ("conv3d [C, T, H, W] over T",
     lambda: nn.Sequential(nn.Conv3d(C, C, 3, padding=1)), (C, 8, 4, 4), "thw"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "make", "shape", "split"), UNBATCHED, ids=[c[0] for c in UNBATCHED]
)
def test_an_unbatched_field_is_refused_at_the_first_call(
    case: str, make: Callable[[], nn.Module], shape: tuple[int, ...], split: str
) -> None:
    """Before: ``conv [C, H, W]`` returned each rank's ``[4, 6, 8]`` block as the output (one
    device: ``[4, 12, 8]``); the global pooling's field gradient was off by 2.5e-2 (each rank's
    pooled output gathered nowhere, counted per rank); the ``[N, L]`` signal's mean was the
    block's (output off by 0.15)."""
    with pytest.raises(fd.nn.ParallelizeError, match=r"not a batched \[N, C, \*spatial\] .*Fix: "
                       r"pass field.unsqueeze\(0\)"):  # fmt: skip
        _run(make(), shape, split)


def test_the_same_fields_batched_equal_one_device() -> None:
    """The fix the message names: a batch of one."""
    equal_to_one_device(nn.Sequential(nn.Conv2d(C, C, 3, padding=1)), (1, C, 12, 8), "h")
    equal_to_one_device(
        nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.AdaptiveAvgPool2d(1)), (1, C, 12, 8), "hw"
    )


GROWN: list[tuple[str, Callable[[], nn.Module], str]] = [
    ("Upsample(scale_factor=4)", lambda: _global_then(nn.Upsample(scale_factor=4)),
     r"'2' \(Upsample\) grows a field a global pooling reduced to one row"),
    ("ConvTranspose2d(2, stride 2)", lambda: _global_then(nn.ConvTranspose2d(C, C, 2, 2)),
     r"'2' \(ConvTranspose2d\) grows a field a global pooling"),
    ("F.interpolate(x3) in the model", PooledInterp,
     r"F.interpolate in .* grows a field a global pooling"),
    ("PSPNet's pooled branch (nearest, to the block's size)", _pyramid_nearest,
     r"F.interpolate in .* grows a field a global pooling"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "make", "match"), GROWN, ids=[c[0] for c in GROWN])
def test_an_upsampled_global_pooling_is_refused(
    case: str, make: Callable[[], nn.Module], match: str
) -> None:
    """Before: ``Upsample(4)`` of the pooled ``[1, 4, 1, 1]`` came back ``[1, 4, 8, 4]`` (one
    device: ``[1, 4, 4, 4]``: every rank's copy of the whole result gathered as if it were a
    block); the transposed convolution ``[1, 4, 4, 2]`` for ``[1, 4, 2, 2]``; PSPNet's branch a
    bare torch error about a cat of 6 and 3 rows."""
    with pytest.raises(fd.nn.ParallelizeError, match=match + r".*Fix: broadcast the pooled"):
        _run(make(), (1, C, 12, 8), "h")


AMBIGUOUS: list[tuple[str, Callable[[], nn.Module], tuple[int, ...], str, str]] = [
    ("squeeze-excitation, then a max pooling to one row per rank", SqueezeThenDown,
     (1, C, 4, 8), "h", r"the region's output: along the split dim -2 \(axis 'h'\) a rank holds a "
     r"block of one row and a global pooling"),
    ("the same over H x W", SqueezeThenDown, (1, C, 4, 4), "hw",
     r"the region's output: along the split dim -2"),
    ("a block pooled to one row per rank plus the global mean", DownPlusGlobal, (1, C, 4, 8), "h",
     r"the region's output: along the split dim -2"),
    # (refused before too, with a message about a pooled field)
    ("the same, then a 3 x 3 convolution", SqueezeThenDownConv, (1, C, 4, 8), "h",
     r"a window reading a halo: along the split dim -2"),
    # (right before, by luck: the pooled row is what a one-row block would be gathered as; refused
    # now, as the style cannot tell the two apart at the output)
    ("a field of one row per rank, then a global pooling",
     lambda: _global_then(), (1, C, 2, 8), "h", r"the region's output: along the split dim -2"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "make", "shape", "split", "match"), AMBIGUOUS, ids=[c[0] for c in AMBIGUOUS]
)
def test_one_row_blocks_beside_a_global_pooling_are_refused(
    case: str, make: Callable[[], nn.Module], shape: tuple[int, ...], split: str, match: str
) -> None:
    """Before: the squeeze-excitation net returned ``[1, 4, 1, 4]`` where one device gives
    ``[1, 4, 2, 4]``: each rank's one row of the pooled-down block taken for the global pooling's
    row and averaged over the ranks (``pmean``), the ranks' rows mixed into one."""
    with pytest.raises(fd.nn.ParallelizeError, match=match + r".*Fix: a domain of more rows"):
        _run(make(), shape, split)


CLEAN: list[tuple[str, Callable[[], nn.Module], tuple[int, ...], str]] = [
    ("squeeze-excitation, then a max pooling to two rows per rank", SqueezeThenDown,
     (1, C, 8, 8), "h"),
    ("global pooling, 1 x 1 convolution, group norm", lambda: _global_then(
        nn.Conv2d(C, C, 1), nn.GroupNorm(2, C)), (2, C, 12, 8), "hw"),
    ("global pooling twice", lambda: _global_then(nn.AdaptiveAvgPool2d(1)), (1, C, 12, 8), "h"),
    ("H pooled, then a convolution and pooling over W",
     lambda: nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.AdaptiveAvgPool2d((1, None)),
                           nn.Conv2d(C, C, (1, 3), padding=(0, 1)), nn.MaxPool2d((1, 2))),
     (1, C, 12, 8), "hw"),
    ("one row per rank, no global pooling: upsampled",
     lambda: nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.MaxPool2d(2),
                           nn.Upsample(scale_factor=2, mode="bilinear")), (1, C, 4, 8), "h"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "make", "shape", "split"), CLEAN, ids=[c[0] for c in CLEAN])
def test_global_pooling_and_thin_blocks_apart_equal_one_device(
    case: str, make: Callable[[], nn.Module], shape: tuple[int, ...], split: str
) -> None:
    equal_to_one_device(make(), shape, split)


def test_uneven_one_row_block_and_global_pooling_on_simulated_ranks() -> None:
    """Simulated ranks pad every block to the largest (3 rows here), so a rank's one valid row is
    no one-row tensor: the global pooling's output is told apart, equal to one device."""
    make = SqueezeThenDown
    equal_to_one_device(_global_then(), (1, C, 4, 7), "h", sizes={-2: [1, 3]})
    equal_to_one_device(make(), (1, C, 6, 8), "h", sizes={-2: [2, 4]})


def test_on_gloo() -> None:
    """2 gloo ranks: uneven blocks through the model's ``F.interpolate(size=)``, reflect
    convolution + instance norm + pooling + transposed convolution, and a global pooling over
    uneven W blocks, each equal to one device (output, field and parameter gradients); an
    unbatched field and a one-row block beside a global pooling refused on every rank."""
    from tests import review_domain_worker as w
    from tests.dist_harness import run_on_gloo

    for case in [c for c in w.CASES if c not in w.REFUSED]:
        net, x, _, _ = w.build(case)
        xr = x.clone().requires_grad_()
        out = net(xr)
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
        (out * cot).sum().backward()
        assert xr.grad is not None
        for got in run_on_gloo(w.run_case, 2, case, timeout=120):
            assert "error" not in got, got
            assert torch.allclose(got["out"], out, atol=1e-10), case
            assert torch.allclose(got["dx"], xr.grad, atol=1e-10), case
            for name, p in net.named_parameters():
                assert torch.allclose(got["grads"][name], p.grad, atol=1e-10), (case, name)  # type: ignore[arg-type]
    for case, match in w.REFUSED.items():
        for got in run_on_gloo(w.run_case, 2, case, timeout=120):
            assert "error" in got and match in got["error"], (case, got)


@pytest.mark.parametrize(
    ("make", "shape", "split", "match"),
    [
        (lambda: nn.Conv2d(C, C, 5, padding=2), (1, C, 2, 8), "h",
         r"the halo \(before=2, after=2\) is wider than the smallest block"),
        (lambda: nn.Conv2d(C, C, 3, padding=1, padding_mode="reflect"), (1, C, 2, 8), "h",
         r"reflect padding of \(before=1, after=1\) rows needs end blocks of more rows"),
        (lambda: nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(C, C, 5, padding=2)), (1, C, 4, 4), "w",
         r"the halo \(before=2, after=2\) is wider than the smallest block"),
    ],
)  # fmt: skip
def test_a_field_narrower_than_a_halo_names_the_layer(
    make: Callable[[], nn.Module], shape: tuple[int, ...], split: str, match: str
) -> None:
    """Before: halo_exchange's own error, which names the collective and the axis but not the
    layer of the model whose kernel reaches past the neighbour's block."""
    with pytest.raises(fd.nn.ParallelizeError, match=r"domain parallel: '.*' \(Conv2d\): .*"
                       + match + r".*Fix"):  # fmt: skip
        _run(make(), shape, split)
