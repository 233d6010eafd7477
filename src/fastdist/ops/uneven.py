"""Uneven and ragged collectives: one block per primitive, as in ``collectives.py``.

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

Offsets are never passed in: rows are packed by destination on the sender and by source on
the receiver, in axis order (JAX's receiver-side ``output_offsets`` are a known trap).

All ragged rows live along dim 0 of the primitives; the public functions take ``dim`` and
move it there.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from fastdist.core.context import is_real
from fastdist.core.mesh import AxisName, Mesh
from fastdist.core.primitive import GroupSpec, Primitive
from fastdist.core.rows import pad_rows
from fastdist.errors import CollectiveError, NoBackendError
from fastdist.ops.gathers import all_gather
from fastdist.ops.prelude import (
    apply_primitive,
    check_index,
    enter,
    like,
    names_this_rank,
    need_reducible,
    norm_dim,
    real_view,
)

if TYPE_CHECKING:
    from fastdist.core.comm import AxisComm

__all__ = [
    "all_gather_v",
    "reduce_scatter_v",
    "gather_v",
    "scatter_v",
    "ragged_all_to_all",
    "indexed_all_to_all_v",
    "exchange_sizes",
]


# ====================================================================== shared helpers
def _out_rows(capacity: int, exact: int) -> int:
    return capacity if capacity >= 0 else exact


def _capacity_or_uniform(capacity: int, sizes: Sequence[int]) -> int:
    """Rows of a ragged output shared by all ranks: ``capacity``, or the common size when sizes are
    equal."""
    if capacity >= 0:
        return capacity
    if len(set(sizes)) != 1:
        raise NoBackendError(
            "fastdist: a ragged output without capacity has a rank-dependent shape; pass "
            "capacity=max(sizes)"
        )
    return int(sizes[0])


def _check_sizes(op: str, axis: AxisName, sizes: Any, n: int) -> list[int]:
    """``sizes`` as ``n`` Python ints >= 0; raises naming the op, the axis and the first bad entry.

    Each entry may be a Python int, a numpy integer or a 0-d integer tensor (a 1-D integer
    tensor counts as its entries). A bool, a float (even ``2.0``), a complex or a negative
    number is refused: rows are never rounded or truncated silently.
    """
    if isinstance(sizes, Tensor) and (
        sizes.dim() != 1 or torch._C._functorch.is_batchedtensor(sizes)
    ):
        raise CollectiveError(
            op,
            axis,
            "sizes must be the same list of ints on every rank",
            "use exchange_sizes(...).tolist() on real ranks, or ragged_all_to_all for "
            "data-dependent sizes",
        )
    if isinstance(sizes, (str, bytes)):
        raise CollectiveError(
            op,
            axis,
            f"sizes={sizes!r} is not a list of ints",
            f"pass {n} row counts, one per rank along the axis",
        )
    try:
        entries = list(sizes)
    except TypeError:
        raise CollectiveError(
            op,
            axis,
            f"sizes={sizes!r} is not a list of ints",
            f"pass {n} row counts, one per rank along the axis",
        ) from None
    out = [_row_count(op, axis, f"sizes[{i}]", s) for i, s in enumerate(entries)]
    if len(out) != n:
        raise CollectiveError(
            op,
            axis,
            f"sizes has {len(out)} entries but the axis has {n} ranks",
            f"pass {n} row counts, one per rank along the axis",
        )
    return out


def _row_count(op: str, axis: AxisName, what: str, value: Any) -> int:
    """One row count: a Python int, a numpy integer or a 0-d integer tensor, >= 0 (never a bool or
    a float, even a whole one)."""
    count: int | None = None
    if type(value) is int:  # the usual case, first (and plain for dynamo)
        count, kind = value, "int"
    elif isinstance(value, Tensor):
        if torch._C._functorch.is_batchedtensor(value):
            raise CollectiveError(
                op,
                axis,
                f"{what} differs per rank (a per-rank tensor)",
                "pass the same Python ints on every rank, or use ragged_all_to_all for "
                "data-dependent sizes",
            )
        if value.dim() == 0 and not (
            value.is_floating_point() or value.is_complex() or value.dtype == torch.bool
        ):
            count = int(value.item())
        kind = f"a {value.dim()}-d {value.dtype} tensor"
    elif isinstance(value, torch.SymInt):
        count = int(value)
        kind = "SymInt"
    elif isinstance(value, bool) or (
        not torch.compiler.is_compiling()
        and getattr(getattr(value, "dtype", None), "kind", "") == "b"
    ):
        # Python or numpy (numpy 1.x lets np.bool_ pass operator.index); dynamo cannot read a numpy
        # dtype
        kind = "bool"
    else:
        try:
            # int, numpy integers: yes; float (even 2.0), complex, str: TypeError
            count = operator.index(value)
        except TypeError:
            pass
        kind = type(value).__name__
    if count is None:
        raise CollectiveError(
            op,
            axis,
            f"{what} = {value!r} is {kind if kind.startswith('a ') else 'a ' + kind}, not an "
            "integer row count",
            "pass Python ints (numpy ints and 0-d integer tensors also do); round explicitly "
            "(int(round(s))) if you computed them as floats",
        )
    if count < 0:
        raise CollectiveError(op, axis, f"{what} = {count} is negative", "row counts are >= 0")
    return count


def _check_capacity(op: str, axis: AxisName, capacity: int | None, need: int, what: str) -> int:
    if capacity is None:
        return -1
    capacity = _row_count(op, axis, "capacity", capacity)  # an int (numpy and 0-d ones too)
    if capacity < need:
        raise CollectiveError(
            op,
            axis,
            f"capacity={capacity!r} cannot hold {what} ({need} rows)",
            f"use capacity >= {need}",
        )
    return capacity


def _local_rows(
    op: str, axis: AxisName, x: Tensor, sizes: Sequence[int], simulated: bool, index: int | None
) -> None:
    """Every rank's input must hold at least its own rows (more are padding)."""
    need, who = (
        (max(sizes), "max(sizes) (simulated ranks share one shape)")
        if simulated
        else (sizes[cast(int, index)], f"sizes[{index}]")
    )
    if x.shape[0] < need:
        raise CollectiveError(
            op,
            axis,
            f"the local shard has {x.shape[0]} rows along the ragged dim but {who} = {need}",
            f"pass at least {need} rows (rows past the size are ignored)",
            rank="every rank" if simulated else f"rank index {index}",
        )


