"""Uneven and ragged collectives: values and gradients against a plain-torch reference, a MoE layer
against one device, and every error."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import fastdist as fd
from fastdist.testing import shard_sizes

from .reference import axes_of, meshes, per_group

F64 = torch.float64


def pad(t: Tensor, rows: int) -> Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def ref_v(
    op: str, xs: Tensor, mesh: fd.Mesh, axis: Any, sizes: list[int], kw: dict[str, Any]
) -> Tensor:
    """Plain-torch meaning of each v-op on stacked inputs (ragged dim 0), with explicit loops."""
    cap = kw.get("capacity")

    def f(m: list[Tensor]) -> list[Tensor]:
        n = len(m)
        if op == "all_gather_v":
            return [torch.cat([m[i][: sizes[i]] for i in range(n)])] * n
        if op == "reduce_scatter_v":
            total = sum(m[1:], m[0])
            return [
                pad(c, cap if cap is not None else c.shape[0]) for c in torch.split(total, sizes)
            ]
        if op == "gather_v":
            whole = pad(torch.cat([m[i][: sizes[i]] for i in range(n)]), cap)
            return [whole if i == kw["dst"] else whole * 0 for i in range(n)]
        if op == "scatter_v":
            return [
                pad(c, cap if cap is not None else c.shape[0])
                for c in torch.split(m[kw["src"]], sizes)
            ]
        raise KeyError(op)

    return per_group(xs, mesh, axis, f)


@st.composite
def v_cases(draw: Any, op: str) -> tuple[fd.Mesh, Any, list[int], dict[str, Any], Tensor]:
    mesh = draw(meshes(max_size=8))
    axis = draw(axes_of(mesh))
    n = mesh.axis_size(axis)
    sizes = draw(shard_sizes(n, even=draw(st.booleans())))
    kw: dict[str, Any] = {}
    if op in ("all_gather_v", "gather_v"):
        rows = max(sizes) + draw(st.integers(0, 2))  # padding rows past each rank's size
    else:
        rows = sum(sizes)
    if op in ("reduce_scatter_v", "scatter_v") and (len(set(sizes)) > 1 or draw(st.booleans())):
        kw["capacity"] = max(sizes) + draw(st.integers(0, 2))
    if op == "gather_v":
        kw["dst"] = draw(st.integers(0, n - 1))
        kw["capacity"] = sum(sizes) + draw(st.integers(0, 2))
    if op == "scatter_v":
        kw["src"] = draw(st.integers(0, n - 1))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    xs = torch.randn(mesh.size, rows, 2, dtype=F64, generator=gen)
    return mesh, axis, sizes, kw, xs


@pytest.mark.parametrize("op", ["all_gather_v", "reduce_scatter_v", "gather_v", "scatter_v"])
@given(data=st.data())
def test_v_ops_values_and_gradients(op: str, data: st.DataObject) -> None:
    mesh, axis, sizes, kw, xs = data.draw(v_cases(op))
    # the ragged rows live in dim 0 of xs[r]; move them to `dim`
    dim = data.draw(st.sampled_from([0, 1, -1]))
    dtype = data.draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.int64]))
    fn = getattr(fd, op)

    def to_dim(t: Tensor) -> Tensor:  # per-rank (rows, 2) -> rows along `dim`
        return t if dim == 0 else t.movedim(1, 2)

    want = ref_v(op, xs, mesh, axis, sizes, kw)
    vals = (xs * 4).round().to(dtype)  # integer-valued: exact in every dtype
    got = fd.simulate(lambda x: fn(x, mesh, axis, sizes, dim=dim, **kw), mesh)(
        to_dim(vals).contiguous()
    )
    torch.testing.assert_close(got, to_dim(ref_v(op, vals, mesh, axis, sizes, kw)))
    # a leaf of its own (xs stays untouched)
    leaf = to_dim(xs).detach().clone().contiguous().requires_grad_()
    out = fd.simulate(lambda x: fn(x, mesh, axis, sizes, dim=dim, **kw), mesh)(leaf)
    ref_leaf = xs.clone().requires_grad_()
    want = to_dim(ref_v(op, ref_leaf, mesh, axis, sizes, kw))
    torch.testing.assert_close(out, want.detach())
    c = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    (out * c).sum().backward()  # varying outputs: the global loss is the sum of every rank's loss
    (want * c).sum().backward()
    torch.testing.assert_close(leaf.grad, to_dim(ref_leaf.grad))


@pytest.mark.parametrize("dim", [1, -1])
def test_v_ops_along_another_dim_and_dtypes(dim: int) -> None:
    mesh = fd.Mesh({"tp": 3})
    sizes = [2, 0, 1]
    # per rank (4 rows along dim 1 as [2, 4])
    x = torch.arange(3 * 4 * 2, dtype=torch.int64).reshape(3, 4, 2).transpose(1, 2)
    out = fd.simulate(lambda x: fd.all_gather_v(x, mesh, "tp", sizes, dim=dim), mesh)(
        x.contiguous()
    )
    want = torch.cat([x[0, :, :2], x[2, :, :1]], dim=1)
    assert all(torch.equal(o, want) for o in out)
    xb = torch.randn(3, 3, 2).bfloat16().requires_grad_()
    fd.simulate(lambda x: fd.all_gather_v(x, mesh, "tp", [1, 1, 1], accumulate_fp32=True), mesh)(
        xb
    ).float().sum().backward()
    assert (
        xb.grad.dtype == torch.bfloat16
        and xb.grad[:, :1].eq(3).all()
        and xb.grad[:, 1:].eq(0).all()
    )


def test_exact_outputs_when_sizes_are_equal_and_empty_gather_elsewhere_on_one_rank() -> None:
    mesh = fd.Mesh({"tp": 2})
    out = fd.simulate(lambda x: fd.reduce_scatter_v(x, mesh, "tp", [2, 2]), mesh)(
        torch.ones(2, 4, 1)
    )
    assert out.shape == (2, 2, 1) and out.eq(2).all()
    one = fd.Mesh({"tp": 1})
    assert fd.gather_v(torch.ones(3, 2), one, "tp", [3], dst=0).shape == (3, 2)


# ============================================================================ ragged all-to-all
@st.composite
def ragged_cases(draw: Any) -> tuple[fd.Mesh, Any, Tensor, Tensor, int]:
    mesh = draw(meshes(max_size=8))
    axis = draw(axes_of(mesh))
    n = mesh.axis_size(axis)
    # S[i][j]: i -> j
    S = torch.tensor(
        draw(st.lists(st.lists(st.integers(0, 3), min_size=n, max_size=n), min_size=n, max_size=n))
    )
    rows = int(S.sum(1).max()) + draw(st.integers(0, 2))
    cap = int(S.sum(0).max()) + draw(st.integers(0, 2))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    xs = torch.randn(mesh.size, rows, 2, dtype=F64, generator=gen)
    # rank r with index i along the axis sends row i of the matrix
    send = torch.stack([S[mesh.index(r, axis)] for r in range(mesh.size)])
    return mesh, axis, xs, send, cap


def ref_ragged(xs: Tensor, send: Tensor, mesh: fd.Mesh, axis: Any, cap: int) -> Tensor:
    """Receiver j's buffer: from each sender i in axis order, the block of i's rows destined to
    j."""
    out: list[Tensor | None] = [None] * mesh.size
    for group in mesh.groups(axis):
        for j, rj in enumerate(group):
            parts = []
            for ri in group:
                start = int(send[ri, :j].sum())
                parts.append(xs[ri, start : start + int(send[ri, j])])
            out[rj] = pad(torch.cat(parts), cap)
    return torch.stack(out)  # type: ignore[arg-type]


@given(case=ragged_cases())
def test_ragged_all_to_all_values_and_gradients(
    case: tuple[fd.Mesh, Any, Tensor, Tensor, int],
) -> None:
    mesh, axis, xs, send, cap = case
    leaf = xs.clone().requires_grad_()
    out, recv = fd.simulate(
        lambda x, s: fd.ragged_all_to_all(x, mesh, axis, s, capacity=cap), mesh
    )(leaf, send)
    ref_leaf = xs.clone().requires_grad_()
    want = ref_ragged(ref_leaf, send, mesh, axis, cap)
    torch.testing.assert_close(out, want.detach())
    for r in range(mesh.size):
        g = mesh.group(r, axis)
        assert recv[r].tolist() == [int(send[ri, mesh.index(r, axis)]) for ri in g]
    c = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(2))
    (out * c).sum().backward()
    (want * c).sum().backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad)


def test_ragged_all_to_all_compiles_on_simulated_ranks() -> None:
    torch._dynamo.reset()
    mesh = fd.Mesh({"ep": 2})
    x = torch.randn(2, 3, 2, dtype=F64)
    send = torch.tensor([[1, 2], [2, 0]])
    step = fd.simulate(lambda x, s: fd.ragged_all_to_all(x, mesh, "ep", s, capacity=4)[0], mesh)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    step(a, send).sin().sum().backward()
    torch.compile(step, fullgraph=True)(b, send).sin().sum().backward()
    torch.testing.assert_close(b.grad, a.grad)


# ============================================================================ MoE layer
def moe_single_device(x: Tensor, router: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    """Top-1 MoE: every token goes through its expert's MLP, scaled by its gate."""
    probs = (x @ router).softmax(-1)  # (T, E)
    gate, expert = probs.max(-1)
    h = torch.einsum("td,tdh->th", x, w1[expert])
    y = torch.einsum("th,thd->td", torch.tanh(h), w2[expert])
    return y * gate.unsqueeze(-1)


