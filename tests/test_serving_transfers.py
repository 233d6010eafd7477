"""Serving-side transfers on real gloo processes: tensor dicts between pipeline stages with the
all-gather optimisation, and graph_capture's set-up (communicators created before capture)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fastdist as fd
import fastdist.comm.p2p as D
from fastdist.comm.native import fake
from tests.dist_harness import run_on_gloo

DICT = {
    "h": torch.arange(12.0).reshape(3, 4),
    "odd": torch.arange(5.0),
    "empty": torch.zeros(0, 2),
    "step": 7,
    "ids": torch.tensor([3, 1, 4, 1]),
}


def _pp_transfer(all_gather_axis: str | None) -> dict[str, Any]:
    """pp=2 x tp=2: stage 0 sends DICT to stage 1 (same tp index); records what each rank put on the
    wire."""
    mesh = fd.connect(pp=2, tp=2, timeout=20)
    sent: list[int] = []
    real = D.send

    def counting_send(t: torch.Tensor, *a: Any, **k: Any) -> None:
        # the tensors send_tensor_dict puts on the wire (metadata travels apart)
        sent.append(t.numel())
        real(t, *a, **k)

    D.send = counting_send  # type: ignore[assignment]
    try:
        if mesh.index(mesh.rank, "pp") == 0:
            fd.comm.send_tensor_dict(DICT, mesh, "pp", 1, all_gather_axis=all_gather_axis)
            return {"sent": sent}
        return {"got": fd.comm.recv_tensor_dict(mesh, "pp", 0, all_gather_axis=all_gather_axis)}
    finally:
        D.send = real  # type: ignore[assignment]


@pytest.mark.parametrize("all_gather_axis", [None, "tp"])
def test_tensor_dict_between_stages_with_and_without_the_all_gather(
    all_gather_axis: str | None,
) -> None:
    out = run_on_gloo(_pp_transfer, 4, all_gather_axis, timeout=90)
    for rank in (0, 1):  # stage 0 (tp index 0 and 1)
        # h (12) and ids (4) travel as halves over tp=2; odd (5 elements) and empty travel whole
        want = [12, 5, 0, 4] if all_gather_axis is None else [6, 5, 0, 2]
        assert out[rank]["sent"] == want, out[rank]
    for rank in (2, 3):  # stage 1: the whole dict, exactly
        got = out[rank]["got"]
        assert got.keys() == DICT.keys() and got["step"] == 7
        for k, v in DICT.items():
            if isinstance(v, torch.Tensor):
                assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def _mismatched_all_gather_axis() -> str:
    mesh = fd.connect(pp=2, tp=2, timeout=5)
    with pytest.raises(
        fd.CommError,
        match=r"all_gather_axis=\('pp', 'tp'\) shares mesh axes with the transfer axis 'pp'",
    ):
        # refused before anything is sent
        fd.comm.send_tensor_dict(DICT, mesh, "pp", 1, all_gather_axis=("pp", "tp"))
    if mesh.index(mesh.rank, "pp") == 0:
        try:
            fd.comm.send_tensor_dict(DICT, mesh, "pp", 1, all_gather_axis="tp")
            return "sent"
        except fd.FastdistError as e:
            return type(e).__name__
    with pytest.raises(
        fd.CommError,
        match=(
            r"the sender used all_gather_axis='tp', this rank None.*Fix: pass the same "
            r"all_gather_axis on both sides"
        ),
    ):
        fd.comm.recv_tensor_dict(mesh, "pp", 0)
    return "raised"


def test_mismatched_or_overlapping_all_gather_axis_raises() -> None:
    out = run_on_gloo(_mismatched_all_gather_axis, 4, timeout=90)
    assert out[2:] == ["raised", "raised"]


def _capture_setup(lib: str) -> list[Any]:
    mesh = fd.connect(tp=2, backend="nccl-ctypes", library=lib)
    with fd.comm.graph_capture(mesh, device="cpu") as ctx:
        before = [line.split()[0] for line in fake.call_log(lib)]
        out = fd.psum(torch.tensor([1.0, 2.0]) * (mesh.rank + 1), mesh, "tp")
    after = [line.split()[0] for line in fake.call_log(lib)]
    fd.comm.close(mesh)
    return [ctx.stream is None, str(ctx.device), before, after, out.tolist()]


def test_graph_capture_creates_the_communicators_first(tmp_path: Path) -> None:
    """CPU + the fake NCCL: entering graph_capture initialises the communicator before any
    collective runs."""
    lib = fake.build(tmp_path / "fakenccl")
    for no_stream, device, before, after, out in run_on_gloo(_capture_setup, 2, lib, timeout=90):
        assert no_stream and device == "cpu" and out == [3.0, 6.0]
        assert "ncclCommInitRank" in before  # the communicator exists on entering the block
        # the block's psum: one call on it, no set-up left
        assert after[len(before) :] == ["ncclAllReduce"]


def test_graph_capture_on_a_simulated_mesh_runs_the_block_as_is() -> None:
    mesh = fd.Mesh({"tp": 2})
    with fd.comm.graph_capture(mesh, device="cpu") as ctx:
        out = fd.simulate(lambda x: fd.psum(x, mesh, "tp"), mesh)(torch.tensor([1.0, 2.0]))
    assert ctx.stream is None and out.tolist() == [3.0, 3.0]
    with (
        pytest.raises(fd.MeshError, match="nope"),
        fd.comm.graph_capture(mesh, "nope", device="cpu"),
    ):
        pass
