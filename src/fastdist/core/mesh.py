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

import math
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

from fastdist.core.mesh_view import MeshView
from fastdist.errors import MeshError

__all__ = ["Mesh", "MeshComm", "AxisName", "DEFAULT_ORDER"]

#: An axis name, or a tuple of axis names treated as one flattened axis.
AxisName = str | Sequence[str]

#: Outer-to-inner order used by :meth:`Mesh.from_world_size`: tensor parallelism
#: innermost (consecutive ranks, usually one node), pipeline outermost; classifier-free
#: guidance (``cfg``, one exchange of a prediction per denoising step) just inside ``dp``.
DEFAULT_ORDER: tuple[str, ...] = ("pp", "dp", "cfg", "ep", "cp", "sp", "tp")


class MeshComm(Protocol):
    """What a mesh over real ranks carries: this process's communicator on the job.

    :func:`fastdist.connect` builds it (a :class:`fastdist.comm.torch_comm.TorchComm`) and
    ``fastdist.comm`` manages it; the mesh itself only reads this process's rank and the backend,
    and asks for the communicator of a slice (:meth:`Mesh.without`).
    """

    @property
    def rank(self) -> int:
        """This process's rank on the mesh."""

    @property
    def backend(self) -> str:
        """``"torch"``, ``"nccl-ctypes"`` or ``"hccl-ctypes"``."""

    def slice(self, removed: tuple[int, ...], mesh: Mesh) -> MeshComm:
        """The communicator of ``mesh`` (these axes without those at ``removed``) over this
        process's slice."""


