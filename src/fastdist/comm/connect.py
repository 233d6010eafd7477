"""Connecting a :class:`~fastdist.Mesh` to a running ``torch.distributed`` job, and the lifecycle
of its process groups.

A :class:`~fastdist.Mesh` is a torch-free value: its axes, and arithmetic on them. Over real
ranks it also carries a communicator (this process's process groups); this module builds that
communicator and manages it:

- :func:`connect` (``fastdist.connect``): the mesh of the given degrees over the running job;
- :func:`from_device_mesh` / :func:`to_device_mesh`: to and from a ``DeviceMesh``;
- :func:`with_timeout`: the same ranks with another timeout;
- :func:`create_groups`: create the groups now instead of on first use;
- :func:`reset`: recover after a failed collective;
- :func:`close`: release the ctypes communicators.

Every function but :func:`connect` and :func:`from_device_mesh` is also ``fastdist.comm.<name>``.
Without a job each one refuses with :class:`~fastdist.MeshError`:

>>> import fastdist as fd
>>> fd.comm.reset(fd.Mesh({"tp": 2}))
Traceback (most recent call last):
...
fastdist.errors.MeshError: fastdist.comm.reset: Mesh({'tp': 2}) is not backed by ...
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from fastdist.comm.torch_comm import DEFAULT_TIMEOUT, TorchComm, as_timedelta
from fastdist.comm.transports import select_backend
from fastdist.core.mesh import AxisName, Mesh
from fastdist.errors import MeshError

__all__ = [
    "connect",
    "from_device_mesh",
    "to_device_mesh",
    "with_timeout",
    "create_groups",
    "reset",
    "close",
]


def connect(
    *,
    order: Sequence[str] | None = None,
    timeout: float | datetime.timedelta | None = None,
    check: bool = False,
    backend: str = "torch",
    library: str | None = None,
    **degrees: int,
) -> Mesh:
    """A mesh over the running ``torch.distributed`` job (after ``init_process_group``).

    Axes are laid out as in :meth:`fastdist.Mesh.from_world_size` over the job's world size;
    this process is rank ``dist.get_rank()``. Collectives on the mesh run on real ranks.

    Args:
        order: the axes' order, outer to inner, as in :meth:`fastdist.Mesh.from_world_size`.
        timeout: seconds (or a timedelta) every blocking call may wait for a peer;
            default :data:`fastdist.comm.torch_comm.DEFAULT_TIMEOUT` (10 minutes).
        check: consistency check mode: before each collective the ranks of the
            group compare op, shapes, dtypes and parameters, and all raise
            :class:`~fastdist.ConsistencyError` on a mismatch (eager mode only; it
            costs one small gloo all-gather per collective).
        backend: ``"torch"`` (torch.distributed process groups: gloo, NCCL, HCCL),
            ``"nccl-ctypes"`` or ``"hccl-ctypes"`` (device tensors through NCCL/HCCL
            called directly with ctypes, usable inside CUDA graph capture; CPU tensors
            still use gloo). Results do not depend on the choice.
        library: the NCCL/HCCL shared object for a ctypes backend (default: discovered,
            see :func:`fastdist.comm.native.find_library`).
        **degrees: the size of each axis you know (``tp=2``); ``dp`` is inferred unless given.

    Returns:
        the mesh, whose communicator (:attr:`fastdist.Mesh.comm`) holds this process's groups.

    >>> import fastdist as fd
    >>> fd.connect(tp=2)
    Traceback (most recent call last):
    ...
    fastdist.errors.MeshError: fastdist.connect: torch.distributed is not initialised. ...
    """
    as_timedelta(timeout, DEFAULT_TIMEOUT, "fastdist.connect")  # checked before the job
    if not isinstance(check, bool):
        raise MeshError(
            f"fastdist.connect: check must be True or False, got {check!r}. Fix: "
            "check=True for consistency check mode, else leave it out"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise MeshError(
            "fastdist.connect: torch.distributed is not initialised. Fix: call "
            "torch.distributed.init_process_group first (torchrun sets its environment)"
        )
    world = dist.get_world_size()
    try:
        plain = Mesh.from_world_size(world, order=order, **degrees)
    except MeshError as e:
        raise _world_error(str(e), world, degrees) from None
    return _over_job(
        plain, timeout, "fastdist.connect", check=check, backend=backend, library=library
    )


def _world_error(message: str, world: int, degrees: dict[str, int]) -> MeshError:
    """``Mesh.from_world_size``'s refusal ``message`` as :func:`connect`'s: about the job's size
    when the degrees do not fit the world."""
    text = message.removeprefix("Mesh.from_world_size: ")
    if "world size" not in text:  # a bad degree or order: not about the job's size
        return MeshError(f"fastdist.connect: {text}")
    problem = text.split(". Fix: ", 1)[0].replace(
        f"world size {world}", f"the job's world size {world} (torch.distributed)"
    )
    asked = math.prod(degrees.values())  # valid ints here; with dp: the whole job
    if "dp" in degrees:
        fix = (
            f"launch {asked} processes (torchrun --nproc-per-node {asked}; on several "
            f"nodes, nodes x processes per node = {asked}), or leave dp out to infer it "
            f"from the job's {world} ranks"
        )
    else:
        fix = (
            f"launch a multiple of {asked} processes (torchrun --nproc-per-node {asked}; "
            f"on several nodes, nodes x processes per node a multiple of {asked}), or "
            f"choose degrees whose product divides {world}"
        )
    return MeshError(f"fastdist.connect: {problem}. Fix: {fix}")


def from_device_mesh(
    device_mesh: Any,
    *,
    timeout: float | datetime.timedelta | None = None,
    check: bool = False,
    backend: str = "torch",
    library: str | None = None,
) -> Mesh:
    """A mesh with the axes of a ``torch.distributed.device_mesh.DeviceMesh``, reusing its
    groups.

    The DeviceMesh must have dimension names and the row-major rank layout
    (``init_device_mesh`` gives both). ``backend`` and ``library`` as in :func:`connect`.

    Args:
        device_mesh: a ``DeviceMesh`` with dimension names and the row-major rank layout.
        timeout: seconds (or a timedelta) every blocking call may wait for a peer, as in
            :func:`connect`.
        check: consistency check mode (the ranks compare each collective's op, shapes,
            dtypes and parameters first), as in :func:`connect`.
        backend: ``"torch"`` (the DeviceMesh's process groups), ``"nccl-ctypes"`` or
            ``"hccl-ctypes"``, as in :func:`connect`.
        library: the NCCL/HCCL shared object for a ctypes backend, as in :func:`connect`.

    Returns:
        the mesh, whose communicator reuses the DeviceMesh's per-dimension groups.
    """
    names = device_mesh.mesh_dim_names
    if not names:
        raise MeshError(
            "fastdist.comm.from_device_mesh: the DeviceMesh has no mesh_dim_names. Fix: "
            "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
        )
    layout = device_mesh.mesh.flatten().tolist()
    if layout != list(range(len(layout))):
        raise MeshError(
            f"fastdist.comm.from_device_mesh: the DeviceMesh's ranks {layout} are not row-major "
            f"0..{len(layout) - 1}. Fix: build it with init_device_mesh"
        )
    plain = Mesh(list(zip(names, (int(s) for s in device_mesh.mesh.shape))))
    return _over_job(
        plain,
        timeout,
        "fastdist.comm.from_device_mesh",
        check=check,
        device_mesh=device_mesh,
        backend=backend,
        library=library,
    )


def to_device_mesh(mesh: Mesh, device_type: str = "cpu") -> Any:
    """A ``DeviceMesh`` with ``mesh``'s axes (collective call: every rank must call it).

    Args:
        mesh: a mesh over the whole job (not a slice from :meth:`fastdist.Mesh.without`).
        device_type: the device type of the ``DeviceMesh`` (``"cpu"``, ``"cuda"``).

    Returns:
        the ``DeviceMesh`` (``init_device_mesh`` with the mesh's axis sizes and names).
    """
    from torch.distributed.device_mesh import init_device_mesh

    comm = cast("TorchComm | None", mesh.comm)
    if comm is not None and comm.where:
        raise MeshError(
            f"fastdist.comm.to_device_mesh: {mesh!r} is the slice {comm.where} of a larger mesh, "
            "and a DeviceMesh spans the whole job. Fix: call to_device_mesh on the whole mesh "
            "and index the DeviceMesh (device_mesh['tp'])"
        )
    return init_device_mesh(device_type, tuple(mesh.shape.values()), mesh_dim_names=mesh.axis_names)


def with_timeout(mesh: Mesh, timeout: float | datetime.timedelta) -> Mesh:
    """The same axes on the same job with another timeout (its groups are created anew,
    lazily).

    Args:
        mesh: a mesh over real ranks (from :func:`connect`, or a slice of one).
        timeout: seconds (or a timedelta) every blocking call may wait for a peer.

    Returns:
        a mesh over the same ranks (a slice stays that slice), check mode and backend.
    """
    comm = _comm_of(mesh, "fastdist.comm.with_timeout")
    td = as_timedelta(timeout, None, "fastdist.comm.with_timeout")  # required: None is refused
    plain = Mesh(mesh.shape.items())
    return Mesh(plain.shape.items(), comm=comm.renewed(plain, td))


def create_groups(mesh: Mesh, *axes: AxisName, device_type: str = "cpu") -> None:
    """Create now (instead of on first use) this rank's process groups for ``axes`` (default:
    each axis).

    Never required for correctness: groups are created on first use, in any order across
    ranks, and under ``torch.compile`` while dynamo traces. Useful to pay the set-up cost
    up front, and needed with a ctypes backend before CUDA graph capture: with its device
    type (``"cuda"``; ``"cpu"`` for the fake library) it also creates the NCCL/HCCL
    communicators, which must exist before capture. Every rank of each group must call it.

    Args:
        mesh: a mesh over real ranks (from :func:`connect`).
        *axes: the axes (names or tuples of names) whose groups to create; default: each axis.
        device_type: with a ctypes backend, the device type of its communicators (``"cuda"``;
            ``"cpu"`` for the fake library).
    """
    comm = _comm_of(mesh, "fastdist.comm.create_groups")
    lib = comm.native_lib
    native = lib is not None and device_type == lib.device_type
    backend = "gloo" if native else select_backend(device_type)
    for axis in axes or mesh.axis_names:
        ac = comm.axis(mesh.axis_indices(axis, "fastdist.comm.create_groups"))
        if ac.n > 1:
            comm.group(ac, backend, "create_groups")
            if native:
                device = (
                    torch.device("cuda", torch.cuda.current_device())
                    if device_type == "cuda"
                    else torch.device(device_type)
                )
                comm.native(ac, "create_groups", torch.empty(0, device=device))


def reset(mesh: Mesh, timeout: float | datetime.timedelta | None = None) -> None:
    """Recover after a failed collective: drop ``mesh``'s process groups and start fresh ones.

    After a :class:`~fastdist.CollectiveTimeout` or :class:`~fastdist.CommError` (or an
    error that one rank raised while its peers waited in a collective) the mesh's groups
    may hold half-finished messages, so every later call on them would fail. **Every rank
    of the mesh** calls ``fastdist.comm.reset(mesh)``; it destroys the groups (a peer still
    waiting in one fails at once), moves the mesh to a new epoch agreed through the job's store,
    and returns once every rank has reset. The next collectives create new groups. Then redo
    the step on every rank. Compiled steps are traced again on their next call; run them
    under :class:`fastdist.comm.comm_guard` so that a failure inside the compiled graph raises
    fastdist's errors too (torch's own ``RuntimeError`` otherwise).

    Waits up to ``timeout`` (default: twice the mesh's timeout plus 5 s, since a peer may
    need a whole timeout to notice the failure) and raises
    :class:`~fastdist.CollectiveTimeout` naming the ranks that did not reset. A rank that
    exited cannot rejoin: restart the job then. Other meshes are not affected: on a slice
    (:meth:`fastdist.Mesh.without`) only the slice's ranks reset, and its parent keeps its
    groups.

    ```text
    try:
        loss = step(batch)              # compiled: step = fastdist.comm.comm_guard(mesh)(compiled)
    except fastdist.FastdistError:      # CommError, CollectiveTimeout, or this rank's own error
        fastdist.comm.reset(mesh)       # on every rank
        loss = step(batch)
    ```

    Args:
        mesh: a mesh over real ranks (from :func:`connect`, or a slice of one).
        timeout: how long to wait for every rank to reset; default: twice the mesh's timeout
            plus 5 s.
    """
    comm = _comm_of(mesh, "fastdist.comm.reset")
    default = 2 * comm.timeout + datetime.timedelta(seconds=5)
    comm.reset(as_timedelta(timeout, default, "fastdist.comm.reset"))


def close(mesh: Mesh, timeout: float = 5.0) -> bool:
    """Release ``mesh``'s communicators: abort its ctypes ones (with a bounded wait) and destroy
    the process groups it created; True if every abort finished.

    Call it on every rank before ``torch.distributed.destroy_process_group()``: groups still
    referenced at interpreter exit are torn down after the program finished, where a gloo
    group can abort the process. Later calls on the mesh raise
    :class:`~fastdist.CommError` (``fastdist.comm.reset`` makes it usable again). A no-op for
    plain meshes. A slice (:meth:`fastdist.Mesh.without`) has its own communicators: close it
    too.

    Args:
        mesh: any mesh.
        timeout: seconds to wait for each communicator's abort.

    Returns:
        whether every communicator finished its abort within ``timeout``.

    >>> import fastdist as fd
    >>> fd.comm.close(fd.Mesh({"tp": 2}))
    True
    """
    comm = cast("TorchComm | None", mesh.comm)
    return True if comm is None else comm.close(timeout)


def _over_job(
    plain: Mesh, timeout: float | datetime.timedelta | None, who: str, **comm_args: Any
) -> Mesh:
    """``plain``'s axes over the running torch.distributed job, with a new communicator; ``who``
    (e.g. ``"fastdist.connect"``) names the call in errors."""
    comm = TorchComm(plain, timeout=as_timedelta(timeout, DEFAULT_TIMEOUT, who), **comm_args)
    return Mesh(plain.shape.items(), comm=comm)


def _comm_of(mesh: Mesh, who: str) -> TorchComm:
    """``mesh``'s communicator; :class:`~fastdist.MeshError` naming ``who`` on a plain mesh."""
    if mesh.comm is None:
        raise MeshError(
            f"{who}: {mesh!r} is not backed by torch.distributed. Fix: build it with "
            "fastdist.connect"
        )
    return cast(TorchComm, mesh.comm)