def moe_per_rank(
    x: Tensor, router: Tensor, w1: Tensor, w2: Tensor, mesh: fd.Mesh, axis: str
) -> Tensor:
    """x: this rank's tokens (T, D); router replicated (D, E); w1/w2: this rank's expert (one per
    rank)."""
    E, T = router.shape[1], x.shape[0]
    # replicated weight, rank-specific tokens: its grads are summed
    router = fd.pvary(router, mesh, axis)
    probs = (x @ router).softmax(-1)
    gate, expert = probs.max(-1)
    order = torch.argsort(expert, stable=True)  # tokens packed by destination expert (= rank)
    send = F.one_hot(expert, E).sum(0)  # tokens per expert
    got, recv = fd.indexed_all_to_all_v(x, mesh, axis, order, send, capacity=E * T)
    # my expert on every token it received (padding rows are discarded below)
    y = torch.tanh(got @ w1) @ w2
    # return each token to its owner, in order
    back, _ = fd.ragged_all_to_all(y, mesh, axis, recv, capacity=T)
    out = torch.zeros_like(back).index_copy(0, order, back)  # unsort
    return out * gate.unsqueeze(-1)


@pytest.mark.parametrize("ep, T", [(2, 3), (4, 5)])
def test_moe_layer_matches_single_device(ep: int, T: int) -> None:
    mesh = fd.Mesh({"ep": ep})
    D, H = 4, 3
    g = torch.Generator().manual_seed(ep)
    x = torch.randn(ep * T, D, dtype=F64, generator=g)
    router = torch.randn(D, ep, dtype=F64, generator=g) * 2
    w1, w2 = (
        torch.randn(ep, D, H, dtype=F64, generator=g),
        torch.randn(ep, H, D, dtype=F64, generator=g),
    )
    ref = [t.clone().requires_grad_() for t in (x, router, w1, w2)]
    want = moe_single_device(*ref)
    c = torch.randn(want.shape, dtype=F64, generator=g)
    (want * c).sum().backward()

    xs = x.reshape(ep, T, D).clone().requires_grad_()  # tokens split over ep
    rs = router.expand(ep, D, ep).clone().requires_grad_()  # router replicated
    w1s, w2s = w1.clone().requires_grad_(), w2.clone().requires_grad_()  # expert e on rank e
    out = fd.simulate(lambda *a: moe_per_rank(*a, mesh, "ep"), mesh)(xs, rs, w1s, w2s)
    torch.testing.assert_close(out.reshape(ep * T, D), want.detach())
    (out * c.reshape(ep, T, D)).sum().backward()
    torch.testing.assert_close(xs.grad.reshape(ep * T, D), ref[0].grad)
    torch.testing.assert_close(rs.grad, ref[1].grad.expand(ep, D, ep))
    torch.testing.assert_close(w1s.grad, ref[2].grad)
    torch.testing.assert_close(w2s.grad, ref[3].grad)


