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
import operator
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
        #: graph task id -> forward order of a `deferred_pvary_many` call -> [order, its kept
        #: parameters, their partial gradients, mesh, axes, how many calls were kept before]
        self.tasks: dict[int, dict[int, list[Any]]] = {}
        #: graph task id -> the thread its backward kept partials on
        self.threads: dict[int, int] = {}
        self.engine_seen = False

    def keep(
        self,
        task: int,
        order: int,
        ps: tuple[Tensor, ...],
        gs: tuple[Tensor, ...],
        mesh: Mesh,
        axes: Any,
    ) -> None:
        """Keep the partials ``gs`` of ``ps`` (one `deferred_pvary_many` call's, forward order
        ``order``) for the end of backward ``task``, queuing the task's flush at its first
        entry. A parameter kept again in the same backward (used by two calls) has its
        partials added at the flush, in the order they were kept."""
        with self.lock:
            entries = self.tasks.get(task)
            if entries is None:
                entries = self.tasks[task] = {}
                self.threads[task] = threading.get_ident()
                torch.autograd.Variable._execution_engine.queue_callback(
                    functools.partial(_flush, self, task)
                )
            entries[order] = [order, ps, gs, mesh, axes, len(entries)]

    def take(self, task: int) -> list[Any]:
        """The task's kept entries, in forward order, forgotten here."""
        with self.lock:
            self.threads.pop(task, None)
            return sorted(self.tasks.pop(task, {}).values(), key=operator.itemgetter(0))

    def pending(self) -> int:
        """How many calls' partial gradients wait for the end of a backward."""
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

    Forward: ``p`` (an alias). Backward: this rank's gradient is kept, summed over ``axes`` with
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
        # aliases (the parameter's storage and version counter; this node their grad_fn):
        # detach is a third of view_as's cost on a Parameter (no view metadata to build)
        return tuple([p.detach() for p in ps])

    @staticmethod
    def backward(ctx: Any, *gs: Tensor | None) -> tuple[Tensor | None, ...]:
        # per call, not per parameter: the checks, the task and one keep (Python calls are
        # most of this node's cost)
        out: list[Tensor | None] = [None] * (3 + len(gs))
        recording = torch.is_grad_enabled()
        edges = ctx.next_functions  # this node's: the parameters' gradient accumulators
        ps = ctx.ps
        kept_ps: list[Tensor] = []
        kept_gs: list[Tensor] = []
        for i, g in enumerate(gs):
            if g is None:
                continue
            p = ps[i]
            try:  # does the running backward accumulate into p.grad (not autograd.grad)?
                accumulates = torch._C._will_engine_execute_node(edges[i][0])
            except RuntimeError:  # torch refuses a leaf under autograd.grad
                accumulates = False
            # hooks that read the gradient during the backward (fastdist DataParallel), a
            # recorded backward, or autograd.grad: pvary's own backward, per parameter
            if recording or p._backward_hooks or p._post_accumulate_grad_hooks or not accumulates:
                for axis in ctx.axes:
                    g = psum(g, ctx.mesh, axis)
                out[3 + i] = g
            else:
                kept_ps.append(p)
                kept_gs.append(g)
        if kept_ps:
            task = torch._C._current_graph_task_id()
            PENDING.keep(task, ctx.order, tuple(kept_ps), tuple(kept_gs), ctx.mesh, ctx.axes)
        return tuple(out)


def _flush(pending: PendingSums, task: int) -> None:
    """End of backward ``task``: sum its kept partial gradients, bucketed, into ``.grad``."""
    calls = pending.take(task)
    ps = [p for c in calls for p in c[1]]
    gs = [g for c in calls for g in c[2]]
    with torch.no_grad():
        if len({id(p) for p in ps}) == len(ps) and _one_bucket(calls, gs):
            _sum_into(ps, gs, calls[0][3], calls[0][4])  # the common case, whole
            return
        for bucket in _buckets(_entries(calls)):
            _sum_into([e[1] for e in bucket], [e[4] for e in bucket], bucket[0][2], bucket[0][3])


def _one_bucket(calls: list[Any], gs: list[Tensor]) -> bool:
    """Whether every kept partial goes into one bucket: one mesh, axes, dtype and device, at
    most `BUCKET_BYTES` (what `_buckets` of `_entries` would make)."""
    if len({(id(c[3]), c[4]) for c in calls}) != 1 or len({(g.dtype, g.device) for g in gs}) != 1:
        return False
    return sum(map(Tensor.numel, gs)) * gs[0].element_size() <= BUCKET_BYTES


def _entries(calls: list[Any]) -> list[list[Any]]:
    """One ``[order, parameter, mesh, axes, partial]`` per parameter, grouped by mesh, axes,
    dtype and device: a parameter kept by several calls has their partials added in the order
    they were kept, and its place is its first kept call's (forward order, then its index)."""
    per: dict[int, list[Any]] = {}
    for call in sorted(calls, key=operator.itemgetter(5)):  # the order the backward kept them
        order, ps, gs, mesh, axes = call[:5]
        for i, (p, g) in enumerate(zip(ps, gs)):
            e = per.get(id(p))
            if e is None:
                per[id(p)] = [(order, i), p, mesh, axes, g]
            else:
                e[4] = e[4] + g
    groups: dict[tuple[int, tuple[str, ...], torch.dtype, torch.device], list[Any]] = {}
    for e in sorted(per.values(), key=operator.itemgetter(0)):
        groups.setdefault((id(e[2]), e[3], e[4].dtype, e[4].device), []).append(e)
    return [e for group in groups.values() for e in group]


def _buckets(entries: list[Any]) -> list[list[Any]]:
    """Consecutive runs of ``entries`` (grouped as `_entries` makes them) of one mesh, axes,
    dtype and device and at most `BUCKET_BYTES` each (one larger alone)."""
    out: list[list[Any]] = [[]]
    size = 0
    last = None
    for e in entries:
        n = e[4].numel() * e[4].element_size()
        key = (id(e[2]), e[3], e[4].dtype, e[4].device)
        if out[-1] and (size + n > BUCKET_BYTES or key != last):
            out.append([])
            size = 0
        out[-1].append(e)
        size += n
        last = key
    return out


def _sum_into(ps: list[Tensor], gs: list[Tensor], mesh: Mesh, axes: tuple[str, ...]) -> None:
    """One flat collective of ``gs`` over ``axes``; each parameter's slice into its ``.grad``."""
    flat = torch._C._nn.flatten_dense_tensors(gs)  # [sum of numels]: their cat, flattened
    axis: AxisName = axes[0] if len(axes) == 1 else axes
    flat = psum(flat, mesh, axis)
    for p, g in zip(ps, torch._C._nn.unflatten_dense_tensors(flat, gs)):  # views of flat
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)
