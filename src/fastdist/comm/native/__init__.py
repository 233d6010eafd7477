"""Direct NCCL / HCCL through ctypes: the ``"nccl-ctypes"`` and ``"hccl-ctypes"`` mesh backends.

Choose per mesh: ``fastdist.connect(tp=8, backend="nccl-ctypes")``. Device tensors then
go through a :class:`NativeCommunicator` per axis group (usable inside CUDA graph
capture); CPU tensors and objects still use the mesh's gloo groups. The ops' results
do not depend on the backend.

- :mod:`fastdist.comm.native.library`: the binding tables, discovery, loading.
- :mod:`fastdist.comm.native.comm`: the communicator (id exchange, init, ops, abort).
- :mod:`fastdist.comm.native.fake`: a host-memory fake library to test all of it on CPU.
"""

from fastdist.comm.native.comm import (
    NativeCommunicator,
    exchange_over_group,
    exchange_over_stateless,
)
from fastdist.comm.native.library import (
    HCCL,
    NCCL,
    SPECS,
    Function,
    LibrarySpec,
    NativeLibrary,
    decode_nccl_version,
    find_library,
    load_library,
)

__all__ = [
    "NativeCommunicator",
    "NativeLibrary",
    "LibrarySpec",
    "Function",
    "NCCL",
    "HCCL",
    "SPECS",
    "BACKENDS",
    "find_library",
    "load_library",
    "decode_nccl_version",
    "exchange_over_group",
    "exchange_over_stateless",
]

#: Mesh backends: ``"torch"`` (torch.distributed process groups) and the ctypes ones.
BACKENDS = ("torch", "nccl-ctypes", "hccl-ctypes")
