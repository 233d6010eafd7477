"""``fastdist.ops.all_to_all_qkv`` (q, k and v in one Ulysses all-to-all, issue 38.6): values and
gradients against plain torch on one device in float64 (simulated ranks and gloo), bit-equality
with three ``all_to_all_4d`` calls, the refusals; and the DiT's Ulysses attention that uses it
(``fastdist.nn.attention.ulysses_sdpa``) bit-equal to ``split_attention``."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import Tensor

import fastdist as fd
from fastdist.errors import CollectiveError
from fastdist.ops import all_to_all_4d, all_to_all_qkv

# (mesh, axis, batch, rows per rank, (q heads, k heads, v heads), (q/k head dim, v head dim))
CASES = [
    ({"sp": 2}, "sp", 1, 3, (4, 4, 4), (5, 5)),  # batch 1: the results are views
    ({"sp": 2}, "sp", 2, 3, (4, 2, 2), (5, 7)),  # grouped-query k/v, a v head dim of its own
    ({"sp": 4}, "sp", 1, 2, (8, 4, 4), (3, 3)),
    ({"dp": 2, "sp": 2}, "sp", 2, 2, (2, 2, 2), (4, 6)),  # one axis of two
    ({"dp": 2, "sp": 2}, ("dp", "sp"), 1, 2, (4, 4, 4), (2, 2)),  # two axes as one
]


def _position(mesh: fd.Mesh, rank: int, axis: fd.AxisName) -> tuple[tuple[int, ...], int]:
    """(the rank's group: its coordinates off ``axis``, its position along ``axis``)."""
    names = mesh.axis_names
    coords = []
    for size in reversed([mesh.axis_size(a) for a in names]):
        coords.append(rank % size)
        rank //= size
    coord = dict(zip(names, reversed(coords)))
    axes = (axis,) if isinstance(axis, str) else axis
    pos = 0
    for a in axes:
        pos = pos * mesh.axis_size(a) + coord[a]
    return tuple(c for a, c in coord.items() if a not in axes), pos


def _global(mesh: fd.Mesh, axis: fd.AxisName, batch: int, rows: int, heads: int, dim: int):
    """One float64 tensor ``(groups, batch, n * rows, heads, dim)``: each group's sequence."""
    groups = mesh.size // mesh.axis_size(axis)
    n = mesh.axis_size(axis)
    g = torch.Generator().manual_seed(heads * 100 + dim)
    return torch.randn(groups, batch, n * rows, heads, dim, generator=g, dtype=torch.float64)


def _group_index(mesh: fd.Mesh, axis: fd.AxisName) -> dict[tuple[int, ...], int]:
    keys = sorted({_position(mesh, r, axis)[0] for r in range(mesh.size)})
    return {k: i for i, k in enumerate(keys)}


@pytest.mark.parametrize(("sizes", "axis", "batch", "rows", "heads", "dims"), CASES)
def test_values_and_gradients_equal_plain_torch(sizes, axis, batch, rows, heads, dims) -> None:
    """Rank r of a group gets the group's whole sequence of its heads (``r * H / n ..``); the
    gradient of every rank's cotangent is the group's whole-tensor gradient, each rank getting
    its rows: compared with indexing the one-device tensors in float64."""
    mesh = fd.Mesh(sizes)
    n = mesh.axis_size(axis)
    shapes = [(heads[0], dims[0]), (heads[1], dims[0]), (heads[2], dims[1])]
    whole = [_global(mesh, axis, batch, rows, h, d) for h, d in shapes]  # (G, B, S, H, D)
    cots = [torch.randn_like(t) for t in whole]
    gi = _group_index(mesh, axis)
    where = [_position(mesh, r, axis) for r in range(mesh.size)]
    # per rank: its rows of its group's tensors
    mine = [
        torch.stack([t[gi[g], :, p * rows : (p + 1) * rows] for g, p in where]).requires_grad_()
        for t in whole
    ]
    out = fd.simulate(lambda q, k, v: all_to_all_qkv(q, k, v, mesh, axis), mesh)(*mine)
    # per rank's cotangent: its heads of its group's cotangent (whole sequence)
    cot = []
    for (h, _), c in zip(shapes, cots):
        per = h // n
        cot.append(torch.stack([c[gi[g], :, :, p * per : (p + 1) * per] for g, p in where]))
    for t, o, (h, _) in zip(whole, out, shapes):
        per = h // n
        want = torch.stack([t[gi[g], :, :, p * per : (p + 1) * per] for g, p in where])
        assert o.shape == want.shape and torch.equal(o, want)
    grads = torch.autograd.grad(sum((o * c).sum() for o, c in zip(out, cot)), mine)
    for gr, c in zip(grads, cots):  # d/dx sum(out * cot) = the cotangent, at the rank's rows
        want = torch.stack([c[gi[g], :, p * rows : (p + 1) * rows] for g, p in where])
        assert torch.equal(gr, want)


@pytest.mark.parametrize(("sizes", "axis", "batch", "rows", "heads", "dims"), CASES[:3])
def test_bit_equal_to_three_all_to_all_4d(sizes, axis, batch, rows, heads, dims) -> None:
    """float32 values and gradients: bit for bit those of ``all_to_all_4d`` on each tensor."""
    mesh = fd.Mesh(sizes)
    g = torch.Generator().manual_seed(0)
    shapes = [(heads[0], dims[0]), (heads[1], dims[0]), (heads[2], dims[1])]
    xs = [torch.randn(mesh.size, batch, rows, h, d, generator=g) for h, d in shapes]
    a_in = [x.clone().requires_grad_() for x in xs]
    b_in = [x.clone().requires_grad_() for x in xs]
    a = fd.simulate(lambda q, k, v: all_to_all_qkv(q, k, v, mesh, axis), mesh)(*a_in)
    b = fd.simulate(lambda *t: tuple(all_to_all_4d(x, mesh, axis) for x in t), mesh)(*b_in)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    cot = [torch.randn(x.shape, generator=g) for x in a]
    ga = torch.autograd.grad(sum((x * c).sum() for x, c in zip(a, cot)), a_in)
    gb = torch.autograd.grad(sum((x * c).sum() for x, c in zip(b, cot)), b_in)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))


