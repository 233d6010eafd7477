"""On a CUDA device: context parallelism (an HF Llama, a diffusers Wan) and domain parallelism
(a conv net with halo exchange) equal one device, with the data on the GPU.

Skipped where torch sees no CUDA device (CI has none). The same oracles as the CPU tests
(``tests/test_context_llm.py``, ``tests/test_context_parallel.py``, ``tests/test_domain.py``):
simulated ranks, float64, the model on one device as the reference; plus bfloat16 runs that
exercise the GPU's attention kernels, checked within bfloat16 rounding of float64.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fastdist as fd

#: FASTDIST_TEST_DEVICE=cpu runs these oracles on the CPU (to check the tests themselves)
CUDA = torch.device(os.environ.get("FASTDIST_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(
    CUDA.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
)
F64 = torch.float64


def _rep(t: Tensor, n: int) -> Tensor:
    return t.expand(n, *t.shape)


def _close_grads(got: dict[str, Tensor], ref: nn.Module, rel: float) -> None:
    """Every parameter's gradient within ``rel`` of the largest entry of one device's."""
    for name, p in ref.named_parameters():
        if p.grad is None:
            continue
        err = float((got[name].float() - p.grad.float()).abs().max() / p.grad.abs().max())
        assert err < rel, f"{name}: {err:.2e}"


# ------------------------------------------------------------------ an HF Llama, context parallel
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_llm_context_parallel_on_cuda_matches_one_device(mode: str) -> None:
    pytest.importorskip("transformers")
    from fastdist.nn import CausalContextParallel

    from .tiny_models import VOCAB, build

    ref = build("llama", kv=2).to(CUDA)
    model = copy.deepcopy(ref)
    mesh = fd.Mesh({"cp": 2})
    plan = fd.nn.plans.plan(model, mesh, context_parallel=CausalContextParallel("cp", mode))
    pm = fd.nn.parallelize(model, mesh, plan)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g).to(CUDA)
    want = ref(input_ids=ids, use_cache=False).logits  # (B, S, V)
    got = pm(input_ids=_rep(ids, 2), use_cache=False).logits  # (2, B, S, V)
    torch.testing.assert_close(got, _rep(want, 2).detach(), rtol=1e-9, atol=1e-10)
    cot = torch.randn(want.shape, generator=g, dtype=F64).to(CUDA)
    (want * cot).sum().backward()
    (got * cot).sum().backward()
    _close_grads(pm.grads(), ref, 1e-9)


def test_llm_context_parallel_bf16_on_cuda_is_close_to_float64() -> None:
    """bfloat16 on the GPU: the ring's blocks run the GPU's kernels; the loss within bfloat16
    rounding of float64 on one device, every gradient finite."""
    pytest.importorskip("transformers")
    from fastdist.nn import CausalContextParallel

    from .tiny_models import VOCAB, build

    ref = build("llama", kv=2).to(CUDA)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 32), generator=g).to(CUDA)
    logits = ref(input_ids=ids, use_cache=False).logits
    want = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    model = copy.deepcopy(ref).to(torch.bfloat16)
    mesh = fd.Mesh({"cp": 2})
    plan = fd.nn.plans.plan(model, mesh, context_parallel=CausalContextParallel("cp", "ring"))
    pm = fd.nn.parallelize(model, mesh, plan)
    out = pm(input_ids=_rep(ids, 2), use_cache=False).logits.float()  # (2, B, S, V)
    loss = torch.stack(
        [F.cross_entropy(o[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) for o in out]
    )
    loss.sum().backward()
    torch.testing.assert_close(loss, _rep(want.float(), 2).detach(), rtol=3e-2, atol=3e-2)
    assert all(torch.isfinite(g).all() for g in pm.grads().values())


# ------------------------------------------------ a diffusers Wan, context parallel
@pytest.mark.parametrize("mode", ["ulysses", "ring", "usp"])
def test_wan_context_parallel_on_cuda_matches_one_device(mode: str) -> None:
    pytest.importorskip("diffusers")
    from .test_context_parallel import inputs
    from .tiny_models import tiny_wan

    ref = tiny_wan(heads=4).to(CUDA)
    model = copy.deepcopy(ref)
    x = {k: v.to(CUDA) for k, v in inputs().items()}
    if mode == "usp":
        mesh = fd.Mesh({"sp": 2, "cp": 2})
        plan: Any = fd.nn.plans.wan(mode="usp", ring_axis="cp")
    else:
        mesh = fd.Mesh({"sp": 2})
        plan = fd.nn.plans.wan(mode=mode)
    pm = fd.nn.parallelize(model, mesh, plan)
    want = ref(**x).sample
    got = pm(**{k: _rep(v, mesh.size) for k, v in x.items()}).sample
    torch.testing.assert_close(got, _rep(want, mesh.size).detach(), rtol=0, atol=1e-10)
    want.pow(2).sum().backward()
    got.pow(2).sum().backward()
    _close_grads(pm.grads(), ref, 1e-6)  # Wan's float32 norms: see test_context_parallel


# ------------------------------------------------------------------ domain parallelism
class _Stack(nn.Module):
    """Conv, group norm, max pooling, transposed conv, bilinear upsampling: every halo kind."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU())
        self.b = nn.Sequential(
            nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")
        )
        self.c = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.d = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(8, 2, 1))

    def forward(self, x: Tensor) -> Tensor:
        a = self.a(x)
        return self.d(torch.cat([a, self.c(self.b(a))], 1))


@pytest.mark.parametrize("axes", [{"h": 2}, {"h": 2, "w": 2}])
def test_domain_parallel_on_cuda_matches_one_device(axes: dict[str, int]) -> None:
    torch.manual_seed(0)
    ref = _Stack().to(F64).to(CUDA)
    net = copy.deepcopy(ref)
    dims = {-2: "h", -1: "w"} if "w" in axes else {-2: "h"}
    mesh = fd.Mesh(axes)
    pm = fd.nn.parallelize(net, mesh, {"": fd.nn.DomainParallel(dims)})
    x = torch.randn(2, 2, 8, 12, dtype=F64).to(CUDA)
    want = ref(x)
    got = pm(_rep(x, mesh.size))
    torch.testing.assert_close(got, _rep(want, mesh.size).detach(), rtol=0, atol=1e-10)
    cot = torch.randn(want.shape, dtype=F64).to(CUDA)
    (want * cot).sum().backward()
    (got * cot).sum().backward()
    _close_grads(pm.grads(), ref, 1e-9)


def test_halo_exchange_on_cuda_gradient_is_the_transpose() -> None:
    """The halo's gradient rule on the GPU: <halo(x), c> = <x, halo^T(c)>, checked by autograd
    against the same exchange on the CPU."""
    mesh = fd.Mesh({"h": 4})
    x = torch.randn(4, 3, 5, 6, dtype=F64)
    c = torch.randn(4, 3, 5 + 2 + 1, 6, dtype=F64)
    outs, grads = [], []
    for dev in ("cpu", CUDA):
        leaf = x.to(dev).clone().requires_grad_()
        step = fd.simulate(lambda t: fd.halo_exchange(t, mesh, "h", -2, (2, 1)), mesh)
        out = step(leaf)
        (out * c.to(dev)).sum().backward()
        outs.append(out.detach().cpu())
        grads.append(leaf.grad.cpu())  # type: ignore[union-attr]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-12)
