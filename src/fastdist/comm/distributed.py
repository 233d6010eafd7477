"""Real ranks: a mesh over ``torch.distributed`` process groups, one rank per process.

Build a mesh from a running job (after ``init_process_group``, e.g. under ``torchrun``)::

    dist.init_process_group("gloo")            # or "nccl", "cpu:gloo,cuda:nccl"
    mesh = fastdist.Mesh.from_torch(tp=4)      # dp inferred from the world size

and call the same per-rank model code that runs under :func:`fastdist.simulate`. Each
axis group talks through a transport (:class:`TorchTransport`): direct c10d calls when
eager (the least work per call), torch's functional collectives
(``torch.ops._c10d_functional``) under ``torch.compile``, so a step compiles without
graph breaks from fastdist. A mesh with a ctypes backend uses
:class:`fastdist.comm.native.NativeCommunicator` for device tensors instead.

Process groups belong to the mesh (its :class:`TorchComm`), one per axis (or tuple of
axes) and backend, created on first use and only by the ranks in them, with members in
axis order so that a group rank is the index along the axis. Each group's name is derived
from the mesh (its shape and which mesh of that shape it is), the ordered member ranks, the
backend and the mesh's epoch (see :meth:`TorchComm.reset`), never from how many groups the
process made before: ranks may touch the mesh's axes in any order. Under ``torch.compile`` a
missing group is created while dynamo traces, outside the graph. Every group carries the
mesh's timeout; a peer that does not arrive raises :class:`~fastdist.CollectiveTimeout`
naming the op, axis, group, rank and which peers did not reach the call.

Backends by tensor device: ``cpu`` -> gloo, ``cuda`` -> nccl, ``npu`` -> hccl (needs
``torch_npu``); see :func:`select_backend`.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib.util
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d as c10d

from fastdist.core.primitive import GroupSpec
from fastdist.errors import (
    CollectiveTimeout,
    CommArgumentError,
    CommError,
    ConsistencyError,
    MeshError,
    NoBackendError,
)

if TYPE_CHECKING:
    from fastdist.comm.native import NativeCommunicator, NativeLibrary
    from fastdist.core.mesh import AxisName, Mesh

__all__ = [
    "TorchComm",
    "AxisComm",
    "select_backend",
    "DEFAULT_TIMEOUT",
    "broadcast_object",
    "all_gather_object",
    "send_object",
    "recv_object",
    "broadcast_tensor_dict",
    "send_tensor_dict",
    "recv_tensor_dict",
    "graph_capture",
    "GraphCaptureContext",
    "send",
    "recv",
    "barrier",
    "comm_guard",
]

#: Default timeout of every blocking call on a mesh built from torch.distributed.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)

T = TypeVar("T")
_Fn = TypeVar("_Fn", bound=Callable[..., Any])
_F = torch.ops._c10d_functional


def select_backend(device_type: str, *, npu_available: bool | None = None) -> str:
    """The c10d backend for tensors on ``device_type``: cpu -> gloo, cuda -> nccl, npu -> hccl.

    ``npu_available`` defaults to whether ``torch_npu`` can be imported.

    Args:
        device_type: ``"cpu"``, ``"cuda"`` or ``"npu"``.
        npu_available: whether ``torch_npu`` is usable; default: whether it can be imported.

    Returns:
        the c10d backend name: ``"gloo"``, ``"nccl"`` or ``"hccl"``.

    >>> select_backend("cpu"), select_backend("cuda"), select_backend("npu", npu_available=True)
    ('gloo', 'nccl', 'hccl')
    """
    if device_type == "cpu":
        return "gloo"
    if device_type == "cuda":
        return "nccl"
    if device_type == "npu":
        if npu_available is None:
            npu_available = importlib.util.find_spec("torch_npu") is not None
        if not npu_available:
            raise NoBackendError(
                "fastdist: NPU tensors need the HCCL backend from torch_npu, which is not "
                "importable. Fix: pip install torch_npu"
            )
        return "hccl"
    raise NoBackendError(
        f"fastdist: no collective backend for {device_type!r} tensors. "
        "Fix: move tensors to cpu, cuda or npu"
    )


def _as_timedelta(
    timeout: float | datetime.timedelta | None,
    default: datetime.timedelta | None,
    who: str = "fastdist",
) -> datetime.timedelta:
    """``timeout`` (seconds or a timedelta, > 0) as a timedelta; ``default`` for None (no
    ``default``: None is refused too). ``who`` (e.g. ``"Mesh.from_torch"``) names the call in the
    error."""
    if timeout is None and default is not None:
        return default
    if isinstance(timeout, datetime.timedelta) and timeout > datetime.timedelta(0):
        return timeout
    if (
        isinstance(timeout, (int, float))
        and not isinstance(timeout, bool)
        and 0 < timeout < float("inf")
    ):
        return datetime.timedelta(seconds=float(timeout))
    leave_out = (
        f", or leave it out for the default ({default.total_seconds():g} s)"
        if default is not None
        else ""
    )
    raise MeshError(
        f"{who}: timeout must be positive seconds or a positive timedelta, got {timeout!r}. "
        f"Fix: pass timeout=<seconds> greater than 0 (e.g. timeout=60){leave_out}"
    )


class TorchComm:
    """The process groups of one mesh on this process. Owned by the mesh; nothing global.

    Group identity: every group is named ``fastdist.<shape>.<k>.e<epoch>.<ranks>.<backend>``
    (``<ranks>`` as ``0-1-2-3``, or a digest of it for large groups) where ``<k>`` counts the
    meshes of this shape this rank built before (kept in the job's store, so every rank that builds
    its meshes in the same order agrees), ``<ranks>`` are the members in axis order and ``<epoch>``
    counts :meth:`reset` calls. Nothing in the name depends on the order in which ranks first use
    the mesh's axes, so a subset of ranks may use an axis before the others touch the mesh
    (``torch.distributed.new_group`` names a group by how many groups the process already made,
    which deadlocks then).

    Ranks: mesh rank ``r`` is global rank ``ranks[r]``: the identity over the whole job for
    :meth:`fastdist.Mesh.from_torch`, this process's slice for :meth:`fastdist.Mesh.without`
    (:meth:`slice`). ``rank`` is this process's mesh rank (coordinates, shards); everything that
    names processes (group members and names, store keys, error messages, :class:`AxisComm`'s
    ``ranks`` and ``rank``) uses global ranks. A slice's ``<shape>`` is its parent's uid and the
    slice's coordinates (``pp2_tp2.0-pp1``), so two slices of one shape never share a name.

    Args:
        mesh: the mesh (its size must equal the world size, or ``len(ranks)``).
        timeout: the timeout of every group this comm creates.
        check: consistency check mode (see :meth:`AxisComm.check`).
        device_mesh: a ``DeviceMesh`` whose per-dimension groups to reuse.
        backend: ``"torch"`` or a ctypes backend (see :func:`fastdist.Mesh.from_torch`).
        library: the ctypes backend's library (a path or an already bound library).
        ranks: the global rank of each mesh rank; default: the whole job, in order.
        base: the name the uid counts from; default: the mesh's shape (``dp2_tp2``).
        where: which slice of its parent mesh this is, e.g. ``"pp=1"``; ``""`` for the whole job.
    """

    def __init__(
        self,
        mesh: Mesh,
        *,
        timeout: datetime.timedelta,
        check: bool,
        device_mesh: Any = None,
        backend: str = "torch",
        library: Any = None,
        ranks: Sequence[int] | None = None,
        base: str | None = None,
        where: str = "",
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise NoBackendError(
                "fastdist: torch.distributed is not initialised. Fix: call "
                "torch.distributed.init_process_group first (torchrun sets its environment)"
            )
        world = dist.get_world_size()
        if ranks is None and mesh.size != world:
            raise MeshError(
                f"fastdist: {mesh!r} has {mesh.size} ranks but the torch.distributed world has "
                f"{world}. Fix: choose degrees whose product is {world}"
            )
        #: the global rank of each mesh rank (mesh rank r is global rank ranks[r])
        self.ranks: tuple[int, ...] = tuple(range(world) if ranks is None else ranks)
        self.global_rank = dist.get_rank()
        if len(self.ranks) != mesh.size or self.global_rank not in self.ranks:
            raise MeshError(
                f"fastdist: {mesh!r} ({mesh.size} ranks) cannot span global ranks "
                f"{list(self.ranks)} from rank {self.global_rank}. Fix: build slices with "
                "Mesh.without"
            )
        # self.rank: this process's rank on the mesh (its global rank when the mesh spans the job)
        self.mesh, self.rank = mesh, self.ranks.index(self.global_rank)
        self.timeout, self.check = timeout, check
        #: "" for a mesh over the whole job, else which slice of it, e.g. "pp=1"
        self.where = where
        self._device_mesh = device_mesh
        self._groups: dict[tuple[tuple[int, ...], str], Any] = {}
        self._created: list[
            Any
        ] = []  # the groups this comm made (not a DeviceMesh's): reset() destroys them
        self._axes: dict[tuple[int, ...], AxisComm] = {}
        self._specs: dict[Any, GroupSpec] = {}  # axis -> the collectives' group spec (see spec)
        self._slices: dict[tuple[int, ...], TorchComm] = {}  # removed axes -> slice (see slice)
        self.backend: str = backend
        self.native_lib: NativeLibrary | None = _native_library(backend, library)
        self._native: dict[tuple[int, ...], NativeCommunicator] = {}
        self.broken: str | None = (
            None  # what failed, once a failure dropped the groups (see abandon)
        )
        self.in_call: int | None = None  # the thread inside a blocking call now (see enter)
        self.store: Any = c10d._get_default_store()
        # the shape, or for a slice its parent's uid and the slice's coordinates: unique in the job
        self.base = base or "_".join(f"{n}{s}" for n, s in mesh.shape.items())
        # which mesh of this base this rank builds (0, 1, ...): the same on every rank that builds
        # its meshes in the same order
        count = self.store.add(f"fastdist/meshes/{self.base}/rank{self.global_rank}", 1)
        self.uid = f"{self.base}.{int(count) - 1}"
        self.epoch = 0
        # names this comm's groups; read (and guarded on) by dynamo when it traces a step
        self.tag = f"{self.uid}.e0"

    def slice(self, removed: tuple[int, ...], mesh: Mesh) -> TorchComm:
        """The communicator of ``mesh`` (this mesh without the axes at positions ``removed``) over
        this process's slice: the ranks that share its indices along ``removed`` (cached, so
        repeated slicing gives the same comm). Creates no group and talks to no peer."""
        key = tuple(sorted(removed))
        got = self._slices.get(key)
        if got is not None:
            return got
        names = self.mesh.axis_names
        coords = self.mesh.coords(self.rank)
        kept = tuple(n for i, n in enumerate(names) if i not in key)
        # mesh ranks of the slice, row-major over the kept axes (a mesh of no axes: this rank)
        members = self.mesh.group(self.rank, kept) if kept else [self.rank]
        at = ",".join(f"{names[i]}={coords[names[i]]}" for i in key)
        comm = TorchComm(
            mesh,
            timeout=self.timeout,
            check=self.check,
            backend=self.backend,
            library=self.native_lib,
            ranks=[self.ranks[r] for r in members],
            base=f"{self.uid}-" + "_".join(f"{names[i]}{coords[names[i]]}" for i in key),
            where=f"{self.where},{at}" if self.where else at,
        )
        if not torch.compiler.is_compiling():
            self._slices[key] = comm
        return comm

    def renewed(self, mesh: Mesh, timeout: datetime.timedelta) -> TorchComm:
        """A new communicator over the same ranks with another timeout (new groups, lazily)."""
        return TorchComm(
            mesh,
            timeout=timeout,
            check=self.check,
            backend=self.backend,
            library=self.native_lib,
            ranks=self.ranks,
            base=self.base,
            where=self.where,
        )

    # ------------------------------------------------------------------ groups
    def group_name(self, ranks: Sequence[int], backend: str) -> str:
        """The name of the group of ``ranks`` (in axis order) on ``backend``: the same on every
        member."""
        return f"fastdist.{self.tag}.{_members(ranks)}.{backend}"

    def axis(self, idx: tuple[int, ...]) -> AxisComm:
        """The communicator of this rank's group along the axes at positions ``idx`` (cached)."""
        ac = self._axes.get(idx)
        if ac is None:
            ac = self._new_axis(idx)
            # a trace must not mutate the cache (dynamo would replay it, and guard on it)
            if not torch.compiler.is_compiling():
                self._axes[idx] = ac
        return ac

    def spec(self, axis: AxisName, op: str) -> GroupSpec:
        """The collectives' group spec for ``axis`` (validated naming ``op``; cached outside dynamo
        tracing)."""
        try:
            cached: GroupSpec = self._specs[axis]
            return cached
        except (KeyError, TypeError):
            # TypeError: an unhashable axis (e.g. a list), validated below
            pass
        idx = self.mesh.axis_indices(axis, op)
        spec = GroupSpec(self.mesh._sizes, idx, comm=self.axis(idx))
        # a trace must not mutate the cache
        if isinstance(axis, (str, tuple)) and not torch.compiler.is_compiling():
            self._specs[axis] = spec
        return spec

    def _new_axis(self, idx: tuple[int, ...]) -> AxisComm:
        names = tuple(self.mesh.axis_names[i] for i in idx)
        label: Any = names[0] if len(names) == 1 else names
        # the group's global ranks, in axis order
        return AxisComm(
            self, idx, label, tuple(self.ranks[r] for r in self.mesh.group(self.rank, names))
        )

    def group(self, ac: AxisComm, backend: str, op: str) -> Any:
        """The process group for ``ac`` on ``backend``, created on first use by the ranks in it
        (eagerly)."""
        pg = self._groups.get((ac.ranks, backend))
        if pg is not None:
            return pg
        self.check_usable(op, ac)
        # only eager helpers get here (collectives use group names while tracing)
        if torch.compiler.is_compiling():
            _raise_while_tracing(
                op,
                ac.label,
                ac.ranks,
                self.global_rank,
                f"the {backend} process group is needed outside a collective",
                "run this call eagerly",
            )
        return self._create_group(ac, backend, op)

    def _create_group(self, ac: AxisComm, backend: str, op: str) -> Any:
        key = (ac.ranks, backend)
        pg = self._groups.get(key)
        if pg is not None:
            return pg
        dm = self._device_mesh
        if dm is not None and len(ac.idx) == 1 and backend == select_backend(dm.device_type):
            pg = dm.get_group(ac.idx[0])
        else:
            desc = f"fastdist:{'x'.join(self.mesh.axis_names[i] for i in ac.idx)}"
            try:
                pg = _new_named_group(
                    list(ac.ranks), backend, self.group_name(ac.ranks, backend), desc, self.timeout
                )
            except Exception as e:  # re-raised with context
                raise ac.failed(op, e, "creating the process group") from e
            self._created.append(pg)
        self._groups[key] = pg
        return pg

    def group_name_for(self, idx: tuple[int, ...], backend: str, op: str) -> str:
        """The name of this rank's group along ``idx`` on ``backend``, creating the group if it
        does not exist yet."""
        # a new AxisComm here is not stored: dynamo may be tracing self._axes
        ac = self._axes.get(idx) or self._new_axis(idx)
        self.check_usable(op, ac)
        return str(self._create_group(ac, backend, op).group_name)

    # ------------------------------------------------------------------ ctypes communicators
    def native(self, ac: AxisComm, op: str, x: Tensor) -> NativeCommunicator | None:
        """The ctypes communicator for ``ac`` when this mesh's backend serves ``x``'s device, else
        None.

        Created on first use by the group's members (id exchange over the gloo group).
        """
        lib = self.native_lib
        if lib is None or x.device.type != lib.device_type:
            return None
        if torch.compiler.is_compiling():
            _raise_while_tracing(
                op,
                ac.label,
                ac.ranks,
                self.global_rank,
                f"the {self.backend} backend runs eagerly (and in CUDA graphs), not under "
                "torch.compile",
                "compile with backend='torch'",
            )
        nc = self._native.get(ac.ranks)
        if nc is not None:
            return nc
        self.check_usable(op, ac)
        if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise CommError(
                op,
                ac.label,
                ac.ranks,
                self.global_rank,
                f"the {self.backend} communicator for this axis does not exist yet, and it cannot "
                "be created during CUDA graph capture",
                "call mesh.create_groups(device_type='cuda') once before capturing",
            )
        from fastdist.comm.native import NativeCommunicator, exchange_over_group

        exchange = exchange_over_group(ac.cpu_group(op))
        nc = ac.run(
            op,
            lambda: NativeCommunicator.create(
                lib,
                n=ac.n,
                index=ac.index,
                exchange=exchange,
                device=x.device,
                label=ac.label,
                ranks=ac.ranks,
                rank=self.global_rank,
            ),
            what="creating the communicator",
        )
        self._native[ac.ranks] = nc
        return nc

    def close(self, timeout: float = 5.0) -> bool:
        """Abort this mesh's ctypes communicators, waiting at most ``timeout`` seconds for each."""
        done = all([nc.close(timeout) for nc in self._native.values()])
        self._native.clear()
        return done

    # ------------------------------------------------------------------ recovery
    def abandon(self, why: str) -> None:
        """After a failure: destroy this mesh's groups now, so peers still waiting in them fail at
        once, not at their timeout.

        Until :meth:`reset`, every call on the mesh raises :class:`~fastdist.CommError` saying
        ``why``.
        """
        self.broken = why
        self.close(timeout=5.0)
        for ac in self._axes.values():
            ac._transports.clear()
        self._groups.clear()
        created, self._created = self._created, []
        # destroyed and unreferenced, a gloo group closes its connections (shutdown alone does not)
        while created:
            _drop_group(created.pop())

    def enter(self, op: str, ac: AxisComm) -> bool:
        """Mark this thread as inside a blocking call on the mesh (``in_call``); whether this call
        set the mark (False: an outer call on this thread holds it; the caller clears it only
        when True).

        A mesh's groups pair calls by their order, so two threads calling on one mesh at once
        would pair them differently on different processes (wrong data, or a hang): a call made
        while another thread is inside one on the same mesh raises :class:`~fastdist.CommError`
        at once, before anything is sent. Calls that do not overlap in time are not seen.
        """
        me = threading.get_ident()
        owner = self.in_call
        if owner == me:
            return False
        if owner is not None:
            raise CommError(
                op,
                ac.label,
                ac.ranks,
                self.global_rank,
                f"another thread (ident {owner}) is inside a call on this mesh: a mesh's groups "
                "pair calls by their order, which two threads would make differ between the "
                "processes (nothing was sent; the mesh stays usable)",
                "make the calls on a mesh from one thread at a time (e.g. a lock around each "
                "step), or give each thread its own mesh (Mesh.from_torch once per thread, built "
                "in the same order on every rank)",
            )
        self.in_call = me
        return True

    def check_usable(self, op: str, ac: AxisComm) -> None:
        """Raise if an earlier failure dropped this mesh's groups (see :meth:`abandon`)."""
        if self.broken is not None:
            raise CommError(
                op,
                ac.label,
                ac.ranks,
                self.global_rank,
                f"this mesh's process groups were dropped after an earlier failure ({self.broken})",
                "call mesh.reset() on every rank of the mesh, then redo the step",
            )

    def reset(self, timeout: datetime.timedelta) -> None:
        """Drop this mesh's groups and agree with every rank of the mesh on fresh ones (see
        :meth:`fastdist.Mesh.reset`).

        Local work first: abort the ctypes communicators, destroy the process groups this comm
        created (their peers' pending calls fail at once), forget every cached axis. Then
        through the job's store: move to the next epoch (the newest any rank has reached, so
        ranks that reset at different times agree), and wait until every rank of the mesh has
        reset, up to ``timeout``. New groups are created lazily under new names.
        """
        self.abandon("")
        self.broken = None
        self._axes.clear()
        self._specs.clear()
        self._device_mesh = (
            None  # a DeviceMesh's groups may be broken too: from now on this mesh makes its own
        )
        everyone = list(self.ranks)  # global ranks: the store's keys and the messages name them
        key = f"fastdist/{self.uid}/epoch"
        try:
            self.store.add(key, 0)  # "0" when missing
            # the newest epoch any rank moved to
            self.epoch = int(self.store.compare_set(key, str(self.epoch), str(self.epoch + 1)))
            self.tag = f"{self.uid}.e{self.epoch}"
            arrived = f"fastdist/{self.uid}/e{self.epoch}/reset/"
            self.store.set(arrived + str(self.global_rank), "1")
            missing = _wait_for_keys(self.store, arrived, everyone, timeout.total_seconds())
        except Exception as e:  # the store itself is gone
            raise CommError(
                "Mesh.reset",
                self.mesh.axis_names,
                everyone,
                self.global_rank,
                f"the job's store is unreachable ({_clean(e)})",
                "the process hosting the store (rank 0, or torchrun's agent) probably exited: "
                "restart the job",
            ) from e
        if missing:
            raise CollectiveTimeout(
                "Mesh.reset",
                self.mesh.axis_names,
                everyone,
                self.global_rank,
                f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not "
                f"call reset within {timeout.total_seconds():g} s{_in_slice(self)}",
                "every rank of the mesh must call mesh.reset() after a failure; a rank that "
                "exited cannot rejoin: restart the job",
            )


