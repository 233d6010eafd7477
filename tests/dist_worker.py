"""One rank of a multi-process test: ``python -m tests.dist_worker SCENARIO RANK WORLD PORT
OUTDIR``.

Each scenario runs on real gloo ranks and checks its own results against fastdist.simulate
(or the single-device computation) for the same inputs, then writes a picklable summary
to ``OUTDIR/RANK.pkl`` for the parent test to assert on.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from einops import rearrange

import fastdist as fd

SCENARIOS: dict[str, Callable[[int, int], Any]] = {}


def scenario(fn: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
    SCENARIOS[fn.__name__] = fn
    return fn


def from_torch(**kw: Any) -> fd.Mesh:
    """fastdist.connect on the backend the parent test asked for (FASTDIST_TEST_BACKEND /
    _LIBRARY)."""
    backend = os.environ.get("FASTDIST_TEST_BACKEND", "torch")
    library = os.environ.get("FASTDIST_TEST_LIBRARY") if backend != "torch" else None
    return fd.connect(backend=backend, library=library, **kw)


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}")


# ============================================================================ ops vs simulate
MESHES = {2: {"tp": 2}, 3: {"tp": 3}, 4: {"dp": 2, "tp": 2}, 8: {"dp": 2, "sp": 2, "tp": 2}}
INVARIANT_OUT = {"psum", "pmean", "pmax", "pmin", "broadcast"}


def op_cases(mesh: fd.Mesh) -> list[tuple[str, Any, dict[str, Any]]]:
    axes: list[Any] = list(mesh.axis_names)
    if mesh.ndim > 1:
        axes.append(tuple(reversed(mesh.axis_names)))  # a tuple not in mesh order
    cases = []
    for axis in axes:
        n = mesh.axis_size(axis)
        cases += [
            ("psum", axis, {}),
            ("pmean", axis, {}),
            ("pmax", axis, {}),
            ("pmin", axis, {}),
            ("pvary", axis, {}),
            ("all_gather", axis, {"dim": 1}),
            ("all_gather", axis, {"dim": -1, "tiled": False}),
            ("psum_scatter", axis, {"dim": 0}),
            ("psum_scatter", axis, {"dim": 1, "tiled": False}),
            ("all_to_all", axis, {"split_dim": 0, "concat_dim": -1}),
            ("all_to_all", axis, {"split_dim": 2, "concat_dim": 2}),
            ("ppermute", axis, {"perm": [(i, (i + 1) % n) for i in range(n)]}),
            ("ppermute", axis, {"perm": [(0, n - 1)]}),
            ("broadcast", axis, {"src": n - 1}),
        ]
    return cases


def group_first(x: torch.Tensor, mesh: fd.Mesh, axis: Any) -> torch.Tensor:
    first = {r: g[0] for g in mesh.groups(axis) for r in g}
    return torch.stack([x[first[r]] for r in range(mesh.size)])


@scenario
def ops(rank: int, world: int) -> int:
    """Every op, single and tuple axes: values and gradients equal simulate's slice for this
    rank."""
    mesh = from_torch(order=("dp", "sp", "tp"), **MESHES[world])
    checks = 0
    for i, (op, axis, kw) in enumerate(op_cases(mesh)):
        n = mesh.axis_size(axis)
        g = torch.Generator().manual_seed(i)
        shape = {"psum_scatter": (n * 2, n, 3), "all_to_all": (n * 2, 3, n * 2)}.get(op, (2, 3, 4))
        xs = torch.randn(world, *shape, dtype=torch.float64, generator=g)
        if op == "pvary":
            xs = group_first(xs, mesh, axis)
        fn = getattr(fd, op)
        sim_x = xs.clone().requires_grad_()
        sim_out = fd.simulate(lambda x, fn=fn, axis=axis, kw=kw: fn(x, mesh, axis, **kw), mesh)(
            sim_x
        )
        c = torch.randn(sim_out.shape, dtype=torch.float64, generator=g)
        if op in INVARIANT_OUT:
            c = group_first(c, mesh, axis)
        (sim_out * c).sum().backward()

        x = xs[rank].clone().requires_grad_()
        out = fn(x, mesh, axis, **kw)
        (out * c[rank]).sum().backward()
        close(out, sim_out[rank].detach(), f"{op}{kw} over {axis!r} value on rank {rank}")
        close(x.grad, sim_x.grad[rank], f"{op}{kw} over {axis!r} grad on rank {rank}")
        checks += 1
    # integer and bfloat16 values, axis_index
    xi = torch.arange(world * 3).reshape(world, 3)
    close(
        fd.psum(xi[rank], mesh, mesh.axis_names),
        fd.simulate(lambda x: fd.psum(x, mesh, mesh.axis_names), mesh)(xi)[rank],
        "int psum",
    )
    xb = torch.randn(world, 4, generator=torch.Generator().manual_seed(5)).bfloat16()
    close(
        fd.all_gather(xb[rank], mesh, "tp"),
        fd.simulate(lambda x: fd.all_gather(x, mesh, "tp"), mesh)(xb)[rank],
        "bf16 all_gather",
    )
    assert fd.axis_index(mesh, "tp").item() == mesh.index(rank, "tp") and mesh.rank == rank
    # the same mesh object can still be simulated
    assert (
        fd.simulate(lambda x: fd.psum(x, mesh, "tp"), mesh)(torch.ones(world)).tolist()
        == [float(mesh.shape["tp"])] * world
    )
    return checks + 3


# ============================================================================ models
@scenario
def models(rank: int, world: int) -> str:
    """TP MLP (dp x tp) and Ulysses attention (sp) on real ranks against one device."""
    from fastdist.tools.demo import tp_mlp

    mesh = fd.connect(tp=2)  # dp = world / 2
    dp, tp, B, D, H = mesh.shape["dp"], 2, 3, 5, 4
    g = torch.Generator().manual_seed(0)
    x, W1, b1, W2 = (
        torch.randn(*s, dtype=torch.float64, generator=g)
        for s in [(dp * B, D), (D, H), (H,), (H, D)]
    )
    ref = [t.clone().requires_grad_() for t in (x, W1, b1, W2)]
    (torch.tanh(ref[0] @ ref[1] + ref[2]) @ ref[3]).sin().sum().backward()

    c = mesh.coords(rank)
    d, t = c["dp"], c["tp"]
    xl = rearrange(x, "(dp b) d -> dp b d", dp=dp)[d].clone().requires_grad_()
    w1 = rearrange(W1, "d (tp h) -> tp d h", tp=tp)[t].clone().requires_grad_()
    bl = rearrange(b1, "(tp h) -> tp h", tp=tp)[t].clone().requires_grad_()
    w2 = rearrange(W2, "(tp h) d -> tp h d", tp=tp)[t].clone().requires_grad_()
    tp_mlp(xl, w1, bl, w2, mesh).sin().sum().backward()
    close(xl.grad, rearrange(ref[0].grad, "(dp b) d -> dp b d", dp=dp)[d], "TP MLP dx")
    close(
        fd.psum(w1.grad, mesh, "dp"),
        rearrange(ref[1].grad, "d (tp h) -> tp d h", tp=tp)[t],
        "TP MLP dW1",
    )
    close(
        fd.psum(w2.grad, mesh, "dp"),
        rearrange(ref[3].grad, "(tp h) d -> tp h d", tp=tp)[t],
        "TP MLP dW2",
    )

    sp = fd.connect(order=("dp", "sp"), sp=world)
    P, S, Hh, Dh = world, 2 * world, world, 3
    q, k, v = (torch.randn(1, S, Hh, Dh, dtype=torch.float64, generator=g) for _ in range(3))

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attention(*leaves).sin().sum().backward()
    mine = [
        rearrange(t, "b (p s) h d -> p b s h d", p=P)[rank].clone().requires_grad_()
        for t in (q, k, v)
    ]
    qh, kh, vh = (fd.all_to_all_4d(t, sp, "sp") for t in mine)
    o = fd.all_to_all_4d(attention(qh, kh, vh), sp, "sp", scatter_dim=1, gather_dim=2)
    o.sin().sum().backward()
    for got, leaf in zip(mine, leaves):
        close(got.grad, rearrange(leaf.grad, "b (p s) h d -> p b s h d", p=P)[rank], "Ulysses grad")
    return "ok"


@scenario
def compiled(rank: int, world: int) -> str:
    """A compiled step on real ranks (fullgraph, functional collectives), and torch.func.grad of
    it: gradients equal eager."""
    from fastdist.tools.demo import tp_mlp

    mesh = fd.connect(tp=world)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    w1, b1, w2 = (
        torch.randn(4, 2, dtype=torch.float64, generator=g),
        torch.randn(2, dtype=torch.float64, generator=g),
        torch.randn(2, 4, dtype=torch.float64, generator=g),
    )

    def step(*a: torch.Tensor) -> torch.Tensor:
        y = tp_mlp(*a, mesh)
        return (
            fd.all_gather(y, mesh, "tp", dim=0).sum()
            + fd.psum_scatter(y, mesh, "tp", dim=1).pow(2).sum()
        ).sin()

    eager = [t.clone().requires_grad_() for t in (x, w1, b1, w2)]
    step(*eager).backward()  # also creates the groups
    comp = [t.clone().requires_grad_() for t in (x, w1, b1, w2)]
    torch.compile(step, fullgraph=True)(*comp).backward()
    for a, b in zip(comp, eager):
        close(a.grad, b.grad, "compiled grad")
    # torch.func.grad on real ranks: the autograd.Function path taken while a transform is active
    func_grads = torch.func.grad(lambda *a: step(*a), argnums=(0, 1, 2, 3))(x, w1, b1, w2)
    for a, b in zip(func_grads, eager):
        close(a, b.grad, "torch.func.grad")
    # groups created explicitly, then compiled without an eager run
    fresh = fd.connect(tp=world)
    fd.comm.create_groups(fresh, "tp")
    out = torch.compile(lambda t: fd.pmax(t, fresh, "tp"), fullgraph=True)(
        torch.tensor([float(rank)])
    )
    assert out.item() == world - 1
    # no eager run and no create_groups: the groups (a tuple axis's too) are made while dynamo
    # traces
    late = fd.connect(tp=world, timeout=30)
    f = torch.compile(
        lambda t: fd.psum(t, late, "tp") * fd.all_gather(t, late, ("tp", "dp")).sum(),
        fullgraph=True,
    )
    want = world * (world - 1) / 2 * world * (world - 1) / 2
    assert f(torch.tensor([float(rank)])).item() == want
    fd.comm.reset(late)  # the compiled step is traced again, on the new groups
    assert f(torch.tensor([float(rank)])).item() == want
    names = {str(pg.group_name) for pg in late._comm._groups.values()}
    fd.comm.barrier(late)
    assert names == {f"fastdist.dp1_tp{world}.2.e1.{'-'.join(map(str, range(world)))}.gloo"}, (
        names
    )  # the third mesh of this shape, epoch 1
    return "ok"


@scenario
def spmd_checked(rank: int, world: int) -> str:
    """spmd on real ranks with the checked mode: a dp x tp MLP with no pvary, global in, global
    out."""
    mesh = fd.connect(tp=2)
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (
        torch.randn(4, 3, dtype=torch.float64, generator=g),
        torch.randn(3, 4, dtype=torch.float64, generator=g),
        torch.randn(4, 3, dtype=torch.float64, generator=g),
    )

    def local(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return fd.psum(torch.tanh(x @ w1) @ w2, mesh, "tp")

    f = fd.spmd(
        local,
        mesh,
        in_specs=(fd.P("dp", None), fd.P(None, "tp"), fd.P("tp", None)),
        out_specs=fd.P("dp", None),
        check="insert",
    )
    ls = [t.clone().requires_grad_() for t in (x, w1, w2)]
    out = f(*ls)
    out.sin().sum().backward()  # every process: the same global loss
    ref = [t.clone().requires_grad_() for t in (x, w1, w2)]
    want = torch.tanh(ref[0] @ ref[1]) @ ref[2]
    want.sin().sum().backward()
    close(out, want.detach(), "spmd output")
    for a, b in zip(ls, ref):
        close(a.grad, b.grad, "spmd grad")
    try:
        fd.spmd(
            local,
            mesh,
            in_specs=(fd.P("dp", None), fd.P(None, "tp"), fd.P("tp", None)),
            out_specs=fd.P("dp", None),
            check="error",
        )(*ls)
    except fd.ReplicationError as e:
        assert "torch matmul" in str(e)
        return "ok"
    return "no error in error mode"


@scenario
def uneven(rank: int, world: int) -> dict[str, Any]:
    """v-ops with exact (ragged) outputs on real ranks == simulate's capacity-padded rows; ragged
    a2a; MoE; check mode."""
    mesh = from_torch(tp=world)
    seed = int(os.environ.get("FASTDIST_TEST_SEED", "0"))
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 4, (world,), generator=g).tolist()  # uneven, zeros included
    sizes[seed % world] = max(sizes[seed % world], 1)  # at least one row somewhere
    total, m = sum(sizes), max(sizes)

    def both(
        sim_fn: Callable[..., torch.Tensor],
        real_fn: Callable[..., torch.Tensor],
        xs: torch.Tensor,
        rows: Callable[[int], int],
    ) -> None:
        sim_x = xs.clone().requires_grad_()
        sim_out = fd.simulate(sim_fn, mesh)(sim_x)
        c = torch.randn(sim_out.shape, dtype=torch.float64, generator=g)
        (sim_out * c).sum().backward()
        x = xs[rank].clone().requires_grad_()
        out = real_fn(x)
        k = rows(rank)
        assert out.shape[0] == k, (out.shape, k)
        close(out, sim_out[rank, :k].detach(), f"value on rank {rank}")
        (out * c[rank, :k]).sum().backward()
        close(x.grad, sim_x.grad[rank], f"grad on rank {rank}")

    # padding rows past each size
    xs = torch.randn(world, m + 1, 3, dtype=torch.float64, generator=g)
    both(
        lambda x: fd.all_gather_v(x, mesh, "tp", sizes),
        lambda x: fd.all_gather_v(x, mesh, "tp", sizes),
        xs,
        lambda r: total,
    )
    xt = torch.randn(world, total, 3, dtype=torch.float64, generator=g)
    both(
        lambda x: fd.reduce_scatter_v(x, mesh, "tp", sizes, capacity=m),
        lambda x: fd.reduce_scatter_v(x, mesh, "tp", sizes),
        xt,
        lambda r: sizes[r],
    )
    both(
        lambda x: fd.gather_v(x, mesh, "tp", sizes, dst=0, capacity=total),
        lambda x: fd.gather_v(x, mesh, "tp", sizes, dst=0),
        xs,
        lambda r: total if r == 0 else 0,
    )
    both(
        lambda x: fd.scatter_v(x, mesh, "tp", sizes, src=1, capacity=m),
        lambda x: fd.scatter_v(x, mesh, "tp", sizes, src=1),
        xt,
        lambda r: sizes[r],
    )
    # the same per-rank code with capacity on both backends
    both(
        lambda x: fd.scatter_v(x, mesh, "tp", sizes, src=1, capacity=m),
        lambda x: fd.scatter_v(x, mesh, "tp", sizes, src=1, capacity=m),
        xt,
        lambda r: m,
    )
    send = torch.randint(0, 3, (world, world), generator=g)
    cap = int(send.sum(0).max())
    xr = torch.randn(world, int(send.sum(1).max()) + 1, 2, dtype=torch.float64, generator=g)
    both(
        lambda x: fd.ragged_all_to_all(
            x, mesh, "tp", send[fd.axis_index(mesh, "tp")], capacity=cap
        )[0],
        lambda x: fd.ragged_all_to_all(x, mesh, "tp", send[rank], capacity=cap)[0],
        xr,
        lambda r: cap,
    )
    assert fd.exchange_sizes(sizes[rank], mesh, "tp").tolist() == sizes

    from tests.test_uneven import moe_per_rank, moe_single_device

    T, D, H = 3, 4, 3
    x, router = (
        torch.randn(world * T, D, dtype=torch.float64, generator=g),
        torch.randn(D, world, dtype=torch.float64, generator=g) * 2,
    )
    w1, w2 = (
        torch.randn(world, D, H, dtype=torch.float64, generator=g),
        torch.randn(world, H, D, dtype=torch.float64, generator=g),
    )
    ref = [t.clone().requires_grad_() for t in (x, router, w1, w2)]
    want = moe_single_device(*ref)
    c = torch.randn(want.shape, dtype=torch.float64, generator=g)
    (want * c).sum().backward()
    mine = [
        x[rank * T : (rank + 1) * T].clone().requires_grad_(),
        router.clone().requires_grad_(),
        w1[rank].clone().requires_grad_(),
        w2[rank].clone().requires_grad_(),
    ]
    out = moe_per_rank(*mine, mesh, "tp")
    close(out, want[rank * T : (rank + 1) * T].detach(), "MoE output")
    (out * c[rank * T : (rank + 1) * T]).sum().backward()
    close(mine[0].grad, ref[0].grad[rank * T : (rank + 1) * T], "MoE dx")
    close(mine[1].grad, ref[1].grad, "MoE d router")
    close(mine[2].grad, ref[2].grad[rank], "MoE d w1")

    checked = from_torch(tp=world, check=True, timeout=30)
    try:
        fd.all_gather_v(torch.zeros(3, 1), checked, "tp", [1] * (world - 1) + [1 + (rank == 0)])
    except fd.ConsistencyError as e:
        return {"check": str(e)}
    return {"check": None}


# ============================================================================ meshes side by side,
# DeviceMesh
@scenario
def two_meshes(rank: int, world: int) -> str:
    big = fd.connect(tp=world)  # a TP=world model
    draft = fd.connect(tp=1)  # a TP=1 draft model: {"dp": world, "tp": 1}
    x = torch.tensor([float(rank + 1)])
    total = world * (world + 1) / 2
    assert fd.psum(x, big, "tp").item() == total
    assert fd.psum(x, draft, "tp").item() == rank + 1  # a group of one: no communication
    assert fd.psum(x, draft, "dp").item() == total
    assert fd.all_gather(x, big, "tp").tolist() == [float(r + 1) for r in range(world)]
    assert big._comm is not draft._comm
    return "ok"


@scenario
def device_mesh(rank: int, world: int) -> str:
    mesh = fd.connect(tp=2)
    dm = fd.comm.to_device_mesh(mesh, "cpu")
    assert dm.mesh_dim_names == ("dp", "tp") and tuple(dm.mesh.shape) == (world // 2, 2)
    back = fd.comm.from_device_mesh(dm)
    # same axes, another communicator: not the same value (a real mesh equals only meshes sharing
    # its groups)
    assert (
        back.shape == mesh.shape
        and back != mesh
        and back != fd.Mesh(dict(mesh.shape))
        and back == back
    )
    x = torch.tensor([float(rank)])
    close(fd.psum(x, back, "tp"), fd.psum(x, mesh, "tp"), "psum over the DeviceMesh's group")
    assert back._comm._groups[(back._comm.axis((1,)).ranks, "gloo")] is dm.get_group("tp")
    return "ok"


# ============================================================================ faults
def _timed_failing_psum(mesh: fd.Mesh) -> dict[str, Any]:
    """A psum that a peer will not join: which error, its message, and how long it took."""
    t0 = time.monotonic()
    try:
        fd.psum(torch.ones(1), mesh, "tp")
    except fd.CommError as e:  # CollectiveTimeout is a CommError
        return {"type": type(e).__name__, "msg": str(e), "elapsed": time.monotonic() - t0}
    return {"type": None}


@scenario
def timeout(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 skips a collective: rank 0 must raise CollectiveTimeout within the timeout."""
    mesh = fd.connect(tp=world, timeout=3)
    fd.psum(torch.ones(1), mesh, "tp")  # creates the group
    if rank == 1:
        time.sleep(8)
        return {"skipped": True}
    return _timed_failing_psum(mesh)


