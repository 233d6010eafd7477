"""Every collective: values against an independent reference, gradients against the
single-device oracle, in eager, torch.func and compiled runs; opcheck for every op."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import fastdist as fd
import fastdist.ops  # noqa: F401  # registers every primitive in PRIMITIVES (fd loads it lazily)
from fastdist.core.primitive import PRIMITIVES, GroupSpec, Primitive
from fastdist.core.transforms import FAST_PATH

from .reference import axes_of, meshes, per_group, ref

ALL_OPS = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "pvary",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "broadcast",
]
# Output replicated over the group: each rank's loss uses it the same way (one copy in the oracle).
INVARIANT_OUT = {"psum", "pmean", "pmax", "pmin", "broadcast"}
FLOAT_ONLY = {"pmean"}


def run(op: str, xs: Tensor, mesh: fd.Mesh, axis: fd.AxisName, **kw: Any) -> Tensor:
    return fd.simulate(lambda x: getattr(fd, op)(x, mesh, axis, **kw), mesh)(xs)


@st.composite
def cases(
    draw, op: str, dtypes: tuple[torch.dtype, ...]
) -> tuple[fd.Mesh, fd.AxisName, dict[str, Any], Tensor]:
    """A mesh, an axis, the op's keyword arguments and stacked integer-valued input."""
    mesh = draw(meshes())
    axis = draw(axes_of(mesh))
    n = mesh.axis_size(axis)
    ndim = draw(st.integers(0 if op not in ("psum_scatter", "all_to_all") else 1, 3))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    kw: dict[str, Any] = {}
    if op == "all_gather":
        kw["tiled"] = tiled = draw(st.booleans()) if ndim else False
        hi = ndim if tiled else ndim + 1
        kw["dim"] = draw(st.integers(-hi, hi - 1))
    elif op == "psum_scatter":
        kw["tiled"] = tiled = draw(st.booleans())
        kw["dim"] = dim = draw(st.integers(-ndim, ndim - 1))
        shape[dim] = shape[dim] * n if tiled else n
    elif op == "all_to_all":
        kw["split_dim"] = s = draw(st.integers(-ndim, ndim - 1))
        kw["concat_dim"] = draw(st.integers(-ndim, ndim - 1))
        shape[s] *= n
    elif op == "ppermute":
        srcs = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
        dsts = draw(st.permutations(range(n)))[: len(srcs)]
        kw["perm"] = list(zip(srcs, dsts))
    elif op == "broadcast":
        kw["src"] = draw(st.integers(0, n - 1))
    dtype = draw(st.sampled_from(dtypes))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    # integer-valued: exact sums
    xs = torch.randint(-8, 9, (mesh.size, *shape), generator=gen).to(dtype)
    if op == "pvary":  # pvary's input is replicated over the group
        xs = per_group(xs, mesh, axis, lambda m: [m[0]] * len(m))
    return mesh, axis, kw, xs


# ============================================================================ values
@pytest.mark.parametrize("op", ALL_OPS)
@given(data=st.data())
def test_values_match_reference(op: str, data: st.DataObject) -> None:
    dtypes = (torch.float32, torch.float64, torch.bfloat16) + (
        () if op in FLOAT_ONLY else (torch.int32, torch.int64)
    )
    mesh, axis, kw, xs = data.draw(cases(op, dtypes))
    got = run(op, xs, mesh, axis, **kw)
    want = ref(op, xs, mesh, axis, **norm_kw(op, kw, xs.dim() - 1))
    assert got.dtype == xs.dtype
    torch.testing.assert_close(got, want)