def _in_slice(comm: Any) -> str:
    """`` (slice pp=1: global ranks [4, 5, 6, 7])`` for a slice's messages; ``""`` for a mesh over
    the whole job (or a stand-in comm without slices)."""
    where = getattr(comm, "where", "")
    return f" (slice {where}: global ranks {list(comm.ranks)})" if where else ""


def _members(ranks: Sequence[int]) -> str:
    """The ranks of a group, in order, as part of a name: ``0-1-2-3``, or a digest when that gets
    long."""
    text = "-".join(map(str, ranks))
    return (
        text
        if len(text) <= 64
        else f"{len(ranks)}r{hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:16]}"
    )


def _drop_group(pg: Any) -> None:
    """Destroy ``pg`` without waiting for its peers (NCCL-like backends are aborted first: their
    shutdown may wait on hung work)."""
    try:
        if dist.get_backend(pg) != "gloo" and hasattr(pg, "abort"):
            pg.abort()
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001, S110 - a broken group may refuse a clean shutdown; it is dropped either way
        pass


def _new_named_group(
    ranks: list[int], backend: str, name: str, desc: str, timeout: datetime.timedelta
) -> Any:
    """``new_group(ranks, use_local_synchronization=True, sort_ranks=False)`` with the group name
    given, not counted.

    Only the members call it. ``torch.distributed.new_group`` takes no name and derives one
    from how many groups this process made, which differs between ranks that used the mesh in
    different orders; the helper below is what ``new_group`` calls with that name.
    """
    default = c10d._get_default_group()
    pg, _ = c10d._new_process_group_helper(
        len(ranks),
        ranks.index(dist.get_rank()),
        ranks,
        c10d.Backend(backend),
        c10d._get_default_store(),
        c10d.GroupName(name),
        timeout=timeout,
        device_id=default.bound_device_id,
        group_desc=desc,
    )
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg


