"""The gradient sums of ``pvary``'d parameters, deferred to the end of backward and bucketed.

``pvary``'s backward is a ``psum`` of the gradient over the axis: one collective per parameter
per backward. `deferred_pvary` is ``pvary`` of a parameter whose summed gradient is only ever
added into ``.grad``: its backward keeps this rank's partial gradient, and a callback queued on
the autograd engine sums all kept partials at the end of the backward in few flat collectives
(grouped by mesh, axes, dtype and device; buckets of about 25 MB, like DDP), then adds each
parameter's slice into its ``.grad``. The result is the same sum, added to ``.grad`` at the end of
the backward instead of when the parameter's own node runs.

That is exact only where nothing reads the parameter's gradient during the backward and the
backward accumulates into ``.grad``; `deferred_pvary`'s backward checks, and falls back to the
per-parameter ``psum`` returned to autograd, when:

* the engine does not run the parameter's gradient accumulator (``torch.autograd.grad``, or
  ``backward(inputs=...)`` without it): the gradient is returned, as ``pvary``'s;
* the backward records a graph (``create_graph=True``);
* the parameter has hooks that read its gradient during backward (``register_hook``,
  ``register_post_accumulate_grad_hook``: fastdist's ``DataParallel``).

The caller (`fastdist.nn.pvary_sites`) uses it only on real ranks, outside ``torch.compile`` and
replication checks,
on leaf parameters, and never once DDP or FSDP2 has been seen (their C++ / module hooks read the
gradient before the end of backward). Every kept partial of one backward is summed in the
order the forward applied `deferred_pvary` (the same program on every rank: the same order).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fastdist.core.mesh import AxisName, Mesh
from fastdist.ops import psum

__all__ = ["BUCKET_BYTES", "deferred_pvary", "pending_sums", "drop_pending"]

#: the largest flat buffer one collective sums (DDP's default bucket_cap_mb is 25)
BUCKET_BYTES = 25 * 1024 * 1024

_ORDER = itertools.count()
_LOCK = threading.Lock()
# id(parameter) -> [order, parameter, mesh, axes, summed-so-far partial gradient]
_PENDING: dict[int, list[Any]] = {}
_QUEUED = [False]


def deferred_pvary(p: Tensor, mesh: Mesh, axes: Sequence[str]) -> Tensor:
    """``pvary(p)`` over each of ``axes`` whose gradient sum is deferred and bucketed.

    Forward: ``p`` (a view). Backward: this rank's gradient is kept, summed over ``axes`` with
    the other kept gradients at the end of the backward, and added into ``p.grad``.

    >>> import torch, fastdist as fd
    >>> p = torch.nn.Parameter(torch.ones(2))
    >>> deferred_pvary(p, fd.Mesh({"sp": 1}), ("sp",)).sum().backward()  # one rank: the sum is p's
    >>> p.grad
    tensor([1., 1.])
    """
    return _Deferred.apply(p, mesh, tuple(axes), next(_ORDER))  # type: ignore[no-untyped-call,no-any-return]


def pending_sums() -> int:
    """How many parameters' partial gradients wait for the end of the current backward."""
    return len(_PENDING)


def drop_pending() -> None:
    """Forget partial gradients left by a backward that raised (its end-of-backward callback
    never ran); called when a new forward starts outside any backward."""
    with _LOCK:
        _PENDING.clear()
        _QUEUED[0] = False


class _Deferred(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, p: Tensor, mesh: Mesh, axes: tuple[str, ...], order: int) -> Tensor:
        ctx.p, ctx.mesh, ctx.axes, ctx.order = p, mesh, axes, order
        return p.view_as(p)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None, None, None]:
        p: Tensor = ctx.p
        if torch.is_grad_enabled() or _read_during_backward(p) or not _accumulates(p):
            for axis in ctx.axes:  # pvary's own backward, per parameter
                g = psum(g, ctx.mesh, axis)
            return g, None, None, None
        with _LOCK:
            kept = _PENDING.get(id(p))
            if kept is None:
                _PENDING[id(p)] = [ctx.order, p, ctx.mesh, ctx.axes, g]
            else:  # the parameter used again in the same forward: its partials add up
                kept[4] = kept[4] + g
            if not _QUEUED[0]:
                _QUEUED[0] = True
                torch.autograd.Variable._execution_engine.queue_callback(_flush)
        return None, None, None, None


def _read_during_backward(p: Tensor) -> bool:
    """Hooks on ``p`` that see its gradient before the backward ends (fastdist DataParallel)."""
    return bool(getattr(p, "_backward_hooks", None)) or bool(
        getattr(p, "_post_accumulate_grad_hooks", None)
    )


def _accumulates(p: Tensor) -> bool:
    """Whether the running backward accumulates into ``p.grad`` (not ``autograd.grad``)."""
    node = torch.autograd.graph.get_gradient_edge(p).node
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # torch refuses a leaf under autograd.grad: nothing goes into .grad
        return False


def _flush() -> None:
    """End of backward: sum the kept partial gradients, bucketed, and add them into ``.grad``."""
    with _LOCK:
        kept = sorted(_PENDING.values(), key=lambda e: e[0])
        _PENDING.clear()
        _QUEUED[0] = False
    groups: dict[tuple[int, tuple[str, ...], torch.dtype, torch.device], list[Any]] = {}
    for e in kept:
        groups.setdefault((id(e[2]), e[3], e[4].dtype, e[4].device), []).append(e)
    with torch.no_grad():
        for entries in groups.values():
            for bucket in _buckets(entries):
                _sum_bucket(bucket)


def _buckets(entries: list[Any]) -> list[list[Any]]:
    """Consecutive runs of ``entries`` of at most `BUCKET_BYTES` each (one larger alone)."""
    out: list[list[Any]] = [[]]
    size = 0
    for e in entries:
        n = e[4].numel() * e[4].element_size()
        if out[-1] and size + n > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(e)
        size += n
    return out


def _sum_bucket(bucket: list[Any]) -> None:
    """One flat collective over the bucket's axes; each parameter's slice into its ``.grad``."""
    mesh: Mesh = bucket[0][2]
    axes: tuple[str, ...] = bucket[0][3]
    flat = torch.cat([e[4].reshape(-1) for e in bucket])  # [sum of numels]
    axis: AxisName = axes[0] if len(axes) == 1 else axes
    flat = psum(flat, mesh, axis)
    offset = 0
    for e in bucket:
        p: Tensor = e[1]
        n = e[4].numel()
        g = flat[offset : offset + n].view_as(e[4])
        offset += n
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)
