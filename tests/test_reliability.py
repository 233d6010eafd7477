"""Issue 32's reliability points: argument errors of the point-to-point helpers, recovery of a
compiled step (fastdist.comm.comm_guard), check mode seeing a skipped call, mesh construction order,
and threads."""

from __future__ import annotations

import datetime
import re
from typing import Any

import pytest
import torch

import fastdist as fd

from .dist_harness import expect_ok, run_world


@pytest.fixture(scope="module")
def issue32() -> list[dict[str, Any]]:
    """tests/reliability_worker.py's "issue32" scenario on two gloo processes (mesh timeout 3 s)."""
    return expect_ok(run_world("issue32", 2, timeout=120, module="tests.reliability_worker"))


def test_point_to_point_to_own_index_is_an_argument_error(issue32: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(issue32):
        for key, op, name in [
            ("send_self", "send", "dst"),
            ("recv_self", "recv", "src"),
            ("send_object_self", "send_object", "dst"),
            ("send_dict_self", "send_tensor_dict", "dst"),
        ]:
            kind, msg, secs = out[key]
            assert kind == "CommArgumentError" and secs < 0.5, out[key]
            assert msg == (
                f"fastdist.{op}(axis='tp') on rank {rank} (group ranks [0, 1]): {name}={rank} is "
                "this rank's own index along the axis: a point-to-point call needs another rank. "
                f"Fix: use {name} in [{1 - rank}] (the other indices along the axis)"
            )
        assert out["dst7"][:2] == (
            "CommArgumentError",
            f"fastdist.send(axis='tp') on rank {rank} (group ranks [0, 1]): dst=7 is not an index "
            "along the axis (size 2). Fix: use dst in 0..1",
        )
    # the mesh stayed usable (no reset): the worker's psum and a send/recv after the errors
    assert issue32[1]["p2p"] == [5.0, 5.0]


def test_argument_errors_are_one_family() -> None:
    """A bad src/dst is a CollectiveError (a ValueError) for send (and StatelessGroup's messages)
    as for broadcast; CommArgumentError stays a CommError for older callers."""
    err = fd.CommArgumentError("send", "tp", [0, 1], 1, "dst=1 is this rank's own index", "x")
    assert isinstance(err, fd.CollectiveError) and isinstance(err, ValueError)
    assert isinstance(err, fd.CommError) and isinstance(err, fd.FastdistError)
    assert (err.op, err.axis, err.rank, err.ranks, err.fix) == ("send", "tp", "rank 1", (0, 1), "x")
    assert err.readdress(op="send_tensor_dict") is err and str(err).startswith(
        "fastdist.send_tensor_dict(axis='tp') on rank 1 (group ranks [0, 1]): dst=1"
    )
    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=5)
    )  # a port the OS picks
    group = fd.comm.StatelessGroup(store, 0, 2, timeout=0.3)
    with pytest.raises(fd.CommArgumentError, match=r"dst=0 is not another member"):
        group.send_obj(1, dst=0)
    with pytest.raises(fd.CommArgumentError, match=r"src=2 is not a member"):
        group.broadcast_obj(1, src=2)
    mesh = fd.Mesh({"tp": 2})
    with pytest.raises(fd.CollectiveError, match=r"src=2 is not an index along the axis"):
        fd.simulate(lambda x: fd.broadcast(x, mesh, "tp", src=2), mesh)(torch.ones(2, 1))


def test_compiled_step_timeout_is_a_fastdist_error_and_recovers(
    issue32: list[dict[str, Any]],
) -> None:
    r0, r1 = issue32
    kind, msg, secs = r0["compiled"]
    assert kind == "CollectiveTimeout" and 2.9 < secs < 3 + 3, (kind, secs)
    assert (
        msg.startswith(
            "fastdist.comm_guard(axis=('dp', 'tp')) on rank 0 (group ranks [0, 1]): a collective "
            "inside the guarded block (a compiled step) timed out: a peer did not arrive within "
            "the mesh's timeout (3 s): Timed out waiting 3000ms"
        )
        and "Fix: check that every rank makes the same collectives in the same order; call " in msg
    )
    assert "fastdist.comm.reset(mesh)" in msg and "third_party" not in msg
    # the groups were dropped, as eagerly: the next call says so at once
    assert (
        "process groups were dropped after an earlier failure (fastdist.comm_guard"
        in (r0["after_failure"])
    )
    # after fastdist.comm.reset(mesh) on both ranks the compiled step runs again:
    # psum([1, 2]) * 2 = 6
    assert r0["recovered"] == r1["recovered"] == [6.0, 6.0]
    # an error of the model itself is not taken for a communication failure
    for out in issue32:
        assert out["model_error"][:2] == (
            "RuntimeError",
            "mat1 and mat2 shapes cannot be multiplied (2x3 and 2x3)",
        )