@scenario
def peer_exits(rank: int, world: int) -> dict[str, Any]:
    """The last rank exits: the others raise (CommError or CollectiveTimeout), none hangs."""
    mesh = fd.connect(tp=world, timeout=15)
    fd.psum(torch.ones(1), mesh, "tp")
    if rank == world - 1:
        os._exit(3)
    return _timed_failing_psum(mesh)


@scenario
def check_mode(rank: int, world: int) -> dict[str, Any]:
    mesh = fd.connect(tp=world, check=True, timeout=30)  # consistent calls pass
    assert fd.psum(torch.ones(2), mesh, "tp").tolist() == [float(world)] * 2
    try:
        fd.all_gather(torch.ones(2 + rank), mesh, "tp")
    except fd.ConsistencyError as e:
        return {"msg": str(e)}
    return {"msg": None}


@scenario
def barrier_timeout(rank: int, world: int) -> dict[str, Any]:
    mesh = fd.connect(tp=world, timeout=30)
    fd.comm.barrier(mesh)  # everyone arrives
    if rank == world - 1:
        time.sleep(6)
        return {"skipped": True}
    t0 = time.monotonic()
    try:
        fd.comm.barrier(mesh, "tp", timeout=2)
    except fd.CollectiveTimeout as e:
        return {"msg": str(e), "elapsed": time.monotonic() - t0}
    return {"msg": None}


