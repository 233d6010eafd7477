"""The collectives: one block per primitive, each with its shape, forward and backward rule.

Read this file like a table (as JAX's ``lax/parallel.py``). Each block has

* ``_<op>_shape``: the per-rank output shape (the fake rule);
* ``_<op>_stacked``: the forward over all ranks at once, on ``[world, *s]``
  (the simulated implementation, reached through the generic vmap rule);
* ``_<op>_dist``: the forward on one real rank, with torch's functional
  collectives on the rank's group ``comm`` (a ``fastdist.comm.distributed.AxisComm``);
* ``_<op>_bwd``: the per-rank gradient rule, written with other primitives;
* the public function: argument checks with errors that name the op, the axis
  and the fix, then ``<op>_p.bind``.

``spec.to_groups`` views ``[world, *s]`` as ``[G, n, *s]`` (G groups of n members,
member index in axis order), so a per-rank tensor dim ``d`` is dim ``d + 2`` there.
The rules on the hot path of models (psum, all_gather, psum_scatter, ppermute) use
``spec.axis_view`` instead: the mesh layout ``[*before, n, *after, *s]``, a view with no
permute copy when the group's axes are consecutive mesh axes (``to_groups`` otherwise).

Gradient conventions (the pairs that decide whether gradients are right):

==================  ===============================  ==================================
op                  forward                          backward (per rank)
==================  ===============================  ==================================
``psum``            sum over the group               identity
``pvary``           identity                         ``psum``
``pmean``           mean over the group              ``g / n``
``pmax``/``pmin``   max/min over the group           ``g`` to the lowest rank attaining it
``all_gather``      concatenate (or stack)           ``psum_scatter``
``all_gather_inv.`` concatenate, replicated result   local slice (``local_chunk``)
``local_chunk``     own chunk of a replicated value  ``all_gather_invariant``
``psum_scatter``    sum, keep own chunk              ``all_gather``
``all_to_all``      split ``a``, concatenate ``comm``   ``all_to_all`` with ``a``, ``comm`` swapped
``ppermute``        send along (src, dst) pairs      ``ppermute`` along the inverse pairs
``broadcast``       copy of ``src``'s value          ``g`` on ``src``, zero elsewhere
==================  ===============================  ==================================

``psum``'s identity backward assumes what its output is: the same on every rank
of the group, so each rank's loss uses it the same way and its cotangent is the
same everywhere. Where a replicated value enters rank-specific computation (a
replicated input to a column-parallel matmul), call ``pvary`` first: forward
nothing, backward the all-reduce that sums the ranks' partial gradients. This
is Megatron's ``copy_to_tensor_model_parallel_region`` / ``reduce_from_...``
pair, and JAX's typed ``pvary`` / ``psum``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import Tensor

from fastdist.core.context import check_of, is_real, simulation_of
from fastdist.core.dtype_rule import check_reduction_dtype
from fastdist.core.mesh import AxisName, Mesh
from fastdist.core.primitive import GroupSpec, Primitive
from fastdist.errors import CollectiveError, MeshError
from fastdist.sim.simulate import promote, rank_binding

if TYPE_CHECKING:
    from fastdist.comm.distributed import AxisComm

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "pvary",
    "all_gather",
    "psum_scatter",
    "all_gather_invariant",
    "local_chunk",
    "all_to_all",
    "all_to_all_4d",
    "ppermute",
    "ring_shift",
    "broadcast",
    "axis_index",
    "axis_size",
]


# ====================================================================== shared helpers
_F = TypeVar("_F", bound=Callable[..., Any])


def _names_this_rank(fn: _F) -> _F:
    """Argument checks run on each rank with that rank's own inputs. On simulated ranks one
    program checks them all (``on every rank``); on a real mesh the error a check raises names
    the rank it ran on instead, as the rank's inputs may differ from its peers'."""
    at = list(inspect.signature(fn).parameters).index("mesh")

    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CollectiveError as e:
            mesh = args[at] if len(args) > at else kwargs.get("mesh")
            if (
                e.rank == "every rank"
                and isinstance(mesh, Mesh)
                and mesh._comm is not None
                and simulation_of(mesh) is None
            ):
                e.readdress(rank=f"rank {mesh._comm.global_rank}")
            raise

    return cast(_F, op)


def _enter(op: str, x: Any, mesh: Mesh, axis: AxisName) -> tuple[Tensor, GroupSpec]:
    """Check ``x``/``mesh``/``axis`` and return ``x`` with the rank dimension, plus the group
    spec."""
    if not isinstance(x, Tensor):
        raise CollectiveError(
            op, axis, f"x must be a torch.Tensor, got {type(x).__name__}", "pass a tensor"
        )
    if not isinstance(mesh, Mesh):
        raise CollectiveError(
            op,
            axis,
            f"mesh must be a fastdist.Mesh, got {type(mesh).__name__}",
            "pass the Mesh the code runs on",
        )
    binding = simulation_of(mesh)
    # real ranks (a simulation over the mesh takes precedence)
    if binding is None and mesh._comm is not None:
        return x, mesh._comm.spec(axis, f"fastdist.{op}")
    spec = _plain_spec(op, mesh, axis)
    if binding is None:
        binding = rank_binding(op, mesh)  # raises unless the mesh has one rank
    tracker = check_of(mesh)
    if tracker is None:
        return promote(op, x, binding), spec
    # fastdist's own plumbing is not user code: keep the state, unobserved
    with tracker.suspended():
        y = promote(op, x, binding)
    tracker.set(y, tracker.get(x))
    return y, spec


@functools.lru_cache(maxsize=4096)
def _cached_plain_spec(mesh: Mesh, axis: str | tuple[str, ...]) -> GroupSpec:
    return GroupSpec(mesh._sizes, mesh.axis_indices(axis, "fastdist"))


def _plain_spec(op: str, mesh: Mesh, axis: AxisName) -> GroupSpec:
    """The group spec of ``axis`` on a simulated mesh: a pure function of the axes, memoised.

    The memo is a cache of a pure function (outside dynamo tracing); an invalid axis is not
    cached and raises naming ``op``.
    """
    if isinstance(axis, (str, tuple)) and not torch.compiler.is_compiling():
        try:
            return _cached_plain_spec(mesh, axis)
        except (MeshError, TypeError):
            # re-raised below naming the op (TypeError: unhashable parts)
            pass
    return GroupSpec(mesh._sizes, mesh.axis_indices(axis, f"fastdist.{op}"))


def _apply(
    prim: Primitive, mesh: Mesh, x: Tensor, spec: GroupSpec, *extra: Tensor, **params: Any
) -> Tensor:
    """Run the primitive on ``x`` (and extra tensor inputs such as sizes).

    Under a replication check (``fastdist.spmd``) the tracker checks ``x``'s state first.
    """
    tracker = check_of(mesh)
    if tracker is not None:
        return cast(Tensor, tracker.collective(prim, mesh, x, spec, params, extra))
    return prim.bind(x, *extra, spec=spec, **params)


def _flag(op: str, axis: AxisName, name: str, value: Any) -> bool:
    """``value`` if it is a bool (``tiled="no"`` would read as true)."""
    if not isinstance(value, bool):
        raise CollectiveError(
            op,
            axis,
            f"{name}={value!r} is not a bool",
            f"pass {name}=True or {name}=False",
        )
    return value


def _norm_dim(op: str, axis: AxisName, name: str, dim: Any, ndim: int) -> int:
    """Normalise a (possibly negative) dim in ``[-ndim, ndim)``."""
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        rng = f"[{-ndim}, {ndim - 1}]" if ndim else "none: the tensor is 0-d"
        raise CollectiveError(
            op,
            axis,
            f"{name}={dim!r} is out of range for a {ndim}-d tensor",
            f"use a {name} in {rng}",
        )
    return dim % ndim


def _need_divisible(op: str, axis: AxisName, x: Tensor, dim: int, n: int, alt: str) -> None:
    if x.shape[dim] % n:
        raise CollectiveError(
            op,
            axis,
            f"dim {dim} has size {x.shape[dim]}, not divisible by the axis size {n}",
            f"pad dim {dim} to a multiple of {n}, or {alt}",
        )


def _need_reducible(prim: Primitive, axis: AxisName, x: Tensor) -> None:
    """The one dtype rule of reductions (``fastdist.core.dtype_rule``), for ``prim``'s kind of
    reduction."""
    check_reduction_dtype(prim.name, axis, x.dtype, cast(str, prim.reduces))


def _real_view(x: Tensor) -> Tensor:
    """A complex tensor as its ``[..., 2]`` float view, for sums on real ranks (torch's c10d
    reduce-scatter and functional all-reduce, and NCCL, take no complex dtype); other tensors as
    they are."""
    return torch.view_as_real(x.resolve_conj()) if x.is_complex() else x


def _like(y: Tensor, x: Tensor) -> Tensor:
    """Undo :func:`_real_view` on a result ``y`` of the same kind as ``x``."""
    return torch.view_as_complex(y.contiguous()) if x.is_complex() else y


def _same(n: int, s: tuple[Any, ...], *rest: Any, **params: Any) -> tuple[Any, ...]:
    return s


def _index(op: str, axis: AxisName, name: str, value: Any, n: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
        raise CollectiveError(
            op,
            axis,
            f"{name}={value!r} is not an index along the axis (size {n})",
            f"use {name} in 0..{n - 1}",
        )
    return value


def _where_member(spec: GroupSpec, y: Tensor, mask: Tensor) -> Tensor:
    """``y`` where the ``[G, n]`` member mask holds, zero elsewhere."""
    return torch.where(
        mask.reshape(*mask.shape, *(1,) * (y.dim() - 2)),
        y,
        torch.zeros((), dtype=y.dtype, device=y.device),
    )


# ====================================================================== psum
def _psum_stacked(spec: GroupSpec, x: Tensor) -> Tensor:
    y, a = spec.axis_view(x)  # [*before, n, *after, *s]
    # the sum, on every member
    return spec.from_axis_view(y.sum(a, keepdim=True, dtype=y.dtype).expand_as(y), x.shape[1:])


def _psum_dist(comm: AxisComm, x: Tensor) -> Tensor:
    return _like(comm.all_reduce("psum", _real_view(x), "sum"), x)


def _psum_bwd(ops: Any, spec: GroupSpec, g: Tensor, saved: Any) -> tuple[Any, ...]:
    return (g,)


psum_p = Primitive(
    "psum",
    shape=_same,
    stacked=_psum_stacked,
    distributed=_psum_dist,
    backward=_psum_bwd,
    replication=("VP", "I"),
    reduces="sum",
)


@_names_this_rank
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
    x, spec = _enter("psum", x, mesh, axis)
    _need_reducible(psum_p, axis, x)
    return _apply(psum_p, mesh, x, spec)


# ====================================================================== pvary
def _pvary_stacked(spec: GroupSpec, x: Tensor) -> Tensor:
    return x.clone()


def _pvary_dist(comm: AxisComm, x: Tensor) -> Tensor:
    return x.clone()


def _pvary_bwd(ops: Any, spec: GroupSpec, g: Tensor, saved: Any) -> tuple[Any, ...]:
    return (ops.psum(g, spec=spec),)


pvary_p = Primitive(
    "pvary",
    shape=_same,
    stacked=_pvary_stacked,
    distributed=_pvary_dist,
    backward=_pvary_bwd,
    replication=("I", "V"),
)


@_names_this_rank
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
    x, spec = _enter("pvary", x, mesh, axis)
    return _apply(pvary_p, mesh, x, spec)


# ====================================================================== pmean
def _pmean_stacked(spec: GroupSpec, x: Tensor) -> Tensor:
    y = spec.to_groups(x)  # [G, n, *s]
    return spec.from_groups(y.mean(1, keepdim=True).expand_as(y))


def _pmean_dist(comm: AxisComm, x: Tensor) -> Tensor:
    return _like(comm.all_reduce("pmean", _real_view(x), "sum") / comm.n, x)  # gloo has no AVG


def _pmean_bwd(ops: Any, spec: GroupSpec, g: Tensor, saved: Any) -> tuple[Any, ...]:
    return (g / spec.n,)


pmean_p = Primitive(
    "pmean",
    shape=_same,
    stacked=_pmean_stacked,
    distributed=_pmean_dist,
    backward=_pmean_bwd,
    replication=("VP", "I"),
    reduces="mean",
)


@_names_this_rank
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
    x, spec = _enter("pmean", x, mesh, axis)
    _need_reducible(pmean_p, axis, x)
    return _apply(pmean_p, mesh, x, spec)


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


def _select_extreme_bwd(ops: Any, spec: GroupSpec, g: Tensor, saved: Any) -> tuple[Any, ...]:
    _, x, out, _ = saved  # (g, x, out, output)
    return (ops.select_extreme(g, x, out, spec=spec), None, None)


pmax_p = Primitive(
    "pmax",
    shape=_same,
    stacked=_pmax_stacked,
    distributed=_pmax_dist,
    backward=_extreme_bwd,
    saves=True,
    replication=("V", "I"),
    reduces="max",
)
pmin_p = Primitive(
    "pmin",
    shape=_same,
    stacked=_pmin_stacked,
    distributed=_pmin_dist,
    backward=_extreme_bwd,
    saves=True,
    replication=("V", "I"),
    reduces="min",
)
# Internal: g on the lowest-index rank whose x equals the reduced value, zero elsewhere (linear in
# g).
select_extreme_p = Primitive(
    "select_extreme",
    inputs=("g", "x", "out"),
    shape=_same,
    stacked=_select_extreme_stacked,
    distributed=_select_extreme_dist,
    backward=_select_extreme_bwd,
    saves=True,
)


def _extreme(op: str, prim: Primitive, x: Tensor, mesh: Mesh, axis: AxisName) -> Tensor:
    x, spec = _enter(op, x, mesh, axis)
    _need_reducible(prim, axis, x)
    return _apply(prim, mesh, x, spec)


@_names_this_rank
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


@_names_this_rank
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


# ====================================================================== all_gather
def _all_gather_shape(n: int, s: tuple[Any, ...], *, dim: int, tiled: bool) -> tuple[Any, ...]:
    return (*s[:dim], s[dim] * n, *s[dim + 1 :]) if tiled else (*s[:dim], n, *s[dim:])


def _all_gather_stacked(spec: GroupSpec, x: Tensor, *, dim: int, tiled: bool) -> Tensor:
    y, a = spec.axis_view(x)  # [*before, n, *after, *s]
    k = y.dim() - (x.dim() - 1)  # mesh dims in the view
    # [*before, *after, *s[:dim], n, *s[dim:]]: the members' blocks side by side
    z = y.movedim(a, k - 1 + dim)
    # [*before, n, *after, *s[:dim], n, *s[dim:]]: every member holds them
    every = z.unsqueeze(a).expand(*y.shape[:k], *z.shape[k - 1 :])
    s = x.shape[1:]
    out = (*s[:dim], spec.n * s[dim], *s[dim + 1 :]) if tiled else (*s[:dim], spec.n, *s[dim:])
    return spec.from_axis_view(every, out)  # one copy


def _all_gather_dist(comm: AxisComm, x: Tensor, *, dim: int, tiled: bool) -> Tensor:
    if tiled:
        if dim == 0:
            return comm.all_gather_rows("all_gather", x)  # [n * s[0], ...]
        # [n * s[dim], ...] back to dim
        return comm.all_gather_rows("all_gather", x.movedim(dim, 0)).movedim(0, dim)
    out = comm.all_gather_rows("all_gather", x.unsqueeze(0))  # [n, *s]
    return out if dim == 0 else out.movedim(0, dim)  # the new dim moved to dim


def _all_gather_bwd(
    ops: Any, spec: GroupSpec, g: Tensor, saved: Any, *, dim: int, tiled: bool
) -> tuple[Any, ...]:
    return (ops.psum_scatter(g, spec=spec, dim=dim, tiled=tiled),)


all_gather_p = Primitive(
    "all_gather",
    params=(("dim", "int"), ("tiled", "bool")),
    shape=_all_gather_shape,
    stacked=_all_gather_stacked,
    distributed=_all_gather_dist,
    backward=_all_gather_bwd,
    dim_params=("dim",),
    replication=("V", "V"),
)


@_names_this_rank
def all_gather(
    x: Tensor, mesh: Mesh, axis: AxisName, dim: int = 0, *, tiled: bool = True
) -> Tensor:
    """Gather every rank's ``x`` along ``dim``, in axis order.

    Shape: ``tiled=True`` (default, like ``all_gather_into_tensor``) concatenates,
    multiplying ``x.shape[dim]`` by the axis size ``n``; ``tiled=False`` stacks
    into a new dim of size ``n`` at ``dim``. Gradient: ``psum_scatter`` of ``g``
    along the same dim (each rank gets the sum over ranks of its own slice).

    Args:
        x: this rank's tensor (inside :func:`fastdist.simulate`, each rank's slice of the input).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).
        dim: the tensor dim to gather along (negative counts from the end).
        tiled: ``True`` concatenates along ``dim``; ``False`` stacks into a new dim of size ``n`` at
            ``dim``.

    Returns:
        every rank's ``x`` in axis order: ``x.shape[dim]`` times ``n`` (tiled), or a new dim of size
        ``n``.

    >>> import torch, fastdist
    >>> mesh = fastdist.Mesh({"sp": 2})
    >>> x = torch.tensor([[1., 2.], [3., 4.]])  # rank 0 holds [1, 2], rank 1 [3, 4]
    >>> fastdist.simulate(lambda x: fastdist.all_gather(x, mesh, "sp"), mesh)(x)
    tensor([[1., 2., 3., 4.],
            [1., 2., 3., 4.]])
    """
    x, spec = _enter("all_gather", x, mesh, axis)
    tiled = _flag("all_gather", axis, "tiled", tiled)
    d = _norm_dim("all_gather", axis, "dim", dim, x.dim() if tiled else x.dim() + 1)
    return _apply(all_gather_p, mesh, x, spec, dim=d, tiled=tiled)


# ====================================================================== all_gather_invariant /
# local_chunk
def _all_gather_invariant_bwd(
    ops: Any, spec: GroupSpec, g: Tensor, saved: Any, *, dim: int
) -> tuple[Any, ...]:
    return (ops.local_chunk(g, spec=spec, dim=dim),)


def _local_chunk_shape(n: int, s: tuple[Any, ...], *, dim: int) -> tuple[Any, ...]:
    return (*s[:dim], s[dim] // n, *s[dim + 1 :])


def _local_chunk_stacked(spec: GroupSpec, x: Tensor, *, dim: int) -> Tensor:
    # [G, member, *s[:dim], chunk, s[dim] / n, ...]
    y = spec.to_groups(x).unflatten(dim + 2, (spec.n, -1))  # type: ignore[no-untyped-call]
    # [G, *s[:dim], s[dim] / n, ..., n]: member j's chunk j
    y = y.movedim(dim + 2, 2).diagonal(dim1=1, dim2=2)
    return spec.from_groups(y.movedim(-1, 1))  # [G, n, ...]


def _local_chunk_dist(comm: AxisComm, x: Tensor, *, dim: int) -> Tensor:
    # my chunk, no communication
    mine: Tensor = x.unflatten(dim, (comm.n, -1)).select(dim, comm.index)  # type: ignore[no-untyped-call]
    return mine.clone()


def _local_chunk_bwd(
    ops: Any, spec: GroupSpec, g: Tensor, saved: Any, *, dim: int
) -> tuple[Any, ...]:
    return (ops.all_gather_invariant(g, spec=spec, dim=dim),)


def _gather_tiled(rule: Any) -> Any:
    return lambda *a, dim, **kw: rule(*a, dim=dim, tiled=True, **kw)


all_gather_invariant_p = Primitive(
    "all_gather_invariant",
    params=(("dim", "int"),),
    shape=_gather_tiled(_all_gather_shape),
    stacked=_gather_tiled(_all_gather_stacked),
    distributed=_gather_tiled(_all_gather_dist),
    backward=_all_gather_invariant_bwd,
    dim_params=("dim",),
    replication=("V", "I"),
)
local_chunk_p = Primitive(
    "local_chunk",
    params=(("dim", "int"),),
    shape=_local_chunk_shape,
    stacked=_local_chunk_stacked,
    distributed=_local_chunk_dist,
    backward=_local_chunk_bwd,
    dim_params=("dim",),
    replication=("I", "V"),
)


@_names_this_rank
def all_gather_invariant(x: Tensor, mesh: Mesh, axis: AxisName, dim: int = 0) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (axis order), for a *replicated* consumer.

    Same forward as ``all_gather(tiled=True)``; the result is declared invariant, so
    its cotangent is taken to be the same on every rank. Gradient: each rank keeps its
    own chunk of ``g`` (a local slice, no communication); see :func:`local_chunk`.
    Use it when every rank computes the same loss from the gathered tensor.

    Args:
        x: this rank's tensor (inside :func:`fastdist.simulate`, each rank's slice of the input).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).
        dim: the tensor dim to concatenate along (negative counts from the end).

    Returns:
        every rank's ``x`` concatenated along ``dim`` in axis order, declared replicated over the
        group.
    """
    x, spec = _enter("all_gather_invariant", x, mesh, axis)
    d = _norm_dim("all_gather_invariant", axis, "dim", dim, x.dim())
    return _apply(all_gather_invariant_p, mesh, x, spec, dim=d)


