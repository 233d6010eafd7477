"""Per-rank programs of tests/test_review_comm_ops.py: a table of cases of the ops the first
sweep (tests/review_comm_worker.py) left out -- ``halo_exchange``, ``all_to_all_qkv``,
``indexed_all_to_all_v``, ``ragged_all_to_all``, the static-size v-ops with exact-size shards,
``pvary_packed`` -- run on real ranks (gloo, or the fake ctypes NCCL) and, by the test, on
simulated ranks or against one device; the test compares them.

A case is ``(fn, inputs)``: ``fn(mesh, *xs)`` is per-rank code, ``inputs()`` the stacked
``[4, ...]`` inputs (slice ``r``: mesh rank ``r``'s). Every case also checks that changing the
inputs in place after the call leaves the result alone, and float64 cases run a backward of a
per-rank weighted sum.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import fastdist as fd
from fastdist.ops import all_to_all_qkv
from fastdist.ops.packed import pvary_packed
from tests.review_comm_worker import DTYPES  # the same dtypes as the sweep of the other ops

WORLD = 4
AXES: list[Any] = ["tp", "dp", ("dp", "tp"), ("tp", "dp")]
MODES = ("zeros", "circular", "replicate", "reflect")

Fn = Callable[..., Any]
Inputs = Callable[[], tuple[Tensor, ...]]


def make(dtype: torch.dtype, shape: tuple[int, ...], salt: int = 0) -> Tensor:
    """``[WORLD, *shape]`` of small exact values, every rank and element different-ish."""
    full = (WORLD, *shape)
    n = 1
    for s in full:
        n *= s
    base = (torch.arange(n, dtype=torch.float64) * 7 + salt) % 13 - 6
    if dtype == torch.bool:
        t = base > 0
    elif dtype.is_complex:
        t = torch.complex(base, base.flip(0)).to(dtype)
    else:
        t = base.to(dtype)
    return t.reshape(full).clone()


def n_of(axis: Any) -> int:
    return 4 if isinstance(axis, tuple) else 2


LAYOUTS: dict[str, Callable[[Tensor], Tensor]] = {
    "plain": lambda x: x,
    "t": lambda x: x.transpose(-1, -2).contiguous().transpose(-1, -2),  # column-major
    "stride": lambda x: torch.cat([x, x], -1)[..., ::2],
    "expand": lambda x: x[..., :1].expand(*x.shape),
    "neg": lambda x: x.flip(-1),
    "empty": lambda x: x[..., :0],
}


# ------------------------------------------------------------------ halo_exchange
def _halo_sizes(axis: Any) -> list[int]:
    return [2, 4] if n_of(axis) == 2 else [2, 3, 4, 3]


def halo_case(axis: Any, width: Any, mode: str, uneven: bool, lay: str, dim: int) -> Fn:
    def fn(mesh: Any, x: Tensor) -> Tensor:
        y = LAYOUTS[lay](x)  # [4, 3]: rows (dim 0) split
        y = y if dim == 0 else y.t()
        sizes = _halo_sizes(axis) if uneven else None
        return fd.halo_exchange(y, mesh, axis, dim, width, mode=mode, sizes=sizes)

    return fn


def halo_cases() -> dict[str, tuple[Fn, Inputs]]:
    out: dict[str, tuple[Fn, Inputs]] = {}

    def add(dt: torch.dtype, ax: Any, w: Any, mode: str, uneven: bool, lay: str, dim: int) -> None:
        key = f"halo|{dt}|{ax}|{w}|{mode}|{uneven}|{lay}|{dim}"
        out[key] = (halo_case(ax, w, mode, uneven, lay, dim), lambda: (make(dt, (4, 3)),))

    for ax in AXES:
        for w in [1, (2, 0), (0, 1)]:
            for mode in MODES:
                for uneven in (False, True):
                    add(torch.float64, ax, w, mode, uneven, "plain", 0)
    for dt in DTYPES:
        for ax in ["tp", ("tp", "dp")]:
            add(dt, ax, (1, 2), "reflect", True, "plain", 0)
            add(dt, ax, 1, "circular", False, "plain", 1)
    for mode in MODES:  # a 2-D split: dim 0 over one axis, then dim 1 over the other (corners)
        for first, second in [("dp", "tp"), ("tp", "dp")]:
            out[f"halo2d|torch.float64|{first}|{mode}"] = (
                lambda m, x, a=first, b=second, mode=mode: fd.halo_exchange(
                    fd.halo_exchange(x, m, a, 0, 1, mode=mode), m, b, 1, (1, 2), mode=mode
                ),
                lambda: (make(torch.float64, (3, 4)),),
            )
    for lay in LAYOUTS:
        for dt in [torch.float64, torch.complex64, torch.bool]:
            for ax in ["dp", ("dp", "tp")]:
                add(dt, ax, (2, 1), "replicate", True, lay, 0)
                add(dt, ax, 1, "zeros", False, lay, 1)
    return out


def halo_exact(mesh: Any, axis: Any, width: Any, mode: str, with_sizes: bool) -> Any:
    """Real ranks, uneven blocks of exactly their own rows (no padding rows): ``sizes`` given or
    not; the test compares with padding the whole domain on one device (values and gradient)."""
    idx = int(fd.axis_index(mesh, axis))
    sizes = _halo_sizes(axis)
    whole = make(torch.float64, (sum(sizes), 3))[0]
    start = sum(sizes[:idx])
    x = whole[start : start + sizes[idx]].clone().requires_grad_(True)
    y = fd.halo_exchange(x, mesh, axis, 0, width, mode=mode, sizes=sizes if with_sizes else None)
    w = weight_for(y.shape, idx)
    (y * w).sum().backward()
    return y.detach(), x.grad


# ------------------------------------------------------------------ all_to_all_qkv
def qkv_case(axis: Any, lay: str, batch: int) -> tuple[Fn, Inputs]:
    n = n_of(axis)

    def fn(mesh: Any, q: Tensor, k: Tensor, v: Tensor) -> Any:
        if lay == "bhsd":  # (B, H, m, D) as attention keeps it, transposed to (B, m, H, D)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        elif lay == "gqa":  # one kv head expanded to the query heads (a stride-0 dim)
            k = k[:, :, :1].expand(-1, -1, 4, -1)
            v = v[:, :, :1].expand(-1, -1, 4, -1)
        elif lay == "stride":
            q, k, v = (t[..., ::2] for t in (q, k, v))
        elif lay == "flip":
            q, k, v = (t.flip(1) for t in (q, k, v))
        return all_to_all_qkv(q, k, v, mesh, axis)

    def inputs(dt: torch.dtype) -> Inputs:
        m = 2
        if lay == "bhsd":
            shapes = [(batch, 4, m, 2), (batch, n, m, 2), (batch, n, m, 3)]
        elif lay == "stride":
            shapes = [(batch, m, 4, 4), (batch, m, n, 4), (batch, m, n, 6)]
        else:
            shapes = [(batch, m, 4, 2), (batch, m, n, 2), (batch, m, n, 3)]
        return lambda: tuple(make(dt, s, i) for i, s in enumerate(shapes))

    return fn, inputs  # type: ignore[return-value]


def qkv_cases() -> dict[str, tuple[Fn, Inputs]]:
    out: dict[str, tuple[Fn, Inputs]] = {}
    for ax in AXES:
        for lay in ["plain", "bhsd", "gqa", "stride", "flip"]:
            for batch in (1, 2):
                dts = (
                    DTYPES
                    if (lay, batch) == ("plain", 1)
                    else [torch.float64] + [torch.bool] * (batch == 1)
                )
                for dt in dts:
                    fn, inp = qkv_case(ax, lay, batch)
                    out[f"qkv|{dt}|{ax}|{lay}|{batch}"] = (fn, inp(dt))  # type: ignore[operator]
    return out


# ------------------------------------------------------------------ indexed / ragged all-to-all
def _routing(axis: Any, kind: str, tokens: int = 6) -> tuple[Tensor, Tensor]:
    """Stacked ``(index [4, k], send [4, n])`` of each rank's dispatch."""
    n = n_of(axis)
    idx, sends = [], []
    for r in range(WORLD):
        tok = torch.arange(tokens)
        if kind == "topk2":  # every token to two ranks
            dest = torch.cat([(tok * 3 + r) % n, (tok + r + 1) % n])
            tok = torch.cat([tok, tok])
        elif kind == "subset":  # some tokens go nowhere
            keep = (tok + r) % 3 != 0
            tok, dest = tok[keep], ((tok * 5 + r) % n)[keep]
        elif kind == "none":  # nothing to send
            tok, dest = tok[:0], tok[:0]
        else:
            dest = (tok * 3 + r) % n
        order = torch.argsort(dest, stable=True)
        idx.append(tok[order])
        sends.append(torch.bincount(dest, minlength=n))
    k = max(len(i) for i in idx)
    assert all(len(i) == k for i in idx)
    return torch.stack(idx), torch.stack(sends)