# ====================================================================== all_gather_v /
# reduce_scatter_v
def _agv_shape(
    n: int, s: tuple[Any, ...], *, sizes: Sequence[int], accumulate_fp32: bool
) -> tuple[Any, ...]:
    return (sum(sizes), *s[1:])


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
    return (_capacity_or_uniform(capacity, sizes), *s[1:])


def _rsv_stacked(spec: GroupSpec, x: Tensor, *, sizes: Sequence[int], capacity: int) -> Tensor:
    total = spec.to_groups(x).sum(1, dtype=x.dtype)  # [G, sum, *f]
    rows = _capacity_or_uniform(capacity, sizes)
    # n x [G, rows, *f]
    chunks = [pad_rows(t, rows, dim=1) for t in torch.split(total, list(sizes), dim=1)]
    return spec.from_groups(torch.stack(chunks, dim=1))  # member i keeps chunk i


def _rsv_dist(comm: AxisComm, x: Tensor, *, sizes: Sequence[int], capacity: int) -> Tensor:
    mine = like(
        comm.reduce_scatter_v_rows("reduce_scatter_v", real_view(x[: sum(sizes)]), sizes), x
    )  # [sizes[me], *f]
    return pad_rows(mine, _out_rows(capacity, sizes[comm.index]))


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
    sz = _check_sizes("all_gather_v", axis, sizes, spec.n)
    xm = x.movedim(d, 0)
    _local_rows(
        "all_gather_v",
        axis,
        xm,
        sz,
        spec.comm is None,
        None if spec.comm is None else spec.comm.index,
    )
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
    sz = _check_sizes("reduce_scatter_v", axis, sizes, spec.n)
    if x.shape[d] != sum(sz):
        raise CollectiveError(
            "reduce_scatter_v",
            axis,
            f"dim {d} has {x.shape[d]} rows but sizes sum to {sum(sz)}",
            "pass sizes that sum to the dim's length",
        )
    cap = _check_capacity("reduce_scatter_v", axis, capacity, max(sz), "the largest chunk")
    _need_static_shape("reduce_scatter_v", axis, spec, cap, sz)
    return apply_primitive(
        reduce_scatter_v_p, mesh, x.movedim(d, 0), spec, sizes=tuple(sz), capacity=cap
    ).movedim(0, d)


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
    return (_out_rows(capacity, sum(sizes)), *s[1:])