def test_exchange_sizes() -> None:
    mesh = fd.Mesh({"dp": 2, "ep": 2})
    sizes = fd.simulate(lambda n: fd.exchange_sizes(n, mesh, "ep"), mesh)(
        torch.tensor([3, 0, 5, 1])
    )
    assert sizes.tolist() == [[3, 0], [3, 0], [5, 1], [5, 1]]


# ============================================================================ errors
MESH = fd.Mesh({"tp": 3})


@pytest.mark.parametrize(
    "fn, match",
    [
        (
            lambda x: fd.all_gather_v(x, MESH, "tp", [1, 2]),
            r"all_gather_v\(axis='tp'\).*sizes has 2 entries but the axis has 3 ranks",
        ),
        (lambda x: fd.all_gather_v(x, MESH, "tp", [1, -1, 2]), r"sizes\[1\] = -1 is negative"),
        (lambda x: fd.all_gather_v(x, MESH, "tp", "abc"), r"sizes='abc' is not a list of ints"),
        (
            lambda x: fd.all_gather_v(x, MESH, "tp", [1, 5, 2]),
            r"the local shard has 4 rows along the ragged dim but max\(sizes\) .* = 5.*pass at "
            r"least 5 rows",
        ),
        (
            lambda x: fd.reduce_scatter_v(x, MESH, "tp", [1, 1, 1]),
            r"reduce_scatter_v.*dim 0 has 4 rows but sizes sum to 3",
        ),
        (
            lambda x: fd.reduce_scatter_v(x, MESH, "tp", [1, 1, 2]),
            r"sizes \[1, 1, 2\] differ.*simulated ranks share one shape.*capacity=2",
        ),
        (
            lambda x: fd.reduce_scatter_v(x, MESH, "tp", [1, 1, 2], capacity=1),
            r"capacity=1 cannot hold the largest chunk \(2 rows\)",
        ),
        (
            lambda x: fd.reduce_scatter_v(x, MESH, "tp", [1, 1, 2], capacity=2.5),
            r"on every rank: capacity = 2\.5 is a float, not an integer row count\. Fix: pass "
            r"Python ints",
        ),
        (
            lambda x: fd.indexed_all_to_all_v(
                x, MESH, "tp", torch.arange(3), torch.tensor([1, 1]), capacity=4
            ),
            r"^fastdist\.indexed_all_to_all_v\(axis='tp'\) on every rank: send_sizes has shape "
            r"\(2,\), not \(3,\)",
        ),
        (
            lambda x: fd.indexed_all_to_all_v(
                x, MESH, "tp", torch.tensor([0.0, 1.0]), torch.tensor([1, 1, 0]), capacity=4
            ),
            r"indexed_all_to_all_v.*index must be a 1-d integer tensor of row numbers, got shape "
            r"\(2,\), dtype torch\.float32",
        ),
        (
            lambda x: fd.gather_v(x, MESH, "tp", [1, 1, 2], dst=3),
            r"gather_v.*dst=3 is not an index along the axis \(size 3\)",
        ),
        (
            lambda x: fd.gather_v(x, MESH, "tp", [1, 1, 2], dst=0),
            r"only dst gets rows.*pass capacity=4",
        ),
        (
            lambda x: fd.scatter_v(x, MESH, "tp", [1, 1, 2], src=-1),
            r"scatter_v.*src=-1 is not an index",
        ),
        (
            lambda x: fd.scatter_v(x, MESH, "tp", [1, 1, 1], src=0),
            r"scatter_v.*dim 0 has 4 rows but sizes sum to 3",
        ),
        (
            lambda x: fd.ragged_all_to_all(x, MESH, "tp", torch.tensor([1, 1]), capacity=4),
            r"send_sizes has shape \(2,\), not \(3,\)",
        ),
        (
            lambda x: fd.ragged_all_to_all(x, MESH, "tp", torch.tensor([1, 1, 1]), capacity=-2),
            r"capacity=-2 is not a row count",
        ),
        (
            lambda x: fd.all_gather_v(x, MESH, "tp", fd.axis_index(MESH, "tp").expand(3)),
            r"sizes must be the same list of ints on every rank",
        ),
    ],
)
def test_argument_errors(fn: Any, match: str) -> None:
    with pytest.raises(fd.CollectiveError, match=match):
        fd.simulate(fn, MESH)(torch.zeros(3, 4, 2))


