"""Build the host-memory fake NCCL/HCCL library (``fakecomm.c``) to test ctypes paths without a GPU.

The fake library exports the NCCL and HCCL C functions with their real signatures and
enum values, works on CPU pointers, and implements the collectives across processes
through files in a rendezvous directory named by the unique id. It records every call
(see :func:`call_log`). A mesh built with ``backend="nccl-ctypes", library=<fake>`` runs
its CPU tensors through it, so the whole ctypes call path (id exchange, init, grouped
calls, dtype and op enums) is exercised on a CPU-only machine.

>>> import shutil, tempfile, fastdist.comm.native.fake as fake
>>> if shutil.which("gcc"):
...     lib = fake.build(tempfile.mkdtemp())
...     lib.endswith("libnccl.so.2")
... else:
...     True
True
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

from fastdist.errors import LibraryError

__all__ = ["SOURCE", "build", "call_log", "clear_log"]

#: The C source of the fake library, shipped with fastdist.
SOURCE = Path(__file__).with_name("fakecomm.c")


def build(
    out_dir: str | Path,
    *,
    name: str = "libnccl.so.2",
    version: int | None = None,
    window: bool = False,
    cc: str = "gcc",
) -> str:
    """Compile ``fakecomm.c`` into ``out_dir/name`` and return its path.

    Args:
        version: what ``ncclGetVersion`` reports (NCCL encoding, e.g. ``22703`` for 2.27.3).
        window: also export ``ncclCommWindowRegister`` / ``Deregister``.
        cc: the C compiler.
    """
    compiler = shutil.which(cc)
    if compiler is None:
        raise LibraryError(
            f"fastdist.comm.native.fake.build: no C compiler {cc!r} on PATH. Fix: install gcc"
        )
    out = Path(out_dir) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    flags = [f"-DFAKECOMM_VERSION={version}"] if version is not None else []
    flags += ["-DFAKECOMM_WINDOW"] if window else []
    cmd = [
        compiler,
        "-std=c11",
        "-D_GNU_SOURCE",
        "-O2",
        "-shared",
        "-fPIC",
        *flags,
        "-o",
        str(out),
        str(SOURCE),
        "-lpthread",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise LibraryError(
            f"fastdist.comm.native.fake.build: {' '.join(cmd)} failed:\n{res.stderr}"
        )
    return str(out)


def call_log(path: str) -> list[str]:
    """The calls the fake library at ``path`` recorded in this process, one line each."""
    lib = ctypes.CDLL(path)
    lib.fakecomm_log.restype, lib.fakecomm_log.argtypes = (
        ctypes.c_size_t,
        [ctypes.c_char_p, ctypes.c_size_t],
    )
    n = lib.fakecomm_log(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib.fakecomm_log(buf, n + 1)
    return buf.value.decode().splitlines()


def clear_log(path: str) -> None:
    """Forget the calls recorded so far."""
    ctypes.CDLL(path).fakecomm_log_clear()