def indexed_case(axis: Any, kind: str, lay: str, itype: torch.dtype, acc: bool) -> Fn:
    def fn(mesh: Any, x: Tensor, index: Tensor, send: Tensor) -> Any:
        i = index.to(itype)
        if lay == "istride":  # the index a strided view
            i = torch.stack([i, i], -1)[:, 0]
        y = x if lay in ("plain", "istride") else LAYOUTS[lay](x)
        return fd.indexed_all_to_all_v(
            y, mesh, axis, i, send, capacity=6 * 2 * n_of(axis), accumulate_fp32=acc
        )

    return fn


def ragged_case(axis: Any, kind: str, lay: str, pad: int) -> Fn:
    def fn(mesh: Any, x: Tensor, index: Tensor, send: Tensor) -> Any:
        rows = LAYOUTS[lay](x)[index]  # packed by destination
        rows = torch.cat([rows, rows[:pad]])  # padding rows past send.sum()
        return fd.ragged_all_to_all(rows, mesh, axis, send, capacity=6 * 2 * n_of(axis) + 1)

    return fn


def a2av_cases() -> dict[str, tuple[Fn, Inputs]]:
    out: dict[str, tuple[Fn, Inputs]] = {}

    def inputs(dt: torch.dtype, ax: Any, kind: str, shape: tuple[int, ...] = (6, 3)) -> Inputs:
        return lambda: (make(dt, shape), *_routing(ax, kind))

    for ax in AXES:
        for kind in ["one", "topk2", "subset", "none"]:
            for itype in (torch.int64, torch.int32):
                fn = indexed_case(ax, kind, "plain", itype, False)
                out[f"iav|f64|{ax}|{kind}|{itype}"] = (fn, inputs(torch.float64, ax, kind))
            out[f"rag|f64|{ax}|{kind}"] = (
                ragged_case(ax, kind, "plain", 2),
                inputs(torch.float64, ax, kind),
            )
    for dt in DTYPES:
        for ax in ["tp", ("tp", "dp")]:
            out[f"iav|{dt}|{ax}"] = (
                indexed_case(ax, "topk2", "plain", torch.int64, False),
                inputs(dt, ax, "topk2"),
            )
            out[f"rag|{dt}|{ax}"] = (
                ragged_case(ax, "subset", "plain", 1),
                inputs(dt, ax, "subset"),
            )
    for lay in ["t", "stride", "expand", "neg", "empty", "istride"]:
        for dt in [torch.float64, torch.bool]:
            for ax in ["dp", ("dp", "tp")]:
                out[f"iav|{dt}|{ax}|{lay}"] = (
                    indexed_case(ax, "topk2", lay, torch.int64, False),
                    inputs(dt, ax, "topk2"),
                )
                if lay != "istride":
                    out[f"rag|{dt}|{ax}|{lay}"] = (
                        ragged_case(ax, "one", lay, 0),
                        inputs(dt, ax, "one"),
                    )
    for dt in [torch.bfloat16, torch.float16, torch.float32]:
        for ax in ["tp", ("dp", "tp")]:
            out[f"iav-acc|{dt}|{ax}"] = (
                indexed_case(ax, "topk2", "plain", torch.int64, True),
                inputs(dt, ax, "topk2"),
            )
    return out


