"""Real-rank reliability scenarios (issue 20): ``python -m tests.reliability_worker SCENARIO RANK
WORLD PORT OUTDIR``.

The scenarios join tests/dist_worker.py's table and run through its entry point (launched by
``tests.dist_harness.run_world(..., module="tests.reliability_worker")``). Each records what every
failure said and how long it took, so that the parent test can tell a prompt error from one that
waited for the mesh's timeout.
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import distributed_c10d as c10d

import fastdist as fd
from fastdist import P
from tests.dist_worker import close, main, scenario


def timed(
    call: Callable[[], Any], *errors: type[BaseException]
) -> tuple[str | None, str | None, float]:
    """``(error type, message, seconds)`` of a call expected to raise one of ``errors``; ``(None,
    None, seconds)`` if it returned."""
    t0 = time.monotonic()
    try:
        call()
    except errors as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, None, time.monotonic() - t0


def meet(name: str, world: int, timeout: float = 60.0) -> None:
    """Wait (outside any mesh) until every rank got here: a rank that failed early stays alive, in
    no collective."""
    store = c10d._get_default_store()
    store.set(f"reliability/{name}/{c10d.get_rank()}", "1")
    store.wait(
        [f"reliability/{name}/{r}" for r in range(world)], datetime.timedelta(seconds=timeout)
    )


# ============================================================================ point 2: failures,
# promptly
@scenario
def reliability(rank: int, world: int) -> dict[str, Any]:
    """A rank's invalid input: its peers learn promptly when its error path drops the groups (mesh
    timeout 20 s), every rank at once in check mode, and, when the failing rank stays alive, at the
    timeout with an error naming it (not a bare timeout)."""
    out: dict[str, Any] = {}
    mesh = fd.connect(tp=world, timeout=20)
    x = torch.ones(4)
    assert fd.psum(x, mesh, "tp").tolist() == [2.0] * 4
    # rank 0's shard has 3 rows, not divisible by 2: it raises at once and resets (its error path);
    # rank 1 waits in the collective
    out["failure"] = timed(
        lambda: fd.psum_scatter(torch.ones(3 if rank == 0 else 4), mesh, "tp"), fd.FastdistError
    )
    t0 = time.monotonic()
    fd.comm.reset(mesh)  # every rank: rank 0 waits here for rank 1
    out["reset"] = time.monotonic() - t0
    assert fd.psum(x * (rank + 1), mesh, "tp").tolist() == [3.0] * 4  # the mesh works again
    # rank 0 sends 5 rows from 2: every rank raises the same error at once, and the mesh stays
    # usable
    sizes = torch.tensor([2, 3]) if rank == 0 else torch.tensor([1, 1])
    out["ragged"] = timed(
        lambda: fd.ragged_all_to_all(torch.ones(2, 1), mesh, "tp", sizes, capacity=8),
        fd.CollectiveError,
    )
    got, recv = fd.ragged_all_to_all(
        torch.full((2, 1), float(rank)), mesh, "tp", torch.tensor([1, 1]), capacity=3
    )
    assert recv.tolist() == [1, 1] and got.flatten().tolist() == [0.0, 1.0, 0.0]
    # rank 1's index alone is bad: every rank raises the same error at once (checked with the
    # exchange's sizes), naming rank 1 and the op called; the mesh stays usable
    index = torch.tensor([0, 7]) if rank == 1 else torch.tensor([1, 0])
    out["indexed"] = timed(
        lambda: fd.indexed_all_to_all_v(
            torch.ones(2, 1), mesh, "tp", index, torch.tensor([1, 1]), capacity=4
        ),
        fd.CollectiveError,
    )
    rows = torch.tensor([[10.0 * rank], [10.0 * rank + 1]])  # rank r: rows 10r, 10r + 1
    # each rank sends x[1] to index 0 and x[0] to index 1
    got, _ = fd.indexed_all_to_all_v(
        rows, mesh, "tp", torch.tensor([1, 0]), torch.tensor([1, 1]), capacity=2
    )
    out["indexed_ok"] = got.flatten().tolist()
    sim = fd.Mesh({"ep": 2})  # simulated ranks name the axis too
    out["simulated"] = timed(
        lambda: fd.simulate(lambda t, s: fd.ragged_all_to_all(t, sim, "ep", s, capacity=4)[0], sim)(
            torch.ones(2, 2, 1), torch.tensor([[0, -1], [0, 0]])
        ),
        fd.CollectiveError,
    )[1]

    # check mode: the ranks pass different shapes; every rank raises what each passed, long before
    # the 20 s timeout
    checked = fd.connect(tp=world, check=True, timeout=20)
    # consistent calls pass
    assert fd.psum(torch.ones(2), checked, "tp").tolist() == [float(world)] * 2
    out["check"] = timed(
        lambda: fd.all_gather(torch.ones(2 + rank), checked, "tp"), fd.ConsistencyError
    )
    # nobody is left in a collective
    assert fd.psum(torch.ones(2), checked, "tp").tolist() == [float(world)] * 2

    # default mode, the failing rank stays alive (no reset, no exit): its peer times out, told which
    # rank did not come
    slow = fd.connect(tp=world, timeout=2)
    assert fd.psum(torch.ones(1), slow, "tp").item() == world
    out["alive"] = timed(
        lambda: fd.exchange_sizes(2.5 if rank == 0 else 3, slow, "tp"), fd.FastdistError
    )
    meet("alive", world)
    fd.comm.reset(slow)
    assert fd.exchange_sizes(rank + 1, slow, "tp").tolist() == list(range(1, world + 1))

    # close releases the mesh's groups now: a later call says the mesh was closed; reset reopens
    made = len(slow._comm._created)
    assert fd.comm.close(slow) and made > 0 and not slow._comm._created
    out["closed"] = timed(lambda: fd.psum(torch.ones(1), slow, "tp"), fd.CommError)
    fd.comm.reset(slow)
    out["reopened"] = fd.psum(torch.ones(1), slow, "tp").item()
    return out


# ============================================================================ points 3 and 8:
# torch.compile on real ranks
@scenario
def compiled_timed(rank: int, world: int) -> dict[str, Any]:
    """Compile before any group exists (the groups are made while dynamo traces), timed; an spmd
    step compiled with check=False (one graph, equal to eager and to one device); check='insert'
    under fullgraph raises fastdist's message on every rank, at once."""
    from torch._dynamo.utils import counters

    out: dict[str, Any] = {}
    # no eager call, no create_groups; a wait for a group would show against 120 s
    late = fd.connect(tp=world, timeout=120)
    f = torch.compile(
        lambda t: fd.psum(t, late, "tp") * fd.all_gather(t, late, "tp").sum(),
        fullgraph=True,
        backend="aot_eager",
    )
    t0 = time.monotonic()
    value = f(torch.tensor([float(rank)])).item()
    out["late"] = (
        value,
        time.monotonic() - t0,
        sorted(str(pg.group_name) for pg in late._comm._groups.values()),
    )

    mesh = fd.connect(tp=world, timeout=60)  # {"dp": 1, "tp": world}

    def written(
        x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b: torch.Tensor
    ) -> torch.Tensor:  # the pvarys check="error" asks for
        x, b = fd.pvary(x, mesh, "tp"), fd.pvary(b, mesh, "dp")
        w1, w2 = fd.pvary(w1, mesh, "dp"), fd.pvary(w2, mesh, "dp")
        return fd.psum(torch.tanh(x @ w1) @ w2, mesh, "tp") + b

    def bare(
        x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b: torch.Tensor
    ) -> torch.Tensor:  # relies on check="insert"
        return fd.psum(torch.tanh(x @ w1) @ w2, mesh, "tp") + b

    specs: dict[str, Any] = {
        "in_specs": (P("dp"), P(None, "tp"), P("tp", None), P()),
        "out_specs": P("dp"),
    }
    g = torch.Generator().manual_seed(0)
    args = [
        torch.randn(*s, generator=g, dtype=torch.float64) for s in ((4, 4), (4, 6), (6, 4), (4,))
    ]
    c = torch.arange(16.0, dtype=torch.float64).reshape(4, 4)

    def run(fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        leaves = [a.clone().requires_grad_() for a in args]
        y = fn(*leaves)
        (y * c).sum().backward()
        return y.detach(), [leaf.grad for leaf in leaves]

    ref = [a.clone().requires_grad_() for a in args]  # one device
    want = torch.tanh(ref[0] @ ref[1]) @ ref[2] + ref[3]
    (want * c).sum().backward()
    # eager, checked (real ranks default to check=False)
    eager_out, eager_grads = run(fd.spmd(bare, mesh, check="insert", **specs))

    graphs: list[Any] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(
        fd.spmd(written, mesh, check=False, **specs), fullgraph=True, backend=counting
    )
    t0 = time.monotonic()
    comp_out, comp_grads = run(step)
    again, _ = run(step)  # no recompilation
    out["spmd_compile_s"] = time.monotonic() - t0
    out["graphs"], out["graph_breaks"] = len(graphs), sum(counters["graph_break"].values())
    for got, e, w, name in zip(
        [comp_out, *comp_grads],
        [eager_out, *eager_grads],
        [want.detach(), *(r.grad for r in ref)],
        ["out", "x", "w1", "w2", "b"],
    ):
        close(got, e, f"compiled spmd {name} vs eager on rank {rank}")
        close(got, w, f"compiled spmd {name} vs one device on rank {rank}")
    close(again, comp_out, "second compiled call")

    torch._dynamo.reset()
    out["insert"] = timed(
        lambda: torch.compile(
            fd.spmd(bare, mesh, check="insert", **specs), fullgraph=True, backend="aot_eager"
        )(*args),
        Exception,
    )
    assert fd.psum(torch.ones(1), mesh, "tp").item() == world  # nobody was left in a collective
    return out


# ============================================================================ issue 32: argument
# errors, compiled steps, check mode, mesh construction order
@scenario
def issue32(rank: int, world: int) -> dict[str, Any]:
    """Two ranks: a wrong world size; send/recv to this rank's own index (refused before any
    communication, the mesh stays usable); a compiled step that a peer skips, under comm_guard,
    then reset and a next compiled call; check mode seeing a skipped call of the same op and
    shape; meshes of one shape built in different orders."""
    out: dict[str, Any] = {}
    out["world"] = timed(lambda: fd.connect(tp=3), fd.MeshError)
    out["world_dp"] = timed(lambda: fd.connect(dp=3), fd.MeshError)
    mesh = fd.connect(tp=world, timeout=3)
    out["with_timeout"] = timed(lambda: fd.comm.with_timeout(mesh, 0), fd.MeshError)
    x = torch.ones(2)
    assert fd.psum(x, mesh, "tp").tolist() == [2.0, 2.0]
    errors = (fd.CommArgumentError,)
    out["send_self"] = timed(lambda: fd.comm.send(x, mesh, "tp", rank), *errors)
    out["recv_self"] = timed(lambda: fd.comm.recv(x, mesh, "tp", rank), *errors)
    out["send_object_self"] = timed(lambda: fd.comm.send_object(1, mesh, "tp", rank), *errors)
    out["send_dict_self"] = timed(
        lambda: fd.comm.send_tensor_dict({"x": x}, mesh, "tp", rank), *errors
    )
    out["dst7"] = timed(lambda: fd.comm.send(x, mesh, "tp", 7), *errors)
    # no group was dropped: the mesh works without a reset, point to point included
    assert fd.psum(x * (rank + 1), mesh, "tp").tolist() == [3.0, 3.0]
    if rank == 0:
        fd.comm.send(x * 5, mesh, "tp", 1)
    else:
        out["p2p"] = fd.comm.recv(x, mesh, "tp", 0).tolist()

    # a compiled step under comm_guard: rank 1 skips a call, rank 0 gets fastdist's timeout
    step = fd.comm.comm_guard(mesh)(
        torch.compile(lambda t: fd.psum(t, mesh, "tp") * 2, fullgraph=True, backend="aot_eager")
    )
    assert step(torch.full((2,), rank + 1.0)).tolist() == [6.0, 6.0]
    if rank == 0:
        out["compiled"] = timed(lambda: step(torch.ones(2)), fd.FastdistError)
        try:
            fd.psum(x, mesh, "tp")  # the groups were dropped: later calls fail at once
        except fd.CommError as e:
            out["after_failure"] = str(e)
    meet("compiled", world)
    fd.comm.reset(mesh)
    out["recovered"] = step(torch.full((2,), rank + 1.0)).tolist()
    # an error from the model itself passes through unchanged, and leaves the mesh alone

    def model_error() -> None:
        with fd.comm.comm_guard(mesh):
            torch.ones(2, 3) @ torch.ones(2, 3)

    out["model_error"] = timed(model_error, RuntimeError)
    assert fd.psum(x, mesh, "tp").tolist() == [2.0, 2.0]

    # check mode: rank 1 skips the middle psum (same op, same shape as the next one)
    checked = fd.connect(tp=world, check=True, timeout=20)

    def program() -> None:
        fd.psum(torch.ones(2), checked, "tp")
        if rank == 0:
            fd.psum(torch.ones(2), checked, "tp")  # rank 1 skips this one
        fd.psum(torch.ones(2), checked, "tp")

    out["skip"] = timed(program, fd.ConsistencyError)
    # nobody entered the collective: the mesh is still in step
    assert fd.psum(torch.ones(2) * (rank + 1), checked, "tp").tolist() == [3.0, 3.0]

    # two meshes of one shape, built in different orders on the two ranks
    if rank == 0:
        a, _ = fd.connect(tp=world, timeout=3), fd.connect(tp=world, timeout=4)
    else:
        _, a = fd.connect(tp=world, timeout=4), fd.connect(tp=world, timeout=3)
    out["order"] = timed(lambda: fd.psum(torch.ones(1), a, "tp"), fd.FastdistError)
    # the same, compiled: the group is created while dynamo traces, and the error it raises there
    # (wrapped by torch.compile) comes out of comm_guard as itself
    if rank == 0:
        c, _ = fd.connect(tp=world, timeout=3), fd.connect(tp=world, timeout=4)
    else:
        _, c = fd.connect(tp=world, timeout=4), fd.connect(tp=world, timeout=3)
    compiled = fd.comm.comm_guard(c)(
        torch.compile(lambda t: fd.psum(t, c, "tp"), fullgraph=True, backend="aot_eager")
    )
    out["order_compiled"] = timed(lambda: compiled(torch.ones(1)), fd.FastdistError)
    return out


@scenario
def threads(rank: int, world: int) -> dict[str, Any]:
    """Issue 32.8 on real ranks: a second thread calling on a mesh while another thread is inside
    a call on it is refused at once (the mesh stays usable); two threads on two meshes run
    concurrently and get right values, their groups created at once in opposite orders on the
    two ranks."""
    import threading

    out: dict[str, Any] = {}
    store = c10d._get_default_store()
    mesh = fd.connect(tp=world, timeout=20)
    assert fd.psum(torch.ones(1), mesh, "tp").item() == world
    second: dict[str, Any] = {}

    def intruder() -> None:
        try:
            deadline = time.monotonic() + 60
            while mesh._comm.in_call is None and time.monotonic() < deadline:  # main's psum
                time.sleep(0.005)
            second["result"] = timed(lambda: fd.psum(torch.ones(1), mesh, "tp"), fd.CommError)
        finally:  # only now may the peer join main's psum: main stays inside it until here
            store.set("reliability/threads/intruded", "1")

    if rank == 0:
        helper = threading.Thread(target=intruder)
        helper.start()
    else:  # rank 0's psum waits for this rank meanwhile, however slowly its intruder runs
        store.wait(["reliability/threads/intruded"], datetime.timedelta(seconds=90))
    out["main"] = fd.psum(torch.full((1,), rank + 1.0), mesh, "tp").item()
    if rank == 0:
        helper.join()
        out["intruder"] = second["result"]
    assert fd.psum(torch.ones(1), mesh, "tp").item() == world  # still usable, no reset

    # two meshes, one per thread, built in the same order on every rank; each rank makes its
    # first call (which creates the mesh's group) on one mesh half a second before the other,
    # rank 0 on mesh 0 and rank 1 on mesh 1, so the creations overlap in opposite orders
    meshes = [fd.connect(tp=world, timeout=20) for _ in range(2)]
    got: dict[int, Any] = {}

    def loop(t: int) -> None:
        time.sleep(0.5 * ((t + rank) % 2))
        vals: list[Any] = []
        try:
            for i in range(20):
                x = torch.full((1,), float(100 * t + 10 * i + rank))
                vals.append(fd.psum(x, meshes[t], "tp").item())
        except fd.FastdistError as e:  # shown in the parent's diff, not only in this log
            vals.append(f"{type(e).__name__}: {e}")
        got[t] = vals

    workers = [threading.Thread(target=loop, args=(t,)) for t in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    out["two_meshes"] = got
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
