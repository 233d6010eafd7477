"""A context-parallel diffusers DiT (tiny ``WanTransformer3DModel``, float64) with data
parallelism on 4 gloo processes (dp 2 x sp 2): torch's FSDP2 (``data_parallel_step`` takes
fastdist's engine too; the test runs it on simulated ranks only), the
gradients of the mean over the data ranks' losses, the clipped norm and the parameters after an
SGD step equal one device's; and tensor x context parallelism (tp 2 x sp 2, `wan_tp`) on real
ranks. The simulated runs of the same compositions: ``tests/test_dit_compose.py``.
"""

from __future__ import annotations

import copy

import torch

import fastdist as fd
from fastdist.nn.plans.dit_tp import wan_tp
from tests.test_context_parallel import assert_grads, inputs, reference
from tests.test_dit_compose import assert_params, sgd
from tests.tiny_models import tiny_wan


def data_parallel_step(engine: str) -> str:
    """One rank of dp 2 x sp 2: a step of each data rank's latents, checked here against one
    device's step on the mean of both losses."""
    mesh = fd.connect(dp=2, sp=2, timeout=120)
    ref = tiny_wan(heads=4)
    model = copy.deepcopy(ref)
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.wan(model, mesh, mode="ring"))
    fd.train.DataParallel(pm, "dp", engine=engine)
    if engine == "fsdp":  # each parameter a DTensor over dp
        assert type(model.blocks[0].attn1.to_q.weight).__name__ == "DTensor"
    opt, opt_ref = sgd(pm.parameters()), sgd(ref.parameters())
    batches = [inputs(frames=3, seed=10 + d) for d in range(2)]
    pm(**batches[mesh.coords(mesh.rank)["dp"]]).sample.pow(2).sum().backward()
    (sum(ref(**b).sample.pow(2).sum() for b in batches) / 2).backward()
    assert_grads(pm.grads(), {n: p.grad for n, p in ref.named_parameters()})  # type: ignore[misc]
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    torch.testing.assert_close(fd.nn.clip_grad_norm_(pm, 0.5), want, rtol=1e-9, atol=0)
    opt.step()
    opt_ref.step()
    assert_params(pm.state_dict(), ref)
    return engine


def test_fsdp_times_sp_on_gloo() -> None:
    """FSDP2 over dp (fastdist's engine runs the same step on simulated ranks)."""
    from tests.dist_harness import run_on_gloo

    assert run_on_gloo(data_parallel_step, 4, "fsdp", timeout=300) == ["fsdp"] * 4


def tp_times_sp() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One rank of tp 2 x sp 2 (Ulysses): the whole output and every single-device gradient."""
    mesh = fd.connect(tp=2, sp=2, timeout=120)
    model = tiny_wan(heads=4)
    pm = fd.nn.parallelize(model, mesh, wan_tp(model, mesh))
    out = pm(**inputs(frames=3)).sample
    out.pow(2).sum().backward()
    return out.detach(), pm.grads()


def test_tp_times_sp_on_gloo() -> None:
    from tests.dist_harness import run_on_gloo

    out, grads = reference(tiny_wan(heads=4), inputs(frames=3))
    for got, got_grads in run_on_gloo(tp_times_sp, 4, timeout=300):
        torch.testing.assert_close(got, out, rtol=0, atol=1e-12)
        assert_grads(got_grads, grads)
