"""``Mesh``: named axes over a world of ranks, and every rank group derived from them.

Rank order is row-major, like numpy, JAX and Megatron's "TP innermost" layout: the
**last axis varies fastest**. For ``Mesh({"dp": 2, "tp": 4})`` rank ``r`` has
coordinates ``dp = r // 4`` and ``tp = r % 4``, so the tp groups are consecutive
ranks ``[0, 1, 2, 3], [4, 5, 6, 7]`` and the dp groups are strided ``[0, 4], [1, 5], ...``.

In general ``rank = sum(coord[a] * stride[a])`` with ``stride[a]`` the product of
the sizes of the axes after ``a``. A tuple of axes ``("dp", "tp")`` is one
flattened axis whose index is row-major in *the tuple's order* (the first named
axis is the most significant), as in JAX.

Everything here is arithmetic on the axis sizes: no process groups are created
and nothing is global. Two meshes of different shapes live side by side.

>>> mesh = Mesh({"dp": 2, "tp": 4})
>>> mesh.size, mesh.axis_names
(8, ('dp', 'tp'))
>>> mesh.groups("tp")
[[0, 1, 2, 3], [4, 5, 6, 7]]
>>> mesh.groups("dp")
[[0, 4], [1, 5], [2, 6], [3, 7]]
>>> mesh.coords(6)
{'dp': 1, 'tp': 2}
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from fastdist.errors import MeshError

__all__ = ["Mesh", "AxisName", "DEFAULT_ORDER"]

#: An axis name, or a tuple of axis names treated as one flattened axis.
AxisName = str | Sequence[str]

#: Outer-to-inner order used by :meth:`Mesh.from_world_size`: tensor parallelism
#: innermost (consecutive ranks, usually one node), pipeline outermost.
DEFAULT_ORDER: tuple[str, ...] = ("pp", "dp", "ep", "cp", "sp", "tp")


class Mesh:
    """An ordered set of named axes, e.g. ``Mesh({"dp": 2, "sp": 2, "tp": 2})``.

    Args:
        axes: ordered mapping (or sequence of pairs) from axis name to size. Names
            must be distinct identifiers; sizes positive ints. The last axis
            varies fastest across ranks.

    A ``Mesh`` is an immutable value: meshes with equal axes compare and hash equal and
    are interchangeable (a collective on ``Mesh({"tp": 2})`` runs inside a simulation of
    another ``Mesh({"tp": 2})``). A mesh over real ranks (:meth:`from_torch`) also carries
    its communicator (its process groups), so it equals only itself and meshes sharing that
    communicator. What is running over a mesh (a simulation, a replication check) is kept
    per thread by ``simulate``/``spmd``, not on the mesh. Collectives take the mesh as an
    argument; run them on all ranks at once with :func:`fastdist.simulate`.

    >>> a, b = Mesh({"dp": 2, "tp": 2}), Mesh({"dp": 2, "tp": 2})
    >>> a == b, hash(a) == hash(b)
    (True, True)
    >>> a.x = 1
    Traceback (most recent call last):
    ...
    AttributeError: Mesh is immutable: cannot set 'x'. Fix: build a new Mesh
    """

    __slots__ = ("_names", "_sizes", "_strides", "_comm")
    _names: tuple[str, ...]
    _sizes: tuple[int, ...]
    _strides: tuple[int, ...]
    _comm: Any

    def __init__(
        self, axes: Mapping[str, int] | Iterable[tuple[str, int]], *, _comm: Any = None
    ) -> None:
        items = list(axes.items()) if isinstance(axes, Mapping) else list(axes)
        names: list[str] = []
        sizes: list[int] = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise MeshError(
                    f"Mesh: expected (name, size) pairs, got {item!r}. Fix: pass a mapping like "
                    f"{{'dp': 2, 'tp': 4}}"
                )
            name, size = item
            if not isinstance(name, str) or not name.isidentifier():
                raise MeshError(
                    f"Mesh: axis name {name!r} is not an identifier string. Fix: use names like "
                    "'dp', 'tp'"
                )
            if name in names:
                raise MeshError(
                    f"Mesh: axis {name!r} appears twice. Fix: give every axis a distinct name"
                )
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise MeshError(
                    f"Mesh: axis {name!r} has size {size!r}. Fix: sizes are positive ints"
                )
            names.append(name)
            sizes.append(size)
        setattr_ = object.__setattr__  # a Mesh is immutable: fields are set here, once
        setattr_(self, "_names", tuple(names))
        setattr_(self, "_sizes", tuple(sizes))
        # stride of axis i = product of the sizes after it (row-major, last axis fastest)
        setattr_(self, "_strides", tuple(math.prod(sizes[i + 1 :]) for i in range(len(sizes))))
        # The real-rank communicator (fastdist.comm.distributed.TorchComm) of a mesh built by
        # Mesh.from_torch / from_device_mesh: part of the mesh's value; None for a plain mesh.
        setattr_(self, "_comm", _comm)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Mesh is immutable: cannot set {name!r}. Fix: build a new Mesh")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Mesh is immutable: cannot delete {name!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        if self._comm is not None:
            raise MeshError(
                f"Mesh: {self!r} holds this process's process groups and cannot be pickled. "
                "Fix: send the axes (dict(mesh.shape)) and build the mesh with Mesh.from_torch in "
                "the other process"
            )
        return (Mesh, (list(zip(self._names, self._sizes)),))

    def __copy__(self) -> Mesh:
        return self  # a value: copies are the same mesh

    def __deepcopy__(self, memo: Any) -> Mesh:
        return self

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_world_size(
        cls, world_size: int, *, order: Sequence[str] = DEFAULT_ORDER, **degrees: int
    ) -> Mesh:
        """Build a mesh from a world size and the parallel degrees you know.

        ``dp`` is inferred as ``world_size // prod(other degrees)`` unless given.
        Axes are laid out in ``order`` (outer to inner; default
        ``("pp", "dp", "ep", "cp", "sp", "tp")``, so tp is innermost as in
        Megatron and vLLM). ``dp`` is always present; other axes only when given.

        Args:
            world_size: the number of ranks.
            order: the axes' order, outer to inner (the last varies fastest across ranks).
            **degrees: the size of each axis you know (``tp=2, sp=2``); ``dp`` is inferred unless
                given.

        Returns:
            a plain mesh (simulated ranks) with ``dp`` and the given axes, in ``order``.

        >>> Mesh.from_world_size(8, tp=2, sp=2)
        Mesh({'dp': 2, 'sp': 2, 'tp': 2})
        >>> Mesh.from_world_size(6, tp=4)
        Traceback (most recent call last):
        ...
        fastdist.errors.MeshError: Mesh.from_world_size: world size 6 is not divisible by tp=4 ...
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise MeshError(
                f"Mesh.from_world_size: world_size must be a positive int, got {world_size!r}. "
                "Fix: pass the number of processes (torch.distributed.get_world_size())"
            )
        order = tuple(order)
        unknown = [n for n in degrees if n not in order]
        if unknown:
            raise MeshError(
                f"Mesh.from_world_size: axis {unknown[0]!r} is not in the layout order {order}. "
                f"Fix: pass order=(..., {unknown[0]!r}, ...) listing every axis outer to inner"
            )
        if "dp" not in order:
            raise MeshError(
                f"Mesh.from_world_size: order {order} has no 'dp' axis to infer. Fix: include "
                "'dp' in order"
            )
        for name, deg in degrees.items():
            if isinstance(deg, bool) or not isinstance(deg, int) or deg < 1:
                raise MeshError(f"Mesh.from_world_size: {name}={deg!r} is not a positive int")
        given = {n: d for n, d in degrees.items() if n != "dp"}
        prod = math.prod(given.values())
        desc = ", ".join(f"{n}={d}" for n, d in given.items()) or "no degrees"
        if world_size % prod:
            raise MeshError(
                f"Mesh.from_world_size: world size {world_size} is not divisible by {desc} "
                f"(product {prod}). Fix: choose degrees whose product divides {world_size}"
            )
        dp = world_size // prod
        if "dp" in degrees and degrees["dp"] != dp:
            raise MeshError(
                f"Mesh.from_world_size: dp={degrees['dp']} with {desc} gives "
                f"{degrees['dp'] * prod} ranks, "
                f"not world size {world_size}. Fix: leave dp out to infer it (dp={dp})"
            )
        sizes = {**given, "dp": dp}
        return cls([(n, sizes[n]) for n in order if n in sizes])

    @classmethod
    def from_torch(
        cls,
        *,
        order: Sequence[str] = DEFAULT_ORDER,
        timeout: float | datetime.timedelta | None = None,
        check: bool = False,
        backend: str = "torch",
        library: str | None = None,
        **degrees: int,
    ) -> Mesh:
        """A mesh over the running ``torch.distributed`` job (after ``init_process_group``).

        Axes are laid out as in :meth:`from_world_size` over the job's world size; this
        process is rank ``dist.get_rank()``. Collectives on the mesh run on real ranks.

        Args:
            timeout: seconds (or a timedelta) every blocking call may wait for a peer;
                default :data:`fastdist.comm.distributed.DEFAULT_TIMEOUT` (10 minutes).
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
        """
        import torch.distributed as dist

        from fastdist.comm import distributed as D

        D._as_timedelta(timeout, D.DEFAULT_TIMEOUT, "Mesh.from_torch")  # checked before the job
        if not isinstance(check, bool):
            raise MeshError(
                f"Mesh.from_torch: check must be True or False, got {check!r}. Fix: "
                "check=True for consistency check mode, else leave it out"
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise MeshError(
                "Mesh.from_torch: torch.distributed is not initialised. Fix: call "
                "torch.distributed.init_process_group first (torchrun sets its environment)"
            )
        world = dist.get_world_size()
        try:
            plain = cls.from_world_size(world, order=order, **degrees)
        except MeshError as e:
            text = str(e).removeprefix("Mesh.from_world_size: ")
            if "world size" not in text:  # a bad degree or order: not about the job's size
                raise MeshError(f"Mesh.from_torch: {text}") from None
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
            raise MeshError(f"Mesh.from_torch: {problem}. Fix: {fix}") from None
        return plain._over_job(
            timeout, "Mesh.from_torch", check=check, backend=backend, library=library
        )

    @classmethod
    def from_device_mesh(
        cls,
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
        (``init_device_mesh`` gives both). ``backend`` and ``library`` as in :meth:`from_torch`.

        Args:
            device_mesh: a ``DeviceMesh`` with dimension names and the row-major rank layout.
            timeout: seconds (or a timedelta) every blocking call may wait for a peer, as in
                :meth:`from_torch`.
            check: consistency check mode (the ranks compare each collective's op, shapes,
                dtypes and parameters first), as in :meth:`from_torch`.
            backend: ``"torch"`` (the DeviceMesh's process groups), ``"nccl-ctypes"`` or
                ``"hccl-ctypes"``, as in :meth:`from_torch`.
            library: the NCCL/HCCL shared object for a ctypes backend, as in :meth:`from_torch`.
        """

        names = device_mesh.mesh_dim_names
        if not names:
            raise MeshError(
                "Mesh.from_device_mesh: the DeviceMesh has no mesh_dim_names. Fix: "
                "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
            )
        layout = device_mesh.mesh.flatten().tolist()
        if layout != list(range(len(layout))):
            raise MeshError(
                f"Mesh.from_device_mesh: the DeviceMesh's ranks {layout} are not row-major "
                f"0..{len(layout) - 1}. Fix: build it with init_device_mesh"
            )
        plain = cls(list(zip(names, (int(s) for s in device_mesh.mesh.shape))))
        return plain._over_job(
            timeout,
            "Mesh.from_device_mesh",
            check=check,
            device_mesh=device_mesh,
            backend=backend,
            library=library,
        )

    def to_device_mesh(self, device_type: str = "cpu") -> Any:
        """A ``DeviceMesh`` with this mesh's axes (collective call: every rank must call it).

        Args:
            device_type: the device type of the ``DeviceMesh`` (``"cpu"``, ``"cuda"``).
        """
        from torch.distributed.device_mesh import init_device_mesh

        if self._comm is not None and self._comm.where:
            raise MeshError(
                f"Mesh.to_device_mesh: {self!r} is the slice {self._comm.where} of a larger mesh, "
                "and a DeviceMesh spans the whole job. Fix: call to_device_mesh on the whole mesh "
                "and index the DeviceMesh (device_mesh['tp'])"
            )
        return init_device_mesh(device_type, self._sizes, mesh_dim_names=self._names)

    def with_timeout(self, timeout: float | datetime.timedelta) -> Mesh:
        """The same axes on the same job with another timeout (its groups are created anew,
        lazily).

        Args:
            timeout: seconds (or a timedelta) every blocking call may wait for a peer.
        """

        if self._comm is None:
            raise MeshError(
                f"Mesh.with_timeout: {self!r} is not backed by torch.distributed. Fix: build it "
                "with Mesh.from_torch"
            )
        from fastdist.comm import distributed as D

        td = D._as_timedelta(timeout, None, "Mesh.with_timeout")  # required: None is refused too
        plain = Mesh(list(zip(self._names, self._sizes)))
        # the same ranks (a slice stays that slice), check mode and backend
        return type(self)(plain.shape.items(), _comm=self._comm.renewed(plain, td))

    def _over_job(
        self, timeout: float | datetime.timedelta | None, who: str, **comm_args: Any
    ) -> Mesh:
        """This plain mesh's axes over the running torch.distributed job, with a new
        communicator; ``who`` (e.g. ``"Mesh.with_timeout"``) names the call in errors."""
        from fastdist.comm import distributed as D

        comm = D.TorchComm(
            self, timeout=D._as_timedelta(timeout, D.DEFAULT_TIMEOUT, who), **comm_args
        )
        return type(self)(self.shape.items(), _comm=comm)

    def create_groups(self, *axes: AxisName, device_type: str = "cpu") -> None:
        """Create now (instead of on first use) this rank's process groups for ``axes`` (default:
        each axis).

        Never required for correctness: groups are created on first use, in any order across
        ranks, and under ``torch.compile`` while dynamo traces. Useful to pay the set-up cost
        up front, and needed with a ctypes backend before CUDA graph capture: with its device
        type (``"cuda"``; ``"cpu"`` for the fake library) it also creates the NCCL/HCCL
        communicators, which must exist before capture. Every rank of each group must call it.

        Args:
            *axes: the axes (names or tuples of names) whose groups to create; default: each axis.
            device_type: with a ctypes backend, the device type of its communicators (``"cuda"``;
                ``"cpu"`` for the fake library).
        """
        import torch

        from fastdist.comm import distributed as D

        if self._comm is None:
            raise MeshError(
                f"Mesh.create_groups: {self!r} is not backed by torch.distributed. Fix: build it "
                "with Mesh.from_torch"
            )
        lib = self._comm.native_lib
        native = lib is not None and device_type == lib.device_type
        backend = "gloo" if native else D.select_backend(device_type)
        for axis in axes or self._names:
            ac = self._comm.axis(self.axis_indices(axis, "Mesh.create_groups"))
            if ac.n > 1:
                self._comm.group(ac, backend, "create_groups")
                if native:
                    device = (
                        torch.device("cuda", torch.cuda.current_device())
                        if device_type == "cuda"
                        else torch.device(device_type)
                    )
                    self._comm.native(ac, "create_groups", torch.empty(0, device=device))

    def reset(self, timeout: float | datetime.timedelta | None = None) -> None:
        """Recover after a failed collective: drop this mesh's process groups and start fresh ones.

        After a :class:`~fastdist.CollectiveTimeout` or :class:`~fastdist.CommError` (or an
        error that one rank raised while its peers waited in a collective) the mesh's groups
        may hold half-finished messages, so every later call on them would fail. **Every rank
        of the mesh** calls ``mesh.reset()``; it destroys the groups (a peer still waiting in
        one fails at once), moves the mesh to a new epoch agreed through the job's store, and
        returns once every rank has reset. The next collectives create new groups. Then redo
        the step on every rank. Compiled steps are traced again on their next call; run them
        under :class:`fastdist.comm_guard` so that a failure inside the compiled graph raises
        fastdist's errors too (torch's own ``RuntimeError`` otherwise).

        Waits up to ``timeout`` (default: twice the mesh's timeout plus 5 s, since a peer may
        need a whole timeout to notice the failure) and raises
        :class:`~fastdist.CollectiveTimeout` naming the ranks that did not reset. A rank that
        exited cannot rejoin: restart the job then. Other meshes are not affected: on a slice
        (:meth:`without`) only the slice's ranks reset, and its parent keeps its groups.

        ```text
        try:
            loss = step(batch)              # compiled: step = fastdist.comm_guard(mesh)(compiled)
        except fastdist.FastdistError:      # CommError, CollectiveTimeout, or this rank's own error
            mesh.reset()                    # on every rank
            loss = step(batch)
        ```

        Args:
            timeout: how long to wait for every rank to reset; default: twice the mesh's timeout
                plus 5 s.
        """
        from fastdist.comm import distributed as D

        if self._comm is None:
            raise MeshError(
                f"Mesh.reset: {self!r} is not backed by torch.distributed. Fix: build it with "
                "Mesh.from_torch"
            )
        default = 2 * self._comm.timeout + datetime.timedelta(seconds=5)
        self._comm.reset(D._as_timedelta(timeout, default, "Mesh.reset"))

    @property
    def backend(self) -> str | None:
        """``"torch"``, ``"nccl-ctypes"`` or ``"hccl-ctypes"`` on real ranks; ``None`` for a plain
        mesh."""
        return None if self._comm is None else str(self._comm.backend)

    def close(self, timeout: float = 5.0) -> bool:
        """Release this mesh's ctypes communicators (abort with a bounded wait); True if all
        finished.

        A no-op for ``backend="torch"`` and plain meshes (torch owns its process groups). A slice
        (:meth:`without`) has its own communicators: close it too.

        Args:
            timeout: seconds to wait for each communicator's abort.
        """
        return True if self._comm is None else bool(self._comm.close(timeout))

    @property
    def rank(self) -> int:
        """This process's rank on the mesh, on a mesh built from torch.distributed (within its
        slice for a mesh from :meth:`without`; the global rank for :meth:`from_torch`)."""
        if self._comm is None:
            raise MeshError(
                f"Mesh.rank: {self!r} describes ranks but is not one of them. Fix: build the mesh "
                "with Mesh.from_torch, or use fastdist.axis_index inside simulate"
            )
        return int(self._comm.rank)

    # ------------------------------------------------------------------ properties
    @property
    def size(self) -> int:
        """Number of ranks (the product of the axis sizes)."""
        return math.prod(self._sizes)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Axis names, outer (slowest) to inner (fastest)."""
        return self._names

    @property
    def shape(self) -> Mapping[str, int]:
        """Read-only mapping axis name -> size, in axis order."""
        return MappingProxyType(dict(zip(self._names, self._sizes)))

    @property
    def ndim(self) -> int:
        """Number of axes."""
        return len(self._names)

    # ------------------------------------------------------------------ axis resolution
    def axis_indices(self, axis: AxisName, op: str = "Mesh") -> tuple[int, ...]:
        """Positions of ``axis`` (a name or tuple of names) among this mesh's axes.

        Raises :class:`MeshError` naming ``op`` for an unknown, repeated or empty axis.

        Args:
            axis: an axis name, or a tuple of names taken as one flattened axis (row-major).
            op: the name the error message gives the caller.
        """
        names = (
            (axis,)
            if isinstance(axis, str)
            else tuple(axis)
            if isinstance(axis, (tuple, list))
            else None
        )
        if names is None or not all(isinstance(n, str) for n in names):
            raise MeshError(
                f"{op}: axis must be an axis name or a tuple of names, got {axis!r}. Fix: use one "
                f"of {self._names}"
            )
        if not names:
            raise MeshError(
                f"{op}: axis=() names no mesh axis. Fix: name at least one of {self._names}"
            )
        if len(set(names)) != len(names):
            raise MeshError(f"{op}: axis {axis!r} repeats an axis. Fix: name each axis once")
        for n in names:
            if n not in self._names:
                raise MeshError(
                    f"{op}: unknown mesh axis {n!r}; {self!r} has axes {self._names}. Fix: use "
                    f"one of {self._names}"
                )
        return tuple(self._names.index(n) for n in names)

    def axis_size(self, axis: AxisName) -> int:
        """Size of ``axis`` (product of the sizes for a tuple of axes).

        Args:
            axis: an axis name, or a tuple of names taken as one flattened axis (row-major).

        Returns:
            the number of ranks along ``axis``.
        """
        return math.prod([self._sizes[i] for i in self.axis_indices(axis, "Mesh.axis_size")])

    # ------------------------------------------------------------------ ranks and coordinates
    def _check_rank(self, rank: int, op: str) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise MeshError(
                f"{op}: rank {rank!r} is outside {self!r} (ranks 0..{self.size - 1}). Fix: pass "
                f"a rank in 0..{self.size - 1}"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank``: a mapping axis -> index along that axis.

        Args:
            rank: a rank of the mesh, ``0 <= rank < size``.

        Returns:
            the index of ``rank`` along each axis, by axis name.
        """
        self._check_rank(rank, "Mesh.coords")
        return {n: (rank // st) % sz for n, sz, st in zip(self._names, self._sizes, self._strides)}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """Inverse of :meth:`coords`: the rank at the given coordinates (all axes required).

        Args:
            coords: the index along every axis, by axis name.

        Returns:
            the rank at ``coords``.
        """
        if set(coords) != set(self._names):
            raise MeshError(
                f"Mesh.rank_of: coordinates {dict(coords)} must name exactly the axes {self._names}"
            )
        rank = 0
        for n, sz, st in zip(self._names, self._sizes, self._strides):
            c = coords[n]
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < sz:
                raise MeshError(
                    f"Mesh.rank_of: coordinate {n}={c!r} is outside 0..{sz - 1}. Fix: pass "
                    f"{n} in 0..{sz - 1}"
                )
            rank += c * st
        return rank

    def index(self, rank: int, axis: AxisName) -> int:
        """Index of ``rank`` within its group along ``axis`` (row-major over a tuple).

        Args:
            rank: a rank of the mesh.
            axis: an axis name, or a tuple of names taken as one flattened axis (row-major).

        Returns:
            the index of ``rank`` within its group along ``axis``.
        """
        self._check_rank(rank, "Mesh.index")
        return int(self._index_of(rank, self.axis_indices(axis, "Mesh.index")))

    def _index_of(self, rank: Any, axis_idx: Sequence[int]) -> Any:
        """Row-major index along the given axes; ``rank`` may be an int or an integer tensor."""
        idx = rank * 0
        for i in axis_idx:
            idx = idx * self._sizes[i] + (rank // self._strides[i]) % self._sizes[i]
        return idx

    def groups(self, axis: AxisName) -> list[list[int]]:
        """All rank groups along ``axis``: one list per group, each in axis order.

        Groups are ordered by the coordinates of the other axes (row-major).
        Groups along different axes are orthogonal: any two intersect in at most
        one rank, by construction.

        Args:
            axis: an axis name, or a tuple of names taken as one flattened axis (row-major).

        Returns:
            one list of ranks per group, each in axis order.

        >>> Mesh({"dp": 2, "tp": 2}).groups(("tp", "dp"))
        [[0, 2, 1, 3]]
        """
        idx = self.axis_indices(axis, "Mesh.groups")
        members = self._offsets(idx)
        return [
            [b + m for m in members]
            for b in self._offsets([i for i in range(self.ndim) if i not in idx])
        ]

    def group(self, rank: int, axis: AxisName) -> list[int]:
        """The group along ``axis`` that contains ``rank``, in axis order.

        Args:
            rank: a rank of the mesh.
            axis: an axis name, or a tuple of names taken as one flattened axis (row-major).

        Returns:
            the ranks of ``rank``'s group along ``axis``, in axis order.
        """
        self._check_rank(rank, "Mesh.group")
        idx = self.axis_indices(axis, "Mesh.group")
        base = rank - sum(
            ((rank // self._strides[i]) % self._sizes[i]) * self._strides[i] for i in idx
        )
        return [base + m for m in self._offsets(idx)]

    def _offsets(self, axis_idx: Sequence[int]) -> list[int]:
        """Rank offsets of every coordinate combination of the given axes, row-major in their
        order."""
        offsets = [0]
        for i in axis_idx:
            offsets = [o + c * self._strides[i] for o in offsets for c in range(self._sizes[i])]
        return offsets

    def submesh(self, axis: AxisName) -> Mesh:
        """The mesh of one group along ``axis``: those axes with their sizes, in the given order.

        Args:
            axis: the axis (or tuple of axes, in the order the submesh takes) of the group.

        >>> Mesh({"dp": 2, "sp": 2, "tp": 4}).submesh(("sp", "tp"))
        Mesh({'sp': 2, 'tp': 4})
        """
        return Mesh(
            [(self._names[i], self._sizes[i]) for i in self.axis_indices(axis, "Mesh.submesh")]
        )

    def without(self, axis: AxisName) -> Mesh:
        """The mesh of the other axes (in order): what one pipeline stage is parallelized over.

        On a plain mesh, the :class:`Mesh` of those axes. On a mesh over real ranks
        (:meth:`from_torch`), the same axes over **this process's slice**: the ranks with this
        process's index along ``axis``, e.g. for ``Mesh.from_torch(pp=2, tp=2)`` on 4 processes
        ``mesh.without("pp")`` spans global ranks 0, 1 on ranks 0 and 1 and ranks 2, 3 on ranks 2
        and 3. Its ``rank`` is the rank within the slice, and every collective on it, over any
        of its axes or all of them, stays inside the slice. It has its own process groups,
        created lazily by the slice's members only (named after the slice, so slices of one
        shape never meet), and the parent's timeout, check mode and backend. Calling
        ``without`` again with the same axes gives the same (equal) mesh. It is not a collective:
        nothing is sent and no peer needs to call it. Errors name global ranks and the slice
        (``pp=1``); :meth:`reset` on the slice involves only its ranks.

        Removing every axis gives a mesh with no axes (size 1, this process alone), e.g.
        ``Mesh({"pp": 4}).without("pp") == Mesh({})``. It describes one rank; on real ranks it
        has no axis to run a collective over, so collectives, the object helpers and
        ``ParallelModel.grads()``/``state_dict()`` on it raise :class:`MeshError` (keep a size-1
        axis, as ``Mesh.from_torch`` keeps ``dp``, to run them).

        Args:
            axis: the axis (or tuple of axes) to remove.

        Returns:
            the mesh of the remaining axes, in this mesh's order.

        >>> mesh = Mesh({"pp": 2, "dp": 2, "tp": 2})
        >>> mesh.without("pp")
        Mesh({'dp': 2, 'tp': 2})
        >>> mesh.without(("pp", "tp")), mesh.without(("pp", "dp", "tp")).size
        (Mesh({'dp': 2}), 1)
        """
        idx = self.axis_indices(axis, "Mesh.without")
        rest = Mesh(
            [(n, s) for i, (n, s) in enumerate(zip(self._names, self._sizes)) if i not in idx]
        )
        if self._comm is None:
            return rest
        return type(self)(rest.shape.items(), _comm=self._comm.slice(idx, rest))

    # ------------------------------------------------------------------ display
    def show(self, axis: AxisName | None = None) -> Any:
        """The rank grid (last axis as columns); with ``axis``, its groups lettered (coloured in
        Jupyter).

        Args:
            axis: the axis whose groups to letter; default: none.
        """
        from fastdist.tools.visual import MeshView

        return MeshView(self, axis)

    def _repr_html_(self) -> str:
        from fastdist.tools.visual import MeshView

        return MeshView(self)._repr_html_()

    # ------------------------------------------------------------------ value semantics
    def __eq__(self, other: object) -> bool:
        """Equal axes (names, sizes, order) and the same communicator (both ``None`` for plain
        meshes)."""
        if self is other:
            return True
        return (
            isinstance(other, Mesh)
            and self._names == other._names
            and self._sizes == other._sizes
            and self._comm is other._comm
        )

    def __hash__(self) -> int:
        return hash((self._names, self._sizes))

    def __repr__(self) -> str:
        return f"Mesh({dict(zip(self._names, self._sizes))!r})"
