"""A context-parallel attention processor while ``torch.compile`` traces: it runs eagerly,
outside the graph.

The processor's attention call is swapped for the split attention (`fastdist.nn.styles.context`):
by re-binding diffusers' ``dispatch_attention_fn`` for the call, or under an `AttentionSwap`
(a ``TorchFunctionMode``). Traced by dynamo, the mode cannot be followed through the
processor's tensor methods (graph breaks at each one), and the graphs compiled between those
breaks ran with the mode still active: with ``backend="eager"`` (graphs of torch functions) the
mode swapped each graph's already-split attention a second time, a wrong output with no error.
``torch.compiler.disable`` makes each processor call one graph break, eager inside; the rest of
the model compiles. This module imports torch's compiler (dynamo), which ``import fastdist``
must not: `fastdist.nn.styles.context` imports it only while dynamo traces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["attention_outside_the_graph"]

#: torch.compiler.disable, typed (torch's is untyped)
_DISABLE: Callable[..., Any] = torch.compiler.disable


def _processor_eager(processor: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``processor(*args, **kwargs)`` run eagerly (see the module's docstring)."""
    return processor(*args, **kwargs)


#: a context-parallel processor's call as one graph break, with the reason in torch's error
attention_outside_the_graph: Callable[..., Any] = _DISABLE(
    _processor_eager,
    reason="fastdist's context-parallel attention processors swap the attention call of an "
    "unmodified diffusers processor, which dynamo cannot trace: each runs eagerly, one graph "
    "break per attention. Fix: compile without fullgraph=True (the rest of the model compiles)",
)