@scenario
def subset_first(rank: int, world: int) -> dict[str, Any]:
    """Ranks first touch the mesh's axes in different orders (some ranks before the others): no
    deadlock, right values."""
    # a generous timeout: creating a gloo group on a loaded 2-core machine took over 5 s in CI;
    # a rank that waited for a group its peers never make would still fail at the timeout
    mesh = fd.connect(tp=2, timeout=60)
    twin = fd.connect(tp=2, timeout=60)  # the same shape: its own groups
    x = torch.tensor([float(rank + 1)])
    t0 = time.monotonic()
    if rank < 2:  # ranks 0 and 1 use "tp" while ranks 2 and 3 have made no group yet
        assert fd.psum(x, mesh, "tp").item() == 3.0
    assert fd.psum(x, mesh, ("dp", "tp")).item() == 10.0  # then every rank
    if rank >= 2:
        assert fd.all_gather(x, twin, "tp").tolist() == [3.0, 4.0]
    assert fd.psum(x, twin, ("tp", "dp")).item() == 10.0
    assert fd.psum(x, mesh, "dp").item() == [4.0, 6.0][rank % 2]
    if rank >= 2:
        assert fd.psum(x, mesh, "tp").item() == 7.0
    else:
        assert fd.all_gather(x, twin, "tp").tolist() == [1.0, 2.0]
    elapsed = time.monotonic() - t0
    whole = (0, 1, 2, 3)
    names = [
        str(mesh._comm._groups[whole, "gloo"].group_name),
        str(twin._comm._groups[(0, 2, 1, 3), "gloo"].group_name),
    ]
    try:
        fd.psum(torch.ones(2, device="meta"), mesh, "tp")
        meta = None
    except fd.NoBackendError as e:
        meta = str(e)
    # rank 0 hosts the store: it must not exit while the others still make groups
    fd.comm.barrier(mesh)
    return {"elapsed": elapsed, "names": names, "meta": meta}