# ------------------------------------------------------------------ static v-ops, pvary_packed
def _vsizes(axis: Any) -> list[int]:
    return [1, 3] if n_of(axis) == 2 else [2, 0, 3, 1]


def vop_cases() -> dict[str, tuple[Fn, Inputs]]:
    """The v-ops with the operand on other dims than 0, capacity, dst/src at the end, and
    accumulate_fp32 (simulated ranks share one shape: inputs of max(sizes) rows)."""
    out: dict[str, tuple[Fn, Inputs]] = {}
    ops: dict[str, Fn] = {
        "agv1": lambda m, x, a: fd.all_gather_v(x.movedim(0, 1), m, a, _vsizes(a), dim=1),
        "agv-acc": lambda m, x, a: fd.all_gather_v(x, m, a, _vsizes(a), accumulate_fp32=True),
        "rsv1": lambda m, x, a: fd.reduce_scatter_v(
            x[:, :1].expand(x.shape[0], sum(_vsizes(a)), *x.shape[2:]).movedim(1, 2),
            m,
            a,
            _vsizes(a),
            dim=2,
            capacity=4,
        ),
        "gv-last": lambda m, x, a: fd.gather_v(x, m, a, _vsizes(a), n_of(a) - 1, capacity=8),
        "sv-last": lambda m, x, a: fd.scatter_v(
            torch.cat([x, x, x]).narrow(0, 0, sum(_vsizes(a))),
            m,
            a,
            _vsizes(a),
            n_of(a) - 1,
            capacity=5,
        ),
    }
    for name, op in ops.items():
        for ax in AXES:
            for dt in [torch.float64, torch.bfloat16, torch.bool]:
                if name == "rsv1" and dt == torch.bool:
                    continue
                out[f"v|{name}|{dt}|{ax}"] = (
                    lambda m, x, op=op, ax=ax: op(m, x, ax),
                    lambda dt=dt: (make(dt, (4, 3, 2)),),
                )
    return out


