"""Reductions over an axis: ``psum``, ``pvary``, ``pmean``, ``pmax``, ``pmin`` (one block each,
rules beside the public function; conventions in ``fastdist.ops``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fastdist.core.mesh import AxisName, Mesh
from fastdist.core.primitive import GroupSpec, Primitive

if TYPE_CHECKING:
    from fastdist.core.comm import AxisComm
from fastdist.ops.prelude import (
    apply_primitive,
    enter,
    like,
    names_this_rank,
    need_reducible,
    real_view,
    same_shape,
)

__all__ = [
    "psum",
    "pvary",
    "pmean",
    "pmax",
    "pmin",
]


# ====================================================================== psum
def _psum_stacked(spec: GroupSpec, x: Tensor) -> Tensor:
    y, a = spec.axis_view(x)  # [*before, n, *after, *s]
    # the sum, on every member
    return spec.from_axis_view(y.sum(a, keepdim=True, dtype=y.dtype).expand_as(y), x.shape[1:])


def _psum_dist(comm: AxisComm, x: Tensor) -> Tensor:
    if x.is_complex():
        return like(comm.all_reduce("psum", real_view(x), "sum"), x)
    return comm.all_reduce("psum", x, "sum")


def _psum_bwd(ops: Any, spec: GroupSpec, g: Tensor, saved: Any) -> tuple[Any, ...]:
    return (g,)


psum_p = Primitive(
    "psum",
    shape=same_shape,
    stacked=_psum_stacked,
    distributed=_psum_dist,
    backward=_psum_bwd,
    jvp="linear",
    replication=("VP", "I"),
    reduces="sum",
)


@names_this_rank
def psum(x: Tensor, mesh: Mesh, axis: AxisName) -> Tensor:
    """All-reduce sum: every rank of the group gets the sum of the group's ``x``.

    Shape: unchanged. Gradient: identity (the output is replicated over the
    group, so its cotangent is taken to be replicated); see :func:`pvary`.

    Args:
        x: this rank's tensor (inside :func:`fastdist.simulate`, each rank's slice of the input).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).

    Returns:
        the sum of the group's ``x``, the same on every rank of the group; shape of ``x``.

    >>> import torch, fastdist
    >>> mesh = fastdist.Mesh({"tp": 3})
    >>> fastdist.simulate(lambda x: fastdist.psum(x, mesh, "tp"), mesh)(torch.tensor([1., 2., 4.]))
    tensor([7., 7., 7.])
    """
    x, spec = enter("psum", x, mesh, axis)
    need_reducible(psum_p, axis, x)
    return apply_primitive(psum_p, mesh, x, spec)


# ====================================================================== pvary
def _pvary_stacked(spec: GroupSpec, x: Tensor) -> Tensor:
    return x.clone()


def _pvary_dist(comm: AxisComm, x: Tensor) -> Tensor:
    return x.clone()


def _pvary_bwd(ops: Any, spec: GroupSpec, g: Tensor, saved: Any) -> tuple[Any, ...]:
    return (ops.psum(g, spec=spec),)


pvary_p = Primitive(
    "pvary",
    shape=same_shape,
    stacked=_pvary_stacked,
    distributed=_pvary_dist,
    backward=_pvary_bwd,
    jvp="linear",
    replication=("I", "V"),
)


@names_this_rank
def pvary(x: Tensor, mesh: Mesh, axis: AxisName) -> Tensor:
    """Mark a value that is replicated over the group as about to vary per rank.

    Forward: identity. Shape: unchanged. Gradient: ``psum`` over the group.

    Call it where a replicated tensor (an activation after :func:`psum`, a
    replicated input or weight) feeds rank-specific computation, such as the
    input of a column-parallel linear layer: each rank's backward then gets the
    sum of all ranks' partial gradients, which is the full gradient. Without it
    each rank keeps only its own partial (the classic silent TP bug).

    Args:
        x: this rank's tensor (inside :func:`fastdist.simulate`, each rank's slice of the input).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).

    Returns:
        ``x`` itself (forward), now varying per rank for autograd: its gradient is summed over the
        group.
    """
    x, spec = enter("pvary", x, mesh, axis)
    return apply_primitive(pvary_p, mesh, x, spec)


# ====================================================================== pmean
def _pmean_stacked(spec: GroupSpec, x: Tensor) -> Tensor:
    y = spec.to_groups(x)  # [G, n, *s]
    return spec.from_groups(y.mean(1, keepdim=True).expand_as(y))


def _pmean_dist(comm: AxisComm, x: Tensor) -> Tensor:
    return like(comm.all_reduce("pmean", real_view(x), "sum") / comm.n, x)  # gloo has no AVG


def _pmean_bwd(ops: Any, spec: GroupSpec, g: Tensor, saved: Any) -> tuple[Any, ...]:
    return (g / spec.n,)


pmean_p = Primitive(
    "pmean",
    shape=same_shape,
    stacked=_pmean_stacked,
    distributed=_pmean_dist,
    backward=_pmean_bwd,
    jvp="linear",
    replication=("VP", "I"),
    reduces="mean",
)


@names_this_rank
def pmean(x: Tensor, mesh: Mesh, axis: AxisName) -> Tensor:
    """All-reduce mean over the group.

    Shape: unchanged. Gradient: ``g / n`` (``psum``'s rule scaled by the group size).
    Used for data-parallel gradient averaging: ``pmean(grad, mesh, "dp")``.

    Args:
        x: this rank's tensor (inside :func:`fastdist.simulate`, each rank's slice of the input).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).

    Returns:
        the mean of the group's ``x``, the same on every rank; shape of ``x``.
    """
    x, spec = enter("pmean", x, mesh, axis)
    need_reducible(pmean_p, axis, x)
    return apply_primitive(pmean_p, mesh, x, spec)


# ====================================================================== pmax / pmin and their
# subgradient
def _pmax_stacked(spec: GroupSpec, x: Tensor) -> Tensor:
    y = spec.to_groups(x)  # [G, n, *s]
    return spec.from_groups(y.amax(1, keepdim=True).expand_as(y))


def _pmin_stacked(spec: GroupSpec, x: Tensor) -> Tensor:
    y = spec.to_groups(x)  # [G, n, *s]
    return spec.from_groups(y.amin(1, keepdim=True).expand_as(y))


def _pmax_dist(comm: AxisComm, x: Tensor) -> Tensor:
    return comm.all_reduce("pmax", x, "max")


def _pmin_dist(comm: AxisComm, x: Tensor) -> Tensor:
    return comm.all_reduce("pmin", x, "min")


def _extreme_bwd(ops: Any, spec: GroupSpec, g: Tensor, saved: Any) -> tuple[Any, ...]:
    x, out = saved
    return (ops.select_extreme(g, x, out, spec=spec),)


def _select_extreme_stacked(spec: GroupSpec, g: Tensor, x: Tensor, out: Tensor) -> Tensor:
    hit = spec.to_groups(x) == spec.to_groups(out)  # [G, n, *s]: members attaining the extreme
    first = hit & (hit.cumsum(1) == 1)  # the lowest-index one of them
    return spec.from_groups(
        torch.where(first, spec.to_groups(g), torch.zeros((), dtype=g.dtype, device=g.device))
    )


def _select_extreme_dist(comm: AxisComm, g: Tensor, x: Tensor, out: Tensor) -> Tensor:
    # my axis index where I attain the extreme, else n
    mine = torch.where(x == out, comm.index, comm.n)
    winner = comm.all_reduce("select_extreme", mine, "min")  # the lowest index attaining it
    return torch.where(winner == comm.index, g, torch.zeros((), dtype=g.dtype, device=g.device))


def _extreme_jvp(ops: Any, spec: GroupSpec, tangents: Any, saved: Any) -> Tensor | None:
    # the tangent of the rank the value came from (lowest index on ties, as the gradient)
    (t,) = tangents
    x, out = saved
    return None if t is None else ops.psum(ops.select_extreme(t, x, out, spec=spec), spec=spec)


def _select_extreme_jvp(ops: Any, spec: GroupSpec, tangents: Any, saved: Any) -> Tensor | None:
    # linear in g; x and out only say which rank is selected (piecewise constant)
    t = tangents[0]
    _, x, out, _ = saved
    return None if t is None else ops.select_extreme(t, x, out, spec=spec)


def _select_extreme_bwd(ops: Any, spec: GroupSpec, g: Tensor, saved: Any) -> tuple[Any, ...]:
    _, x, out, _ = saved  # (g, x, out, output)
    return (ops.select_extreme(g, x, out, spec=spec), None, None)


pmax_p = Primitive(
    "pmax",
    shape=same_shape,
    stacked=_pmax_stacked,
    distributed=_pmax_dist,
    backward=_extreme_bwd,
    jvp=_extreme_jvp,
    saves=True,
    replication=("V", "I"),
    reduces="max",
)
pmin_p = Primitive(
    "pmin",
    shape=same_shape,
    stacked=_pmin_stacked,
    distributed=_pmin_dist,
    backward=_extreme_bwd,
    jvp=_extreme_jvp,
    saves=True,
    replication=("V", "I"),
    reduces="min",
)
# Internal: g on the lowest-index rank whose x equals the reduced value, zero elsewhere (linear in
# g).
select_extreme_p = Primitive(
    "select_extreme",
    inputs=("g", "x", "out"),
    shape=same_shape,
    stacked=_select_extreme_stacked,
    distributed=_select_extreme_dist,
    backward=_select_extreme_bwd,
    jvp=_select_extreme_jvp,
    saves=True,
)


def _extreme(op: str, prim: Primitive, x: Tensor, mesh: Mesh, axis: AxisName) -> Tensor:
    x, spec = enter(op, x, mesh, axis)
    need_reducible(prim, axis, x)
    return apply_primitive(prim, mesh, x, spec)


@names_this_rank
def pmax(x: Tensor, mesh: Mesh, axis: AxisName) -> Tensor:
    """All-reduce maximum over the group (elementwise).

    Shape: unchanged. Gradient: ``g`` goes to the lowest-index rank of the group
    whose ``x`` attains the maximum (ties: lowest rank), zero to the others.

    Args:
        x: this rank's tensor (inside :func:`fastdist.simulate`, each rank's slice of the input).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).

    Returns:
        the elementwise maximum over the group, the same on every rank; shape of ``x``.
    """
    return _extreme("pmax", pmax_p, x, mesh, axis)


@names_this_rank
def pmin(x: Tensor, mesh: Mesh, axis: AxisName) -> Tensor:
    """All-reduce minimum over the group (elementwise).

    Shape: unchanged. Gradient: ``g`` to the lowest-index rank attaining the minimum.

    Args:
        x: this rank's tensor (inside :func:`fastdist.simulate`, each rank's slice of the input).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).

    Returns:
        the elementwise minimum over the group, the same on every rank; shape of ``x``.
    """
    return _extreme("pmin", pmin_p, x, mesh, axis)
