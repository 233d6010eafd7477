"""Mesh: layout, groups, coordinates, construction helpers and their errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fastdist as fd
from fastdist.core import context

from .reference import axes_of, meshes


def brute_groups(mesh: fd.Mesh, axis: fd.AxisName) -> list[list[int]]:
    """Groups from coordinates alone: ranks sharing every other coordinate, ordered by the axis
    index."""
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    others = [a for a in mesh.axis_names if a not in names]
    buckets: dict[tuple[int, ...], list[int]] = {}
    for r in range(mesh.size):
        c = mesh.coords(r)
        buckets.setdefault(tuple(c[a] for a in others), []).append(r)

    def flat(r: int) -> int:
        c, i = mesh.coords(r), 0
        for a in names:
            i = i * mesh.shape[a] + c[a]
        return i

    return [sorted(g, key=flat) for _, g in sorted(buckets.items())]


def test_row_major_layout_last_axis_fastest() -> None:
    mesh = fd.Mesh({"dp": 2, "sp": 2, "tp": 2})
    assert [tuple(mesh.coords(r).values()) for r in range(8)] == list(
        itertools.product(range(2), repeat=3)
    )
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("sp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.groups(("dp", "tp")) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # tuple order decides member order
    assert mesh.groups(("tp", "dp")) == [
        [0, 4, 1, 5],
        [2, 6, 3, 7],
    ]


def test_properties() -> None:
    mesh = fd.Mesh({"dp": 2, "tp": 4})
    assert (mesh.size, mesh.axis_names, dict(mesh.shape), mesh.ndim) == (
        8,
        ("dp", "tp"),
        {"dp": 2, "tp": 4},
        2,
    )
    assert mesh.axis_size(("dp", "tp")) == 8
    assert mesh.rank_of({"dp": 1, "tp": 2}) == 6
    assert (
        mesh.group(6, "dp") == [2, 6]
        and mesh.index(6, "tp") == 2
        and mesh.index(6, ("tp", "dp")) == 5
    )
    assert mesh.submesh("tp") == fd.Mesh({"tp": 4})
    assert repr(mesh) == "Mesh({'dp': 2, 'tp': 4})"
    assert mesh == fd.Mesh([("dp", 2), ("tp", 4)]) and hash(mesh) == hash(
        fd.Mesh({"dp": 2, "tp": 4})
    )
    assert mesh != fd.Mesh({"tp": 4, "dp": 2})
    with pytest.raises(TypeError):
        mesh.shape["dp"] = 3  # type: ignore[index]


@given(data=st.data())
def test_groups_match_coordinates_and_are_orthogonal(data: st.DataObject) -> None:
    mesh = data.draw(meshes(max_size=64))
    axis = data.draw(axes_of(mesh))
    groups = mesh.groups(axis)
    assert groups == brute_groups(mesh, axis)
    assert sorted(r for g in groups for r in g) == list(range(mesh.size))  # a partition
    for g in groups:
        assert all(mesh.group(r, axis) == g and mesh.index(r, axis) == i for i, r in enumerate(g))
    names = (axis,) if isinstance(axis, str) else axis
    rest = tuple(a for a in mesh.axis_names if a not in names)
    if rest:  # groups along disjoint axes meet in at most one rank
        assert all(len(set(g) & set(h)) <= 1 for g in groups for h in mesh.groups(rest))
    for r in range(mesh.size):
        assert mesh.rank_of(mesh.coords(r)) == r


def test_from_world_size_puts_tp_innermost_and_infers_dp() -> None:
    assert fd.Mesh.from_world_size(8, tp=2, sp=2) == fd.Mesh({"dp": 2, "sp": 2, "tp": 2})
    assert fd.Mesh.from_world_size(16, tp=4, pp=2) == fd.Mesh({"pp": 2, "dp": 2, "tp": 4})
    assert fd.Mesh.from_world_size(4) == fd.Mesh({"dp": 4})
    assert fd.Mesh.from_world_size(8, tp=8, dp=1) == fd.Mesh({"dp": 1, "tp": 8})


def test_from_world_size_knows_the_guidance_axis() -> None:
    """``cfg`` (classifier-free guidance) is in the default order, inside ``dp``: a ``cfg`` x
    ``sp`` mesh needs no ``order=`` (it was refused as an unknown axis)."""
    assert fd.Mesh.from_world_size(4, cfg=2, sp=2) == fd.Mesh({"dp": 1, "cfg": 2, "sp": 2})
    assert fd.Mesh.from_world_size(8, cfg=2, sp=2) == fd.Mesh({"dp": 2, "cfg": 2, "sp": 2})
    assert fd.Mesh.from_world_size(2, cfg=2) == fd.Mesh({"dp": 1, "cfg": 2})
    assert fd.Mesh.from_world_size(
        8, order=("dp", "ring", "ulysses"), ulysses=2, ring=2
    ) == fd.Mesh({"dp": 2, "ring": 2, "ulysses": 2})
    # axes of the user's own naming, none in the default order: as written, inside dp
    assert fd.Mesh.from_world_size(8, w=2, h=2) == fd.Mesh({"dp": 2, "w": 2, "h": 2})
    assert fd.Mesh.from_world_size(4, h=2, w=2, dp=1) == fd.Mesh({"dp": 1, "h": 2, "w": 2})
    # The FastVideo bug (non-orthogonal TP and SP groups) cannot happen: tp and sp groups meet in
    # one rank.
    m = fd.Mesh.from_world_size(8, tp=2, sp=4)
    assert all(len(set(a) & set(b)) <= 1 for a in m.groups("tp") for b in m.groups("sp"))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: fd.Mesh.from_world_size(6, tp=4), r"world size 6 is not divisible by tp=4.*Fix"),
        (
            lambda: fd.Mesh.from_world_size(8, tp=2, dp=2),
            r"dp=2 with tp=2 gives 4 ranks, not world size 8.*dp=4",
        ),
        (
            lambda: fd.Mesh.from_world_size(8, tp=2, zz=2),
            r"axis 'zz' is not in the layout order.*Fix: pass order=",
        ),
        (lambda: fd.Mesh.from_world_size(0), r"world_size must be a positive int"),
        (lambda: fd.Mesh.from_world_size(8, tp=0), r"tp=0 is not a positive int"),
        (lambda: fd.Mesh.from_world_size(8, order=("tp",), tp=2), r"no 'dp' axis"),
        (lambda: fd.Mesh({"dp": 0}), r"axis 'dp' has size 0"),
        (lambda: fd.Mesh({"dp": True}), r"axis 'dp' has size True"),
        (lambda: fd.Mesh([("dp", 2), ("dp", 2)]), r"axis 'dp' appears twice"),
        (lambda: fd.Mesh({"d p": 2}), r"not an identifier"),
        (lambda: fd.Mesh([("dp",)]), r"expected \(name, size\) pairs"),
        (lambda: fd.Mesh({"dp": 2}).coords(2), r"Mesh.coords: rank 2 is outside"),
        (
            lambda: fd.Mesh({"dp": 2}).groups("tp"),
            r"Mesh.groups: unknown mesh axis 'tp'.*Fix: use one of \('dp',\)",
        ),
        (lambda: fd.Mesh({"dp": 2}).groups(()), r"axis=\(\) names no mesh axis"),
        (lambda: fd.Mesh({"dp": 2}).groups(("dp", "dp")), r"repeats an axis"),
        (lambda: fd.Mesh({"dp": 2}).groups(3), r"axis must be an axis name or a tuple"),
        (lambda: fd.Mesh({"dp": 2}).rank_of({"dp": 5}), r"coordinate dp=5 is outside"),
        (lambda: fd.Mesh({"dp": 2}).rank_of({"tp": 0}), r"must name exactly the axes"),
    ],
)
def test_mesh_errors(call, match: str) -> None:
    with pytest.raises(fd.MeshError, match=match):
        call()


def test_large_mesh_groups_are_pure_arithmetic() -> None:
    mesh = fd.Mesh.from_world_size(4096, tp=8, sp=4, pp=4)
    tp = mesh.groups("tp")
    assert len(tp) == 512 and tp[1] == list(range(8, 16))
    dp = mesh.groups("dp")
    assert len(dp) == 4096 // mesh.shape["dp"] and dp[0] == [
        i * 32 for i in range(mesh.shape["dp"])
    ]
    assert math.prod(mesh.shape.values()) == 4096


def test_two_meshes_coexist_without_global_state() -> None:
    a, b = fd.Mesh({"tp": 4}), fd.Mesh({"dp": 2, "tp": 2})
    assert a.groups("tp") == [[0, 1, 2, 3]] and b.groups("tp") == [[0, 1], [2, 3]]
    # nothing left running
    assert context._RUNNING.simulations == () and context._RUNNING.checks == ()


# ---------------------------------------------------------------------- a Mesh is an immutable
# value
def test_equal_meshes_are_interchangeable() -> None:
    """Code that builds its own Mesh runs inside a simulation (and a check) of an equal one."""
    m1, m2 = fd.Mesh({"dp": 2, "tp": 2}), fd.Mesh({"dp": 2, "tp": 2})
    assert m1 == m2 and hash(m1) == hash(m2) and m1 is not m2
    x = torch.arange(4.0)
    out = fd.simulate(lambda v: fd.psum(v, m2, "tp") + fd.axis_index(m2, "dp"), m1)(x)
    assert out.tolist() == [1.0, 1.0, 6.0, 6.0]
    f = fd.spmd(
        lambda v, w: fd.psum(v @ w, m2, "tp"),
        m1,
        in_specs=(fd.P(None, "tp"), fd.P("tp", None)),
        out_specs=fd.P(),
        check="error",
    )
    v, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    torch.testing.assert_close(f(v, w), v @ w)
    # an unequal mesh is not covered
    with pytest.raises(fd.NoBackendError, match="no simulation of this mesh"):
        fd.simulate(lambda v: fd.psum(v, fd.Mesh({"dp": 4}), "dp"), m1)(x)
    assert context._RUNNING.simulations == () and context._RUNNING.checks == ()


def test_mesh_cannot_be_mutated_and_copies_are_itself() -> None:
    import copy
    import pickle

    mesh = fd.Mesh({"dp": 2, "tp": 4})
    for name in ("_sizes", "_comm", "anything"):
        with pytest.raises(AttributeError, match="Mesh is immutable"):
            setattr(mesh, name, None)
    with pytest.raises(AttributeError, match="Mesh is immutable"):
        del mesh._names
    assert not hasattr(mesh, "__dict__")
    assert copy.copy(mesh) is mesh and copy.deepcopy({"m": mesh})["m"] is mesh
    back = pickle.loads(pickle.dumps(mesh))
    assert back == mesh and back.groups("tp") == mesh.groups("tp")


def test_threads_simulate_the_same_mesh_at_once() -> None:
    """The running simulation is per thread: two threads interleave on one mesh, each gets its own
    result."""
    import threading

    mesh = fd.Mesh({"tp": 4})
    barrier = threading.Barrier(2, timeout=30)
    results: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []

    def per_rank(x: torch.Tensor, scale: float) -> torch.Tensor:
        y = fd.psum(x, mesh, "tp")
        barrier.wait()  # both threads are inside a simulation of the same mesh now
        return fd.all_gather((y * scale).reshape(1), mesh, "tp").reshape(-1) + fd.axis_index(
            mesh, "tp"
        )

    def work(name: str, scale: float) -> None:
        try:
            results[name] = fd.simulate(lambda x: per_rank(x, scale), mesh)(torch.arange(4.0))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n, s)) for n, s in (("a", 1.0), ("b", 10.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for name, scale in (("a", 1.0), ("b", 10.0)):
        expect = torch.full((4, 4), 6.0 * scale) + torch.arange(4.0)[:, None]
        assert torch.equal(results[name], expect), name
    assert context._RUNNING.simulations == ()


def test_compiled_simulation_over_an_equal_mesh_is_one_graph() -> None:
    import torch._dynamo.testing

    torch._dynamo.reset()  # a fresh compile, whatever earlier tests compiled
    m1, m2 = fd.Mesh({"tp": 2}), fd.Mesh({"tp": 2})
    counter = torch._dynamo.testing.CompileCounter()
    step = torch.compile(
        fd.simulate(lambda x: fd.psum(x * 2, m2, "tp"), m1), backend=counter, fullgraph=True
    )
    x = torch.tensor([1.0, 2.0])
    assert step(x).tolist() == [6.0, 6.0] and step(x + 1).tolist() == [10.0, 10.0]
    assert counter.frame_count == 1
