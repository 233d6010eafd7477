"""``python -m fastdist info``: what this machine can run, and why not where it cannot."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

import torch
import torch.distributed as dist

from fastdist.errors import FastdistError

__all__ = ["report"]


def _native(kind: str, path: str | None, environ: Mapping[str, str] | None) -> list[str]:
    from fastdist.comm.native import SPECS, find_library, load_library

    spec = SPECS[kind]
    try:
        found = find_library(kind, path, environ=environ)
        lib = load_library(kind, found)
    except FastdistError as e:
        return [f"  {spec.backend}: unavailable", *(f"    {line}" for line in str(e).splitlines())]
    lines = [f"  {spec.backend}: library {lib.path} ({spec.kind.upper()} {lib.version_str})"]
    gated = [f"{name} ({why})" for name, why in lib.unbound.items()]
    if gated:
        lines.append(f"    not bound: {', '.join(gated)}")
    if lib.device_type == "cpu":
        lines.append(
            "    this is fastdist's host-memory fake library (fastdist.comm.native.fake): CPU "
            "tensors, for tests"
        )
    elif lib.device_type == "cuda" and not torch.cuda.is_available():
        lines.append("    loads, but no CUDA device is visible: a communicator needs a GPU")
    elif lib.device_type == "npu" and importlib.util.find_spec("torch_npu") is None:
        lines.append("    loads, but torch_npu is not importable: NPU tensors need it")
    return lines


def report(
    nccl_library: str | None = None,
    hccl_library: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> str:
    """A plain-text report: versions, devices, torch.distributed backends, ctypes libraries.

    Args:
        nccl_library: the NCCL shared object to report on; default: found as
            `fastdist.comm.native.find_library` finds it.
        hccl_library: the HCCL shared object to report on; default: found likewise.
        environ: where to read ``FASTDIST_NCCL_LIBRARY`` / ``FASTDIST_HCCL_LIBRARY``; default:
            ``os.environ``.

    Returns:
        the report, plain text.

    >>> "torch " + torch.__version__ in report()
    True
    """
    from fastdist import __version__

    cuda = (
        f"{torch.cuda.device_count()} device(s), CUDA {torch.version.cuda}"
        if torch.cuda.is_available()
        else ("not available" + ("" if torch.version.cuda else " (this torch is a CPU build)"))
    )
    npu = (
        "torch_npu importable"
        if importlib.util.find_spec("torch_npu") is not None
        else "torch_npu not installed"
    )
    avail = dist.is_available()
    nccl = (
        "available"
        if avail and dist.is_nccl_available()
        else "unavailable (torch built without NCCL)"
    )
    hccl = "available" if npu == "torch_npu importable" else "unavailable (pip install torch_npu)"
    lines = [
        f"fastdist {__version__}, torch {torch.__version__}",
        f"CUDA: {cuda}",
        f"NPU: {npu}",
        "torch.distributed backends (backend='torch'):",
        f"  gloo (cpu): {'available' if avail and dist.is_gloo_available() else 'unavailable'}",
        f"  nccl (cuda): {nccl}",
        f"  hccl (npu): {hccl}",
        "ctypes backends (backend='nccl-ctypes' / 'hccl-ctypes'):",
        *_native("nccl", nccl_library, environ),
        *_native("hccl", hccl_library, environ),
    ]
    return "\n".join(lines)