def test_capacity_takes_numpy_and_0d_integer_tensors_as_sizes_do() -> None:
    import numpy as np

    x = torch.arange(24.0).reshape(3, 4, 2)
    want = fd.simulate(lambda t: fd.reduce_scatter_v(t, MESH, "tp", [1, 1, 2], capacity=2), MESH)(x)
    for cap in (np.int64(2), torch.tensor(2)):
        got = fd.simulate(
            lambda t, cap=cap: fd.reduce_scatter_v(t, MESH, "tp", [1, 1, 2], capacity=cap), MESH
        )(x)
        assert torch.equal(got, want), cap


@pytest.mark.parametrize(
    "send, cap, match",
    [
        (
            [[1, 1, 1], [0, 0, 5], [0, 0, 0]],
            9,
            r"rank 1 has send sizes summing past the 4 rows of its input",
        ),
        ([[1, 1, 1], [1, 1, 1], [0, -1, 0]], 9, r"rank 2 has negative send sizes"),
        (
            [[2, 0, 0], [2, 0, 0], [1, 0, 0]],
            4,
            r"rank 0 has more rows arriving than capacity=4.*raise capacity",
        ),
    ],
)
def test_data_dependent_errors_name_the_rank(send: list[list[int]], cap: int, match: str) -> None:
    with pytest.raises(fd.CollectiveError, match=match):
        fd.simulate(lambda x, s: fd.ragged_all_to_all(x, MESH, "tp", s, capacity=cap)[0], MESH)(
            torch.zeros(3, 4, 2), torch.tensor(send)
        )


