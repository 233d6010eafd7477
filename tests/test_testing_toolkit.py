"""fastdist.testing and the pytest plugin: the tools users test their parallel code with."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import fastdist as fd
from fastdist import P
from fastdist.testing import (
    assert_matches_single_device,
    axes,
    meshes,
    run_on_gloo,
    shard_sizes,
    sharded,
)

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
    assert (
        torch.equal(torch.cat(s.shards, s.dim), s.global_tensor)
        and [t.shape[0] for t in s.shards] == s.sizes
    )


def test_uneven_sizes_include_empty_shards() -> None:
    seen_zero = []

    @given(shard_sizes(4, total=3))
    def probe(sizes: list[int]) -> None:
        seen_zero.append(0 in sizes)

    probe()
    assert any(seen_zero)


def _mlp(mesh: fd.Mesh):
    """A dp x tp MLP as it must be written: x is replicated over tp and meets the tp-split w1,
    the weights are replicated over dp and meet dp-split rows, so each goes through pvary (whose
    backward sums the gradient over that axis)."""

    def local(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        w1, w2 = fd.pvary(w1, mesh, "dp"), fd.pvary(w2, mesh, "dp")
        return fd.psum(torch.tanh(fd.pvary(x, mesh, "tp") @ w1) @ w2, mesh, "tp")

    return local


def _mlp_without_pvary(mesh: fd.Mesh):
    """The same MLP missing the pvary of x: each rank's dx is its partial over tp (wrong outside
    fd.spmd)."""

    def local(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        w1, w2 = fd.pvary(w1, mesh, "dp"), fd.pvary(w2, mesh, "dp")
        return fd.psum(torch.tanh(x @ w1) @ w2, mesh, "tp")

    return local


def _inputs() -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(4, 3, dtype=F64, generator=g),
        torch.randn(3, 4, dtype=F64, generator=g),
        torch.randn(4, 3, dtype=F64, generator=g),
    ]


def _reference(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    return torch.tanh(x @ w1) @ w2


SPECS = {"in_specs": (P("dp", None), P(None, "tp"), P("tp", None)), "out_specs": P("dp", None)}


def test_assert_matches_single_device_passes_for_correct_code(fastdist_mesh: fd.Mesh) -> None:
    assert_matches_single_device(_mlp(fastdist_mesh), _reference, fastdist_mesh, _inputs(), **SPECS)


def test_assert_matches_single_device_tests_the_code_as_written(fastdist_mesh: fd.Mesh) -> None:
    """By default nothing is repaired: the missing pvary leaves dx partial on every rank, and the
    failure names the input by position and name, the rank, and both norms."""
    with pytest.raises(AssertionError) as info:
        assert_matches_single_device(
            _mlp_without_pvary(fastdist_mesh), _reference, fastdist_mesh, _inputs(), **SPECS
        )
    first = str(info.value).splitlines()[0]
    ref = torch.func.grad(lambda x: (_reference(x, *_inputs()[1:]) * _cotangent()).sum())(
        _inputs()[0]
    )[:2]  # rank 0 holds rows 0..1 (dp=0)
    assert first.startswith(
        f"gradient of input 0 (x) on rank 0 {{'dp': 0, 'tp': 0}} (reference norm "
        f"{torch.linalg.vector_norm(ref).item():.6g}, got norm "
    ), first


def _cotangent() -> Tensor:
    """The cotangent assert_matches_single_device draws for a [4, 3] output with seed 0."""
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=F64)


def test_check_insert_is_the_spmd_semantics_and_must_be_asked_for(fastdist_mesh: fd.Mesh) -> None:
    """check="insert" runs the code as fd.spmd does (pvary inserted): the same MLP then passes;
    check="error" refuses it, naming the missing pvary."""
    assert_matches_single_device(
        _mlp_without_pvary(fastdist_mesh),
        _reference,
        fastdist_mesh,
        _inputs(),
        check="insert",
        **SPECS,
    )
    with pytest.raises(fd.ReplicationError, match="tp"):
        assert_matches_single_device(
            _mlp_without_pvary(fastdist_mesh),
            _reference,
            fastdist_mesh,
            _inputs(),
            check="error",
            **SPECS,
        )


def test_assert_matches_single_device_catches_a_wrong_value(fastdist_mesh: fd.Mesh) -> None:
    """Twice the sum: the message gives both norms (the reference's and twice it)."""
    x = torch.tensor([[1.5], [-4.0]], dtype=F64)
    with pytest.raises(
        AssertionError,
        match=r"^output on rank 0 \{'dp': 0, 'tp': 0\} \(reference norm 2.5, got norm 5\): ",
    ):
        assert_matches_single_device(
            lambda x: fd.psum(x, fastdist_mesh, "tp") * 2,
            lambda x: x.sum(0, keepdim=True),
            fastdist_mesh,
            [x],
            in_specs=(P("tp", None),),
            out_specs=P(),
        )


# ---------------------------------------------------- a user's own autograd.Function (Megatron)
def _megatron_functions(mesh: fd.Mesh, *, wrong_backward: bool = False):
    """Megatron-LM's pair as a user writes them: copy to the tp region (identity forward, psum
    backward) and reduce from it (psum forward, identity backward). ``wrong_backward``: the copy's
    backward forgets its psum (the bug a missing pvary is)."""

    class CopyToTensorParallel(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x: Tensor) -> Tensor:
            return x.clone()

        @staticmethod
        def setup_context(ctx: object, inputs: tuple[Tensor], output: Tensor) -> None:
            pass

        @staticmethod
        def backward(ctx: object, g: Tensor) -> Tensor:
            return g if wrong_backward else fd.psum(g, mesh, "tp")

    class ReduceFromTensorParallel(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x: Tensor) -> Tensor:
            return fd.psum(x, mesh, "tp")

        @staticmethod
        def setup_context(ctx: object, inputs: tuple[Tensor], output: Tensor) -> None:
            pass

        @staticmethod
        def backward(ctx: object, g: Tensor) -> Tensor:
            return g

    def local(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        w1, w2 = fd.pvary(w1, mesh, "dp"), fd.pvary(w2, mesh, "dp")  # their gradient: sum over dp
        h = torch.tanh(CopyToTensorParallel.apply(x) @ w1)
        return ReduceFromTensorParallel.apply(h @ w2)

    return local


def test_a_correct_megatron_pair_passes(fastdist_mesh: fd.Mesh) -> None:
    assert_matches_single_device(
        _megatron_functions(fastdist_mesh), _reference, fastdist_mesh, _inputs(), **SPECS
    )


def test_a_megatron_pair_with_a_wrong_backward_fails(fastdist_mesh: fd.Mesh) -> None:
    """The deliberately wrong backward (no psum) fails by default, naming x."""
    with pytest.raises(AssertionError, match=r"^gradient of input 0 \(x\) on rank 0 "):
        assert_matches_single_device(
            _megatron_functions(fastdist_mesh, wrong_backward=True),
            _reference,
            fastdist_mesh,
            _inputs(),
            **SPECS,
        )


@pytest.mark.fastdist_mesh(sp=4)
def test_fixture_marker_sets_the_axes(fastdist_mesh: fd.Mesh) -> None:
    assert fastdist_mesh == fd.Mesh({"sp": 4})


# -------------------------------------------------------------------------- gloo
def gloo_psum(scale: float) -> list[float]:
    mesh = fd.connect(tp=2)
    return (fd.psum(torch.tensor([float(mesh.rank)]), mesh, "tp") * scale).tolist()


def gloo_fail() -> None:
    raise ValueError("boom on purpose")


def gloo_same_test() -> str:
    """The body of test_assert_matches_single_device_passes_for_correct_code, then of
    ..._tests_the_code_as_written, on a real mesh."""
    mesh = fd.connect(tp=2)
    assert_matches_single_device(_mlp(mesh), _reference, mesh, _inputs(), **SPECS)
    try:
        assert_matches_single_device(_mlp_without_pvary(mesh), _reference, mesh, _inputs(), **SPECS)
    except AssertionError as e:
        return str(e).splitlines()[0]
    return "not caught"


def test_the_same_check_runs_on_gloo_processes() -> None:
    firsts = run_on_gloo(gloo_same_test, 4)
    assert [
        f.startswith(f"gradient of input 0 (x) on rank {r} ") for r, f in enumerate(firsts)
    ] == [True] * 4


def test_run_on_gloo_returns_every_rank_result() -> None:
    assert run_on_gloo(gloo_psum, 2, 10.0) == [[10.0], [10.0]]


def test_run_on_gloo_from_a_forkserver() -> None:
    """``start_method="forkserver"``: the ranks fork from a server that imported torch once; the
    same results, a rank's failure reported the same way; any other start method is refused."""
    from tests.dist_harness import forkserver

    forkserver()  # the suite's preload (multiprocessing.set_forkserver_preload), as other tests
    assert run_on_gloo(gloo_psum, 2, 10.0, start_method="forkserver") == [[10.0], [10.0]]
    with pytest.raises(fd.GlooRunError, match=r"rank \d: raised ValueError: boom on purpose"):
        run_on_gloo(gloo_fail, 2, start_method="forkserver")
    with pytest.raises(fd.MeshError, match=r"start_method='fork' is not 'spawn' or 'forkserver'"):
        run_on_gloo(gloo_psum, 2, 1.0, start_method="fork")  # type: ignore[arg-type]


def test_run_on_gloo_reports_the_failing_rank() -> None:
    with pytest.raises(
        fd.GlooRunError,
        match=(
            r"(?s)^run_on_gloo\(gloo_fail, 2\) failed:\n--- rank \d: raised ValueError: boom on "
            r"purpose\nTraceback"
        ),
    ) as info:
        run_on_gloo(gloo_fail, 2)
    e = info.value
    assert (
        isinstance(e, AssertionError)
        and not e.timed_out
        and sorted(e.failures) == [0, 1]
        and e.exitcodes == {0: 1, 1: 1}
    )
    for text in e.failures.values():
        assert text.startswith(
            "raised ValueError: boom on purpose\nTraceback (most recent call last):\n"
        )
        # from the user's function down
        assert (
            'in gloo_fail\n    raise ValueError("boom on purpose")' in text
            and "_gloo_entry" not in text
        )


def gloo_many_tensors(n: int) -> dict[str, object]:
    """A result that holds many tensors (they once travelled as shared-memory handles that died with
    the rank)."""
    mesh = fd.connect(tp=2)
    big = torch.arange(1000.0)
    return {
        "rank": mesh.rank,
        "tensors": [torch.full((2,), float(i * 10 + mesh.rank)) for i in range(n)],
        "views": [big[i : i + 3] for i in range(0, 30, 10)],
    }


def test_run_on_gloo_returns_results_holding_many_tensors() -> None:
    results = run_on_gloo(gloo_many_tensors, 2, 500)
    for r, got in enumerate(results):
        assert got["rank"] == r and len(got["tensors"]) == 500
        assert torch.equal(
            torch.stack(got["tensors"]), (torch.arange(500.0) * 10 + r).unsqueeze(1).expand(500, 2)
        )
        assert [v.tolist() for v in got["views"]] == [
            [0.0, 1.0, 2.0],
            [10.0, 11.0, 12.0],
            [20.0, 21.0, 22.0],
        ]


def gloo_exit(code: int) -> None:
    """Rank 1 dies without a word; rank 0 waits (as a peer blocked in a collective would)."""
    import os
    import time

    if fd.connect(tp=2).rank == 1:
        os._exit(code)
    time.sleep(60)


def test_run_on_gloo_reports_a_rank_that_died_promptly() -> None:
    start = time.monotonic()
    with pytest.raises(fd.GlooRunError) as info:
        run_on_gloo(gloo_exit, 2, 3, timeout=60, grace=1)
    took = time.monotonic() - start
    e = info.value
    assert list(e.failures) == [1, 0] and not e.timed_out  # the cause first
    assert (
        e.failures[1]
        == "exited with code 3 before it saved a result (os._exit, or a crash in native code)"
    )
    assert (
        e.failures[0]
        == "still running 1 s after rank 1 failed: killed (probably waiting for it in a collective)"
    )
    assert e.exitcodes == {0: -9, 1: 3}
    assert str(e).startswith("run_on_gloo(gloo_exit, 2) failed:\n--- rank 1: exited with code 3")
    assert took < 20, took  # spawning two ranks + 1 s grace, not the 60 s timeout


def gloo_sleep() -> None:
    import time

    time.sleep(60)


def test_run_on_gloo_times_out_and_says_so() -> None:
    start = time.monotonic()
    with pytest.raises(
        fd.GlooRunError,
        match=(
            r"^run_on_gloo\(gloo_sleep, 2\) timed out:\n--- rank 0: still running after the 3 s "
            r"timeout: killed\n--- rank 1: "
        ),
    ) as info:
        run_on_gloo(gloo_sleep, 2, timeout=3)
    assert info.value.timed_out and info.value.exitcodes == {0: -9, 1: -9}
    assert 3 <= time.monotonic() - start < 15


def test_concurrent_run_on_gloo_calls_do_not_collide() -> None:
    """Each run has its own store on a port the OS gave the parent: parallel runs cannot take each
    other's port."""
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_on_gloo, gloo_psum, 2, float(k)) for k in (1, 2)]
        assert [f.result(timeout=120) for f in runs] == [[[1.0], [1.0]], [[2.0], [2.0]]]


