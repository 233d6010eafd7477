"""Gathers and scatters: ``all_gather``, ``all_gather_invariant``, ``local_chunk``,
``psum_scatter``, ``all_to_all``, ``all_to_all_4d`` (one block each; conventions in
``fastdist.ops``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from fastdist.core.mesh import AxisName, Mesh
from fastdist.core.primitive import GroupSpec, Primitive
from fastdist.errors import CollectiveError

if TYPE_CHECKING:
    from fastdist.core.comm import AxisComm
from fastdist.ops.prelude import (
    apply_primitive,
    enter,
    flag,
    like,
    moves_bits,
    names_this_rank,
    need_divisible,
    need_reducible,
    norm_dim,
    real_view,
)

__all__ = [
    "all_gather",
    "all_gather_invariant",
    "local_chunk",
    "psum_scatter",
    "all_to_all",
    "all_to_all_4d",
]


# ====================================================================== all_gather
def _all_gather_shape(n: int, s: tuple[Any, ...], *, dim: int, tiled: bool) -> tuple[Any, ...]:
    return (*s[:dim], s[dim] * n, *s[dim + 1 :]) if tiled else (*s[:dim], n, *s[dim:])


@moves_bits
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
    jvp="linear",
    dim_params=("dim",),
    replication=("V", "V"),
)


@names_this_rank
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
    x, spec = enter("all_gather", x, mesh, axis)
    if tiled is not True and tiled is not False:
        flag("all_gather", axis, "tiled", tiled)  # raises: not a bool
    d = norm_dim("all_gather", axis, "dim", dim, x.dim() if tiled else x.dim() + 1)
    return apply_primitive(all_gather_p, mesh, x, spec, dim=d, tiled=tiled)


# ====================================================================== all_gather_invariant /
# local_chunk
def _all_gather_invariant_bwd(
    ops: Any, spec: GroupSpec, g: Tensor, saved: Any, *, dim: int
) -> tuple[Any, ...]:
    return (ops.local_chunk(g, spec=spec, dim=dim),)


def _local_chunk_shape(n: int, s: tuple[Any, ...], *, dim: int) -> tuple[Any, ...]:
    return (*s[:dim], s[dim] // n, *s[dim + 1 :])


@moves_bits
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
    jvp="linear",
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
    jvp="linear",
    dim_params=("dim",),
    replication=("I", "V"),
)


@names_this_rank
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
    x, spec = enter("all_gather_invariant", x, mesh, axis)
    d = norm_dim("all_gather_invariant", axis, "dim", dim, x.dim())
    return apply_primitive(all_gather_invariant_p, mesh, x, spec, dim=d)


@names_this_rank
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
    x, spec = enter("local_chunk", x, mesh, axis)
    d = norm_dim("local_chunk", axis, "dim", dim, x.dim())
    need_divisible("local_chunk", axis, x, d, spec.n, "use a dim whose size divides")
    return apply_primitive(local_chunk_p, mesh, x, spec, dim=d)


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
        return like(_psum_scatter_dist(comm, real_view(x), dim=dim, tiled=tiled), x)
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
    jvp="linear",
    dim_params=("dim",),
    replication=("VP", "V"),
    reduces="sum",
)


@names_this_rank
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
    x, spec = enter("psum_scatter", x, mesh, axis)
    need_reducible(psum_scatter_p, axis, x)
    if tiled is not True and tiled is not False:
        flag("psum_scatter", axis, "tiled", tiled)  # raises: not a bool
    d = norm_dim("psum_scatter", axis, "dim", dim, x.dim())
    if tiled:
        if x.shape[d] % spec.n:  # raises below
            need_divisible(
                "psum_scatter", axis, x, d, spec.n, "use reduce_scatter_v for uneven chunks"
            )
    elif x.shape[d] != spec.n:
        raise CollectiveError(
            "psum_scatter",
            axis,
            f"tiled=False needs dim {d} of size {spec.n} (the axis size), got {x.shape[d]}",
            "use tiled=True to split the dim into n chunks",
        )
    return apply_primitive(psum_scatter_p, mesh, x, spec, dim=d, tiled=tiled)


# ====================================================================== all_to_all
def _all_to_all_shape(
    n: int, s: tuple[Any, ...], *, split_dim: int, concat_dim: int
) -> tuple[Any, ...]:
    out = list(s)
    out[split_dim] = out[split_dim] // n
    out[concat_dim] = out[concat_dim] * n
    return tuple(out)


@moves_bits
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
    jvp="linear",
    dim_params=("split_dim", "concat_dim"),
    replication=("V", "V"),
)


@names_this_rank
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
    x, spec = enter("all_to_all", x, mesh, axis)
    s = norm_dim("all_to_all", axis, "split_dim", split_dim, x.dim())
    c = norm_dim("all_to_all", axis, "concat_dim", concat_dim, x.dim())
    if x.shape[s] % spec.n:  # raises below
        need_divisible("all_to_all", axis, x, s, spec.n, "use a split_dim whose size divides")
    return apply_primitive(all_to_all_p, mesh, x, spec, split_dim=s, concat_dim=c)


@names_this_rank
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
