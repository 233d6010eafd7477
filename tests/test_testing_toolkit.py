"""fastdist.testing and the pytest plugin: the tools users test their parallel code with."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import fastdist as fd
from fastdist import P
from fastdist.testing import assert_matches_single_device, axes, meshes, run_on_gloo, shard_sizes, sharded

F64 = torch.float64


@given(data=st.data())
def test_strategies_draw_valid_values(data: st.DataObject) -> None:
    mesh = data.draw(meshes(max_size=12))
    assert 1 <= mesh.size <= 12 and set(mesh.axis_names) <= {"dp", "sp", "tp"}
    axis = data.draw(axes(mesh))
    n = mesh.axis_size(axis)
    sizes = data.draw(shard_sizes(n, total=7))
    assert len(sizes) == n and sum(sizes) == 7 and min(sizes) >= 0
    s = data.draw(sharded(n, even=data.draw(st.booleans())))
    assert torch.equal(torch.cat(s.shards, s.dim), s.global_tensor) and [t.shape[0] for t in s.shards] == s.sizes


def test_uneven_sizes_include_empty_shards() -> None:
    seen_zero = []

    @given(shard_sizes(4, total=3))
    def probe(sizes: list[int]) -> None:
        seen_zero.append(0 in sizes)

    probe()
    assert any(seen_zero)


def _mlp(mesh: fd.Mesh):
    def local(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        return fd.psum(torch.tanh(x @ w1) @ w2, mesh, "tp")

    return local


def _inputs() -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, dtype=F64, generator=g), torch.randn(3, 4, dtype=F64, generator=g), torch.randn(4, 3, dtype=F64, generator=g)]


SPECS = {"in_specs": (P("dp", None), P(None, "tp"), P("tp", None)), "out_specs": P("dp", None)}


def test_assert_matches_single_device_passes_for_correct_code(fastdist_mesh: fd.Mesh) -> None:
    assert_matches_single_device(_mlp(fastdist_mesh), lambda x, w1, w2: torch.tanh(x @ w1) @ w2, fastdist_mesh, _inputs(), **SPECS)


def test_assert_matches_single_device_catches_a_wrong_gradient(fastdist_mesh: fd.Mesh) -> None:
    """Without the checker (and without a hand-written pvary) dx is each rank's partial: caught, naming the rank."""
    with pytest.raises(AssertionError, match=r"gradient of input 0 on rank 0 \{'dp': 0, 'tp': 0\}"):
        assert_matches_single_device(_mlp(fastdist_mesh), lambda x, w1, w2: torch.tanh(x @ w1) @ w2, fastdist_mesh, _inputs(), check=False, **SPECS)


def test_assert_matches_single_device_catches_a_wrong_value(fastdist_mesh: fd.Mesh) -> None:
    with pytest.raises(AssertionError, match=r"output on rank 0"):
        assert_matches_single_device(lambda x: fd.psum(x, fastdist_mesh, "tp") * 2, lambda x: x.sum(0, keepdim=True).expand(2, 1) * 1, fastdist_mesh,
                                     [torch.randn(2, 1, dtype=F64)], in_specs=(P("tp", None),), out_specs=P(), check=False)


@pytest.mark.fastdist_mesh(sp=4)
def test_fixture_marker_sets_the_axes(fastdist_mesh: fd.Mesh) -> None:
    assert fastdist_mesh == fd.Mesh({"sp": 4})


# -------------------------------------------------------------------------- gloo
def gloo_psum(scale: float) -> list[float]:
    mesh = fd.Mesh.from_torch(tp=2)
    return (fd.psum(torch.tensor([float(mesh.rank)]), mesh, "tp") * scale).tolist()


def gloo_fail() -> None:
    raise ValueError("boom on purpose")


def gloo_same_test() -> str:
    """The body of test_assert_matches_single_device_passes_for_correct_code, on a real mesh."""
    mesh = fd.Mesh.from_torch(tp=2)
    assert_matches_single_device(_mlp(mesh), lambda x, w1, w2: torch.tanh(x @ w1) @ w2, mesh, _inputs(), **SPECS)
    try:
        assert_matches_single_device(_mlp(mesh), lambda x, w1, w2: torch.tanh(x @ w1) @ w2, mesh, _inputs(), check=False, **SPECS)
    except AssertionError as e:
        return str(e).splitlines()[0]
    return "not caught"


def test_the_same_check_runs_on_gloo_processes() -> None:
    firsts = run_on_gloo(gloo_same_test, 4)
    assert [f.startswith(f"gradient of input 0 on rank {r} ") for r, f in enumerate(firsts)] == [True] * 4


def test_run_on_gloo_returns_every_rank_result() -> None:
    assert run_on_gloo(gloo_psum, 2, 10.0) == [[10.0], [10.0]]


def test_run_on_gloo_reports_the_failing_rank() -> None:
    with pytest.raises(AssertionError, match=r"(?s)run_on_gloo\(gloo_fail, 2\) failed:.*--- rank \d ---.*ValueError: boom on purpose"):
        run_on_gloo(gloo_fail, 2)
