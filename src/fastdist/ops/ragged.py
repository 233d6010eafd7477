"""Ragged collectives with data-dependent sizes (MoE dispatch): ``ragged_all_to_all``,
``indexed_all_to_all_v``, ``exchange_sizes``, one block per primitive. Sizes, capacities and
padding follow the conventions of ``fastdist.ops.uneven``.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fastdist.core.binding import rank_binding
from fastdist.core.context import is_real
from fastdist.core.mesh import AxisName, Mesh
from fastdist.core.primitive import GroupSpec, Primitive
from fastdist.core.rows import pad_rows
from fastdist.core.transforms import without_values
from fastdist.errors import CollectiveError
from fastdist.ops.gathers import all_gather
from fastdist.ops.prelude import (
    apply_primitive,
    as_index,
    bits_carrier,
    enter,
    moves_bits,
    names_this_rank,
    row_count,
)

if TYPE_CHECKING:
    from fastdist.core.comm import AxisComm


__all__ = [
    "ragged_all_to_all",
    "indexed_all_to_all_v",
    "exchange_sizes",
    "all_to_all_sizes",
]


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


@moves_bits
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
    return _ragged(x, mesh, axis, send_sizes, capacity, (0, 0, 0))


def _ragged(
    x: Tensor,
    mesh: Mesh,
    axis: AxisName,
    send_sizes: Tensor,
    capacity: int,
    fault: tuple[int, int, int],
) -> tuple[Tensor, Tensor]:
    """:func:`ragged_all_to_all` past its compile branch; ``fault``: ``(1, entry, rows)`` when
    this rank's ``indexed_all_to_all_v`` index holds ``entry`` outside its ``x``'s ``rows``
    (checked with every rank's sizes on real ranks), else ``(0, 0, rows)``."""
    if torch.compiler.is_compiling() and is_real(mesh):
        # dynamo is loaded (it is tracing): the module that needs it is imported only now. No
        # fault while tracing (indexes are not read then)
        from fastdist.ops.ragged_graph import ragged_a2a_outside_the_graph

        return ragged_a2a_outside_the_graph(ragged_all_to_all, x, mesh, axis, send_sizes, capacity)
    x, spec = enter("ragged_all_to_all", x, mesh, axis)
    cap = as_index(capacity)  # NumPy integers too
    if cap is None or cap < 0:
        raise CollectiveError(
            "ragged_all_to_all",
            axis,
            f"capacity={capacity!r} is not a row count",
            "pass the most rows any rank can receive",
        )
    capacity = cap
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
        recv = _exchange_checked_sizes(x, mesh, axis, send, capacity, spec.comm, fault)
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
    x: Tensor,
    mesh: Mesh,
    axis: AxisName,
    send: Tensor,
    capacity: int,
    comm: AxisComm,
    fault: tuple[int, int, int],
) -> Tensor:
    """Real ranks: this rank's receive sizes, after every rank checked every rank's sizes (and
    ``indexed_all_to_all_v``'s index: ``fault``, as :func:`_ragged` takes it).

    One small all-gather of each rank's send sizes, row count, capacity and index fault (in place
    of the all-to-all of the send sizes): a bad size or index on one rank then raises the same
    error on every rank of the group at once, naming that rank, and no rank is left waiting in
    the exchange.
    """
    extra = [x.shape[0], capacity, *fault]
    mine = torch.cat([send, torch.tensor(extra, dtype=torch.long, device=send.device)])  # [n + 5]
    table = all_gather(mine.reshape(1, -1), mesh, axis, dim=0)  # [n, n + 5]: row i from index i
    faults = table[:, comm.n + 2 :].tolist()  # [n, 3]: (bad?, entry, rows of x) per index
    bad = [(comm.ranks[i], entry, rows) for i, (b, entry, rows) in enumerate(faults) if b]
    if bad:
        rows = bad[0][2]
        fix = (
            (f"index rows 0..{rows - 1}" if rows else "index no rows: x has none")
            if len(bad) == 1
            else "index rows 0..rows-1 of each rank's x"
        )
        raise CollectiveError(
            "indexed_all_to_all_v",
            comm.label,
            "; ".join(
                f"rank {r}'s index holds {e}, outside the {n} rows of its x" for r, e, n in bad
            )
            + " (every rank of the group raises this)",
            fix,
            rank=f"rank {comm.rank}",
        )
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
#: functorch's C functions (a module, read once), to read a simulation's stacked index
_FUNCTORCH: Any = torch._C._functorch


def _outside_rows(index: Tensor, rows: int) -> bool:
    """Whether an entry of ``index`` is outside ``[0, rows)``: one pass (``aminmax``), two
    scalar reads (on an accelerator, device-to-host). An index without values (a fake or meta
    tensor: `fastdist.profile`'s tracing, shape propagation) is not checked."""
    if not index.numel() or without_values(index):
        return False
    lo, hi = torch.aminmax(index)
    return int(lo) < 0 or int(hi) >= rows


def _index_check(index: Tensor, rank: Tensor, rows: int, axis: AxisName) -> None:
    """Raise naming the first rank (of ``rank``, broadcastable to ``index``) whose ``index``
    holds a row number outside ``[0, rows)`` (one device-to-host read of a flag, more only on
    failure)."""
    if not _outside_rows(index, rows):
        return
    bad = (index < 0) | (index >= rows)
    ranks = rank.detach().cpu().expand(index.shape)
    b, values = bad.cpu(), index.detach().cpu()
    first = int(ranks[b].min())
    held = values[b & (ranks == first)]
    lo = int(held.min())
    rows_of = f"rows 0..{rows - 1}" if rows else "no rows: x has none"
    raise CollectiveError(
        "indexed_all_to_all_v",
        axis,
        f"index holds {lo if lo < 0 else int(held.max())}, outside the {rows} rows of x",
        f"index {rows_of}",
        rank=f"rank {first}",
    )


