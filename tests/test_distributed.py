"""Real ranks: gloo processes on this machine, compared with simulated ranks and one device."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import fastdist as fd
from fastdist.comm.axes import TorchAxisComm
from fastdist.comm.failures import comm_error
from fastdist.comm.transports import select_backend

from .dist_harness import ROOT, expect_ok, run_world


# ============================================================================ same values and
# gradients as simulate
@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_op_matches_simulate_on_gloo(world: int) -> None:
    counts = expect_ok(run_world("ops", world))
    assert len(set(counts)) == 1 and counts[0] > 40  # every rank ran every case


def test_tp_mlp_and_ulysses_end_to_end_on_gloo() -> None:
    assert expect_ok(run_world("models", 4)) == ["ok"] * 4


def test_compiled_step_on_gloo_equals_eager() -> None:
    """Issue 20.3 among others: a step compiled before any group exists (groups made while dynamo
    traces) works, in bounded time."""
    t0 = time.monotonic()
    assert expect_ok(run_world("compiled", 2, timeout=180)) == ["ok"] * 2
    # about 25 s: inductor compiles four steps (slower on a loaded machine)
    assert time.monotonic() - t0 < 120


def test_compile_before_groups_and_spmd_under_compile_on_gloo() -> None:
    """Issues 20.3 and 20.8 on two gloo processes, timed: a compiled step on a mesh with no groups
    yet (made while dynamo traces) runs well within the mesh's 120 s timeout; an spmd step with the
    pvarys written, check=False, compiles to one graph equal to the eager checked step and to one
    device; check='insert' under fullgraph raises fastdist's message at once."""
    for r, v in enumerate(
        expect_ok(run_world("compiled_timed", 2, timeout=240, module="tests.reliability_worker"))
    ):
        value, elapsed, names = v["late"]
        # psum(rank) * sum(all_gather(rank)) = 1 * 1
        assert value == 1.0 and names == ["fastdist.dp1_tp2.0.e0.0-1.gloo"], v["late"]
        # tracing, aot_eager and one group on each rank; any wait for a peer's group would show
        # against 120 s
        assert elapsed < 40, elapsed
        # one graph for two calls: no graph break, no recompilation
        assert v["graphs"] == 1 and v["graph_breaks"] == 0, v
        assert v["spmd_compile_s"] < 40, v["spmd_compile_s"]
        kind, msg, elapsed = v["insert"]
        assert msg is not None and "spmd: check='insert' runs eagerly only" in msg, (r, kind, msg)
        assert (
            "compiling the step unchecked would drop the pvary it inserts: wrong gradients" in msg
        )
        assert (
            "Fix: run the step once eagerly with check='error', write the pvary calls it names, "
            "and compile fd.spmd(..., check=False)" in msg
        )
        # every rank raises while tracing, before any collective: no rank waits for the other
        assert elapsed < 10, elapsed


def test_spmd_checked_mode_on_gloo() -> None:
    assert expect_ok(run_world("spmd_checked", 4)) == ["ok"] * 4


@pytest.mark.parametrize("world, seed", [(3, 0), (3, 1), (4, 2)])
def test_uneven_and_ragged_ops_on_gloo(world: int, seed: int) -> None:
    """Random uneven sizes (zeros included) per seed: every op on gloo equals simulate, values and
    gradients."""
    for r, value in enumerate(expect_ok(run_world("uneven", world, seed=seed))):
        assert (
            value["check"] is not None
            and f"fastdist.all_gather_v(axis='tp') on rank {r}" in value["check"]
        )
        odd, even = (1,) * (world - 1) + (2,), (1,) * world  # rank 0 passed different sizes
        assert (
            f"rank 0: all_gather_v(shapes=[(3, 1)], dtypes=['torch.float32'], params={{'sizes': "
            f"{odd}" in value["check"]
        )
        assert (
            f"rank 1: all_gather_v(shapes=[(3, 1)], dtypes=['torch.float32'], params={{'sizes': "
            f"{even}" in value["check"]
        )


