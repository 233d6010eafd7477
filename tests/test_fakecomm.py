"""Tests for the host-memory fake NCCL/HCCL library ``src/fastdist/comm/native/fakecomm.c``.

The library is built with gcc into a temporary directory and driven through ctypes: single
rank semantics, the call log, failure injection, the compile-time macros, several ranks as
threads of this process (groups, abort, timeout) and as spawned processes (every collective).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

if shutil.which("gcc") is None:
    pytest.skip("gcc is needed to build fakecomm.c", allow_module_level=True)

SOURCE = Path(__file__).resolve().parents[1] / "src" / "fastdist" / "comm" / "native" / "fakecomm.c"
T = TypeVar("T")

P = ctypes.POINTER
c_int, c_void_p, c_size_t, c_char_p = (
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_char_p,
)
c_uint32, c_uint64 = ctypes.c_uint32, ctypes.c_uint64


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class RootInfo(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 4108)]


NCCL_DT = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.uint32: 3, torch.int64: 4,
           torch.uint64: 5, torch.float16: 6, torch.float32: 7, torch.float64: 8,
           torch.bfloat16: 9, torch.float8_e4m3fn: 10, torch.float8_e5m2: 11}  # fmt: skip
HCCL_DT = {torch.int8: 0, torch.int16: 1, torch.int32: 2, torch.float16: 3, torch.float32: 4,
           torch.int64: 5, torch.uint64: 6, torch.uint8: 7, torch.uint16: 8, torch.uint32: 9,
           torch.float64: 10, torch.bfloat16: 11}  # fmt: skip
SUM, PROD, MAX, MIN, AVG = range(5)
SUCCESS, SYSTEM_ERROR, INVALID_ARGUMENT, INVALID_USAGE, REMOTE_ERROR = 0, 2, 4, 5, 6
HCCL_E_PARA, HCCL_E_INTERNAL, HCCL_E_TIMEOUT = 1, 4, 9

_COLL = [c_void_p, c_void_p, c_size_t, c_int]  # send, recv, count, dtype
_HCOLL = [c_void_p, c_void_p, c_uint64, c_int]
SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "ncclGetErrorString": (c_char_p, [c_int]),
    "ncclGetLastError": (c_char_p, [c_void_p]),
    "ncclGetVersion": (c_int, [P(c_int)]),
    "ncclGetUniqueId": (c_int, [P(UniqueId)]),
    "ncclCommInitRank": (c_int, [P(c_void_p), c_int, UniqueId, c_int]),
    "ncclCommDestroy": (c_int, [c_void_p]),
    "ncclCommAbort": (c_int, [c_void_p]),
    "ncclCommGetAsyncError": (c_int, [c_void_p, P(c_int)]),
    "ncclCommCount": (c_int, [c_void_p, P(c_int)]),
    "ncclCommUserRank": (c_int, [c_void_p, P(c_int)]),
    "ncclAllReduce": (c_int, [*_COLL, c_int, c_void_p, c_void_p]),
    "ncclAllGather": (c_int, [*_COLL, c_void_p, c_void_p]),
    "ncclReduceScatter": (c_int, [*_COLL, c_int, c_void_p, c_void_p]),
    "ncclBroadcast": (c_int, [*_COLL, c_int, c_void_p, c_void_p]),
    "ncclReduce": (c_int, [*_COLL, c_int, c_int, c_void_p, c_void_p]),
    "ncclSend": (c_int, [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
    "ncclRecv": (c_int, [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
    "ncclGroupStart": (c_int, []),
    "ncclGroupEnd": (c_int, []),
    "ncclCommWindowRegister": (c_int, [c_void_p, c_void_p, c_size_t, P(c_void_p), c_int]),
    "ncclCommWindowDeregister": (c_int, [c_void_p, c_void_p]),
    "HcclGetRootInfo": (c_int, [P(RootInfo)]),
    "HcclCommInitRootInfo": (c_int, [c_uint32, P(RootInfo), c_uint32, P(c_void_p)]),
    "HcclCommDestroy": (c_int, [c_void_p]),
    "HcclGetErrorString": (c_char_p, [c_int]),
    "HcclAllReduce": (c_int, [*_HCOLL, c_int, c_void_p, c_void_p]),
    "HcclBroadcast": (c_int, [c_void_p, c_uint64, c_int, c_uint32, c_void_p, c_void_p]),
    "HcclAllGather": (c_int, [*_HCOLL, c_void_p, c_void_p]),
    "HcclReduceScatter": (c_int, [*_HCOLL, c_int, c_void_p, c_void_p]),
    "HcclReduce": (c_int, [*_HCOLL, c_int, c_uint32, c_void_p, c_void_p]),
    "HcclSend": (c_int, [c_void_p, c_uint64, c_int, c_uint32, c_void_p, c_void_p]),
    "HcclRecv": (c_int, [c_void_p, c_uint64, c_int, c_uint32, c_void_p, c_void_p]),
    "HcclAlltoAllV": (
        c_int,
        [
            c_void_p,
            c_void_p,
            c_void_p,
            c_int,
            c_void_p,
            c_void_p,
            c_void_p,
            c_int,
            c_void_p,
            c_void_p,
        ],
    ),
    "HcclGroupStart": (c_int, []),
    "HcclGroupEnd": (c_int, []),
    "fakecomm_host_memory": (c_int, []),
    "fakecomm_log": (c_size_t, [c_char_p, c_size_t]),
    "fakecomm_log_clear": (None, []),
    "fakecomm_fail_next": (None, [c_int]),
    "fakecomm_set_timeout_ms": (None, [c_int]),
    "fakecomm_set_abort_delay_ms": (None, [c_int]),
}


def build(out_dir: Path, *flags: str) -> str:
    """Compile fakecomm.c with the documented command (warnings are errors) and return the library
    path."""
    out = out_dir / "libnccl.so.2"
    cmd = [
        "gcc",
        "-std=c11",
        "-D_GNU_SOURCE",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-O2",
        "-shared",
        "-fPIC",
        *flags,
    ]
    cmd += ["-o", str(out), str(SOURCE), "-lpthread"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    return str(out)


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in SIGNATURES.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    return lib


def last_error(lib: ctypes.CDLL) -> str:
    msg: bytes = lib.ncclGetLastError(None)
    return msg.decode()


def call_log(lib: ctypes.CDLL) -> list[str]:
    n = lib.fakecomm_log(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    assert lib.fakecomm_log(buf, n + 1) == n
    return buf.value.decode().splitlines()


def new_id(lib: ctypes.CDLL) -> UniqueId:
    uid = UniqueId()
    assert lib.ncclGetUniqueId(ctypes.byref(uid)) == SUCCESS
    return uid


def init(lib: ctypes.CDLL, uid: UniqueId, nranks: int, rank: int) -> int:
    comm = c_void_p()
    rc = lib.ncclCommInitRank(ctypes.byref(comm), nranks, uid, rank)
    assert rc == SUCCESS, last_error(lib)
    assert comm.value
    return comm.value


def hccl_init(lib: ctypes.CDLL, info: RootInfo, nranks: int, rank: int) -> int:
    comm = c_void_p()
    rc = lib.HcclCommInitRootInfo(nranks, ctypes.byref(info), rank, ctypes.byref(comm))
    assert rc == SUCCESS, last_error(lib)
    assert comm.value
    return comm.value


def u64s(values: Sequence[int]) -> Any:
    return (c_uint64 * len(values))(*values)


def addr(obj: Any) -> int:
    return ctypes.addressof(obj)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t``: exact comparison for every dtype (NaN, -0.0 and unsigned types
    included)."""
    return t.contiguous().view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def sample(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 8).to(dtype)
    lo = 0 if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64) else -100
    return torch.randint(lo, 100, (n,), generator=g, dtype=torch.int64).to(dtype)


