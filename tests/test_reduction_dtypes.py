"""The one dtype rule of reductions: every reduction, every dtype torch can make, on simulated
ranks, gloo processes and the ctypes NCCL communicator (host-memory fake library); same values,
same errors."""

from __future__ import annotations

import re
import shutil
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import fastdist as fd
from fastdist.comm.native import NativeCommunicator, fake, load_library
from fastdist.core.primitive import PRIMITIVES
from tests.dist_harness import run_on_gloo

# The rule, written out (docs/api.md, "Dtypes of reductions"): the specification the code is checked
# against.
FLOATS = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
COMPLEX = {torch.complex64, torch.complex128}
INTS = {torch.int8, torch.uint8, torch.int32, torch.int64}
EXPECTED = {
    "sum": FLOATS | COMPLEX | INTS,
    "mean": FLOATS | COMPLEX,
    "max": FLOATS | INTS | {torch.bool},
    "min": FLOATS | INTS | {torch.bool},
}

OPS: dict[str, tuple[str, Callable[[Tensor, fd.Mesh], Tensor]]] = {
    "psum": ("sum", lambda x, mesh: fd.psum(x, mesh, "tp")),
    "pmean": ("mean", lambda x, mesh: fd.pmean(x, mesh, "tp")),
    "pmax": ("max", lambda x, mesh: fd.pmax(x, mesh, "tp")),
    "pmin": ("min", lambda x, mesh: fd.pmin(x, mesh, "tp")),
    "psum_scatter": ("sum", lambda x, mesh: fd.psum_scatter(x, mesh, "tp")),
    "reduce_scatter_v": (
        "sum",
        lambda x, mesh: fd.reduce_scatter_v(x, mesh, "tp", [1, 3], capacity=3),
    ),
}


def _creatable() -> list[torch.dtype]:
    """Every dtype torch can make a (2, 4) tensor of (quantized dtypes cannot)."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        for d in sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str):
            try:
                torch.zeros(2, 4, dtype=d)
            except (RuntimeError, NotImplementedError):
                continue
            out.append(d)
    return out


DTYPES = _creatable()


def inputs(dtype: torch.dtype) -> Tensor:
    """Two ranks' values (2, 4): small integers, exact in every allowed dtype (a mean of two:
    halves)."""
    base = torch.tensor([[0.0, 3.0, 1.0, 2.0], [2.0, 1.0, 3.0, 0.0]])
    if dtype.is_complex:
        return torch.complex(base, base.flip(1)).to(dtype)
    if dtype == torch.bool:
        return base > 1
    return base.to(dtype)


def reference(op: str, x: Tensor) -> Tensor:
    """Each rank's result (stacked), computed in float64 / complex128 and cast back."""
    wide = x.to(torch.complex128 if x.is_complex() else torch.float64)
    total = wide.sum(0)
    out = {
        "psum": lambda: total.expand(2, 4),
        "pmean": lambda: wide.mean(0).expand(2, 4),
        "pmax": lambda: wide.amax(0).expand(2, 4),
        "pmin": lambda: wide.amin(0).expand(2, 4),
        "psum_scatter": lambda: total.reshape(2, 2),
        "reduce_scatter_v": lambda: torch.stack(
            [F.pad(total[:1], (0, 2)), total[1:]]
        ),  # sizes [1, 3], capacity 3
    }[op]()
    return out.to(x.dtype)


def simulated(op: str, dtype: torch.dtype) -> tuple[str, Any]:
    """``("ok", stacked result)`` or ``("refused", message)`` on two simulated ranks."""
    mesh = fd.Mesh({"tp": 2})
    x = inputs(dtype) if dtype in EXPECTED[OPS[op][0]] else torch.zeros(2, 4, dtype=dtype)
    try:
        return "ok", fd.simulate(lambda t: OPS[op][1](t, mesh), mesh)(x)
    except fd.ReductionDtypeError as e:
        return "refused", str(e)


def test_every_reducing_primitive_declares_its_kind_and_is_covered_here() -> None:
    """A new reduction must declare ``reduces=`` (and so pass through the rule) and be added to
    OPS."""
    declared = {
        name: p.reduces
        for name, p in PRIMITIVES.items()
        if p.reduces is not None and name != "select_extreme"
    }
    assert declared == {op: kind for op, (kind, _) in OPS.items()}


