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
    """dp=2 real ranks, each its own batches, so BatchNorm's running statistics differ per rank;
    save. Returns this rank's BatchNorm state."""
    mesh = fd.connect(dp=2, timeout=60)
    pm = fd.nn.parallelize(conv_bn(), mesh, {})
    fd.train.DataParallel(pm)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    torch.manual_seed(1 + mesh.rank)
    for _ in range(2):
        pm(torch.randn(3, 2, 6, 6, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(path, pm, opt)
    return {k: v.clone() for k, v in pm.module[1].state_dict().items()}