@_names_this_rank
def local_chunk(x: Tensor, mesh: Mesh, axis: AxisName, dim: int = 0) -> Tensor:
    """This rank's chunk ``i`` (its index along ``axis``) of a replicated ``x``, split along
    ``dim``.

    Shape: ``x.shape[dim]`` divided by the axis size. No communication. Gradient:
    ``all_gather_invariant`` of ``g`` (every rank gets the whole gradient). JAX calls
    this ``pscatter``; :func:`fastdist.spmd` uses it to shard its inputs.

    Args:
        x: the replicated tensor (the same on every rank of the group).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).
        dim: the tensor dim to split (negative counts from the end).

    Returns:
        chunk ``i`` of ``x`` along ``dim``, ``i`` this rank's index along ``axis``.
    """
    x, spec = _enter("local_chunk", x, mesh, axis)
    d = _norm_dim("local_chunk", axis, "dim", dim, x.dim())
    _need_divisible("local_chunk", axis, x, d, spec.n, "use a dim whose size divides")
    return _apply(local_chunk_p, mesh, x, spec, dim=d)


# ====================================================================== psum_scatter
def _psum_scatter_shape(n: int, s: tuple[Any, ...], *, dim: int, tiled: bool) -> tuple[Any, ...]:
    return (*s[:dim], s[dim] // n, *s[dim + 1 :]) if tiled else (*s[:dim], *s[dim + 1 :])


def _psum_scatter_stacked(spec: GroupSpec, x: Tensor, *, dim: int, tiled: bool) -> Tensor:
    y, a = spec.axis_view(x)  # [*before, n, *after, *s]
    k = y.dim() - (x.dim() - 1)
    if tiled:
        y = y.unflatten(k + dim, (spec.n, -1))  # type: ignore[no-untyped-call]  # [..., *s[:dim], n chunks, s[dim] / n, ...]
    y = y.movedim(k + dim, a + 1)  # [*before, n members, n chunks, *after, ...]
    # [*before, n, *after, ...]: member j's slot holds the sum of chunk j (one pass)
    total = y.sum(a, dtype=x.dtype)
    return spec.from_axis_view(total, total.shape[k:])


def _psum_scatter_dist(comm: AxisComm, x: Tensor, *, dim: int, tiled: bool) -> Tensor:
    if x.is_complex():  # the float view has one more (last) dim: dim still names the same one
        return _like(_psum_scatter_dist(comm, _real_view(x), dim=dim, tiled=tiled), x)
    # [s[dim] / n, *rest]: my chunk of the sum
    mine = comm.reduce_scatter_rows("psum_scatter", x.movedim(dim, 0) if dim else x)
    if not tiled:
        return mine.squeeze(0)
    return mine.movedim(0, dim) if dim else mine


def _psum_scatter_bwd(
    ops: Any, spec: GroupSpec, g: Tensor, saved: Any, *, dim: int, tiled: bool
) -> tuple[Any, ...]:
    return (ops.all_gather(g, spec=spec, dim=dim, tiled=tiled),)


psum_scatter_p = Primitive(
    "psum_scatter",
    params=(("dim", "int"), ("tiled", "bool")),
    shape=_psum_scatter_shape,
    stacked=_psum_scatter_stacked,
    distributed=_psum_scatter_dist,
    backward=_psum_scatter_bwd,
    dim_params=("dim",),
    replication=("VP", "V"),
    reduces="sum",
)


@_names_this_rank
def psum_scatter(
    x: Tensor, mesh: Mesh, axis: AxisName, dim: int = 0, *, tiled: bool = True
) -> Tensor:
    """Reduce-scatter: sum over the group, then rank ``i`` (along ``axis``) keeps chunk ``i`` of
    ``dim``.

    Shape: ``tiled=True`` (default) divides ``x.shape[dim]`` by ``n`` (must be
    divisible); ``tiled=False`` needs ``x.shape[dim] == n`` and removes ``dim``.
    Gradient: ``all_gather`` of ``g`` along the same dim.

    Args:
        x: this rank's tensor (inside :func:`fastdist.simulate`, each rank's slice of the input).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).
        dim: the tensor dim to sum and split (negative counts from the end).
        tiled: ``True`` keeps chunk ``i`` of ``dim``; ``False`` needs ``x.shape[dim] == n`` and
            removes ``dim``.

    Returns:
        this rank's chunk of the group's sum: ``x.shape[dim]`` divided by ``n`` (tiled), or ``dim``
        removed.

    >>> import torch, fastdist
    >>> mesh = fastdist.Mesh({"tp": 2})
    >>> x = torch.tensor([[1., 2.], [10., 20.]])
    >>> fastdist.simulate(lambda x: fastdist.psum_scatter(x, mesh, "tp"), mesh)(x)
    tensor([[11.],
            [22.]])
    """
    x, spec = _enter("psum_scatter", x, mesh, axis)
    _need_reducible(psum_scatter_p, axis, x)
    tiled = _flag("psum_scatter", axis, "tiled", tiled)
    d = _norm_dim("psum_scatter", axis, "dim", dim, x.dim())
    if tiled:
        _need_divisible(
            "psum_scatter", axis, x, d, spec.n, "use reduce_scatter_v for uneven chunks"
        )
    elif x.shape[d] != spec.n:
        raise CollectiveError(
            "psum_scatter",
            axis,
            f"tiled=False needs dim {d} of size {spec.n} (the axis size), got {x.shape[d]}",
            "use tiled=True to split the dim into n chunks",
        )
    return _apply(psum_scatter_p, mesh, x, spec, dim=d, tiled=tiled)


# ====================================================================== all_to_all
def _all_to_all_shape(
    n: int, s: tuple[Any, ...], *, split_dim: int, concat_dim: int
) -> tuple[Any, ...]:
    out = list(s)
    out[split_dim] = out[split_dim] // n
    out[concat_dim] = out[concat_dim] * n
    return tuple(out)


def _all_to_all_stacked(spec: GroupSpec, x: Tensor, *, split_dim: int, concat_dim: int) -> Tensor:
    y = spec.to_groups(x)  # [G, i, *s]  (i: sender)
    # [G, i, *s[:split], j, s[split] / n, *s[split+1:]]  (j: receiver)
    y = y.unflatten(split_dim + 2, (spec.n, -1))  # type: ignore[no-untyped-call]
    y = y.movedim(split_dim + 2, 1)  # [G, j, i, *c]  with c = s, c[split] = s[split] / n
    y = y.movedim(2, concat_dim + 2)  # [G, j, *c[:concat], i, *c[concat:]]
    # [G, j, *c with c[concat] * n]
    return spec.from_groups(y.flatten(concat_dim + 2, concat_dim + 3))


def _all_to_all_dist(comm: AxisComm, x: Tensor, *, split_dim: int, concat_dim: int) -> Tensor:
    if split_dim == concat_dim == 0:
        # [n * c0, ...]: equal row blocks out, senders' blocks in
        return comm.all_to_all_rows("all_to_all", x, None, None)
    chunks = x.unflatten(split_dim, (comm.n, -1)).movedim(split_dim, 0)  # type: ignore[no-untyped-call]  # [n (receiver), *c]
    got = comm.all_to_all_rows("all_to_all", chunks, None, None)  # [n (sender), *c]
    # senders concatenated on concat_dim
    return got.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1)