def _gv_stacked(
    spec: GroupSpec, x: Tensor, *, sizes: Sequence[int], dst: int, capacity: int
) -> Tensor:
    y = spec.to_groups(x)  # [G, n, C, *f]
    whole = torch.cat([y[:, i, : sizes[i]] for i in range(spec.n)], dim=1)  # [G, sum, *f]
    rows = _out_rows(capacity, sum(sizes))
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
    return (_capacity_or_uniform(capacity, sizes), *s[1:])


def _sv_stacked(
    spec: GroupSpec, x: Tensor, *, sizes: Sequence[int], src: int, capacity: int
) -> Tensor:
    whole = spec.to_groups(x)[:, src, : sum(sizes)]  # [G, sum, *f]: the source's tensor
    rows = _capacity_or_uniform(capacity, sizes)
    chunks = [pad_rows(t, rows, dim=1) for t in torch.split(whole, list(sizes), dim=1)]
    return spec.from_groups(torch.stack(chunks, dim=1))  # [G, n, rows, *f]: member i gets chunk i


def _sv_dist(comm: AxisComm, x: Tensor, *, sizes: Sequence[int], src: int, capacity: int) -> Tensor:
    me = comm.index
    sends = list(sizes) if me == src else [0] * comm.n
    recvs = [sizes[me] if i == src else 0 for i in range(comm.n)]
    got = comm.all_to_all_rows("scatter_v", x[: sum(sends)], recvs, sends)  # [sizes[me], *f]
    return pad_rows(got, _out_rows(capacity, sizes[me]))


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
    sz = _check_sizes("gather_v", axis, sizes, spec.n)
    check_index("gather_v", axis, "dst", dst, spec.n)
    xm = x.movedim(d, 0)
    _local_rows(
        "gather_v", axis, xm, sz, spec.comm is None, None if spec.comm is None else spec.comm.index
    )
    cap = _check_capacity("gather_v", axis, capacity, sum(sz), "the gathered rows")
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
    sz = _check_sizes("scatter_v", axis, sizes, spec.n)
    check_index("scatter_v", axis, "src", src, spec.n)
    if x.shape[d] != sum(sz):
        raise CollectiveError(
            "scatter_v",
            axis,
            f"dim {d} has {x.shape[d]} rows but sizes sum to {sum(sz)}",
            "pass sizes that sum to the dim's length",
        )
    cap = _check_capacity("scatter_v", axis, capacity, max(sz), "the largest chunk")
    _need_static_shape("scatter_v", axis, spec, cap, sz)
    return apply_primitive(
        scatter_v_p, mesh, x.movedim(d, 0), spec, sizes=tuple(sz), src=src, capacity=cap
    ).movedim(0, d)


# ====================================================================== ragged_all_to_all
# (data-dependent sizes)
def _ragged_a2a_shape(
    n: int, s: tuple[Any, ...], ss: tuple[Any, ...], rs: tuple[Any, ...], *, capacity: int
) -> tuple[Any, ...]:
    return (capacity, *s[1:])


def _ragged_a2a_check(
    send: Tensor,
    recv: Tensor,
    rows: int | Tensor,
    capacity: int | Tensor,
    ranks: Any,
    axis: AxisName | None = None,
) -> None:
    """Data-dependent checks, on real (stacked or local) size tensors: raise naming the rank.

    ``rows`` and ``capacity`` are one int for every rank, or a tensor with one per rank.
    """
    rows_t, cap_t = (
        torch.as_tensor(rows, device=send.device),
        torch.as_tensor(capacity, device=send.device),
    )

    def at(t: Tensor, i: int) -> int:  # rank i's value of a per-rank (or shared) number
        return int(t.reshape(-1)[i if t.dim() else 0])

    checks: list[tuple[Callable[[int], str], Tensor, str]] = [
        (lambda i: "negative send sizes", (send < 0).any(-1), "row counts are >= 0"),
        (
            lambda i: f"send sizes summing past the {at(rows_t, i)} rows of its input",
            send.sum(-1) > rows_t,
            "the rows to send must fit in x",
        ),
        (
            lambda i: f"more rows arriving than capacity={at(cap_t, i)}",
            recv.sum(-1) > cap_t,
            "raise capacity (the most any rank can receive)",
        ),
    ]
    for what, bad, fix in checks:
        if bool(bad.any()):
            i = int(bad.nonzero()[0].item()) if bad.dim() else 0
            where = ranks(i)
            raise CollectiveError(
                "ragged_all_to_all", axis, f"{where} has {what(i)}", fix, rank=where
            )