@pytest.mark.parametrize("op", list(OPS))
def test_each_reduction_follows_the_rule_on_simulated_ranks(op: str) -> None:
    kind, fn = OPS[op]
    mesh = fd.Mesh({"tp": 2})
    step = fd.simulate(lambda t: fn(t, mesh), mesh)
    assert len(DTYPES) > 20  # every float, int, uint, complex, fp8, bits type
    for dtype in DTYPES:
        outcome, value = simulated(op, dtype)
        if dtype in EXPECTED[kind]:
            assert outcome == "ok", (dtype, value)
            want = reference(op, inputs(dtype))
            assert value.dtype == dtype and torch.equal(value, want), (dtype, value, want)
            continue
        assert outcome == "refused", dtype
        with pytest.raises(fd.ReductionDtypeError) as info:
            step(torch.zeros(2, 4, dtype=dtype))
        e = info.value
        assert (e.op, e.axis, e.dtype, e.reduction, e.rank) == (op, "tp", dtype, kind, "every rank")
        assert (
            isinstance(e, fd.CollectiveError)
            and isinstance(e, ValueError)
            and isinstance(e, TypeError)
        )
        assert str(e).startswith(
            f"fastdist.{op}(axis='tp') on every rank: cannot "
        ) and f" {dtype} tensors ({kind} reductions take " in str(e)
        assert str(e).endswith(f"Fix: {e.fix}") and e.fix


@pytest.mark.parametrize(
    "op, dtype, fix",
    [
        (
            "reduce_scatter_v",
            torch.bool,
            r"cannot sum torch.bool tensors.*Fix: cast to an integer dtype to count "
            r"\(x.int\(\)\), or use pmax / pmin",
        ),
        (
            "psum",
            torch.bool,
            r"cannot sum torch.bool tensors.*Fix: cast to an integer dtype to count",
        ),
        (
            "pmean",
            torch.bool,
            r"cannot average torch.bool tensors.*Fix: cast with x.float\(\) first \(the fraction "
            r"of ranks",
        ),
        (
            "pmean",
            torch.int64,
            r"cannot average torch.int64 tensors.*Fix: cast with x.float\(\) first, or psum and "
            r"divide",
        ),
        (
            "pmax",
            torch.complex64,
            r"cannot take the maximum of torch.complex64 tensors.*Fix: complex numbers are not "
            r"ordered",
        ),
        ("psum_scatter", torch.int16, r"cannot sum torch.int16 tensors.*Fix: cast to int32 first"),
        (
            "pmin",
            torch.uint32,
            r"cannot take the minimum of torch.uint32 tensors.*Fix: cast to int64 first",
        ),
        (
            "psum",
            torch.float8_e4m3fn,
            r"cannot sum torch.float8_e4m3fn tensors.*Fix: upcast to bfloat16 or float32, reduce, "
            r"and cast back",
        ),
        (
            "psum",
            torch.complex32,
            r"cannot sum torch.complex32 tensors.*Fix: cast to complex64 first",
        ),
    ],
)
def test_the_fix_names_the_cast(op: str, dtype: torch.dtype, fix: str) -> None:
    outcome, message = simulated(op, dtype)
    assert outcome == "refused"
    assert re.search(fix, message), message


def test_bool_or_and_any_through_pmax_and_pmin() -> None:
    mesh = fd.Mesh({"tp": 3})
    x = torch.tensor([[True, False, False], [False, False, True], [False, False, True]])
    got = fd.simulate(
        lambda t: torch.stack([fd.pmax(t, mesh, "tp"), fd.pmin(t, mesh, "tp")]), mesh
    )(x)
    # every rank: [any over ranks, all over ranks]
    assert all(g.tolist() == [[True, False, True], [False, False, False]] for g in got)


# Every v-op with row counts that are not integers (the same on every rank), and reduce_scatter_v on
# bool; x holds each rank's rows.
V_OPS: dict[str, Callable[[Tensor, fd.Mesh], Any]] = {
    "all_gather_v": lambda x, mesh: fd.all_gather_v(x, mesh, "tp", [1.9, 2.5]),
    "reduce_scatter_v": lambda x, mesh: fd.reduce_scatter_v(x, mesh, "tp", [1, 2.0], capacity=2),
    "gather_v": lambda x, mesh: fd.gather_v(
        x, mesh, "tp", [torch.tensor(1.0), 2], dst=0, capacity=3
    ),
    "scatter_v": lambda x, mesh: fd.scatter_v(x, mesh, "tp", [1, np.float32(2)], src=0, capacity=2),
    "ragged_all_to_all": lambda x, mesh: fd.ragged_all_to_all(
        x, mesh, "tp", torch.tensor([1.0, 1.0]), capacity=3
    )[0],
    "indexed_all_to_all_v": lambda x, mesh: fd.indexed_all_to_all_v(
        x, mesh, "tp", torch.arange(3), torch.tensor([1.5, 1.5]), capacity=3
    )[0],
    "exchange_sizes": lambda x, mesh: fd.exchange_sizes(2.5, mesh, "tp"),
    "exchange_sizes tensor": lambda x, mesh: fd.exchange_sizes(torch.tensor(2.5), mesh, "tp"),
    "reduce_scatter_v bool": lambda x, mesh: fd.reduce_scatter_v(
        x > 0, mesh, "tp", [1, 2], capacity=2
    ),
}
V_OP_PROBLEMS = {  # what each message says is wrong
    "all_gather_v": "sizes[0] = 1.9 is a float, not an integer row count",
    "reduce_scatter_v": "sizes[1] = 2.0 is a float, not an integer row count",
    "gather_v": "sizes[0] = tensor(1.) is a 0-d torch.float32 tensor, not an integer row count",
    "scatter_v": "sizes[1] = np.float32(2.0) is a float32, not an integer row count",
    "ragged_all_to_all": "send_sizes has dtype torch.float32, but row counts are integers (they "
    "are never truncated)",
    "indexed_all_to_all_v": "send_sizes has dtype torch.float32, but row counts are integers "
    "(they are never truncated)",
    "exchange_sizes": "local_size = 2.5 is a float, not an integer row count",
    "exchange_sizes tensor": "local_size has dtype torch.float32, but a row count is an integer",
    "reduce_scatter_v bool": "cannot sum torch.bool tensors (sum reductions take",
}


