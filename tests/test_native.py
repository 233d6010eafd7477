"""The ctypes NCCL/HCCL backend, on CPU: binding tables, discovery, loading, and the real call path
through fastdist's host-memory fake library (built here with gcc)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import fastdist as fd
from fastdist.comm.native import (
    HCCL,
    NCCL,
    SPECS,
    NativeCommunicator,
    decode_nccl_version,
    fake,
    find_library,
    load_library,
)
from fastdist.comm.native.library import NativeLibrary, _open

from .dist_harness import ROOT, expect_ok, run_world

needs_gcc = pytest.mark.skipif(
    shutil.which("gcc") is None, reason="needs gcc to build the fake library"
)


@pytest.fixture(scope="module")
def fakelib(tmp_path_factory: pytest.TempPathFactory) -> str:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the fake library")
    return fake.build(tmp_path_factory.mktemp("fakenccl"))


@pytest.fixture(autouse=True)
def _rendezvous_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKECOMM_DIR", str(tmp_path))


def _names(log: list[str]) -> list[str]:
    return [line.split()[0] for line in log]


def _fields(line: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in line.split()[1:])


# ============================================================================ the tables (pure
# data)
ISSUE_NCCL = [
    "GetErrorString",
    "GetVersion",
    "GetUniqueId",
    "CommInitRank",
    "CommDestroy",
    "CommAbort",
    "AllReduce",
    "AllGather",
    "ReduceScatter",
    "Broadcast",
    "Reduce",
    "Send",
    "Recv",
    "GroupStart",
    "GroupEnd",
]
ISSUE_HCCL = [
    "GetRootInfo",
    "CommInitRootInfo",
    "AllReduce",
    "Broadcast",
    "AllGather",
    "ReduceScatter",
    "Send",
    "Recv",
    "CommDestroy",
]
# argument counts from nccl.h / hccl.h
ARITY = {
    "ncclAllReduce": 7,
    "ncclAllGather": 6,
    "ncclReduceScatter": 7,
    "ncclBroadcast": 7,
    "ncclReduce": 8,
    "ncclSend": 6,
    "ncclRecv": 6,
    "ncclCommInitRank": 4,
    "ncclGroupStart": 0,
    "HcclAllReduce": 7,
    "HcclBroadcast": 6,
    "HcclAllGather": 6,
    "HcclReduceScatter": 7,
    "HcclReduce": 8,
    "HcclSend": 6,
    "HcclRecv": 6,
    "HcclCommInitRootInfo": 4,
    "HcclAlltoAllV": 10,
}


def _is_ctype(t: Any) -> bool:
    return isinstance(t, type) and issubclass(
        t, (ctypes._SimpleCData, ctypes.Structure, ctypes._Pointer)
    )  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "spec,prefix,required", [(NCCL, "nccl", ISSUE_NCCL), (HCCL, "Hccl", ISSUE_HCCL)]
)
def test_binding_table_is_complete_and_well_formed(
    spec: Any, prefix: str, required: list[str]
) -> None:
    names = [f.name for f in spec.functions]
    assert len(names) == len(set(names))
    assert {prefix + r for r in required} <= set(names)
    for f in spec.functions:
        assert f.name.startswith(prefix) and (f.restype is None or _is_ctype(f.restype)), f
        assert all(_is_ctype(a) for a in f.argtypes), f
        assert f.since is None or (len(f.since) == 3 and not f.optional), f
        if f.name in ARITY:
            assert len(f.argtypes) == ARITY[f.name], f.name
    assert spec.error_string in names and (
        spec.version_function is None or spec.version_function in names
    )
    assert ctypes.sizeof(spec.id_type) == {"nccl": 128, "hccl": 4108}[spec.kind]
    assert [f.since for f in NCCL.functions if f.name.startswith("ncclCommWindow")] == [
        (2, 27, 0)
    ] * 2  # window registration is gated


def test_dtype_and_reduce_op_enums_match_the_headers() -> None:
    t = torch
    assert dict(NCCL.dtypes) == {
        t.int8: 0,
        t.uint8: 1,
        t.int32: 2,
        t.uint32: 3,
        t.int64: 4,
        t.uint64: 5,
        t.float16: 6,
        t.float32: 7,
        t.float64: 8,
        t.bfloat16: 9,
    }
    assert dict(NCCL.reduce_ops) == {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
    assert dict(HCCL.dtypes) == {
        t.int8: 0,
        t.int16: 1,
        t.int32: 2,
        t.float16: 3,
        t.float32: 4,
        t.int64: 5,
        t.uint64: 6,
        t.uint8: 7,
        t.uint16: 8,
        t.uint32: 9,
        t.float64: 10,
        t.bfloat16: 11,
    }
    assert dict(HCCL.reduce_ops) == {"sum": 0, "prod": 1, "max": 2, "min": 3}
    # fp8 travels as uint8
    assert all(d not in NCCL.dtypes for d in (t.float8_e4m3fn, t.float8_e5m2))


def test_nccl_version_decoding_covers_both_encodings() -> None:
    assert decode_nccl_version(22703) == (2, 27, 3)
    assert decode_nccl_version(21805) == (2, 18, 5)
    assert decode_nccl_version(2804) == (2, 8, 4)  # before 2.9: major * 1000 + minor * 100 + patch
    assert decode_nccl_version(20900) == (2, 9, 0)


# ============================================================================ discovery
def _nowhere() -> list[str]:
    return []


def _no_wheel(_: Any) -> None:
    return None


@needs_gcc
def test_discovery_order_path_then_env_then_loaded_then_wheel_then_soname(tmp_path: Path) -> None:
    a, b, c, d = (fake.build(tmp_path / n) for n in "abcd")
    loaded = lambda: ["/usr/lib/libc.so.6", c]  # noqa: E731
    wheel = lambda w: d  # noqa: E731
    env = {"FASTDIST_NCCL_LIBRARY": b}
    assert find_library("nccl", a, environ=env, loaded=loaded, wheel_file=wheel) == a
    assert find_library("nccl", environ=env, loaded=loaded, wheel_file=wheel) == b
    assert find_library("nccl", environ={}, loaded=loaded, wheel_file=wheel) == c
    assert find_library("nccl", environ={}, loaded=_nowhere, wheel_file=wheel) == d
    # the soname through the dynamic loader (LD_LIBRARY_PATH is read at process start: use a child)
    code = (
        "from fastdist.comm.native import find_library; print(find_library('nccl', environ={}, "
        "loaded=lambda: [], wheel_file=lambda w: None))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "LD_LIBRARY_PATH": str(Path(a).parent)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "libnccl.so.2"


@needs_gcc
def test_hccl_is_found_in_the_cann_toolkit(tmp_path: Path) -> None:
    lib = fake.build(tmp_path / "lib64", name="libhccl.so")
    assert find_library("hccl", environ={"ASCEND_HOME_PATH": str(tmp_path)}, loaded=_nowhere) == lib
    with pytest.raises(
        fd.LibraryNotFoundError,
        match=r"ASCEND_HOME_PATH/lib64/libhccl.so: .*nowhere/lib64/libhccl.so: no such file",
    ):
        find_library(
            "hccl", environ={"ASCEND_HOME_PATH": str(tmp_path / "nowhere")}, loaded=_nowhere
        )


def test_not_found_message_lists_every_place_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(fd.LibraryNotFoundError) as e:
        find_library("nccl", environ={}, loaded=_nowhere, wheel_file=_no_wheel)
    msg = str(e.value)
    for part in (
        "library= argument: not given",
        "$FASTDIST_NCCL_LIBRARY: not set",
        "already loaded",
        "nvidia.nccl wheel: not installed",
        "libnccl.so.2",
        "Fix:",
        "FASTDIST_NCCL_LIBRARY=/path/to/libnccl.so.2",
        "pip install nvidia-nccl",
    ):
        assert part in msg, part
    assert e.value.kind == "nccl" and len(e.value.tried) >= 5
    with pytest.raises(fd.LibraryNotFoundError, match="FASTDIST_HCCL_LIBRARY"):
        find_library("hccl", environ={}, loaded=_nowhere)


def test_a_named_library_that_does_not_load_is_an_error_not_skipped(tmp_path: Path) -> None:
    missing = str(tmp_path / "libnccl.so.2")
    with pytest.raises(fd.LibraryError, match=r"library='.*libnccl.so.2' does not load"):
        find_library("nccl", missing, loaded=_nowhere)
    with pytest.raises(
        fd.LibraryError, match=r"\$FASTDIST_NCCL_LIBRARY=.* does not load.*or unset it"
    ):
        find_library("nccl", environ={"FASTDIST_NCCL_LIBRARY": missing}, loaded=_nowhere)
    with pytest.raises(fd.LibraryError, match="unknown native library"):
        load_library("mpi")


# ============================================================================ loading and version
# gating
@needs_gcc
def test_version_gating_and_missing_symbols(tmp_path: Path) -> None:
    old = load_library("nccl", fake.build(tmp_path / "old", version=22105, window=True))
    assert old.version == (2, 21, 5) and not old.has("ncclCommWindowRegister")
    assert "needs NCCL >= 2.27.0, this is 2.21.5" in old.unbound["ncclCommWindowRegister"]
    with pytest.raises(
        fd.LibraryError, match="ncclCommWindowRegister is not available.*needs NCCL >= 2.27.0"
    ):
        old.fn("ncclCommWindowRegister")
    new = load_library("nccl", fake.build(tmp_path / "new", version=22703, window=True))
    assert (
        new.has("ncclCommWindowRegister")
        and new.has("ncclGetLastError")
        and new.has("ncclCommAbort")
    )
    bare = load_library("nccl", fake.build(tmp_path / "bare", version=22703))
    assert bare.unbound["ncclCommWindowRegister"] == "not exported by this library"
    # a library that is not NCCL at all (vllm #4257: "ncclGetVersion undefined")
    src = tmp_path / "other.c"
    src.write_text("int not_nccl(void) { return 0; }\n")
    other = tmp_path / "libother.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(other), str(src)], check=True)
    with pytest.raises(fd.LibraryError, match="does not export ncclGetVersion. Is it really NCCL"):
        load_library("nccl", str(other))


def test_each_library_is_loaded_and_bound_once_per_path(fakelib: str) -> None:
    assert load_library("nccl", fakelib) is load_library("nccl", fakelib)
    assert _open(fakelib) is _open(fakelib)
    lib = load_library("nccl", fakelib)
    assert lib.device_type == "cpu" and lib.spec is NCCL and "2.21.5" in repr(lib)
    hl = load_library("hccl", fakelib)
    assert (
        hl.spec is SPECS["hccl"]
        and hl.version is None
        and hl.has("HcclAlltoAllV")
        and hl.has("HcclGroupStart")
    )


# ============================================================================ one communicator in
# this process (one member)
def _solo(lib: NativeLibrary) -> NativeCommunicator:
    return NativeCommunicator.create(
        lib,
        n=1,
        index=0,
        exchange=lambda b: b if b is not None else b"",
        label="tp",
        ranks=[0],
        rank=0,
    )


@pytest.mark.parametrize("kind", ["nccl", "hccl"])
def test_every_op_through_ctypes_on_one_member(fakelib: str, kind: str) -> None:
    lib = load_library(kind, fakelib)
    fake.clear_log(fakelib)
    comm = _solo(lib)
    init = fake.call_log(fakelib)
    first = "ncclGetUniqueId" if kind == "nccl" else "HcclGetRootInfo"
    assert _names(init)[:3] == [
        first,
        "ncclCommInitRank" if kind == "nccl" else "HcclCommInitRootInfo",
        "ncclAllReduce" if kind == "nccl" else "HcclAllReduce",
    ]
    x = torch.randn(4, 3, dtype=torch.float64)
    for red in ("sum", "max", "min", "avg"):
        torch.testing.assert_close(comm.all_reduce("psum", x, red), x)
    torch.testing.assert_close(comm.all_gather_rows("all_gather", x), x)
    torch.testing.assert_close(comm.reduce_scatter_rows("psum_scatter", x), x)
    torch.testing.assert_close(comm.broadcast("broadcast", x, 0), x)
    torch.testing.assert_close(comm.all_to_all_rows("all_to_all", x, [4], [4]), x)
    torch.testing.assert_close(comm.all_gather_v_rows("all_gather_v", x, [3]), x[:3])
    torch.testing.assert_close(comm.reduce_scatter_v_rows("reduce_scatter_v", x[:2], [2]), x[:2])
    xb = torch.randn(5, dtype=torch.bfloat16)
    torch.testing.assert_close(comm.all_reduce("psum", xb, "sum"), xb)
    assert comm.close() and comm.closed
    with pytest.raises(fd.CommError, match="communicator was closed"):
        comm.all_reduce("psum", x, "sum")


def test_call_arguments_reach_the_library(fakelib: str) -> None:
    comm = _solo(load_library("nccl", fakelib))
    fake.clear_log(fakelib)
    comm.all_reduce("psum", torch.ones(6, dtype=torch.float32), "max")
    comm.all_gather_v_rows("all_gather_v", torch.ones(4, 2, dtype=torch.float16), [3])
    f8 = torch.arange(8.0).to(torch.float8_e5m2)
    torch.testing.assert_close(comm.all_gather_rows("all_gather", f8).float(), f8.float())
    torch.testing.assert_close(
        comm.all_to_all_rows("all_to_all", torch.arange(6).reshape(3, 2).to(torch.int16), [3], [3]),
        torch.arange(6).reshape(3, 2).to(torch.int16),
    )
    log = fake.call_log(fakelib)
    assert _names(log) == [
        "ncclAllReduce",
        "ncclGroupStart",
        "ncclBroadcast",
        "ncclGroupEnd",
        "ncclAllGather",
        "ncclGroupStart",
        "ncclSend",
        "ncclRecv",
        "ncclGroupEnd",
    ]
    ar, bc, ag, send = _fields(log[0]), _fields(log[2]), _fields(log[4]), _fields(log[6])
    assert (ar["count"], ar["dtype"], ar["op"], ar["stream"]) == ("6", "7", "2", "0x0")
    assert (bc["count"], bc["dtype"], bc["root"]) == ("6", "6", "0")  # 3 rows x 2, float16
    assert (ag["count"], ag["dtype"]) == ("8", "1")  # fp8 travels as uint8
    # int16 (no NCCL type): 6 x 2 bytes as uint8
    assert (send["count"], send["dtype"], send["peer"]) == (
        "12",
        "1",
        "0",
    )
    with pytest.raises(
        fd.ReductionDtypeError,
        match=r"fastdist.psum\(axis='tp'\) on rank 0: cannot sum torch.float8_e5m2 tensors.*Fix: "
        r"upcast",
    ):
        comm.all_reduce("psum", f8, "sum")
    with pytest.raises(fd.CommError, match="the tensor is on meta"):
        comm.all_reduce("psum", torch.ones(2, device="meta"), "sum")


def test_library_errors_name_op_axis_rank_and_text(fakelib: str) -> None:
    comm = _solo(load_library("nccl", fakelib))
    ctypes.CDLL(fakelib).fakecomm_fail_next(6)
    with pytest.raises(fd.CommError) as e:
        comm.all_gather_rows("all_gather", torch.ones(2))
    msg = str(e.value)
    assert (
        "fastdist.all_gather(axis='tp') on rank 0" in msg
        and "ncclAllGather returned 6" in msg
        and "injected failure" in msg
    )


def test_close_waits_a_bounded_time_for_a_blocking_abort(fakelib: str) -> None:
    comm = _solo(load_library("nccl", fakelib))
    dll = ctypes.CDLL(fakelib)
    dll.fakecomm_set_abort_delay_ms(3000)
    try:
        t0 = time.monotonic()
        with pytest.warns(
            RuntimeWarning, match="ncclCommAbort on rank 0.*did not return within 0.2 s"
        ):
            assert comm.close(timeout=0.2) is False
        assert time.monotonic() - t0 < 2.0
    finally:
        dll.fakecomm_set_abort_delay_ms(0)


# ============================================================================ mesh backend
# selection
def test_mesh_backend_argument_is_checked() -> None:
    from fastdist.comm.torch_comm import native_library

    with pytest.raises(
        fd.MeshError, match="unknown backend 'nccl'.*'torch', 'nccl-ctypes', 'hccl-ctypes'"
    ):
        native_library("nccl", None)
    with pytest.raises(fd.MeshError, match="library= only applies"):
        native_library("torch", "/x.so")
    assert native_library("torch", None) is None
    assert fd.Mesh({"tp": 2}).backend is None and fd.comm.close(fd.Mesh({"tp": 2}))


@pytest.mark.parametrize(
    "backend,world", [("nccl-ctypes", 2), ("nccl-ctypes", 4), ("hccl-ctypes", 2)]
)
def test_ops_on_the_ctypes_backend_match_simulate_across_processes(
    fakelib: str, tmp_path: Path, backend: str, world: int
) -> None:
    """Every op and v-op through the fake NCCL/HCCL between spawned processes == simulate (values
    and grads)."""
    env = {
        "FASTDIST_TEST_BACKEND": backend,
        "FASTDIST_TEST_LIBRARY": fakelib,
        "FAKECOMM_DIR": str(tmp_path),
    }
    results = expect_ok(run_world("native", world, env=env))
    pre = "nccl" if backend == "nccl-ctypes" else "Hccl"
    for r, res in enumerate(results):
        assert res["checks"] > 40 and res["backend"] == backend and res["closed"]
        # create_groups made the communicator: id, init, warm-up all-reduce (the id only on member
        # 0)
        init = [n for n in _names(res["after_create"])]
        assert init == (
            [f"{pre}GetUniqueId" if pre == "nccl" else "HcclGetRootInfo"] if r == 0 else []
        ) + ["ncclCommInitRank" if pre == "nccl" else "HcclCommInitRootInfo", f"{pre}AllReduce"]
        # no second init: the communicator is cached
        assert _names(res["psum"]) == [f"{pre}AllReduce"]
        agv = Counter(_names(res["agv"]))
        # one broadcast per root, grouped
        assert agv[f"{pre}Broadcast"] == world and agv[f"{pre}GroupStart"] == 1
        assert [_fields(line)["dtype"] for line in res["fp8"]] == [
            str(SPECS[pre.lower()].dtypes[torch.uint8])
        ]
        if world > 2:
            assert res["check"] is not None and "disagree" in res["check"]
        assert (
            res["compiled_error"] is not None
            and "not under torch.compile" in res["compiled_error"]
            and "backend='torch'" in res["compiled_error"]
        )


@needs_gcc
def test_id_exchange_over_gloo_and_over_a_stateless_group(fakelib: str, tmp_path: Path) -> None:
    env = {"FASTDIST_TEST_LIBRARY": fakelib, "FAKECOMM_DIR": str(tmp_path)}
    for value in expect_ok(run_world("native_exchange", 3, env=env)):
        assert value["same_id"] and value["sum"] == 0 + 1 + 2 and value["stateless_sum"] == 3


def test_info_reports_the_library_and_why_not(fakelib: str) -> None:
    env = {**os.environ, "FASTDIST_NCCL_LIBRARY": fakelib, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-m", "fastdist", "info"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"torch {torch.__version__}" in out and "gloo (cpu): available" in out
    assert f"nccl-ctypes: library {fakelib} (NCCL 2.21.5)" in out and "fake library" in out
    assert "hccl-ctypes: unavailable" in out and "FASTDIST_HCCL_LIBRARY: not set" in out
    from fastdist.tools.info import report

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "not bound: ncclCommWindowRegister (needs NCCL >= 2.27.0, this is 2.21.5)" in report(
            nccl_library=fakelib
        )


def _psum_over_fake_nccl(lib: str) -> list[float]:
    mesh = fd.connect(tp=2, backend="nccl-ctypes", library=lib)
    out = fd.psum(torch.tensor([1.0, 2.0]) * (mesh.rank + 1), mesh, "tp")
    calls = _names(fake.call_log(lib))
    assert "ncclAllReduce" in calls, calls
    fd.comm.close(mesh)
    return [float(v) for v in out]


def test_users_can_run_their_code_on_the_fake_library_with_run_on_gloo(fakelib: str) -> None:
    """The documented testing flow: fastdist.testing.run_on_gloo +
    fastdist.connect(backend='nccl-ctypes', library=fake)."""
    from fastdist.testing import run_on_gloo

    assert run_on_gloo(_psum_over_fake_nccl, 2, fakelib) == [[3.0, 6.0], [3.0, 6.0]]