def _all_to_all_bwd(
    ops: Any, spec: GroupSpec, g: Tensor, saved: Any, *, split_dim: int, concat_dim: int
) -> tuple[Any, ...]:
    return (ops.all_to_all(g, spec=spec, split_dim=concat_dim, concat_dim=split_dim),)


all_to_all_p = Primitive(
    "all_to_all",
    params=(("split_dim", "int"), ("concat_dim", "int")),
    shape=_all_to_all_shape,
    stacked=_all_to_all_stacked,
    distributed=_all_to_all_dist,
    backward=_all_to_all_bwd,
    dim_params=("split_dim", "concat_dim"),
    replication=("V", "V"),
)


@_names_this_rank
def all_to_all(x: Tensor, mesh: Mesh, axis: AxisName, split_dim: int, concat_dim: int) -> Tensor:
    """Split ``split_dim`` into ``n`` chunks, send chunk ``j`` to rank ``j``, concatenate what
    arrives along ``concat_dim``.

    Shape: ``split_dim`` shrinks by ``n`` (must be divisible), ``concat_dim``
    grows by ``n``, in sender order. Gradient: ``all_to_all`` with the two dims swapped.

    Args:
        x: this rank's tensor (inside :func:`fastdist.simulate`, each rank's slice of the input).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).
        split_dim: the dim cut into ``n`` chunks, chunk ``j`` going to rank ``j``.
        concat_dim: the dim along which the received chunks are concatenated, in sender order.

    Returns:
        the chunks received from every rank, ``split_dim`` divided and ``concat_dim`` multiplied by
        ``n``.

    >>> import torch, fastdist
    >>> mesh = fastdist.Mesh({"sp": 2})
    >>> x = torch.tensor([[1., 2.], [3., 4.]])  # rank 0: [1, 2], rank 1: [3, 4]
    >>> fastdist.simulate(lambda x: fastdist.all_to_all(x, mesh, "sp", 0, 0), mesh)(x)
    tensor([[1., 3.],
            [2., 4.]])
    """
    x, spec = _enter("all_to_all", x, mesh, axis)
    s = _norm_dim("all_to_all", axis, "split_dim", split_dim, x.dim())
    c = _norm_dim("all_to_all", axis, "concat_dim", concat_dim, x.dim())
    _need_divisible("all_to_all", axis, x, s, spec.n, "use a split_dim whose size divides")
    return _apply(all_to_all_p, mesh, x, spec, split_dim=s, concat_dim=c)