def test_two_meshes_in_one_process() -> None:
    assert expect_ok(run_world("two_meshes", 4)) == ["ok"] * 4


def test_device_mesh_round_trip() -> None:
    assert expect_ok(run_world("device_mesh", 4)) == ["ok"] * 4


def test_object_helpers_and_point_to_point() -> None:
    assert expect_ok(run_world("objects", 3)) == ["ok"] * 3


# ============================================================================ faults: errors, never
# hangs
def test_skipped_collective_raises_timeout_naming_op_axis_ranks() -> None:
    r0, r1 = expect_ok(run_world("timeout", 2))
    assert r1 == {"skipped": True}
    assert r0["type"] == "CollectiveTimeout"
    assert (
        "fastdist.psum(axis='tp') on rank 0 (group ranks [0, 1])" in r0["msg"]
        and "within the timeout (3 s)" in r0["msg"]
    )
    # the cause, without gloo's source path
    assert "Timed out waiting 3000ms for recv operation to complete" in r0["msg"]
    assert "third_party" not in r0["msg"] and ".cc:" not in r0["msg"]
    assert (
        "rank 1 did not reach this call (call 2 on this group)" in r0["msg"]
        and "fastdist.comm.reset(mesh) on every rank" in r0["msg"]
    )
    # the 3 s timeout (+ 0.75 s for the peers' notes), plus margin for a loaded machine
    assert 2.5 < r0["elapsed"] < 3 + 10


def test_exited_peer_makes_the_others_raise() -> None:
    res = run_world("peer_exits", 3)
    assert res[2].returncode == 3  # the rank that left
    for r in res[:2]:
        assert r.returncode == 0, r.output
        assert r.value["type"] in ("CommError", "CollectiveTimeout"), r.value
        assert (
            f"fastdist.psum(axis='tp') on rank {r.rank} (group ranks [0, 1, 2])" in r.value["msg"]
        )
        assert "rank 2 did not reach this call" in r.value["msg"], r.value["msg"]
        assert "third_party" not in r.value["msg"] and "GLHF" not in r.value["msg"]
        # the closed connection and the 2 s roll call (about 2 s), not the mesh's 15 s timeout
        assert r.value["elapsed"] < 8, r.value


def test_ranks_may_first_use_axes_in_any_order() -> None:
    """Issue 20.1: ranks 0, 1 use "tp" before ranks 2, 3 touch the mesh; a whole-mesh psum then
    must not wait for anything."""
    values = expect_ok(run_world("subset_first", 4, timeout=180))
    for v in values:
        # the mesh's timeout is 60 s: a rank waiting for a group its peers never make would fail
        # there (and show here); gloo's own connect under load stays well below it
        assert v["elapsed"] < 45, v
        assert v["names"] == values[0]["names"]  # a group has one name on every member
    assert values[0]["names"] == [
        "fastdist.dp2_tp2.0.e0.0-1-2-3.gloo",
        "fastdist.dp2_tp2.1.e0.0-2-1-3.gloo",
    ]
    for r, v in enumerate(values):  # a meta tensor: the op, the axis, the rank and the fix
        assert v["meta"].startswith(
            f"fastdist.psum(axis='tp') on rank {r} (group ranks [{r - r % 2}, {r - r % 2 + 1}]): "
            "'meta' tensors hold no data"
        )
        assert (
            "Fix: pass cpu, cuda or npu tensors" in v["meta"] and "fastdist.simulate" in v["meta"]
        )


@pytest.fixture(scope="module")
def reliability() -> list[dict[str, Any]]:
    """tests/reliability_worker.py's "reliability" scenario on two gloo processes (one launch for
    the tests below)."""
    return expect_ok(run_world("reliability", 2, timeout=120, module="tests.reliability_worker"))


