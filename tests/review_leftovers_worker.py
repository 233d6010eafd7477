"""Gloo scenarios of tests/test_review_leftovers.py: `fastdist.train.DataParallel`'s buffer
broadcast (BatchNorm running statistics) beside torch's DDP and one device, and the
vocabulary-parallel loss with label smoothing on real ranks."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

import fastdist as fd

F64 = torch.float64
STEPS = 3


def bn_net() -> torch.nn.Module:
    """A small float64 net whose BatchNorm updates running statistics from each rank's batch."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    ).to(F64)


def batches(rank: int, step: int) -> list[torch.Tensor]:
    """Two micro-batches of rank ``rank`` at ``step``: each rank's data differs (mean and scale)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(6, 4, generator=g, dtype=F64) * (1 + rank) + rank for _ in range(2)]


def eval_input() -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(7), dtype=F64)


def train(model: Any, no_sync: Any, rank: int) -> torch.Tensor:
    """STEPS steps of SGD, two micro-batches each (the first under ``no_sync``), then an eval
    forward (no grad); returns the eval output."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        first, second = batches(rank, step)
        with no_sync():
            (model(first).pow(2).mean() / 2).backward()
        (model(second).pow(2).mean() / 2).backward()
        opt.step()
        opt.zero_grad()
    (model.module if isinstance(model, fd.nn.ParallelModel) else model).eval()
    with torch.no_grad():
        return model(eval_input())  # type: ignore[no-any-return]


def one_device(world: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The reference on one device: the gradient of the mean of every rank's loss (each rank's
    batch normalised by its own statistics), running statistics updated from rank 0's batches
    only (what DDP broadcasts); returns the state dict and the eval output."""
    net = bn_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    bn = net[1]
    for step in range(STEPS):
        for micro in range(2):
            kept = {k: v.clone() for k, v in bn.named_buffers()}
            for r in reversed(range(world)):  # rank 0 last: its update is the one kept
                for k, v in bn.named_buffers():
                    v.copy_(kept[k])
                (net(batches(r, step)[micro]).pow(2).mean() / 2 / world).backward()
        opt.step()
        opt.zero_grad()
    net.eval()
    with torch.no_grad():
        out = net(eval_input())
    return net.state_dict(), out


def buffers_as_ddp() -> dict[str, Any]:
    """fastdist's DataParallel (buffer broadcast on and off), torch's DDP and FSDP2 side by side
    on the same data; every result back to the test."""
    from torch.nn.parallel import DistributedDataParallel

    mesh = fd.connect(timeout=120)
    rank = mesh.rank
    out: dict[str, Any] = {}
    for name, flag in (("fastdist", True), ("off", False)):
        pm = fd.nn.parallelize(bn_net(), mesh, {})
        dp = fd.train.DataParallel(pm, "dp", broadcast_buffers=flag)
        out[name] = (train(pm, dp.no_sync, rank), copy.deepcopy(pm.module.state_dict()))
    ddp = DistributedDataParallel(bn_net())
    out["ddp"] = (train(ddp, ddp.no_sync, rank), copy.deepcopy(ddp.module.state_dict()))
    pm = fd.nn.parallelize(bn_net(), mesh, {})
    dp = fd.train.DataParallel(pm, "dp", engine="ddp")
    out["engine-ddp"] = (train(pm, dp.no_sync, rank), copy.deepcopy(pm.module.state_dict()))
    pm = fd.nn.parallelize(bn_net(), mesh, {})
    dp = fd.train.DataParallel(pm, "dp", engine="fsdp")
    got = train(pm, dp.no_sync, rank)
    out["fsdp"] = (got, {k: v.clone() for k, v in pm.module.named_buffers()})
    # sync_buffers() by hand, with the broadcast off: the buffers agree now
    pm = fd.nn.parallelize(bn_net(), mesh, {})
    dp = fd.train.DataParallel(pm, "dp", broadcast_buffers=False)
    pm(batches(rank, 0)[0]).sum().backward()
    dp.sync_buffers()
    out["by-hand"] = (None, {k: v.clone() for k, v in pm.module.named_buffers()})
    # no persistent floating buffer (a Linear with a rank's own non-persistent cache): no
    # collective, so rank 0 alone runs a forward and sync_buffers() (a broadcast would wait for
    # rank 1 until the mesh's timeout), and the cache stays the rank's own
    lin = torch.nn.Linear(3, 1).to(F64)
    lin.register_buffer("cache", torch.full((2,), float(rank), dtype=F64), persistent=False)
    pm = fd.nn.parallelize(lin, mesh, {})
    dp = fd.train.DataParallel(pm, "dp")
    if rank == 0:
        pm(torch.ones(2, 3, dtype=F64))  # with grad: the next forward's broadcast is due
        pm(torch.ones(2, 3, dtype=F64))
        dp.sync_buffers()
    out["own-cache"] = pm.module.cache.clone()
    out["reference"] = one_device(mesh.size) if rank == 0 else None
    return out


def label_smoothing_on_gloo() -> str:
    """cross_entropy and causal_lm_loss with label smoothing on 2 gloo tp ranks: a padded
    vocabulary (7 real columns over 2 x 4), -100 labels, every reduction; loss and gradient equal
    one device in float64."""
    mesh = fd.connect(tp=2, timeout=120)
    full = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(3), dtype=F64)
    target = torch.tensor([[6, -100, 0, 3], [1, 2, -100, 5], [4, 4, 0, 6]])
    for reduction in ("none", "sum", "mean"):
        ref_in = full[..., :7].clone().requires_grad_()
        ref = F.cross_entropy(
            ref_in.reshape(-1, 7), target.reshape(-1), label_smoothing=0.15, reduction=reduction
        )
        local = full.chunk(2, -1)[mesh.rank].clone().requires_grad_()
        got = fd.nn.cross_entropy(
            local, target, mesh, vocab_size=7, reduction=reduction, label_smoothing=0.15
        )
        torch.testing.assert_close(got, ref.reshape(got.shape), rtol=1e-13, atol=1e-13)
        weights = torch.rand(ref.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
        (ref * weights).sum().backward()
        (got * weights.reshape(got.shape)).sum().backward()
        assert ref_in.grad is not None and local.grad is not None
        grad = torch.nn.functional.pad(ref_in.grad, (0, 1)).chunk(2, -1)[mesh.rank]
        torch.testing.assert_close(local.grad, grad, rtol=1e-13, atol=1e-13)
    lm = fd.nn.causal_lm_loss(
        full.chunk(2, -1)[mesh.rank], target, mesh, vocab_size=7, label_smoothing=0.3
    )
    ref = F.cross_entropy(
        full[:, :-1, :7].reshape(-1, 7), target[:, 1:].reshape(-1), label_smoothing=0.3
    )
    torch.testing.assert_close(lm, ref, rtol=1e-13, atol=1e-13)
    return "ok"
