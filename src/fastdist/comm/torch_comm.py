"""Connecting a mesh to a job: the process groups of one mesh on this process (:class:`TorchComm`).

Process groups belong to the mesh (its :class:`TorchComm`), one per axis (or tuple of
axes) and backend, created on first use and only by the ranks in them, with members in
axis order so that a group rank is the index along the axis. Each group's name is derived
from the mesh (its shape and which mesh of that shape it is), the ordered member ranks, the
backend and the mesh's epoch (see :meth:`TorchComm.reset`), never from how many groups the
process made before: ranks may touch the mesh's axes in any order. Under ``torch.compile`` a
missing group is created while dynamo traces, outside the graph. Every group carries the
mesh's timeout; a peer that does not arrive raises :class:`~fastdist.CollectiveTimeout`
naming the op, axis, group, rank and which peers did not reach the call.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d as c10d

from fastdist.comm.axes import TorchAxisComm
from fastdist.comm.failures import (
    clean_error,
    in_slice,
    member_label,
    raise_while_tracing,
    wait_for_keys,
)
from fastdist.comm.native import BACKENDS, NativeCommunicator, exchange_over_group, load_library
from fastdist.comm.transports import select_backend
from fastdist.core.primitive import GroupSpec
from fastdist.errors import CollectiveTimeout, CommError, MeshError, NoBackendError

if TYPE_CHECKING:
    from fastdist.comm.native import NativeLibrary
    from fastdist.core.mesh import AxisName, Mesh

__all__ = ["TorchComm", "DEFAULT_TIMEOUT", "as_timedelta", "native_library"]


#: Default timeout of every blocking call on a mesh built from torch.distributed.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def as_timedelta(
    timeout: float | datetime.timedelta | None,
    default: datetime.timedelta | None,
    who: str = "fastdist",
) -> datetime.timedelta:
    """``timeout`` (seconds or a timedelta, > 0) as a timedelta; ``default`` for None (no
    ``default``: None is refused too).

    Args:
        timeout: seconds or a timedelta, or None.
        default: what None means; None: None is refused too.
        who: the call to name in the error, e.g. ``"fastdist.connect"``.

    Returns:
        the timeout as a timedelta.
    """
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


#: ``TorchComm.broken`` of a mesh that ``fastdist.comm.close`` released (not a failure)
CLOSED = "closed"


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
    :func:`fastdist.connect`, this process's slice for :meth:`fastdist.Mesh.without`
    (:meth:`slice`). ``rank`` is this process's mesh rank (coordinates, shards); everything that
    names processes (group members and names, store keys, error messages, :class:`TorchAxisComm`'s
    ``ranks`` and ``rank``) uses global ranks. A slice's ``<shape>`` is its parent's uid and the
    slice's coordinates (``pp2_tp2.0-pp1``), so two slices of one shape never share a name.

    Args:
        mesh: the mesh (its size must equal the world size, or ``len(ranks)``).
        timeout: the timeout of every group this comm creates.
        check: consistency check mode (see :meth:`TorchAxisComm.check`).
        device_mesh: a ``DeviceMesh`` whose per-dimension groups to reuse.
        backend: ``"torch"`` or a ctypes backend (see :func:`fastdist.connect`).
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
        self._axes: dict[tuple[int, ...], TorchAxisComm] = {}
        self._specs: dict[Any, GroupSpec] = {}  # axis -> the collectives' group spec (see spec)
        self._slices: dict[tuple[int, ...], TorchComm] = {}  # removed axes -> slice (see slice)
        self.backend: str = backend
        self.native_lib: NativeLibrary | None = native_library(backend, library)
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
        return f"fastdist.{self.tag}.{member_label(ranks)}.{backend}"

    def axis(self, idx: tuple[int, ...]) -> TorchAxisComm:
        """The communicator of this rank's group along the axes at positions ``idx`` (cached)."""
        ac = self._axes.get(idx)
        if ac is None:
            ac = self._new_axis(idx)
            # a trace must not mutate the cache (dynamo would replay it, and guard on it)
            if not torch.compiler.is_compiling():
                self._axes[idx] = ac
        return ac

    def spec(self, axis: AxisName, op: str) -> GroupSpec:
        """The collectives' group spec for ``axis`` (validated once, naming ``fastdist.<op>``;
        cached outside dynamo tracing, so a call finds it with one lookup).

        Args:
            axis: the mesh axis, or a tuple of axes.
            op: the calling op's name (``"psum"``), for the error an invalid axis raises.
        """
        try:
            cached: GroupSpec = self._specs[axis]
            return cached
        except (KeyError, TypeError):
            # TypeError: an unhashable axis (e.g. a list), validated below
            pass
        idx = self.mesh.axis_indices(axis, f"fastdist.{op}")
        spec = GroupSpec(self.mesh.sizes, idx, comm=self.axis(idx))
        # a trace must not mutate the cache
        if isinstance(axis, (str, tuple)) and not torch.compiler.is_compiling():
            self._specs[axis] = spec
        return spec

    def _new_axis(self, idx: tuple[int, ...]) -> TorchAxisComm:
        names = tuple(self.mesh.axis_names[i] for i in idx)
        label: Any = names[0] if len(names) == 1 else names
        # the group's global ranks, in axis order
        return TorchAxisComm(
            self, idx, label, tuple(self.ranks[r] for r in self.mesh.group(self.rank, names))
        )

    def group(self, ac: TorchAxisComm, backend: str, op: str) -> Any:
        """The process group for ``ac`` on ``backend``, created on first use by the ranks in it
        (eagerly)."""
        pg = self._groups.get((ac.ranks, backend))
        if pg is not None:
            return pg
        self.check_usable(op, ac)
        # only eager helpers get here (collectives use group names while tracing)
        problem = f"the {backend} process group is needed outside a collective"
        self._eager_only(op, ac, problem, "run this call eagerly")
        return self._create_group(ac, backend, op)

    def _eager_only(self, op: str, ac: TorchAxisComm, problem: str, fix: str) -> None:
        """Raise :class:`~fastdist.CommError` (from inside dynamo's tracing) when ``op`` on
        ``ac`` is traced: it runs eagerly only."""
        if torch.compiler.is_compiling():
            raise_while_tracing(op, ac.label, ac.ranks, self.global_rank, problem, fix)

    def _create_group(self, ac: TorchAxisComm, backend: str, op: str) -> Any:
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
        # a new TorchAxisComm here is not stored: dynamo may be tracing self._axes
        ac = self._axes.get(idx) or self._new_axis(idx)
        self.check_usable(op, ac)
        return str(self._create_group(ac, backend, op).group_name)

    # ------------------------------------------------------------------ ctypes communicators
    def native(self, ac: TorchAxisComm, op: str, x: Tensor) -> NativeCommunicator | None:
        """The ctypes communicator for ``ac`` when this mesh's backend serves ``x``'s device, else
        None.

        Created on first use by the group's members (id exchange over the gloo group).
        """
        lib = self.native_lib
        if lib is None or x.device.type != lib.device_type:
            return None
        problem = f"the {self.backend} backend runs eagerly (and in CUDA graphs), not under "
        self._eager_only(op, ac, problem + "torch.compile", "compile with backend='torch'")
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
                "call fastdist.comm.create_groups(mesh, device_type='cuda') once before capturing",
            )
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
        """Release this mesh's communicators: abort its ctypes ones (waiting at most ``timeout``
        seconds for each) and destroy the process groups it created. Later calls on the mesh
        raise :class:`~fastdist.CommError` (until :meth:`reset`). Whether every abort finished.

        Destroyed here, while the process runs, the groups do not outlive
        ``torch.distributed.destroy_process_group()`` to be torn down at interpreter exit, where
        a gloo group's threads can abort the process (``terminate called without an active
        exception``) after the program has finished.
        """
        if self.broken is None:
            self.broken = CLOSED
        done = all([nc.close(timeout) for nc in self._native.values()])
        self._native.clear()
        for ac in self._axes.values():
            ac.drop_transports()
        self._groups.clear()
        created, self._created = self._created, []
        # destroyed and unreferenced, a gloo group closes its connections (shutdown alone does not)
        while created:
            _drop_group(created.pop())
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

    def enter(self, op: str, ac: TorchAxisComm) -> bool:
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
                "step), or give each thread its own mesh (fastdist.connect once per thread, built "
                "in the same order on every rank)",
            )
        self.in_call = me
        return True

    def check_usable(self, op: str, ac: TorchAxisComm) -> None:
        """Raise if an earlier failure dropped this mesh's groups (see :meth:`abandon`)."""
        if self.broken is not None:
            raise CommError(
                op,
                ac.label,
                ac.ranks,
                self.global_rank,
                f"this mesh's process groups were dropped after an earlier failure ({self.broken})"
                if self.broken != CLOSED
                else "this mesh was closed (fastdist.comm.close released its process groups)",
                "call fastdist.comm.reset(mesh) on every rank of the mesh, then redo the step",
            )

    def reset(self, timeout: datetime.timedelta) -> None:
        """Drop this mesh's groups and agree with every rank of the mesh on fresh ones (see
        :func:`fastdist.comm.reset`).

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
            missing = wait_for_keys(self.store, arrived, everyone, timeout.total_seconds())
        except Exception as e:  # the store itself is gone
            raise CommError(
                "fastdist.comm.reset",
                self.mesh.axis_names,
                everyone,
                self.global_rank,
                f"the job's store is unreachable ({clean_error(e)})",
                "the process hosting the store (rank 0, or torchrun's agent) probably exited: "
                "restart the job",
            ) from e
        if missing:
            raise CollectiveTimeout(
                "fastdist.comm.reset",
                self.mesh.axis_names,
                everyone,
                self.global_rank,
                f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not "
                f"call reset within {timeout.total_seconds():g} s{in_slice(self)}",
                "every rank of the mesh must call fastdist.comm.reset(mesh) after a failure; a "
                "rank that exited cannot rejoin: restart the job",
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

    The group meets its peers through its own clone of the job's store (its own connection): a
    store client serves one request at a time and holds its connection while it waits for a
    key, so two threads creating groups of two meshes at once through the shared client would
    block each other, and ranks whose threads got there in opposite orders deadlock until the
    timeout.
    """
    default = c10d._get_default_group()
    store: Any = c10d._get_default_store()  # torch's stubs lack Store.clone
    try:
        store = store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):  # a custom store without clone
        pass
    pg, _ = c10d._new_process_group_helper(
        len(ranks),
        ranks.index(dist.get_rank()),
        ranks,
        c10d.Backend(backend),
        store,
        c10d.GroupName(name),
        timeout=timeout,
        device_id=default.bound_device_id,
        group_desc=desc,
    )
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg


def native_library(backend: str, library: Any) -> NativeLibrary | None:
    """The bound library for a ctypes backend (loaded when the mesh is built, so errors come
    early); None for ``backend="torch"``.

    Args:
        backend: ``"torch"``, ``"nccl-ctypes"`` or ``"hccl-ctypes"``.
        library: a path to the library, an already bound one, or None (found by name).

    Returns:
        the bound library, or None for ``"torch"``.
    """
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
        return cast("NativeLibrary", library)  # already bound (comm.with_timeout passes it on)
    return load_library(backend.split("-")[0], None if library is None else str(library))