@scenario
def recover(rank: int, world: int) -> dict[str, Any]:
    """One rank fails before a collective its peer waits in; both reset the mesh and go on. Bad
    ragged sizes raise everywhere."""
    mesh = fd.connect(tp=world, timeout=2)
    x = torch.ones(4)
    assert fd.psum(x, mesh, "tp").tolist() == [2.0] * 4
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    # rank 0's shard has 3 rows, not divisible by 2: it raises at once; rank 1 waits in the
    # collective
    try:
        fd.psum_scatter(torch.ones(3 if rank == 0 else 4), mesh, "tp")
    except fd.FastdistError as e:
        out["failure"] = (type(e).__name__, str(e), time.monotonic() - t0)
    t0 = time.monotonic()
    fd.comm.reset(mesh)  # every rank: rank 0 waits here for rank 1
    out["reset"] = time.monotonic() - t0
    assert fd.psum(x * (rank + 1), mesh, "tp").tolist() == [3.0] * 4  # the mesh works again
    t0 = time.monotonic()
    # rank 0 sends 5 rows from 2: every rank raises the same error at once, and the mesh stays
    # usable
    try:
        fd.ragged_all_to_all(
            torch.ones(2, 1),
            mesh,
            "tp",
            torch.tensor([2, 3]) if rank == 0 else torch.tensor([1, 1]),
            capacity=8,
        )
    except fd.CollectiveError as e:
        out["ragged"] = (str(e), time.monotonic() - t0)
    got, recv = fd.ragged_all_to_all(
        torch.full((2, 1), float(rank)), mesh, "tp", torch.tensor([1, 1]), capacity=3
    )
    assert recv.tolist() == [1, 1] and got.flatten().tolist() == [0.0, 1.0, 0.0]
    sim = fd.Mesh({"ep": 2})
    try:  # simulated ranks name the axis too
        fd.simulate(lambda t, s: fd.ragged_all_to_all(t, sim, "ep", s, capacity=4)[0], sim)(
            torch.ones(2, 2, 1), torch.tensor([[0, -1], [0, 0]])
        )
    except fd.CollectiveError as e:
        out["simulated"] = str(e)
    return out


