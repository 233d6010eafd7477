"""Replicated parameters that meet rank-varying data, ``pvary``'d inside their own module's forward.

A parameter replicated over an axis but used on data that differs across that axis (a norm on a
sequence shard, a per-head norm on a head shard; the `fastdist.nn.PvaryParams` style) must be
``pvary``'d where it is used, so that its gradient is summed over the axis (``pvary``'s backward
is ``psum``). `PvarySites` does it at the innermost place: a forward pre-hook on the owning
module puts ``pvary(parameter)`` in the parameter's slot for the duration of that module's
forward, and a forward hook puts the parameter back (also when forward raises).

Doing it there, rather than around the whole model's call, is what makes every way of running
the module exact:

* activation checkpointing: a recomputation runs the module's forward again (reentrant
  checkpointing recomputes in backward, after the model's call returned), so the parameter is
  ``pvary``'d again and its gradient summed, as in the first forward;
* torch's engines (DDP, FSDP2) call the model themselves, and FSDP2 installs its unsharded
  parameters at each block's forward: the swap happens after, at the innermost module, so the
  gradient reaches the very parameter the engine reduces;
* simulated ranks: inside ``torch.func.functional_call`` the slot holds the simulation's
  per-rank parameter, which is what gets ``pvary``'d.

Two shortcuts, each taken only where it gives the same result:

* a forward that records no graph (``torch.no_grad()``, inference mode) outside a replication
  check (``fastdist.spmd``, which reads every ``pvary``) skips the hooks' work (``pvary``'s
  forward is the identity: only its backward does anything);
* on real ranks, the gradient sums are bucketed (`fastdist.nn.grad_buckets`): a leaf parameter
  is ``deferred_pvary``'d, its partial gradient kept and summed with the others' in a few flat
  collectives at the end of the backward, instead of one ``psum`` per parameter. Not under
  ``torch.compile`` or a replication check, and never once DDP or FSDP2 has been seen in this
  process (they read the gradient during the backward); `fastdist.nn.grad_buckets` lists the
  checks its backward does.
  ``PvarySites(..., bucket=False)`` keeps one ``psum`` per parameter everywhere.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fastdist.core.context import check_of, is_real
from fastdist.core.mesh import Mesh
from fastdist.nn.grad_buckets import PENDING, deferred_pvary_many
from fastdist.ops import pvary

__all__ = ["PvarySites"]

#: where the parameter a pre-hook replaced is kept until its forward hook puts it back
_KEPT = "_fastdist_pvary_kept"


class PvarySites:
    """Hooks that ``pvary`` each site's parameter inside its module's forward.

    Args:
        mesh: the mesh the parameters' axes belong to.
        sites: ``(module, parameter name, axis)`` for each parameter to ``pvary`` over ``axis``
            (a parameter directly owned by ``module``).
        bucket: on real ranks, sum the gradients in few flat collectives at the end of the
            backward (`fastdist.nn.grad_buckets`) rather than one ``psum`` per parameter.

    Each module gets one forward pre-hook (prepended: it runs before the module's other
    pre-hooks, which see the ``pvary``'d tensor like the forward does) and one forward hook
    (``always_call``). A forward of the module running inside another forward of the same
    module (nothing in a model does this) sees the parameter ``pvary``'d once, by the outer call.
    """

    def __init__(
        self, mesh: Mesh, sites: Sequence[tuple[nn.Module, str, str]], bucket: bool = True
    ) -> None:
        self.sites = list(sites)
        self._handles: list[Any] = []
        # module -> parameter name -> its axes, in order, each once (a parameter listed for two
        # axes is pvary'd over both; listed twice for one axis, once: its gradient summed once)
        by_module: dict[int, tuple[nn.Module, dict[str, list[str]]]] = {}
        for module, name, axis in self.sites:
            axes = by_module.setdefault(id(module), (module, {}))[1].setdefault(name, [])
            if axis not in axes:
                axes.append(axis)
        for module, names in by_module.values():
            pre, post = _hooks(mesh, tuple((n, tuple(a)) for n, a in names.items()), bucket)
            self._handles.append(module.register_forward_pre_hook(pre, prepend=True))
            self._handles.append(module.register_forward_hook(post, always_call=True))

    def remove(self) -> None:
        """Remove the hooks (the parameters are then used as they are)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def _hooks(
    mesh: Mesh, names: tuple[tuple[str, tuple[str, ...]], ...], bucket: bool
) -> tuple[Any, Any]:
    """The (pre-hook, forward hook) pair of one module whose parameters ``names`` (name, axes)
    are ``pvary``'d (partials of module-level functions: a model holding them still pickles)."""
    return functools.partial(_swap_in, mesh, names, bucket), functools.partial(_put_back, names)


def _torch_engine_active() -> bool:
    """DDP's forward is running, or FSDP2 / a composable API manages some module (remembered:
    a reentrant checkpoint's recomputation runs outside DDP's forward)."""
    if PENDING.engine_seen:
        return True
    # looked up, not imported (every forward of every module: an import statement costs); a
    # module not imported yet has no state set
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    composable = sys.modules.get("torch.distributed._composable_state")
    active = getattr(getattr(ddp, "DistributedDataParallel", None), "_active_ddp_module", None)
    seen = active is not None or bool(getattr(composable, "_module_state_mapping", None))
    PENDING.engine_seen = seen
    return seen


def _swap_in(
    mesh: Mesh,
    names: tuple[tuple[str, tuple[str, ...]], ...],
    bucket: bool,
    m: nn.Module,
    args: Any,
) -> None:
    """Forward pre-hook: each named parameter's slot holds ``pvary(parameter)`` over its axes."""
    if _KEPT in m.__dict__:
        return  # a forward of m inside another one: already pvary'd
    engine = _torch_engine_active()  # checked under no_grad too (a reentrant checkpoint's)
    checking = check_of(mesh) is not None  # a replication check reads every pvary it sees
    if not torch.is_grad_enabled() and not checking:
        return  # no graph: pvary's forward is the identity (_put_back finds nothing kept)
    defer = (
        bucket
        and not engine
        and not checking
        and is_real(mesh)
        and not torch.compiler.is_compiling()
    )
    if defer and PENDING.tasks and torch._C._current_graph_task_id() == -1 and PENDING.stale():
        PENDING.drop()  # left by a backward that raised before its end
    kept: dict[str, Tensor | None] = {}
    deferred: dict[tuple[str, ...], list[str]] = {}  # axes -> the names deferred over them
    for name, axes in names:
        p = m._parameters[name]
        kept[name] = p  # the parameter itself, put back by _put_back
        if p is None:
            continue
        if defer and p.is_leaf and p.requires_grad:
            deferred.setdefault(axes, []).append(name)
            continue
        v: Tensor = p
        for axis in axes:
            v = pvary(v, mesh, axis)
        # the slot holds a plain tensor while forward runs, as torch.func.functional_call
        # leaves it
        m._parameters[name] = v  # type: ignore[assignment]
    for axes, group in deferred.items():  # one autograd node per module (and axes)
        views = deferred_pvary_many([kept[n] for n in group], mesh, axes)  # type: ignore[misc]
        for name, v in zip(group, views):
            m._parameters[name] = v  # type: ignore[assignment]
    m.__dict__[_KEPT] = kept


def _put_back(
    names: tuple[tuple[str, tuple[str, ...]], ...], m: nn.Module, args: Any, out: Any
) -> None:
    """Forward hook (also when forward raised): the parameters back in their slots."""
    kept = m.__dict__.pop(_KEPT, None)
    if kept is not None:
        for name, p in kept.items():
            m._parameters[name] = p