@_names_this_rank
def all_to_all_4d(
    x: Tensor, mesh: Mesh, axis: AxisName, scatter_dim: int = 2, gather_dim: int = 1
) -> Tensor:
    """Ulysses all-to-all on ``(batch, seq, heads, head_dim)`` tensors.

    ``scatter_dim=2, gather_dim=1`` (default) maps ``(bs, S/P, H, D) -> (bs, S, H/P, D)``:
    every rank trades its sequence shard of all heads for all of the sequence of
    its head shard. ``scatter_dim=1, gather_dim=2`` is the inverse. ``P`` is the
    axis size; ``H`` (resp. ``S``) must be divisible by it. Gradient: the inverse map.

    Args:
        x: this rank's ``(batch, seq, heads, head_dim)`` tensor.
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).
        scatter_dim: the dim split across the ranks (2: heads, the default; 1: sequence).
        gather_dim: the dim the ranks' pieces are gathered along (1: sequence, the default; 2:
            heads).

    Returns:
        ``(bs, S, H/P, D)`` from ``(bs, S/P, H, D)`` with the defaults; the inverse with the dims
        swapped.
    """
    if not isinstance(x, Tensor) or x.dim() != 4:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise CollectiveError(
            "all_to_all_4d",
            axis,
            f"x must be a 4-d (batch, seq, heads, head_dim) tensor, got {got}",
            "reshape to 4-d or use all_to_all",
        )
    if {scatter_dim % 4, gather_dim % 4} != {1, 2}:
        raise CollectiveError(
            "all_to_all_4d",
            axis,
            f"scatter_dim={scatter_dim}, gather_dim={gather_dim} "
            "must be the seq (1) and heads (2) dims",
            "use (2, 1) before attention and (1, 2) after",
        )
    return all_to_all(x, mesh, axis, split_dim=scatter_dim, concat_dim=gather_dim)


