"""fastdist: JAX-style parallel primitives for PyTorch.

Collectives are pure functions of ``(tensor, mesh, axis)`` with per-rank gradient
rules that compose with autograd, ``torch.func`` and ``torch.compile``. A
:class:`Mesh` names the axes; :func:`simulate` runs per-rank code on every rank
of a mesh in one process.

>>> import torch, fastdist
>>> mesh = fastdist.Mesh({"dp": 2, "tp": 2})
>>> step = fastdist.simulate(lambda x: fastdist.all_gather(x, mesh, "tp"), mesh)
>>> step(torch.arange(4.0).reshape(4, 1))
tensor([[0., 1.],
        [0., 1.],
        [2., 3.],
        [2., 3.]])
"""

from . import (
    mq,  # fastdist.mq: message queue broadcaster, node locality (serving)
    nn,  # fastdist.nn: parallel layers
    profile,  # fastdist.profile: communication profile, dry runs, layout planner
    train,  # fastdist.train: data parallelism, ZeRO, distributed checkpoints
)
from .collectives import (
    all_gather,
    all_gather_invariant,
    all_to_all,
    all_to_all_4d,
    axis_index,
    axis_size,
    broadcast,
    local_chunk,
    pmax,
    pmean,
    pmin,
    ppermute,
    psum,
    psum_scatter,
    pvary,
    ring_shift,
)
from .distributed import (
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
from .errors import (
    CollectiveError,
    CollectiveTimeout,
    CommError,
    ConsistencyError,
    FastdistError,
    GlooRunError,
    LibraryError,
    LibraryNotFoundError,
    MeshError,
    NoBackendError,
    ReductionDtypeError,
    TargetError,
)
from .mesh import DEFAULT_ORDER, AxisName, Mesh
from .replication import ReplicationError, as_partial
from .sharding import P, PartitionSpec
from .simulate import simulate
from .spmd import spmd
from .stateless import StatelessGroup
from .uneven import (
    all_gather_v,
    exchange_sizes,
    gather_v,
    indexed_all_to_all_v,
    ragged_all_to_all,
    reduce_scatter_v,
    scatter_v,
)
from .visual import plot_ranks, show_ranks, show_sharding

__version__ = "0.1.0"

__all__ = [
    "Mesh",
    "nn",
    "mq",
    "profile",
    "train",
    "AxisName",
    "DEFAULT_ORDER",
    "simulate",
    "spmd",
    "P",
    "PartitionSpec",
    "as_partial",
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "pvary",
    "all_gather",
    "all_gather_invariant",
    "local_chunk",
    "psum_scatter",
    "all_to_all",
    "all_to_all_4d",
    "all_gather_v",
    "reduce_scatter_v",
    "gather_v",
    "scatter_v",
    "ragged_all_to_all",
    "indexed_all_to_all_v",
    "exchange_sizes",
    "ppermute",
    "ring_shift",
    "broadcast",
    "axis_index",
    "axis_size",
    "broadcast_object",
    "all_gather_object",
    "send_object",
    "recv_object",
    "broadcast_tensor_dict",
    "send_tensor_dict",
    "recv_tensor_dict",
    "graph_capture",
    "GraphCaptureContext",
    "send",
    "recv",
    "barrier",
    "StatelessGroup",
    "show_ranks",
    "plot_ranks",
    "show_sharding",
    "FastdistError",
    "MeshError",
    "CollectiveError",
    "ReductionDtypeError",
    "NoBackendError",
    "CommError",
    "CollectiveTimeout",
    "ConsistencyError",
    "LibraryError",
    "LibraryNotFoundError",
    "ReplicationError",
    "TargetError",
    "GlooRunError",
]
