"""Per-rank programs of tests/test_review_comm.py: one table of collective cases, run on real ranks
(gloo, or the fake ctypes NCCL) and, by the test, on simulated ranks; the test compares them."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import fastdist as fd

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]


def make_input(dtype: torch.dtype, shape: tuple[int, ...], world: int = 4) -> torch.Tensor:
    """``[world, *shape]`` of small exact values (every rank different)."""
    n = world * max(1, int(torch.tensor(shape).prod().item()) if shape else 1)
    base = (torch.arange(n, dtype=torch.float64) * 7 % 11 - 5)[:n]
    if dtype == torch.bool:
        t = base > 0
    elif dtype.is_complex:
        t = torch.complex(base, base.flip(0)).to(dtype)
    else:
        t = base.to(dtype)
    full = (world, *shape)
    numel = int(torch.tensor(full).prod().item())
    return t[:numel].reshape(full).clone() if numel else torch.zeros(full, dtype=dtype)


def _ax4(axis: Any) -> bool:
    return isinstance(axis, tuple) and len(axis) == 2


def _perm(axis: Any) -> list[tuple[int, int]]:
    return [(0, 1), (1, 2), (2, 3), (3, 0)] if _ax4(axis) else [(0, 1), (1, 0)]


def _send(x: torch.Tensor, axis: Any) -> torch.Tensor:
    """Send sizes of this rank (from its data, so they differ per rank): at most 4 rows in all."""
    n = 4 if _ax4(axis) else 2
    v = x.reshape(-1)[0].ne(0).to(torch.int64)
    return torch.stack([(v + j) % 2 for j in range(n)])


def _zeros(axis: Any) -> list[int]:
    """Sizes where some ranks send nothing (their shard has no elements)."""
    return [0, 0, 4, 0] if _ax4(axis) else [0, 4]


def _sizes(axis: Any) -> list[int]:
    return [1, 0, 2, 1] if _ax4(axis) else [1, 3]


#: an op of the table: (this rank's tensor, mesh, axis) -> result
Op = Callable[[torch.Tensor, Any, Any], Any]

OPS: dict[str, Op] = {
    "psum": lambda x, m, a: fd.psum(x, m, a),
    "pmean": lambda x, m, a: fd.pmean(x, m, a),
    "pmax": lambda x, m, a: fd.pmax(x, m, a),
    "pmin": lambda x, m, a: fd.pmin(x, m, a),
    "ag0": lambda x, m, a: fd.all_gather(x, m, a, 0),
    "ag-1u": lambda x, m, a: fd.all_gather(x, m, a, -1, tiled=False),
    "agi": lambda x, m, a: fd.all_gather_invariant(x, m, a, -1),
    "lchunk": lambda x, m, a: fd.local_chunk(x, m, a, 0),
    "ps0": lambda x, m, a: fd.psum_scatter(x, m, a, 0),
    "ps-1": lambda x, m, a: fd.psum_scatter(x, m, a, -1),
    "a2a": lambda x, m, a: fd.all_to_all(x, m, a, 0, 1),
    "a2a-r": lambda x, m, a: fd.all_to_all(x, m, a, -1, -2),
    "ppermute": lambda x, m, a: fd.ppermute(x, m, a, _perm(a)),
    "ring": lambda x, m, a: fd.ring_shift(x, m, a, -1),
    "bcast": lambda x, m, a: fd.broadcast(x, m, a, 1),
    "agv": lambda x, m, a: fd.all_gather_v(x, m, a, _sizes(a)),
    "agv-1": lambda x, m, a: fd.all_gather_v(x, m, a, [1, 0, 2, 1] if _ax4(a) else [1, 2], dim=-1),
    "rsv": lambda x, m, a: fd.reduce_scatter_v(x, m, a, _sizes(a), capacity=3),
    "gv": lambda x, m, a: fd.gather_v(x, m, a, _sizes(a), 1, capacity=4),
    "sv": lambda x, m, a: fd.scatter_v(x, m, a, _sizes(a), 0, capacity=3),
    "sv-1": lambda x, m, a: fd.scatter_v(x.transpose(0, 1), m, a, _sizes(a), 1, dim=-1, capacity=3),
    "agv-e": lambda x, m, a: fd.all_gather_v(x.transpose(0, 1)[:1], m, a, _zeros(a), dim=-1),
    "ragged": lambda x, m, a: fd.ragged_all_to_all(x, m, a, _send(x, a), capacity=8),
}

#: the ops whose row checks depend on the rank's own index
V_OPS = {"agv", "agv-1", "agv-e", "rsv", "gv", "sv", "sv-1", "ragged"}

LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "plain": lambda x: x,
    "t": lambda x: x.transpose(-1, -2),
    "stride": lambda x: x[..., ::2],
    "expand": lambda x: x[..., :1].expand(*x.shape),
    "neg": lambda x: x.flip(-1) if x.dtype != torch.bool else x,
    # torch calls these contiguous, with a last stride that is not 1
    "col1": lambda x: x.transpose(-1, -2)[..., :1],
    "empty": lambda x: x.transpose(-1, -2)[:0],
}

AXES: list[Any] = ["tp", "dp", ("dp", "tp"), ("tp", "dp")]


def cases() -> list[tuple[str, str, str, Any, tuple[int, ...]]]:
    """(op, dtype name, layout, axis, per-rank shape) of every sweep case (none where a v-op's
    row check would pass on some ranks only: those wait for the others until the timeout)."""
    out = [c for c in _all_cases() if c[0] != "agv-e" or (c[2], c[4]) == ("plain", (4, 8))]
    return out


def _all_cases() -> list[tuple[str, str, str, Any, tuple[int, ...]]]:
    out = []
    for op in OPS:
        for dt in DTYPES:
            for ax in AXES:
                out.append((op, str(dt), "plain", ax, (4, 8)))
        for lay in LAYOUTS:
            if lay == "plain":
                continue
            if op in V_OPS and lay in ("empty", "col1"):
                continue
            for dt in ["torch.float64", "torch.complex64", "torch.bool"]:
                for ax in AXES:
                    out.append((op, dt, lay, ax, (8, 4)))
        for shape in [(), (0, 4), (4, 0), (8, 4, 2)]:
            if op in V_OPS and 0 in shape:
                continue  # a rank short of its own rows raises alone (its peers time out)
            for ax in ["tp", ("tp", "dp")]:
                out.append((op, "torch.float32", "plain", ax, shape))
    return out


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name.split(".")[1])


def run_case(x: torch.Tensor, mesh: Any, op: str, layout: str, axis: Any) -> Any:
    return OPS[op](LAYOUTS[layout](x), mesh, axis)


def outcome(fn: Callable[[], Any]) -> Any:
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the test compares what was raised
        return ("err", type(e).__name__, str(e)[:300])


def sweep(lib: str | None, rendezvous: str | None = None) -> dict[str, Any]:
    """Every case of :func:`cases` on this rank (dp=2 x tp=2), plus extra patterns."""
    torch.set_num_threads(1)
    g = dist.get_rank()
    if lib is None:
        mesh = fd.connect(dp=2, tp=2, timeout=20)
    else:
        if rendezvous is not None:  # the fake library's rendezvous directory
            os.environ["FAKECOMM_DIR"] = rendezvous
        mesh = fd.connect(dp=2, tp=2, timeout=20, backend="nccl-ctypes", library=lib)
    res: dict[str, Any] = {"rank": mesh.rank, "backend": mesh.backend}
    for op, dt, lay, ax, shape in cases():
        x = make_input(dtype_of(dt), shape)[mesh.rank].clone()
        if os.environ.get("REVIEW_TRACE"):
            with open(f"{os.environ['REVIEW_TRACE']}.{g}", "w") as f:
                f.write(repr((op, dt, lay, ax, shape)))
        res[repr((op, dt, lay, ax, shape))] = outcome(
            lambda x=x, op=op, lay=lay, ax=ax: run_case(x, mesh, op, lay, ax)
        )
    res["extras"] = extras(mesh, g)
    fd.psum(torch.ones(1), mesh, ("dp", "tp"))
    if lib is not None:
        fd.comm.close(mesh)
    return res


def extras(mesh: Any, g: int) -> dict[str, Any]:
    """Aliasing, grads, no_grad / inference_mode, views with requires_grad, interleaving,
    objects."""
    out: dict[str, Any] = {}
    x0 = make_input(torch.float64, (4, 8))[mesh.rank].clone()
    for op in OPS:
        for ax in ["tp", ("dp", "tp")]:
            # the input changed after the call (the output returned) / the output changed after
            # the call (the input returned)
            for key, change_input in (("mut_in", True), ("mut_out", False)):

                def mutated(op: str = op, ax: Any = ax, change_input: bool = change_input) -> Any:
                    x = x0.clone()
                    y = run_case(x, mesh, op, "plain", ax)
                    y = y[0] if isinstance(y, tuple) else y
                    changed, kept = (x, y) if change_input else (y, x)
                    changed.mul_(100)
                    return kept.clone()

                out[key, op, ax] = outcome(mutated)
            # gradients
            out["grad", op, ax] = outcome(lambda op=op, ax=ax: grad_case(x0, mesh, op, ax, g))
            out["grad_view", op, ax] = outcome(
                lambda op=op, ax=ax: grad_case(x0, mesh, op, ax, g, view=True)
            )
            with torch.no_grad():
                out["nograd", op, ax] = outcome(
                    lambda op=op, ax=ax: run_case(x0, mesh, op, "plain", ax)
                )
            with torch.inference_mode():
                xi = x0.clone()
            out["inference", op, ax] = outcome(
                lambda op=op, ax=ax, xi=xi: run_case(xi, mesh, op, "plain", ax)
            )
    # interleaving two axes
    a = fd.psum(x0, mesh, "dp")
    b = fd.all_gather(x0, mesh, "tp")
    c = fd.psum(a, mesh, "tp")
    d = fd.psum_scatter(b, mesh, "dp")
    out["interleave"] = (a, b, c, d)
    # objects
    objs: list[Any] = [
        None,
        {"r": mesh.rank, "t": torch.arange(3) + mesh.rank, "s": {1, 2}},
        "x" * (1 << 16) if mesh.rank == 1 else "",
        b"\x00" * mesh.rank,
        (float("nan"), mesh.rank),
    ]
    out["ago"] = outcome(lambda: [fd.comm.all_gather_object(o, mesh, "tp") for o in objs])
    out["ago_all"] = outcome(lambda: fd.comm.all_gather_object(objs[1], mesh))
    out["bco"] = outcome(lambda: [fd.comm.broadcast_object(o, mesh, ("tp", "dp"), 1) for o in objs])
    out["bco_src"] = outcome(lambda: fd.comm.broadcast_object(mesh.rank, mesh, "dp", 1))
    return out


def grad_case(x0: torch.Tensor, mesh: Any, op: str, ax: Any, g: int, view: bool = False) -> Any:
    leaf = x0.clone().requires_grad_(True)
    x = leaf[:, :] if view else leaf
    y = run_case(x, mesh, op, "plain", ax)
    y = y[0] if isinstance(y, tuple) else y
    w = weight_for(y.shape, mesh.rank)
    (y * w).sum().backward()
    return (y.detach(), leaf.grad)


def weight_for(shape: Any, rank: int) -> torch.Tensor:
    n = int(torch.tensor(list(shape)).prod().item()) if len(shape) else 1
    return (torch.arange(n, dtype=torch.float64) * (rank + 2) % 5 - 1).reshape(shape)


#: every op with arguments that fit an axis of size 1
ONE_OPS: dict[str, Op] = {
    **{k: OPS[k] for k in ["psum", "pmean", "pmax", "pmin", "ag0", "ag-1u", "agi", "lchunk"]},
    **{k: OPS[k] for k in ["ps0", "ps-1", "a2a", "a2a-r", "ring"]},
    "ppermute": lambda x, m, a: fd.ppermute(x, m, a, [(0, 0)]),
    "bcast": lambda x, m, a: fd.broadcast(x, m, a, 0),
    "agv": lambda x, m, a: fd.all_gather_v(x, m, a, [2]),
    "agv-all": lambda x, m, a: fd.all_gather_v(x, m, a, [4]),
    "rsv": lambda x, m, a: fd.reduce_scatter_v(x, m, a, [4]),
    "gv": lambda x, m, a: fd.gather_v(x, m, a, [4], 0),
    "sv": lambda x, m, a: fd.scatter_v(x, m, a, [4], 0),
    "ragged": lambda x, m, a: fd.ragged_all_to_all(
        x, m, a, x.new_full((1,), 4, dtype=torch.int64), capacity=4
    ),
    "pvary": lambda x, m, a: fd.pvary(x, m, a),
    "agi0": lambda x, m, a: fd.all_gather_invariant(x, m, a, 0),
    "ps-u": lambda x, m, a: fd.psum_scatter(x[:1], m, a, 0, tiled=False),
    "a2a4d": lambda x, m, a: fd.all_to_all_4d(x.reshape(1, 4, 2, 4), m, a),
}


def one_member(_: Any = None) -> dict[str, Any]:
    """Every op over a size-1 axis (dp=2 x tp=1): the input changed in place after the call, and
    the output changed in place after the call."""
    torch.set_num_threads(1)
    mesh = fd.connect(dp=2, tp=1, timeout=20)
    return {"rank": mesh.rank, **alias_checks(mesh, mesh.rank)}


def alias_checks(mesh: Any, rank: int) -> dict[str, Any]:
    """(op, "in"/"out") -> (result after the input was scaled, input after the result was
    scaled) for every op over "tp"."""
    out: dict[Any, Any] = {}
    x0 = make_input(torch.float64, (4, 8), 2)[rank]
    for op, fn in ONE_OPS.items():
        x = x0.clone()
        y = fn(x, mesh, "tp")
        y = y[0] if isinstance(y, tuple) else y
        x.mul_(100)
        out[op, "in"] = y.clone()
        x = x0.clone()
        y = fn(x, mesh, "tp")
        y = y[0] if isinstance(y, tuple) else y
        y.mul_(100)
        out[op, "out"] = x.clone()
    return out