def _ragged_a2a_stacked(
    spec: GroupSpec, x: Tensor, send: Tensor, recv: Tensor, *, capacity: int
) -> Tensor:
    _ragged_a2a_check(send, recv, x.shape[1], capacity, lambda r: f"rank {r}")
    X = spec.to_groups(x)  # [G, i, C, *f]
    S = spec.to_groups(send)  # [G, i, j]: rows sender i sends to receiver j
    G, n, C = X.shape[0], spec.n, X.shape[2]
    if C == 0:  # nothing to send anywhere: every buffer is zeros
        return spec.from_groups(x.new_zeros(G, n, capacity, *X.shape[3:]))
    send_off = S.cumsum(-1) - S  # [G, i, j]: where i's rows for j start in i's input
    R = S.transpose(1, 2)  # [G, j, i]: rows j receives from i
    incl = R.cumsum(-1)  # [G, j, i]
    t = torch.arange(capacity, device=x.device)  # receive-buffer row
    # [G, j, cap]: the source that fills row t
    src = (incl.unsqueeze(-1) <= t).sum(-2).clamp(max=n - 1)
    valid = t < incl[..., -1:]  # [G, j, cap]
    # [G, j, cap]: first row of that source's block in j's buffer
    start = (incl - R).gather(-1, src)
    # [G, j, cap]: where that block starts in the source's input
    off = send_off.transpose(1, 2).gather(-1, src)
    row = torch.where(valid, off + t - start, 0).clamp(0, C - 1)
    flat = X.reshape(G, n * C, *X.shape[3:])  # [G, i*C, *f]
    idx = (src * C + row).reshape(G, -1)  # [G, j*cap]
    picked = flat[torch.arange(G, device=x.device).unsqueeze(1), idx].reshape(
        G, n, capacity, *X.shape[3:]
    )
    mask = valid.reshape(G, n, capacity, *([1] * (X.dim() - 3)))
    return spec.from_groups(
        torch.where(mask, picked, torch.zeros((), dtype=x.dtype, device=x.device))
    )


def _ragged_a2a_dist(
    comm: AxisComm, x: Tensor, send: Tensor, recv: Tensor, *, capacity: int
) -> Tensor:
    _ragged_a2a_check(send, recv, x.shape[0], capacity, lambda r: f"rank {comm.rank}", comm.label)
    s, r = send.tolist(), recv.tolist()  # split sizes to the host (one sync)
    got = comm.all_to_all_rows("ragged_all_to_all", x[: sum(s)], r, s)  # [sum(recv), *f], by source
    return pad_rows(got, capacity)


def _ragged_a2a_bwd(
    ops: Any, spec: GroupSpec, g: Tensor, saved: Any, *, capacity: int
) -> tuple[Any, ...]:
    x, send, recv, _ = saved
    return (
        ops.ragged_all_to_all(g, recv, send, spec=spec, capacity=ops.local_shape(x)[0]),
        None,
        None,
    )


ragged_all_to_all_p = Primitive(
    "ragged_all_to_all",
    inputs=("x", "send_sizes", "recv_sizes"),
    params=(("capacity", "int"),),
    shape=_ragged_a2a_shape,
    stacked=_ragged_a2a_stacked,
    distributed=_ragged_a2a_dist,
    backward=_ragged_a2a_bwd,
    saves=True,
    replication=("V", "V"),
)