def test_what_a_rank_left_behind_is_read_as_what_happened(tmp_path) -> None:
    """In-process: an unsaveable result, a missing one after a signal or an exit code (what
    run_on_gloo reports)."""
    from fastdist.testing import _outcome, _save

    _save(str(tmp_path / "rank0.pt"), ("ok", lambda: 1))  # a lambda cannot be pickled
    ok, text = _outcome(0, 0, str(tmp_path))
    assert (
        not ok
        and text.startswith("raised an error saving its result\nTraceback")
        and "lambda" in text
    )
    _save(str(tmp_path / "rank1.pt"), ("ok", {"x": torch.arange(3)}))
    ok, value = _outcome(1, 0, str(tmp_path))
    assert (
        ok and torch.equal(value["x"], torch.arange(3)) and not (tmp_path / "rank1.pt.tmp").exists()
    )
    assert _outcome(1, 1, str(tmp_path)) == (
        False,
        "returned a result, then exited with code 1 while tearing down",
    )
    assert _outcome(2, -9, str(tmp_path)) == (
        False,
        "killed by SIGKILL before it saved a result (out of memory? a crash in native code?)",
    )
    assert _outcome(2, -200, str(tmp_path))[1].startswith("killed by signal 200 before")
    assert _outcome(2, 0, str(tmp_path)) == (
        False,
        "exited with code 0 before it saved a result (os._exit, or a crash in native code)",
    )
