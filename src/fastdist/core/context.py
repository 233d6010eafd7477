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

Outside ``simulate``/``spmd`` both stacks are empty. One thing outlives a call: the
backward of a ``torch.autograd.Function`` applied inside ``simulate`` runs after it
returned, so ``simulate`` leaves what that backward needs on the Function's autograd node
(not here), and :func:`simulation_of` reads it from the node being run.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fastdist.core.mesh import Mesh

__all__ = [
    "simulation_of",
    "check_of",
    "push_simulation",
    "pop_simulation",
    "push_check",
    "pop_check",
    "is_real",
]


class _Running(threading.local):
    """Per-thread stacks of ``(mesh, binding)`` and ``(mesh, tracker)`` pairs, innermost last."""

    simulations: tuple[tuple[Mesh, Any], ...]
    checks: tuple[tuple[Mesh, Any], ...]

    def __init__(self) -> None:  # runs once per thread, on first use there
        # Instance attributes, not class defaults: dynamo traces an instance attribute of a
        # threading.local but not a class-level default read through it.
        self.simulations = ()
        self.checks = ()


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
    found = _innermost(_RUNNING.simulations, mesh)
    if found is not None or torch.compiler.is_compiling():
        return found
    node = torch._C._current_autograd_node()  # None outside a backward
    for resume in reversed(getattr(node, "_fastdist_resume", ())):
        if resume.covers(mesh):
            return resume.binding(mesh)
    return None


def is_real(mesh: Mesh) -> bool:
    """Whether collectives on ``mesh`` go to real ranks: a communicator and no simulation over
    it."""
    return mesh._comm is not None and simulation_of(mesh) is None


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
    return _innermost(_RUNNING.checks, mesh)


def push_check(mesh: Mesh, tracker: Any) -> None:
    """Register ``tracker`` (or ``None`` to suspend the checks of ``mesh``) until
    :func:`pop_check`."""
    _RUNNING.checks = _RUNNING.checks + ((mesh, tracker),)


def pop_check() -> None:
    """Drop the innermost check entry."""
    _RUNNING.checks = _RUNNING.checks[:-1]