def _index_fault(index: Tensor, rows: int) -> tuple[int, int]:
    """Real ranks: ``(1, an entry of index outside [0, rows))``, or ``(0, 0)`` when every entry
    is a row (one device-to-host read of ``aminmax``; nothing while dynamo traces)."""
    if torch.compiler.is_compiling() or not _outside_rows(index, rows):
        return 0, 0
    lo, hi = (int(t) for t in torch.aminmax(index))
    return 1, lo if lo < 0 else hi


@torch.library.custom_op("fastdist::check_row_index", mutates_args=())
def _check_row_index(index: Tensor, rank: Tensor, rows: int, axis: str) -> Tensor:
    """A copy of ``index``; raises :class:`~fastdist.CollectiveError` if an entry is outside
    ``[0, rows)``. ``rank`` (broadcastable to ``index``) is the global rank holding each entry;
    ``axis`` the ``repr`` of the mesh axis. A custom op so that its vmap rule sees every
    simulated rank's index at once (a vmapped tensor has no values to read)."""
    _index_check(index, rank, rows, ast.literal_eval(axis))
    return index.clone()


@_check_row_index.register_fake
def _check_row_index_fake(index: Tensor, rank: Tensor, rows: int, axis: str) -> Tensor:
    return torch.empty_like(index)


@_check_row_index.register_vmap
def _check_row_index_vmap(
    info: Any, in_dims: tuple[int | None, ...], index: Tensor, rank: Tensor, *params: Any
) -> tuple[Tensor, int]:
    # every simulated rank's index at once, each entry with its rank (the index is vmapped like
    # the rank id, or replicated and only the rank id is); an outer vmap: the op's next rule
    ib, rb, n = in_dims[0], in_dims[1], info.batch_size
    t = index.movedim(ib, 0) if ib is not None else index.unsqueeze(0).expand(n, *index.shape)
    r = rank.movedim(rb, 0) if rb is not None else rank.unsqueeze(0).expand(n, *rank.shape)
    r = r.reshape(n, *([1] * (t.dim() - r.dim())), *r.shape[1:]).expand(t.shape)
    return _check_row_index(t, r, *params), 0


def _checked_index(index: Tensor, rows: int, mesh: Mesh, axis: AxisName) -> Tensor:
    """``index`` once every entry is a row of ``x`` (``rows`` of them).

    Real ranks: nothing here (:func:`_index_fault` reads this rank's, and the exchange checks
    every rank's). Simulated ranks: every rank's index at once, read from the simulation's stacked
    tensor (the usual case: an index vmapped by the simulation alone, or a replicated plain
    one), else through ``fastdist::check_row_index``, whose vmap rule sees it stacked (under
    other transforms; several times the cost)."""
    compiling = torch.compiler.is_compiling()
    if is_real(mesh):  # checked by indexed_all_to_all_v with every rank's index (_index_fault)
        return index
    binding = rank_binding("indexed_all_to_all_v", mesh)  # raises unless simulated or one rank
    here = -1 if compiling else _FUNCTORCH.maybe_get_level(index)
    if not compiling and here == -1:  # a plain index: the same on every rank (rank 0's)
        _index_check(index, torch.zeros((), dtype=torch.long), rows, axis)
        return index
    if (
        not compiling
        and binding is not None
        and here == _FUNCTORCH.maybe_get_level(binding.rank)
        and _FUNCTORCH.is_batchedtensor(index)
    ):  # vmapped by the simulation alone: its stacked tensor, read directly
        stacked = _FUNCTORCH.get_unwrapped(index)
        if _outside_rows(stacked, rows):  # the ranks and details only on failure
            stacked = stacked.movedim(_FUNCTORCH.maybe_get_bdim(index), 0)
            ranks = torch.arange(stacked.shape[0]).reshape(-1, *[1] * (stacked.dim() - 1))
            _index_check(stacked, ranks, rows, axis)
        return index
    rank = (
        binding.rank
        if binding is not None
        else torch.zeros((), dtype=torch.long, device=index.device)
    )
    out: Tensor = torch.ops.fastdist.check_row_index(index, rank, rows, repr(axis))
    return out


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
    index = _checked_index(index, x.shape[0], mesh, axis)
    widen = accumulate_fp32 and x.dtype in (torch.bfloat16, torch.float16)
    # else rows picked on the bits of a dtype torch has no kernels for (float8, uint16, ...)
    carrier = None if widen else bits_carrier(x, not is_real(mesh))
    src = x.float() if widen else x if carrier is None else x.view(carrier)
    fault = _index_fault(index, x.shape[0]) if is_real(mesh) else (0, 0)
    # a bad index on this rank: zeros in its place, so that the exchange's check (of every
    # rank's sizes and index) raises on every rank of the group, not on this one alone
    rows = (
        src.new_zeros((index.shape[0], *src.shape[1:])) if fault[0] else src.index_select(0, index)
    )
    try:
        out, recv = _ragged(rows, mesh, axis, send_sizes, capacity, (*fault, x.shape[0]))
    except CollectiveError as e:  # its exchange's checks: name the op the caller called
        if e.op == "ragged_all_to_all":
            # the exchange's input is x[index]: its rows are the ones index selects
            e.readdress(op=op, problem=e.problem.replace("of its input", "index selects"))
        raise
    return (out.to(x.dtype) if carrier is None else out.view(x.dtype)), recv


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
            [row_count("exchange_sizes", axis, "local_size", local_size)], dtype=torch.long
        )
    return all_gather(t, mesh, axis, dim=0)
