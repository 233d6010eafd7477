"""On a CUDA device: the same oracles as the CPU suite, with the data on the GPU.

Skipped where torch sees no CUDA device (CI has none). Run on a lent H100 (torch 2.11+cu130,
NCCL 2.28.9) in session 26: see docs/native.md, "What has run on hardware".
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastdist as fd

from .reference import ref
from .test_collectives import (
    ALL_OPS,
    COMPILE_CASES,
    cases,
    cotangent,
    norm_kw,
    oracle_grad,
    run,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("op", ALL_OPS)
@settings(max_examples=10)
@given(data=st.data())
def test_values_on_cuda_every_dtype(op: str, data: st.DataObject) -> None:
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16) + (
        () if op == "pmean" else (torch.int32, torch.int64)
    )
    mesh, axis, kw, xs = data.draw(cases(op, dtypes))
    got = run(op, xs.to(CUDA), mesh, axis, **kw)
    assert got.device.type == "cuda" and got.dtype == xs.dtype
    torch.testing.assert_close(got.cpu(), ref(op, xs, mesh, axis, **norm_kw(op, kw, xs.dim() - 1)))


@pytest.mark.parametrize("op", ALL_OPS)
@settings(max_examples=10)
@given(data=st.data())
def test_gradients_on_cuda_match_single_device(op: str, data: st.DataObject) -> None:
    mesh, axis, kw, xs = data.draw(cases(op, (torch.float64,)))
    xs = xs + torch.rand(xs.shape, dtype=xs.dtype, generator=torch.Generator().manual_seed(1)) * (
        op in ("pmax", "pmin")
    )
    leaf = xs.to(CUDA).requires_grad_()
    out = run(op, leaf, mesh, axis, **kw)
    c = cotangent(op, out.detach().cpu(), mesh, axis, seed=data.draw(st.integers(0, 2**16)))
    (out * c.to(CUDA)).sum().backward()
    assert leaf.grad is not None and leaf.grad.device.type == "cuda"
    torch.testing.assert_close(leaf.grad.cpu(), oracle_grad(op, xs, c, mesh, axis, kw))


@pytest.mark.parametrize("op", ALL_OPS)
def test_inductor_on_cuda_equals_eager(op: str) -> None:
    """Compiled with inductor (Triton kernels on the GPU): forward and backward equal eager and the
    oracle."""
    from .reference import per_group

    torch._dynamo.reset()
    mesh, axis = fd.Mesh({"dp": 2, "tp": 3}), "tp"
    xs = torch.randn(6, 3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    if op == "pvary":
        xs = per_group(xs, mesh, axis, lambda m: [m[0]] * len(m))
    kw = COMPILE_CASES[op]
    fn = getattr(fd, op)
    # elementwise work for Triton to fuse
    step = fd.simulate(lambda x: torch.sin(fn(x, mesh, axis, **kw)) * 2, mesh)
    eager_leaf, comp_leaf = (xs.to(CUDA).requires_grad_() for _ in range(2))
    eager_out = step(eager_leaf)
    comp_out = torch.compile(step, fullgraph=True)(comp_leaf)
    c = cotangent(op, eager_out.detach().cpu(), mesh, axis, seed=3).to(CUDA)
    (eager_out * c).sum().backward()
    (comp_out * c).sum().backward()
    torch.testing.assert_close(comp_out, eager_out)
    torch.testing.assert_close(comp_leaf.grad, eager_leaf.grad)


def test_hf_llama_tp_sp_on_cuda_matches_one_device() -> None:
    pytest.importorskip("transformers")
    from .test_hf_models import run_parallel

    run_parallel("llama", 2, True, 2, device="cuda")
    run_parallel("gpt2", 2, True, 4, device="cuda")


def test_hf_llama_bf16_on_cuda_is_close_to_float64() -> None:
    """bf16 on the GPU (flash/efficient SDPA kernels, rank-batched): the loss within bf16 rounding
    of float64."""
    pytest.importorskip("transformers")
    from .test_hf_models import batch, build, rep

    ref = build("llama").to("cuda")
    ids, labels = (t.to(CUDA) for t in batch(S=16))
    want = ref(input_ids=ids, labels=labels).loss
    model = copy.deepcopy(ref).to(torch.bfloat16)
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=True))
    got = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh)).loss
    got.sum().backward()
    assert got.dtype == torch.float32  # HF's loss upcasts
    torch.testing.assert_close(got, want.detach().float().expand(2), rtol=2e-2, atol=2e-2)
    grads = pm.grads()
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_native_nccl_benchmark_checks_pass() -> None:
    """benchmarks/native_gpu.py: every NativeCommunicator op through the real libnccl, eager and in
    CUDA graphs."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import native_gpu  # type: ignore[import-not-found]

        assert native_gpu.main(["--iters", "20"]) == 0
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_graph_capture_of_a_simulated_step_replays_with_new_inputs() -> None:
    """fd.comm.graph_capture's side stream + torch.cuda.graph: a simulated psum step captured once,
    replayed on new data."""
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    step = fd.simulate(lambda x: torch.tanh(fd.psum(x, mesh, "tp")), mesh)
    static = torch.zeros(4, 3, device=CUDA)
    with fd.comm.graph_capture(mesh) as ctx:
        assert ctx.stream is not None and ctx.device.type == "cuda"
        step(static)  # warm up on the capture stream
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=ctx.stream):
            out = step(static)
    for seed in range(3):
        new = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed)).to(CUDA)
        static.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        want = torch.tanh(new.reshape(2, 2, 3).sum(1, keepdim=True).expand(2, 2, 3).reshape(4, 3))
        torch.testing.assert_close(out, want)