# ========================================================= row counts are integers, never truncated
V_OPS = {
    "all_gather_v": lambda x, s: fd.all_gather_v(x, MESH, "tp", s),
    "reduce_scatter_v": lambda x, s: fd.reduce_scatter_v(x[:3], MESH, "tp", s, capacity=3),
    "gather_v": lambda x, s: fd.gather_v(x, MESH, "tp", s, dst=0, capacity=6),
    "scatter_v": lambda x, s: fd.scatter_v(x[:3], MESH, "tp", s, src=0, capacity=3),
}


@pytest.mark.parametrize("op", list(V_OPS))
@pytest.mark.parametrize(
    "sizes, entry",
    [
        ([1.9, 0.6, 0.5], r"sizes\[0\] = 1\.9 is a float"),
        # whole floats too: a float is never a row count
        (
            [1, 2.0, 0],
            r"sizes\[1\] = 2\.0 is a float",
        ),
        ([1, True, 1], r"sizes\[1\] = True is a bool"),
        ([1, 1, np.float32(1.0)], r"sizes\[2\] = np\.float32\(1\.0\) is a float32"),
        ([1, np.bool_(True), 1], r"sizes\[1\] = np\.True_ is a bool"),
        (
            torch.tensor([1.0, 1.0, 1.0]),
            r"sizes\[0\] = tensor\(1\.\) is a 0-d torch\.float32 tensor",
        ),
        (
            [torch.tensor(1), torch.tensor([1]), 1],
            r"sizes\[1\] = tensor\(\[1\]\) is a 1-d torch\.int64 tensor",
        ),
    ],
)
def test_non_integer_sizes_raise_naming_the_entry(op: str, sizes: Any, entry: str) -> None:
    with pytest.raises(
        fd.CollectiveError,
        match=(
            rf"^fastdist\.{op}\(axis='tp'\) on every rank: {entry}, not an integer row count\. "
            r"Fix: pass Python ints"
        ),
    ):
        fd.simulate(lambda x: V_OPS[op](x, sizes), MESH)(torch.ones(3, 4, 2))


@pytest.mark.parametrize("op", list(V_OPS))
def test_negative_sizes_raise_naming_the_entry(op: str) -> None:
    with pytest.raises(
        fd.CollectiveError,
        match=rf"^fastdist\.{op}\(axis='tp'\) on every rank: sizes\[2\] = -1 is negative",
    ):
        fd.simulate(lambda x: V_OPS[op](x, [2, 2, -1]), MESH)(torch.ones(3, 4, 2))


@pytest.mark.parametrize("op", list(V_OPS))
def test_numpy_ints_and_integer_tensors_are_sizes(op: str) -> None:
    x = torch.arange(24.0).reshape(3, 4, 2)
    want = fd.simulate(lambda x: V_OPS[op](x, [1, 0, 2]), MESH)(x)
    for sizes in (
        [np.int64(1), np.int32(0), 2],
        [torch.tensor(1), torch.tensor(0, dtype=torch.int8), 2],
        torch.tensor([1, 0, 2]),
        np.array([1, 0, 2]),
    ):
        assert torch.equal(fd.simulate(lambda x, s=sizes: V_OPS[op](x, s), MESH)(x), want), sizes


def test_data_dependent_sizes_must_be_integer_tensors() -> None:
    with pytest.raises(
        fd.CollectiveError,
        match=(
            r"ragged_all_to_all\(axis='tp'\).*send_sizes has dtype torch.float32, but row counts "
            r"are integers"
        ),
    ):
        fd.simulate(lambda x, s: fd.ragged_all_to_all(x, MESH, "tp", s, capacity=9)[0], MESH)(
            torch.zeros(3, 4, 2), torch.full((3, 3), 1.5)
        )
    with pytest.raises(
        fd.CollectiveError,
        match=(
            r"exchange_sizes\(axis='tp'\) on every rank: local_size = 2\.5 is a float, not an "
            r"integer row count"
        ),
    ):
        fd.simulate(lambda x: fd.exchange_sizes(2.5, MESH, "tp"), MESH)(torch.zeros(3))
    with pytest.raises(
        fd.CollectiveError, match=r"exchange_sizes\(axis='tp'\).*local_size has dtype torch.float32"
    ):
        fd.simulate(lambda n: fd.exchange_sizes(n, MESH, "tp"), MESH)(torch.tensor([1.0, 2.0, 3.0]))
    got = fd.simulate(lambda x: fd.exchange_sizes(np.int64(2), MESH, "tp"), MESH)(torch.zeros(3))
    assert got.tolist() == [[2, 2, 2]] * 3