def test_mesh_recovers_after_a_rank_fails_and_ragged_sizes_fail_everywhere(
    reliability: list[dict[str, Any]],
) -> None:
    """Issue 20.2: a rank raises before a collective its peer waits in and resets (its error path
    drops the groups): the peer learns it within seconds, not at the mesh's 20 s timeout;
    fastdist.comm.reset(mesh) on both and the mesh works again."""
    r0, r1 = reliability
    kind, msg, elapsed = r0["failure"]
    assert (
        kind == "CollectiveError"
        and "fastdist.psum_scatter(axis='tp') on rank 0: dim 0 has size 3" in msg
        and elapsed < 1
    )
    # the waiting peer: the connection closed when rank 0 reset, so no timeout
    kind, msg, elapsed = r1["failure"]
    assert kind == "CommError", (kind, msg)
    assert msg.startswith(
        "fastdist.psum_scatter(axis='tp') on rank 1 (group ranks [0, 1]): the collective failed: "
    ), msg
    # gloo's words for a closed connection
    assert re.search(r"the collective failed: [^;]*Connection (closed|reset) by peer", msg), msg
    assert (
        "rank 0 did not reach this call (call 2 on this group)" in msg
        and "may have raised an error before it" in msg
    )
    assert "fastdist.comm.reset(mesh) on every rank" in msg
    assert "third_party" not in msg and "GLHF" not in msg
    # the roll call (at most 2 s) plus margin for a loaded machine: far from the 20 s timeout
    assert elapsed < 7, elapsed
    assert r0["reset"] < 10 and r1["reset"] < 2  # rank 0 waited in reset for rank 1
    # rank 1's own index was bad: both ranks raised at once, naming rank 1 and the op called
    # (not the ragged_all_to_all inside); then both ranks exchanged correctly
    for r, v in enumerate((r0, r1)):
        assert v["indexed"][1] == (
            f"fastdist.indexed_all_to_all_v(axis='tp') on rank {r}: rank 1's index holds 7, "
            "outside the 2 rows of its x (every rank of the group raises this). Fix: index rows "
            "0..1"
        ), v["indexed"]
        assert v["indexed"][2] < 1.5  # nobody waits for the timeout
    assert r0["indexed_ok"] == [1.0, 11.0] and r1["indexed_ok"] == [0.0, 10.0]
    for v in (r0, r1):
        msg, elapsed = v["ragged"][1:]
        assert msg == (
            "fastdist.ragged_all_to_all(axis='tp') on rank 0: rank 0 has send sizes summing past "
            "the 2 rows of its input. Fix: the rows to send must fit in x"
        ), msg
        assert elapsed < 1.5  # both ranks, at once: nobody waits for the timeout
        assert v["simulated"].startswith(
            "fastdist.ragged_all_to_all(axis='ep') on rank 0: rank 0 has negative send sizes"
        )


def test_a_closed_mesh_released_its_groups_and_says_so(
    reliability: list[dict[str, Any]],
) -> None:
    """fastdist.comm.close destroys the groups the mesh made (examples close their meshes before
    destroy_process_group, so no gloo group is torn down at interpreter exit); a later call
    raises at once, saying the mesh was closed; reset makes it usable again."""
    for rank, v in enumerate(reliability):
        kind, msg, elapsed = v["closed"]
        assert kind == "CommError" and elapsed < 1, v["closed"]
        assert msg.startswith(f"fastdist.psum(axis='tp') on rank {rank}"), msg
        assert "this mesh was closed (fastdist.comm.close released its process groups)" in msg
        assert "fastdist.comm.reset(mesh) on every rank" in msg
        assert v["reopened"] == 2.0


