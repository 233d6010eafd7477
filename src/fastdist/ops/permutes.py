"""Permutations and rank queries: ``ppermute``, ``ring_shift``, ``broadcast``, ``axis_index``,
``axis_size`` (one block each; conventions in ``fastdist.ops``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from fastdist.core.binding import rank_binding
from fastdist.core.context import check_of, is_real
from fastdist.core.mesh import AxisName, Mesh
from fastdist.core.primitive import GroupSpec, Primitive
from fastdist.errors import CollectiveError

if TYPE_CHECKING:
    from fastdist.core.comm import AxisComm, Comm
from fastdist.ops.prelude import (
    apply_primitive,
    as_index,
    check_index,
    check_mesh,
    enter,
    moves_bits,
    names_this_rank,
    same_shape,
    where_member,
)

__all__ = [
    "ppermute",
    "ring_shift",
    "broadcast",
    "axis_index",
    "axis_size",
]


# ====================================================================== ppermute
@moves_bits
def _ppermute_stacked(spec: GroupSpec, x: Tensor, *, perm: Sequence[int]) -> Tensor:
    y, a = spec.axis_view(x)  # [*before, n, *after, *s]
    # member j reads member src_of[j] (itself if it receives nothing: zeroed below)
    src_of = list(range(spec.n))
    received = [False] * spec.n
    for src, dst in zip(perm[0::2], perm[1::2]):
        src_of[dst] = src
        received[dst] = True
    # one gather pass
    out = y.index_select(a, torch.tensor(src_of, dtype=torch.long, device=x.device))
    # no `in` on perm: see _pairs_of
    idle = [j for j in range(spec.n) if not received[j]]
    if idle:
        # non-destinations: 0
        out.index_fill_(a, torch.tensor(idle, dtype=torch.long, device=x.device), 0)
    return spec.from_axis_view(out, x.shape[1:])


def _ppermute_dist(comm: AxisComm, x: Tensor, *, perm: Sequence[int]) -> Tensor:
    me, n = comm.index, comm.n
    scalar = x.dim() == 0
    rows = x.reshape(1) if scalar else x  # [k, ...]: sent whole, as k rows of dim 0
    if not perm or rows.numel() == 0:
        return torch.zeros_like(x)
    dst_of, src_of = _pairs_of(perm, n)
    sending, receiving = dst_of[me] is not None, src_of[me] is not None
    k = rows.shape[0]
    sends, recvs = [0] * n, [0] * n  # rows to / from each member
    if sending:
        sends[dst_of[me]] = k
    if receiving:
        recvs[src_of[me]] = k
    # [k, ...] from my source, or nothing
    got = comm.all_to_all_rows("ppermute", rows if sending else rows[:0], recvs, sends)
    if not receiving:
        return torch.zeros_like(x)  # non-destinations: 0
    return got.reshape(()) if scalar else got


def _pairs_of(perm: Sequence[int], n: int) -> tuple[list[Any], list[Any]]:
    """Each member's destination and source under ``perm`` (``None``: it sends / receives
    nothing), by indexing, never ``in`` / ``index`` on ``perm``: a rule that dynamo compiles as
    a frame of its own (run at a graph break under ``torch.compile(dynamic=True)``) gets
    ``perm`` as SymInts, and dynamo answers ``1 in [0, 1]`` False there (torch 2.13): every
    member was taken for idle and zeroed."""
    dst_of: list[Any] = [None] * n
    src_of: list[Any] = [None] * n
    for src, dst in zip(perm[0::2], perm[1::2]):
        dst_of[src], src_of[dst] = dst, src
    return dst_of, src_of


def _ppermute_bwd(
    ops: Any, spec: GroupSpec, g: Tensor, saved: Any, *, perm: Sequence[int]
) -> tuple[Any, ...]:
    inverse = tuple(v for s, d in zip(perm[0::2], perm[1::2]) for v in (d, s))
    return (ops.ppermute(g, spec=spec, perm=inverse),)


ppermute_p = Primitive(
    "ppermute",
    params=(("perm", "int[]"),),
    shape=same_shape,
    stacked=_ppermute_stacked,
    distributed=_ppermute_dist,
    backward=_ppermute_bwd,
    jvp="linear",
    replication=("V", "V"),
)


@names_this_rank
def ppermute(x: Tensor, mesh: Mesh, axis: AxisName, perm: Sequence[tuple[int, int]]) -> Tensor:
    """Send ``x`` from rank ``src`` to rank ``dst`` for every ``(src, dst)`` pair (indices along
    ``axis``).

    Sources are distinct and destinations are distinct; a rank that is no
    destination gets zeros. Shape: unchanged. Gradient: ``ppermute`` of ``g``
    along the inverted pairs.

    Args:
        x: this rank's tensor (inside :func:`fastdist.simulate`, each rank's slice of the input).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).
        perm: ``(src, dst)`` pairs of indices along ``axis``; sources distinct, destinations
            distinct.

    Returns:
        the ``x`` of the rank that sends to this one, zeros on a rank that no pair sends to; shape
        of ``x``.

    >>> import torch, fastdist
    >>> mesh = fastdist.Mesh({"pp": 3})
    >>> shift = lambda x: fastdist.ppermute(x, mesh, "pp", [(0, 1), (1, 2)])
    >>> shift = fastdist.simulate(shift, mesh)
    >>> shift(torch.tensor([1., 2., 3.]))
    tensor([0., 1., 2.])
    """
    x, spec = enter("ppermute", x, mesh, axis)
    return apply_primitive(ppermute_p, mesh, x, spec, perm=_check_perm(axis, perm, spec.n))


def _check_perm(axis: AxisName, perm: Sequence[tuple[int, int]], n: int) -> tuple[int, ...]:
    """``perm`` flattened to ``(src0, dst0, src1, dst1, ...)``, after checking it is a partial
    permutation of ``0..n-1``."""
    try:
        pairs = [tuple(p) for p in perm]
    except TypeError:
        raise CollectiveError(
            "ppermute",
            axis,
            f"perm={perm!r} is not a sequence of (src, dst) pairs",
            "pass e.g. [(0, 1), (1, 0)]",
        ) from None
    if any(len(p) != 2 for p in pairs):
        raise CollectiveError(
            "ppermute",
            axis,
            f"perm={perm!r} is not a sequence of (src, dst) pairs",
            "pass e.g. [(0, 1), (1, 0)]",
        )
    # (src0, dst0, src1, dst1, ...) as Python ints (a NumPy integer too, as JAX takes them)
    flat = tuple(
        check_index("ppermute", axis, ("src", "dst")[i % 2], v, n)
        for i, v in enumerate(v for p in pairs for v in p)
    )
    for role, vals in (("source", flat[0::2]), ("destination", flat[1::2])):
        if len(set(vals)) < len(vals):
            dup = min(v for v in vals if vals.count(v) > 1)
            raise CollectiveError(
                "ppermute",
                axis,
                f"{role} {dup} appears in more than one pair of perm={pairs}",
                f"give each {role} one pair",
            )
    return flat


@names_this_rank
def ring_shift(x: Tensor, mesh: Mesh, axis: AxisName, shift: int = 1) -> Tensor:
    """Rotate along the axis ring: rank ``i`` sends to ``(i + shift) % n`` (so receives from ``i -
    shift``).

    Shape: unchanged. Gradient: the opposite shift. Built on :func:`ppermute`.

    Args:
        x: this rank's tensor (inside :func:`fastdist.simulate`, each rank's slice of the input).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).
        shift: how many places along the ring rank ``i`` sends (``(i + shift) % n``); negative
            shifts the other way.

    Returns:
        the ``x`` of rank ``(i - shift) % n``; shape of ``x``.
    """
    k = as_index(shift)  # a NumPy integer too, as JAX takes it
    if k is None:
        raise CollectiveError(
            "ring_shift", axis, f"shift={shift!r} is not an int", "pass an int such as 1 or -1"
        )
    x, spec = enter("ring_shift", x, mesh, axis)
    # memoised outside dynamo tracing (dynamo warns on a memo; it traces the function itself)
    n = spec.n
    perm = _ring(n, k) if torch.compiler.is_compiling() else _ring_memo(n, k)
    return apply_primitive(ppermute_p, mesh, x, spec, perm=perm)


def _ring(n: int, shift: int) -> tuple[int, ...]:
    """The ring of ``n`` members shifted by ``shift`` as ``(src0, dst0, ...)``: a permutation by
    construction."""
    return tuple([v for i in range(n) for v in (i, (i + shift) % n)])


# a memo of the pure function above (building the ring costs a small call's own work again)
_ring_memo = functools.lru_cache(maxsize=1024)(_ring)


# ====================================================================== broadcast
@moves_bits
def _broadcast_stacked(spec: GroupSpec, x: Tensor, *, src: int) -> Tensor:
    y = spec.to_groups(x)  # [G, n, *s]
    # every member gets member src's value
    return spec.from_groups(y[:, src : src + 1].expand_as(y))


def _broadcast_dist(comm: AxisComm, x: Tensor, *, src: int) -> Tensor:
    return comm.broadcast("broadcast", x, src)  # src is the group rank == the axis index


def _broadcast_bwd(
    ops: Any, spec: GroupSpec, g: Tensor, saved: Any, *, src: int
) -> tuple[Any, ...]:
    return (ops.keep_src(g, spec=spec, src=src),)


@moves_bits
def _keep_src_stacked(spec: GroupSpec, x: Tensor, *, src: int) -> Tensor:
    y = spec.to_groups(x)  # [G, n, *s]
    return spec.from_groups(where_member(spec, y, spec.member_index(y.device) == src))


def _keep_src_dist(comm: AxisComm, x: Tensor, *, src: int) -> Tensor:
    return x.clone() if comm.index == src else torch.zeros_like(x)


broadcast_p = Primitive(
    "broadcast",
    params=(("src", "int"),),
    shape=same_shape,
    stacked=_broadcast_stacked,
    distributed=_broadcast_dist,
    backward=_broadcast_bwd,
    jvp="linear",
    replication=("V", "I"),
)
# Internal: keep x on member src, zero elsewhere (self-adjoint: its backward is itself).
keep_src_p = Primitive(
    "keep_src",
    params=(("src", "int"),),
    shape=same_shape,
    stacked=_keep_src_stacked,
    distributed=_keep_src_dist,
    backward=_broadcast_bwd,
    jvp="linear",
)


@names_this_rank
def broadcast(x: Tensor, mesh: Mesh, axis: AxisName, src: int = 0) -> Tensor:
    """Every rank of the group gets the ``x`` of the rank with index ``src`` along ``axis``.

    Shape: unchanged. Gradient: ``g`` on rank ``src``, zero elsewhere (the output
    is replicated, so its cotangent is taken to be replicated, as for :func:`psum`).

    Args:
        x: this rank's tensor (inside :func:`fastdist.simulate`, each rank's slice of the input).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).
        src: the index along ``axis`` of the rank whose ``x`` every rank gets.

    Returns:
        rank ``src``'s ``x`` on every rank of the group; shape of ``x``.

    >>> import torch, fastdist
    >>> mesh = fastdist.Mesh({"tp": 3})
    >>> fastdist.simulate(lambda x: fastdist.broadcast(x, mesh, "tp", src=2), mesh)(
    ...     torch.tensor([1., 2., 3.]))
    tensor([3., 3., 3.])
    """
    x, spec = enter("broadcast", x, mesh, axis)
    return apply_primitive(
        broadcast_p,
        mesh,
        x,
        spec,
        src=check_index("broadcast", axis, "src", src, spec.n),
    )


# ====================================================================== axis_index / axis_size
def axis_index(mesh: Mesh, axis: AxisName) -> Tensor:
    """This rank's index along ``axis`` as a 0-d int64 tensor (row-major over a tuple of axes).

    Inside :func:`fastdist.simulate` it differs per rank; on a one-rank mesh it is 0.
    No gradient (an integer).

    Args:
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).

    Returns:
        this rank's index along ``axis``: a 0-d int64 tensor.

    >>> import torch, fastdist
    >>> mesh = fastdist.Mesh({"dp": 2, "tp": 2})
    >>> fastdist.simulate(lambda x: x + fastdist.axis_index(mesh, "dp"), mesh)(
    ...     torch.zeros(4, dtype=torch.long))
    tensor([0, 0, 1, 1])
    """
    check_mesh("axis_index", mesh, axis)
    idx = mesh.axis_indices(axis, "fastdist.axis_index")
    if is_real(mesh):
        index = torch.tensor(cast("Comm", mesh.comm).axis(idx).index)
    else:
        # the running simulation (None on a one-rank mesh)
        binding = rank_binding("axis_index", mesh)
        index = (
            torch.zeros((), dtype=torch.long)
            if binding is None
            else cast(Tensor, mesh._index_of(binding.rank, idx))
        )
    tracker = check_of(mesh)
    if tracker is not None:
        tracker.mark_varying(index, [mesh.axis_names[i] for i in idx])
    return index


def axis_size(mesh: Mesh, axis: AxisName) -> int:
    """Number of ranks along ``axis`` (product over a tuple), a Python int.

    Args:
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).

    Returns:
        the number of ranks along ``axis`` (the product over a tuple of axes).

    >>> import fastdist
    >>> fastdist.axis_size(fastdist.Mesh({"dp": 2, "tp": 4}), ("dp", "tp"))
    8
    """
    check_mesh("axis_size", mesh, axis)
    return mesh.axis_size(axis)
