"""Record the collectives of a step as it really runs (real ranks, or ``fastdist.simulate``):
:func:`record` opens a :class:`Recording`, which sees every collective through the declared
observer point ``fastdist.core.context.COLLECTIVE_OBSERVERS``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn

from fastdist.core.context import COLLECTIVE_OBSERVERS
from fastdist.core.mesh import Mesh
from fastdist.errors import ProfileError
from fastdist.profile._common import META_KEY, RUNNING, ModuleStack, RankShare, make_record
from fastdist.profile.records import Profile, Record

__all__ = ["Recording", "record"]


# recordings in progress, innermost last (a collective on any thread goes to each)
_ACTIVE: list[Recording] = []
_INSTALL = threading.Lock()


def _unwrapped(t: Tensor) -> Tensor:
    """The tensor under simulate's vmap (and any torch.func wrapper): the one that carries the
    autograd node."""
    ft: Any = torch._C._functorch
    while ft.is_functorch_wrapped_tensor(t):
        t = ft.get_unwrapped(t)
    return t


def _observe(
    prim: Any,
    stacked: bool,
    tensors: tuple[Tensor, ...],
    spec: Any,
    params: dict[str, Any],
    run: Callable[[], Tensor],
) -> Tensor:
    """The collective observer (``fastdist.core.context.CollectiveObserver``) installed while
    recordings are open: runs the collective and adds its record to each open recording."""
    if RUNNING.depth or not _ACTIVE:
        return run()
    RUNNING.depth += 1
    try:
        out = run()
    finally:
        RUNNING.depth -= 1
    node: Any = torch._C._current_autograd_node()
    for rec in list(_ACTIVE):
        rec._add(prim.name, tensors, out, spec, params, stacked, node)
    return out


class Recording:
    """The collectives of a step as it runs: the context manager :func:`record` returns.

    Attributes:
        mesh: the mesh of the records (as for :func:`trace`).
        profile: the :class:`Profile` of what ran so far (complete once the ``with`` block ends).
    """

    def __init__(self, mesh: Mesh, meshes: Sequence[Mesh], modules: Sequence[nn.Module]) -> None:
        self.mesh = mesh
        self._names = {tuple(m.shape.values()): m.axis_names for m in reversed([mesh, *meshes])}
        self._stack = ModuleStack()
        self._modules = tuple(modules)
        self._hooks: ExitStack | None = None
        self._key = (META_KEY, id(self))
        self._records: list[Record] = []

    def __enter__(self) -> Recording:
        if self._hooks is not None:
            raise ProfileError(
                "record", "this recording is already open", "open a new record(...) for each block"
            )
        self._hooks = ExitStack()
        self._hooks.enter_context(self._stack.hooks(self._modules))
        with _INSTALL:
            if not _ACTIVE:
                COLLECTIVE_OBSERVERS.add(_observe)
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _INSTALL:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                COLLECTIVE_OBSERVERS.remove(_observe)
        assert self._hooks is not None
        self._hooks.close()

    @property
    def profile(self) -> Profile:
        return Profile(self.mesh, tuple(self._records))

    def _add(
        self,
        op: str,
        tensors: Sequence[Any],
        out: Any,
        spec: Any,
        params: Mapping[str, Any],
        stacked: bool,
        node: Any,
    ) -> None:
        if node is None:
            module = self._stack.current
            fn: Any = _unwrapped(out).grad_fn
            # the backward collective this node will issue is attributed to the module running now
            if fn is not None:
                fn.metadata[self._key] = module
        else:
            module = str(node.metadata.get(self._key, ""))
        if stacked:  # [world, ...] tensors (simulate's backward): one rank's share
            tensors, out = tuple(RankShare(t) for t in tensors), RankShare(out)
        rec = make_record(
            op,
            tensors,
            out,
            tuple(spec.mesh_shape),
            tuple(spec.axes),
            params,
            self._names,
            node is not None,
            module,
        )
        if rec is not None:
            self._records.append(rec)


def record(
    mesh: Mesh, *, meshes: Sequence[Mesh] = (), modules: Sequence[nn.Module] = ()
) -> Recording:
    """Record the collectives of a step while it really runs: on real ranks, or under
    :func:`fastdist.simulate`.

    A context manager (``with record(mesh) as rec:``); ``rec.profile`` is the :class:`Profile`.

    The same records (:class:`Record`) as :func:`trace` (one rank's: this process's on real
    ranks, rank 0's shapes under ``simulate``), forward and backward, with the module that
    issued each. Unlike
    :func:`trace` the step runs for real (data, memory, and on real ranks the communication);
    use it to profile the very step you train with, :func:`trace` to profile without running.

    Args:
        mesh: the mesh the step's collectives use (it names the axes of the records).
        meshes: further meshes the step uses.
        modules: modules whose submodules name the ``module`` field of each record.

    Every fastdist collective this process runs while the block is open is recorded, on any
    thread (the backward may run on autograd's threads), eager code only: a compiled step is
    recorded once, when dynamo traces it. Data-dependent sizes are charged as :func:`trace`
    charges them (``ragged_all_to_all``: the send buffer, ``bound=True``).

    >>> import torch, fastdist as fd
    >>> from fastdist.profile import trace
    >>> mesh = fd.Mesh({"tp": 4})
    >>> with record(mesh) as rec:
    ...     out = fd.simulate(lambda x: fd.all_gather(x, mesh, "tp"), mesh)(torch.ones(4, 2, 3))
    >>> rec.profile == trace(lambda x: fd.all_gather(x, mesh, "tp"), mesh, torch.ones(2, 3))
    True
    """
    for m in [mesh, *meshes]:
        if not isinstance(m, Mesh):
            raise ProfileError(
                "record",
                f"expected a fastdist.Mesh, got {type(m).__name__}",
                "pass the Mesh the step runs on",
            )
    return Recording(mesh, meshes, modules)