# ============================================================================ gradients
def oracle_grad(
    op: str, xs: Tensor, c: Tensor, mesh: fd.Mesh, axis: fd.AxisName, kw: dict[str, Any]
) -> Tensor:
    """Single-device gradient of the global loss, per rank.

    Varying outputs: the global loss is the sum of the ranks' losses <c_r, out_r>.
    Replicated outputs: one copy per group (every rank computes the same loss).
    Replicated inputs (pvary): one variable per group, used by every member.
    """
    groups = mesh.groups(axis)
    first = {r: g[0] for g in groups for r in g}
    leaf = xs.detach().clone().requires_grad_()
    x = torch.stack([leaf[first[r]] for r in range(mesh.size)]) if op == "pvary" else leaf
    out = ref(op, x, mesh, axis, **norm_kw(op, kw, xs.dim() - 1))
    if op in INVARIANT_OUT:
        loss = sum((out[g[0]] * c[g[0]]).sum() for g in groups)
    else:
        loss = (out * c).sum()
    (grad,) = torch.autograd.grad(loss, leaf)
    return torch.stack([grad[first[r]] for r in range(mesh.size)]) if op == "pvary" else grad


def norm_kw(op: str, kw: dict[str, Any], ndim: int) -> dict[str, Any]:
    """Non-negative dims for the reference (an untiled all_gather adds a dim)."""
    out = dict(kw)
    for k in ("dim", "split_dim", "concat_dim"):
        if k in out:
            out[k] %= ndim + (1 if op == "all_gather" and not kw.get("tiled", True) else 0)
    return out


def cotangent(op: str, out: Tensor, mesh: fd.Mesh, axis: fd.AxisName, seed: int) -> Tensor:
    c = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return per_group(c, mesh, axis, lambda m: [m[0]] * len(m)) if op in INVARIANT_OUT else c


@pytest.mark.parametrize("op", ALL_OPS)
@given(data=st.data())
def test_gradients_match_single_device(op: str, data: st.DataObject) -> None:
    mesh, axis, kw, xs = data.draw(cases(op, (torch.float64,)))
    xs = xs + torch.rand(xs.shape, dtype=xs.dtype, generator=torch.Generator().manual_seed(1)) * (
        op in ("pmax", "pmin")
    )  # no ties
    leaf = xs.clone().requires_grad_()
    out = run(op, leaf, mesh, axis, **kw)
    c = cotangent(op, out, mesh, axis, seed=data.draw(st.integers(0, 2**16)))
    (out * c).sum().backward()  # the sum over ranks of every rank's loss <c_r, out_r>
    torch.testing.assert_close(leaf.grad, oracle_grad(op, xs, c, mesh, axis, kw))


@pytest.mark.parametrize("op", ALL_OPS)
@given(data=st.data())
def test_func_grad_inside_simulate_matches_backward(op: str, data: st.DataObject) -> None:
    """``torch.func.grad`` of the per-rank loss inside simulate == outer backward()."""
    mesh, axis, kw, xs = data.draw(cases(op, (torch.float64,)))
    xs = xs + torch.rand(xs.shape, dtype=xs.dtype, generator=torch.Generator().manual_seed(2)) * (
        op in ("pmax", "pmin")
    )
    c = cotangent(
        op, run(op, xs, mesh, axis, **kw), mesh, axis, seed=data.draw(st.integers(0, 2**16))
    )
    fn = getattr(fd, op)
    grads = fd.simulate(
        lambda x, c: torch.func.grad(lambda x: (fn(x, mesh, axis, **kw) * c).sum())(x), mesh
    )(xs, c)
    torch.testing.assert_close(grads, oracle_grad(op, xs, c, mesh, axis, kw))


@pytest.mark.parametrize("op", ALL_OPS)
@given(data=st.data())
def test_func_grad_outside_simulate_matches_backward(op: str, data: st.DataObject) -> None:
    """``torch.func.grad`` around simulate (a grad layer under the rank vmap) == outer backward().

    Outer ``backward()`` records the stacked op's autograd; an active grad transform routes
    through the autograd.Function instead (fastdist.core.primitive.bind): both must agree.
    """
    mesh, axis, kw, xs = data.draw(cases(op, (torch.float64,)))
    xs = xs + torch.rand(xs.shape, dtype=xs.dtype, generator=torch.Generator().manual_seed(4)) * (
        op in ("pmax", "pmin")
    )
    c = cotangent(
        op, run(op, xs, mesh, axis, **kw), mesh, axis, seed=data.draw(st.integers(0, 2**16))
    )
    fn = getattr(fd, op)
    grads = torch.func.grad(
        lambda x: (fd.simulate(lambda x: fn(x, mesh, axis, **kw), mesh)(x) * c).sum()
    )(xs)
    torch.testing.assert_close(grads, oracle_grad(op, xs, c, mesh, axis, kw))


