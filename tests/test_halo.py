"""Halo exchange and domain-parallel convolutions against one device: ``F.pad`` / ``F.conv*d``
of the whole domain, cut per rank, forward and backward, on simulated ranks and gloo processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

import fastdist as fd

F64 = torch.float64
MODES = ("zeros", "circular", "replicate", "reflect")
TOL = 1e-10


def blocks(x: Tensor, sizes: list[int], dim: int) -> Tensor:
    """Each rank's block of ``x`` along ``dim``, zero-padded to ``max(sizes)`` rows and stacked:
    ``[n, *x.shape]`` with ``dim`` cut."""
    rows = max(sizes)
    parts = []
    for p in x.split(sizes, dim=dim):
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, rows - p.shape[dim]]
        parts.append(F.pad(p, pad))
    return torch.stack(parts)


def windows(whole: Tensor, sizes: list[int], dim: int, extra: int) -> list[Tensor]:
    """Rank ``i``'s window of ``whole`` (the padded domain): ``sizes[i] + extra`` rows from the
    start of its block."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [whole.narrow(dim, s, n + extra) for s, n in zip(starts, sizes)]


def fits(sizes: list[int], lo: int, hi: int, mode: str) -> bool:
    reflect_ok = mode != "reflect" or (lo < sizes[0] and hi < sizes[-1])
    return max(lo, hi) <= min(sizes) and reflect_ok


@st.composite
def halo_cases(draw: Any) -> tuple[int, list[int], int, int, str, int]:
    n = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    even = draw(st.booleans())
    sizes = [sizes[0]] * n if even else sizes
    lo = draw(st.integers(0, min(sizes)))
    hi = draw(st.integers(0, min(sizes)))
    mode = draw(st.sampled_from(MODES))
    dim = draw(st.integers(0, 2))
    return n, sizes, lo, hi, mode, dim


@given(halo_cases(), st.integers(0, 2**31 - 1))
def test_halo_exchange_equals_padding_the_whole_domain(case: Any, seed: int) -> None:
    """Each rank's result is its window of ``F.pad`` of the whole domain (padding rows zero), and
    the gradient of any loss over the windows equals one device's."""
    n, sizes, lo, hi, mode, dim = case
    if not fits(sizes, lo, hi, mode):
        return
    g = torch.Generator().manual_seed(seed)
    shape = [2, 3, 2]
    shape[dim] = sum(sizes)
    x = torch.randn(*shape, generator=g, dtype=F64, requires_grad=True)
    torch_mode = "constant" if mode == "zeros" else mode  # F.pad pads the last dim
    whole = F.pad(x.movedim(dim, -1), (lo, hi), mode=torch_mode).movedim(-1, dim)
    mesh = fd.Mesh({"sp": n})
    out = fd.simulate(
        lambda b: fd.halo_exchange(b, mesh, "sp", dim, (lo, hi), mode=mode, sizes=sizes), mesh
    )(blocks(x, sizes, dim))
    weights = torch.randn(whole.shape, generator=g, dtype=F64)
    want = windows(whole, sizes, dim, lo + hi)
    loss, ref_loss = out.new_zeros(()), whole.new_zeros(())
    for i, (w_i, s) in enumerate(zip(windows(weights, sizes, dim, lo + hi), sizes)):
        got = out[i].narrow(dim, 0, lo + s + hi)
        assert torch.equal(got, want[i]), (i, got, want[i])
        assert not out[i].narrow(dim, lo + s + hi, max(sizes) - s).any()  # padding rows: 0
        loss = loss + (got * w_i).sum()
        ref_loss = ref_loss + (want[i] * w_i).sum()
    (grad,) = torch.autograd.grad(loss, x)
    (ref,) = torch.autograd.grad(ref_loss, x)
    assert torch.allclose(grad, ref, atol=TOL)


