"""What is running now: the simulations and replication checks in progress on this thread.

A :class:`~fastdist.Mesh` is a value (its axes, and on real ranks its communicator); it
holds no record of what is being done with it. ``fastdist.simulate`` and ``fastdist.spmd``
register here, for the duration of one call, *which mesh values* they run over; a
collective looks its mesh up by value. So two equal meshes are interchangeable: code that
builds its own ``Mesh({"tp": 2})`` runs inside ``simulate(fn, Mesh({"tp": 2}))``.

The state is per thread (``threading.local``), like JAX's trace state: two threads may
simulate the same mesh at once, and nothing is left behind once a call returns. It is not
a ``contextvars.ContextVar`` because dynamo cannot trace ``ContextVar.get``/``set`` in torch
2.13, while it traces attribute reads and writes of a ``threading.local``, which keeps
``torch.compile(simulate(fn, mesh), fullgraph=True)`` free of graph breaks. Entries are
immutable tuples, replaced rather than mutated.

Two declared hook points live here too, for code that watches or prices a step without
replacing anyone's functions (``fastdist.profile`` uses both):

* :data:`COLLECTIVE_OBSERVERS`: process-wide observers that ``Primitive.bind`` and
  ``Primitive.bind_stacked`` call around every collective (a recording sees the backward
  too, which autograd may run on its own threads, so this one is not per thread). With
  none installed, ``bind`` pays one attribute read.
* :func:`routing_policy`: per thread, how the routed MoE layers of ``fastdist.nn.moe``
  charge a routing whose row counts are data (a trace's ``routing="balanced"``).

Outside ``simulate``/``spmd`` both stacks are empty. One thing outlives a call: the
backward of a ``torch.autograd.Function`` applied inside ``simulate`` runs after it
returned, so ``simulate`` leaves what that backward needs on the Function's autograd node
(not here), and :func:`simulation_of` reads it from the node being run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from torch import Tensor

    from fastdist.core.mesh import Mesh

__all__ = [
    "simulation_of",
    "check_of",
    "push_simulation",
    "pop_simulation",
    "push_check",
    "pop_check",
    "is_real",
    "COLLECTIVE_OBSERVERS",
    "CollectiveObserver",
    "CollectiveObservers",
    "routing_policy",
    "push_routing",
    "pop_routing",
]


class _Running(threading.local):
    """Per-thread stacks of ``(mesh, binding)`` and ``(mesh, tracker)`` pairs and of MoE routing
    policies, innermost last."""

    simulations: tuple[tuple[Mesh, Any], ...]
    checks: tuple[tuple[Mesh, Any], ...]
    routings: tuple[Any, ...]

    def __init__(self) -> None:  # runs once per thread, on first use there
        # Instance attributes, not class defaults: dynamo traces an instance attribute of a
        # threading.local but not a class-level default read through it.
        self.simulations = ()
        self.checks = ()
        self.routings = ()


_RUNNING = _Running()


def _innermost(stack: tuple[tuple[Mesh, Any], ...], mesh: Mesh) -> Any:
    """The value of the innermost entry of ``stack`` for a mesh equal to ``mesh``, else None."""
    for m, value in reversed(stack):
        if m is mesh or m == mesh:
            return value
    return None


def simulation_of(mesh: Mesh) -> Any:
    """The binding of the innermost simulation running over a mesh equal to ``mesh``, else None.

    In the backward of a ``torch.autograd.Function`` applied inside ``simulate`` (which runs
    after ``simulate`` returned), the simulation that ``simulate`` left on the Function's
    autograd node (``fastdist.sim.simulate._Resume``), bound to the vmap over the ranks that torch
    re-created for that backward.
    """
    simulations = _RUNNING.simulations
    # the usual case on real ranks: nothing simulated on this thread (no stack scan)
    found = _innermost(simulations, mesh) if simulations else None
    if found is not None or torch.compiler.is_compiling():
        return found
    node = torch._C._current_autograd_node()  # None outside a backward
    if node is None:
        return None
    for resume in reversed(getattr(node, "_fastdist_resume", ())):
        if resume.covers(mesh):
            return resume.binding(mesh)
    return None


def is_real(mesh: Mesh) -> bool:
    """Whether collectives on ``mesh`` go to real ranks: a communicator and no simulation over
    it."""
    return mesh.comm is not None and simulation_of(mesh) is None


def push_simulation(meshes: list[Mesh], binding: Any) -> None:
    """Register ``binding`` as the running simulation of each of ``meshes`` (pair with
    :func:`pop_simulation`)."""
    _RUNNING.simulations = _RUNNING.simulations + tuple((m, binding) for m in meshes)


def pop_simulation(count: int) -> None:
    """Drop the ``count`` innermost simulation entries (those one :func:`push_simulation` added)."""
    _RUNNING.simulations = _RUNNING.simulations[: len(_RUNNING.simulations) - count]


def check_of(mesh: Mesh) -> Any:
    """The tracker of the innermost replication check running over ``mesh`` (``None``: none, or
    suspended)."""
    checks = _RUNNING.checks
    return _innermost(checks, mesh) if checks else None


def push_check(mesh: Mesh, tracker: Any) -> None:
    """Register ``tracker`` (or ``None`` to suspend the checks of ``mesh``) until
    :func:`pop_check`."""
    _RUNNING.checks = _RUNNING.checks + ((mesh, tracker),)


def pop_check() -> None:
    """Drop the innermost check entry."""
    _RUNNING.checks = _RUNNING.checks[:-1]


def routing_policy() -> Any:
    """The innermost MoE routing policy installed on this thread
    (``fastdist.nn.moe.RoutingPolicy``), else None: the routed layers then run as written."""
    return _RUNNING.routings[-1] if _RUNNING.routings else None


def push_routing(policy: Any) -> None:
    """Install ``policy`` (a ``fastdist.nn.moe.RoutingPolicy``) on this thread until
    :func:`pop_routing`."""
    _RUNNING.routings = _RUNNING.routings + (policy,)


def pop_routing() -> None:
    """Drop the innermost routing policy of this thread."""
    _RUNNING.routings = _RUNNING.routings[:-1]


class CollectiveObserver(Protocol):
    """Called around one collective: ``observer(prim, stacked, tensors, spec, params, run)``.

    ``prim`` is the ``fastdist.core.primitive.Primitive``, ``stacked`` whether it came through
    ``bind_stacked`` (``[world, ...]`` tensors), ``tensors``/``spec``/``params`` its arguments;
    ``run()`` runs it (and any observer installed before this one) and returns its output,
    which the observer returns.
    """

    def __call__(
        self,
        prim: Any,
        stacked: bool,
        tensors: tuple[Tensor, ...],
        spec: Any,
        params: dict[str, Any],
        run: Callable[[], Tensor],
    ) -> Tensor: ...


class CollectiveObservers:
    """The observers of every collective this process runs (:data:`COLLECTIVE_OBSERVERS`).

    Process-wide rather than per thread: what is observed is a step, whose backward autograd
    may run on threads of its own. ``active`` is an immutable tuple, replaced under a lock;
    ``Primitive.bind`` reads it once per call and goes through :meth:`call` only when it is
    not empty.
    """

    def __init__(self) -> None:
        self.active: tuple[CollectiveObserver, ...] = ()
        self._lock = threading.Lock()

    def add(self, observer: CollectiveObserver) -> None:
        """Install ``observer`` (the last installed is the outermost)."""
        with self._lock:
            self.active = (*self.active, observer)

    def remove(self, observer: CollectiveObserver) -> None:
        """Uninstall ``observer``."""
        with self._lock:
            self.active = tuple(o for o in self.active if o is not observer)

    def call(
        self,
        prim: Any,
        stacked: bool,
        tensors: tuple[Tensor, ...],
        spec: Any,
        params: dict[str, Any],
        run: Callable[[], Tensor],
    ) -> Tensor:
        """Run one collective through every observer (``run``: the collective itself)."""
        for observer in self.active:

            def step(
                observer: CollectiveObserver = observer, inner: Callable[[], Tensor] = run
            ) -> Tensor:
                return observer(prim, stacked, tensors, spec, params, inner)

            run = step
        return run()


#: the collective observers of this process (see :class:`CollectiveObservers`)
COLLECTIVE_OBSERVERS = CollectiveObservers()