def test_outer_backward_records_the_stacked_op() -> None:
    """With only simulate's vmap active, the functorch-composing Function does not run: backward
    calls the per-rank rule on stacked tensors directly (through the stacked Function, no vmap)."""
    mesh = fd.Mesh({"tp": 4})
    leaf = torch.randn(4, 3, requires_grad=True)
    out = fd.simulate(lambda x: fd.psum(x, mesh, "tp"), mesh)(leaf)
    names: list[str] = []
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            names.append(node.name())
            stack += [f for f, _ in node.next_functions]
    # the public route: torch's generated vmap rule of the functorch-composing Function
    if not FAST_PATH:
        assert names[:2] == ["VmappedPsumFunctionBackward", "torch::autograd::AccumulateGrad"], (
            names
        )
        return
    assert not any("PsumFunction" in n for n in names), names
    assert names[:2] == ["PsumStackedFunctionBackward", "torch::autograd::AccumulateGrad"], names


def test_second_order_gradients_match_single_device() -> None:
    """Double backward through a simulated collective: its backward rule is itself differentiable.

    Rank r holds chunk x_r of X and loses sum(c_r * all_gather(x)^3). The gradient is chunk r
    of 3 C X^2 (C = the sum of the c_r), so the gradient's product with a direction v has
    gradient chunk r of 6 C X V.
    """
    mesh = fd.Mesh({"dp": 2, "tp": 4})
    gen = torch.Generator().manual_seed(0)
    # [ranks, chunk]
    xs, vs = (torch.randn(8, 3, dtype=torch.float64, generator=gen) for _ in range(2))
    cs = torch.randn(8, 12, dtype=torch.float64, generator=gen)  # [ranks, gathered]
    leaf = xs.clone().requires_grad_()
    losses = fd.simulate(lambda x, c: (c * fd.all_gather(x, mesh, "tp") ** 3).sum(), mesh)(leaf, cs)
    (g,) = torch.autograd.grad(losses.sum(), leaf, create_graph=True)
    (hv,) = torch.autograd.grad((g * vs).sum(), leaf)
    for d in range(2):  # each dp group is its own tp problem
        # the gathered X and direction
        X, V = (
            xs[4 * d : 4 * d + 4].reshape(12),
            vs[4 * d : 4 * d + 4].reshape(12),
        )
        C = cs[4 * d : 4 * d + 4].sum(0)
        torch.testing.assert_close(g.detach()[4 * d : 4 * d + 4], (3 * C * X**2).reshape(4, 3))
        torch.testing.assert_close(hv[4 * d : 4 * d + 4], (6 * C * X * V).reshape(4, 3))


COMPILE_CASES = {
    "psum": {},
    "pmean": {},
    "pmax": {},
    "pmin": {},
    "pvary": {},
    "all_gather": {"dim": 1, "tiled": True},
    "psum_scatter": {"dim": -1, "tiled": True},
    "all_to_all": {"split_dim": 1, "concat_dim": 0},
    "ppermute": {"perm": [(0, 2), (2, 1), (1, 0)]},
    "broadcast": {"src": 2},
}