def test_a_failed_rank_that_stays_alive_is_named_at_the_timeout(
    reliability: list[dict[str, Any]],
) -> None:
    """Issue 20.2, default mode: rank 0's data-dependent input (exchange_sizes' local size 2.5) is
    invalid and it neither resets nor exits; rank 1 waits the mesh's 2 s timeout and is told that
    rank 0 did not come and may have raised (not a bare timeout)."""
    r0, r1 = reliability
    kind, msg, elapsed = r0["alive"]
    assert (
        kind == "CollectiveError"
        and msg.startswith("fastdist.exchange_sizes(axis='tp') on ")
        and elapsed < 1
    ), r0["alive"]
    assert "local_size = 2.5 is a float, not an integer row count. Fix: pass Python ints" in msg
    kind, msg, elapsed = r1["alive"]
    assert kind == "CollectiveTimeout", (kind, msg)
    assert (
        "(axis='tp') on rank 1 (group ranks [0, 1]): a peer did not arrive for the collective "
        "within the timeout (2 s)" in msg
    ), msg
    assert (
        "rank 0 did not reach this call (call 2 on this group) within 0.5 s of this failure: it "
        "may have raised an error before it" in msg
    )
    assert "fastdist.comm.reset(mesh) on every rank" in msg and "third_party" not in msg
    assert 2 - 0.1 < elapsed < 2 + 0.5 + 4, elapsed  # the timeout, the roll call, margin


def test_stateless_group_says_the_store_connection_closed() -> None:
    """Issue 20.4: the store's host exits; a receive says the connection closed (not 'nothing
    within 20 s'), at once."""
    res = run_world("stateless_host_exits", 2, timeout=60)
    assert res[1].returncode == 0, res[1].output
    for name, op in (("recv", "recv_obj"), ("send", "send_obj")):
        kind, msg, elapsed = res[1].value[name]
        assert kind == "CommError" and msg.startswith(
            f"fastdist.StatelessGroup.{op}(axis=None) on rank 1 (group ranks [0, 1]): the "
            "connection to the store at 127.0.0.1:"
        )
        assert "has probably exited" in msg and "within 20 s" not in msg and elapsed < 2


def test_check_mode_mismatch_raises_on_every_rank_with_what_each_passed(
    reliability: list[dict[str, Any]],
) -> None:
    """Issue 20.2, check mode: the ranks pass different shapes; each raises at once (the mesh's
    timeout is 20 s) with what each passed."""
    for r, value in enumerate(reliability):
        kind, msg, elapsed = value["check"]
        assert kind == "ConsistencyError" and msg is not None
        assert msg.startswith(
            f"fastdist.all_gather(axis='tp') on rank {r} (group ranks [0, 1]): the ranks disagree: "
        ), msg
        assert (
            "rank 0: all_gather(shapes=[(2,)], dtypes=['torch.float32'], params={'dim': 0, "
            "'tiled': True}) at reliability_worker.py:" in msg
        )
        assert (
            "rank 1: all_gather(shapes=[(3,)], dtypes=['torch.float32'], params={'dim': 0, "
            "'tiled': True}) at reliability_worker.py:" in msg
        )
        assert msg.endswith(
            "Fix: make every rank of the group make the same calls in the same order, each from "
            "the same line of code"
        )
        assert elapsed < 3, elapsed  # one small all-gather of the calls


def test_barrier_timeout_names_the_missing_rank() -> None:
    values = expect_ok(run_world("barrier_timeout", 3))
    assert (
        "Ranks 2 failed to pass monitoredBarrier" in values[0]["msg"]
        and "fastdist.barrier(axis='tp') on rank 0" in values[0]["msg"]
    )
    assert all(v["msg"] and v["elapsed"] < 2 + 10 for v in values[:2])


def test_stateless_group_over_tcpstore() -> None:
    values = expect_ok(run_world("stateless", 3))
    for r, v in enumerate(values):
        assert v["expired"] >= 2 and v["gone"]  # old keys deleted after data_expiration
        assert (
            f"on rank {r}" in v["timeout_msg"]
            and "within 1 s" in v["timeout_msg"]
            and v["elapsed"] < 1 + 10
        )