def _wait_for_keys(
    store: Any, prefix: str, ranks: Sequence[int], seconds: float, keep_last: bool = False
) -> list[int]:
    """Poll ``store`` until ``prefix + str(r)`` exists for every ``r`` in ``ranks``, at most
    ``seconds``; the ranks still missing.

    With ``keep_last``, a store that fails after the first poll (its host exited meanwhile) ends
    the wait with what that poll found.
    """
    deadline = time.monotonic() + seconds
    missing: list[int] | None = None
    while True:
        try:
            missing = [r for r in ranks if not store.check([prefix + str(r)])]
        except Exception:
            if keep_last and missing is not None:
                return missing
            raise
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.02)


def _run_while_tracing(fn: _Fn) -> _Fn:
    """Mark ``fn`` for dynamo: called (not traced) while it traces, its result a constant of the
    graph.

    This is what ``torch._dynamo.assume_constant_result`` does (it sets this one attribute), done
    here so that importing fastdist does not import dynamo (a second of import time);
    tests/test_import_time.py checks that torch's marker is still this attribute.
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@_run_while_tracing
def _group_name_while_tracing(
    comm: TorchComm, idx: tuple[int, ...], backend: str, op: str, tag: str
) -> str:
    """Run (not traced) while dynamo traces a collective: the group's name, creating the group now
    if needed.

    ``tag`` names the comm's current groups; passing it makes dynamo guard on it, so a step
    compiled before :meth:`TorchComm.reset` is traced again (with the new groups) after it.
    """
    return comm.group_name_for(idx, backend, op)


@_run_while_tracing
def _raise_while_tracing(
    op: str, axis: Any, ranks: tuple[int, ...], rank: int, problem: str, fix: str
) -> None:
    """Raise :class:`~fastdist.CommError` from inside dynamo's tracing (it cannot construct
    fastdist's exceptions in a graph)."""
    raise CommError(op, axis, ranks, rank, problem, fix)


_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


