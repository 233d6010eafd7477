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

Three shortcuts, each taken only where it gives the same result:

* a forward that records no graph (``torch.no_grad()``, inference mode) outside a replication
  check (``fastdist.spmd``, which reads every ``pvary``) skips the hooks' work (``pvary``'s
  forward is the identity: only its backward does anything);
* on real ranks, the gradient sums are bucketed (`fastdist.nn.grad_buckets`): a leaf parameter
  is ``deferred_pvary``'d, its partial gradient kept and summed with the others' in a few flat
  collectives at the end of the backward, instead of one ``psum`` per parameter. Not under
  ``torch.compile`` or a replication check, and never once DDP or FSDP2 has been seen in this
  process (they read the gradient during the backward); `fastdist.nn.grad_buckets` lists the
  checks its backward does.
  ``PvarySites(..., bucket=False)`` keeps one ``psum`` per parameter everywhere;
* where the sums are bucketed, a site module's pre-hook also swaps the parameters of the site
  modules inside it, in the same autograd node (one node per forward of a model that owns a
  site, instead of one per module). Swapping a module's parameters early is what its own hook
  would do at its call; the inner module's hook finds its slots holding the enclosing site's
  views and leaves them. One whose forward runs after the enclosing one returned (a reentrant
  checkpoint's recomputation), whose slot was given another tensor meanwhile, or that holds a
  parameter that cannot defer (frozen, not a leaf), swaps its own as before.
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

#: on a module whose pre-hook swapped: (its own parameters replaced {name: parameter}, the
#: inner site modules it swapped with them), until its forward hook puts them back
_KEPT = "_fastdist_pvary_kept"
#: on an inner site module swapped by an enclosing site's pre-hook: (name, parameter, view) each
_BY = "_fastdist_pvary_by"

#: a site module's parameters: (name, axes) each
Names = tuple[tuple[str, tuple[str, ...]], ...]


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

    Where the gradient sums are deferred (real ranks, `fastdist.nn.grad_buckets`), a site
    module's pre-hook also swaps the parameters of the site modules inside it (its
    descendants), all in one autograd node: a DiT whose model owns a site ``pvary``'s every
    parameter in one node per forward instead of one per module. An inner module then finds
    its parameters swapped and leaves them; one called again after its enclosing site's
    forward (a reentrant checkpoint's recomputation), or whose slot was assigned another
    tensor meanwhile, swaps its own as before.
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
        names = {k: tuple((n, tuple(a)) for n, a in v[1].items()) for k, v in by_module.items()}
        for key, (module, _) in by_module.items():
            inner = tuple(
                (sub, names[id(sub)])
                for sub in module.modules()
                if sub is not module and id(sub) in names
            )
            pre, post = _hooks(mesh, names[key], inner, bucket)
            self._handles.append(module.register_forward_pre_hook(pre, prepend=True))
            self._handles.append(module.register_forward_hook(post, always_call=True))

    def remove(self) -> None:
        """Remove the hooks (the parameters are then used as they are)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def _hooks(
    mesh: Mesh, names: Names, inner: tuple[tuple[nn.Module, Names], ...], bucket: bool
) -> tuple[Any, Any]:
    """The (pre-hook, forward hook) pair of one module whose parameters ``names`` (name, axes)
    are ``pvary``'d, ``inner`` the site modules inside it (partials of module-level functions:
    a model holding them still pickles)."""
    return functools.partial(_swap_in, mesh, names, bucket, inner), _put_back


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
    names: Names,
    bucket: bool,
    inner: tuple[tuple[nn.Module, Names], ...],
    m: nn.Module,
    args: Any,
) -> None:
    """Forward pre-hook: each named parameter's slot holds ``pvary(parameter)`` over its axes
    (and, deferring, those of the ``inner`` site modules not swapped yet)."""
    d = m.__dict__
    if _KEPT in d:
        return  # a forward of m inside another one: already pvary'd
    if _BY in d:  # swapped by an enclosing site: do the slots still hold its views?
        by = d[_BY]
        slots = m._parameters
        for name, _, v in by:
            if slots[name] is not v:
                break
        else:
            return
        # a slot assigned another tensor since: swap those (the enclosing site keeps the rest)
        names, inner = tuple(na for na, (_, _, v) in zip(names, by) if slots[na[0]] is not v), ()
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
    # axes -> the (slots, name) of each parameter deferred over them, and the parameters
    deferred: dict[tuple[str, ...], tuple[list[Any], list[Tensor]]] = {}
    kept = _swap_own(mesh, names, defer, m._parameters, deferred)
    taken = _take_inner(inner, deferred) if defer and inner else []
    for axes, (where, ps) in deferred.items():  # one autograd node per axes
        for (slots, name), v in zip(where, deferred_pvary_many(ps, mesh, axes)):
            slots[name] = v
    for sub, sub_names in taken:  # marked with their views, told apart from later tensors
        slots = sub._parameters
        sub.__dict__[_BY] = tuple([(n, p, slots[n]) for (n, _), p in sub_names])
    d[_KEPT] = (kept, [sub for sub, _ in taken])


def _swap_own(
    mesh: Mesh,
    names: Names,
    defer: bool,
    slots: dict[str, Any],
    deferred: dict[tuple[str, ...], tuple[list[Any], list[Tensor]]],
) -> dict[str, Tensor | None]:
    """The module's own parameters: those deferring added to ``deferred``, the others
    ``pvary``'d in their slots now; returns the parameters replaced, by name."""
    kept: dict[str, Tensor | None] = {}
    for name, axes in names:
        p = slots[name]
        kept[name] = p  # the parameter itself, put back by _put_back
        if p is None:
            continue
        if defer and p.is_leaf and p.requires_grad:
            _defer(deferred, axes, slots, name, p)
            continue
        v: Tensor = p
        for axis in axes:
            v = pvary(v, mesh, axis)
        # the slot holds a plain tensor while forward runs, as torch.func.functional_call
        # leaves it
        slots[name] = v
    return kept


