"""Dynamic loss scaling (`fastdist.train.GradScaler`) against torch's GradScaler on
one device, in float64, with one rank's gradient overflowing: every rank must skip that step
together and keep the one-device weights and scale (with clipping after ``unscale_`` too).

On real ranks torch's own scaler checks each process's gradients alone: a tensor-parallel
shard that overflows on one rank makes that rank skip and back off while the other steps
(shown below). A `ZeroOptimizer` under torch's scaler is refused with a fastdist error.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import fastdist as fd
from fastdist.train.grad_scaler import GradScaler
from tests import grad_scaler_worker as w
from tests.dist_harness import run_on_gloo

TOL = {"rtol": 1e-10, "atol": 1e-12}
PLAN = {"0": fd.nn.ColwiseParallel(input="replicated"), "2": fd.nn.RowwiseParallel()}


def _simulated_run(
    mesh: fd.Mesh, optimizer: str, clip: float | None, scaler_kind: str = "fastdist"
) -> tuple[fd.nn.ParallelModel, list[float], list[torch.Tensor]]:
    """A simulated run: the last tp rank's gradient of ``0.weight`` (its block's first row) set
    to inf after the backward of step ``BAD_STEP`` (on each dp replica of it: the gradients are
    reduced over dp by then)."""
    tp, dp = mesh.shape.get("tp", 1), mesh.shape.get("dp", 1)
    pm = fd.nn.parallelize(w.model(), mesh, PLAN if tp > 1 else {})
    if dp > 1:
        fd.train.DataParallel(pm, "dp")
    opt: Any = (
        fd.train.ZeroOptimizer(pm, torch.optim.AdamW, lr=1e-2)
        if optimizer == "zero"
        else torch.optim.AdamW(pm.parameters(), lr=1e-2)
    )
    scaler: Any = (
        GradScaler(pm, "cpu", init_scale=2.0**10)
        if scaler_kind == "fastdist"
        else torch.amp.GradScaler("cpu", init_scale=2.0**10)
    )
    coords = [mesh.coords(r) for r in range(mesh.size)]
    scales, norms = [], []
    for step in range(w.STEPS):
        xs = w.inputs(step, dp)
        x = torch.stack([xs[c.get("dp", 0)] for c in coords])  # each rank its dp rank's batch
        loss = pm(x).pow(2).mean(dim=(1, 2)).sum()
        scaler.scale(loss).backward()
        if step == w.BAD_STEP:
            for r, c in enumerate(coords):
                if c.get("tp", 0) == tp - 1:
                    pm.module[0].weight.grad[r, 0, 0] = float("inf")
        if clip is not None:
            scaler.unscale_(opt)
            norms.append(fd.nn.clip_grad_norm_(pm, clip))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(float(scaler.get_scale()))
    return pm, scales, norms


def _one_device_injected(
    dp: int, tp: int, clip: float | None
) -> tuple[Any, list[float], list[Any]]:
    """One device, the whole batch, torch's GradScaler, the same element overflowing."""
    ref = w.model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scales, norms = [], []
    for step in range(w.STEPS):
        scaler.scale(ref(torch.cat(w.inputs(step, dp))).pow(2).mean()).backward()
        if step == w.BAD_STEP:  # the last rank's block's first row (its own copy under dp)
            ref[0].weight.grad[(tp - 1) * (w.HIDDEN // tp), 0] = float("inf")
        if clip is not None:
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(float(scaler.get_scale()))
    return ref, scales, norms


@pytest.mark.parametrize(
    "shape, optimizer, clip",
    [
        ({"tp": 2}, "adamw", None),
        ({"tp": 2}, "adamw", 0.05),
        ({"dp": 2, "tp": 2}, "adamw", 0.05),
        ({"dp": 2, "tp": 2}, "zero", 0.05),
        ({"dp": 2}, "zero", None),
    ],
)
def test_simulated_overflow_skips_every_rank(
    shape: dict[str, int], optimizer: str, clip: float | None
) -> None:
    mesh = fd.Mesh(shape)
    pm, scales, norms = _simulated_run(mesh, optimizer, clip)
    ref, want_scales, want_norms = _one_device_injected(
        mesh.shape.get("dp", 1), mesh.shape.get("tp", 1), clip
    )
    assert scales == want_scales == [2.0**10, 2.0**9, 2.0**9]  # backed off once, together
    for got, want in zip(norms, want_norms):
        torch.testing.assert_close(got, want.expand(mesh.size), **TOL)
    state = pm.state_dict()  # raises if replicas diverged
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), **TOL, msg=name)


