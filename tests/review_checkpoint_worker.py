"""Rank functions for tests/test_review_checkpoint_gloo.py (importable by run_on_gloo)."""

from __future__ import annotations

from typing import Any

import torch

import fastdist as fd
from fastdist import checkpoint


def conv_bn() -> torch.nn.Module:
    """A tiny float64 conv net with BatchNorm (running statistics: persistent buffers)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 4 * 4, 3),
    ).double()


def bn_dp2(path: str) -> dict[str, Any]:
    """dp=2 real ranks, each its own batch, so BatchNorm's running statistics differ per rank:
    save (must refuse), then average them over dp and save again. Returns each rank's statistics
    before and after averaging, and what the first save said."""
    mesh = fd.connect(dp=2, timeout=60)
    pm = fd.nn.parallelize(conv_bn(), mesh, {})
    fd.train.DataParallel(pm)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    torch.manual_seed(1 + mesh.rank)
    for _ in range(2):
        pm(torch.randn(3, 2, 6, 6, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()
    bn = pm.module[1]
    out: dict[str, Any] = {"own": {k: v.clone() for k, v in bn.state_dict().items()}}
    try:
        checkpoint.save(path, pm, opt)
        out["first save"] = "written"
    except fd.errors.CheckpointError as e:
        out["first save"] = str(e)
    with torch.no_grad():
        for buf in (bn.running_mean, bn.running_var):
            torch.distributed.all_reduce(buf)
            buf /= 2
    checkpoint.save(path, pm, opt)
    out["synced"] = {k: v.clone() for k, v in bn.state_dict().items()}
    return out