def test_check_mode_sees_a_skipped_call_of_the_same_op_and_shape(
    issue32: list[dict[str, Any]],
) -> None:
    for rank, out in enumerate(issue32):
        kind, msg, secs = out["skip"]
        assert kind == "ConsistencyError" and secs < 5, out["skip"]
        assert msg.startswith(
            f"fastdist.psum(axis='tp') on rank {rank} (group ranks [0, 1]): the ranks disagree "
            "(the same call from different lines: a rank skipped or added a call before this one"
        )
        site = "psum(shapes=[(2,)], dtypes=['torch.float32'], params={}) at reliability_worker.py"
        assert f"rank 0: {site}:" in msg and f"rank 1: {site}:" in msg
        lines = [int(n) for n in re.findall(r"at reliability_worker\.py:(\d+)", msg)]
        assert lines[1] == lines[0] + 1  # rank 1 is at the next psum: it skipped one
        assert "Fix: make every rank of the group make the same calls in the same order" in msg


def test_meshes_built_in_different_orders_are_named(issue32: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(issue32):
        kind, msg, secs = out["order"]
        assert kind == "CollectiveTimeout" and secs < 3 + 3, out["order"]
        assert f"fastdist.psum(axis='tp') on rank {rank} (group ranks [0, 1])" in msg
        assert "creating the process group" in msg
        assert (
            "Fix: check that every rank builds its meshes of one shape in the same order "
            "(fastdist.connect, fastdist.comm.from_device_mesh and fastdist.comm.with_timeout "
            f"each count; this is mesh {2 + rank} of shape dp1_tp2 built on this rank" in msg
        )
        # compiled under comm_guard: the same error, not torch.compile's wrapper around it
        kind, msg, secs = out["order_compiled"]
        assert kind == "CollectiveTimeout" and secs < 3 + 3, out["order_compiled"]
        assert msg.startswith(
            f"fastdist.psum(axis='tp') on rank {rank} (group ranks [0, 1]): a peer did not arrive "
            "for creating the process group within the timeout (3 s)"
        )
        assert f"this is mesh {4 + rank} of shape dp1_tp2 built on this rank" in msg


def test_from_torch_world_size_names_from_torch_and_torchrun(
    issue32: list[dict[str, Any]],
) -> None:
    for out in issue32:
        assert out["world"][:2] == (
            "MeshError",
            "fastdist.connect: the job's world size 2 (torch.distributed) is not divisible by tp=3 "
            "(product 3). Fix: launch a multiple of 3 processes (torchrun --nproc-per-node 3; on "
            "several nodes, nodes x processes per node a multiple of 3), or choose degrees whose "
            "product divides 2",
        )
        assert out["with_timeout"][:2] == (
            "MeshError",
            "fastdist.comm.with_timeout: timeout must be positive seconds or a positive timedelta, "
            "got 0. Fix: pass timeout=<seconds> greater than 0 (e.g. timeout=60)",
        )
        assert out["world_dp"][:2] == (
            "MeshError",
            "fastdist.connect: dp=3 with no degrees gives 3 ranks, not the job's world size 2 "
            "(torch.distributed). Fix: launch 3 processes (torchrun --nproc-per-node 3; on several "
            "nodes, nodes x processes per node = 3), or leave dp out to infer it from the job's 2 "
            "ranks",
        )


# ---------------------------------------------------------------------------- threads (32.8)
def test_two_threads_simulate_the_same_mesh_at_once() -> None:
    """Both threads are inside ``simulate`` over one Mesh object at the same time (a barrier in the
    per-rank code proves it), with collectives, autograd, spmd's replication checking and
    simulate's SDPA batching; every value and gradient equals the single-device float64
    reference."""
    import threading

    mesh = fd.Mesh({"dp": 2, "tp": 2})
    f64 = torch.float64
    both_inside = threading.Barrier(2, timeout=30)

    def per_rank(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        both_inside.wait()  # traced once per call: both threads are in simulate now
        y = fd.all_gather(x @ w, mesh, "tp", dim=1)  # (rows, 4): x @ W, whole
        a = torch.nn.functional.scaled_dot_product_attention(y[None], y[None], y[None])[0]
        return fd.psum((a * y).sum(), mesh, "dp") + fd.axis_index(mesh, "tp")

    step = fd.simulate(per_rank, mesh)
    checked = fd.spmd(  # spmd's replication checking runs on simulated ranks
        lambda w, x: fd.all_gather_invariant(x @ w, mesh, "tp", dim=1),
        mesh,
        (fd.P(None, "tp"), fd.P()),
        fd.P(),
    )
    results: dict[int, Any] = {}

    def worker(t: int) -> None:
        g = torch.Generator().manual_seed(t)
        w_full = torch.randn(3, 4, dtype=f64, generator=g)
        x = torch.randn(5, 3, dtype=f64, generator=g)
        outs = []
        for _ in range(3):
            # rank (d, t) holds columns [2t, 2t + 2) of W
            w = torch.stack([w_full[:, 2 * (r % 2) : 2 * (r % 2) + 2] for r in range(4)])
            w.requires_grad_()
            if t == 0:
                out = step(w, x.expand(4, 5, 3))
            else:  # one vmap level deeper: a binding taken from the other thread would not fit
                out = torch.vmap(lambda d, w, x: step(w, x) + d, in_dims=(0, None, None))(
                    torch.zeros(1, dtype=f64), w, x.expand(4, 5, 3)
                )[0]
            out.sum().backward()
            wc = w_full.clone().requires_grad_()
            outs.append((out.detach(), w.grad, checked(wc, x), wc))
        results[t] = (w_full, x, outs)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(results) == [0, 1]
    for w_full, x, outs in results.values():
        ref_w = w_full.clone().requires_grad_()
        y = x @ ref_w
        a = torch.nn.functional.scaled_dot_product_attention(y[None], y[None], y[None])[0]
        s = (a * y).sum()
        want = torch.stack([2 * s.detach() + r % 2 for r in range(4)])  # psum over dp of s
        s.backward()
        # each rank's backward of its own loss: psum's backward gives this rank's own s the
        # cotangent, and rank (d, t)'s columns of W feed s on the two tp ranks of row d
        per_rank_cols = torch.stack(
            [2 * ref_w.grad[:, 2 * (r % 2) : 2 * (r % 2) + 2] for r in range(4)]
        )
        for out, grad, spmd_out, _ in outs:
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(grad, per_rank_cols, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(spmd_out, x @ w_full, rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def threads_on_gloo() -> list[dict[str, Any]]:
    return expect_ok(run_world("threads", 2, timeout=120, module="tests.reliability_worker"))


def test_a_second_thread_on_a_busy_real_mesh_is_refused(
    threads_on_gloo: list[dict[str, Any]],
) -> None:
    r0, r1 = threads_on_gloo
    assert r0["main"] == r1["main"] == 3.0  # the first thread's psum went on undisturbed
    kind, msg, secs = r0["intruder"]
    assert kind == "CommError" and secs < 0.5, r0["intruder"]
    assert msg.startswith("fastdist.psum(axis='tp') on rank 0 (group ranks [0, 1]): another thread")
    assert "is inside a call on this mesh" in msg and "nothing was sent" in msg
    assert "Fix: make the calls on a mesh from one thread at a time" in msg


def test_two_threads_on_two_real_meshes(threads_on_gloo: list[dict[str, Any]]) -> None:
    want = {t: [200.0 * t + 20 * i + 1 for i in range(20)] for t in range(2)}
    for out in threads_on_gloo:
        assert out["two_meshes"] == want