@st.composite
def conv_cases(draw: Any) -> tuple[int, list[int], int, int, bool, int]:
    nd = draw(st.sampled_from([1, 2]))
    n = draw(st.integers(1, 3))
    k = draw(st.sampled_from([1, 3, 5]))
    dil = draw(st.sampled_from([1, 2]))
    periodic = draw(st.booleans())
    half = dil * (k - 1) // 2  # the halo width: 'same' padding
    sizes = draw(st.lists(st.integers(max(half, 1), max(half, 1) + 3), min_size=n, max_size=n))
    return nd, sizes, k, dil, periodic, half


@given(conv_cases(), st.integers(0, 2**31 - 1))
def test_conv_on_halo_padded_blocks_equals_one_device(case: Any, seed: int) -> None:
    """``F.conv1d`` / ``conv2d`` with padding on the whole tensor equals each rank's conv (no
    padding on the split dim) of its halo-padded block: outputs, input and weight gradients."""
    nd, sizes, k, dil, periodic, half = case
    g = torch.Generator().manual_seed(seed)
    n, split = len(sizes), 2  # split the first spatial dim
    spatial = [sum(sizes), 4][:nd]
    x = torch.randn(2, 3, *spatial, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(4, 3, *[k] * nd, generator=g, dtype=F64, requires_grad=True)
    conv = F.conv1d if nd == 1 else F.conv2d
    if periodic:  # circular on the split dim, zeros on the other
        xp = F.pad(x, [0, 0] * (nd - 1) + [half, half], mode="circular")
        ref = conv(xp, w, dilation=dil, padding=(0, half)[:nd] if nd == 2 else 0)
    else:
        ref = conv(x, w, dilation=dil, padding=half)
    mesh = fd.Mesh({"sp": n})
    mode = "circular" if periodic else "zeros"

    def rank(b: Tensor) -> Tensor:
        b = fd.halo_exchange(b, mesh, "sp", split, half, mode=mode, sizes=sizes)
        return conv(b, w, dilation=dil, padding=(0, half)[:nd] if nd == 2 else 0)

    out = fd.simulate(rank, mesh)(blocks(x, sizes, split))
    cot = torch.randn(ref.shape, generator=g, dtype=F64)
    loss = out.new_zeros(())
    for i, (want, c) in enumerate(
        zip(windows(ref, sizes, split, 0), windows(cot, sizes, split, 0))
    ):
        got = out[i].narrow(split, 0, sizes[i])
        assert torch.allclose(got, want, atol=TOL)
        loss = loss + (got * c).sum()
    gx, gw = torch.autograd.grad(loss, (x, w))
    rx, rw = torch.autograd.grad((ref * cot).sum(), (x, w))
    assert torch.allclose(gx, rx, atol=TOL) and torch.allclose(gw, rw, atol=TOL)


def test_two_split_dims_over_two_axes_equal_one_device() -> None:
    """H over ``h`` and W over ``w`` (a 2 x 2 grid of blocks): one call per dim; the corners
    arrive with the second call."""
    torch.manual_seed(0)
    mesh = fd.Mesh({"h": 2, "w": 2})
    x = torch.randn(1, 2, 6, 8, dtype=F64, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, dtype=F64, requires_grad=True)
    ref = F.conv2d(x, w, padding=1)
    # rank (i, j): rows 3i.., columns 4j..
    grid = torch.stack([b for rows in x.chunk(2, 2) for b in rows.chunk(2, 3)])

    def rank(b: Tensor) -> Tensor:
        b = fd.halo_exchange(b, mesh, "h", 2, 1)
        b = fd.halo_exchange(b, mesh, "w", 3, 1)
        return F.conv2d(b, w)

    out = fd.simulate(rank, mesh)(grid)
    want = torch.stack([b for rows in ref.chunk(2, 2) for b in rows.chunk(2, 3)])
    assert torch.allclose(out, want, atol=TOL)
    cot = torch.randn_like(want)
    gx, gw = torch.autograd.grad((out * cot).sum(), (x, w))
    whole_cot = torch.cat([torch.cat([cot[0], cot[1]], 3), torch.cat([cot[2], cot[3]], 3)], 2)
    rx, rw = torch.autograd.grad((ref * whole_cot).sum(), (x, w))
    assert torch.allclose(gx, rx, atol=TOL) and torch.allclose(gw, rw, atol=TOL)


@pytest.mark.parametrize("check", ["insert", False])
def test_under_spmd_with_a_data_axis(check: Any) -> None:
    """Batch over ``dp``, H over ``sp`` through ``fd.spmd`` (the checked mode inserts the weight's
    ``pvary``; unchecked, it is written): equal to one device, the weight's gradient summed over
    both axes."""
    torch.manual_seed(0)
    mesh = fd.Mesh({"dp": 2, "sp": 2})
    x = torch.randn(2, 2, 8, 5, dtype=F64, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, dtype=F64, requires_grad=True)

    def rank(x: Tensor, w: Tensor) -> Tensor:
        w = w if check else fd.pvary(w, mesh, ("dp", "sp"))
        h = fd.halo_exchange(x, mesh, "sp", 2, 1, mode="circular")
        return F.conv2d(h, w, padding=(0, 1))

    spec = fd.P("dp", None, "sp")
    out = fd.spmd(rank, mesh, (spec, fd.P()), spec, check=check)(x, w)
    ref = F.conv2d(F.pad(x, (0, 0, 1, 1), mode="circular"), w, padding=(0, 1))
    assert torch.allclose(out, ref, atol=TOL)
    cot = torch.randn_like(ref)
    got = torch.autograd.grad((out * cot).sum(), (x, w))
    want = torch.autograd.grad((ref * cot).sum(), (x, w))
    assert all(torch.allclose(a, b, atol=TOL) for a, b in zip(got, want))


def test_under_torch_func_grad() -> None:
    """``torch.func.grad`` inside the simulation (the autograd.Function route) agrees."""
    mesh = fd.Mesh({"sp": 3})
    x = torch.randn(3, 4, 2, dtype=F64)
    whole = torch.cat(list(x))

    def windows_loss(t: Tensor) -> Tensor:  # each rank's padded window, summed over ranks
        padded = F.pad(t.T, (1, 1), mode="circular").T  # [14, 2]
        return sum((w**3).sum() for w in windows(padded, [4, 4, 4], 0, 2))  # type: ignore[return-value]

    ref = torch.func.grad(windows_loss)(whole)

    def rank(b: Tensor) -> Tensor:
        return torch.func.grad(
            lambda t: (fd.halo_exchange(t, mesh, "sp", 0, 1, mode="circular") ** 3).sum()
        )(b)

    got = fd.simulate(rank, mesh)(x)
    assert torch.allclose(torch.cat(list(got)), ref, atol=TOL)


# ------------------------------------------------------------------ the layer
def _layer_case(
    nd: int, mode: str, sizes: list[int], dim: int, seed: int, **conv_kw: Any
) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(seed)
    conv_cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[nd]
    conv = conv_cls(4, 6, padding_mode=mode, dtype=F64, **conv_kw)
    shape = [2, 4, *[5] * nd]
    shape[dim] = sum(sizes)
    x = torch.randn(*shape, dtype=F64)
    return conv, x, torch.randn_like(conv(x))


LAYER_CASES = [
    (2, "zeros", [4, 4], 2, {"kernel_size": 3, "padding": 1}),
    (2, "reflect", [3, 5, 4], 3, {"kernel_size": (3, 5), "padding": (1, 2), "groups": 2}),
    (2, "circular", [4, 3], 2, {"kernel_size": 3, "padding": "same", "dilation": 2}),
    (3, "replicate", [3, 2], 3, {"kernel_size": 3, "padding": 1, "stride": (2, 1, 1)}),
    (3, "zeros", [2, 2, 2], 2, {"kernel_size": (2, 3, 3), "padding": "same"}),
    (1, "zeros", [3, 3], -1, {"kernel_size": 4, "padding": "same", "bias": False}),
    (2, "zeros", [4, 2, 3], 2, {"kernel_size": 3, "padding": 1, "stride": 2}),
    (3, "reflect", [3, 6, 5], 4, {"kernel_size": (1, 3, 5), "padding": (0, 1, 2), "stride": 3}),
    (1, "circular", [4, 4], 2, {"kernel_size": 2, "padding": "same"}),
]


@pytest.mark.filterwarnings("ignore:Using padding='same'")  # the reference's even kernel
@pytest.mark.parametrize(("nd", "mode", "sizes", "dim", "kw"), LAYER_CASES)
def test_domain_conv_equals_one_device(
    nd: int, mode: str, sizes: list[int], dim: int, kw: dict[str, Any]
) -> None:
    """``fd.nn.DomainConv`` of an unmodified conv on simulated ranks (stacked parameters): each
    rank's output block, the input gradient and every rank's parameter gradients equal one
    device's."""
    conv, x, cot = _layer_case(nd, mode, sizes, dim, 0, **kw)
    d = dim % x.dim()
    mesh = fd.Mesh({"sp": len(sizes)})
    layer = fd.nn.DomainConv(conv, mesh, "sp", dim, sizes=sizes)
    state = fd.nn.stack_state(conv.state_dict(), fd.nn.param_specs(layer), mesh)
    params = {k: v.requires_grad_() for k, v in state.items()}
    xs = blocks(x, sizes, d).requires_grad_()
    out = fd.simulate(lambda p, b: torch.func.functional_call(layer, p, (b,)), mesh)(params, xs)
    osz = list(layer.out_sizes or [])  # ceil(sizes / stride)
    assert osz == [-(-r // conv.stride[d - 2]) for r in sizes]  # type: ignore[index]
    assert torch.equal(out, out * (blocks(cot, osz, d) != 0))  # padding rows: 0
    ref = conv(x)
    assert torch.allclose(out, blocks(ref, osz, d), atol=TOL)
    xr = x.clone().requires_grad_()
    loss = (conv(xr) * cot).sum()
    grads = torch.autograd.grad(loss, [xr, *conv.parameters()])
    mine = torch.autograd.grad((out * blocks(cot, osz, d)).sum(), [xs, *params.values()])
    assert torch.allclose(mine[0], blocks(grads[0], sizes, d), atol=TOL)
    for got, want in zip(mine[1:], grads[1:]):  # every rank holds the whole gradient
        assert torch.allclose(got, want.expand_as(got), atol=TOL)


@pytest.mark.parametrize("sizes", [[3, 3], [4, 2, 3]])
def test_causal_temporal_padding_equals_one_device(sizes: list[int]) -> None:
    """A video VAE's causal conv (``padding=0``, the input padded by hand with ``2 * p`` frames
    before and none after): ``padding=`` gives the split T that padding; equal to one device."""
    conv, x, _ = _layer_case(3, "zeros", sizes, 2, 2, kernel_size=3)
    ref = conv(F.pad(x, (1, 1, 1, 1, 2, 0)))  # [N, C, T, H, W]: T causal
    mesh = fd.Mesh({"sp": len(sizes)})
    layer = fd.nn.DomainConv(conv, mesh, "sp", 2, sizes=sizes, padding=[(2, 0), (1, 1), (1, 1)])
    state = fd.nn.stack_state(conv.state_dict(), fd.nn.param_specs(layer), mesh)
    params = {k: v.requires_grad_() for k, v in state.items()}
    out = fd.simulate(lambda p, b: torch.func.functional_call(layer, p, (b,)), mesh)(
        params, blocks(x, sizes, 2)
    )
    assert torch.allclose(out, blocks(ref, sizes, 2), atol=TOL)
    cot = ref.detach()
    (out * blocks(cot, sizes, 2)).sum().backward()
    (gw,) = torch.autograd.grad((ref * cot).sum(), conv.weight)
    assert torch.allclose(params["weight"].grad, gw.expand_as(params["weight"]), atol=TOL)  # type: ignore[arg-type]


def test_errors_name_the_op_and_the_fix() -> None:
    mesh = fd.Mesh({"sp": 2})
    run = fd.simulate(lambda b: fd.halo_exchange(b, mesh, "sp", 0, 3, sizes=[2, 4]), mesh)
    with pytest.raises(fd.CollectiveError, match="wider than the smallest block"):
        run(torch.zeros(2, 4))
    run = fd.simulate(lambda b: fd.halo_exchange(b, mesh, "sp", 0, 1, mode="wrap"), mesh)
    with pytest.raises(fd.CollectiveError, match="not a padding mode"):
        run(torch.zeros(2, 4))
    run = fd.simulate(lambda b: fd.halo_exchange(b, mesh, "sp", 0, 2, mode="reflect"), mesh)
    with pytest.raises(fd.CollectiveError, match="reflect padding"):
        run(torch.zeros(2, 2))
    run = fd.simulate(lambda b: fd.halo_exchange(b, mesh, "sp", 0, (1, -1)), mesh)
    with pytest.raises(fd.CollectiveError, match="width="):
        run(torch.zeros(2, 2))
    with pytest.raises(fd.MeshError, match="multiple of 2 rows"):
        fd.nn.DomainConv(nn.Conv2d(1, 1, 3, stride=2, padding=1), mesh, "sp", sizes=[3, 4])
    strided = fd.nn.DomainConv(nn.Conv2d(1, 1, 3, stride=2, padding=1), mesh, "sp")
    with pytest.raises(fd.MeshError, match="multiple of 2 rows"):
        fd.simulate(strided, mesh)(torch.zeros(2, 1, 1, 3, 3))
    with pytest.raises(fd.MeshError, match="keeps the length"):
        fd.nn.DomainConv(nn.Conv2d(1, 1, 3), mesh, "sp")
    with pytest.raises(fd.MeshError, match="not a spatial dim"):
        fd.nn.DomainConv(nn.Conv2d(1, 1, 3, padding=1), mesh, "sp", dim=1)
    with pytest.raises(fd.MeshError, match="before, after"):
        fd.nn.DomainConv(nn.Conv2d(1, 1, 3), mesh, "sp", padding=[(1, 1)])
    with pytest.raises(fd.MeshError, match="ConvTranspose2d"):
        fd.nn.DomainConv(nn.ConvTranspose2d(1, 1, 3), mesh, "sp")


# ------------------------------------------------------------------ real ranks
GLOO_SIZES = [3, 2, 4]


def halo_on_gloo() -> list[Tensor]:
    """One gloo rank: its uneven block (exactly its rows) through ``halo_exchange`` + conv2d and
    through ``DomainConv`` (reflect); the outputs and the gradients of the input and weights."""
    mesh = fd.connect(sp=torch.distributed.get_world_size(), timeout=120)
    i = mesh.rank
    conv, x, cot = _layer_case(2, "reflect", GLOO_SIZES, 2, 1, kernel_size=3, padding=1)
    start, size = sum(GLOO_SIZES[:i]), GLOO_SIZES[i]
    b = x.narrow(2, start, size).clone().requires_grad_()
    c = cot.narrow(2, start, size)
    w = conv.weight.detach().clone().requires_grad_()
    h = fd.halo_exchange(b, mesh, "sp", 2, 1, sizes=GLOO_SIZES)  # zeros at the ends
    y = F.conv2d(h, w, padding=(0, 1))
    gb, gw = torch.autograd.grad((y * c).sum(), (b, w))
    gw = fd.psum(gw, mesh, "sp")  # the weight's partial gradients summed
    layer = fd.nn.DomainConv(conv, mesh, "sp", 2, sizes=GLOO_SIZES)
    b2 = b.detach().clone().requires_grad_()
    y2 = layer(b2)
    (y2 * c).sum().backward()
    assert conv.weight.grad is not None and conv.bias is not None and conv.bias.grad is not None
    return [y, gb, gw, y2, b2.grad, conv.weight.grad, conv.bias.grad]  # type: ignore[list-item]


def test_halo_exchange_and_domain_conv_on_gloo() -> None:
    from tests.dist_harness import run_on_gloo

    conv, x, cot = _layer_case(2, "reflect", GLOO_SIZES, 2, 1, kernel_size=3, padding=1)
    xr = x.clone().requires_grad_()
    w = conv.weight.detach().clone().requires_grad_()
    ref = F.conv2d(xr, w, padding=1)
    gx, gw = torch.autograd.grad((ref * cot).sum(), (xr, w))
    ref2 = conv(x.clone().requires_grad_())
    xr2 = x.clone().requires_grad_()
    (conv(xr2) * cot).sum().backward()
    cut = [(sum(GLOO_SIZES[:i]), s) for i, s in enumerate(GLOO_SIZES)]
    for (start, size), got in zip(cut, run_on_gloo(halo_on_gloo, 3, timeout=120)):
        y, gb, gw_r, y2, gb2, gw2, gbias2 = got
        assert torch.allclose(y, ref.narrow(2, start, size), atol=TOL)
        assert torch.allclose(gb, gx.narrow(2, start, size), atol=TOL)
        assert torch.allclose(gw_r, gw, atol=TOL)
        assert torch.allclose(y2, ref2.narrow(2, start, size), atol=TOL)
        assert torch.allclose(gb2, xr2.grad.narrow(2, start, size), atol=TOL)  # type: ignore[union-attr]
        assert torch.allclose(gw2, conv.weight.grad, atol=TOL)  # type: ignore[arg-type]
        assert torch.allclose(gbias2, conv.bias.grad, atol=TOL)  # type: ignore[union-attr,arg-type]
    for n in (2, 3):  # every mode, uneven blocks, unequal widths: one all-to-all each way
        _check_halo_modes_on_gloo(n)


# issue 41: both sides of a halo in one collective, on real ranks too
GLOO_CASES = [
    (mode, width, sizes)
    for mode in MODES
    for width in [(1, 2), (2, 0), (0, 1)]
    for sizes in ([3, 2, 4], [3, 3, 3])
    if fits(sizes, *width, mode)
]


def _one_field(sizes: list[int]) -> Tensor:
    g = torch.Generator().manual_seed(sum(sizes))
    return torch.randn(2, sum(sizes), 3, generator=g, dtype=F64)


def halo_modes_on_gloo() -> list[tuple[Tensor, Tensor, int, int]]:
    """One gloo rank (of 2 or 3): each case's ``halo_exchange`` of its own rows along dim 1, the
    gradient of a weighted sum, and the all-to-alls of the forward and of the backward."""
    from torch.profiler import ProfilerActivity, profile

    n = torch.distributed.get_world_size()
    mesh = fd.connect(sp=n, timeout=120)
    i, got = mesh.rank, []
    for mode, (lo, hi), sizes in GLOO_CASES:
        sizes = sizes[:n]
        if not fits(sizes, lo, hi, mode):
            continue
        x = _one_field(sizes)
        b = x.narrow(1, sum(sizes[:i]), sizes[i]).clone().requires_grad_()
        with profile(activities=[ProfilerActivity.CPU]) as fwd:
            h = fd.halo_exchange(b, mesh, "sp", 1, (lo, hi), mode=mode, sizes=sizes)
        weights = torch.arange(h.numel(), dtype=F64).reshape(h.shape).cos()
        with profile(activities=[ProfilerActivity.CPU]) as bwd:
            (gb,) = torch.autograd.grad((h * weights).sum(), b)
        calls = [sum(e.name == "c10d::alltoall_base_" for e in p.events()) for p in (fwd, bwd)]
        got.append((h.detach(), gb, *calls))
    return got


def _check_halo_modes_on_gloo(n: int) -> None:
    """Each rank's padded block and input gradient equal one device's ``F.pad`` of the whole
    domain (every mode, uneven blocks, unequal widths), with one all-to-all each way."""
    from tests.dist_harness import run_on_gloo

    per_rank = run_on_gloo(halo_modes_on_gloo, n, timeout=120)
    cases = [
        (mode, width, sizes[:n])
        for mode, width, sizes in GLOO_CASES
        if fits(sizes[:n], *width, mode)
    ]
    assert len(cases) > 10
    for k, (mode, (lo, hi), sizes) in enumerate(cases):
        x = _one_field(sizes).requires_grad_()
        whole = F.pad(x.movedim(1, -1), (lo, hi), mode="constant" if mode == "zeros" else mode)
        whole = whole.movedim(-1, 1)
        loss = whole.new_zeros(())
        for i, want in enumerate(windows(whole, sizes, 1, lo + hi)):
            h, _, fwd_calls, bwd_calls = per_rank[i][k]
            assert torch.equal(h, want), (mode, lo, hi, sizes, i)
            assert (fwd_calls, bwd_calls) == (1, 1), (mode, lo, hi, sizes, i)
            weights = torch.arange(h.numel(), dtype=F64).reshape(h.shape).cos()
            loss = loss + (want * weights).sum()
        (gx,) = torch.autograd.grad(loss, x)
        for i, (start, size) in enumerate((sum(sizes[:j]), s) for j, s in enumerate(sizes)):
            assert torch.allclose(per_rank[i][k][1], gx.narrow(1, start, size), atol=TOL)


def test_one_collective_per_split_dim_on_simulated_ranks() -> None:
    """An H x W split (2 x 3 simulated ranks, unequal widths, zeros and circular): one
    ``halo_swap`` per call in the forward and one in the backward, no ``ppermute``; the result
    equals ``F.pad`` of the whole domain, forward and backward."""
    from fastdist.core.context import COLLECTIVE_OBSERVERS

    seen: list[tuple[str, bool]] = []

    def observer(prim: Any, stacked: bool, tensors: Any, spec: Any, params: Any, run: Any) -> Any:
        seen.append((prim.name, torch.is_grad_enabled()))
        return run()

    mesh = fd.Mesh({"h": 2, "w": 3})
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 6, generator=g, dtype=F64, requires_grad=True)

    def rank(b: Tensor) -> Tensor:
        b = fd.halo_exchange(b, mesh, "h", 1, (2, 1))
        return fd.halo_exchange(b, mesh, "w", 2, (1, 0), mode="circular")

    blocks_hw = x.unflatten(1, (2, 2)).unflatten(3, (3, 2)).permute(1, 3, 0, 2, 4)
    COLLECTIVE_OBSERVERS.add(observer)
    try:
        out = fd.simulate(rank, mesh)(blocks_hw.reshape(6, 2, 2, 2))
        forward = list(seen)
        weights = torch.randn(out.shape, generator=g, dtype=F64)
        (gx,) = torch.autograd.grad((out * weights).sum(), x)
    finally:
        COLLECTIVE_OBSERVERS.remove(observer)
    assert [name for name, _ in forward] == ["halo_swap", "halo_swap"]
    assert [name for name, _ in seen[2:]] == ["halo_swap", "halo_swap"]  # the backward
    whole = F.pad(x, (0, 0, 2, 1))  # H: zeros, 2 before and 1 after
    whole = torch.cat([whole[..., -1:], whole], dim=2)  # W: periodic, 1 before
    want = torch.stack(
        [whole[:, 2 * i : 2 * i + 5, 2 * j : 2 * j + 3] for i in range(2) for j in range(3)]
    )
    assert torch.equal(out, want)
    (ref,) = torch.autograd.grad((want * weights).sum(), x)
    assert torch.allclose(gx, ref, atol=TOL)