def v_op_refusals(call: Callable[[Tensor], Any]) -> dict[str, tuple[str, str] | None]:
    """``{v-op: (error type, message)}`` of ``call(fn)`` for each entry of V_OPS (None where
    nothing was raised)."""
    out: dict[str, tuple[str, str] | None] = {}
    for name, fn in V_OPS.items():
        try:
            call(fn)
            out[name] = None
        except fd.CollectiveError as e:
            out[name] = (type(e).__name__, str(e))
    return out


def test_v_ops_refuse_non_integer_sizes_on_simulated_ranks() -> None:
    mesh = fd.Mesh({"tp": 2})
    for name, got in v_op_refusals(
        lambda fn: fd.simulate(lambda t: fn(t, mesh), mesh)(torch.ones(2, 3, 2))
    ).items():
        assert got is not None, name
        kind, msg = got
        assert kind == ("ReductionDtypeError" if "bool" in name else "CollectiveError"), got
        op = re.match(
            rf"fastdist\.(\w+)\(axis='tp'\) on every rank: {re.escape(V_OP_PROBLEMS[name])}", msg
        )
        assert op is not None and op.group(1) in {
            name.split()[0],
            "ragged_all_to_all" if name == "indexed_all_to_all_v" else "",
        }, msg


# ------------------------------------------------------------------ real ranks: gloo and the ctypes
# backend
def gloo_reductions(lib: str | None) -> dict[Any, Any]:
    """Every (op, dtype) on a gloo mesh (and the fake-NCCL ctypes mesh): ``("ok", tensor)`` or
    ``("refused", message)``."""
    meshes = {"gloo": fd.connect(tp=2, timeout=60)}
    if lib is not None:
        meshes["nccl-ctypes"] = fd.connect(tp=2, timeout=60, backend="nccl-ctypes", library=lib)
    out: dict[Any, Any] = {}
    for backend, mesh in meshes.items():
        for op, (kind, fn) in OPS.items():
            for dtype in DTYPES:
                x = (
                    inputs(dtype)[mesh.rank]
                    if dtype in EXPECTED[kind]
                    else torch.zeros(4, dtype=dtype)
                )
                try:
                    out[backend, op, str(dtype)] = ("ok", fn(x, mesh))
                except fd.ReductionDtypeError as e:
                    out[backend, op, str(dtype)] = ("refused", str(e))
        try:
            fd.all_gather_v(torch.zeros(3, 2), mesh, "tp", [1.9, 2.5])
        except fd.CollectiveError as e:
            out[backend, "sizes"] = str(e)
        # every rank raises each v-op's error locally, before any communication
        t0 = time.monotonic()
        out[backend, "v-ops"] = v_op_refusals(lambda fn: fn(torch.ones(3, 2), mesh))  # noqa: B023 - called at once
        out[backend, "v-ops seconds"] = time.monotonic() - t0
        out[backend, "after"] = fd.psum(
            torch.ones(1), mesh, "tp"
        ).item()  # and no rank is left in a collective
    if lib is not None:
        out["calls"] = sorted({line.split()[0] for line in fake.call_log(lib)})
        fd.comm.close(meshes["nccl-ctypes"])
    return out


def at_rank(message: str, rank: int) -> str:
    """A simulated rank's argument error as real rank ``rank`` words it."""
    assert " on every rank: " in message, message
    return message.replace(" on every rank: ", f" on rank {rank}: ", 1)