class Mesh:
    """An ordered set of named axes, e.g. ``Mesh({"dp": 2, "sp": 2, "tp": 2})``.

    Args:
        axes: ordered mapping (or sequence of pairs) from axis name to size. Names
            must be distinct identifiers; sizes positive ints. The last axis
            varies fastest across ranks.
        comm: the communicator over real ranks, set by :func:`fastdist.connect` (and the other
            constructors of ``fastdist.comm``); leave it out for a plain mesh.

    A ``Mesh`` is an immutable value: meshes with equal axes compare and hash equal and
    are interchangeable (a collective on ``Mesh({"tp": 2})`` runs inside a simulation of
    another ``Mesh({"tp": 2})``). A mesh over real ranks (:func:`fastdist.connect`) also
    carries its communicator (:attr:`comm`, its process groups), so it equals only itself and
    meshes sharing that communicator; ``fastdist.comm`` manages those groups (``with_timeout``,
    ``create_groups``, ``reset``, ``close``). What is running over a mesh (a simulation, a
    replication check) is kept per thread by ``simulate``/``spmd``, not on the mesh. Collectives
    take the mesh as an argument; run them on all ranks at once with :func:`fastdist.simulate`.

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
    # typed Any: the real-rank runtime (fastdist.comm) reads its own communicator type through it
    _comm: Any

    def __init__(
        self,
        axes: Mapping[str, int] | Iterable[tuple[str, int]],
        *,
        comm: MeshComm | None = None,
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
        # The real-rank communicator (fastdist.comm.torch_comm.TorchComm) of a mesh built by
        # fastdist.connect / fastdist.comm.from_device_mesh: part of the mesh's value; None for a
        # plain mesh.
        setattr_(self, "_comm", comm)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Mesh is immutable: cannot set {name!r}. Fix: build a new Mesh")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Mesh is immutable: cannot delete {name!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        if self._comm is not None:
            raise MeshError(
                f"Mesh: {self!r} holds this process's process groups and cannot be pickled. "
                "Fix: send the axes (dict(mesh.shape)) and build the mesh with fastdist.connect in "
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
        cls, world_size: int, *, order: Sequence[str] | None = None, **degrees: int
    ) -> Mesh:
        """Build a mesh from a world size and the parallel degrees you know.

        ``dp`` is inferred as ``world_size // prod(other degrees)`` unless given.
        Axes are laid out in ``order`` (outer to inner; default
        ``("pp", "dp", "cfg", "ep", "cp", "sp", "tp")``, so tp is innermost as in
        Megatron and vLLM). ``dp`` is always present; other axes only when given.
        Axes of your own naming (a domain's ``h`` and ``w``), none of them in the default
        order, are laid out as you wrote them, inside ``dp``.

        Args:
            world_size: the number of ranks.
            order: the axes' order, outer to inner (the last varies fastest across ranks);
                default as above.
            **degrees: the size of each axis you know (``tp=2, sp=2``); ``dp`` is inferred unless
                given.

        Returns:
            a plain mesh (simulated ranks) with ``dp`` and the given axes, in ``order``.

        >>> Mesh.from_world_size(8, tp=2, sp=2)
        Mesh({'dp': 2, 'sp': 2, 'tp': 2})
        >>> Mesh.from_world_size(4, h=2, w=2)
        Mesh({'dp': 1, 'h': 2, 'w': 2})
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
        if order is None:
            own = [n for n in degrees if n != "dp"]
            custom = bool(own) and not any(n in DEFAULT_ORDER for n in own)
            order = ("dp", *own) if custom else DEFAULT_ORDER
        order = tuple(order)
        unknown = [n for n in degrees if n not in order]
        if unknown:
            raise MeshError(
                f"Mesh.from_world_size: axis {unknown[0]!r} is not in the layout order {order}. "
                f"Fix: pass order=(..., {unknown[0]!r}, ...) listing every axis outer to inner, "
                "'dp' included"
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

    # ------------------------------------------------------------------ real ranks
    @property
    def comm(self) -> MeshComm | None:
        """The communicator over real ranks set by :func:`fastdist.connect`; ``None`` for a plain
        mesh.

        >>> Mesh({"tp": 2}).comm is None
        True
        """
        return self._comm  # type: ignore[no-any-return]

    @property
    def backend(self) -> str | None:
        """``"torch"``, ``"nccl-ctypes"`` or ``"hccl-ctypes"`` on real ranks; ``None`` for a plain
        mesh."""
        return None if self._comm is None else str(self._comm.backend)

    @property
    def rank(self) -> int:
        """This process's rank on the mesh, on a mesh built from torch.distributed (within its
        slice for a mesh from :meth:`without`; the global rank for :func:`fastdist.connect`)."""
        if self._comm is None:
            raise MeshError(
                f"Mesh.rank: {self!r} describes ranks but is not one of them. Fix: build the mesh "
                "with fastdist.connect, or use fastdist.axis_index inside simulate"
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
    def sizes(self) -> tuple[int, ...]:
        """Axis sizes, in axis order."""
        return self._sizes

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
        (:func:`fastdist.connect`), the same axes over **this process's slice**: the ranks with
        this process's index along ``axis``, e.g. for ``fastdist.connect(pp=2, tp=2)`` on 4
        processes ``mesh.without("pp")`` spans global ranks 0, 1 on ranks 0 and 1 and ranks 2, 3
        on ranks 2 and 3. Its ``rank`` is the rank within the slice, and every collective on it,
        over any of its axes or all of them, stays inside the slice. It has its own process groups,
        created lazily by the slice's members only (named after the slice, so slices of one
        shape never meet), and the parent's timeout, check mode and backend. Calling
        ``without`` again with the same axes gives the same (equal) mesh. It is not a collective:
        nothing is sent and no peer needs to call it. Errors name global ranks and the slice
        (``pp=1``); ``fastdist.comm.reset`` on the slice involves only its ranks.

        Removing every axis gives a mesh with no axes (size 1, this process alone), e.g.
        ``Mesh({"pp": 4}).without("pp") == Mesh({})``. It describes one rank; on real ranks it
        has no axis to run a collective over, so collectives, the object helpers and
        ``ParallelModel.grads()``/``state_dict()`` on it raise :class:`MeshError` (keep a size-1
        axis, as ``fastdist.connect`` keeps ``dp``, to run them).

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
        return type(self)(rest.shape.items(), comm=self._comm.slice(idx, rest))

    # ------------------------------------------------------------------ display
    def show(self, axis: AxisName | None = None) -> MeshView:
        """The rank grid (last axis as columns); with ``axis``, its groups lettered (coloured in
        Jupyter).

        Args:
            axis: the axis whose groups to letter; default: none.
        """
        return MeshView(self, axis)

    def _repr_html_(self) -> str:
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