@pytest.mark.parametrize("op", ALL_OPS)
def test_compiled_gradients_equal_eager(op: str) -> None:
    """A compiled forward that is right says nothing about the compiled backward: check both."""
    torch._dynamo.reset()
    mesh, axis = fd.Mesh({"dp": 2, "tp": 3}), "tp"
    xs = torch.randn(6, 3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    if op == "pvary":
        xs = per_group(xs, mesh, axis, lambda m: [m[0]] * len(m))
    kw = COMPILE_CASES[op]
    fn = getattr(fd, op)
    step = fd.simulate(lambda x: fn(x, mesh, axis, **kw), mesh)
    eager_leaf, comp_leaf = xs.clone().requires_grad_(), xs.clone().requires_grad_()
    eager_out = step(eager_leaf)
    comp_out = torch.compile(step, fullgraph=True)(comp_leaf)
    c = cotangent(op, eager_out, mesh, axis, seed=3)
    (eager_out * c).sum().backward()
    (comp_out * c).sum().backward()
    torch.testing.assert_close(comp_out, eager_out)
    torch.testing.assert_close(comp_leaf.grad, eager_leaf.grad)
    torch.testing.assert_close(eager_leaf.grad, oracle_grad(op, xs, c, mesh, axis, kw))


# ============================================================================ specific semantics
def test_pmax_pmin_ties_go_to_lowest_rank() -> None:
    mesh = fd.Mesh({"tp": 4})
    xs = torch.tensor([1.0, 3.0, 3.0, 0.0], requires_grad=True)
    fd.simulate(lambda x: fd.pmax(x, mesh, "tp"), mesh)(xs).sum().backward()
    # Single device: d max(x) / dx is 1 at one argmax; ties go to the lowest rank (rank 1, not 2).
    assert xs.grad.tolist() == [0.0, 1.0, 0.0, 0.0]
    ys = torch.tensor([2.0, 0.0, 5.0, 0.0], requires_grad=True)
    (fd.simulate(lambda x: fd.pmin(x, mesh, "tp"), mesh)(ys) * 3).sum().backward()
    assert ys.grad.tolist() == [0.0, 3.0, 0.0, 0.0]


def test_psum_grad_per_rank_is_identity_not_n() -> None:
    """jax#3970: grad of psum taken per rank must be 1, not the group size."""
    mesh = fd.Mesh({"tp": 4})
    g = fd.simulate(lambda x: torch.func.grad(lambda x: fd.psum(x, mesh, "tp"))(x), mesh)(
        torch.randn(4)
    )
    assert g.tolist() == [1.0] * 4


def test_axis_index_and_size() -> None:
    mesh = fd.Mesh({"dp": 2, "sp": 3, "tp": 2})
    idx = fd.simulate(lambda x: x + fd.axis_index(mesh, ("tp", "dp")), mesh)(
        torch.zeros(12, dtype=torch.long)
    )
    assert idx.tolist() == [mesh.index(r, ("tp", "dp")) for r in range(12)]
    assert fd.axis_size(mesh, ("sp", "tp")) == 6
    assert fd.axis_index(fd.Mesh({"tp": 1}), "tp").item() == 0


def test_ring_shift_and_inverse_gradient() -> None:
    mesh = fd.Mesh({"dp": 2, "cp": 4})
    xs = torch.arange(8.0, requires_grad=True)
    out = fd.simulate(lambda x: fd.ring_shift(x, mesh, "cp", shift=1), mesh)(xs)
    assert out.tolist() == [3.0, 0.0, 1.0, 2.0, 7.0, 4.0, 5.0, 6.0]  # rank i receives from i - 1
    (out * torch.arange(8.0)).sum().backward()
    assert xs.grad.tolist() == [1.0, 2.0, 3.0, 0.0, 5.0, 6.0, 7.0, 4.0]  # cotangent shifted back


def test_collective_on_constant_inside_simulate_varies_per_rank() -> None:
    """A tensor built inside fn from constants is replicated; collectives still see every rank."""
    mesh = fd.Mesh({"tp": 3})
    out = fd.simulate(lambda x: x + fd.psum(torch.ones(2), mesh, "tp"), mesh)(torch.zeros(3, 2))
    assert out.tolist() == [[3.0, 3.0]] * 3
    sc = fd.simulate(lambda x: x + fd.psum_scatter(torch.arange(3.0), mesh, "tp"), mesh)(
        torch.zeros(3, 1)
    )
    assert sc.tolist() == [[0.0], [3.0], [6.0]]


def test_one_rank_mesh_runs_outside_simulate_with_gradients() -> None:
    mesh = fd.Mesh({"tp": 1})
    x = torch.randn(3, 4, requires_grad=True)
    y = fd.all_gather(fd.psum(x, mesh, "tp"), mesh, "tp", dim=1)
    assert torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(3, 4))
    compiled = torch.compile(lambda x: fd.psum_scatter(x * 2, mesh, "tp", dim=0), fullgraph=True)
    x2 = torch.randn(3, requires_grad=True)
    compiled(x2).sum().backward()
    assert torch.equal(x2.grad, torch.full((3,), 2.0))


