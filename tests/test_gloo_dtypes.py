"""Every data-movement collective carries every dtype, bit for bit, on 2 gloo processes.

gloo refuses int16, uint16/32/64, every float8, float4 and bits dtype ("Invalid scalar type"),
and its functional all-to-all (what ``torch.compile`` traces) every complex dtype. The c10d
transports (``fastdist.comm.transports``) send such a tensor as a bitwise view of a dtype every
backend carries and view it back (``wire_dtype``). The reference is ``fd.simulate`` on one
process (no c10d); results are compared as bytes (NaN patterns included). A quantized tensor has
no such view: it raises a ``CollectiveError`` naming op, axis and dtype before anything is sent,
and the mesh stays usable.

Before: ``all_gather`` of an int16 tensor raised ``CommError: ... the collective failed: Invalid
scalar type; every rank of the group reached this call ... so they probably disagree on it`` and
dropped the mesh's groups (every later call: "groups were dropped").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import fastdist as fd
from fastdist.comm.transports import CARRIED, wire_dtype
from fastdist.errors import CollectiveError
from tests.dist_harness import run_on_gloo

#: every dtype of this torch that holds whole bytes and is not quantized
NAMES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits8", "bits16",
]  # fmt: skip
DTYPES = [getattr(torch, n) for n in NAMES if hasattr(torch, n)]
N, ROWS, COLS = 2, 4, 3
SEND = torch.tensor([[1, 2], [3, 1]])  # ragged_all_to_all: rank r sends SEND[r][j] rows to j

Op = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
#: each data-movement collective, as per-rank code (x: [ROWS, COLS], s: this rank's SEND row)
OPS: dict[str, Op] = {
    "all_gather": lambda x, s, m: fd.all_gather(x, m, "tp"),
    "all_gather_dim1": lambda x, s, m: fd.all_gather(x, m, "tp", dim=1, tiled=False),
    "all_to_all": lambda x, s, m: fd.all_to_all(x, m, "tp", 0, 1),
    "broadcast": lambda x, s, m: fd.broadcast(x, m, "tp", src=1),
    "ppermute": lambda x, s, m: fd.ppermute(x, m, "tp", [(0, 1), (1, 0)]),
    "ring_shift": lambda x, s, m: fd.ring_shift(x, m, "tp"),
    "all_gather_v": lambda x, s, m: fd.all_gather_v(x, m, "tp", [3, 2]),
    "gather_v": lambda x, s, m: fd.gather_v(x, m, "tp", [3, 2], dst=1, capacity=5),
    "scatter_v": lambda x, s, m: fd.scatter_v(x, m, "tp", [3, 1], src=0, capacity=3),
    "halo_exchange": lambda x, s, m: fd.halo_exchange(x, m, "tp", 0, 1, mode="circular"),
    "ragged_all_to_all": lambda x, s, m: fd.ragged_all_to_all(x, m, "tp", s, capacity=5)[0],
}


def inputs(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every rank's input stacked, ``[N, ROWS, COLS]``: random bytes (every bit pattern, NaNs
    included; bool 0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (N, ROWS, COLS * dtype.itemsize), dtype=torch.uint8, generator=g)
    return raw % 2 == 1 if dtype is torch.bool else raw.view(dtype)


def as_bytes(t: torch.Tensor) -> tuple[tuple[int, ...], str, torch.Tensor]:
    """``t``'s shape, dtype and bytes (a uint8 tensor: torch.save of every dtype loads)."""
    return tuple(t.shape), str(t.dtype), t.contiguous().reshape(-1).view(torch.uint8).clone()


def _compiled(x: torch.Tensor, mesh: fd.Mesh) -> list[torch.Tensor]:
    """Movement collectives under torch.compile (FunctionalTransport)."""
    return [
        fd.all_gather(x, mesh, "tp"),
        fd.all_to_all(x, mesh, "tp", 0, 1),
        fd.broadcast(x, mesh, "tp", src=1),
    ]


COMPILED = ["int16", "float8_e4m3fn", "complex64", "complex128", "uint64"]