# ====================================================================== ppermute
def _ppermute_stacked(spec: GroupSpec, x: Tensor, *, perm: Sequence[int]) -> Tensor:
    y, a = spec.axis_view(x)  # [*before, n, *after, *s]
    srcs, dsts = perm[0::2], perm[1::2]
    # member j reads member src_of[j] (itself if it receives nothing: zeroed below)
    src_of = list(range(spec.n))
    for src, dst in zip(srcs, dsts):
        src_of[dst] = src
    # one gather pass
    out = y.index_select(a, torch.tensor(src_of, dtype=torch.long, device=x.device))
    idle = [j for j in range(spec.n) if j not in dsts]
    if idle:
        # non-destinations: 0
        out.index_fill_(a, torch.tensor(idle, dtype=torch.long, device=x.device), 0)
    return spec.from_axis_view(out, x.shape[1:])


def _ppermute_dist(comm: AxisComm, x: Tensor, *, perm: Sequence[int]) -> Tensor:
    srcs, dsts, me = perm[0::2], perm[1::2], comm.index
    rows = x if x.dim() else x.reshape(1)  # [k, ...]: sent whole, as k rows of dim 0
    if not srcs or rows.numel() == 0:
        return torch.zeros_like(x)
    sending, receiving = me in srcs, me in dsts
    sends, recvs = [0] * comm.n, [0] * comm.n  # rows to / from each member
    if sending:
        sends[dsts[srcs.index(me)]] = rows.shape[0]
    if receiving:
        recvs[srcs[dsts.index(me)]] = rows.shape[0]
    # [k, ...] from my source, or nothing
    got = comm.all_to_all_rows("ppermute", rows if sending else rows[:0], recvs, sends)
    if not receiving:
        return torch.zeros_like(x)  # non-destinations: 0
    return got if x.dim() else got.reshape(())


