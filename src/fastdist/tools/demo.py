"""The demo: a tensor-parallel MLP on a simulated dp x tp mesh, checked against one device.

``python -m fastdist demo`` builds ``Mesh({"dp": 2, "tp": 4})``, runs
:func:`tp_mlp` forward and backward on every simulated rank, averages the
weight gradients over ``dp`` with a collective, and compares every rank's
loss and gradients with the same MLP run unsharded on one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange, repeat
from torch import Tensor

from fastdist.core.mesh import Mesh
from fastdist.ops import psum, pvary
from fastdist.sim.simulate import simulate

__all__ = ["tp_mlp", "DemoResult", "run_demo"]


def tp_mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, mesh: Mesh, axis: str = "tp") -> Tensor:
    """Per-rank tensor-parallel MLP ``tanh(x @ W1 + b1) @ W2``: column-parallel, then row-parallel.

    Args (one rank's view; ``P`` = size of ``axis``):
        x: ``(B, D)``, replicated over ``axis``.
        w1: ``(D, H/P)``, this rank's column shard of ``W1``; b1: ``(H/P,)``.
        w2: ``(H/P, D)``, this rank's row shard of ``W2``.

    Returns ``(B, D)``, replicated over ``axis``.
    """
    x = pvary(x, mesh, axis)  # replicated -> per-rank use; backward all-reduces dx
    h = torch.tanh(x @ w1 + b1)  # (B, H/P): this rank's slice of the hidden layer
    return psum(h @ w2, mesh, axis)  # (B, D): sum of partial products; backward is the identity


def _grad(t: Tensor) -> Tensor:
    assert t.grad is not None, "backward() did not reach this tensor"
    return t.grad


@dataclass
class DemoResult:
    """Per-rank losses and the largest deviations from the single-device run."""

    mesh: Mesh
    rank_losses: list[float]
    loss: float
    reference_loss: float
    max_grad_diff: dict[str, float]
    tolerance: float

    @property
    def mismatches(self) -> dict[str, float]:
        """What deviates from the single-device run by more than ``tolerance``: ``"loss"`` and
        ``"grad <name>"`` to their largest absolute difference over all ranks (empty when
        :attr:`ok`)."""
        diffs = {
            "loss": abs(self.loss - self.reference_loss),
            **{f"grad {name}": diff for name, diff in self.max_grad_diff.items()},
        }
        # NaN counts as a mismatch
        return {k: d for k, d in diffs.items() if not d <= self.tolerance}

    @property
    def ok(self) -> bool:
        """Whether every rank's loss and gradients match the single device within ``tolerance``."""
        return not self.mismatches


def run_demo(
    dp: int = 2,
    tp: int = 4,
    *,
    dtype: torch.dtype = torch.float64,
    compile: bool = False,
    seed: int = 0,
) -> DemoResult:
    """Run the TP MLP on a simulated ``dp x tp`` mesh and compare with one device."""
    mesh = Mesh.from_world_size(dp * tp, tp=tp)
    B, D, H = 3, 8, 4 * tp  # per-dp-replica batch, model dim, hidden dim
    gen = torch.Generator().manual_seed(seed)
    x, y = (torch.randn(dp * B, D, generator=gen, dtype=dtype) for _ in range(2))
    W1 = torch.randn(D, H, generator=gen, dtype=dtype) / D**0.5
    b1 = torch.randn(H, generator=gen, dtype=dtype)
    W2 = torch.randn(H, D, generator=gen, dtype=dtype) / H**0.5

    # Single device: the oracle.
    ref = [t.clone().requires_grad_() for t in (x, W1, b1, W2)]
    ref_loss = ((torch.tanh(ref[0] @ ref[1] + ref[2]) @ ref[3] - y) ** 2).mean()
    ref_loss.backward()  # type: ignore[no-untyped-call]

    # Shard onto ranks (rank = dp_index * tp + tp_index): data split over dp, weights over tp.
    xs = repeat(x, "(dp b) d -> (dp tp) b d", dp=dp, tp=tp).clone().requires_grad_()
    ys = repeat(y, "(dp b) d -> (dp tp) b d", dp=dp, tp=tp)
    w1s = repeat(W1, "d (tp h) -> (dp tp) d h", dp=dp, tp=tp).clone().requires_grad_()
    b1s = repeat(b1, "(tp h) -> (dp tp) h", dp=dp, tp=tp).clone().requires_grad_()
    w2s = repeat(W2, "(tp h) d -> (dp tp) h d", dp=dp, tp=tp).clone().requires_grad_()

    def rank_loss(x: Tensor, y: Tensor, w1: Tensor, b1: Tensor, w2: Tensor) -> Tensor:
        out = tp_mlp(x, w1, b1, w2, mesh)
        return ((out - y) ** 2).sum() / (dp * B * D)  # this dp replica's share of the global mean

    step = simulate(rank_loss, mesh)
    if compile:
        step = torch.compile(step, fullgraph=True)
    losses = step(xs, ys, w1s, b1s, w2s)  # [world]
    losses.sum().backward()  # type: ignore[no-untyped-call]  # every rank calls backward on its own loss
    # Data parallelism: sum the weight gradients over dp (the loss is already scaled by the global
    # batch).
    sync = simulate(lambda g: psum(g, mesh, "dp"), mesh)
    grads = {"W1": sync(_grad(w1s)), "b1": sync(_grad(b1s)), "W2": sync(_grad(w2s))}

    dx, dW1, db1, dW2 = (_grad(t) for t in ref)
    expect = {
        "x": repeat(dx, "(dp b) d -> (dp tp) b d", dp=dp, tp=tp),
        "W1": repeat(dW1, "d (tp h) -> (dp tp) d h", dp=dp, tp=tp),
        "b1": repeat(db1, "(tp h) -> (dp tp) h", dp=dp, tp=tp),
        "W2": repeat(dW2, "(tp h) d -> (dp tp) h d", dp=dp, tp=tp),
    }
    got = {"x": _grad(xs), **grads}
    diffs = {k: (got[k] - expect[k]).abs().max().item() for k in expect}
    per_rank = losses.detach()
    # one copy per dp replica
    total = rearrange(per_rank, "(dp tp) -> dp tp", dp=dp)[:, 0].sum().item()
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    return DemoResult(mesh, per_rank.tolist(), total, ref_loss.item(), diffs, tol)
