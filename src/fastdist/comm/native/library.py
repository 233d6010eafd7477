"""ctypes bindings to NCCL and HCCL: one table per library, version-gated, each library loaded once.

Why a ctypes binding at all (beside torch's own NCCL/HCCL process groups): torch.distributed
calls are not allowed inside CUDA graph capture, a C++ extension would tie the build to one
NCCL version, and communicators outside the default group are awkward. The binding is pure
data: :data:`NCCL` and :data:`HCCL` list every function as ``(name, restype, argtypes)``,
optionally with the library version that introduced it (``since``) or marked ``optional``
(bound when the loaded library exports it). :func:`load_library` binds the table against one
shared object; :func:`find_library` decides which one.

Discovery order (:func:`find_library`), the first that applies wins:

1. the ``path`` argument (``fastdist.connect(..., library=...)``);
2. the environment variable ``FASTDIST_NCCL_LIBRARY`` / ``FASTDIST_HCCL_LIBRARY``;
3. the copy this process already loaded (torch's CUDA wheel loads ``libnccl.so.2`` from
   the ``nvidia-nccl-cu*`` wheel; torch_npu loads ``libhccl.so``), then the wheel's file
   (NCCL) or ``$ASCEND_HOME_PATH/lib64/libhccl.so`` (HCCL, the CANN toolkit);
4. the soname through the dynamic loader (``LD_LIBRARY_PATH``, ``ldconfig``).

A path given in (1) or (2) that does not load is an error, never silently skipped. When
nothing is found, :class:`~fastdist.LibraryNotFoundError` lists every place it looked.

>>> [f.name for f in NCCL.functions][:4]
['ncclGetErrorString', 'ncclGetVersion', 'ncclGetUniqueId', 'ncclCommInitRank']
>>> NCCL.dtypes[torch.bfloat16], HCCL.dtypes[torch.bfloat16]
(9, 11)
>>> decode_nccl_version(22105), decode_nccl_version(2804)
((2, 21, 5), (2, 8, 4))
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastdist.errors import LibraryError, LibraryNotFoundError

__all__ = [
    "Function",
    "LibrarySpec",
    "NativeLibrary",
    "NCCL",
    "HCCL",
    "SPECS",
    "UniqueId",
    "RootInfo",
    "find_library",
    "load_library",
    "decode_nccl_version",
]

Version = tuple[int, int, int]

# ctypes shorthands for the tables below
_p, _i, _u32, _u64, _sz = (
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_uint32,
    ctypes.c_uint64,
    ctypes.c_size_t,
)


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes, created by one rank and passed to all (by value)."""

    _fields_ = [("internal", ctypes.c_byte * 128)]


class RootInfo(ctypes.Structure):
    """``HcclRootInfo``: 4108 opaque bytes, created by one rank and passed to all (by pointer)."""

    _fields_ = [("internal", ctypes.c_byte * 4108)]


@dataclass(frozen=True)
class Function:
    """One C function of a library: its name, return type and argument types.

    ``since``: the library version that added it (bound only when the loaded library is at
    least that new). ``optional``: bound when exported, fine when absent. A required
    function that is missing makes :func:`load_library` fail, naming it.
    """

    name: str
    restype: Any
    argtypes: tuple[Any, ...]
    since: Version | None = None
    optional: bool = False


@dataclass(frozen=True)
class LibrarySpec:
    """Everything fastdist knows about one native collective library (pure data)."""

    kind: str  # "nccl" | "hccl"
    prefix: str  # of the C function names: "nccl" | "Hccl"
    backend: str  # the Mesh backend name that uses it
    device_type: str  # torch device type of the buffers it takes
    env_var: str
    sonames: tuple[str, ...]
    loaded_prefixes: tuple[str, ...]  # basenames to look for among the libraries already loaded
    wheel: tuple[str, str] | None  # (module, file inside it) of a pip wheel that ships the library
    toolkit: tuple[str, str] | None  # (environment variable of a toolkit root, file inside it)
    functions: tuple[Function, ...]
    dtypes: Mapping[torch.dtype, int]
    reduce_ops: Mapping[str, int]
    id_type: type[ctypes.Structure]
    version_function: str | None
    error_string: str
    install_hint: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    def function(self, name: str) -> Function:
        return next(f for f in self.functions if f.name == name)


def _t(
    name: str, restype: Any, *argtypes: Any, since: Version | None = None, optional: bool = False
) -> Function:
    return Function(name, restype, argtypes, since, optional)


