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

import functools
import itertools
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fastdist.core.mesh import AxisName, Mesh
from fastdist.ops import psum

__all__ = ["BUCKET_BYTES", "PENDING", "PendingSums", "deferred_pvary", "deferred_pvary_many"]

#: the largest flat buffer one collective sums (DDP's default bucket_cap_mb is 25)
BUCKET_BYTES = 25 * 1024 * 1024


class PendingSums:
    """The partial gradients kept for the end of each running backward (`PENDING`).

    Process-wide, as the autograd engine is; each backward (graph task) has its own entries and
    its own end-of-backward callback, so two backwards running at once (two threads, two models)
    never sum or flush each other's. ``engine_seen``: DDP or FSDP2 was seen in this process
    (their hooks read gradients during the backward: no deferring from then on).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.order = itertools.count()
        #: graph task id -> id(parameter) -> [order, parameter, mesh, axes, partial gradient]
        #: (order: (forward order of the call, index of the parameter in it))
        self.tasks: dict[int, dict[int, list[Any]]] = {}
        #: graph task id -> the thread its backward kept partials on
        self.threads: dict[int, int] = {}
        self.engine_seen = False

    def keep(
        self, task: int, order: tuple[int, int], p: Tensor, mesh: Mesh, axes: Any, g: Tensor
    ) -> None:
        """Keep ``p``'s partial ``g`` for the end of backward ``task`` (added to an earlier
        partial of the same parameter), queuing the task's flush at its first entry."""
        with self.lock:
            entries = self.tasks.get(task)
            if entries is None:
                entries = self.tasks[task] = {}
                self.threads[task] = threading.get_ident()
                torch.autograd.Variable._execution_engine.queue_callback(
                    functools.partial(_flush, self, task)
                )
            kept = entries.get(id(p))
            if kept is None:
                entries[id(p)] = [order, p, mesh, axes, g]
            else:  # the parameter used again in the same forward: its partials add up
                kept[4] = kept[4] + g

    def take(self, task: int) -> list[Any]:
        """The task's kept entries, in forward order, forgotten here."""
        with self.lock:
            self.threads.pop(task, None)
            return sorted(self.tasks.pop(task, {}).values(), key=lambda e: e[0])

    def pending(self) -> int:
        """How many parameters' partial gradients wait for the end of a backward."""
        return sum(len(e) for e in self.tasks.values())

    def stale(self) -> bool:
        """Whether partials kept on this thread wait (a forward outside any backward sees only
        those of a backward that raised: this thread's backwards have ended)."""
        me = threading.get_ident()
        return any(t == me for t in self.threads.values())

    def drop(self) -> None:
        """Forget the partial gradients this thread's backwards left when they raised (their
        end-of-backward callback never ran); other threads' running backwards keep theirs."""
        me = threading.get_ident()
        with self.lock:
            for task in [k for k, t in self.threads.items() if t == me]:
                self.threads.pop(task)
                self.tasks.pop(task, None)


#: the one registry of kept partial gradients (the autograd engine is process-wide)
PENDING = PendingSums()


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
    return deferred_pvary_many((p,), mesh, axes)[0]


def deferred_pvary_many(
    ps: Sequence[Tensor], mesh: Mesh, axes: Sequence[str]
) -> tuple[Tensor, ...]:
    """`deferred_pvary` of each of ``ps`` (leaf parameters), in one autograd node: one Python
    call forward and one backward for all of them (a module's weight and bias). Each
    parameter's gradient is kept, or summed per parameter where `deferred_pvary`'s would be, on
    its own; a parameter whose view the forward did not use gets no gradient (as with
    `deferred_pvary`: ``.grad`` stays as it was). The kept gradients sum in the order of the
    calls, then of ``ps``."""
    return _Deferred.apply(mesh, tuple(axes), next(PENDING.order), *ps)  # type: ignore[no-untyped-call,no-any-return]


class _Deferred(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, mesh: Mesh, axes: tuple[str, ...], order: int, *ps: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.ps, ctx.mesh, ctx.axes, ctx.order = ps, mesh, axes, order
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None
        return tuple(p.view_as(p) for p in ps)

    @staticmethod
    def backward(ctx: Any, *gs: Tensor | None) -> tuple[Tensor | None, ...]:
        out: list[Tensor | None] = [None, None, None]
        recording = torch.is_grad_enabled()
        edges = ctx.next_functions  # this node's: the parameters' gradient accumulators
        for i, (p, g) in enumerate(zip(ctx.ps, gs)):
            if g is None:
                out.append(None)
            elif recording or _read_during_backward(p) or not _accumulates(p, edges[i][0]):
                for axis in ctx.axes:  # pvary's own backward, per parameter
                    g = psum(g, ctx.mesh, axis)
                out.append(g)
            else:
                task = torch._C._current_graph_task_id()
                PENDING.keep(task, (ctx.order, i), p, ctx.mesh, ctx.axes, g)
                out.append(None)
        return tuple(out)


def _read_during_backward(p: Tensor) -> bool:
    """Hooks on ``p`` that see its gradient before the backward ends (fastdist DataParallel)."""
    return bool(getattr(p, "_backward_hooks", None)) or bool(
        getattr(p, "_post_accumulate_grad_hooks", None)
    )


def _accumulates(p: Tensor, node: Any = None) -> bool:
    """Whether the running backward accumulates into ``p.grad`` (not ``autograd.grad``);
    ``node``: ``p``'s gradient accumulator where the caller has it (else looked up)."""
    if node is None:
        node = torch.autograd.graph.get_gradient_edge(p).node
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # torch refuses a leaf under autograd.grad: nothing goes into .grad
        return False


def _flush(pending: PendingSums, task: int) -> None:
    """End of backward ``task``: sum its kept partial gradients, bucketed, into ``.grad``."""
    kept = pending.take(task)
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