def finite_halves(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Random bit patterns of a 16-bit float type (subnormals and huge values included), non-finite
    ones zeroed."""
    g = torch.Generator().manual_seed(seed)
    t = (
        torch.randint(-32768, 32768, (n,), generator=g, dtype=torch.int32)
        .to(torch.int16)
        .view(dtype)
    )
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def run_threads(
    lib: ctypes.CDLL, nranks: int, body: Callable[[int, int], T], *, timeout_ms: int = 10_000
) -> list[T]:
    """Run ``body(rank, comm)`` for every rank of one communicator, each rank in its own thread."""
    lib.fakecomm_set_timeout_ms(timeout_ms)
    uid = new_id(lib)
    results: list[Any] = [None] * nranks
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            comm = init(lib, uid, nranks, rank)
            try:
                results[rank] = body(rank, comm)
            finally:
                lib.ncclCommDestroy(comm)
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(nranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    return results


@pytest.fixture(scope="session")
def lib_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build(tmp_path_factory.mktemp("fakecomm"))


@pytest.fixture
def lib(lib_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    monkeypatch.setenv("FAKECOMM_DIR", str(tmp_path))
    lib = load(lib_path)
    lib.fakecomm_log_clear()
    lib.fakecomm_set_timeout_ms(60_000)
    lib.fakecomm_set_abort_delay_ms(0)
    return lib


@pytest.fixture
def comm(lib: ctypes.CDLL) -> Iterator[int]:
    c = init(lib, new_id(lib), 1, 0)
    yield c
    assert lib.ncclCommDestroy(c) == SUCCESS


# ---------------------------------------------------------------- single rank


def test_unique_id_names_a_fresh_directory(lib: ctypes.CDLL, tmp_path: Path) -> None:
    a, b = new_id(lib), new_id(lib)
    da, db = a.internal.decode(), b.internal.decode()
    assert da != db
    assert re.fullmatch(re.escape(str(tmp_path)) + r"/fakecomm-\w{6}", da) and Path(da).is_dir()
    assert ctypes.string_at(addr(a) + len(da), 128 - len(da)) == bytes(128 - len(da))  # zero-padded
    info = RootInfo()
    assert (
        lib.HcclGetRootInfo(ctypes.byref(info)) == SUCCESS and Path(info.internal.decode()).is_dir()
    )


def test_unique_id_path_too_long(
    lib: ctypes.CDLL, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKECOMM_DIR", str(tmp_path / ("d" * 120)))
    assert lib.ncclGetUniqueId(ctypes.byref(UniqueId())) == SYSTEM_ERROR
    assert "does not fit" in last_error(lib)


def test_init_validates_arguments(lib: ctypes.CDLL, tmp_path: Path) -> None:
    uid, comm = new_id(lib), c_void_p()
    for nranks, rank in [(0, 0), (2, 2), (2, -1)]:
        assert lib.ncclCommInitRank(ctypes.byref(comm), nranks, uid, rank) == INVALID_ARGUMENT
        assert "invalid rank" in last_error(lib)
    bad = UniqueId()
    bad.internal = str(tmp_path / "missing").encode()
    assert lib.ncclCommInitRank(ctypes.byref(comm), 1, bad, 0) == INVALID_ARGUMENT
    assert "rendezvous directory" in last_error(lib)


def test_comm_queries_and_error_strings(lib: ctypes.CDLL, comm: int) -> None:
    value = c_int(-1)
    assert lib.ncclCommCount(comm, ctypes.byref(value)) == SUCCESS and value.value == 1
    assert lib.ncclCommUserRank(comm, ctypes.byref(value)) == SUCCESS and value.value == 0
    value.value = 99
    assert lib.ncclCommGetAsyncError(comm, ctypes.byref(value)) == SUCCESS and value.value == 0
    assert lib.fakecomm_host_memory() == 1
    strings = [lib.ncclGetErrorString(rc).decode() for rc in [0, 1, 2, 3, 4, 5, 6, 7, 42]]
    assert strings == [
        "no error", "unhandled cuda error", "unhandled system error", "internal error",
        "invalid argument", "invalid usage", "remote process exited or there was a network error",
        "NCCL operation in progress", "unknown result code",
    ]  # fmt: skip
    assert (
        lib.HcclGetErrorString(1).decode() == "parameter error"
        and lib.HcclGetErrorString(9).decode() == "timeout"
    )


@pytest.mark.parametrize(
    "dtype", [d for d in NCCL_DT if d.itemsize > 1 or not d.is_floating_point], ids=str
)
@pytest.mark.parametrize("op", [SUM, PROD, MAX, MIN, AVG])
def test_single_rank_allreduce_is_identity(
    lib: ctypes.CDLL, comm: int, dtype: torch.dtype, op: int
) -> None:
    x = sample(dtype, 33, seed=op)
    out = torch.zeros_like(x)
    assert (
        lib.ncclAllReduce(x.data_ptr(), out.data_ptr(), 33, NCCL_DT[dtype], op, comm, None)
        == SUCCESS
    )
    assert same(out, x)
    y = x.clone()
    # in place
    assert (
        lib.ncclAllReduce(y.data_ptr(), y.data_ptr(), 33, NCCL_DT[dtype], op, comm, None) == SUCCESS
    )
    assert same(y, x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_conversions_round_trip_every_bit_pattern(
    lib: ctypes.CDLL, comm: int, dtype: torch.dtype
) -> None:
    raw = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    out = torch.empty(65536, dtype=dtype)
    assert (
        lib.ncclAllReduce(raw.data_ptr(), out.data_ptr(), 65536, NCCL_DT[dtype], AVG, comm, None)
        == SUCCESS
    )
    nan = torch.isnan(raw.view(dtype))
    quiet = 0x0200 if dtype == torch.float16 else 0x0040  # NaNs come back quiet, payload kept
    assert torch.equal(out.view(torch.int16), torch.where(nan, raw | quiet, raw))


def test_single_rank_other_collectives(lib: ctypes.CDLL, comm: int) -> None:
    x = torch.arange(10, dtype=torch.float32)
    out = torch.zeros(10)
    assert (
        lib.ncclAllGather(x.data_ptr(), out.data_ptr(), 10, NCCL_DT[torch.float32], comm, None)
        == SUCCESS
    )
    assert torch.equal(out, x)
    out.zero_()
    assert (
        lib.ncclReduceScatter(
            x.data_ptr(), out.data_ptr(), 10, NCCL_DT[torch.float32], SUM, comm, None
        )
        == SUCCESS
    )
    assert torch.equal(out, x)
    out.zero_()
    assert (
        lib.ncclBroadcast(x.data_ptr(), out.data_ptr(), 10, NCCL_DT[torch.float32], 0, comm, None)
        == SUCCESS
    )
    assert torch.equal(out, x)
    y = x.clone()
    assert (
        lib.ncclBroadcast(y.data_ptr(), y.data_ptr(), 10, NCCL_DT[torch.float32], 0, comm, None)
        == SUCCESS
    )
    assert torch.equal(y, x)
    out.zero_()
    assert (
        lib.ncclReduce(x.data_ptr(), out.data_ptr(), 10, NCCL_DT[torch.float32], MAX, 0, comm, None)
        == SUCCESS
    )
    assert torch.equal(out, x)
    # fp8 moves data but does not reduce
    f8 = torch.tensor([0.5, -2.0, 448.0], dtype=torch.float8_e4m3fn)
    g8 = torch.zeros_like(f8)
    assert (
        lib.ncclAllGather(f8.data_ptr(), g8.data_ptr(), 3, NCCL_DT[torch.float8_e4m3fn], comm, None)
        == SUCCESS
    )
    assert same(g8, f8)
    # count 0 is valid (and NULL buffers with it)
    assert [
        lib.ncclAllReduce(None, None, 0, 7, SUM, comm, None),
        lib.ncclAllGather(None, None, 0, 7, comm, None),
        lib.ncclReduceScatter(None, None, 0, 7, SUM, comm, None),
        lib.ncclBroadcast(None, None, 0, 7, 0, comm, None),
        lib.ncclReduce(None, None, 0, 7, SUM, 0, comm, None),
    ] == [SUCCESS] * 5


def test_single_rank_send_recv_to_self_in_a_group(lib: ctypes.CDLL, comm: int) -> None:
    a, b = torch.arange(4, dtype=torch.int64), torch.arange(4, 10, dtype=torch.int64)
    ra, rb = torch.zeros(4, dtype=torch.int64), torch.zeros(6, dtype=torch.int64)
    assert lib.ncclGroupStart() == SUCCESS
    # receive issued before the send
    assert lib.ncclRecv(ra.data_ptr(), 4, 4, 0, comm, None) == SUCCESS
    assert lib.ncclRecv(rb.data_ptr(), 6, 4, 0, comm, None) == SUCCESS
    assert lib.ncclSend(a.data_ptr(), 4, 4, 0, comm, None) == SUCCESS
    assert lib.ncclSend(b.data_ptr(), 6, 4, 0, comm, None) == SUCCESS
    assert not ra.any()  # deferred to the group end
    assert lib.ncclGroupEnd() == SUCCESS
    assert torch.equal(ra, a) and torch.equal(rb, b)
    # a receive of the wrong size is an invalid usage naming both sizes
    assert lib.ncclSend(a.data_ptr(), 4, 7, 0, comm, None) == SUCCESS
    assert lib.ncclRecv(rb.data_ptr(), 3, 7, 0, comm, None) == INVALID_USAGE
    assert "expected 12 bytes from rank 0 but rank 0 wrote 16 bytes" in last_error(lib)


def test_invalid_arguments(lib: ctypes.CDLL, comm: int) -> None:
    x = torch.zeros(4, dtype=torch.uint8)
    assert lib.ncclAllReduce(x.data_ptr(), x.data_ptr(), 4, 10, SUM, comm, None) == INVALID_ARGUMENT
    assert "fp8" in last_error(lib)
    assert (
        lib.ncclReduceScatter(x.data_ptr(), x.data_ptr(), 4, 11, MAX, comm, None)
        == INVALID_ARGUMENT
    )
    assert lib.ncclAllReduce(x.data_ptr(), x.data_ptr(), 1, 12, SUM, comm, None) == INVALID_ARGUMENT
    assert "data type" in last_error(lib)
    assert lib.ncclAllReduce(x.data_ptr(), x.data_ptr(), 4, 1, 5, comm, None) == INVALID_ARGUMENT
    assert "reduction op" in last_error(lib)
    assert lib.ncclBroadcast(x.data_ptr(), x.data_ptr(), 4, 1, 1, comm, None) == INVALID_ARGUMENT
    assert lib.ncclSend(x.data_ptr(), 4, 1, -1, comm, None) == INVALID_ARGUMENT
    assert lib.ncclAllReduce(x.data_ptr(), x.data_ptr(), 4, 1, SUM, None, None) == INVALID_ARGUMENT
    assert lib.ncclAllReduce(None, x.data_ptr(), 4, 1, SUM, comm, None) == INVALID_ARGUMENT
    assert lib.ncclGroupEnd() == INVALID_USAGE
    assert lib.HcclGroupEnd() == HCCL_E_PARA


def test_log_format(lib: ctypes.CDLL, comm: int) -> None:
    x, y = torch.ones(4), torch.zeros(4)
    lib.fakecomm_log_clear()
    assert lib.ncclGroupStart() == SUCCESS
    assert lib.ncclAllReduce(x.data_ptr(), y.data_ptr(), 4, 7, AVG, comm, 0x1234) == SUCCESS
    assert lib.ncclSend(x.data_ptr(), 4, 7, 0, comm, None) == SUCCESS
    assert lib.ncclRecv(y.data_ptr(), 4, 7, 0, comm, None) == SUCCESS
    assert lib.ncclGroupEnd() == SUCCESS
    px, py, pc = hex(x.data_ptr()), hex(y.data_ptr()), hex(comm)
    assert call_log(lib) == [
        "ncclGroupStart",
        f"ncclAllReduce send={px} recv={py} count=4 dtype=7 op=4 comm={pc} stream=0x1234",
        f"ncclSend send={px} count=4 dtype=7 peer=0 comm={pc} stream=0x0",
        f"ncclRecv recv={py} count=4 dtype=7 peer=0 comm={pc} stream=0x0",
        "ncclGroupEnd",
    ]
    small = ctypes.create_string_buffer(8)
    assert (
        lib.fakecomm_log(small, 8) == len("\n".join(call_log(lib))) + 1
        and small.value == b"ncclGro"
    )
    lib.fakecomm_log_clear()
    assert lib.fakecomm_log(None, 0) == 0


def test_fail_next(lib: ctypes.CDLL, comm: int) -> None:
    x, y = torch.ones(3), torch.zeros(3)
    lib.fakecomm_fail_next(REMOTE_ERROR)
    assert lib.ncclAllReduce(x.data_ptr(), y.data_ptr(), 3, 7, SUM, comm, None) == REMOTE_ERROR
    assert last_error(lib) == "fakecomm: injected failure" and not y.any()
    assert lib.ncclAllReduce(
        x.data_ptr(), y.data_ptr(), 3, 7, SUM, comm, None
    ) == SUCCESS and torch.equal(y, x)
    lib.fakecomm_fail_next(INVALID_USAGE)
    assert lib.ncclSend(x.data_ptr(), 3, 7, 0, comm, None) == INVALID_USAGE
    assert call_log(lib)[-1].startswith("ncclSend ")  # failed calls are logged too
    info = RootInfo()
    assert lib.HcclGetRootInfo(ctypes.byref(info)) == SUCCESS
    hcomm = hccl_init(lib, info, 1, 0)
    for nccl_rc, hccl_rc in [
        (REMOTE_ERROR, HCCL_E_TIMEOUT),
        (INVALID_ARGUMENT, HCCL_E_PARA),
        (3, HCCL_E_INTERNAL),
    ]:
        lib.fakecomm_fail_next(nccl_rc)
        assert lib.HcclAllReduce(x.data_ptr(), y.data_ptr(), 3, 4, 0, hcomm, None) == hccl_rc
    assert lib.HcclCommDestroy(hcomm) == SUCCESS


def test_hccl_single_rank(lib: ctypes.CDLL) -> None:
    info = RootInfo()
    assert lib.HcclGetRootInfo(ctypes.byref(info)) == SUCCESS
    hcomm = hccl_init(lib, info, 1, 0)
    x = torch.arange(6, dtype=torch.int16) - 3
    out = torch.zeros_like(x)
    assert lib.HcclAllReduce(
        x.data_ptr(), out.data_ptr(), 6, HCCL_DT[torch.int16], 2, hcomm, None
    ) == SUCCESS and torch.equal(out, x)
    assert lib.HcclAllGather(
        x.data_ptr(), out.data_ptr(), 6, 1, hcomm, None
    ) == SUCCESS and torch.equal(out, x)
    assert lib.HcclReduceScatter(
        x.data_ptr(), out.data_ptr(), 6, 1, 0, hcomm, None
    ) == SUCCESS and torch.equal(out, x)
    assert lib.HcclReduce(
        x.data_ptr(), out.data_ptr(), 6, 1, 3, 0, hcomm, None
    ) == SUCCESS and torch.equal(out, x)
    assert lib.HcclBroadcast(out.data_ptr(), 6, 1, 0, hcomm, None) == SUCCESS and torch.equal(
        out, x
    )
    # unknown dtype
    assert lib.HcclAllReduce(x.data_ptr(), out.data_ptr(), 6, 12, 0, hcomm, None) == HCCL_E_PARA
    # no avg in HCCL
    assert lib.HcclAllReduce(x.data_ptr(), out.data_ptr(), 6, 1, 4, hcomm, None) == HCCL_E_PARA
    assert lib.HcclBroadcast(out.data_ptr(), 6, 1, 1, hcomm, None) == HCCL_E_PARA
    assert lib.HcclCommDestroy(hcomm) == SUCCESS
    assert call_log(lib)[-1] == f"HcclCommDestroy comm={hex(hcomm)}"


def test_version_and_window_macros(lib: ctypes.CDLL, tmp_path: Path) -> None:
    version = c_int()
    assert lib.ncclGetVersion(ctypes.byref(version)) == SUCCESS and version.value == 22105
    assert not hasattr(lib, "ncclCommWindowRegister") and not hasattr(
        lib, "ncclCommWindowDeregister"
    )
    other = load(build(tmp_path, "-DFAKECOMM_VERSION=22703", "-DFAKECOMM_WINDOW"))
    assert other.ncclGetVersion(ctypes.byref(version)) == SUCCESS and version.value == 22703
    c = init(other, new_id(other), 1, 0)
    buf, win = torch.zeros(16), c_void_p()
    assert (
        other.ncclCommWindowRegister(c, buf.data_ptr(), 64, ctypes.byref(win), 1) == SUCCESS
        and win.value
    )
    assert other.ncclCommWindowDeregister(c, win) == SUCCESS
    assert call_log(other)[-2:] == [
        f"ncclCommWindowRegister comm={hex(c)} buff={hex(buf.data_ptr())} size=64 flags=1",
        f"ncclCommWindowDeregister comm={hex(c)} win={hex(win.value)}",
    ]
    assert other.ncclCommDestroy(c) == SUCCESS


def test_abort_delay(lib: ctypes.CDLL) -> None:
    c = init(lib, new_id(lib), 1, 0)
    lib.fakecomm_set_abort_delay_ms(200)
    t0 = time.monotonic()
    assert lib.ncclCommAbort(c) == SUCCESS
    assert time.monotonic() - t0 >= 0.19


# ---------------------------------------------------------------- several ranks as threads


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_sum_and_avg_round_like_torch(lib: ctypes.CDLL, dtype: torch.dtype) -> None:
    n, count = 3, 4096
    xs = [finite_halves(dtype, count, seed=r) for r in range(n)]
    acc = xs[0].float() + xs[1].float() + xs[2].float()  # rank order, in float32

    def body(rank: int, comm: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, a = torch.empty(count, dtype=dtype), torch.empty(count, dtype=dtype)
        assert (
            lib.ncclAllReduce(
                xs[rank].data_ptr(), s.data_ptr(), count, NCCL_DT[dtype], SUM, comm, None
            )
            == SUCCESS
        )
        assert (
            lib.ncclAllReduce(
                xs[rank].data_ptr(), a.data_ptr(), count, NCCL_DT[dtype], AVG, comm, None
            )
            == SUCCESS
        )
        return s, a

    for s, a in run_threads(lib, n, body):
        assert same(s, acc.to(dtype)) and same(a, (acc / n).to(dtype))


def test_hccl_collectives_across_threads(lib: ctypes.CDLL) -> None:
    n = 2
    info = RootInfo()
    assert lib.HcclGetRootInfo(ctypes.byref(info)) == SUCCESS
    xs = [torch.tensor([1, -2, 30000, -30000], dtype=torch.int16) * (r + 1) for r in range(n)]

    def body(rank: int, _: int) -> None:
        comm = hccl_init(lib, info, n, rank)
        x = xs[rank]
        out = torch.zeros(4, dtype=torch.int16)
        assert (
            lib.HcclAllReduce(x.data_ptr(), out.data_ptr(), 4, HCCL_DT[torch.int16], 0, comm, None)
            == SUCCESS
        )
        assert torch.equal(out, xs[0] + xs[1])  # wraps like int16
        assert (
            lib.HcclAllReduce(x.data_ptr(), out.data_ptr(), 4, HCCL_DT[torch.uint16], 2, comm, None)
            == SUCCESS
        )
        assert torch.equal(
            out.view(torch.uint16).to(torch.int64),
            torch.maximum(*(t.view(torch.uint16).to(torch.int64) for t in xs)),
        )
        gathered = torch.zeros(8, dtype=torch.int16)
        assert lib.HcclAllGather(x.data_ptr(), gathered.data_ptr(), 4, 1, comm, None) == SUCCESS
        assert torch.equal(gathered, torch.cat(xs))
        # prod
        assert (
            lib.HcclReduceScatter(gathered.data_ptr(), out.data_ptr(), 4, 1, 1, comm, None)
            == SUCCESS
        )
        assert torch.equal(out, (gathered * gathered)[rank * 4 : rank * 4 + 4])
        red = torch.zeros(4, dtype=torch.int16)
        assert (
            lib.HcclReduce(
                x.data_ptr(), red.data_ptr() if rank == 1 else None, 4, 1, 3, 1, comm, None
            )
            == SUCCESS
        )
        assert torch.equal(
            red, torch.minimum(*xs) if rank == 1 else torch.zeros(4, dtype=torch.int16)
        )
        buf = x.clone()
        assert lib.HcclBroadcast(buf.data_ptr(), 4, 1, 0, comm, None) == SUCCESS and torch.equal(
            buf, xs[0]
        )
        got = torch.zeros(4, dtype=torch.int16)
        assert lib.HcclGroupStart() == SUCCESS
        assert lib.HcclRecv(got.data_ptr(), 4, 1, 1 - rank, comm, None) == SUCCESS
        assert lib.HcclSend(x.data_ptr(), 4, 1, 1 - rank, comm, None) == SUCCESS
        assert lib.HcclGroupEnd() == SUCCESS and torch.equal(got, xs[1 - rank])
        assert lib.HcclCommDestroy(comm) == SUCCESS

    run_threads(lib, n, body)


def test_timeout_names_the_ranks(lib: ctypes.CDLL) -> None:
    def body(rank: int, comm: int) -> tuple[int, str, float]:
        if rank == 1:
            return 0, "", 0.0  # never joins the collective
        # after init: the waits in progress keep their own deadline
        lib.fakecomm_set_timeout_ms(300)
        x = torch.ones(2)
        t0 = time.monotonic()
        rc = lib.ncclAllReduce(x.data_ptr(), x.data_ptr(), 2, 7, SUM, comm, None)
        return rc, last_error(lib), time.monotonic() - t0

    rc, msg, took = run_threads(lib, 2, body)[0]
    assert rc == REMOTE_ERROR and 0.29 < took < 5
    assert msg == "fakecomm: rank 0 waited 300 ms for rank 1 in call #0 (ncclAllReduce)"


def test_abort_wakes_a_blocked_collective(lib: ctypes.CDLL) -> None:
    lib.fakecomm_set_timeout_ms(20_000)
    uid = new_id(lib)
    comms: list[int] = []
    t = threading.Thread(target=lambda: comms.append(init(lib, uid, 2, 1)))
    t.start()
    c0 = init(lib, uid, 2, 0)
    t.join()
    result: list[int] = []
    x = torch.ones(2)
    waiter = threading.Thread(
        target=lambda: result.append(
            lib.ncclAllReduce(x.data_ptr(), x.data_ptr(), 2, 7, SUM, c0, None)
        )
    )
    waiter.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    assert lib.ncclCommAbort(c0) == SUCCESS
    waiter.join(timeout=5)
    assert result == [REMOTE_ERROR] and time.monotonic() - t0 < 2
    assert "aborted" in last_error(lib)
    assert lib.ncclCommDestroy(comms[0]) == SUCCESS


# ---------------------------------------------------------------- several ranks as processes


def _rank_main(lib_path: str, rank: int, world: int, ids: Any, results: Any, tmp: str) -> None:
    """One rank of the multi-process test (runs in a spawned child)."""
    try:
        os.environ["FAKECOMM_DIR"] = tmp
        torch.set_num_threads(1)
        lib = load(lib_path)
        if rank == 0:
            uid, info = new_id(lib), RootInfo()
            assert lib.HcclGetRootInfo(ctypes.byref(info)) == SUCCESS
            for _ in range(world - 1):
                ids.put((ctypes.string_at(addr(uid), 128), ctypes.string_at(addr(info), 4108)))
        else:
            raw_id, raw_info = ids.get(timeout=60)
            uid, info = UniqueId.from_buffer_copy(raw_id), RootInfo.from_buffer_copy(raw_info)
        _scenario(lib, rank, world, init(lib, uid, world, rank), hccl_init(lib, info, world, rank))
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _scenario(lib: ctypes.CDLL, rank: int, n: int, comm: int, hcomm: int) -> None:
    def allreduce(xs: list[torch.Tensor], op: int) -> torch.Tensor:
        out = torch.empty_like(xs[rank])
        assert (
            lib.ncclAllReduce(
                xs[rank].data_ptr(), out.data_ptr(), out.numel(), NCCL_DT[out.dtype], op, comm, None
            )
            == SUCCESS
        )
        return out

    f32 = [sample(torch.float32, 100, seed=r) for r in range(n)]
    i32 = [sample(torch.int32, 100, seed=10 + r) for r in range(n)]
    i64 = [sample(torch.int64, 100, seed=20 + r) for r in range(n)]
    u8 = [sample(torch.uint8, 100, seed=30 + r) for r in range(n)]
    f16 = [finite_halves(torch.float16, 1000, seed=40 + r) for r in range(n)]
    bf16 = [finite_halves(torch.bfloat16, 1000, seed=50 + r) for r in range(n)]
    assert same(allreduce(f32, SUM), f32[0] + f32[1] + f32[2])
    assert same(allreduce(i32, MAX), torch.stack(i32).amax(0))
    assert same(allreduce(u8, MIN), torch.stack(u8).amin(0))
    assert same(allreduce(i64, AVG), torch.div(i64[0] + i64[1] + i64[2], 3, rounding_mode="trunc"))
    assert same(allreduce(i32, PROD), i32[0] * i32[1] * i32[2])
    for xs in (f16, bf16):
        acc = xs[0].float() + xs[1].float() + xs[2].float()
        assert same(allreduce(xs, SUM), acc.to(xs[0].dtype)) and same(
            allreduce(xs, AVG), (acc / 3).to(xs[0].dtype)
        )

    x64 = [sample(torch.float64, 7, seed=60 + r) for r in range(n)]
    gathered = torch.empty(7 * n, dtype=torch.float64)
    assert lib.ncclAllGather(x64[rank].data_ptr(), gathered.data_ptr(), 7, 8, comm, None) == SUCCESS
    assert same(gathered, torch.cat(x64))

    big = [sample(torch.float32, 5 * n, seed=70 + r) for r in range(n)]
    part = torch.empty(5)
    assert (
        lib.ncclReduceScatter(big[rank].data_ptr(), part.data_ptr(), 5, 7, SUM, comm, None)
        == SUCCESS
    )
    assert same(part, (big[0] + big[1] + big[2])[5 * rank : 5 * rank + 5])

    buf = i64[rank].clone()
    # in place, root 1
    assert lib.ncclBroadcast(buf.data_ptr(), buf.data_ptr(), 100, 4, 1, comm, None) == SUCCESS
    assert same(buf, i64[1])
    out = torch.zeros(100, dtype=torch.int32)
    assert (
        lib.ncclBroadcast(
            i32[rank].data_ptr() if rank == 2 else None, out.data_ptr(), 100, 2, 2, comm, None
        )
        == SUCCESS
    )
    assert same(out, i32[2])

    red = torch.zeros(100)
    assert (
        lib.ncclReduce(
            f32[rank].data_ptr(), red.data_ptr() if rank == 2 else None, 100, 7, SUM, 2, comm, None
        )
        == SUCCESS
    )
    assert same(red, f32[0] + f32[1] + f32[2] if rank == 2 else torch.zeros(100))

    # grouped ring, receives first: deferred to the group end, so nothing deadlocks
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    first, second = torch.zeros(3), torch.zeros(100, dtype=torch.int64)
    assert lib.ncclGroupStart() == SUCCESS
    assert lib.ncclRecv(first.data_ptr(), 3, 7, prv, comm, None) == SUCCESS
    assert lib.ncclRecv(second.data_ptr(), 100, 4, prv, comm, None) == SUCCESS
    assert lib.ncclSend(f32[rank].data_ptr(), 3, 7, nxt, comm, None) == SUCCESS
    assert lib.ncclSend(i64[rank].data_ptr(), 100, 4, nxt, comm, None) == SUCCESS
    assert lib.ncclGroupEnd() == SUCCESS
    assert same(first, f32[prv][:3]) and same(second, i64[prv])

    # HcclAlltoAllV: rank s sends cnt[s][d] elements (value 100*s + 10*d + i) to d; pieces are
    # spaced out by one element on both sides, and the receiver places them in reverse rank order.
    cnt = [[(s + 2 * d) % 3 for d in range(n)] for s in range(n)]
    sdispl = [sum(cnt[rank][e] + 1 for e in range(d)) for d in range(n)]
    send = torch.full((sum(cnt[rank]) + n,), -1.0)
    for d in range(n):
        send[sdispl[d] : sdispl[d] + cnt[rank][d]] = (
            torch.arange(cnt[rank][d]) + 100 * rank + 10 * d
        )
    rcnt = [cnt[s][rank] for s in range(n)]
    rdispl = [sum(rcnt[e] + 1 for e in range(s + 1, n)) for s in range(n)]
    recv, expect = torch.full((sum(rcnt) + n,), -1.0), torch.full((sum(rcnt) + n,), -1.0)
    for s in range(n):
        expect[rdispl[s] : rdispl[s] + rcnt[s]] = torch.arange(rcnt[s]) + 100 * s + 10 * rank
    arrays = [u64s(cnt[rank]), u64s(sdispl), u64s(rcnt), u64s(rdispl)]
    sc, sd, rc_, rd = (addr(a) for a in arrays)
    rc = lib.HcclAlltoAllV(
        send.data_ptr(),
        sc,
        sd,
        HCCL_DT[torch.float32],
        recv.data_ptr(),
        rc_,
        rd,
        HCCL_DT[torch.float32],
        hcomm,
        None,
    )
    assert rc == SUCCESS and same(recv, expect)
    line = call_log(lib)[-1]
    assert line.startswith(
        f"HcclAlltoAllV send={hex(send.data_ptr())} recv={hex(recv.data_ptr())} dtype=4 "
    )
    assert f"sendcounts={','.join(map(str, cnt[rank]))} " in line and line.endswith(
        f"comm={hex(hcomm)} stream=0x0"
    )
    h = torch.arange(4, dtype=torch.int16) * (rank + 1)
    hout = torch.zeros(4, dtype=torch.int16)
    assert (
        lib.HcclAllReduce(h.data_ptr(), hout.data_ptr(), 4, HCCL_DT[torch.int16], 0, hcomm, None)
        == SUCCESS
    )
    assert same(hout, torch.arange(4, dtype=torch.int16) * 6)
    assert lib.HcclCommDestroy(hcomm) == SUCCESS

    # mismatched counts: every rank sees an invalid usage naming both ranks and both sizes
    mine = 4 if rank == 0 else 5
    z = torch.zeros(mine)
    assert lib.ncclAllReduce(z.data_ptr(), z.data_ptr(), mine, 7, SUM, comm, None) == INVALID_USAGE
    other, theirs = (1, 20) if rank == 0 else (0, 16)
    want = (
        f"rank {rank} expected {4 * mine} bytes from rank {other} but rank {other} wrote {theirs} "
        "bytes"
    )
    assert want in last_error(lib), last_error(lib)

    # timeout: only rank 1 calls
    if rank == 1:
        lib.fakecomm_set_timeout_ms(300)
        rc = lib.ncclAllReduce(z.data_ptr(), z.data_ptr(), 5, 7, SUM, comm, None)
        msg = last_error(lib)
        assert rc == REMOTE_ERROR and re.fullmatch(
            r"fakecomm: rank 1 waited 300 ms for rank 0 in call #\d+ \(ncclAllReduce\)", msg
        ), msg
    assert lib.ncclCommDestroy(comm) == SUCCESS


def test_three_processes(lib_path: str, tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    world = 3
    ids, results = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main, args=(lib_path, r, world, ids, results, str(tmp_path)), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        outcome = dict(results.get(timeout=60) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert outcome == {r: "ok" for r in range(world)}, "\n".join(
        f"rank {r}: {v}" for r, v in sorted(outcome.items()) if v != "ok"
    )