def _ppermute_bwd(
    ops: Any, spec: GroupSpec, g: Tensor, saved: Any, *, perm: Sequence[int]
) -> tuple[Any, ...]:
    inverse = tuple(v for s, d in zip(perm[0::2], perm[1::2]) for v in (d, s))
    return (ops.ppermute(g, spec=spec, perm=inverse),)


ppermute_p = Primitive(
    "ppermute",
    params=(("perm", "int[]"),),
    shape=_same,
    stacked=_ppermute_stacked,
    distributed=_ppermute_dist,
    backward=_ppermute_bwd,
    replication=("V", "V"),
)


@_names_this_rank
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
    x, spec = _enter("ppermute", x, mesh, axis)
    return _apply(ppermute_p, mesh, x, spec, perm=_check_perm(axis, perm, spec.n))


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
    flat = tuple(v for p in pairs for v in p)  # (src0, dst0, src1, dst1, ...)
    for i, v in enumerate(flat):
        if type(v) is not int or not 0 <= v < n:
            _index("ppermute", axis, ("src", "dst")[i % 2], v, n)
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


@_names_this_rank
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
    if isinstance(shift, bool) or not isinstance(shift, int):
        raise CollectiveError(
            "ring_shift", axis, f"shift={shift!r} is not an int", "pass an int such as 1 or -1"
        )
    x, spec = _enter("ring_shift", x, mesh, axis)
    n = spec.n
    # (src0, dst0, ...): a permutation by construction
    perm = tuple([v for i in range(n) for v in (i, (i + shift) % n)])
    return _apply(ppermute_p, mesh, x, spec, perm=perm)