@scenario
def stateless_host_exits(rank: int, world: int) -> dict[str, Any]:
    """The process hosting a StatelessGroup's store exits: the others learn that the connection
    closed, at once."""
    g = fd.comm.StatelessGroup.create(
        "127.0.0.1", int(os.environ["FASTDIST_TEST_STORE_PORT"]), rank, world, timeout=20
    )
    g.barrier()
    if rank == 0:
        time.sleep(0.3)
        os._exit(0)
    time.sleep(1.0)
    out = {}
    for name, call in (("recv", lambda: g.recv_obj(src=0)), ("send", lambda: g.send_obj(1, dst=0))):
        t0 = time.monotonic()
        try:
            call()
        except fd.CommError as e:
            out[name] = (type(e).__name__, str(e), time.monotonic() - t0)
    return out


# ============================================================================ objects and point to
# point
@scenario
def objects(rank: int, world: int) -> str:
    mesh = fd.connect(tp=world)
    assert fd.comm.broadcast_object({"from": rank}, mesh, "tp", src=1) == {"from": 1}
    assert fd.comm.all_gather_object(("r", rank), mesh) == [("r", r) for r in range(world)]
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    # even ranks send first, odd ranks receive first: no deadlock for any world size
    if rank % 2 == 0:
        fd.comm.send_object([rank] * 3, mesh, "tp", dst=nxt)
        got = fd.comm.recv_object(mesh, "tp", src=prv)
    else:
        got = fd.comm.recv_object(mesh, "tp", src=prv)
        fd.comm.send_object([rank] * 3, mesh, "tp", dst=nxt)
    assert got == [prv] * 3
    d = {"x": torch.arange(6.0).reshape(2, 3) + rank, "ids": torch.tensor([rank]), "step": 7}
    got_d = fd.comm.broadcast_tensor_dict(d if rank == 0 else None, mesh, "tp", src=0)
    assert (
        got_d["step"] == 7
        and torch.equal(got_d["x"], torch.arange(6.0).reshape(2, 3))
        and got_d["ids"].tolist() == [0]
    )
    if rank == 0:
        fd.comm.send_tensor_dict(
            {"a": torch.ones(4, dtype=torch.int32), "note": "hi"}, mesh, "tp", dst=1
        )
        fd.comm.send(torch.full((2, 2), 5.0), mesh, "tp", dst=1)
    elif rank == 1:
        td = fd.comm.recv_tensor_dict(mesh, "tp", src=0)
        assert td["note"] == "hi" and td["a"].dtype == torch.int32 and td["a"].tolist() == [1] * 4
        assert fd.comm.recv(torch.empty(2, 2), mesh, "tp", src=0).tolist() == [[5.0, 5.0]] * 2
    fd.comm.barrier(mesh)
    return "ok"


