"""`Staged`: a model split into pipeline stages, as a checkpoint sees it.

A protocol (`fastdist.train.Pipeline` satisfies it; this layer does not import `fastdist.train`).
It lives apart from `fastdist.checkpoint.planner` so that `fastdist.checkpoint.save` / `load` can
tell a pipeline from a model without importing ``torch.distributed.checkpoint`` (about a second
with sympy, imported on the first distributed save or load).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from fastdist.core.mesh import Mesh
from fastdist.nn.parallelize import ParallelModel

__all__ = ["Staged"]


@runtime_checkable
class Staged(Protocol):
    """A model split into pipeline stages (`fastdist.train.Pipeline`): the stages this process
    holds, each a `fastdist.nn.ParallelModel` over the same stage mesh holding part of the whole
    model's parameters under the model's own names; ``mesh`` is the whole mesh (with the
    pipeline axis ``axis``); ``tied``: weights of which the first and the last stage each hold a
    copy (tied embeddings), written once under the first stage's name and read into both."""

    mesh: Mesh
    axis: str

    @property
    def tied(self) -> Mapping[str, str]:
        """A weight the first and last stage both hold: the last's name -> the first's (read
        only here, so a ``dict`` attribute satisfies it)."""
        ...

    @property
    def stages(self) -> Mapping[int, ParallelModel]:
        """Stage index -> the stage's model, for the stages held here."""
        ...