def packed_pvary(mesh: Any, a: Tensor, b: Tensor, c: Tensor, axis: Any) -> Any:
    """pvary_packed of three tensors, the second's output unused by the loss (a gradient that
    does not come)."""
    pa, pb, pc = pvary_packed([a, b, c], mesh, axis)
    return pa * 2, (pc * 3).sum(0)


def all_cases() -> dict[str, tuple[Fn, Inputs]]:
    out = {**halo_cases(), **qkv_cases(), **a2av_cases(), **vop_cases()}
    for ax in AXES:
        out[f"pvary_packed|{ax}"] = (
            lambda m, a, b, c, ax=ax: packed_pvary(m, a, b, c, ax),
            lambda: (
                make(torch.float64, (3,)),
                make(torch.float64, (2,), 1),
                make(torch.float64, (2, 2), 2),
            ),
        )
    return out


# ------------------------------------------------------------------ running a case
def outcome(fn: Callable[[], Any]) -> Any:
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the test compares what was raised
        return ("err", type(e).__name__, str(e)[:300])


def flat(y: Any) -> list[Tensor]:
    if isinstance(y, Tensor):
        return [y]
    return [t for part in y for t in flat(part)]


def weight_for(shape: Any, rank: int) -> Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) * (rank + 2) % 5 - 1).reshape(tuple(shape))


def wants_grad(key: str) -> bool:
    return ("float64" in key or "f64" in key or "acc" in key or key.startswith("pvary")) and (
        "empty" not in key
    )


def mutate(x: Tensor) -> None:
    with torch.no_grad():
        if x.dtype == torch.bool:
            x.logical_not_()
        elif not x.is_floating_point() and not x.is_complex():
            x.add_(1)
        else:
            x.mul_(3).add_(1)


def real_case(mesh: Any, fn: Fn, inputs: Inputs, grad: bool) -> Any:
    """(outputs cloned, whether changing the inputs in place changed them, grads or None)."""
    xs = [t[mesh.rank].clone() for t in inputs()]
    if grad:
        xs = [x.requires_grad_(True) if x.is_floating_point() else x for x in xs]
    ys = flat(fn(mesh, *xs))
    snap = [y.detach().clone() for y in ys]
    grads = None
    if grad:
        loss = sum(
            (y.to(torch.float64) * weight_for(y.shape, mesh.rank)).sum()
            for y in ys
            if y.is_floating_point() and y.requires_grad
        )
        if isinstance(loss, Tensor):
            loss.backward()
        grads = [x.grad if x.is_floating_point() else None for x in xs]
    for x in xs:
        mutate(x.detach() if grad else x)
    aliased = [not torch.equal(y.detach(), s) for y, s in zip(ys, snap)]
    return snap, aliased, grads