@scenario
def stateless(rank: int, world: int) -> dict[str, Any]:
    port = int(os.environ["FASTDIST_TEST_STORE_PORT"])
    g = fd.comm.StatelessGroup.create(
        "127.0.0.1", port, rank, world, timeout=20
    )  # the default data_expiration (an hour): a slow rank under load still finds every key
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for i in range(3):
        g.send_obj((rank, i), dst=nxt)
    got = [g.recv_obj(src=prv) for _ in range(3)]
    assert got == [(prv, i) for i in range(3)], got
    assert g.broadcast_obj({"cfg": 1} if rank == 2 else None, src=2) == {"cfg": 1}
    assert g.all_gather_obj(rank * 10) == [r * 10 for r in range(world)]
    g.barrier()
    time.sleep(0.6)
    expired = g.expire(older_than=0.5)  # this rank's keys older than 0.5 s are deleted
    g.barrier()  # every member has expired its keys
    gone = not g.store.check([f"p2p/{prv}->{rank}/0"])
    # fresh counters: waits for an expired key
    late = fd.comm.StatelessGroup(g.store, rank, world, timeout=1.0)
    t0 = time.monotonic()
    try:
        late.recv_obj(src=prv)
    except fd.CollectiveTimeout as e:
        msg, elapsed = str(e), time.monotonic() - t0
    else:
        msg, elapsed = None, 0.0
    g.barrier()  # every rank's wait has timed out
    # the store's host (rank 0) exits last: a barrier is not enough (rank 0 may leave it while
    # a slower rank still reads the last keys), so every other rank says when it is done
    if rank:
        g.send_obj("done", dst=0)
    else:
        assert [g.recv_obj(src=r) for r in range(1, world)] == ["done"] * (world - 1)
    return {"expired": expired, "gone": gone, "timeout_msg": msg, "elapsed": elapsed}