def test_two_meshes_in_one_simulation() -> None:
    """A TP=4 model beside a TP=1 draft model over the same 4 ranks."""
    big, draft = fd.Mesh({"tp": 4}), fd.Mesh({"dp": 4, "tp": 1})
    f = fd.simulate(
        lambda x: fd.psum(x, big, "tp") + fd.psum(x, draft, "tp") + fd.psum(x, draft, "dp"),
        big,
        meshes=[draft],
    )
    out = f(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert out.tolist() == [10 + 1 + 10, 10 + 2 + 10, 10 + 3 + 10, 10 + 4 + 10]
    assert fd.core.context._RUNNING.simulations == ()  # dropped once the call returned


def test_outer_vmap_over_simulate_is_a_data_dim() -> None:
    """vmap over independent simulations (an ensemble) treats the outer dim as data."""
    mesh = fd.Mesh({"tp": 2})
    xs = torch.randn(5, 2, 3)  # [ensemble, rank, features]
    out = torch.vmap(fd.simulate(lambda x: fd.all_gather(x, mesh, "tp", dim=0), mesh))(xs)
    want = torch.stack([ref("all_gather", x, mesh, "tp", dim=0) for x in xs])
    torch.testing.assert_close(out, want)
    # and its gradient: each ensemble member's, as if simulated alone (outer backward records
    # the stacked op with the data dim in its parameters)
    step = fd.simulate(
        lambda x: fd.psum_scatter(
            torch.sin(fd.all_gather(x, mesh, "tp", dim=0)), mesh, "tp", dim=0
        ),
        mesh,
    )
    c = torch.randn(xs.shape)
    leaf = xs.clone().requires_grad_()
    (torch.vmap(step)(leaf) * c).sum().backward()
    for e in range(5):
        one = xs[e].clone().requires_grad_()
        (step(one) * c[e]).sum().backward()
        torch.testing.assert_close(leaf.grad[e], one.grad)
    assert leaf.grad.abs().sum() > 0


def test_pytree_arguments_and_kwargs() -> None:
    mesh = fd.Mesh({"tp": 2})
    f = fd.simulate(lambda d, scale: {"y": fd.psum(d["a"] * scale, mesh, "tp") + d["b"]}, mesh)
    out = f({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([10.0, 20.0])}, scale=3.0)
    assert out["y"].tolist() == [19.0, 29.0]


def test_randomness_different_per_rank() -> None:
    mesh = fd.Mesh({"dp": 4})
    out = fd.simulate(lambda x: x + torch.rand(()), mesh, randomness="different")(torch.zeros(4))
    assert len(set(out.tolist())) == 4


# ============================================================================ opcheck
def _opcheck_samples(name: str, one_rank: bool) -> tuple[tuple[Tensor, ...], dict[str, Any]]:
    """Sample inputs: stacked over mesh (dp=2, tp=2) collecting over tp, or one rank's (mesh of
    1)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 6, dtype=torch.float64, generator=gen)  # [world=4, 2, 6]
    params = {
        "all_gather": {"dim": 1, "tiled": True},
        "psum_scatter": {"dim": 1, "tiled": True},
        "all_to_all": {"split_dim": 1, "concat_dim": 0},
        "ppermute": {"perm": (0, 1, 1, 0)},
        "broadcast": {"src": 1},
        "keep_src": {"src": 1},
        "all_gather_invariant": {"dim": 1},
        "local_chunk": {"dim": 1},
        "all_gather_v": {"sizes": (1, 2), "accumulate_fp32": False},
        "reduce_scatter_v": {"sizes": (1, 1), "capacity": 2},
        "gather_v": {"sizes": (1, 2), "dst": 1, "capacity": 3},
        "scatter_v": {"sizes": (1, 1), "src": 0, "capacity": 1},
        "ragged_all_to_all": {"capacity": 3},
    }.get(name, {})
    one = {
        "broadcast": {"src": 0},
        "keep_src": {"src": 0},
        "ppermute": {"perm": (0, 0)},
        "all_gather_v": {"sizes": (2,), "accumulate_fp32": False},
        "reduce_scatter_v": {"sizes": (2,), "capacity": 2},
        "gather_v": {"sizes": (2,), "dst": 0, "capacity": 2},
        "scatter_v": {"sizes": (2,), "src": 0, "capacity": 2},
        "ragged_all_to_all": {"capacity": 2},
    }
    if one_rank:
        params = one.get(name, params)
    if name == "select_extreme":
        out = x.reshape(2, 2, 2, 6).amax(1, keepdim=True).expand(2, 2, 2, 6).reshape(4, 2, 6)
        tensors: tuple[Tensor, ...] = (
            torch.randn(4, 2, 6, dtype=torch.float64, generator=gen),
            x,
            out.contiguous(),
        )
    elif name == "ragged_all_to_all":
        # sender rows per receiver; recv is the transpose within each tp group
        send = (
            torch.tensor([[1, 1], [0, 2], [2, 0], [1, 1]])
            if not one_rank
            else torch.tensor([[2]] * 4)
        )
        recv = (
            torch.tensor([[1, 0], [1, 2], [2, 1], [0, 1]])
            if not one_rank
            else torch.tensor([[2]] * 4)
        )
        tensors = (x, send, recv)
    else:
        tensors = (x,)
    return tensors, params


LAYOUT_OPS = (
    "psum",
    "pmax",
    "all_gather",
    "psum_scatter",
    "ppermute",
    "all_to_all",
    "broadcast",
    "all_gather_invariant",
    "local_chunk",
)


@pytest.mark.parametrize("name", LAYOUT_OPS)
@pytest.mark.parametrize(
    "spec", [GroupSpec((2, 2), (0,)), GroupSpec((4,), (0,))], ids=["outer-axis", "whole-mesh"]
)
def test_opcheck_stacked_op_layouts(name: str, spec: GroupSpec) -> None:
    """The stacked rules work in the mesh layout (GroupSpec.axis_view); their outputs must still be
    what the fake rule says (contiguous), including where no copy was needed on the way."""
    prim = PRIMITIVES[name]
    tensors, params = _opcheck_samples(name, one_rank=False)
    if spec.n == 4:
        params = {
            **params,
            **{
                "psum_scatter": {"dim": 0, "tiled": True},
                "all_to_all": {"split_dim": 1, "concat_dim": 0},
            }.get(name, {}),
        }
        tensors = (torch.randn(4, 4, 8, dtype=torch.float64),)
    args = (
        *(t.clone().requires_grad_(i == 0) for i, t in enumerate(tensors)),
        *prim._op_args(spec, params),
    )
    assert prim.stacked_op(*args).is_contiguous()
    torch.library.opcheck(prim.stacked_op, args)


@pytest.mark.parametrize("name", sorted(PRIMITIVES))
def test_opcheck_stacked_op(name: str) -> None:
    prim = PRIMITIVES[name]
    tensors, params = _opcheck_samples(name, one_rank=False)
    spec = GroupSpec((2, 2), (1,))  # mesh (dp=2, tp=2), collective over tp
    args = (
        *(t.clone().requires_grad_(i == 0) for i, t in enumerate(tensors)),
        *prim._op_args(spec, params),
    )
    torch.library.opcheck(prim.stacked_op, args)


@pytest.mark.parametrize("name", sorted(PRIMITIVES))
def test_opcheck_per_rank_op_on_one_rank(name: str) -> None:
    prim = PRIMITIVES[name]
    tensors, params = _opcheck_samples(name, one_rank=True)
    spec = GroupSpec((1,), (0,))
    args = (
        *(t[0].clone().requires_grad_(i == 0) for i, t in enumerate(tensors)),
        *prim._op_args(spec, params),
    )
    torch.library.opcheck(prim.per_rank_op, args)


@pytest.mark.parametrize("op", ["psum", "all_gather", "psum_scatter", "ppermute", "broadcast"])
def test_empty_tensors(op: str) -> None:
    """Zero-element per-rank tensors pass through every collective (found by the v-op property
    test)."""
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    kw = {"perm": [(0, 1)]} if op == "ppermute" else {}
    out = run(op, torch.zeros(4, 0, 3), mesh, "tp", **kw)
    assert out.numel() == 0 and out.shape[0] == 4


def test_no_grad_path_gives_the_same_values_without_a_graph() -> None:
    """Without a gradient to track, ops skip their autograd.Function (about 4x cheaper under
    vmap)."""
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    xs = torch.randn(4, 3, 4, dtype=torch.float64)
    f = fd.simulate(
        lambda x: fd.psum_scatter(fd.all_gather(x, mesh, "tp", dim=1), mesh, ("dp", "tp"), dim=1),
        mesh,
    )
    with_grad = f(xs.clone().requires_grad_())
    with torch.no_grad():
        plain = f(xs.clone().requires_grad_())
    assert with_grad.grad_fn is not None and plain.grad_fn is None
    torch.testing.assert_close(plain, with_grad.detach())
    torch.testing.assert_close(f(xs), with_grad.detach())


@pytest.mark.skipif(
    not FAST_PATH, reason="the direct rank-dim path is part of the fast path (FASTDIST_FAST_PATH=0)"
)
@pytest.mark.parametrize("op", ALL_OPS)
@given(data=st.data())
def test_direct_rank_dim_path_equals_the_registered_vmap_rule(op: str, data: st.DataObject) -> None:
    """Inside simulate, ``Primitive.bind`` unwraps the rank dim and calls the stacked op itself
    (``_bind_at_level``); the per-rank op's registered vmap rule must give the same values and
    per-rank gradients."""
    from unittest import mock

    mesh, axis, kw, xs = data.draw(cases(op, (torch.float64,)))
    xs = xs + torch.rand(xs.shape, dtype=xs.dtype, generator=torch.Generator().manual_seed(1)) * (
        op in ("pmax", "pmin")
    )  # no ties
    seed = data.draw(st.integers(0, 2**16))
    taken: list[str] = []
    direct_bind = Primitive._bind_at_level

    def counted(self: Primitive, *a: Any) -> Tensor:
        taken.append(self.name)
        return direct_bind(self, *a)

    def registered_rule(
        self: Primitive, level: int, tensors: Any, spec: Any, params: Any
    ) -> Tensor:
        return cast(Tensor, self.per_rank_op(*tensors, *self._op_args(spec, params)))

    def value_and_grad() -> tuple[Tensor, Tensor]:
        leaf = xs.clone().requires_grad_()
        out = run(op, leaf, mesh, axis, **kw)
        (
            out
            * torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
        ).sum().backward()
        assert leaf.grad is not None
        return out.detach(), leaf.grad

    with mock.patch.object(Primitive, "_bind_at_level", counted):
        direct = value_and_grad()
    assert op in taken
    with mock.patch.object(Primitive, "_bind_at_level", registered_rule):
        registered = value_and_grad()
    torch.testing.assert_close(direct, registered)