def worker() -> dict[str, Any]:
    """On each rank: every op on every dtype (an error recorded, then the mesh reset), a few
    dtypes under torch.compile, a quantized tensor (must raise before sending), then a psum."""
    mesh = fd.connect(tp=N)
    r = torch.distributed.get_rank()
    got: dict[str, Any] = {}
    for i, dtype in enumerate(DTYPES):
        x = inputs(dtype, i)[r]
        for name, f in OPS.items():
            try:
                got[f"{name}/{dtype}"] = as_bytes(f(x, SEND[r], mesh))
            except Exception as e:  # noqa: BLE001 - recorded: the parent reports every case
                got[f"{name}/{dtype}"] = f"{type(e).__name__}: {e}"
                fd.comm.reset(mesh)
    step = torch.compile(_compiled, fullgraph=True, backend="aot_eager")
    for name in COMPILED:
        dtype = getattr(torch, name)
        try:
            outs = step(inputs(dtype, 100)[r], mesh)
            got[f"compiled/{dtype}"] = [as_bytes(o) for o in outs]
        except Exception as e:  # noqa: BLE001
            got[f"compiled/{dtype}"] = f"{type(e).__name__}: {e}"
            fd.comm.reset(mesh)
    q = torch.quantize_per_tensor(torch.ones(4, 2), 0.5, 0, torch.quint8)
    try:
        fd.all_gather(q, mesh, "tp")
        got["quantized"] = "no error"
    except CollectiveError as e:  # sent back as its fields (the exception does not unpickle)
        got["quantized"] = (type(e).__name__, e.op, e.axis, e.rank, str(e))
    except Exception as e:  # noqa: BLE001
        got["quantized"] = f"{type(e).__name__}: {e}"
    try:  # no reset since the quantized call: the mesh must still be usable
        got["psum"] = fd.psum(torch.full((2,), float(r + 1)), mesh, "tp")
    except Exception as e:  # noqa: BLE001
        got["psum"] = f"{type(e).__name__}: {e}"
    return got


#: a plain integer dtype of each item size: the reference's input where torch has no CPU kernel
#: for a dtype that the simulated op uses (gather, index, cat: uint16, float8, ...)
SAME_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def reference(name: str, dtype: torch.dtype, seed: int) -> list[tuple[Any, ...]]:
    """Each rank's result of ``OPS[name]`` on one process (``fd.simulate``), as bytes: on the
    input itself, or, where torch has no kernel for its dtype, on its bitwise view as a plain
    integer dtype of the same item size (the op moves bits; they do not depend on the dtype)."""
    mesh = fd.Mesh({"tp": N})
    sim = fd.simulate(lambda x, s: OPS[name](x, s, mesh), mesh)
    x = inputs(dtype, seed)
    try:
        out = sim(x, SEND)
    except (RuntimeError, NotImplementedError):
        out = sim(x.view(SAME_SIZE[dtype.itemsize]), SEND).view(dtype)
    return [as_bytes(o) for o in out]


def compiled_reference(dtype: torch.dtype, seed: int) -> list[list[tuple[Any, ...]]]:
    """Each rank's results of :func:`_compiled` on one process."""
    mesh = fd.Mesh({"tp": N})
    outs = fd.simulate(lambda x: _compiled(x, mesh), mesh)(inputs(dtype, seed))
    return [[as_bytes(o[r]) for o in outs] for r in range(N)]


def same(a: Any, b: Any) -> bool:
    """Equal shape, dtype and bytes."""
    return bool(a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2]))


def test_wire_dtype_table() -> None:
    """One carrier per dtype, of the same item size (complex128: float64 pairs), each carried."""
    for dtype in DTYPES:
        wire = wire_dtype(dtype)
        assert wire in CARRIED, dtype
        assert wire.itemsize == dtype.itemsize or (dtype, wire) == (torch.complex128, torch.float64)
    assert wire_dtype(torch.quint8) is None and wire_dtype(torch.qint32) is None


def test_every_dtype_every_movement_op_on_gloo() -> None:
    ranks = run_on_gloo(worker, N, timeout=500)
    wrong = []
    for i, dtype in enumerate(DTYPES):
        for name in OPS:
            want = reference(name, dtype, i)
            for r in range(N):
                have = ranks[r][f"{name}/{dtype}"]
                if isinstance(have, str) or not same(have, want[r]):
                    wrong.append(f"{name}/{dtype} rank {r}: {str(have)[:200]}")
    for name in COMPILED:
        dtype = getattr(torch, name)
        want_c = compiled_reference(dtype, 100)
        for r in range(N):
            have = ranks[r][f"compiled/{dtype}"]
            if isinstance(have, str) or not all(map(same, have, want_c[r])):
                wrong.append(f"compiled/{dtype} rank {r}: {str(have)[:200]}")
    assert not wrong, "\n".join(wrong)
    for r in range(N):
        e = ranks[r]["quantized"]
        assert e[:4] == ("CollectiveError", "all_gather", "tp", f"rank {r}"), e
        assert "torch.quint8" in e[4] and "dequantize" in e[4], e
        psum = ranks[r]["psum"]
        assert not isinstance(psum, str), psum  # the mesh is still usable
        assert torch.equal(psum, torch.full((2,), 3.0))