class TorchTransport:
    """torch.distributed for one axis group on one device type, called eagerly.

    Direct c10d calls on the group: the least work per call (about half the CPU time of
    the functional collectives on small messages). Outputs are new tensors; inputs are
    never written. Under ``torch.compile`` :class:`FunctionalTransport` takes its place.
    """

    def __init__(self, pg: Any, n: int) -> None:
        self.pg, self.name, self.n = pg, str(pg.group_name), n

    def all_reduce(self, op: str, x: Tensor, reduce_op: str) -> Tensor:
        y = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(y, op=_REDUCE_OPS[reduce_op], group=self.pg)
        return y

    def all_gather_rows(self, op: str, x: Tensor) -> Tensor:
        out = x.new_empty((self.n * x.shape[0], *x.shape[1:]))  # [n * s0, *rest]
        dist.all_gather_single(out, x.contiguous(), group=self.pg)
        return out

    def reduce_scatter_rows(self, op: str, x: Tensor) -> Tensor:
        out = x.new_empty((x.shape[0] // self.n, *x.shape[1:]))  # [s0 / n, *rest]
        dist.reduce_scatter_single(out, x.contiguous(), group=self.pg)
        return out

    def all_to_all_rows(
        self, op: str, x: Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None
    ) -> Tensor:
        rows = x.shape[0] if out_splits is None else sum(out_splits)  # None: equal splits both ways
        out = x.new_empty((rows, *x.shape[1:]))  # [rows received, *rest]
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=self.pg)
        return out

    def broadcast(self, op: str, x: Tensor, src: int) -> Tensor:
        y = x.clone(memory_format=torch.contiguous_format)
        dist.broadcast(y, group_src=src, group=self.pg)
        return y

    def all_gather_v_rows(self, op: str, x: Tensor, sizes: Sequence[int], index: int) -> Tensor:
        """Pad every member's rows to the largest size, all-gather, drop the padding."""
        m = max(sizes)
        # [n, m, *f]
        got = self.all_gather_rows(op, _pad_rows(x[: sizes[index]], m)).unflatten(0, (self.n, m))  # type: ignore[no-untyped-call]
        return torch.cat([got[i, : sizes[i]] for i in range(self.n)])  # [sum, *f]

    def reduce_scatter_v_rows(self, op: str, x: Tensor, sizes: Sequence[int], index: int) -> Tensor:
        """Pad every chunk to the largest size, reduce-scatter, drop the padding."""
        m = max(sizes)
        padded = torch.cat([_pad_rows(t, m) for t in torch.split(x, list(sizes))])  # [n * m, *f]
        return self.reduce_scatter_rows(op, padded)[: sizes[index]]  # [sizes[me], *f]


class FunctionalTransport(TorchTransport):
    """The same collectives through torch's functional collectives, which dynamo traces (used under
    ``torch.compile``).

    Built from the group's name (a constant in the graph), not the group object.
    """

    def __init__(self, name: str, n: int) -> None:
        self.pg, self.name, self.n = None, name, n

    def all_reduce(self, op: str, x: Tensor, reduce_op: str) -> Tensor:
        return cast(Tensor, _F.wait_tensor(_F.all_reduce(x.contiguous(), reduce_op, self.name)))

    def all_gather_rows(self, op: str, x: Tensor) -> Tensor:
        return cast(
            Tensor, _F.wait_tensor(_F.all_gather_into_tensor(x.contiguous(), self.n, self.name))
        )

    def reduce_scatter_rows(self, op: str, x: Tensor) -> Tensor:
        return cast(
            Tensor,
            _F.wait_tensor(_F.reduce_scatter_tensor(x.contiguous(), "sum", self.n, self.name)),
        )

    def all_to_all_rows(
        self, op: str, x: Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None
    ) -> Tensor:
        if out_splits is None or in_splits is None:
            out_splits = in_splits = [x.shape[0] // self.n] * self.n
        return cast(
            Tensor,
            _F.wait_tensor(
                _F.all_to_all_single(x.contiguous(), list(out_splits), list(in_splits), self.name)
            ),
        )

    def broadcast(self, op: str, x: Tensor, src: int) -> Tensor:
        return cast(Tensor, _F.wait_tensor(_F.broadcast(x.contiguous(), src, self.name)))


class AxisComm:
    """This rank's group along one axis (or tuple of axes): ranks in axis order, own index,
    groups."""

    def __init__(
        self, comm: TorchComm, idx: tuple[int, ...], label: Any, ranks: tuple[int, ...]
    ) -> None:
        self.comm, self.idx, self.label, self.ranks = comm, idx, label, ranks
        self.n = len(ranks)
        self.index = ranks.index(comm.global_rank)
        self.rank = comm.global_rank  # global, as the ranks
        self._transports: dict[str, TorchTransport] = {}
        # blocking calls made on this group (eagerly): names the call a failure report is about
        self.calls = 0

    def cpu_group(self, op: str) -> Any:
        """A gloo group for objects and metadata (the device group when tensors live on CPU)."""
        return self.comm.group(self, "gloo", op)

    def run(self, op: str, fn: Callable[..., T], *args: Any, what: str = "the collective") -> T:
        """``fn(*args)``, a blocking call, with timeouts and lost peers turned into errors that
        name op, axis and ranks."""
        if torch.compiler.is_compiling():
            return fn(*args)
        self.comm.check_usable(op, self)
        entered = self.comm.enter(op, self)
        self.calls += 1
        try:
            return fn(*args)
        except (CommError, MeshError, NoBackendError):
            raise
        except Exception as e:  # c10d raises RuntimeError/DistError for everything
            traceback.clear_frames(e.__traceback__)  # let go of the group (see _collective)
            raise self.failed(op, e, what) from e
        finally:
            if entered:
                self.comm.in_call = None

    def failed(self, op: str, e: BaseException, what: str) -> CommError:
        """The error for a failed blocking call: its cause without source paths, and which peers
        did not reach the call.

        Each member whose call fails leaves a note in the job's store under this call's number
        on this group; this rank then waits briefly for its peers' notes. A peer without a note
        did not reach the call (it raised before it, skipped it, is stuck elsewhere or exited).
        Before that the mesh's groups are destroyed (:meth:`TorchComm.abandon`), so that peers
        blocked in this call, or in another call on the mesh that waits for this rank, fail at
        once and report too.
        """
        self.comm.abandon(f"fastdist.{op}(axis={self.label!r}) failed on this rank: {_clean(e)}")
        return _comm_error(op, self, self.rank, e, what, peers=self._peer_report(what))

    def _peer_report(self, what: str) -> str:
        others = [r for r in self.ranks if r != self.rank]
        if not others:
            return ""
        grace = min(2.0, max(0.25, 0.25 * self.comm.timeout.total_seconds()))
        prefix = f"fastdist/{self.comm.tag}/{_members(self.ranks)}/call{self.calls}/"
        try:
            self.comm.store.set(prefix + str(self.rank), what)
            missing = _wait_for_keys(self.comm.store, prefix, others, grace, keep_last=True)
        except Exception:  # noqa: BLE001 - the store is gone too: report the failure without the roll call
            return ""
        if not missing:
            return (
                f"every rank of the group reached this call (call {self.calls} on this group) and "
                "it failed on each, so they probably disagree "
                "on it (different ops, shapes or sizes: Mesh.from_torch(check=True) compares them)"
            )
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        return (
            f"{who} did not reach this call (call {self.calls} on this group) within {grace:g} s "
            f"of this failure: {'they' if len(missing) > 1 else 'it'} may have raised an error "
            f"before it (see {'their logs' if len(missing) > 1 else 'its log'}), skipped it, be "
            "stuck elsewhere, or have exited"
        )

    # --------------------------------------------------------------- collectives
    # Each method picks the transport for x's device -- torch.distributed (TorchTransport) or,
    # on a ctypes mesh, NCCL/HCCL (fastdist.comm.native.NativeCommunicator): same methods and
    # results.
    def transport(self, op: str, x: Tensor) -> TorchTransport | NativeCommunicator:
        """The transport of this axis group for ``x``'s device (memoised per device type;
        functional under compile)."""
        if self.comm.native_lib is not None:
            nc = self.comm.native(self, op, x)  # None when the backend does not serve x's device
            if nc is not None:
                return nc
        kind = x.device.type
        backend = self._backend(op, kind)
        if torch.compiler.is_compiling():
            return FunctionalTransport(
                _group_name_while_tracing(self.comm, self.idx, backend, op, self.comm.tag), self.n
            )
        t = self._transports.get(kind)
        if t is None:
            t = self._transports[kind] = TorchTransport(self.comm.group(self, backend, op), self.n)
        return t

    def _backend(self, op: str, device_type: str) -> str:
        """The c10d backend for tensors on ``device_type``; for none, an error naming the op, the
        axis and the fix."""
        try:
            return select_backend(device_type)
        except NoBackendError as e:
            if device_type == "meta":
                problem = "'meta' tensors hold no data to communicate"
                fix = (
                    "pass cpu, cuda or npu tensors; to work out shapes only, run the per-rank code "
                    "under fastdist.simulate (simulated ranks take meta tensors) or let "
                    "torch.compile trace it with fake tensors"
                )
            else:
                problem, fix = (
                    str(e).removeprefix("fastdist: ").split(". Fix: ", 1)
                    if ". Fix: " in str(e)
                    else (str(e), "move tensors to cpu, cuda or npu")
                )
            raise NoBackendError(
                f"fastdist.{op}(axis={self.label!r}) on rank {self.rank} (group ranks "
                f"{list(self.ranks)}): {problem}. Fix: {fix}"
            ) from None

    def _collective(self, op: str, x: Tensor, method: str, *args: Any) -> Tensor:
        """``transport.method(op, x, *args)``; failures become errors naming op, axis and ranks (as
        :meth:`run`)."""
        if torch.compiler.is_compiling():
            return cast(Tensor, getattr(self.transport(op, x), method)(op, x, *args))
        if self.comm.broken is not None:
            self.comm.check_usable(op, self)
        entered = self.comm.enter(op, self)
        self.calls += 1
        t: TorchTransport | NativeCommunicator | None = None
        try:
            if self.comm.native_lib is None:
                t = self._transports.get(x.device.type)
            if t is None:
                t = self.transport(op, x)
            return cast(Tensor, getattr(t, method)(op, x, *args))
        except (CommError, MeshError, NoBackendError):
            raise
        except Exception as e:  # c10d raises RuntimeError/DistError for everything
            # let go of the group, so that abandoning it frees it and its connections close
            t = None
            # the same for the finished frames of the failed call
            traceback.clear_frames(e.__traceback__)
            raise self.failed(op, e, "the collective") from e
        finally:
            if entered:
                self.comm.in_call = None

    def all_reduce(self, op: str, x: Tensor, reduce_op: str) -> Tensor:
        """Elementwise ``reduce_op`` (``"sum" | "max" | "min"``) over members; same shape."""
        return self._collective(op, x, "all_reduce", reduce_op)

    def all_gather_rows(self, op: str, x: Tensor) -> Tensor:
        """Concatenate every member's ``x`` along dim 0, in axis order."""
        return self._collective(op, x, "all_gather_rows")

    def reduce_scatter_rows(self, op: str, x: Tensor) -> Tensor:
        """Sum over members, member ``i`` keeps chunk ``i`` of dim 0."""
        return self._collective(op, x, "reduce_scatter_rows")

    def all_to_all_rows(
        self, op: str, x: Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None
    ) -> Tensor:
        """Rows ``in_splits[j]`` of dim 0 go to member ``j``; received rows are stacked by sender
        (``None``: equal splits)."""
        return self._collective(op, x, "all_to_all_rows", out_splits, in_splits)

    def broadcast(self, op: str, x: Tensor, src: int) -> Tensor:
        """Every member gets member ``src``'s ``x``."""
        return self._collective(op, x, "broadcast", src)

    def all_gather_v_rows(self, op: str, x: Tensor, sizes: Sequence[int]) -> Tensor:
        """Member ``i`` contributes ``x[:sizes[i]]``; all get them concatenated on dim 0
        (``[sum(sizes), ...]``)."""
        return self._collective(op, x, "all_gather_v_rows", sizes, self.index)

    def reduce_scatter_v_rows(self, op: str, x: Tensor, sizes: Sequence[int]) -> Tensor:
        """Sum ``x`` (``[sum(sizes), ...]``) over members; member ``i`` keeps its ``sizes[i]``
        rows."""
        return self._collective(op, x, "reduce_scatter_v_rows", sizes, self.index)

    # --------------------------------------------------------------- check mode
    def check(self, op: str, tensors: Sequence[Tensor], params: Mapping[str, Any]) -> None:
        """Check mode: every member must call ``op`` with the same shapes, dtypes and parameters."""
        if not self.comm.check or torch.compiler.is_compiling():
            return
        mine = (
            op,
            [tuple(t.shape) for t in tensors],
            [str(t.dtype) for t in tensors],
            dict(params),
            _call_site(),
        )
        every: list[Any] = [None] * self.n
        group = self.cpu_group(op)
        self.run(
            op,
            lambda: dist.all_gather_object(every, mine, group=group),
            what="the consistency check",
        )
        if any(e != every[0] for e in every):
            table = "; ".join(
                f"rank {r}: {e[0]}(shapes={e[1]}, dtypes={e[2]}, params={e[3]}) at "
                f"{e[4][0]}:{e[4][1]}"
                for r, e in zip(self.ranks, every)
            )
            where = (
                " (the same call from different lines: a rank skipped or added a call before "
                "this one, so its calls pair with its peers' other calls)"
                if all(e[:4] == every[0][:4] for e in every)
                else ""
            )
            raise ConsistencyError(
                op,
                self.label,
                self.ranks,
                self.rank,
                f"the ranks disagree{where}: {table}",
                "make every rank of the group make the same calls in the same order, each from "
                "the same line of code",
            )


# where fastdist's and torch's own frames live: skipped when check mode looks for the caller
_LIBRARY_DIRS = (
    os.path.join(str(Path(__file__).parent), ""),
    os.path.join(str(Path(torch.__file__).parent), ""),
)


def _call_site() -> tuple[str, int]:
    """``(file name, line)`` of the innermost frame outside fastdist and torch: where the user's
    code called the collective (check mode compares it between ranks). The file's name without
    its directory: the script may sit in different directories on different nodes."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_LIBRARY_DIRS):
            return os.path.basename(name), frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>", 0


def _pad_rows(x: Tensor, rows: int, dim: int = 0) -> Tensor:
    """``x`` with zeros appended along ``dim`` up to ``rows``."""
    if x.shape[dim] == rows:
        return x
    pad = list(x.shape)
    pad[dim] = rows - x.shape[dim]
    return torch.cat([x, x.new_zeros(pad)], dim=dim)


def _native_library(backend: str, library: Any) -> NativeLibrary | None:
    """The bound library for a ctypes backend (loaded when the mesh is built, so errors come
    early)."""
    from fastdist.comm.native import BACKENDS, load_library

    if backend not in BACKENDS:
        raise MeshError(
            f"fastdist: unknown backend {backend!r}. Fix: use one of "
            f"{', '.join(map(repr, BACKENDS))}"
        )
    if backend == "torch":
        if library is not None:
            raise MeshError(
                "fastdist: library= only applies to backend='nccl-ctypes' or 'hccl-ctypes'. Fix: "
                "drop library=, or pass backend='nccl-ctypes' (or 'hccl-ctypes') with it"
            )
        return None
    if library is not None and not isinstance(library, (str, Path)):
        return cast("NativeLibrary", library)  # already bound (Mesh.with_timeout passes it on)
    return load_library(backend.split("-")[0], None if library is None else str(library))


# "[/pytorch/third_party/gloo/.../pair.cc:553] "
_SOURCE_PATH = re.compile(r"\[[^\[\]\s]*\.(?:cc|cpp|cu|h|hpp|c|py):\d+\]\s*")
_NOISE = re.compile(r"\s*This is typically caused by .*$", re.DOTALL)


def _clean(e: BaseException) -> str:
    """The first line of ``e``'s message without C++ source locations and torch's boilerplate
    advice."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return _NOISE.sub("", _SOURCE_PATH.sub("", first)).strip().rstrip(".") or type(e).__name__


def _comm_error(
    op: str, ac: AxisComm, rank: int, e: BaseException, what: str, peers: str = ""
) -> CommError:
    """The fastdist error for a failed c10d call: :class:`CollectiveTimeout` for a timeout, else
    :class:`CommError`.

    ``peers`` (from :meth:`AxisComm.failed`) says which peers did not reach the call.
    """
    msg = _clean(e)
    extra = f"; {peers}" if peers else ""
    where = _in_slice(ac.comm)
    timed_out = (
        "timed out" in msg.lower() or "timeout" in msg.lower() or isinstance(e, TimeoutError)
    )
    if timed_out:
        secs = ac.comm.timeout.total_seconds()
        order = "check that every rank of the group makes this call in the same order"
        if what == "creating the process group":  # the ranks may be on different meshes
            base, k = ac.comm.uid.rsplit(".", 1)
            which = (
                f"slice {ac.comm.where} number {k} of mesh {base.rsplit('-', 1)[0]}"
                if ac.comm.where
                else f"mesh {k} of shape {base}"
            )
            order = (
                "check that every rank builds its meshes of one shape in the same order "
                "(Mesh.from_torch, Mesh.from_device_mesh and mesh.with_timeout each count; this is "
                f"{which} built on this rank, and a group's name carries that "
                "number, so meshes built in different orders never meet), and that every rank of "
                "the group makes this call"
            )
        return CollectiveTimeout(
            op,
            ac.label,
            ac.ranks,
            rank,
            f"a peer did not arrive for {what}{where} within the timeout ({secs:g} s): "
            f"{msg}{extra}",
            f"{order}; to go on after a failure call mesh.reset() on every rank; "
            "raise the timeout with Mesh.from_torch(timeout=...) or mesh.with_timeout(...)",
        )
    return CommError(
        op,
        ac.label,
        ac.ranks,
        rank,
        f"{what}{where} failed: {msg}{extra}",
        "a peer closed the connection: it failed (see its log) or exited; if every rank is still "
        "alive, call mesh.reset() on every rank to go on",
    )


# =================================================================== helpers on real ranks
def _axis_comm(op: str, mesh: Mesh, axis: AxisName | None) -> AxisComm:
    comm = mesh._comm
    if comm is None:
        raise NoBackendError(
            f"fastdist.{op}: {mesh!r} is not backed by torch.distributed. Fix: build it with "
            "Mesh.from_torch(...) inside a torch.distributed job"
        )
    names = mesh.axis_names if axis is None else axis
    ac: AxisComm = comm.axis(mesh.axis_indices(names, f"fastdist.{op}"))
    return ac


def _check_src(op: str, ac: AxisComm, name: str, value: Any, *, peer: bool = False) -> int:
    """``value`` if it is an index along ``ac``'s axis (with ``peer``: another rank's); else a
    :class:`~fastdist.CommArgumentError`, raised before any communication (the mesh stays
    usable)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < ac.n:
        raise CommArgumentError(
            op,
            ac.label,
            ac.ranks,
            ac.rank,
            f"{name}={value!r} is not an index along the axis (size {ac.n})",
            f"use {name} in 0..{ac.n - 1}",
        )
    if peer and value == ac.index:
        others = [i for i in range(ac.n) if i != ac.index]
        raise CommArgumentError(
            op,
            ac.label,
            ac.ranks,
            ac.rank,
            f"{name}={value} is this rank's own index along the axis: a point-to-point call "
            "needs another rank",
            f"use {name} in {others} (the other indices along the axis)"
            if others
            else "the axis has one rank: there is no other rank to talk to; use the value directly",
        )
    return value


def broadcast_object(obj: T, mesh: Mesh, axis: AxisName | None = None, src: int = 0) -> T:
    """Every rank of the group gets the (picklable) ``obj`` of the rank with index ``src`` along
    ``axis``.

    ``axis=None`` means the whole mesh. Blocks up to the mesh's timeout.

    Args:
        obj: the picklable object (only ``src``'s is used).
        mesh: a mesh from ``Mesh.from_torch`` (real ranks).
        axis: the mesh axis of the group (or a tuple of axes); ``None``: the whole mesh.
        src: the index along ``axis`` of the rank whose ``obj`` every rank gets.

    Returns:
        ``src``'s object, on every rank of the group.
    """
    ac = _axis_comm("broadcast_object", mesh, axis)
    _check_src("broadcast_object", ac, "src", src)
    box = [obj]
    group = ac.cpu_group("broadcast_object")
    ac.run("broadcast_object", lambda: dist.broadcast_object_list(box, group=group, group_src=src))
    return box[0]


def all_gather_object(obj: T, mesh: Mesh, axis: AxisName | None = None) -> list[T]:
    """The (picklable) ``obj`` of every rank of the group, in axis order.

    Args:
        obj: this rank's picklable object.
        mesh: a mesh from ``Mesh.from_torch`` (real ranks).
        axis: the mesh axis of the group (or a tuple of axes); ``None``: the whole mesh.

    Returns:
        every rank's object, in axis order.
    """
    ac = _axis_comm("all_gather_object", mesh, axis)
    out: list[Any] = [None] * ac.n
    group = ac.cpu_group("all_gather_object")
    ac.run("all_gather_object", lambda: dist.all_gather_object(out, obj, group=group))
    return out


def send_object(obj: Any, mesh: Mesh, axis: AxisName, dst: int) -> None:
    """Send a picklable object to the rank with index ``dst`` along ``axis`` (pair with
    :func:`recv_object`).

    Args:
        obj: the picklable object.
        mesh: a mesh from ``Mesh.from_torch`` (real ranks).
        axis: the mesh axis (or tuple of axes) along which ``dst`` is an index.
        dst: the index of the receiving rank (not this rank's own).
    """
    ac = _axis_comm("send_object", mesh, axis)
    _check_src("send_object", ac, "dst", dst, peer=True)
    group = ac.cpu_group("send_object")
    ac.run("send_object", lambda: dist.send_object_list([obj], group=group, group_dst=dst))


def recv_object(mesh: Mesh, axis: AxisName, src: int) -> Any:
    """Receive the object sent by the rank with index ``src`` along ``axis``.

    Args:
        mesh: a mesh from ``Mesh.from_torch`` (real ranks).
        axis: the mesh axis (or tuple of axes) along which ``src`` is an index.
        src: the index of the sending rank (not this rank's own).

    Returns:
        the object ``src`` sent.
    """
    ac = _axis_comm("recv_object", mesh, axis)
    _check_src("recv_object", ac, "src", src, peer=True)
    box: list[Any] = [None]
    group = ac.cpu_group("recv_object")
    ac.run("recv_object", lambda: dist.recv_object_list(box, group=group, group_src=src))
    return box[0]


def send(x: Tensor, mesh: Mesh, axis: AxisName, dst: int) -> None:
    """Send tensor ``x`` to the rank with index ``dst`` along ``axis`` (not differentiable; see
    ``ppermute``).

    Args:
        x: the tensor to send.
        mesh: a mesh from ``Mesh.from_torch`` (real ranks).
        axis: the mesh axis (or tuple of axes) along which ``dst`` is an index.
        dst: the index of the receiving rank (not this rank's own).
    """
    ac = _axis_comm("send", mesh, axis)
    _check_src("send", ac, "dst", dst, peer=True)
    group = ac.comm.group(ac, select_backend(x.device.type), "send")
    ac.run("send", lambda: dist.send(x.contiguous(), group=group, group_dst=dst))


def recv(like: Tensor, mesh: Mesh, axis: AxisName, src: int) -> Tensor:
    """Receive a tensor shaped like ``like`` (shape, dtype, device) from index ``src`` along
    ``axis``.

    Args:
        like: a tensor with the shape, dtype and device of the one to receive.
        mesh: a mesh from ``Mesh.from_torch`` (real ranks).
        axis: the mesh axis (or tuple of axes) along which ``src`` is an index.
        src: the index of the sending rank (not this rank's own).

    Returns:
        the received tensor.
    """
    ac = _axis_comm("recv", mesh, axis)
    _check_src("recv", ac, "src", src, peer=True)
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    group = ac.comm.group(ac, select_backend(out.device.type), "recv")
    ac.run("recv", lambda: dist.recv(out, group=group, group_src=src))
    return out


def _split_dict(d: Mapping[str, Any]) -> tuple[list[tuple[str, Any]], list[Tensor]]:
    """Metadata (tensor shapes/dtypes/devices, other values as they are) and the tensors, in key
    order."""
    meta: list[tuple[str, Any]] = []
    tensors: list[Tensor] = []
    for key, value in d.items():
        if isinstance(value, Tensor):
            meta.append((key, ("__tensor__", tuple(value.shape), value.dtype, value.device.type)))
            tensors.append(value.contiguous())
        else:
            meta.append((key, ("__value__", value)))
    return meta, tensors


def _empty_from(meta: list[tuple[str, Any]]) -> tuple[dict[str, Any], list[Tensor]]:
    out: dict[str, Any] = {}
    tensors: list[Tensor] = []
    for key, entry in meta:
        if entry[0] == "__tensor__":
            _, shape, dtype, device_type = entry
            device = (
                torch.device(device_type, torch.cuda.current_device())
                if device_type == "cuda"
                else torch.device(device_type)
            )
            out[key] = t = torch.empty(shape, dtype=dtype, device=device)
            tensors.append(t)
        else:
            out[key] = entry[1]
    return out, tensors


def broadcast_tensor_dict(
    d: Mapping[str, Any] | None, mesh: Mesh, axis: AxisName | None = None, src: int = 0
) -> dict[str, Any]:
    """Broadcast a dict of tensors and picklable values from index ``src``; other ranks pass
    ``None``.

    Metadata travels as one object; tensors by a broadcast each on their device's group.

    Args:
        d: the dict on ``src``; ``None`` on the other ranks.
        mesh: a mesh from ``Mesh.from_torch`` (real ranks).
        axis: the mesh axis of the group (or a tuple of axes); ``None``: the whole mesh.
        src: the index along ``axis`` of the sending rank.

    Returns:
        ``src``'s dict, on every rank of the group.
    """
    op = "broadcast_tensor_dict"
    ac = _axis_comm(op, mesh, axis)
    _check_src(op, ac, "src", src)
    if ac.index == src:
        if d is None:
            raise CommArgumentError(
                op,
                ac.label,
                ac.ranks,
                ac.rank,
                "the source rank passed None",
                "pass the dict to send on the source rank",
            )
        meta, tensors = _split_dict(d)
        broadcast_object(meta, mesh, ac.label, src)
        out = dict(d)
    else:
        # filled from src
        meta = broadcast_object(cast(list[tuple[str, Any]], None), mesh, ac.label, src)
        out, tensors = _empty_from(meta)
    for t in tensors:
        group = ac.comm.group(ac, select_backend(t.device.type), op)
        ac.run(op, lambda t=t, group=group: dist.broadcast(t, group=group, group_src=src))
    return out


def _ag_plan(
    op: str, mesh: Mesh, axis: AxisName, all_gather_axis: AxisName | None
) -> AxisComm | None:
    """The all-gather axis of a tensor-dict transfer (None: whole tensors); it must not share mesh
    axes with ``axis``."""
    if all_gather_axis is None:
        return None
    ac, gac = _axis_comm(op, mesh, axis), _axis_comm(op, mesh, all_gather_axis)
    shared = set(mesh.axis_indices(axis, op)) & set(mesh.axis_indices(all_gather_axis, op))
    if shared:
        raise CommArgumentError(
            op,
            ac.label,
            ac.ranks,
            ac.rank,
            f"all_gather_axis={all_gather_axis!r} shares mesh axes with the transfer axis {axis!r}",
            "pass an axis the sender and receiver groups both span (e.g. transfer over 'pp', "
            "all-gather over 'tp')",
        )
    return gac if gac.n > 1 else None


def _sliced(t: Tensor, gac: AxisComm | None) -> bool:
    """Whether ``t`` travels as 1/n slices (its element count divides by the all-gather axis
    size)."""
    return gac is not None and t.numel() > 0 and t.numel() % gac.n == 0


def send_tensor_dict(
    d: Mapping[str, Any],
    mesh: Mesh,
    axis: AxisName,
    dst: int,
    *,
    all_gather_axis: AxisName | None = None,
) -> None:
    """Send a dict of tensors and picklable values to index ``dst`` (pair with
    :func:`recv_tensor_dict`).

    ``all_gather_axis`` (vLLM's all-gather optimisation for pipeline stages): the dict is the
    same on every rank of that axis (e.g. ``"tp"``), so each of them sends only its 1/n slice of
    every tensor whose element count n divides, and the receivers, which pass the same
    ``all_gather_axis``, all-gather the slices over it: n times less traffic on ``axis``.
    Other tensors travel whole.

    Args:
        d: a dict of tensors and picklable values.
        mesh: a mesh from ``Mesh.from_torch`` (real ranks).
        axis: the mesh axis (or tuple of axes) along which ``dst`` is an index.
        dst: the index of the receiving rank.
        all_gather_axis: an axis over which ``d`` is the same on every rank: each sends a slice, the
            receivers all-gather them.

    >>> import fastdist as fd  # doctest: +SKIP
    >>> mesh = fd.Mesh.from_torch(pp=2, tp=4)  # doctest: +SKIP
    >>> if fd.axis_index(mesh, "pp") == 0:  # doctest: +SKIP
    ...     fd.send_tensor_dict({"h": hidden}, mesh, "pp", dst=1, all_gather_axis="tp")
    ... else:
    ...     hidden = fd.recv_tensor_dict(mesh, "pp", src=0, all_gather_axis="tp")["h"]
    """
    op = "send_tensor_dict"
    gac = _ag_plan(op, mesh, axis, all_gather_axis)
    _check_src(op, _axis_comm(op, mesh, axis), "dst", dst, peer=True)
    meta, tensors = _split_dict(d)
    send_object((meta, None if gac is None else gac.label), mesh, axis, dst)
    for t in tensors:
        if _sliced(t, gac):
            assert gac is not None
            k = t.numel() // gac.n
            # (numel/n,) my slice of the flattened tensor
            t = t.reshape(-1)[gac.index * k : (gac.index + 1) * k]
        send(t.contiguous(), mesh, axis, dst)


def recv_tensor_dict(
    mesh: Mesh, axis: AxisName, src: int, *, all_gather_axis: AxisName | None = None
) -> dict[str, Any]:
    """Receive the dict sent by :func:`send_tensor_dict` from index ``src`` along ``axis``.

    Pass the sender's ``all_gather_axis``; a mismatch raises :class:`~fastdist.CommError` at
    once on the receiver (the sender's choice travels with the metadata).

    Args:
        mesh: a mesh from ``Mesh.from_torch`` (real ranks).
        axis: the mesh axis (or tuple of axes) along which ``src`` is an index.
        src: the index of the sending rank.
        all_gather_axis: the sender's ``all_gather_axis``.

    Returns:
        the dict ``src`` sent.
    """
    op = "recv_tensor_dict"
    gac = _ag_plan(op, mesh, axis, all_gather_axis)
    _check_src(op, _axis_comm(op, mesh, axis), "src", src, peer=True)
    meta, sender_ag = recv_object(mesh, axis, src)
    ac = _axis_comm(op, mesh, axis)
    mine = None if gac is None else gac.label
    if sender_ag != mine:
        raise CommError(
            op,
            ac.label,
            ac.ranks,
            ac.rank,
            f"the sender used all_gather_axis={sender_ag!r}, this rank {mine!r}",
            "pass the same all_gather_axis on both sides",
        )
    out, tensors = _empty_from(meta)
    for t in tensors:
        group = ac.comm.group(ac, select_backend(t.device.type), op)
        # whole, or (numel/n,) my slice
        buf = t if not _sliced(t, gac) else t.new_empty(t.numel() // cast(AxisComm, gac).n)
        ac.run(op, lambda buf=buf, group=group: dist.recv(buf, group=group, group_src=src))
        if buf is t:
            continue
        assert gac is not None
        # (numel,) every member's slice, in index order
        t.view(-1).copy_(gac.all_gather_rows(op, buf))
    return out


class GraphCaptureContext:
    """What :func:`graph_capture` sets up: the ``stream`` to capture on (None on CPU) and the
    ``device``.

    Args:
        stream: the stream to capture on (``None`` on CPU).
        device: the device.
    """

    def __init__(self, stream: Any, device: torch.device) -> None:
        self.stream, self.device = stream, device

    def __repr__(self) -> str:
        return f"GraphCaptureContext(stream={self.stream!r}, device={self.device})"


@contextlib.contextmanager
def graph_capture(
    mesh: Mesh, *axes: AxisName, device: torch.device | str | None = None, stream: Any = None
) -> Iterator[GraphCaptureContext]:
    """Prepare ``mesh`` for CUDA graph capture and run the block on a side stream.

    On a real mesh it first creates this rank's groups, and with a ctypes backend its NCCL/HCCL
    communicators, for ``axes`` (default: every axis) on ``device``: a communicator cannot be
    created during capture. On a CUDA ``device`` (default: the current CUDA device when there
    is one) the block runs on ``stream`` (default: a new side stream that first waits for the
    current one; capture cannot run on the default stream), and the current stream waits for
    it afterwards. Every fastdist op inside runs on that stream: the torch ops, and the ctypes
    communicators, which use the current stream. Capture itself stays yours
    (``torch.cuda.graph(g, stream=ctx.stream)``). On CPU there is nothing to capture: the
    groups are created and the block runs as is (``ctx.stream`` is None); with the fake NCCL
    library that is how the set-up is tested without a GPU. Every rank of each group must enter.

    Args:
        mesh: the mesh whose groups (and ctypes communicators) to create first.
        *axes: the axes to prepare; default: every axis.
        device: the CUDA device (or ``"cpu"``); default: the current CUDA device when there is one.
        stream: the stream the block runs on; default: a new side stream that first waits for the
            current one.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 2})
    >>> with fd.graph_capture(mesh, device="cpu") as ctx:
    ...     out = fd.simulate(lambda x: fd.psum(x, mesh, "tp"), mesh)(torch.ones(2))
    >>> ctx.stream is None, out.tolist()
    (True, [2.0, 2.0])
    """
    if device is not None:
        dev = torch.device(device)
    else:
        dev = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    for axis in axes:
        mesh.axis_indices(axis, "graph_capture")  # a wrong axis name raises MeshError, on any mesh
    if mesh._comm is not None:
        mesh.create_groups(*axes, device_type=dev.type)
    if dev.type != "cuda":
        yield GraphCaptureContext(None, dev)
        return
    side = stream if stream is not None else torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        yield GraphCaptureContext(side, dev)
    torch.cuda.current_stream(dev).wait_stream(side)


def barrier(
    mesh: Mesh, axis: AxisName | None = None, *, timeout: float | datetime.timedelta | None = None
) -> None:
    """Wait until every rank of the group arrives; raise :class:`CollectiveTimeout` naming the
    missing ranks.

    ``timeout`` overrides the mesh's timeout for this call.

    Args:
        mesh: a mesh from ``Mesh.from_torch`` (real ranks).
        axis: the mesh axis of the group (or a tuple of axes); ``None``: the whole mesh.
        timeout: seconds (or a timedelta) to wait for this call; default: the mesh's timeout.
    """
    ac = _axis_comm("barrier", mesh, axis)
    td = _as_timedelta(timeout, ac.comm.timeout, "fastdist.barrier")
    group = ac.cpu_group("barrier")
    try:
        if not torch.compiler.is_compiling():
            dist.monitored_barrier(group=group, timeout=td, wait_all_ranks=True)
    except Exception as e:
        msg = _clean(e)
        ac.comm.abandon(f"fastdist.barrier(axis={ac.label!r}) failed on this rank: {msg}")
        raise CollectiveTimeout(
            "barrier",
            ac.label,
            ac.ranks,
            ac.rank,
            f"not every rank arrived within {td.total_seconds():g} s: {msg}",
            "check that every rank of the group reaches this barrier; to go on, call mesh.reset() "
            "on every rank",
        ) from e


# what torch.distributed's own errors look like (c10d, gloo, NCCL), raised from inside a compiled
# graph where fastdist's eager wrapping (AxisComm.run) is not on the stack
_C10D_ERROR = re.compile(
    r"third_party/gloo|ProcessGroup|c10d|NCCL|Timed out waiting|Connection closed by peer|"
    r"Connection reset by peer|Socket Timeout|process group|DistBackendError"
)


class comm_guard(contextlib.ContextDecorator):  # noqa: N801 - used like a function
    """Turn torch.distributed's own errors inside a block (or a wrapped function) into fastdist's,
    for the meshes given: use it around a compiled step.

    Eagerly every collective on a real mesh raises :class:`~fastdist.CollectiveTimeout` or
    :class:`~fastdist.CommError` and drops the mesh's groups, so that the recovery pattern
    ``except fastdist.FastdistError: mesh.reset()`` works. Inside a ``torch.compile``'d step the
    collectives run in the graph, where a timeout or a lost peer surfaces as torch's own
    ``RuntimeError`` (gloo: "Timed out waiting 3000ms for recv operation ..."). Under
    ``comm_guard`` such an error (a ``torch.distributed.DistError``, or a ``RuntimeError`` whose
    message comes from c10d, gloo or NCCL) becomes a :class:`~fastdist.CollectiveTimeout` (a
    timeout) or :class:`~fastdist.CommError` naming the block, the mesh's axes and this rank, with
    torch's error as its ``__cause__``; the groups of every mesh given are dropped, as eagerly,
    so that peers still waiting in them fail at once. A fastdist error raised while dynamo
    traces the step (say creating a process group times out), which torch.compile wraps in its
    own exception, is raised as itself. Other exceptions (fastdist's own, a shape error in the
    model) pass through unchanged. Plain (simulated) meshes may be given: they have
    no groups.

    As a decorator (``step = fastdist.comm_guard(mesh)(torch.compile(step))``) or a block::

        try:
            with fastdist.comm_guard(mesh):
                loss = compiled_step(batch)
        except fastdist.FastdistError:
            mesh.reset()          # every rank; the step is traced again on its next call

    Args:
        mesh: a mesh whose torch.distributed errors to translate (and whose groups to drop).
        *meshes: more meshes, likewise.

    >>> import fastdist as fd
    >>> with fd.comm_guard(fd.Mesh({"tp": 2})):
    ...     pass
    """

    def __init__(self, mesh: Mesh, *meshes: Mesh) -> None:
        for m in (mesh, *meshes):
            # a Mesh (checked by its fields: this module does not import fastdist.core.mesh)
            if not all(hasattr(m, f) for f in ("_comm", "axis_names", "size")):
                raise MeshError(
                    f"fastdist.comm_guard: expected fastdist.Mesh values, got "
                    f"{type(m).__name__}. Fix: pass the meshes the guarded step runs on"
                )
        self.meshes = (mesh, *meshes)

    def __enter__(self) -> comm_guard:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        if error is None or not isinstance(error, Exception):
            return
        inner = _wrapped_fastdist_error(error)
        if inner is not None:
            # fastdist's own error, raised while dynamo traced (e.g. creating a group) and wrapped
            # by it: raised as itself, shown with its own cause, not dynamo's wrapper
            inner.__suppress_context__ = True
            raise inner
        if not _is_c10d_error(error):
            return
        raise self.translate(error) from error

    def translate(self, error: BaseException) -> CommError:
        """The fastdist error for ``error`` (torch.distributed's), after dropping the groups of
        the real meshes given.

        Args:
            error: the error torch.distributed raised.

        Returns:
            a ``CollectiveTimeout`` (a timeout) or ``CommError`` naming the block, the mesh's axes
            and this rank.
        """
        real = [m for m in self.meshes if m._comm is not None]
        msg = _clean(error)
        for m in real:
            comm = cast(TorchComm, m._comm)
            comm.abandon(f"fastdist.comm_guard: a call on rank {comm.global_rank} failed: {msg}")
        mesh = real[0] if real else self.meshes[0]
        comm = mesh._comm
        rank = comm.global_rank if comm is not None else -1
        names = mesh.axis_names
        axes = names[0] if len(names) == 1 else names
        ranks = list(comm.ranks) if comm is not None else list(range(mesh.size))
        timed_out = isinstance(error, TimeoutError) or any(
            w in msg.lower() for w in ("timed out", "timeout")
        )
        reset = "call mesh.reset() on every rank of the mesh to go on (the step is traced again)"
        if timed_out:
            secs = comm.timeout.total_seconds() if comm is not None else float("nan")
            return CollectiveTimeout(
                "comm_guard",
                axes,
                ranks,
                rank,
                f"a collective inside the guarded block (a compiled step) timed out: a peer did "
                f"not arrive within the mesh's timeout ({secs:g} s): {msg}",
                "check that every rank makes the same collectives in the same order; "
                + reset
                + "; raise the timeout with Mesh.from_torch(timeout=...) or mesh.with_timeout(...)",
            )
        return CommError(
            "comm_guard",
            axes,
            ranks,
            rank,
            f"a collective inside the guarded block (a compiled step) failed: {msg}",
            "a peer closed the connection: it failed (see its log) or exited; if every rank is "
            "still alive, " + reset,
        )


def _wrapped_fastdist_error(error: BaseException) -> BaseException | None:
    """The fastdist error that torch.compile wrapped in ``error`` (one of dynamo's or inductor's
    exceptions, whose cause chain holds it), else None."""
    from fastdist.errors import FastdistError

    if not type(error).__module__.startswith(("torch._dynamo", "torch._inductor")):
        return None
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        if isinstance(link, FastdistError):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def _is_c10d_error(error: BaseException) -> bool:
    """Whether ``error`` comes from torch.distributed (not from fastdist, not from the model)."""
    from fastdist.errors import FastdistError

    if isinstance(error, FastdistError):
        return False
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and bool(_C10D_ERROR.search(str(error)))