@names_this_rank
def ragged_all_to_all(
    x: Tensor, mesh: Mesh, axis: AxisName, send_sizes: Tensor, *, capacity: int
) -> tuple[Tensor, Tensor]:
    """Exchange data-dependent numbers of rows: send ``send_sizes[j]`` rows to the rank with index
    ``j``.

    ``x``'s rows are packed by destination (first ``send_sizes[0]`` rows for index 0, then
    index 1, ...); rows past ``send_sizes.sum()`` are padding. Returns ``(out, recv_sizes)``:
    ``out`` has ``capacity`` rows, packed by source in axis order, zeros after
    ``recv_sizes.sum()``; ``recv_sizes[i]`` rows came from index ``i``. Shape: ``capacity``
    rows. Gradient: the same exchange backwards (send and receive sizes swapped).
    On real ranks the sizes are read to the host once per call.

    Args:
        x: this rank's rows, packed by destination; rows past ``send_sizes.sum()`` are padding.
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).
        send_sizes: this rank's int64 row counts per destination, ``send_sizes[j]`` rows for index
            ``j``.
        capacity: the rows of ``out`` (at least the most rows any rank receives).

    Returns:
        ``(out, recv_sizes)``: ``out`` has ``capacity`` rows packed by source in axis order, zeros
        after ``recv_sizes.sum()``; ``recv_sizes[i]`` rows came from index ``i``.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"ep": 2})
    >>> x = torch.tensor([[10., 11., 12.], [20., 21., 0.]])  # rank 0: 3 rows, rank 1: 2 (+1 pad)
    >>> sizes = torch.tensor([[1, 2], [2, 0]])  # rank 0 sends 1 row to 0, 2 to 1; rank 1: 2 to 0
    >>> a2a = lambda x, s: fd.ragged_all_to_all(x, mesh, "ep", s, capacity=3)
    >>> out, got = fd.simulate(a2a, mesh)(x, sizes)
    >>> out, got
    (tensor([[10., 20., 21.],
            [11., 12.,  0.]]), tensor([[1, 2],
            [2, 0]]))
    """
    x, spec = enter("ragged_all_to_all", x, mesh, axis)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise CollectiveError(
            "ragged_all_to_all",
            axis,
            f"capacity={capacity!r} is not a row count",
            "pass the most rows any rank can receive",
        )
    if x.dim() == 0:
        raise CollectiveError(
            "ragged_all_to_all", axis, "x is 0-d; rows are dim 0", "pass a tensor of rows"
        )
    send = torch.as_tensor(send_sizes)
    if send.is_floating_point() or send.is_complex() or send.dtype == torch.bool:
        raise CollectiveError(
            "ragged_all_to_all",
            axis,
            f"send_sizes has dtype {send.dtype}, but row counts are integers (they are never "
            "truncated)",
            "pass an integer tensor, e.g. F.one_hot(expert, n).sum(0), or round explicitly "
            "(.round().long())",
        )
    send = send.to(torch.long)
    if send.shape != (spec.n,):
        raise CollectiveError(
            "ragged_all_to_all",
            axis,
            f"send_sizes has shape {tuple(send.shape)}, not ({spec.n},)",
            f"pass one row count per rank along the axis ({spec.n})",
        )
    if spec.comm is not None:
        recv = _exchange_checked_sizes(x, mesh, axis, send, capacity, spec.comm)
        return apply_primitive(
            ragged_all_to_all_p, mesh, x, spec, send, recv, capacity=capacity
        ), recv
    recv = all_to_all_sizes(send, mesh, axis)
    try:
        return apply_primitive(
            ragged_all_to_all_p, mesh, x, spec, send, recv, capacity=capacity
        ), recv
    except CollectiveError as e:
        # the stacked rule found a bad size; it knows the group, not the axis's name
        if e.op == "ragged_all_to_all" and e.axis is None:
            e.readdress(axis=axis)
        raise


def _exchange_checked_sizes(
    x: Tensor, mesh: Mesh, axis: AxisName, send: Tensor, capacity: int, comm: AxisComm
) -> Tensor:
    """Real ranks: this rank's receive sizes, after every rank checked every rank's sizes.

    One small all-gather of each rank's send sizes, row count and capacity (in place of the
    all-to-all of the send sizes): a bad size on one rank then raises the same error on every
    rank of the group at once, naming that rank, and no rank is left waiting in the exchange.
    """
    mine = torch.cat(
        [send, torch.tensor([x.shape[0], capacity], dtype=torch.long, device=send.device)]
    )  # [n + 2]
    table = all_gather(mine.reshape(1, -1), mesh, axis, dim=0)  # [n, n + 2]: row i from index i
    sends = table[:, : comm.n]  # [n, n]: rows index i sends to index j
    _ragged_a2a_check(
        sends,
        sends.t(),
        table[:, comm.n],
        table[:, comm.n + 1],
        lambda i: f"rank {comm.ranks[i]}",
        comm.label,
    )
    return sends[:, comm.index].contiguous()  # recv[i] = what index i sends to this rank


@names_this_rank
def all_to_all_sizes(send: Tensor, mesh: Mesh, axis: AxisName) -> Tensor:
    """``recv[i] = send_of_rank_i[me]``: the transpose of the send-size matrix (one small
    all-to-all)."""
    from fastdist.ops import all_to_all

    return all_to_all(send.reshape(-1, 1), mesh, axis, split_dim=0, concat_dim=0).reshape(-1)


_INDEX_DTYPES = (torch.int64, torch.int32)