def test_one_exchange_each_way() -> None:
    """One all-to-all forward and one backward (three each with ``all_to_all_4d``), of the three
    tensors' bytes: as ``fastdist.profile.trace`` records them."""
    from fastdist.profile import trace

    mesh = fd.Mesh({"sp": 2})
    xs = [torch.ones(1, 3, 2, d, requires_grad=True) for d in (4, 4, 6)]

    def step(q: Tensor, k: Tensor, v: Tensor) -> None:
        sum(o.sum() for o in all_to_all_qkv(q, k, v, mesh, "sp")).backward()

    rows = [(r.op, r.phase, r.size) for r in trace(step, mesh, *xs).records]
    size = 4 * 3 * 2 * (4 + 4 + 6)  # float32 bytes of the three: 3 rows, 2 heads
    assert rows == [("all_to_all", "forward", size), ("all_to_all", "backward", size)]


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        ([(1, 3, 4, 2), (1, 3, 4, 2), (1, 3, 3, 2)], r"v has 3 heads, not divisible by .* 2"),
        ([(1, 3, 4, 2), (1, 2, 4, 2), (1, 3, 4, 2)], r"batch and seq dims differ"),
        ([(1, 3, 4), (1, 3, 4, 2), (1, 3, 4, 2)], r"q must be a 4-d"),
    ],
)
def test_refusals_name_the_op_axis_and_fix(shapes, match) -> None:
    mesh = fd.Mesh({"sp": 2})
    xs = [torch.zeros(2, *s) for s in shapes]
    with pytest.raises(CollectiveError, match=match) as e:
        fd.simulate(lambda q, k, v: all_to_all_qkv(q, k, v, mesh, "sp"), mesh)(*xs)
    assert "all_to_all_qkv" in str(e.value) and "'sp'" in str(e.value) and "ix" in str(e.value)


def test_refuses_mixed_dtypes() -> None:
    mesh = fd.Mesh({"sp": 2})
    q = torch.zeros(2, 1, 3, 2, 2)
    with pytest.raises(CollectiveError, match=r"differ in dtype or device"):
        fd.simulate(lambda q, k, v: all_to_all_qkv(q, k, v, mesh, "sp"), mesh)(q, q, q.double())