# ============================================================================ ctypes backend (fake
# library)
@scenario
def native(rank: int, world: int) -> dict[str, Any]:
    """ops and uneven on the ctypes backend named by the parent, then what the library was asked to
    do."""
    from fastdist.comm.native import fake

    lib = os.environ["FASTDIST_TEST_LIBRARY"]
    checks = ops(rank, world)
    fake.clear_log(lib)
    mesh = from_torch(tp=world)
    fd.comm.create_groups(mesh, device_type="cpu")  # the communicator exists before the first op
    after_create = fake.call_log(lib)
    fake.clear_log(lib)
    x = torch.arange(6.0).reshape(3, 2) + rank
    close(
        fd.psum(x, mesh, "tp"),
        sum(torch.arange(6.0).reshape(3, 2) + r for r in range(world)),
        "psum",
    )
    psum_calls = fake.call_log(lib)
    fake.clear_log(lib)
    sizes = [r % 3 + 1 for r in range(world)]
    got = fd.all_gather_v(torch.full((sizes[rank], 2), float(rank)), mesh, "tp", sizes)
    close(
        got, torch.cat([torch.full((s, 2), float(r)) for r, s in enumerate(sizes)]), "all_gather_v"
    )
    agv_calls = fake.call_log(lib)
    f8 = (torch.arange(4.0) + rank).to(torch.float8_e4m3fn)
    fake.clear_log(lib)
    g8 = fd.all_gather(f8, mesh, "tp", tiled=True)
    close(
        g8.float(),
        torch.cat([torch.arange(4.0) + r for r in range(world)]).to(torch.float8_e4m3fn).float(),
        "fp8 all_gather",
    )
    fp8_calls = fake.call_log(lib)
    try:
        torch.compile(lambda t: fd.psum(t, mesh, "tp"), fullgraph=True)(x)
        compiled_error = None
    except Exception as e:  # noqa: BLE001 - the test checks what it says
        compiled_error = f"{type(e).__name__}: {e}"
    uneven_result = uneven(rank, world)
    return {
        "compiled_error": compiled_error,
        "checks": checks,
        "after_create": after_create,
        "psum": psum_calls,
        "agv": agv_calls,
        "fp8": fp8_calls,
        "check": uneven_result["check"],
        "closed": fd.comm.close(mesh, timeout=5.0),
        "backend": mesh.backend,
    }


