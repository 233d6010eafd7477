"""Losses over a vocabulary split across ranks."""

from __future__ import annotations

import torch
from torch import Tensor

from ..collectives import axis_index, pmax, psum
from ..mesh import Mesh

__all__ = ["vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, mesh: Mesh, axis: str = "tp") -> Tensor:
    """Per-token cross entropy of logits whose vocabulary (last dim) is split over ``axis``.

    ``logits``: (..., vocab/n), this rank's columns; ``target``: (...) global ids, replicated.
    Returns the loss per token, replicated. No rank ever holds the whole vocabulary.
    Gradient: softmax minus one-hot, on this rank's columns.
    """
    n_local = logits.shape[-1]
    top = pmax(logits.detach().amax(-1), mesh, axis)  # (...): a shift for stability, no gradient needed
    shifted = logits - top.unsqueeze(-1)
    log_total = psum(shifted.exp().sum(-1), mesh, axis).log()  # log sum over the whole vocabulary
    start = axis_index(mesh, axis) * n_local
    mine = (target >= start) & (target < start + n_local)
    picked = shifted.gather(-1, torch.where(mine, target - start, 0).unsqueeze(-1)).squeeze(-1)
    return log_total - psum(torch.where(mine, picked, 0.0), mesh, axis)