def test_torch_scaler_with_zero_is_refused() -> None:
    """torch's scaler finds no gradient in the flat chunks: refused at its first step, with the
    fix (was torch's bare 'No inf checks were recorded for this optimizer.')."""
    with pytest.raises(fd.MeshError, match=r"ZeroOptimizer\.step.*fastdist\.train\.GradScaler"):
        _simulated_run(fd.Mesh({"dp": 2}), "zero", None, scaler_kind="torch")
    with pytest.raises(fd.MeshError, match=r"ZeroOptimizer\.step.*fastdist\.train\.GradScaler"):
        _simulated_run(fd.Mesh({"dp": 2}), "zero", 0.05, scaler_kind="torch")  # unscale_ first


def test_scaler_needs_a_mesh() -> None:
    with pytest.raises(fd.MeshError, match="GradScaler: Linear is not a Mesh"):
        GradScaler(torch.nn.Linear(2, 2), "cpu")


def test_disabled_scaler_steps_as_torch() -> None:
    mesh = fd.Mesh({"dp": 2})
    pm = fd.nn.parallelize(torch.nn.Linear(3, 2).double(), mesh, {})
    fd.train.DataParallel(pm, "dp")
    opt = fd.train.ZeroOptimizer(pm, torch.optim.SGD, lr=0.1)
    before = copy.deepcopy(pm.state_dict())
    scaler = GradScaler(pm, "cpu", enabled=False)
    scaler.scale(pm(torch.randn(2, 4, 3, dtype=torch.float64)).sum()).backward()
    scaler.step(opt)
    assert not torch.equal(pm.state_dict()["weight"], before["weight"])


def _check(out: dict[str, Any], what: str) -> None:
    assert out["error"] is None, (what, out["error"])
    assert out["scales"] == out["want_scales"] == [2.0**10, 2.0**9, 2.0**9], what
    torch.testing.assert_close(
        torch.tensor(out["norms"]), torch.tensor(out["want_norms"]), **TOL, msg=what
    )
    assert isinstance(out["whole"], dict), (what, out["whole"])
    for name, p in out["want"].items():
        torch.testing.assert_close(out["whole"][name], p, **TOL, msg=f"{what} {name}")


def test_gloo_tp_shard_overflow_on_one_rank() -> None:
    """tp=2 on 2 gloo processes, the last rank's column-parallel shard overflowing: with
    fastdist's scaler (with and without clipping) both ranks skip and back off together, equal
    to one device; with torch's scaler the ranks' scales and replicated weights diverge."""
    cases = [
        ("none", "adamw", "fastdist", None),
        ("none", "adamw", "fastdist", 0.05),
        ("none", "adamw", "torch", None),
    ]
    ranks = run_on_gloo(w.scaled_runs, 2, 2, cases)
    for r, outs in enumerate(ranks):
        _check(outs[0], f"rank {r} tp2")
        _check(outs[1], f"rank {r} tp2 clip")
    torch_runs = [outs[2] for outs in ranks]  # the silent divergence fastdist's scaler fixes
    assert torch_runs[0]["scales"] == [2.0**10] * 3 != torch_runs[1]["scales"]
    assert "ReplicaMismatchError" in str(torch_runs[0]["whole"])


def test_gloo_dp_engines() -> None:
    """dp=2 on 2 gloo processes: ZeRO-1 with clipping, FSDP2 and fastdist's reducer under
    fastdist's scaler equal one device; torch's scaler with ZeRO-1 raises the fastdist error."""
    cases = [
        ("fastdist", "zero", "fastdist", 0.05),
        ("fastdist", "adamw", "fastdist", 0.05),
        ("fsdp", "adamw", "fastdist", None),
        ("fastdist", "zero", "torch", None),
    ]
    ranks = run_on_gloo(w.scaled_runs, 2, 1, cases)
    for r, outs in enumerate(ranks):
        for case, out in zip(cases[:3], outs):
            _check(out, f"rank {r} dp2 {case}")
        assert "MeshError" in outs[3]["error"] and "fastdist.train.GradScaler" in outs[3]["error"]


def test_gloo_dp2_tp2() -> None:
    """dp2 x tp2 on 4 gloo processes, the overflow in rank 3's tp shard: fastdist's scaler with
    ZeRO-1 and with FSDP2 (DTensors over dp of each tp block), both with clipping, equals one
    device; torch's scaler diverges over tp with FSDP2 too (its DTensors agree over dp only)."""
    cases = [
        ("fastdist", "zero", "fastdist", 0.05),
        ("fsdp", "adamw", "fastdist", 0.05),
        ("fsdp", "adamw", "torch", None),
    ]
    ranks = run_on_gloo(w.scaled_runs, 4, 2, cases, timeout=300)
    for r, outs in enumerate(ranks):
        for case, out in zip(cases[:2], outs):
            _check(out, f"rank {r} dp2 x tp2 {case}")
    assert [outs[2]["scales"][-1] for outs in ranks] == [2.0**10, 2.0**9, 2.0**10, 2.0**9]
    assert "ReplicaMismatchError" in str(ranks[0][2]["whole"])