def test_ulysses_sdpa_bit_equal_to_split_attention() -> None:
    """The DiT's Ulysses attention (``ulysses_sdpa``: one packed exchange) against
    ``split_attention`` (three), even and uneven splits, float32: outputs and gradients bit for
    bit."""
    from fastdist.nn.attention import ulysses_sdpa
    from fastdist.nn.styles.ring_split import TokenSplit, split_attention

    mesh = fd.Mesh({"sp": 2})
    g = torch.Generator().manual_seed(3)
    for tokens in (8, 7):  # 7: rank 1 holds one padding row, masked as a key
        split = TokenSplit(mesh, ("sp",), tokens)
        xs = [torch.randn(2, 1, split.rows, 4, 8, generator=g) for _ in range(3)]
        a_in = [x.clone().requires_grad_() for x in xs]
        b_in = [x.clone().requires_grad_() for x in xs]
        flags = None if split.even else split.key_flags(None, torch.device("cpu"))
        mask = None if flags is None else flags.view(1, 1, 1, -1)
        new = functools.partial(ulysses_sdpa, mesh=mesh, axis="sp", attn_mask=mask)
        old = functools.partial(split_attention, split=split, ulysses_axis="sp", ring_axis=None)
        a = fd.simulate(new, mesh)(*a_in)
        b = fd.simulate(old, mesh)(*b_in)
        assert torch.equal(a, b)
        cot = torch.randn(a.shape, generator=g)
        ga = torch.autograd.grad((a * cot).sum(), a_in)
        gb = torch.autograd.grad((b * cot).sum(), b_in)
        assert all(torch.equal(x, y) for x, y in zip(ga, gb))


def packed_on_gloo() -> list[Tensor]:
    """One gloo rank: its rows of the float64 q, k, v (batch 2: the copying path; then batch 1:
    the views) through ``all_to_all_qkv``, and the gradients of its cotangent."""
    mesh = fd.connect(sp=torch.distributed.get_world_size(), timeout=120)
    n, r = mesh.axis_size("sp"), mesh.rank
    got: list[Tensor] = []
    for batch, heads in ((2, (4, 2, 2)), (1, (2, 2, 2))):
        whole, cots = _gloo_case(n, batch, heads)
        mine = [t[:, r * 3 : (r + 1) * 3].clone().requires_grad_() for t in whole]
        out = all_to_all_qkv(*mine, mesh, "sp")
        cot = [c[:, :, r * (c.shape[2] // n) : (r + 1) * (c.shape[2] // n)] for c in cots]
        grads = torch.autograd.grad(sum((o * c).sum() for o, c in zip(out, cot)), mine)
        got += [*out, *grads]
    return got


def _gloo_case(
    n: int, batch: int, heads: tuple[int, int, int]
) -> tuple[list[Tensor], list[Tensor]]:
    g = torch.Generator().manual_seed(batch)
    dims = (4, 4, 6)
    whole = [
        torch.randn(batch, 3 * n, h, d, generator=g, dtype=torch.float64)
        for h, d in zip(heads, dims)
    ]
    return whole, [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in whole]


def test_values_and_gradients_on_gloo() -> None:
    """Two gloo processes: each rank's results and gradients equal indexing the one-device
    tensors (values moved, never computed: exactly)."""
    from tests.dist_harness import run_on_gloo

    n = 2
    for r, got in enumerate(run_on_gloo(packed_on_gloo, n, timeout=120)):
        want: list[Tensor] = []
        for batch, heads in ((2, (4, 2, 2)), (1, (2, 2, 2))):
            whole, cots = _gloo_case(n, batch, heads)
            want += [t[:, :, r * (t.shape[2] // n) : (r + 1) * (t.shape[2] // n)] for t in whole]
            want += [c[:, r * 3 : (r + 1) * 3] for c in cots]
        assert len(got) == len(want)
        for i, (x, y) in enumerate(zip(got, want)):
            assert x.shape == y.shape and torch.equal(x, y), (r, i)
