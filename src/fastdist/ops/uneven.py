"""Uneven collectives: one block per primitive, as in the other op modules (ragged ones in
``fastdist.ops.ragged``).

Two kinds of sizes, for two situations:

* **Static sizes** (``all_gather_v``, ``reduce_scatter_v``, ``gather_v``, ``scatter_v``): a list of
  Python ints, the same on every rank (``sizes[i]`` rows belong to the rank with index ``i``
  along the axis). Shapes are known ahead, so these also compile.
* **Data-dependent sizes** (``ragged_all_to_all``, ``indexed_all_to_all_v``, for MoE dispatch):
  int tensors computed on each rank (e.g. from a router), with a static ``capacity`` for the
  receive buffer, like JAX's ragged ops.

How ragged shards are held, on every backend alike: a rank's input may have **more** rows
than its size; the rows past ``sizes[rank]`` are padding and ignored. A ragged output has
exactly this rank's rows by default (natural on real ranks, one rank per process), or, with
``capacity=C``, a buffer of ``C`` rows whose valid rows come first and the rest are zeros.
Simulated ranks share one shape, so there a ragged output needs ``capacity`` unless all sizes
are equal (a clear error says so). Per-rank code that passes ``capacity`` runs unchanged on
both.

Argument checks that depend on one rank's own input (a shard shorter than its size, an operand
of the wrong length) see every rank's on real ranks: each public op gathers the ranks' row counts
first (one small all-gather of host memory, eager only), so a bad shard on one rank raises the
same error on every rank of the group, naming the bad ranks, instead of on that rank alone while
its peers wait in the collective (or pair with its next call).

Offsets are never passed in: rows are packed by destination on the sender and by source on
the receiver, in axis order (JAX's receiver-side ``output_offsets`` are a known trap).

All ragged rows live along dim 0 of the primitives; the public functions take ``dim`` and
move it there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from fastdist.core.mesh import AxisName, Mesh
from fastdist.core.primitive import GroupSpec, Primitive
from fastdist.core.rows import pad_rows
from fastdist.errors import CollectiveError
from fastdist.ops.prelude import (
    apply_primitive,
    capacity_or_uniform,
    check_capacity,
    check_index,
    check_sizes,
    enter,
    like,
    local_rows,
    moves_bits,
    names_this_rank,
    need_reducible,
    norm_dim,
    out_rows,
    real_view,
)

if TYPE_CHECKING:
    from fastdist.core.comm import AxisComm


__all__ = [
    "all_gather_v",
    "reduce_scatter_v",
    "gather_v",
    "scatter_v",
    "gather_counts",
    "check_shard_rows",
]


# ====================================================================== checks every rank agrees on
def gather_counts(op: str, spec: GroupSpec, counts: Sequence[int]) -> list[list[int]] | None:
    """Every member's ``counts`` (Python ints, the same number on each), in axis order, on real
    ranks: one small all-gather of host memory, so that a check of them raises the same error on
    every member instead of on one rank alone (its peers would wait in the collective until the
    timeout, or pair with its next call). ``None`` on simulated ranks (one program checks every
    rank already) and while ``torch.compile`` traces (there each rank checks its own, as before).
    """
    comm = spec.comm
    if comm is None or torch.compiler.is_compiling():
        return None
    if comm.n == 1:
        return [list(counts)]
    mine = torch.tensor([list(counts)], dtype=torch.long)  # [1, k] on the host: no device sync
    return cast("list[list[int]]", comm.all_gather_rows(op, mine).tolist())  # [n, k]


def check_shard_rows(
    op: str, axis: AxisName, spec: GroupSpec, rows: int, need: Callable[[int], int], what: str
) -> list[int] | None:
    """Every rank's input must hold ``need(i)`` rows along the ragged dim (``i``: its index along
    the axis): on real ranks every member checks every member's row count, so a short shard raises
    the same :class:`CollectiveError` on all of them, naming the short ranks. Returns every
    member's row count on real ranks (``None`` on simulated ranks and while compiling, where the
    caller checks as before).

    ``what`` names the requirement in the message, ``{i}`` standing for the index (e.g.
    ``"sizes[{i}]"``)."""
    table = gather_counts(op, spec, [rows])
    if table is None:
        return None
    got = [t[0] for t in table]
    short = [i for i, r in enumerate(got) if r < need(i)]
    if short:
        comm = cast("AxisComm", spec.comm)
        who = "; ".join(
            f"rank {comm.ranks[i]} (index {i}) has {got[i]} but {what.format(i=i)} = {need(i)}"
            for i in short
        )
        raise CollectiveError(
            op,
            axis,
            f"a shard has too few rows along the ragged dim ({who}); every rank of the group "
            "raises this",
            f"pass at least {what.format(i='i')} rows on the rank with index i (rows past them "
            "are ignored)",
        )
    return got


# ====================================================================== all_gather_v /
# reduce_scatter_v
def _agv_shape(
    n: int, s: tuple[Any, ...], *, sizes: Sequence[int], accumulate_fp32: bool
) -> tuple[Any, ...]:
    return (sum(sizes), *s[1:])


@moves_bits
def _agv_stacked(
    spec: GroupSpec, x: Tensor, *, sizes: Sequence[int], accumulate_fp32: bool
) -> Tensor:
    y = spec.to_groups(x)  # [G, n, C, *f]
    whole = torch.cat([y[:, i, : sizes[i]] for i in range(spec.n)], dim=1)  # [G, sum, *f]
    return spec.from_groups(whole.unsqueeze(1).expand(-1, spec.n, *whole.shape[1:]))


def _agv_dist(comm: AxisComm, x: Tensor, *, sizes: Sequence[int], accumulate_fp32: bool) -> Tensor:
    return comm.all_gather_v_rows("all_gather_v", x, sizes)  # [sum, *f]


def _agv_bwd(
    ops: Any, spec: GroupSpec, g: Tensor, saved: Any, *, sizes: Sequence[int], accumulate_fp32: bool
) -> tuple[Any, ...]:
    (x, _) = saved
    acc = g.float() if accumulate_fp32 and g.dtype in (torch.bfloat16, torch.float16) else g
    out = ops.reduce_scatter_v(acc, spec=spec, sizes=tuple(sizes), capacity=ops.local_shape(x)[0])
    return (out.to(g.dtype),)


def _rsv_shape(
    n: int, s: tuple[Any, ...], *, sizes: Sequence[int], capacity: int
) -> tuple[Any, ...]:
    return (capacity_or_uniform(capacity, sizes), *s[1:])


def _rsv_stacked(spec: GroupSpec, x: Tensor, *, sizes: Sequence[int], capacity: int) -> Tensor:
    total = spec.to_groups(x).sum(1, dtype=x.dtype)  # [G, sum, *f]
    rows = capacity_or_uniform(capacity, sizes)
    # n x [G, rows, *f]
    chunks = [pad_rows(t, rows, dim=1) for t in torch.split(total, list(sizes), dim=1)]
    return spec.from_groups(torch.stack(chunks, dim=1))  # member i keeps chunk i


def _rsv_dist(comm: AxisComm, x: Tensor, *, sizes: Sequence[int], capacity: int) -> Tensor:
    mine = like(
        comm.reduce_scatter_v_rows("reduce_scatter_v", real_view(x[: sum(sizes)]), sizes), x
    )  # [sizes[me], *f]
    return pad_rows(mine, out_rows(capacity, sizes[comm.index]))


def _rsv_bwd(
    ops: Any, spec: GroupSpec, g: Tensor, saved: Any, *, sizes: Sequence[int], capacity: int
) -> tuple[Any, ...]:
    return (ops.all_gather_v(g, spec=spec, sizes=tuple(sizes), accumulate_fp32=False),)


all_gather_v_p = Primitive(
    "all_gather_v",
    params=(("sizes", "int[]"), ("accumulate_fp32", "bool")),
    shape=_agv_shape,
    stacked=_agv_stacked,
    distributed=_agv_dist,
    backward=_agv_bwd,
    jvp="linear",
    saves=True,
    replication=("V", "V"),
)
reduce_scatter_v_p = Primitive(
    "reduce_scatter_v",
    params=(("sizes", "int[]"), ("capacity", "int")),
    shape=_rsv_shape,
    stacked=_rsv_stacked,
    distributed=_rsv_dist,
    backward=_rsv_bwd,
    jvp="linear",
    replication=("VP", "V"),
    reduces="sum",
)


@names_this_rank
def all_gather_v(
    x: Tensor,
    mesh: Mesh,
    axis: AxisName,
    sizes: Sequence[int],
    dim: int = 0,
    *,
    accumulate_fp32: bool = False,
) -> Tensor:
    """Concatenate uneven shards: the rank with index ``i`` contributes its first ``sizes[i]`` rows
    of ``dim``.

    Shape: ``dim`` becomes ``sum(sizes)`` on every rank (inputs may carry padding rows past
    their size). Gradient: ``reduce_scatter_v``: each rank gets the sum over ranks of its
    own rows (in float32 for bf16/fp16 inputs when ``accumulate_fp32=True``), padding rows 0.

    Args:
        x: this rank's tensor: its first ``sizes[i]`` rows of ``dim`` are its shard, rows past them
            padding (inside :func:`fastdist.simulate`, each rank's slice of the input).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).
        sizes: the row count of each rank along ``dim``, in axis order (the same list on every
            rank).
        dim: the dim to gather along.
        accumulate_fp32: sum the gradient in float32 for bfloat16 / float16 inputs.

    Returns:
        every rank's valid rows concatenated along ``dim`` in axis order: ``sum(sizes)`` rows, on
        every rank.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 3})
    >>> x = torch.tensor([[1., 0.], [2., 3.], [4., 5.]])  # rank 0: 1 row (+ padding); 1, 2: 2
    >>> fd.simulate(lambda x: fd.all_gather_v(x, mesh, "tp", [1, 2, 2]), mesh)(x)[0]
    tensor([1., 2., 3., 4., 5.])
    """
    x, spec = enter("all_gather_v", x, mesh, axis)
    d = norm_dim("all_gather_v", axis, "dim", dim, x.dim())
    sz = check_sizes("all_gather_v", axis, sizes, spec.n)
    xm = x.movedim(d, 0)
    _own_rows("all_gather_v", axis, spec, xm, sz)
    return apply_primitive(
        all_gather_v_p, mesh, xm, spec, sizes=tuple(sz), accumulate_fp32=bool(accumulate_fp32)
    ).movedim(0, d)


@names_this_rank
def reduce_scatter_v(
    x: Tensor,
    mesh: Mesh,
    axis: AxisName,
    sizes: Sequence[int],
    dim: int = 0,
    *,
    capacity: int | None = None,
) -> Tensor:
    """Sum over the group, then the rank with index ``i`` keeps rows ``sum(sizes[:i]) :
    sum(sizes[:i+1])`` of ``dim``.

    Shape: ``dim`` (which must have ``sum(sizes)`` rows) becomes ``sizes[i]``, or ``capacity``
    rows with zeros after the valid ones. Gradient: ``all_gather_v``.

    Args:
        x: this rank's tensor, ``sum(sizes)`` rows along ``dim``.
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).
        sizes: the row count of each rank along ``dim``, in axis order (the same list on every
            rank).
        dim: the dim to sum and split.
        capacity: if given, every rank's result has this many rows along ``dim``, zeros after the
            valid ones (a static shape).

    Returns:
        this rank's rows of the group's sum: ``sizes[i]`` rows along ``dim`` (``capacity`` with
        padding).
    """
    x, spec = enter("reduce_scatter_v", x, mesh, axis)
    need_reducible(reduce_scatter_v_p, axis, x)
    d = norm_dim("reduce_scatter_v", axis, "dim", dim, x.dim())
    sz = check_sizes("reduce_scatter_v", axis, sizes, spec.n)
    _whole_rows("reduce_scatter_v", axis, spec, x.shape[d], d, sz)
    cap = check_capacity("reduce_scatter_v", axis, capacity, max(sz), "the largest chunk")
    _need_static_shape("reduce_scatter_v", axis, spec, cap, sz)
    return apply_primitive(
        reduce_scatter_v_p, mesh, x.movedim(d, 0), spec, sizes=tuple(sz), capacity=cap
    ).movedim(0, d)


def _own_rows(op: str, axis: AxisName, spec: GroupSpec, xm: Tensor, sizes: Sequence[int]) -> None:
    """The rank with index ``i`` holds at least ``sizes[i]`` rows (real ranks: every member checks
    every member's); simulated ranks share one shape: ``max(sizes)``."""
    if check_shard_rows(op, axis, spec, xm.shape[0], lambda i: sizes[i], "sizes[{i}]") is None:
        simulated = spec.comm is None
        local_rows(op, axis, xm, sizes, simulated, None if simulated else spec.comm.index)  # type: ignore[union-attr]


def _whole_rows(
    op: str, axis: AxisName, spec: GroupSpec, rows: int, d: int, sizes: Sequence[int]
) -> None:
    """Every rank's operand has ``sum(sizes)`` rows along ``d`` (real ranks: every member checks
    every member's, so a wrong one raises on all of them)."""
    table = gather_counts(op, spec, [rows])
    got = [rows] if table is None else [t[0] for t in table]
    bad = [i for i, r in enumerate(got) if r != sum(sizes)]
    if not bad:
        return
    comm = spec.comm
    problem = f"dim {d} has {rows} rows but sizes sum to {sum(sizes)}"
    if comm is not None and table is not None:
        where = ", ".join(f"{got[i]} on rank {comm.ranks[i]} (index {i})" for i in bad)
        problem = (
            f"dim {d} has {where} rows but sizes sum to {sum(sizes)} (every rank of the group "
            "raises this)"
        )
    raise CollectiveError(op, axis, problem, "pass sizes that sum to the dim's length")


def _need_static_shape(
    op: str, axis: AxisName, spec: GroupSpec, capacity: int, sizes: Sequence[int]
) -> None:
    if spec.comm is None and capacity < 0 and len(set(sizes)) > 1:
        raise CollectiveError(
            op,
            axis,
            f"sizes {list(sizes)} differ, so each rank's result has its own length, but simulated "
            "ranks share one shape",
            f"pass capacity={max(sizes)} (results padded with zeros; the same code then runs on "
            "real ranks)",
        )


# ====================================================================== gather_v / scatter_v
def _gv_shape(
    n: int, s: tuple[Any, ...], *, sizes: Sequence[int], dst: int, capacity: int
) -> tuple[Any, ...]:
    return (out_rows(capacity, sum(sizes)), *s[1:])


@moves_bits
def _gv_stacked(
    spec: GroupSpec, x: Tensor, *, sizes: Sequence[int], dst: int, capacity: int
) -> Tensor:
    y = spec.to_groups(x)  # [G, n, C, *f]
    whole = torch.cat([y[:, i, : sizes[i]] for i in range(spec.n)], dim=1)  # [G, sum, *f]
    rows = out_rows(capacity, sum(sizes))
    whole = pad_rows(whole, rows, dim=1)  # [G, rows, *f]
    out = torch.zeros(whole.shape[0], spec.n, *whole.shape[1:], dtype=x.dtype, device=x.device)
    out[:, dst] = whole  # only dst receives; the others get zeros, never uninitialised memory
    return spec.from_groups(out)


def _gv_dist(comm: AxisComm, x: Tensor, *, sizes: Sequence[int], dst: int, capacity: int) -> Tensor:
    me = comm.index
    sends = [sizes[me] if j == dst else 0 for j in range(comm.n)]
    recvs = list(sizes) if me == dst else [0] * comm.n
    # dst: [sum, *f]; others: [0, *f] (empty)
    got = comm.all_to_all_rows("gather_v", x[: sum(sends)], recvs, sends)
    return pad_rows(got, capacity) if capacity >= 0 else got


def _gv_bwd(
    ops: Any,
    spec: GroupSpec,
    g: Tensor,
    saved: Any,
    *,
    sizes: Sequence[int],
    dst: int,
    capacity: int,
) -> tuple[Any, ...]:
    (x, _) = saved
    # g's rows past sum(sizes) (capacity padding) are ignored by scatter_v; non-dst ranks' g is
    # unused
    return (
        ops.scatter_v(g, spec=spec, sizes=tuple(sizes), src=dst, capacity=ops.local_shape(x)[0]),
    )


def _sv_shape(
    n: int, s: tuple[Any, ...], *, sizes: Sequence[int], src: int, capacity: int
) -> tuple[Any, ...]:
    return (capacity_or_uniform(capacity, sizes), *s[1:])


@moves_bits
def _sv_stacked(
    spec: GroupSpec, x: Tensor, *, sizes: Sequence[int], src: int, capacity: int
) -> Tensor:
    whole = spec.to_groups(x)[:, src, : sum(sizes)]  # [G, sum, *f]: the source's tensor
    rows = capacity_or_uniform(capacity, sizes)
    chunks = [pad_rows(t, rows, dim=1) for t in torch.split(whole, list(sizes), dim=1)]
    return spec.from_groups(torch.stack(chunks, dim=1))  # [G, n, rows, *f]: member i gets chunk i


def _sv_dist(comm: AxisComm, x: Tensor, *, sizes: Sequence[int], src: int, capacity: int) -> Tensor:
    me = comm.index
    sends = list(sizes) if me == src else [0] * comm.n
    recvs = [sizes[me] if i == src else 0 for i in range(comm.n)]
    got = comm.all_to_all_rows("scatter_v", x[: sum(sends)], recvs, sends)  # [sizes[me], *f]
    return pad_rows(got, out_rows(capacity, sizes[me]))


def _sv_bwd(
    ops: Any,
    spec: GroupSpec,
    g: Tensor,
    saved: Any,
    *,
    sizes: Sequence[int],
    src: int,
    capacity: int,
) -> tuple[Any, ...]:
    (x, _) = saved
    return (
        ops.gather_v(g, spec=spec, sizes=tuple(sizes), dst=src, capacity=ops.local_shape(x)[0]),
    )


gather_v_p = Primitive(
    "gather_v",
    params=(("sizes", "int[]"), ("dst", "int"), ("capacity", "int")),
    shape=_gv_shape,
    stacked=_gv_stacked,
    distributed=_gv_dist,
    backward=_gv_bwd,
    jvp="linear",
    saves=True,
    replication=("V", "V"),
)
scatter_v_p = Primitive(
    "scatter_v",
    params=(("sizes", "int[]"), ("src", "int"), ("capacity", "int")),
    shape=_sv_shape,
    stacked=_sv_stacked,
    distributed=_sv_dist,
    backward=_sv_bwd,
    jvp="linear",
    saves=True,
    replication=("VI", "V"),
)


@names_this_rank
def gather_v(
    x: Tensor,
    mesh: Mesh,
    axis: AxisName,
    sizes: Sequence[int],
    dst: int,
    dim: int = 0,
    *,
    capacity: int | None = None,
) -> Tensor:
    """Concatenate uneven shards (rank ``i``'s first ``sizes[i]`` rows of ``dim``) on the rank with
    index ``dst`` only.

    Shape: on ``dst``, ``dim`` becomes ``sum(sizes)``; every other rank gets an *empty*
    tensor (0 rows), or with ``capacity`` every rank gets ``capacity`` rows (zeros except the
    gathered rows on ``dst``). Never uninitialised memory. Gradient: ``scatter_v`` from ``dst``.

    Args:
        x: this rank's tensor: its first ``sizes[i]`` rows of ``dim`` are its shard (inside
            :func:`fastdist.simulate`, each rank's slice of the input).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).
        sizes: the row count of each rank along ``dim``, in axis order (the same list on every
            rank).
        dst: the index along ``axis`` of the rank that gets the result.
        dim: the dim to gather along.
        capacity: if given, every rank's result has this many rows along ``dim``, zeros after the
            valid ones (a static shape).

    Returns:
        on ``dst``, the ``sum(sizes)`` gathered rows; elsewhere an empty tensor (or ``capacity``
        rows of zeros).
    """
    x, spec = enter("gather_v", x, mesh, axis)
    d = norm_dim("gather_v", axis, "dim", dim, x.dim())
    sz = check_sizes("gather_v", axis, sizes, spec.n)
    dst = check_index("gather_v", axis, "dst", dst, spec.n)
    xm = x.movedim(d, 0)
    _own_rows("gather_v", axis, spec, xm, sz)
    cap = check_capacity("gather_v", axis, capacity, sum(sz), "the gathered rows")
    if spec.comm is None and cap < 0 and spec.n > 1:
        raise CollectiveError(
            "gather_v",
            axis,
            "only dst gets rows, so the ranks' results differ in length, but simulated ranks "
            "share one shape",
            f"pass capacity={sum(sz)} (non-destination ranks get zeros; the same code then runs "
            "on real ranks)",
        )
    return apply_primitive(
        gather_v_p, mesh, xm, spec, sizes=tuple(sz), dst=dst, capacity=cap
    ).movedim(0, d)


@names_this_rank
def scatter_v(
    x: Tensor,
    mesh: Mesh,
    axis: AxisName,
    sizes: Sequence[int],
    src: int,
    dim: int = 0,
    *,
    capacity: int | None = None,
) -> Tensor:
    """The rank with index ``src`` splits its ``x`` along ``dim`` into chunks of ``sizes``; rank
    ``i`` gets chunk ``i``.

    Every rank passes a tensor of the same shape (``dim`` of ``sum(sizes)`` rows); only
    ``src``'s values are used. Shape: ``sizes[i]`` rows, or ``capacity`` rows (zeros after
    the chunk). Gradient: ``gather_v`` to ``src`` (the other ranks' inputs get zero).

    Args:
        x: ``sum(sizes)`` rows along ``dim``, the same shape on every rank; only ``src``'s values
            are used.
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).
        sizes: the row count of each rank along ``dim``, in axis order (the same list on every
            rank).
        src: the index along ``axis`` of the rank whose ``x`` is split.
        dim: the dim to split.
        capacity: if given, every rank's result has this many rows along ``dim``, zeros after the
            valid ones (a static shape).

    Returns:
        chunk ``i`` of ``src``'s ``x``: ``sizes[i]`` rows along ``dim`` (``capacity`` with padding).
    """
    x, spec = enter("scatter_v", x, mesh, axis)
    d = norm_dim("scatter_v", axis, "dim", dim, x.dim())
    sz = check_sizes("scatter_v", axis, sizes, spec.n)
    src = check_index("scatter_v", axis, "src", src, spec.n)
    _whole_rows("scatter_v", axis, spec, x.shape[d], d, sz)
    cap = check_capacity("scatter_v", axis, capacity, max(sz), "the largest chunk")
    _need_static_shape("scatter_v", axis, spec, cap, sz)
    return apply_primitive(
        scatter_v_p, mesh, x.movedim(d, 0), spec, sizes=tuple(sz), src=src, capacity=cap
    ).movedim(0, d)