# ====================================================================== broadcast
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


def _keep_src_stacked(spec: GroupSpec, x: Tensor, *, src: int) -> Tensor:
    y = spec.to_groups(x)  # [G, n, *s]
    return spec.from_groups(_where_member(spec, y, spec.member_index(y.device) == src))


def _keep_src_dist(comm: AxisComm, x: Tensor, *, src: int) -> Tensor:
    return x.clone() if comm.index == src else torch.zeros_like(x)


broadcast_p = Primitive(
    "broadcast",
    params=(("src", "int"),),
    shape=_same,
    stacked=_broadcast_stacked,
    distributed=_broadcast_dist,
    backward=_broadcast_bwd,
    replication=("V", "I"),
)
# Internal: keep x on member src, zero elsewhere (self-adjoint: its backward is itself).
keep_src_p = Primitive(
    "keep_src",
    params=(("src", "int"),),
    shape=_same,
    stacked=_keep_src_stacked,
    distributed=_keep_src_dist,
    backward=_broadcast_bwd,
)


@_names_this_rank
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
    x, spec = _enter("broadcast", x, mesh, axis)
    return _apply(broadcast_p, mesh, x, spec, src=_index("broadcast", axis, "src", src, spec.n))


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
    if not isinstance(mesh, Mesh):
        raise CollectiveError(
            "axis_index",
            axis,
            f"mesh must be a fastdist.Mesh, got {type(mesh).__name__}",
            "pass the Mesh the code runs on",
        )
    idx = mesh.axis_indices(axis, "fastdist.axis_index")
    if is_real(mesh):
        index = torch.tensor(mesh._comm.axis(idx).index)
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
    if not isinstance(mesh, Mesh):
        raise CollectiveError(
            "axis_size",
            axis,
            f"mesh must be a fastdist.Mesh, got {type(mesh).__name__}",
            "pass the Mesh the code runs on",
        )
    return mesh.axis_size(axis)