def sweep(lib: str | None, rendezvous: str | None = None) -> dict[str, Any]:
    """Every case of :func:`all_cases` on this rank (dp=2 x tp=2), then the exact-size halo
    cases and the checks that a bad shard on one rank raises on every rank at once."""
    torch.set_num_threads(1)
    if lib is None:
        mesh = fd.connect(dp=2, tp=2, timeout=20)
    else:
        if rendezvous is not None:
            os.environ["FAKECOMM_DIR"] = rendezvous
        mesh = fd.connect(dp=2, tp=2, timeout=20, backend="nccl-ctypes", library=lib)
    res: dict[str, Any] = {"rank": mesh.rank, "backend": mesh.backend, "seconds": {}}
    t0 = time.monotonic()
    for key, (fn, inputs) in all_cases().items():
        family = key.split("|")[0]
        res["seconds"][family] = res["seconds"].get(family, 0.0) - time.monotonic()
        res[key] = outcome(
            lambda fn=fn, inputs=inputs, key=key: real_case(mesh, fn, inputs, wants_grad(key))
        )
        res["seconds"][family] += time.monotonic()
    t1 = time.monotonic()
    for ax in ["tp", ("dp", "tp")]:
        for w in [(2, 0), (1, 2)]:
            for mode in MODES:
                for with_sizes in (True, False):
                    res["exact", ax, w, mode, with_sizes] = outcome(
                        lambda ax=ax, w=w, mode=mode, s=with_sizes: halo_exact(mesh, ax, w, mode, s)
                    )
        res["exact-agv", ax] = outcome(lambda ax=ax: agv_exact(mesh, ax))
    t2 = time.monotonic()
    res["one-rank"] = one_rank_errors(mesh)
    res["seconds"].update(cases=t1 - t0, exact=t2 - t1, one_rank=time.monotonic() - t2)
    if res["one-rank"]["after"][0] == "ok":
        fd.psum(torch.ones(1), mesh, ("dp", "tp"))
    if lib is not None:
        fd.comm.close(mesh)
    return res


def agv_exact(mesh: Any, axis: Any) -> Any:
    """all_gather_v / reduce_scatter_v / gather_v / scatter_v with shards of exactly their own
    rows (real ranks only: shapes differ per rank), values and all_gather_v's gradient."""
    i = int(fd.axis_index(mesh, axis))
    sizes = _vsizes(axis)
    whole = make(torch.float64, (sum(sizes), 2))[0]
    start = sum(sizes[:i])
    x = whole[start : start + sizes[i]].clone().requires_grad_(True)
    y = fd.all_gather_v(x, mesh, axis, sizes)
    (y * weight_for(y.shape, i)).sum().backward()
    rs = fd.reduce_scatter_v(whole * (i + 1), mesh, axis, sizes)
    gv = fd.gather_v(x.detach(), mesh, axis, sizes, 0)
    sv = fd.scatter_v(whole * (i + 1), mesh, axis, sizes, 1)
    return y.detach(), x.grad, rs, gv, sv


#: per-rank calls where the rank with axis index 1 alone passes a bad argument
ONE_RANK: dict[str, Callable[[Any, int], Any]] = {
    "agv-short": lambda m, i: fd.all_gather_v(torch.ones(1 if i == 1 else 3, 2), m, "tp", [1, 3]),
    "gv-short": lambda m, i: fd.gather_v(torch.ones(0 if i == 1 else 3, 2), m, "tp", [1, 3], 0),
    "rsv-short": lambda m, i: fd.reduce_scatter_v(
        torch.ones(3 if i == 1 else 4, 2), m, "tp", [1, 3]
    ),
    "sv-short": lambda m, i: fd.scatter_v(torch.ones(3 if i == 1 else 4, 2), m, "tp", [1, 3], 0),
    "halo-short": lambda m, i: fd.halo_exchange(
        torch.ones(1 if i == 1 else 3, 2), m, "tp", 0, 1, sizes=[3, 3]
    ),
    "halo-narrow": lambda m, i: fd.halo_exchange(torch.ones(1 if i == 1 else 3, 2), m, "tp", 0, 2),
    "iav-index": lambda m, i: fd.indexed_all_to_all_v(
        torch.ones(3, 2),
        m,
        "tp",
        torch.tensor([0, 5 if i == 1 else 1]),
        torch.tensor([1, 1]),
        capacity=4,
    ),
    "rag-short": lambda m, i: fd.ragged_all_to_all(
        torch.ones(1 if i == 1 else 3, 2), m, "tp", torch.tensor([1, 1]), capacity=4
    ),
}


def one_rank_errors(mesh: Any) -> dict[str, Any]:
    """Each of :data:`ONE_RANK`: (outcome, seconds); then one psum shows the mesh still works."""
    out: dict[str, Any] = {}
    i = int(fd.axis_index(mesh, "tp"))
    for name, call in ONE_RANK.items():
        t0 = time.monotonic()
        got = outcome(lambda call=call: call(mesh, i))
        out[name] = (got[:2], got[2] if got[0] == "err" else "", time.monotonic() - t0)
        if got[:2] != ("err", "CollectiveError"):
            out["after"] = ("broken", name)  # a peer timed out: the mesh's groups are dropped
            return out
    out["after"] = outcome(lambda: fd.psum(torch.ones(1), mesh, "tp"))
    return out
