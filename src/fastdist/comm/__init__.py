"""Real ranks: connecting a mesh to a job, transports, failures, point-to-point, native bindings.

``fastdist.connect`` builds a mesh over the running job; the rest of a mesh's lifecycle is here
(``fastdist.comm.reset(mesh)``, ...), with point-to-point and object transfers
(``fastdist.comm.send_object``, ``fastdist.comm.barrier``, ...), :class:`comm_guard` for compiled
steps, :class:`StatelessGroup` and :func:`axis_comm`, an axis group's communicator (its async
all-reduce and process groups). Names load their module on first use, as in ``fastdist``.

Modules: ``connect`` (a mesh's lifecycle), ``torch_comm`` (a mesh's process groups),
``axes`` (the per-axis communicator), ``transports`` (c10d and functional collectives),
``failures`` (errors that name the missing peers, ``comm_guard``), ``p2p`` (point-to-point,
objects, barrier, graph capture), ``stateless`` (objects through a store), ``pickling`` (how
every message becomes bytes, tensors of any dtype included), ``native`` (NCCL/HCCL through
ctypes).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastdist.comm.axes import axis_comm
    from fastdist.comm.connect import (
        close,
        create_groups,
        from_device_mesh,
        reset,
        to_device_mesh,
        with_timeout,
    )
    from fastdist.comm.failures import comm_guard
    from fastdist.comm.p2p import (
        GraphCaptureContext,
        all_gather_object,
        barrier,
        broadcast_object,
        broadcast_tensor_dict,
        graph_capture,
        recv,
        recv_object,
        recv_tensor_dict,
        send,
        send_object,
        send_tensor_dict,
    )
    from fastdist.comm.stateless import StatelessGroup

__all__ = [
    "from_device_mesh",
    "to_device_mesh",
    "with_timeout",
    "create_groups",
    "reset",
    "close",
    "send",
    "recv",
    "send_object",
    "recv_object",
    "broadcast_object",
    "all_gather_object",
    "send_tensor_dict",
    "recv_tensor_dict",
    "broadcast_tensor_dict",
    "barrier",
    "graph_capture",
    "GraphCaptureContext",
    "comm_guard",
    "StatelessGroup",
    "axis_comm",
]

#: Where each public name is defined (imported on first use: ``import fastdist.comm`` stays light).
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(__all__[:6], "connect"),
    **dict.fromkeys(__all__[6:18], "p2p"),
    "comm_guard": "failures",
    "StatelessGroup": "stateless",
    "axis_comm": "axes",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup finds it without this function
    return value
