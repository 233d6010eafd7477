"""A domain-parallel region while ``torch.compile`` traces: it runs eagerly, outside the graph.

The region's functional guard (`fastdist.nn.domain.guard.Guard`, a ``TorchFunctionMode``) is
pushed by the region's forward pre-hook and popped by its forward hook. Traced by dynamo, the
region breaks the graph (the guard's bookkeeping), and the graphs compiled after the break ran
with the guard still on the mode stack: with ``backend="eager"`` (graphs of torch functions) the
guard read each graph's own ops a second time, and refused fastdist's ``pvary`` of every
parameter as "a direct aten call" of the model (and would run a traced ``F.interpolate``
domain-parallel a second time). ``torch.compiler.disable`` makes the region's pre-hook, forward
and hook eager, one graph break each; the rest of the model compiles, with every backend, as
torch.compile does around the context-parallel attention (`fastdist.nn.styles.context_graph`).
This module imports torch's compiler (dynamo), which ``import fastdist`` must not:
`fastdist.nn.domain.style` imports it only while dynamo traces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["region_outside_the_graph"]

#: torch.compiler.disable, typed (torch's is untyped)
_DISABLE: Callable[..., Any] = torch.compiler.disable


def _region_eager(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` run eagerly (see the module's docstring)."""
    return fn(*args, **kwargs)


#: a domain-parallel region's pre-hook, forward or hook as one graph break, with the reason
region_outside_the_graph: Callable[..., Any] = _DISABLE(
    _region_eager,
    reason="fastdist's DomainParallel region runs under its functional guard (a "
    "TorchFunctionMode) that compiled graphs would run under a second time: the region runs "
    "eagerly, one graph break at its start, its forward and its end. Fix: compile without "
    "fullgraph=True (the rest of the model compiles)",
)
