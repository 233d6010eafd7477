"""Row padding shared by the uneven ops (``fastdist.ops.uneven``) and the transports that pad
uneven collectives to even ones (``fastdist.comm.transports``)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pad_rows"]


def pad_rows(x: Tensor, rows: int, dim: int = 0) -> Tensor:
    """``x`` with zeros appended along ``dim`` up to ``rows``.

    Args:
        x: the tensor.
        rows: its size along ``dim`` afterwards (at least ``x.shape[dim]``).
        dim: the dimension to pad.

    Returns:
        ``x`` itself when it has ``rows`` already, else a padded copy.

    >>> import torch
    >>> pad_rows(torch.ones(1, 2), 3).tolist()
    [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    """
    if x.shape[dim] == rows:
        return x
    pad = list(x.shape)
    pad[dim] = rows - x.shape[dim]
    return torch.cat([x, x.new_zeros(pad)], dim=dim)