# ============================================================================ torchrun
def torchrun(example: str, nproc: int, *args: str) -> str:
    """Run ``examples/<example> <args>`` under torchrun (standalone); its stdout, after asserting
    it exited 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            str(ROOT / "examples" / example),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def torchrun_commands(text: str) -> list[str]:
    """The torchrun commands in ``text``: from ``torchrun`` (or ``torch.distributed.run``) followed
    by an option or a script, to the end of its line or code span (backslash continuations joined);
    mentions of one flag (``torchrun --max-restarts``) are no command."""
    found = re.finditer(
        r"(?:torchrun|torch\.distributed\.run)(?=\s+(?:-|\S+\.py\b))[^`\n]*",
        text.replace("\\\n", " "),
    )
    return [
        " ".join(m.group(0).split())
        for m in found
        if re.search(r"\.py\b|\s-m\s|--nproc", m.group(0))
    ]


def unpinned(commands: list[str]) -> list[str]:
    """The commands that use torchrun's default rendezvous port 29500 (no --standalone,
    --master-port or --rdzv-endpoint)."""
    return [
        c
        for c in commands
        if not re.search(r"\s--(?:standalone|master[-_]port|rdzv[-_]endpoint)\b", c)
    ]


def test_documented_torchrun_commands_choose_their_rendezvous() -> None:
    """Issue 20.9: every torchrun command in the README, docs/*.md and the examples' docstrings
    passes --standalone or a --master-port (the default port 29500 collides with any other job on
    the machine)."""
    sample = (
        "run `torchrun --nproc-per-node 4 a.py` or\n    torchrun --nnodes 1 \\\n  "
        "--standalone b.py\nrestart with `torchrun --max-restarts`"
    )
    assert torchrun_commands(sample) == [
        "torchrun --nproc-per-node 4 a.py",
        "torchrun --nnodes 1 --standalone b.py",
    ]
    # the check catches a bare command
    assert unpinned(torchrun_commands(sample)) == ["torchrun --nproc-per-node 4 a.py"]
    files = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "examples").glob("*.py")),
    ]
    found = {str(f.relative_to(ROOT)): torchrun_commands(f.read_text()) for f in files}
    # the README's two commands (tp_mlp, hf_llama) are parsed
    assert len(found["README.md"]) >= 2, found
    bad = {f: unpinned(cs) for f, cs in found.items() if unpinned(cs)}
    assert not bad, f"torchrun commands without --standalone or --master-port: {bad}"


def test_torchrun_example() -> None:
    out = torchrun("tp_mlp.py", 4)
    assert (
        "tp_mlp on Mesh({'dp': 2, 'tp': 2}): loss of dp replica 0" in out
        and "max grad diff over ranks" in out
    )


def test_torchrun_hf_llama_example() -> None:
    pytest.importorskip("transformers")
    out = torchrun("hf_llama.py", 2)
    assert "hf_llama on Mesh({'dp': 1, 'tp': 2}): max loss diff" in out and ": OK" in out


# ============================================================================ in-process units
@pytest.mark.parametrize(
    "device, npu, want", [("cpu", None, "gloo"), ("cuda", None, "nccl"), ("npu", True, "hccl")]
)
def test_select_backend(device: str, npu: bool | None, want: str) -> None:
    assert select_backend(device, npu_available=npu) == want


def test_select_backend_errors() -> None:
    with pytest.raises(
        fd.NoBackendError,
        match=r"NPU tensors need the HCCL backend from torch_npu.*pip install torch_npu",
    ):
        select_backend("npu", npu_available=False)
    with pytest.raises(fd.NoBackendError, match=r"no collective backend for 'xla' tensors"):
        select_backend("xla")
    # without torch_npu installed, the automatic check refuses NPU tensors with the same message
    if not any(p for p in sys.modules if p == "torch_npu"):
        with pytest.raises(fd.NoBackendError, match="torch_npu"):
            select_backend("npu")


def test_from_torch_needs_an_initialised_job() -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(
        fd.MeshError, match=r"torch\.distributed is not initialised.*init_process_group"
    ):
        fd.connect(tp=2)
    with pytest.raises(fd.NoBackendError, match=r"not backed by torch\.distributed"):
        fd.comm.broadcast_object(1, fd.Mesh({"tp": 2}), "tp")
    with pytest.raises(fd.MeshError, match=r"Mesh\.rank: .* is not one of them"):
        _ = fd.Mesh({"tp": 2}).rank
    for call in (lambda m: fd.comm.with_timeout(m, 3), lambda m: fd.comm.create_groups(m)):
        with pytest.raises(fd.MeshError, match=r"not backed by torch\.distributed"):
            call(fd.Mesh({"tp": 2}))


def test_error_classification() -> None:
    class FakeComm:
        timeout = datetime.timedelta(seconds=7)

    ac = TorchAxisComm.__new__(TorchAxisComm)
    ac.comm, ac.label, ac.ranks = FakeComm(), "tp", (4, 5)  # type: ignore[assignment]
    t = comm_error(
        "psum", ac, 5, RuntimeError("[gloo] Timed out waiting 7000ms for recv"), "the collective"
    )
    assert isinstance(t, fd.CollectiveTimeout) and isinstance(t, TimeoutError)
    assert str(t).startswith(
        "fastdist.psum(axis='tp') on rank 5 (group ranks [4, 5]): a peer did not arrive"
    ) and "(7 s)" in str(t)
    c = comm_error("psum", ac, 5, RuntimeError("Connection closed by peer"), "the collective")
    assert type(
        c
    ) is fd.CommError and "a peer closed the connection: it failed (see its log) or exited" in str(
        c
    )
    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
        "by peer [127.0.0.1]:26499. This is typically caused by a remote worker crashing. "
        "Check the logs of the remote worker before reporting an error. GLHF!"
    )
    c = comm_error("psum", ac, 5, gloo, "the collective", peers="rank 4 did not reach this call")
    assert (
        "the collective failed: Connection closed by peer [127.0.0.1]:26499; rank 4 did not reach "
        "this call. Fix:" in str(c)
    )
    assert "third_party" not in str(c) and "GLHF" not in str(c)


def test_stateless_group_argument_errors() -> None:
    with pytest.raises(fd.MeshError, match="rank 3 is outside 0..1"):
        fd.comm.StatelessGroup(None, 3, 2)
    with pytest.raises(fd.MeshError, match="world_size must be a positive int"):
        fd.comm.StatelessGroup(None, 0, 0)
    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=5)
    )  # a port the OS picks
    g = fd.comm.StatelessGroup(store, 0, 2, timeout=0.3)
    with pytest.raises(fd.CommError, match=r"dst=0 is not another member"):
        g.send_obj(1, dst=0)
    with pytest.raises(fd.CommError, match=r"src=2 is not a member"):
        g.broadcast_obj(1, src=2)
    with pytest.raises(fd.CollectiveTimeout, match=r"nothing from rank 1 within 0.3 s"):
        g.recv_obj(src=1)


def test_stateless_group_sends_expire_their_old_keys() -> None:
    """Every send deletes this member's keys older than ``data_expiration``; ``expire`` takes
    another age."""
    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=5)
    )
    g = fd.comm.StatelessGroup(store, 0, 2, timeout=0.3, data_expiration=0.05)
    g.send_obj("a", dst=1)
    time.sleep(0.1)
    g.send_obj("b", dst=1)  # deletes p2p/0->1/0, written more than 0.05 s ago
    assert not store.check(["p2p/0->1/0"]) and store.check(["p2p/0->1/1"])
    assert g.expire(older_than=3600) == 0 and g.expire(older_than=0) == 1
    assert not store.check(["p2p/0->1/1"])