# ===================================================================== NCCL (nccl.h)
# ncclComm_t, cudaStream_t, buffers and ncclWindow_t are pointers; enums are ints.
#: The NCCL binding (``nccl.h``): every function fastdist binds, with its ctypes signature.
NCCL = LibrarySpec(
    kind="nccl",
    prefix="nccl",
    backend="nccl-ctypes",
    device_type="cuda",
    env_var="FASTDIST_NCCL_LIBRARY",
    sonames=("libnccl.so.2", "libnccl.so", "librccl.so.1"),
    loaded_prefixes=("libnccl.so", "librccl.so"),
    wheel=("nvidia.nccl", "lib/libnccl.so.2"),
    toolkit=None,
    functions=(
        _t("ncclGetErrorString", ctypes.c_char_p, _i),
        _t("ncclGetVersion", _i, ctypes.POINTER(_i)),
        _t("ncclGetUniqueId", _i, ctypes.POINTER(UniqueId)),
        # comm*, nranks, id (by value), rank
        _t("ncclCommInitRank", _i, ctypes.POINTER(_p), _i, UniqueId, _i),
        _t("ncclCommDestroy", _i, _p),
        _t("ncclCommAbort", _i, _p, since=(2, 4, 0)),
        _t("ncclCommGetAsyncError", _i, _p, ctypes.POINTER(_i), since=(2, 4, 0)),
        _t("ncclGetLastError", ctypes.c_char_p, _p, since=(2, 13, 0)),
        _t("ncclCommCount", _i, _p, ctypes.POINTER(_i), optional=True),
        _t("ncclCommUserRank", _i, _p, ctypes.POINTER(_i), optional=True),
        # send, recv, count, dtype, op, comm, stream
        _t("ncclAllReduce", _i, _p, _p, _sz, _i, _i, _p, _p),
        # send, recv, sendcount, dtype, comm, stream
        _t("ncclAllGather", _i, _p, _p, _sz, _i, _p, _p),
        # send, recv, recvcount, dtype, op, comm, stream
        _t("ncclReduceScatter", _i, _p, _p, _sz, _i, _i, _p, _p),
        # send, recv, count, dtype, root, comm, stream
        _t("ncclBroadcast", _i, _p, _p, _sz, _i, _i, _p, _p),
        # send, recv, count, dtype, op, root, comm, stream
        _t("ncclReduce", _i, _p, _p, _sz, _i, _i, _i, _p, _p),
        _t("ncclSend", _i, _p, _sz, _i, _i, _p, _p),  # buf, count, dtype, peer, comm, stream
        _t("ncclRecv", _i, _p, _sz, _i, _i, _p, _p),
        _t("ncclGroupStart", _i),
        _t("ncclGroupEnd", _i),
        # comm, buf, size, win*, flags
        _t("ncclCommWindowRegister", _i, _p, _p, _sz, ctypes.POINTER(_p), _i, since=(2, 27, 0)),
        _t("ncclCommWindowDeregister", _i, _p, _p, since=(2, 27, 0)),
    ),
    # ncclDataType_t. Types not listed travel as bytes (uint8) when nothing is reduced.
    dtypes={
        torch.int8: 0,
        torch.uint8: 1,
        torch.int32: 2,
        torch.uint32: 3,
        torch.int64: 4,
        torch.uint64: 5,
        torch.float16: 6,
        torch.float32: 7,
        torch.float64: 8,
        torch.bfloat16: 9,
    },
    reduce_ops={"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4},  # ncclRedOp_t
    id_type=UniqueId,
    version_function="ncclGetVersion",
    error_string="ncclGetErrorString",
    install_hint="pip install nvidia-nccl-cu12 (or use a CUDA build of torch, which ships it)",
)

# ===================================================================== HCCL (hccl.h, hccl_types.h)
#: The HCCL binding (``hccl.h``, ``hccl_types.h``): every function fastdist binds, with its ctypes
#: signature.
HCCL = LibrarySpec(
    kind="hccl",
    prefix="Hccl",
    backend="hccl-ctypes",
    device_type="npu",
    env_var="FASTDIST_HCCL_LIBRARY",
    sonames=("libhccl.so",),
    loaded_prefixes=("libhccl.so",),
    wheel=None,
    toolkit=("ASCEND_HOME_PATH", "lib64/libhccl.so"),  # set by CANN's set_env.sh
    functions=(
        _t("HcclGetErrorString", ctypes.c_char_p, _i),
        _t("HcclGetRootInfo", _i, ctypes.POINTER(RootInfo)),
        # n, root*, rank, comm*
        _t("HcclCommInitRootInfo", _i, _u32, ctypes.POINTER(RootInfo), _u32, ctypes.POINTER(_p)),
        _t("HcclCommDestroy", _i, _p),
        # send, recv, count, dtype, op, comm, stream
        _t("HcclAllReduce", _i, _p, _p, _u64, _i, _i, _p, _p),
        # buf (in place), count, dtype, root, comm, stream
        _t("HcclBroadcast", _i, _p, _u64, _i, _u32, _p, _p),
        # send, recv, sendcount, dtype, comm, stream
        _t("HcclAllGather", _i, _p, _p, _u64, _i, _p, _p),
        # send, recv, recvcount, dtype, op, comm, stream
        _t("HcclReduceScatter", _i, _p, _p, _u64, _i, _i, _p, _p),
        # send, recv, count, dtype, op, root, comm, stream
        _t("HcclReduce", _i, _p, _p, _u64, _i, _i, _u32, _p, _p),
        _t("HcclSend", _i, _p, _u64, _i, _u32, _p, _p),  # buf, count, dtype, dst, comm, stream
        _t("HcclRecv", _i, _p, _u64, _i, _u32, _p, _p),
        # send, sendcounts, sdispls, sendtype, recv, recvcounts, rdispls, recvtype, comm, stream
        # (uint64 arrays)
        _t("HcclAlltoAllV", _i, _p, _p, _p, _i, _p, _p, _p, _i, _p, _p),
        _t("HcclGroupStart", _i, optional=True),
        _t("HcclGroupEnd", _i, optional=True),
    ),
    dtypes={  # HcclDataType
        torch.int8: 0,
        torch.int16: 1,
        torch.int32: 2,
        torch.float16: 3,
        torch.float32: 4,
        torch.int64: 5,
        torch.uint64: 6,
        torch.uint8: 7,
        torch.uint16: 8,
        torch.uint32: 9,
        torch.float64: 10,
        torch.bfloat16: 11,
    },
    reduce_ops={"sum": 0, "prod": 1, "max": 2, "min": 3},  # HcclReduceOp (no avg: sum, then divide)
    id_type=RootInfo,
    version_function=None,
    error_string="HcclGetErrorString",
    install_hint=(
        "install the CANN toolkit and torch_npu (libhccl.so is in $ASCEND_HOME_PATH/lib64)"
    ),
)

#: The bindings by library kind: ``"nccl"`` and ``"hccl"``.
SPECS: dict[str, LibrarySpec] = {"nccl": NCCL, "hccl": HCCL}


def decode_nccl_version(code: int) -> Version:
    """``ncclGetVersion``'s integer as ``(major, minor, patch)`` (the encoding changed at 2.9).

    Args:
        code: the integer ``ncclGetVersion`` gives.

    Returns:
        ``(major, minor, patch)``.
    """
    if code >= 10000:  # 2.9+: major * 10000 + minor * 100 + patch
        return code // 10000, code // 100 % 100, code % 100
    # before 2.9: major * 1000 + minor * 100 + patch
    return (
        code // 1000,
        code // 100 % 10,
        code % 100,
    )


# ===================================================================== the bound library
class NativeLibrary:
    """One shared object with its table bound: ``lib.fn("ncclAllReduce")(...)`` returns the result
    code.

    Attributes:
        spec: the :class:`LibrarySpec` (NCCL or HCCL).
        path: the file (or soname) that was loaded.
        version: ``(major, minor, patch)``, or ``None`` where the library cannot say (HCCL).
        unbound: function name -> why it is not bound (too old, not exported).
        device_type: torch device type of the buffers it takes (``"cpu"`` for the host-memory
            test library of :mod:`fastdist.comm.native.fake`).
    """

    def __init__(self, spec: LibrarySpec, path: str, cdll: ctypes.CDLL) -> None:
        self.spec, self.path, self._cdll = spec, path, cdll
        self._fns: dict[str, Any] = {}
        self.unbound: dict[str, str] = {}
        self.version: Version | None = None
        if spec.version_function is not None:
            vf = self._bind_one(spec.function(spec.version_function))
            code = ctypes.c_int()
            if vf(ctypes.byref(code)) != 0:
                raise LibraryError(
                    f"fastdist: {spec.version_function} failed in {path}. Fix: point "
                    f"{spec.env_var} at a working {spec.kind.upper()} library"
                )
            self.version = decode_nccl_version(code.value)
        for f in spec.functions:
            if f.name in self._fns:
                continue
            if f.since is not None and self.version is not None and self.version < f.since:
                self.unbound[f.name] = (
                    f"needs {spec.kind.upper()} >= {'.'.join(map(str, f.since))}, this is "
                    f"{self.version_str}"
                )
                continue
            if not hasattr(cdll, f.name):
                if f.since is None and not f.optional:
                    raise LibraryError(
                        f"fastdist: {path} ({spec.kind.upper()} {self.version_str}) does not "
                        f"export {f.name}, which fastdist needs. Fix: point {spec.env_var} at a "
                        f"complete {spec.kind.upper()} library ({spec.install_hint})"
                    )
                self.unbound[f.name] = "not exported by this library"
                continue
            self._bind_one(f)
        self.device_type = "cpu" if hasattr(cdll, "fakecomm_host_memory") else spec.device_type

    def _bind_one(self, f: Function) -> Any:
        try:
            fn = getattr(self._cdll, f.name)
        except AttributeError as e:
            raise LibraryError(
                f"fastdist: {self.path} does not export {f.name}. Is it really "
                f"{self.spec.kind.upper()}? Fix: point {self.spec.env_var} at "
                f"{self.spec.sonames[0]}"
            ) from e
        fn.restype, fn.argtypes = f.restype, list(f.argtypes)
        self._fns[f.name] = fn
        return fn

    @property
    def version_str(self) -> str:
        return "version unknown" if self.version is None else ".".join(map(str, self.version))

    def has(self, name: str) -> bool:
        """Whether ``name`` is bound (exported and new enough).

        Args:
            name: the C function's name (``"ncclAllReduce"``).

        Returns:
            whether ``name`` is bound (exported and new enough).
        """
        return name in self._fns

    def fn(self, name: str) -> Any:
        """The bound function ``name``; a clear error when this library lacks it.

        Args:
            name: the C function's name (``"ncclAllReduce"``).

        Returns:
            the bound ctypes function.
        """
        f = self._fns.get(name)
        if f is None:
            why = self.unbound.get(name, "not in fastdist's table")
            raise LibraryError(
                f"fastdist: {name} is not available in {self.path}: {why}. Fix: use a newer "
                f"{self.spec.kind.upper()} or backend='torch'"
            )
        return f

    def error_text(self, rc: int, comm: Any = None) -> str:
        """``GetErrorString(rc)``, plus ``ncclGetLastError`` when the library has it.

        Args:
            rc: the result code a library call returned.
            comm: the communicator handle, for ``ncclGetLastError``.

        Returns:
            the library's text for ``rc``.
        """
        text = (self._fns[self.spec.error_string](rc) or b"").decode(errors="replace")
        if self.has("ncclGetLastError"):
            last = (self._fns["ncclGetLastError"](comm) or b"").decode(errors="replace").strip()
            if last:
                text = f"{text}: {last}"
        return text

    def new_id(self) -> bytes:
        """A fresh unique id / root info (one rank makes it, every rank passes it to init)."""
        uid = self.spec.id_type()
        name = "ncclGetUniqueId" if self.spec.kind == "nccl" else "HcclGetRootInfo"
        rc = self.fn(name)(ctypes.byref(uid))
        if rc != 0:
            raise LibraryError(
                f"fastdist: {name} failed with {rc} ({self.error_text(rc)}). Fix: check that the "
                f"{self.spec.device_type} driver works on this machine"
            )
        return bytes(uid)

    def __repr__(self) -> str:
        return f"NativeLibrary({self.spec.kind}, {self.path!r}, {self.version_str})"


@functools.cache
def _open(path: str) -> ctypes.CDLL:
    # dlopen handles are process-wide anyway; the memo only keeps one CDLL (and one set of
    # bound argtypes) per path, as the binding contract promises.
    return ctypes.CDLL(path)


@functools.cache
def _bind(kind: str, path: str) -> NativeLibrary:
    return NativeLibrary(SPECS[kind], path, _open(path))


def load_library(
    kind: str, path: str | None = None, *, environ: Mapping[str, str] | None = None
) -> NativeLibrary:
    """Find (see :func:`find_library`) and bind the ``"nccl"`` or ``"hccl"`` library; once per
    path.

    Args:
        kind: ``"nccl"`` or ``"hccl"``.
        path: the shared object to load; default: found as `find_library` finds it.
        environ: where to read ``FASTDIST_NCCL_LIBRARY`` / ``FASTDIST_HCCL_LIBRARY``; default:
            ``os.environ``.

    Returns:
        the bound library (the same object for the same path).
    """
    if kind not in SPECS:
        raise LibraryError(
            f"fastdist: unknown native library {kind!r}. Fix: use one of {sorted(SPECS)}"
        )
    return _bind(kind, find_library(kind, path, environ=environ))


# ===================================================================== discovery
def _loaded_libraries() -> list[str]:
    """Paths of the shared objects this process has mapped (Linux ``/proc/self/maps``)."""
    try:
        text = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return list(
        dict.fromkeys(
            line.split(None, 5)[5]
            for line in text.splitlines()
            if len(line.split(None, 5)) == 6 and ".so" in line
        )
    )


def _wheel_file(wheel: tuple[str, str] | None) -> str | None:
    if wheel is None:
        return None
    try:
        found = importlib.util.find_spec(wheel[0])
    except (ImportError, ValueError):
        return None
    for root in (found.submodule_search_locations or []) if found is not None else []:
        candidate = Path(root) / wheel[1]
        if candidate.exists():
            return str(candidate)
    return None


def _try_open(path: str) -> str | None:
    """None when ``path`` loads, else the loader's message."""
    try:
        _open(path)
    except OSError as e:
        return str(e)
    return None


def find_library(
    kind: str,
    path: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    loaded: Callable[[], Sequence[str]] = _loaded_libraries,
    wheel_file: Callable[[tuple[str, str] | None], str | None] = _wheel_file,
) -> str:
    """The path (or soname) of the ``"nccl"`` / ``"hccl"`` library to load, in the documented order.

    Args:
        path: an explicit file; must load.
        environ: where to read ``FASTDIST_NCCL_LIBRARY`` / ``FASTDIST_HCCL_LIBRARY``
            (default ``os.environ``, read at this call).
        loaded: lists the shared objects this process has loaded (for tests).
        wheel_file: finds the library file inside a wheel (for tests).

    Raises:
        LibraryNotFoundError: nothing found; the message lists every place tried and the fix.
        LibraryError: an explicit path or the environment variable names a file that does not load.
    """
    spec = SPECS[kind]
    env = os.environ if environ is None else environ
    name = spec.kind.upper()
    if path is not None:
        err = _try_open(str(path))
        if err is not None:
            raise LibraryError(
                f"fastdist: the {name} library given as library={str(path)!r} does not load: "
                f"{err}. Fix: pass the path of {spec.sonames[0]}"
            )
        return str(path)
    tried = ["the library= argument: not given"]
    value = env.get(spec.env_var)
    if value:
        err = _try_open(value)
        if err is not None:
            raise LibraryError(
                f"fastdist: ${spec.env_var}={value!r} does not load: {err}. Fix: point it at "
                f"{spec.sonames[0]}, or unset it"
            )
        return value
    tried.append(f"${spec.env_var}: not set")
    mine = [p for p in loaded() if Path(p).name.startswith(spec.loaded_prefixes)]
    if mine:
        return mine[0]
    tried.append(
        f"libraries already loaded by this process (torch {torch.__version__}): no "
        f"{' / '.join(spec.loaded_prefixes)}"
    )
    if spec.wheel is not None:
        wf = wheel_file(spec.wheel)
        if wf is not None and _try_open(wf) is None:
            return wf
        tried.append(
            f"the {spec.wheel[0]} wheel: "
            + ("not installed" if wf is None else f"{wf} does not load")
        )
    if spec.toolkit is not None:
        root = env.get(spec.toolkit[0])
        if root:
            candidate = str(Path(root) / spec.toolkit[1])
            err = _try_open(candidate) if Path(candidate).exists() else "no such file"
            if err is None:
                return candidate
            tried.append(f"${spec.toolkit[0]}/{spec.toolkit[1]}: {candidate}: {err}")
        else:
            tried.append(f"${spec.toolkit[0]}/{spec.toolkit[1]}: ${spec.toolkit[0]} not set")
    for soname in spec.sonames:
        err = _try_open(soname)
        if err is None:
            return soname
        tried.append(f"dynamic loader, {soname}: {err}")
    raise LibraryNotFoundError(
        spec.kind,
        tried,
        f"{spec.install_hint}; or set {spec.env_var}=/path/to/{spec.sonames[0]}; or pass "
        f"fastdist.connect(..., library='/path/to/{spec.sonames[0]}')",
    )
