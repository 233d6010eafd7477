"""Review of fastdist.checkpoint as a new user, on simulated ranks: resumes that must equal the
uninterrupted run, or refuse at the first call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastdist as fd
from fastdist import checkpoint
from fastdist.errors import CheckpointError


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
    ).double()


def dp2(model: torch.nn.Module) -> fd.nn.ParallelModel:
    pm = fd.nn.parallelize(model, fd.Mesh({"dp": 2}), {})
    fd.train.DataParallel(pm)
    return pm


def step(pm: fd.nn.ParallelModel, opt: torch.optim.Optimizer, seed: int, skip: bool) -> None:
    """One step on batch ``seed`` (each dp rank its half); ``skip``: layer 0 gets no gradient
    (a plain optimizer then does not step it: its ``step`` count falls behind)."""
    torch.manual_seed(seed)
    pm(torch.randn(2, 5, 3, dtype=torch.float64)).sum().backward()
    if skip:
        for p in pm.module[0].parameters():
            p.grad = None
    opt.step()
    opt.zero_grad()


def test_zero_refuses_plain_state_whose_steps_differ(tmp_path: Path) -> None:
    """Plain AdamW whose layer 0 skipped the first step (step 2, layer 2: step 3), saved, loaded
    into a ZeroOptimizer (one step count per flat group): before, it silently took the first
    parameter's step (2) for every parameter, and the next step's update of layer 2 used the
    wrong bias correction (9.9e-3 off the uninterrupted run at lr 0.1); now it raises naming
    both counts and the fix. A plain AdamW resumes it exactly."""
    pm = dp2(mlp())
    opt = torch.optim.AdamW(pm.parameters(), lr=0.1)
    for s in range(3):
        step(pm, opt, s, skip=s == 0)
    steps = {n: opt.state[p]["step"].item() for n, p in pm.module.named_parameters()}
    assert steps == {"0.weight": 2.0, "0.bias": 2.0, "2.weight": 3.0, "2.bias": 3.0}
    checkpoint.save(tmp_path, pm, opt)
    step(pm, opt, 3, skip=False)
    want = pm.state_dict()

    zpm = dp2(mlp())
    zero = fd.train.ZeroOptimizer(zpm, torch.optim.AdamW, lr=0.1)
    with pytest.raises(CheckpointError, match=r"'step' differs.*: 2\.0.*: 3\.0.*Fix: resume"):
        checkpoint.load(tmp_path, zpm, zero)

    again = dp2(mlp())
    plain = torch.optim.AdamW(again.parameters(), lr=0.1)
    checkpoint.load(tmp_path, again, plain)
    step(again, plain, 3, skip=False)
    got = again.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_zero_resumes_plain_state_whose_steps_agree(tmp_path: Path) -> None:
    """The same check lets an ordinary plain checkpoint through: ZeRO resumes it bitwise."""
    pm = dp2(mlp())
    opt = torch.optim.AdamW(pm.parameters(), lr=0.1)
    for s in range(2):
        step(pm, opt, s, skip=False)
    checkpoint.save(tmp_path, pm, opt)
    step(pm, opt, 2, skip=False)
    want = pm.state_dict()
    zpm = dp2(mlp())
    zero = fd.train.ZeroOptimizer(zpm, torch.optim.AdamW, lr=0.1)
    checkpoint.load(tmp_path, zpm, zero)
    step(zpm, zero, 2, skip=False)
    got = zpm.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-14, atol=1e-14)
