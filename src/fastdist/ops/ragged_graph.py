"""`fastdist.ragged_all_to_all` on real ranks while ``torch.compile`` traces: the exchange runs
eagerly, outside the graph.

The exchange reads the row counts each rank receives to the host (data-dependent sizes), which
a graph cannot hold: ``torch.compiler.disable`` makes the call one graph break, and with
``fullgraph=True`` torch raises its ``Unsupported`` error carrying the reason and the fix below
(where the size checks raised a guard error on an unbacked size before). This module imports
torch's compiler (dynamo, and with it sympy), which ``import fastdist`` must not:
`fastdist.ops.ragged` imports it only while dynamo traces, when dynamo is loaded anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fastdist.core.mesh import AxisName, Mesh

__all__ = ["ragged_a2a_outside_the_graph"]

#: ``fastdist.ragged_all_to_all`` itself (passed in, so that this module imports nothing back)
Exchange = Callable[..., tuple[Tensor, Tensor]]

#: torch.compiler.disable, typed (torch's is untyped)
_DISABLE: Callable[..., Any] = torch.compiler.disable


def _ragged_a2a_eager(
    exchange: Exchange, x: Tensor, mesh: Mesh, axis: AxisName, send_sizes: Tensor, capacity: int
) -> tuple[Tensor, Tensor]:
    """``exchange`` (`fastdist.ragged_all_to_all`) run eagerly (see the module's docstring)."""
    return exchange(x, mesh, axis, send_sizes, capacity=capacity)


#: the exchange as one graph break, with fastdist's reason and fix in torch's error
ragged_a2a_outside_the_graph: Callable[
    [Exchange, Tensor, Mesh, AxisName, Tensor, int], tuple[Tensor, Tensor]
] = _DISABLE(
    _ragged_a2a_eager,
    reason="fastdist.ragged_all_to_all (and indexed_all_to_all_v, the MoE all_to_all dispatch) "
    "on real ranks reads the row counts each rank receives to the host: data-dependent sizes, "
    "which torch.compile(fullgraph=True) cannot trace. Fix: compile without fullgraph=True (a "
    "graph break at each exchange, the rest compiled), or use the MoE strategy='allgather' (no "
    "data-dependent sizes)",
)