def test_real_ranks_follow_the_same_rule(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same values and the same messages as simulated ranks, over gloo and over ctypes NCCL (the
    fake library, when gcc is here)."""
    lib = fake.build(tmp_path / "lib") if shutil.which("gcc") else None
    monkeypatch.setenv("FAKECOMM_DIR", str(tmp_path))
    ranks = run_on_gloo(gloo_reductions, 2, lib, timeout=120)
    backends = ["gloo"] if lib is None else ["gloo", "nccl-ctypes"]
    for op in OPS:
        for dtype in DTYPES:
            outcome, value = simulated(op, dtype)
            for backend in backends:
                for r, got in enumerate(ranks):
                    g_outcome, g_value = got[backend, op, str(dtype)]
                    assert g_outcome == outcome, (backend, op, dtype, r, g_value)
                    if outcome == "ok":
                        assert g_value.dtype == dtype and torch.equal(g_value, value[r]), (
                            backend,
                            op,
                            dtype,
                            r,
                            g_value,
                            value[r],
                        )
                    else:
                        # the very message of the simulated ranks, naming the rank it ran on
                        assert g_value == at_rank(value, r), (backend, r)
    for r, got in enumerate(ranks):
        for backend in backends:
            assert got[backend, "sizes"] == (
                f"fastdist.all_gather_v(axis='tp') on rank {r}: sizes[0] = 1.9 is a float, not an "
                "integer row count. Fix: pass Python ints (numpy ints and 0-d integer tensors also "
                "do); round explicitly (int(round(s))) if you computed them as floats"
            )
    mesh = fd.Mesh({"tp": 2})
    want = v_op_refusals(lambda fn: fd.simulate(lambda t: fn(t, mesh), mesh)(torch.ones(2, 3, 2)))
    for r, got in enumerate(ranks):
        for backend in backends:
            # every v-op: the very messages of the simulated ranks (checked above), at rank r
            assert got[backend, "v-ops"] == {
                k: None if v is None else (v[0], at_rank(v[1], r)) for k, v in want.items()
            }
            # all nine, at once: the mesh's timeout is 60 s
            assert got[backend, "v-ops seconds"] < 2, got[backend, "v-ops seconds"]
            assert got[backend, "after"] == 2.0
    if lib is None:
        pytest.skip("the ctypes half needs gcc to build the fake NCCL library")
    for got in ranks:
        assert {"ncclAllReduce", "ncclReduceScatter", "ncclReduce"} <= set(got["calls"]), got[
            "calls"
        ]


def test_the_ctypes_communicator_applies_the_rule_itself(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Called directly (no public op in front): complex travels as its real view, bool max as
    uint8; refused dtypes raise the rule's error."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the fake NCCL library")
    path = fake.build(tmp_path / "lib")
    monkeypatch.setenv("FAKECOMM_DIR", str(tmp_path))
    comm = NativeCommunicator.create(
        load_library("nccl", path),
        n=1,
        index=0,
        exchange=lambda b: b if b is not None else b"",
        label="tp",
        ranks=[0],
        rank=0,
    )
    z = torch.complex(torch.arange(6.0), -torch.arange(6.0)).reshape(3, 2)
    fake.clear_log(path)
    assert torch.equal(comm.all_reduce("psum", z, "sum"), z)
    assert torch.equal(comm.all_reduce("pmean", z.conj(), "avg"), z.conj())
    assert torch.equal(comm.reduce_scatter_rows("psum_scatter", z), z)
    assert torch.equal(comm.reduce_scatter_v_rows("reduce_scatter_v", z, [3]), z)
    b = torch.tensor([True, False, True])
    assert torch.equal(comm.all_reduce("pmax", b, "max"), b)
    log = [line for line in fake.call_log(path) if not line.startswith("ncclGroup")]
    assert [line.split()[0] for line in log] == [
        "ncclAllReduce",
        "ncclAllReduce",
        "ncclReduceScatter",
        "ncclReduce",
        "ncclAllReduce",
    ]
    # complex64: 6 numbers as 12 float32
    assert all("count=12 dtype=7" in line for line in log[:4]), log
    assert "count=3 dtype=1 op=2" in log[4], log  # bool max: 3 uint8
    for x, red, match in [
        (
            b,
            "sum",
            r"fastdist.psum\(axis='tp'\) on rank 0: cannot sum torch.bool tensors.*Fix: cast to "
            r"an integer dtype",
        ),
        (z, "max", r"on rank 0: cannot take the maximum of torch.complex64 tensors"),
        (
            z,
            "prod",
            r"on rank 0: cannot multiply torch.complex64 tensors.*their product is not elementwise",
        ),
        (torch.ones(2, dtype=torch.int32), "avg", r"on rank 0: cannot average torch.int32 tensors"),
        (
            torch.ones(2, dtype=torch.int16),
            "sum",
            r"on rank 0: cannot sum torch.int16 tensors.*cast to int32",
        ),
    ]:
        with pytest.raises(fd.ReductionDtypeError, match=match):
            comm.all_reduce("psum", x, red)
    assert comm.close()