@names_this_rank
def indexed_all_to_all_v(
    x: Tensor,
    mesh: Mesh,
    axis: AxisName,
    index: Tensor,
    send_sizes: Tensor,
    *,
    capacity: int,
    accumulate_fp32: bool = False,
) -> tuple[Tensor, Tensor]:
    """Gather rows ``x[index]`` (packed by destination, counts ``send_sizes``) and exchange them.

    The MoE dispatch: ``index`` orders this rank's tokens by destination expert rank. Returns
    ``(out, recv_sizes)`` as :func:`ragged_all_to_all`. Gradient: the reverse exchange, then
    ``index_add`` back into ``x``'s rows (in float32 for bf16/fp16 when ``accumulate_fp32``).

    Args:
        x: this rank's rows (tokens).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).
        index: the rows of ``x`` to send, ordered by destination (``x[index]`` is packed as
            ``send_sizes`` says).
        send_sizes: this rank's int64 row counts per destination, ``send_sizes[j]`` rows for index
            ``j``.
        capacity: the rows of ``out`` (at least the most rows any rank receives).
        accumulate_fp32: sum the gradient in float32 for bfloat16 / float16 inputs.

    Returns:
        ``(out, recv_sizes)``, as :func:`ragged_all_to_all`.
    """
    op = "indexed_all_to_all_v"
    if not isinstance(x, Tensor) or x.dim() == 0:
        got = "a 0-d tensor" if isinstance(x, Tensor) else type(x).__name__
        raise CollectiveError(
            op, axis, f"x must be a tensor of rows, got {got}", "pass a tensor with rows on dim 0"
        )
    # index_select takes int64 and int32 indices only
    if not isinstance(index, Tensor) or index.dim() != 1 or index.dtype not in _INDEX_DTYPES:
        got = (
            f"shape {tuple(index.shape)}, dtype {index.dtype}"
            if isinstance(index, Tensor)
            else type(index).__name__
        )
        raise CollectiveError(
            op,
            axis,
            f"index must be a 1-d integer tensor of row numbers, got {got}",
            "pass an int64 (or int32) tensor, e.g. torch.argsort(destination)",
        )
    # real ranks, host values only (no device sync; simulated ranks hold a batched index, and
    # index_select raises on a bad one there)
    if (
        is_real(mesh)
        and index.device.type == "cpu"
        and index.numel()
        and not torch.compiler.is_compiling()
    ):
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= x.shape[0]:
            rows = f"rows 0..{x.shape[0] - 1}" if x.shape[0] else "no rows: x has none"
            raise CollectiveError(
                op,
                axis,
                f"index holds {lo if lo < 0 else hi}, outside the {x.shape[0]} rows of x",
                f"index {rows}",
            )
    src = x.float() if accumulate_fp32 and x.dtype in (torch.bfloat16, torch.float16) else x
    try:
        out, recv = ragged_all_to_all(
            src.index_select(0, index), mesh, axis, send_sizes, capacity=capacity
        )
    except CollectiveError as e:  # its exchange's checks: name the op the caller called
        if e.op == "ragged_all_to_all":
            # the exchange's input is x[index]: its rows are the ones index selects
            e.readdress(op=op, problem=e.problem.replace("of its input", "index selects"))
        raise
    return out.to(x.dtype), recv


@names_this_rank
def exchange_sizes(local_size: int | Tensor, mesh: Mesh, axis: AxisName) -> Tensor:
    """Every rank's row count along ``axis`` (an int64 tensor, axis order), from each rank's own
    count.

    One small all-gather. On real ranks call ``.tolist()`` for the static-size ops; on
    simulated ranks the result is per-rank data (use it with ``ragged_all_to_all``).

    Args:
        local_size: this rank's row count (an int, or a 0-d integer tensor).
        mesh: the mesh the code runs on (simulated or real ranks).
        axis: the mesh axis whose ranks form the group, or a tuple of axes taken as one flattened
            axis (row-major).

    Returns:
        every rank's row count along ``axis``, an int64 tensor in axis order.
    """
    if isinstance(local_size, Tensor):
        if (
            local_size.is_floating_point()
            or local_size.is_complex()
            or local_size.dtype == torch.bool
        ):
            raise CollectiveError(
                "exchange_sizes",
                axis,
                f"local_size has dtype {local_size.dtype}, but a row count is an integer",
                "pass an int or an integer tensor",
            )
        t = local_size.to(torch.long).reshape(1)
    else:
        t = torch.tensor(
            [_row_count("exchange_sizes", axis, "local_size", local_size)], dtype=torch.long
        )
    return all_gather(t, mesh, axis, dim=0)
