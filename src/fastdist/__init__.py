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

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastdist import (
        checkpoint,  # fastdist.checkpoint: one save/load pair (DCP directories, safetensors)
        comm,  # fastdist.comm: real ranks: lifecycle, point-to-point, objects, failures
        nn,  # fastdist.nn: parallel layers
        profile,  # fastdist.profile: communication profile, dry runs, layout planner
        serving,  # fastdist.serving: message queue broadcaster, node locality
        train,  # fastdist.train: data parallelism, ZeRO, pipelines
    )
    from fastdist.check.replication import (
        as_partial,
    )
    from fastdist.check.spmd import (
        spmd,
    )
    from fastdist.comm.connect import (
        connect,
    )
    from fastdist.core.mesh import (
        DEFAULT_ORDER,
        AxisName,
        Mesh,
    )
    from fastdist.core.sharding import (
        P,
        PartitionSpec,
    )
    from fastdist.errors import (
        CollectiveError,
        CollectiveTimeout,
        CommArgumentError,
        CommError,
        ConsistencyError,
        FastdistError,
        GlooRunError,
        LibraryError,
        LibraryNotFoundError,
        MeshError,
        NoBackendError,
        PipelineError,
        ReductionDtypeError,
        ReplicationError,
        TargetError,
    )
    from fastdist.ops import (
        all_gather,
        all_gather_invariant,
        all_gather_v,
        all_to_all,
        all_to_all_4d,
        all_to_all_qkv,
        axis_index,
        axis_size,
        broadcast,
        exchange_sizes,
        gather_v,
        halo_exchange,
        indexed_all_to_all_v,
        local_chunk,
        pmax,
        pmean,
        pmin,
        ppermute,
        psum,
        psum_scatter,
        pvary,
        ragged_all_to_all,
        reduce_scatter_v,
        ring_shift,
        scatter_v,
    )
    from fastdist.sim.simulate import (
        simulate,
    )
    from fastdist.tools.visual import (
        plot_ranks,
        show_ranks,
        show_sharding,
    )

__version__ = "0.1.0"

__all__ = [
    "Mesh",
    "connect",
    "comm",
    "nn",
    "checkpoint",
    "serving",
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
    "all_to_all_qkv",
    "all_gather_v",
    "reduce_scatter_v",
    "gather_v",
    "scatter_v",
    "ragged_all_to_all",
    "indexed_all_to_all_v",
    "exchange_sizes",
    "ppermute",
    "ring_shift",
    "halo_exchange",
    "broadcast",
    "axis_index",
    "axis_size",
    "show_ranks",
    "plot_ranks",
    "show_sharding",
    "FastdistError",
    "MeshError",
    "CollectiveError",
    "ReductionDtypeError",
    "NoBackendError",
    "CommError",
    "CommArgumentError",
    "CollectiveTimeout",
    "ConsistencyError",
    "LibraryError",
    "LibraryNotFoundError",
    "ReplicationError",
    "TargetError",
    "GlooRunError",
    "PipelineError",
]

#: Where each public name is defined. ``import fastdist`` imports none of these modules (nor
#: torch): the first use of a name imports its module (PEP 562), so ``python -m fastdist --help``
#: starts in milliseconds and ``fd.nn``, ``fd.train``, ``fd.serving``, ``fd.profile`` cost nothing
#: until used. tests/test_import_time.py checks that this table, the imports above and
#: ``__all__`` list the same names.
_SUBMODULES = ("checkpoint", "comm", "nn", "profile", "serving", "train")
_EXPORTS: dict[str, str] = {
    **{name: name for name in _SUBMODULES},
    **dict.fromkeys(
        (
            "all_gather",
            "all_gather_invariant",
            "all_to_all",
            "all_to_all_4d",
            "all_to_all_qkv",
            "axis_index",
            "axis_size",
            "broadcast",
            "halo_exchange",
            "local_chunk",
            "pmax",
            "pmean",
            "pmin",
            "ppermute",
            "psum",
            "psum_scatter",
            "pvary",
            "ring_shift",
        ),
        "ops",
    ),
    **dict.fromkeys(
        (
            "CollectiveError",
            "CollectiveTimeout",
            "CommArgumentError",
            "CommError",
            "ConsistencyError",
            "FastdistError",
            "GlooRunError",
            "LibraryError",
            "LibraryNotFoundError",
            "MeshError",
            "NoBackendError",
            "PipelineError",
            "ReductionDtypeError",
            "ReplicationError",
            "TargetError",
        ),
        "errors",
    ),
    **dict.fromkeys(("DEFAULT_ORDER", "AxisName", "Mesh"), "core.mesh"),
    **dict.fromkeys(("as_partial",), "check.replication"),
    **dict.fromkeys(("P", "PartitionSpec"), "core.sharding"),
    **dict.fromkeys(("simulate",), "sim.simulate"),
    **dict.fromkeys(("spmd",), "check.spmd"),
    **dict.fromkeys(("connect",), "comm.connect"),
    **dict.fromkeys(
        (
            "all_gather_v",
            "exchange_sizes",
            "gather_v",
            "indexed_all_to_all_v",
            "ragged_all_to_all",
            "reduce_scatter_v",
            "scatter_v",
        ),
        "ops",
    ),
    **dict.fromkeys(("plot_ranks", "show_ranks", "show_sharding"), "tools.visual"),
}


class _Package(types.ModuleType):
    """The ``fastdist`` module object: public names import their module on first use."""

    def __getattr__(self, name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            if name.startswith("__") or importlib.util.find_spec(f"{__name__}.{name}") is None:
                raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
            # a submodule not in __all__ (fastdist.testing, fastdist.comm.native, ...)
            return importlib.import_module(f"{__name__}.{name}")
        value = importlib.import_module(f"{__name__}.{module}")
        if name not in _SUBMODULES:
            value = getattr(value, name)
        setattr(self, name, value)  # the next lookup finds it without this method
        return value

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *_EXPORTS})


sys.modules[__name__].__class__ = _Package
