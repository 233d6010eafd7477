"""Rank functions for tests/test_grad_scaler.py's gloo runs (importable by
fastdist.testing.run_on_gloo): dynamic loss scaling on real ranks against one device."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import fastdist as fd
from fastdist.train.grad_scaler import GradScaler

#: steps of a run; the step that overflows on one rank
STEPS, BAD_STEP = 3, 1
BATCH, D_IN, HIDDEN = 3, 4, 8


def model() -> nn.Module:
    """The single-device model (float64, the same on every rank)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, D_IN)).double()


def inputs(step: int, dp: int) -> list[torch.Tensor]:
    """Each data rank's batch of ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(BATCH, D_IN, generator=g, dtype=torch.float64) for _ in range(dp)]


def overflow_at(out: torch.Tensor, row: int, col: int) -> None:
    """Put an inf into the gradient of ``out`` at ``[row, col]`` (an fp16 overflow in the first
    layer's backward: its weight and bias gradients become non-finite there)."""

    def hook(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g[row, col] = float("inf")
        return g

    out.register_hook(hook)


def one_device(
    dp: int, tp: int, clip: float | None
) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """The reference: one device, the whole batch, the mean loss, torch's GradScaler; the
    overflow at the element the injecting rank (the last) holds. Returns (weights, scales,
    clipped norms)."""
    ref = model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scales, norms = [], []
    for step in range(STEPS):
        x = torch.cat(inputs(step, dp))
        handle = None
        if step == BAD_STEP:  # the last rank's first row (dp) / first column of its block (tp)
            row, col = (dp - 1) * BATCH, (tp - 1) * (HIDDEN // tp)
            handle = ref[0].register_forward_hook(
                lambda m, a, o, r=row, c=col: overflow_at(o, r, c)
            )
        loss = ref(x).pow(2).mean()
        scaler.scale(loss).backward()
        if handle is not None:
            handle.remove()
        if clip is not None:
            scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(float(scaler.get_scale()))
    return {n: p.detach().clone() for n, p in ref.named_parameters()}, scales, norms


def scaled_run(
    tp: int, engine: str, optimizer: str, scaler_kind: str, clip: float | None = None
) -> dict[str, Any]:
    """`run_case` on a fresh mesh (dp = world / tp)."""
    return run_case(fd.connect(tp=tp, timeout=60), engine, optimizer, scaler_kind, clip)


def scaled_runs(tp: int, cases: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """`run_case` of each ``(engine, optimizer, scaler_kind, clip)`` on one mesh."""
    mesh = fd.connect(tp=tp, timeout=60)
    return [run_case(mesh, *case) for case in cases]


def run_case(
    mesh: fd.Mesh, engine: str, optimizer: str, scaler_kind: str, clip: float | None
) -> dict[str, Any]:
    """A run on real ranks, the last rank's first-layer gradient overflowing at step
    ``BAD_STEP``. Returns this rank's local weights, scales, clipped norms, whole weights where
    the replicas agree (else the error), the error a step raised, and the one-device
    reference."""
    dp, tp = mesh.axis_size("dp"), mesh.axis_size("tp")
    plan = {"0": fd.nn.ColwiseParallel(input="replicated"), "2": fd.nn.RowwiseParallel()}
    pm = fd.nn.parallelize(model(), mesh, plan if tp > 1 else {})
    if engine != "none":
        fd.train.DataParallel(pm, "dp", engine=engine)
    opt: Any = (
        fd.train.ZeroOptimizer(pm, torch.optim.AdamW, lr=1e-2)
        if optimizer == "zero"
        else torch.optim.AdamW(pm.parameters(), lr=1e-2)
    )
    scaler: Any = (
        torch.amp.GradScaler("cpu", init_scale=2.0**10)
        if scaler_kind == "torch"
        else GradScaler(pm, "cpu", init_scale=2.0**10)
    )
    me = mesh.coords(mesh.rank)
    last = mesh.rank == mesh.size - 1
    first = pm.module[0]
    scales, norms, error = [], [], None
    try:
        for step in range(STEPS):
            x = inputs(step, dp)[me["dp"]]
            handle = None
            if step == BAD_STEP and last:
                handle = first.register_forward_hook(lambda m, a, o: overflow_at(o, 0, 0))
            loss = pm(x).pow(2).mean()
            scaler.scale(loss).backward()
            if handle is not None:
                handle.remove()
            if clip is not None:
                scaler.unscale_(opt)
                norms.append(float(fd.nn.clip_grad_norm_(pm, clip)))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(float(scaler.get_scale()))
    except Exception as e:  # noqa: BLE001 - the test reads the error
        error = f"{type(e).__name__}: {e}"
    local = {n: p.detach().clone() for n, p in pm.named_parameters()}
    local = {n: (t.to_local() if hasattr(t, "to_local") else t) for n, t in local.items()}
    try:
        whole: Any = {k: v.clone() for k, v in pm.state_dict().items()}
    except Exception as e:  # noqa: BLE001 - replicas that diverged
        whole = f"{type(e).__name__}: {e}"
    want, want_scales, want_norms = one_device(dp, tp, clip)
    return {
        "local": local,
        "scales": scales,
        "norms": norms,
        "whole": whole,
        "error": error,
        "want": want,
        "want_scales": want_scales,
        "want_norms": want_norms,
    }