@scenario
def native_exchange(rank: int, world: int) -> dict[str, Any]:
    """The unique id travels over the axis's gloo group, and over a StatelessGroup; communicators
    work."""
    from fastdist.comm.native import (
        NativeCommunicator,
        exchange_over_group,
        exchange_over_stateless,
        load_library,
    )

    lib = load_library("nccl", os.environ["FASTDIST_TEST_LIBRARY"])
    mesh = fd.connect(tp=world)
    ac = mesh._comm.axis(mesh.axis_indices("tp", "test"))
    seen: list[bytes] = []

    def spy(data: bytes | None) -> bytes:
        got = exchange_over_group(ac.cpu_group("test"))(data)
        seen.append(got)
        return got

    comm = NativeCommunicator.create(
        lib, n=world, index=rank, exchange=spy, label="tp", ranks=ac.ranks, rank=rank
    )
    ids = fd.comm.all_gather_object(seen[0], mesh)
    total = comm.all_reduce("psum", torch.tensor([float(rank)]), "sum").item()
    comm.close()
    sg = fd.comm.StatelessGroup.create(
        "127.0.0.1", int(os.environ["FASTDIST_TEST_STORE_PORT"]), rank, world, timeout=30
    )
    comm2 = NativeCommunicator.create(
        lib, n=world, index=rank, exchange=exchange_over_stateless(sg), label="tp", rank=rank
    )
    stateless_sum = comm2.all_reduce("psum", torch.ones(1, dtype=torch.int64), "sum").item()
    comm2.close()
    return {
        "same_id": len(set(ids)) == 1 and len(ids[0]) == 128,
        "sum": total,
        "stateless_sum": stateless_sum,
    }


# ============================================================================ entry point
def main(argv: list[str]) -> None:
    name, rank, world, port, outdir = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    torch.set_num_threads(1)
    if not name.startswith("stateless"):
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
    result = SCENARIOS[name](rank, world)
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown: fault scenarios leave peers gone


if __name__ == "__main__":
    main(sys.argv[1:])