def _defer(
    deferred: dict[tuple[str, ...], tuple[list[Any], list[Tensor]]],
    axes: tuple[str, ...],
    slots: dict[str, Any],
    name: str,
    p: Tensor,
) -> None:
    entry = deferred.get(axes)
    if entry is None:
        entry = deferred[axes] = ([], [])
    entry[0].append((slots, name))
    entry[1].append(p)


def _take_inner(
    inner: tuple[tuple[nn.Module, Names], ...],
    deferred: dict[tuple[str, ...], tuple[list[Any], list[Tensor]]],
) -> list[tuple[nn.Module, list[Any]]]:
    """The inner site modules not swapped yet (by their own forward or another site) whose
    parameters all defer (leaves needing a gradient): their parameters added to ``deferred``;
    each with its ((name, axes), parameter) pairs. Any other module swaps its own, as before."""
    taken: list[tuple[nn.Module, list[Any]]] = []
    for sub, sub_names in inner:
        sd = sub.__dict__
        if _KEPT in sd or _BY in sd:
            continue
        slots = sub._parameters
        pairs = []
        for na in sub_names:
            p = slots[na[0]]
            if p is None or not p.is_leaf or not p.requires_grad:
                break
            pairs.append((na, p))
        else:
            for (name, axes), p in pairs:  # _defer's, inline (every inner parameter, every forward)
                entry = deferred.get(axes)
                if entry is None:
                    entry = deferred[axes] = ([], [])
                entry[0].append((slots, name))
                entry[1].append(p)
            taken.append((sub, pairs))
    return taken


def _put_back(m: nn.Module, args: Any, out: Any) -> None:
    """Forward hook (also when forward raised): the parameters back in their slots, and those
    of the inner modules the pre-hook swapped (a slot assigned another tensor meanwhile keeps
    it)."""
    kept = m.__dict__.pop(_KEPT, None)
    if kept is None:
        return
    own, taken = kept
    slots = m._parameters
    for name, p in own.items():
        slots[name] = p
    for sub in taken:
        slots = sub._parameters
        for name, p, v in sub.__dict__.pop(_BY, ()):
            if slots[name] is v:
                slots[name] = p
