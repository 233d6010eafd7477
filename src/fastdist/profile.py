"""See the communication before paying for it: a per-axis profile of a step, dry runs at scale, a
layout planner.

Three pieces, all arithmetic on what fastdist already knows about each collective (its
group, shape and dtype):

* :func:`trace` runs a per-rank step once on fake tensors (``torch._subclasses.FakeTensorMode``:
  shapes and dtypes, no data, no memory) and records every collective it issues, forward
  and backward, as a :class:`Record`: the op, the mesh axes, the group size, the bytes in
  the `nccl-tests <https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md>`_
  definitions, the phase and the ``nn.Module`` it ran in. The result is a :class:`Profile`.
  Because nothing is allocated per rank, the same call is the **dry run at scale**: a
  4096-rank mesh costs what one rank's shapes cost. It always runs on fake tensors, whatever
  the mesh: on a ``Mesh.from_torch`` mesh nothing is sent and the profile is the plain mesh's.
* :func:`record` collects the same records from a step while it really runs, on real ranks
  or under :func:`fastdist.simulate`.
  A trace also counts the step's compute (matmul and attention FLOPs, other kernels and their
  bytes, per phase, in issue order between the collectives: :class:`Work`), the parameters
  that receive gradients and when (:class:`GradReady`), and the activations autograd saves
  (:meth:`Profile.memory`).
* :class:`Network` describes the links (bandwidth and latency inside a node and across
  nodes, GPUs per node) and optionally the device's compute; :data:`NETWORKS` holds
  documented defaults. :func:`calibrate` measures a :class:`CostModel` on the running job
  instead (each collective kind per group size, matmul FLOP/s, memory bandwidth, per-kernel
  time), saved and loaded as JSON.
* :func:`predict` walks the traced step: compute, tensor-parallel collectives on the critical
  path, the data-parallel gradient reduction overlapped with backward in buckets as
  :class:`fastdist.train.DataParallel` runs it; and the memory per rank against a budget.
  :func:`plan` profiles a step for every candidate layout of a world size (axis sizes and
  their order onto node boundaries) and ranks the layouts by it. No congestion: see
  docs/profile.md.

How the trace sees the collectives (no hook in the op machinery): for the duration of the
call it pushes a rank binding onto the meshes (as :func:`fastdist.simulate` does, with a fake
rank id), so every collective takes its per-rank path and calls its ``torch.ops.fastdist.<op>``
custom op; under ``FakeTensorMode`` that op answers with its shape rule, and its registered
autograd records the per-rank backward rule, whose collectives are per-rank ops again. A
``TorchDispatchMode`` sees each op with its ``mesh_shape``, ``axes`` and parameters. A
``TorchFunctionMode`` tags each forward op's autograd node with the module it ran in, so a
backward collective is attributed to the module whose forward recorded it.

>>> import torch, fastdist as fd
>>> from fastdist.profile import trace
>>> mesh = fd.Mesh({"dp": 2, "tp": 4})
>>> def step(x, w1, w2):
...     h = torch.tanh(fd.pvary(x, mesh, "tp") @ w1)
...     fd.psum(h @ w2, mesh, "tp").sum().backward()
>>> x = torch.ones(8, 16, requires_grad=True)
>>> w1, w2 = torch.ones(16, 32, requires_grad=True), torch.ones(32, 16, requires_grad=True)
>>> prof = trace(step, mesh, x, w1, w2)
>>> # pvary's backward is the all-reduce of dx
>>> [(r.op, r.axis, r.phase, r.size) for r in prof.records]
[('psum', 'tp', 'forward', 512), ('psum', 'tp', 'backward', 512)]
>>> prof.bus_bytes(axis="tp")  # 2 all-reduces of 512 bytes, factor 2(n-1)/n = 1.5
1536.0
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fastdist.core.context import pop_simulation, push_simulation, simulation_of
from fastdist.core.mesh import Mesh
from fastdist.core.primitive import PRIMITIVES, Primitive
from fastdist.errors import FastdistError
from fastdist.sim.simulate import _Binding

if TYPE_CHECKING:
    from fastdist.train.schedules import Schedule, Slot

__all__ = [
    "CALIBRATED_KINDS",
    "NETWORKS",
    "OPTIMIZER_STATE",
    "CostModel",
    "Fit",
    "GradReady",
    "Layout",
    "Link",
    "Memory",
    "Network",
    "Param",
    "Pipeline",
    "PipelineCost",
    "Plan",
    "ROUTINGS",
    "Point",
    "Prediction",
    "Profile",
    "ProfileError",
    "Record",
    "Recording",
    "Work",
    "bus_factor",
    "calibrate",
    "calibrate_kernels",
    "calibrate_step",
    "layouts",
    "plan",
    "predict",
    "record",
    "trace",
    "trace_model",
]

_META_KEY = (
    "fastdist.profile.module"  # autograd node metadata: the module whose forward recorded the node
)


class ProfileError(FastdistError, ValueError):
    """A profile, dry run or plan was asked for something it cannot compute.

    Attributes:
        op: what was being profiled or planned (e.g. ``"trace"``, ``"plan"``).
        fix: one sentence on how to make the call valid.
    """

    def __init__(self, op: str, problem: str, fix: str) -> None:
        self.op, self.fix = op, fix
        super().__init__(f"fastdist.profile.{op}: {problem}. Fix: {fix}")


# ====================================================================== bytes: the nccl-tests
# definitions
def bus_factor(kind: str, n: int) -> float:
    """The nccl-tests bus-bandwidth factor of a collective ``kind`` over ``n`` ranks.

    ``bus bytes = size * factor``: what each rank sends over its link in the ring (or
    pairwise) algorithm, so ``bus bytes / time`` compares with the link bandwidth.

    ===============  ==================  ====================================
    kind             factor              size S (bytes)
    ===============  ==================  ====================================
    ``allreduce``    ``2(n-1)/n``        the buffer (input = output)
    ``allgather``    ``(n-1)/n``         the gathered output (n x input)
    ``reducescatter`` ``(n-1)/n``        the input (n x output)
    ``alltoall``     ``(n-1)/n``         one rank's whole send buffer
    ``gather`` / ``scatter`` ``(n-1)/n`` the whole gathered (scattered) buffer
    ``broadcast``    ``1``               the buffer
    ``sendrecv``     ``1``               one rank's send buffer
    ===============  ==================  ====================================

    Args:
        kind: the nccl-tests collective (the table's first column).
        n: the ranks in the group.

    Returns:
        the factor: bus bytes per byte of the size S.

    >>> bus_factor("allreduce", 4), bus_factor("allgather", 4), bus_factor("broadcast", 4)
    (1.5, 0.75, 1.0)
    """
    if n <= 1:
        return 0.0
    if kind == "allreduce":
        return 2 * (n - 1) / n
    if kind in ("allgather", "reducescatter", "alltoall", "gather", "scatter"):
        return (n - 1) / n
    if kind in ("broadcast", "sendrecv"):
        return 1.0
    raise ProfileError(
        "bus_factor",
        f"unknown collective kind {kind!r}",
        "use one of allreduce, allgather, reducescatter, alltoall, gather, scatter, broadcast, "
        "sendrecv",
    )


def _steps(kind: str, n: int) -> int:
    """Latency terms of the ring (pairwise) algorithm: sequential messages per rank."""
    if n <= 1:
        return 0
    if kind == "allreduce":
        return 2 * (n - 1)
    if kind == "sendrecv":
        return 1
    return n - 1


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _traffic(
    op: str, n: int, tensors: Sequence[Any], params: Mapping[str, Any], out: Any
) -> tuple[str, int, float, bool] | None:
    """``(kind, size S, fraction of ranks that send, size is an upper bound)`` of one per-rank op;
    ``None``: moves no data."""
    x = tensors[0]
    row = _nbytes(tuple(x.shape[1:]), x.dtype)
    if op in ("psum", "pmean", "pmax", "pmin"):
        return "allreduce", _nbytes(tuple(x.shape), x.dtype), 1.0, False
    # pmax/pmin backward: all-reduce (min) of an int64 winner index per element
    if op == "select_extreme":
        return "allreduce", _nbytes(tuple(x.shape), torch.int64), 1.0, False
    if op in ("all_gather", "all_gather_invariant"):
        return "allgather", _nbytes(tuple(out.shape), out.dtype), 1.0, False
    if op == "psum_scatter":
        return "reducescatter", _nbytes(tuple(x.shape), x.dtype), 1.0, False
    if op == "all_to_all":
        return "alltoall", _nbytes(tuple(x.shape), x.dtype), 1.0, False
    if op == "ppermute":
        perm = list(params["perm"])
        movers = sum(1 for s, d in zip(perm[0::2], perm[1::2]) if s != d)
        return "sendrecv", _nbytes(tuple(x.shape), x.dtype), movers / n, False
    if op == "broadcast":
        return "broadcast", _nbytes(tuple(x.shape), x.dtype), 1.0, False
    if op == "all_gather_v":
        return "allgather", sum(params["sizes"]) * row, 1.0, False
    if op == "reduce_scatter_v":
        return "reducescatter", sum(params["sizes"]) * row, 1.0, False
    if op == "gather_v":
        return "gather", sum(params["sizes"]) * row, 1.0, False
    if op == "scatter_v":
        return "scatter", sum(params["sizes"]) * row, 1.0, False
    # the split sizes are data: the whole send buffer bounds what is sent
    if op == "ragged_all_to_all":
        return "alltoall", _nbytes(tuple(x.shape), x.dtype), 1.0, True
    return None  # pvary, local_chunk, keep_src: local


# ====================================================================== records and profiles
@dataclass(frozen=True)
class Record:
    """One collective one rank issues.

    Attributes:
        op: the fastdist op (``"psum"``, ``"all_gather_v"``, ...; backward rules show as the ops
            they call).
        axis: the mesh axis name, or ``"dp+tp"`` for a tuple of axes.
        n: ranks in the group.
        kind: the nccl-tests collective (see :func:`bus_factor`).
        size: S in bytes (nccl-tests' definition for ``kind``).
        bus_bytes: what this rank sends: ``size * bus_factor(kind, n)`` (times the fraction of
            members that send, for a partial ``ppermute``).
        steps: latency terms of the ring algorithm (``2(n-1)`` for all-reduce, ``n-1`` for
            all-gather / reduce-scatter / all-to-all / gather / scatter / broadcast, ``1`` for
            send/recv).
        phase: ``"forward"`` or ``"backward"``.
        module: dotted path of the innermost ``nn.Module`` whose forward issued it (or recorded
            the backward node that issued it); ``""`` outside any traced module.
        dtype: element type.
        shape: the per-rank input shape.
        bound: ``size`` is an upper bound (``ragged_all_to_all``: the split sizes are data).
    """

    op: str
    axis: str
    n: int
    kind: str
    size: int
    bus_bytes: float
    steps: int
    phase: str
    module: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    bound: bool = False


_KEYS = ("op", "axis", "phase", "module", "kind", "n", "dtype")


# ====================================================== compute and memory of a step
@dataclass(frozen=True)
class Work:
    """The compute one rank runs between two events of a traced step (see :attr:`Profile.events`).

    Attributes:
        phase: ``"forward"`` or ``"backward"`` (kernels autograd runs).
        flops: floating-point operations of its matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``:
            ``2 m k n`` each) and attentions (``scaled_dot_product_attention`` forward: ``2 L S
            (E + Ev)`` per batch and head, every score counted, causal or not; backward 2.5 x
            that).
        kernels: aten kernels run (views excluded), the matmuls included.
        bytes: bytes the kernels other than matmuls and attention read and write (their tensor
            inputs plus outputs).
        module: dotted path of the innermost ``nn.Module`` whose forward ran the kernels (for
            backward kernels: whose forward recorded the autograd node that runs them); ``""``
            outside any traced module (or for nodes no module recorded).
        calls: the kernels one by one, grouped by signature: ``(key, count, flops, bytes)`` per
            distinct kernel (``key``: the aten op with its arguments' shapes, strides, dtypes
            and other values, as :func:`calibrate_kernels` times it; ``flops`` / ``bytes``:
            one call's). Empty for work not traced kernel by kernel (a bucket's packing).
    """

    phase: str
    flops: float
    kernels: int
    bytes: float
    module: str = ""
    calls: tuple[tuple[str, int, float, float], ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class GradReady:
    """The gradient of parameter ``Profile.params[param]`` was accumulated (during backward)."""

    param: int


@dataclass(frozen=True)
class Param:
    """A parameter of a traced step: a leaf tensor that required grad and received a gradient.

    Attributes:
        name: the module path (``model.layers.0.mlp.up_proj.weight``) or the argument's position
            (``args[1]``, ``kwargs['w']``).
        bytes: one rank's bytes (its shard).
        dtype: element type.
    """

    name: str
    bytes: int
    dtype: torch.dtype


#: bytes of optimizer state per byte of parameter (torch's defaults: state in the parameter dtype)
OPTIMIZER_STATE = {"adamw": 2.0, "adam": 2.0, "sgd-momentum": 1.0, "sgd": 0.0, "none": 0.0}


@dataclass(frozen=True)
class Memory:
    """One rank's memory of a step (bytes): what :meth:`Profile.memory` estimates.

    Attributes:
        params: the parameters (shards) that received a gradient.
        grads: their gradients (same bytes).
        optimizer: optimizer state (``OPTIMIZER_STATE[optimizer]`` x params).
        activations: tensors autograd saved for backward (unique storages, parameters excluded),
            the forward's peak of what backward needs; temporaries are not counted.
    """

    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


# kernels that move no data (aliases the schema does not mark as views)
_NOT_KERNELS = {torch.ops.aten._unsafe_view.default, torch.ops.aten.lift_fresh.default}
_SDPA = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
}


def _sdpa_flops(q: Tensor, k: Tensor, v: Tensor) -> float:
    # q [..., L, E], k [..., S, E], v [..., S, Ev]: scores q k^T, then probs v, per batch and head
    return 2.0 * math.prod(q.shape[:-1]) * k.shape[-2] * (q.shape[-1] + v.shape[-1])


def _kernel_flops(func: Any, args: Sequence[Any]) -> float:
    """Matmul / attention FLOPs of one aten kernel (0 for anything else)."""
    name = func._opname
    if name in ("mm", "addmm"):
        a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
        return 2.0 * int(a.shape[0]) * int(a.shape[1]) * int(b.shape[1])
    if name in ("bmm", "baddbmm"):
        a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
        return 2.0 * int(a.shape[0]) * int(a.shape[1]) * int(a.shape[2]) * int(b.shape[2])
    if name in _SDPA:
        return _sdpa_flops(args[0], args[1], args[2])
    if name.removesuffix("_backward") in _SDPA:  # recompute scores, dV, dP, dQ, dK: 5 matmuls
        return 2.5 * _sdpa_flops(args[1], args[2], args[3])
    return 0.0


@dataclass(frozen=True)
class _TensorSpec:
    """Shape, strides, storage offset and dtype of one tensor argument of a traced kernel."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    def key(self) -> str:
        text = f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"
        contiguous = math.prod(self.shape) == 0 or self.stride == _contiguous(self.shape)
        return (
            text
            + ("" if contiguous else f"s{list(self.stride)}")
            + (f"+{self.offset}" if self.offset else "")
        )


class _Device:
    """A device argument of a traced kernel (replayed on the calibration's device)."""

    def __repr__(self) -> str:
        return "device"


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _spec_of(a: Any) -> Any:
    if isinstance(a, Tensor):
        return _TensorSpec(
            tuple(int(d) for d in a.shape),
            tuple(int(d) for d in a.stride()),
            int(a.storage_offset()),
            a.dtype,
        )
    if isinstance(a, torch.device):
        return _Device()
    return a


def _key_text(a: Any) -> str:
    if isinstance(a, _TensorSpec):
        return a.key()
    if isinstance(a, (list, tuple)):
        return "[" + ",".join(_key_text(x) for x in a) + "]"
    if isinstance(a, dict):
        return "{" + ",".join(f"{k}={_key_text(v)}" for k, v in a.items()) + "}"
    return repr(a)


def _kernel_key(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """A traced kernel's signature: ``aten::mm(float32[64, 32],float32[32, 16])`` (strides when
    not contiguous, other arguments by value)."""
    spec = pytree.tree_map(_spec_of, (tuple(args), dict(kwargs)))
    text = ",".join(_key_text(a) for a in spec[0])
    if spec[1]:
        text += "," + ",".join(f"{k}={_key_text(v)}" for k, v in sorted(spec[1].items()))
    return f"{func}({text})"


@dataclass(frozen=True)
class _Kernel:
    """One distinct kernel of a traced step, replayable on real tensors of its shapes."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _materialize(spec: Any, dev: torch.device) -> Any:
    """A real tensor for a ``_TensorSpec`` (floats: normal, integers: 0 (valid indices), bools:
    True), the device for a ``_Device``, other values unchanged."""
    if isinstance(spec, _Device):
        return dev
    if not isinstance(spec, _TensorSpec):
        return spec
    extent = spec.offset + (
        1 + sum((n - 1) * st for n, st in zip(spec.shape, spec.stride))
        if all(n > 0 for n in spec.shape)
        else 0
    )
    base = torch.empty(extent, dtype=spec.dtype, device=dev)
    if spec.dtype.is_floating_point or spec.dtype.is_complex:
        base.normal_()
    elif spec.dtype == torch.bool:
        base.fill_(True)
    else:
        base.zero_()
    return base.as_strided(spec.shape, spec.stride, spec.offset)


@dataclass(frozen=True)
class Profile:
    """The collectives of one traced step on one rank (see :func:`trace`).

    Attributes:
        mesh: the mesh the step ran on.
        records: every collective in issue order (forward, then backward).
        outputs: ``(module path, bytes)`` of the first tensor each traced module's forward
            returned (one rank's; the last call's): a pipeline's stage boundary is the output of
            a layer (:class:`Pipeline`). Empty without ``modules=``.
        kernels: each distinct kernel of :attr:`Work.calls` by its key, replayable on real
            tensors (:func:`calibrate_kernels`); empty for a :func:`record`.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"dp": 4})
    >>> prof = trace(lambda x: fd.all_gather(x, mesh, "dp"), mesh, torch.ones(2, 3))
    >>> print(prof.table())
    axis   op          phase    count  size (B)  bus bytes
    dp     all_gather  forward  1      96        72
    total                       1      96        72
    """

    mesh: Mesh
    records: tuple[Record, ...]
    events: tuple[Work | Record | GradReady, ...] = field(default=(), compare=False, repr=False)
    params: tuple[Param, ...] = field(default=(), compare=False, repr=False)
    activations: int = field(default=0, compare=False, repr=False)
    outputs: tuple[tuple[str, int], ...] = field(default=(), compare=False, repr=False)
    kernels: Mapping[str, _Kernel] = field(default_factory=dict, compare=False, repr=False)

    # A profile reads as the tuple of its records: for r in prof, len(prof), prof[0], prof[-2:].
    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    @overload
    def __getitem__(self, index: int) -> Record: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Record, ...]: ...
    def __getitem__(self, index: int | slice) -> Record | tuple[Record, ...]:
        return self.records[index]

    def flops(self, phase: str | None = None) -> float:
        """Matmul and attention FLOPs of the step on this rank (of one ``phase``); a
        :func:`trace` counts them, :func:`record` does not (0).

        Args:
            phase: ``"forward"`` or ``"backward"``; ``None``: both.
        """
        return sum(
            e.flops
            for e in self.events
            if isinstance(e, Work) and (phase is None or e.phase == phase)
        )

    def memory(self, optimizer: str | float = "adamw") -> Memory:
        """One rank's memory (bytes): parameters, gradients, optimizer state, activations.

        Args:
            optimizer: a name in :data:`OPTIMIZER_STATE` (``"adamw"``: 2 x the parameters) or
                the bytes of state per byte of parameter.
        """
        if isinstance(optimizer, str):
            if optimizer not in OPTIMIZER_STATE:
                raise ProfileError(
                    "Profile.memory",
                    f"unknown optimizer {optimizer!r}",
                    f"use one of {', '.join(OPTIMIZER_STATE)}, or bytes of state per parameter "
                    "byte as a number",
                )
            factor = OPTIMIZER_STATE[optimizer]
        else:
            factor = float(optimizer)
        params = sum(p.bytes for p in self.params)
        return Memory(params, params, int(params * factor), self.activations)

    def filter(self, **where: Any) -> Profile:
        """The records whose fields equal the given values, e.g. ``filter(axis="tp",
        phase="backward")``; the compute and gradient events stay (:func:`predict` of the result
        charges the compute and the kept collectives).

        Args:
            **where: field values a record must have (``axis="tp"``, ``phase="backward"``).

        Returns:
            a `Profile` with the matching records.
        """
        bad = [k for k in where if k not in Record.__dataclass_fields__]
        if bad:
            raise ProfileError(
                "Profile.filter",
                f"Record has no field {bad[0]!r}",
                f"filter by {', '.join(Record.__dataclass_fields__)}",
            )

        def keep(r: Record) -> bool:
            return all(getattr(r, k) == v for k, v in where.items())

        return replace(
            self,
            records=tuple(r for r in self.records if keep(r)),
            events=tuple(e for e in self.events if not isinstance(e, Record) or keep(e)),
        )

    def count(self, **where: Any) -> int:
        """Number of collectives (matching ``where``, as :meth:`filter`).

        Args:
            **where: field values a record must have (``axis="tp"``, ``phase="backward"``), as in
                `filter`.
        """
        return len(self.filter(**where).records)

    def size(self, **where: Any) -> int:
        """Sum of the nccl-tests sizes S in bytes (matching ``where``).

        Args:
            **where: field values a record must have (``axis="tp"``, ``phase="backward"``), as in
                `filter`.
        """
        return sum(r.size for r in self.filter(**where).records)

    def bus_bytes(self, **where: Any) -> float:
        """Bytes this rank sends (bus bytes, matching ``where``).

        Args:
            **where: field values a record must have (``axis="tp"``, ``phase="backward"``), as in
                `filter`.
        """
        return sum(r.bus_bytes for r in self.filter(**where).records)

    def summary(self, by: Sequence[str] = ("axis", "op", "phase")) -> list[dict[str, Any]]:
        """Rows grouped by the given Record fields, in first-seen order: the fields, ``count``,
        ``size``, ``bus_bytes``.

        Args:
            by: the ``Record`` fields to group by.

        Returns:
            one row per group: the fields, ``count``, ``size``, ``bus_bytes``.
        """
        bad = [k for k in by if k not in Record.__dataclass_fields__]
        if bad:
            raise ProfileError(
                "Profile.summary",
                f"Record has no field {bad[0]!r}",
                f"group by any of {', '.join(_KEYS)}",
            )
        rows: dict[tuple[Any, ...], dict[str, Any]] = {}
        for r in self.records:
            key = tuple(getattr(r, k) for k in by)
            row = rows.setdefault(
                key, {**dict(zip(by, key)), "count": 0, "size": 0, "bus_bytes": 0.0}
            )
            row["count"] += 1
            row["size"] += r.size
            row["bus_bytes"] += r.bus_bytes
        return list(rows.values())

    def table(self, by: Sequence[str] = ("axis", "op", "phase")) -> str:
        """:meth:`summary` as an aligned text table with a total row.

        Args:
            by: the ``Record`` fields to group by.

        Returns:
            the text table.
        """
        rows = self.summary(by)
        head = [*by, "count", "size (B)", "bus bytes"]
        body = [
            [str(r[k]) for k in by] + [str(r["count"]), str(r["size"]), f"{r['bus_bytes']:.0f}"]
            for r in rows
        ]
        body.append(
            [
                "total",
                *([""] * (len(by) - 1)),
                str(len(self.records)),
                str(self.size()),
                f"{self.bus_bytes():.0f}",
            ]
        )
        widths = [max(len(c[i]) for c in [head, *body]) for i in range(len(head))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]
        )

    def __str__(self) -> str:
        return self.table()


# ====================================================================== tracing
class _ModuleStack:
    """Forward hooks on a module tree keeping the path of the module running now (per trace, not
    global)."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.outputs: dict[str, int] = {}  # module path -> bytes of its output's first tensor

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    @contextmanager
    def hooks(self, modules: Sequence[nn.Module]) -> Iterator[None]:
        handles = []
        for root in modules:
            for name, m in root.named_modules():

                def pre(_m: nn.Module, _a: Any, name: str = name) -> None:
                    self.stack.append(name)

                def post(_m: nn.Module, _a: Any, out: Any, name: str = name) -> None:
                    if self.stack:
                        self.stack.pop()
                    first = next(
                        (t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)), None
                    )
                    if first is not None:
                        self.outputs[name] = first.numel() * first.dtype.itemsize

                handles.append(m.register_forward_pre_hook(pre))
                handles.append(m.register_forward_hook(post, always_call=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()


class _Tagger(TorchFunctionMode):
    """Tags the autograd node of each forward op's output with the module it ran in (a node
    tagged before keeps its module: an op that returns its input unchanged does not move it)."""

    def __init__(self, modules: _ModuleStack) -> None:
        super().__init__()
        self.modules = modules

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor) and t.grad_fn is not None:
                _tag(t.grad_fn, self.modules.current)
        return out


def _tag(node: Any, module: str) -> None:
    """Tag ``node`` and the untagged nodes it reaches (the ones the same call made: ``linear``
    of a 3-d input is a view, a matmul and a view) with ``module``; tagged nodes stop the walk."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n is None or _META_KEY in n.metadata:
            continue
        n.metadata[_META_KEY] = module
        todo.extend(f for f, _ in n.next_functions)


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Sees every ``fastdist::<op>`` per-rank op (forward and backward) and appends its Record."""

    def __init__(
        self, names: Mapping[tuple[int, ...], tuple[str, ...]], modules: _ModuleStack
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names, self.modules = names, modules
        self.records: list[Record] = []
        # the step in issue order: compute between collectives, collectives, gradients ready
        self.events: list[Work | Record | GradReady] = []
        # (phase, module) -> [flops, kernels, bytes] not yet flushed
        self._work: dict[tuple[str, str], list[float]] = {}
        # (phase, module) -> kernel key -> [calls, flops, bytes of one call] not yet flushed
        self._calls: dict[tuple[str, str], dict[str, list[Any]]] = {}
        # kernel key -> how to replay it (calibrate_kernels)
        self.kernels: dict[str, _Kernel] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace == "fastdist":
            self._record(func, args, out)
        elif func.namespace == "aten" and not func.is_view and func not in _NOT_KERNELS:
            self._count(func, args, kwargs or {}, out)
        return out

    def _count(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> None:
        """Charge one aten kernel: its matmul / attention FLOPs, or the bytes it reads and
        writes."""
        node: Any = torch._C._current_autograd_node()
        phase = "forward" if node is None else "backward"
        module = self.modules.current if node is None else str(node.metadata.get(_META_KEY, ""))
        if self._work and (phase, module) not in self._work:
            self.flush()
        acc = self._work.setdefault((phase, module), [0.0, 0.0, 0.0])
        flops = _kernel_flops(func, args)
        nbytes = 0.0
        acc[1] += 1
        if flops:
            acc[0] += flops
        else:
            leaves = [*pytree.tree_leaves((args, kwargs)), *pytree.tree_leaves(out)]
            nbytes = float(
                sum(t.numel() * t.dtype.itemsize for t in leaves if isinstance(t, Tensor))
            )
            acc[2] += nbytes
        key = _kernel_key(func, args, kwargs)
        if key not in self.kernels:
            self.kernels[key] = _Kernel(func, *pytree.tree_map(_spec_of, (tuple(args), kwargs)))
        calls = self._calls.setdefault((phase, module), {})
        one = calls.setdefault(key, [0, flops, nbytes])
        one[0] += 1

    def flush(self) -> None:
        """Close the compute run so far (before a collective or a gradient event)."""
        for (phase, module), (flops, kernels, nbytes) in self._work.items():
            calls = tuple(
                (k, int(c), f, b) for k, (c, f, b) in self._calls.get((phase, module), {}).items()
            )
            self.events.append(Work(phase, flops, int(kernels), nbytes, module, calls))
        self._work = {}
        self._calls = {}

    def _record(self, func: Any, args: Sequence[Any], out: Any) -> None:
        name = func._opname
        prim = PRIMITIVES.get(name.removesuffix("_stacked"))
        if prim is None:
            return
        k = len(prim.inputs)
        tensors, mesh_shape, axes = args[:k], tuple(args[k]), tuple(args[k + 1])
        params = dict(zip(prim.param_names, args[k + 2 :]))
        # a stacked op called directly on [world, ...] tensors: one rank's share
        if name.endswith("_stacked"):
            tensors, out = tuple(_RankShare(t) for t in tensors), _RankShare(out)
        node: Any = torch._C._current_autograd_node()
        module = self.modules.current if node is None else str(node.metadata.get(_META_KEY, ""))
        rec = _make_record(
            prim.name, tensors, out, mesh_shape, axes, params, self.names, node is not None, module
        )
        if rec is not None:
            self.flush()
            self.records.append(rec)
            self.events.append(rec)


class _RankShare:
    """Shape and dtype of one rank's share of a stacked ``[world, ...]`` tensor (nothing is
    indexed)."""

    def __init__(self, t: Tensor) -> None:
        self.shape, self.dtype = tuple(t.shape[1:]), t.dtype


def _make_record(
    op: str,
    tensors: Sequence[Any],
    out: Any,
    mesh_shape: tuple[int, ...],
    axes: tuple[int, ...],
    params: Mapping[str, Any],
    names: Mapping[tuple[int, ...], tuple[str, ...]],
    backward: bool,
    module: str,
) -> Record | None:
    """The Record of one per-rank collective (``tensors``/``out``: anything with ``shape`` and
    ``dtype``); None: moves no data."""
    n = math.prod(mesh_shape[a] for a in axes)
    traffic = _traffic(op, n, tensors, params, out)
    if traffic is None or n <= 1:
        return None
    kind, size, senders, bound = traffic
    axis_names = names.get(mesh_shape)
    axis = (
        "+".join(axis_names[a] for a in axes) if axis_names else "+".join(f"axis{a}" for a in axes)
    )
    return Record(
        op=op,
        axis=axis,
        n=n,
        kind=kind,
        size=size,
        bus_bytes=size * bus_factor(kind, n) * senders,
        steps=_steps(kind, n),
        phase="backward" if backward else "forward",
        module=module,
        dtype=tensors[0].dtype,
        shape=tuple(tensors[0].shape),
        bound=bound,
    )


# small tensors built from Python values stay real under the trace (their values are known)
_CONSTANT_NUMEL = 4096


def _fake_mode() -> Any:
    """A ``FakeTensorMode`` that keeps the values of small tensors made from Python constants.

    torch keeps a fake tensor's value only up to one element; per-rank code often builds small
    index tensors from Python lists (``torch.tensor(seq_sizes)``, Ulysses' per-rank sizes) and
    reads them back (``int(sizes.max())``), which a plain fake tensor cannot answer. Values
    derived from the step's inputs stay unknown (fake), whatever their size.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    class _Mode(FakeTensorMode):  # type: ignore[no-untyped-call]
        def may_turn_const(self, t: Tensor) -> bool:
            return bool(
                t.numel() <= _CONSTANT_NUMEL
                and t.layout == torch.strided
                and not self.is_our_fake(t)
                and t.device.type != "meta"
            )

    return _Mode(allow_non_fake_inputs=True)


def _fake(mode: Any, t: Tensor, stacked: bool, device: torch.device) -> Tensor:
    if stacked:
        if t.dim() == 0:
            raise ProfileError(
                "trace",
                f"a tensor argument of shape {tuple(t.shape)} has no leading rank dim",
                "pass stacked=False for per-rank tensors",
            )
        t = t[0]
    if t.is_meta:  # a meta tensor: a fake one of the same shape on `device`, nothing allocated
        with mode:
            f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        return (
            f.requires_grad_(t.requires_grad)
            if t.requires_grad and (t.is_floating_point() or t.is_complex())
            else f
        )
    g: Tensor = mode.from_tensor(t.detach())
    return g.requires_grad_(t.requires_grad) if t.requires_grad else g


def trace(
    fn: Callable[..., Any],
    mesh: Mesh,
    *args: Any,
    meshes: Sequence[Mesh] = (),
    modules: Sequence[nn.Module] = (),
    stacked: bool = False,
    device: str | torch.device = "cpu",
    routing: str = "bound",
    **kwargs: Any,
) -> Profile:
    """Run per-rank step ``fn`` once on fake tensors and return its collectives.

    Args:
        fn: per-rank code, as given to :func:`fastdist.simulate`; it calls ``backward()``
            itself if the backward collectives are wanted.
        mesh: the mesh ``fn``'s collectives use; any size (4096 ranks cost what one does).
        *args: ``fn``'s arguments. Tensors (at any depth) become fake tensors of the
            same shape, dtype and ``requires_grad`` (no data is copied; ``meta`` tensors are
            accepted, so models built on the meta device trace too). Other values pass unchanged.
        meshes: further meshes ``fn`` uses.
        modules: modules whose parameters and buffers become fake for the trace (gradients
            land on the fake copies, the real module is untouched) and whose submodules name
            the ``module`` field of each record. ``fn`` may call them directly.
        stacked: the tensors carry a leading rank dim (as for ``simulate``); rank 0's shape is used.
        device: device of the fake tensors made from meta tensors.
        routing: how a routed MoE layer (``fastdist.nn.moe``: which expert a token goes to is
            data) is charged. ``"bound"``: what its per-rank code issues on simulated ranks,
            the worst case: every local expert runs on every row of the ``ep x T x k``-row
            receive buffer, and the combine sends that buffer back (records ``bound=True``).
            ``"balanced"``: the expected load of a balanced router: each of the ``E`` experts
            runs on ``ceil(ep x T x k / E)`` rows, gathered and scattered back as real ranks
            do, and ``all_to_all`` dispatch receives (and the combine sends back) its local
            experts' share of that; the ragged records stay marked ``bound=True`` (their sizes
            are then expectations). Other layers are unaffected.
        **kwargs: ``fn``'s keyword arguments, faked as ``args``.

    Returns:
        A :class:`Profile` of one rank. Shapes are rank 0's; per-rank code whose shapes do not
        depend on the rank (everything but data-dependent ragged splits) issues the same
        collectives on every rank.

    Raises:
        ProfileError: a mesh is already being simulated, or an argument cannot be faked.

    The step always runs on fake tensors, whatever ``mesh`` is: on a mesh from
    ``Mesh.from_torch`` (a job on real ranks) the trace takes precedence over the process
    groups, nothing is sent, and the profile equals that of a plain ``Mesh`` with the same
    axes. To profile a step while it really runs (real ranks, or ``fastdist.simulate``), use
    :func:`record`. Small tensors made from Python values (``torch.tensor(seq_sizes)``) keep
    their values, so per-rank code may read them back; values computed from the inputs are
    unknown and must not decide shapes.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"dp": 64, "tp": 64})   # 4096 ranks: nothing per rank is allocated
    >>> x = torch.empty(1 << 20, device="meta")
    >>> prof = trace(lambda x: fd.psum_scatter(x, mesh, "dp"), mesh, x)
    >>> prof.records[0].size, prof.records[0].n
    (4194304, 64)
    """
    all_meshes = [mesh, *meshes]
    for m in all_meshes:
        if not isinstance(m, Mesh):
            raise ProfileError(
                "trace",
                f"expected a fastdist.Mesh, got {type(m).__name__}",
                "pass the Mesh the step runs on",
            )
        if simulation_of(m) is not None:
            raise ProfileError(
                "trace",
                f"{m!r} is being simulated right now",
                "call trace outside fastdist.simulate (it runs the per-rank code itself)",
            )
    dev = torch.device(device)
    mode = _fake_mode()
    conv = lambda a: _fake(mode, a, stacked, dev) if isinstance(a, Tensor) else a
    fargs, fkwargs = pytree.tree_map(conv, (args, kwargs))
    names = {tuple(m.shape.values()): m.axis_names for m in reversed(all_meshes)}
    stack = _ModuleStack()
    recorder = _Recorder(names, stack)
    # leaves that may receive a gradient: the arguments', then the modules' parameters
    leaves: dict[int, tuple[str, Tensor]] = {}
    for path, leaf in pytree.tree_flatten_with_path((fargs, fkwargs))[0]:
        if isinstance(leaf, Tensor) and leaf.requires_grad and leaf.is_leaf:
            where = "args" if path[0] == pytree.SequenceKey(0) else "kwargs"
            leaves.setdefault(id(leaf), (where + pytree.keystr(path[1:]), leaf))
    with ExitStack() as es:
        for module in modules:
            state = {
                **dict(module.named_parameters(remove_duplicate=False)),
                **dict(module.named_buffers(remove_duplicate=False)),
            }
            made: dict[int, Tensor] = {}  # tied weights (a meta model's too) stay one tensor
            for v in state.values():
                if id(v) not in made:
                    made[id(v)] = _fake_param(mode, v, dev)
            fake_state = {k: made[id(v)] for k, v in state.items()}
            for k, v in fake_state.items():
                if isinstance(v, nn.Parameter) and v.requires_grad:
                    leaves.setdefault(id(v), (k, v))
            es.enter_context(
                torch.nn.utils.stateless._reparametrize_module(module, fake_state, tie_weights=True)
            )
        got = _watch_grads(recorder, list(leaves.values()), es)
        saved = _SavedBytes([t for _, t in leaves.values()])
        es.enter_context(torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t))
        es.enter_context(stack.hooks(modules))
        with mode:
            rank = torch.zeros((), dtype=torch.long, device=dev)
        push_simulation(all_meshes, _Binding(rank, mesh.size))  # the trace stands in for simulate
        es.callback(pop_simulation, len(all_meshes))
        es.enter_context(mode)
        es.enter_context(recorder)
        es.enter_context(_Tagger(stack))
        es.enter_context(_quiet())  # an open record() does not see the trace's collectives
        es.enter_context(_routing(routing))
        fn(*fargs, **fkwargs)
        recorder.flush()
    # parameters: the leaves that received a gradient, in argument / registration order
    order = [i for i, _ in enumerate(leaves.values()) if i in got]
    index = {i: k for k, i in enumerate(order)}
    named = list(leaves.values())
    params = tuple(
        Param(named[i][0], named[i][1].numel() * named[i][1].dtype.itemsize, named[i][1].dtype)
        for i in order
    )
    events = tuple(
        GradReady(index[e.param]) if isinstance(e, GradReady) else e for e in recorder.events
    )
    outputs = tuple(stack.outputs.items())
    return Profile(
        mesh, tuple(recorder.records), events, params, saved.bytes, outputs, recorder.kernels
    )


def _watch_grads(
    recorder: _Recorder, leaves: Sequence[tuple[str, Tensor]], es: ExitStack
) -> set[int]:
    """Post-accumulate-grad hooks on the traced leaves: each accumulation is a :class:`GradReady`
    event (its index in ``leaves``, renumbered by :func:`trace`); returns the indices that got
    one (filled during the trace)."""
    got: set[int] = set()
    for i, (_, leaf) in enumerate(leaves):

        def hook(_t: Tensor, i: int = i) -> None:
            recorder.flush()
            recorder.events.append(GradReady(i))
            got.add(i)

        handle = leaf.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
        es.callback(handle.remove)
    return got


class _SavedBytes:
    """Bytes of the unique storages autograd saves for backward (parameters excluded)."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.skip = {t.untyped_storage()._cdata for t in params}
        self.seen: dict[int, Any] = {}  # keeps the (fake) storages alive: no address reused
        self.bytes = 0

    def pack(self, t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.skip and key not in self.seen:
            self.seen[key] = storage
            self.bytes += storage.nbytes()
        return t


def _fake_param(mode: Any, t: Tensor, device: torch.device) -> Tensor:
    f = _fake(mode, t, False, device)
    return nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f


# ====================================================================== recording a step as it runs
class _Running(threading.local):
    """Per thread: inside a recorded collective (its inner calls are not recorded again), or inside
    :func:`trace`; ``routing``: the MoE charge of the trace running on this thread, and the rows
    each expert runs on (set by the dispatch, read by the experts that follow it)."""

    depth = 0
    routing = "bound"
    expert_rows = 0


_RUNNING = _Running()
_ACTIVE: list[
    Recording
] = []  # recordings in progress, innermost last (a collective on any thread goes to each)
_INSTALL = threading.Lock()


@contextmanager
def _quiet() -> Iterator[None]:
    """Collectives run here are not recorded by :func:`record` (the trace records its own)."""
    _RUNNING.depth += 1
    try:
        yield
    finally:
        _RUNNING.depth -= 1


# ---------------------------------------------------------------- MoE routing under a trace
#: how :func:`trace` charges a routed MoE layer (``fastdist.nn.moe``), whose row counts are data
ROUTINGS = ("balanced", "bound")
_MOE_PATCHED: list[tuple[Any, dict[str, Any]]] = []  # (module, originals) while traces run


def _balanced_dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    """``fastdist.nn.moe.dispatch`` that, in a ``routing="balanced"`` trace, receives the rows of
    a balanced routing: each of the ``E`` experts gets ``ceil(ep T k / E)`` rows (``T`` tokens
    with ``k`` experts each, on each of ``ep`` ranks), so ``all_to_all`` receives ``E_local x``
    that (at most ``capacity``) instead of the worst case ``ep T k``."""

    def dispatch(
        x: Tensor, experts: Tensor, mesh: Mesh, axis: str, num_experts: int, **kw: Any
    ) -> Any:
        if _RUNNING.routing != "balanced":
            return original(x, experts, mesh, axis, num_experts, **kw)
        n = mesh.axis_size(axis)
        T, k = experts.shape
        el = max(num_experts // n, 1)
        rows = math.ceil(n * T * k / num_experts)  # one expert's expected rows
        cap = kw.get("capacity")
        if cap is not None:
            rows = min(rows, cap // el)
        _RUNNING.expert_rows = rows
        if kw.get("strategy", "all_to_all") == "all_to_all":
            kw["capacity"] = el * rows
        return original(x, experts, mesh, axis, num_experts, **kw)

    return dispatch


def _balanced_experts(original: Callable[..., Any]) -> Callable[..., Any]:
    """``fastdist.nn.moe._run_experts`` that, in a ``routing="balanced"`` trace, runs each local
    expert as real ranks do (gather its rows, the expert, scatter-add back) on the balanced
    count of rows the dispatch set, instead of every expert on every row."""

    def run(
        x: Tensor, assign: Tensor, scale: Tensor | None, expert_fn: Any, simulated: bool
    ) -> Tensor:
        if _RUNNING.routing != "balanced" or not simulated:
            out: Tensor = original(x, assign, scale, expert_fn, simulated)
            return out
        rows = min(_RUNNING.expert_rows or x.shape[0], x.shape[0])
        idx = torch.arange(rows, device=x.device)  # (rows,): which rows does not change the cost
        y = x.new_zeros(x.shape[0], x.shape[-1])  # (R, H)
        for e in range(assign.shape[-1]):
            ye = expert_fn(x.index_select(0, idx), e)  # (rows, H)
            if scale is not None:
                ye = ye * scale[:, e].index_select(0, idx).unsqueeze(-1).to(ye.dtype)
            y = y.index_add(0, idx, ye)
        return y

    return run


@contextmanager
def _routing(routing: str) -> Iterator[None]:
    """Charge MoE layers by ``routing`` on this thread for the duration (see :func:`trace`)."""
    if routing not in ROUTINGS:
        raise ProfileError(
            "trace", f"routing={routing!r}", f"choose routing among {', '.join(ROUTINGS)}"
        )
    if routing == "bound":
        yield
        return
    from fastdist.nn import moe as M

    with _INSTALL:
        if not _MOE_PATCHED:
            saved: dict[str, Any] = {"dispatch": M.dispatch, "_run_experts": M._run_experts}
            M.dispatch = _balanced_dispatch(saved["dispatch"])
            M._run_experts = _balanced_experts(saved["_run_experts"])
            _MOE_PATCHED.append((M, saved))
        else:
            _MOE_PATCHED.append(_MOE_PATCHED[0])
    before = _RUNNING.routing
    _RUNNING.routing, _RUNNING.expert_rows = routing, 0
    try:
        yield
    finally:
        _RUNNING.routing, _RUNNING.expert_rows = before, 0
        with _INSTALL:
            mod, saved = _MOE_PATCHED.pop()
            if not _MOE_PATCHED:
                for name, fn in saved.items():
                    setattr(mod, name, fn)


def _unwrapped(t: Tensor) -> Tensor:
    """The tensor under simulate's vmap (and any torch.func wrapper): the one that carries the
    autograd node."""
    ft: Any = torch._C._functorch
    while ft.is_functorch_wrapped_tensor(t):
        t = ft.get_unwrapped(t)
    return t


def _recording_bind(prim: Primitive, stacked: bool) -> Callable[..., Tensor]:
    """``prim.bind`` (or ``bind_stacked``), recording each call into the active recordings."""
    bind = Primitive.bind_stacked if stacked else Primitive.bind

    def recorded(*tensors: Tensor, spec: Any, **params: Any) -> Tensor:
        if _RUNNING.depth or not _ACTIVE:
            return bind(prim, *tensors, spec=spec, **params)
        _RUNNING.depth += 1
        try:
            out = bind(prim, *tensors, spec=spec, **params)
        finally:
            _RUNNING.depth -= 1
        node: Any = torch._C._current_autograd_node()
        for rec in list(_ACTIVE):
            rec._add(prim.name, tensors, out, spec, params, stacked, node)
        return out

    return recorded


def _install() -> None:
    for prim in PRIMITIVES.values():
        prim.bind = _recording_bind(prim, False)  # type: ignore[method-assign]
        prim.bind_stacked = _recording_bind(prim, True)  # type: ignore[method-assign]


def _uninstall() -> None:
    for prim in PRIMITIVES.values():
        prim.__dict__.pop("bind", None)
        prim.__dict__.pop("bind_stacked", None)


class Recording:
    """The collectives of a step as it runs: the context manager :func:`record` returns.

    Attributes:
        mesh: the mesh of the records (as for :func:`trace`).
        profile: the :class:`Profile` of what ran so far (complete once the ``with`` block ends).
    """

    def __init__(self, mesh: Mesh, meshes: Sequence[Mesh], modules: Sequence[nn.Module]) -> None:
        self.mesh = mesh
        self._names = {tuple(m.shape.values()): m.axis_names for m in reversed([mesh, *meshes])}
        self._stack = _ModuleStack()
        self._modules = tuple(modules)
        self._hooks: ExitStack | None = None
        self._key = (_META_KEY, id(self))
        self._records: list[Record] = []

    def __enter__(self) -> Recording:
        if self._hooks is not None:
            raise ProfileError(
                "record", "this recording is already open", "open a new record(...) for each block"
            )
        self._hooks = ExitStack()
        self._hooks.enter_context(self._stack.hooks(self._modules))
        with _INSTALL:
            if not _ACTIVE:
                _install()
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _INSTALL:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                _uninstall()
        assert self._hooks is not None
        self._hooks.close()

    @property
    def profile(self) -> Profile:
        return Profile(self.mesh, tuple(self._records))

    def _add(
        self,
        op: str,
        tensors: Sequence[Any],
        out: Any,
        spec: Any,
        params: Mapping[str, Any],
        stacked: bool,
        node: Any,
    ) -> None:
        if node is None:
            module = self._stack.current
            fn: Any = _unwrapped(out).grad_fn
            # the backward collective this node will issue is attributed to the module running now
            if fn is not None:
                fn.metadata[self._key] = module
        else:
            module = str(node.metadata.get(self._key, ""))
        if stacked:  # [world, ...] tensors (simulate's backward): one rank's share
            tensors, out = tuple(_RankShare(t) for t in tensors), _RankShare(out)
        rec = _make_record(
            op,
            tensors,
            out,
            tuple(spec.mesh_shape),
            tuple(spec.axes),
            params,
            self._names,
            node is not None,
            module,
        )
        if rec is not None:
            self._records.append(rec)


def record(
    mesh: Mesh, *, meshes: Sequence[Mesh] = (), modules: Sequence[nn.Module] = ()
) -> Recording:
    """Record the collectives of a step while it really runs: on real ranks, or under
    :func:`fastdist.simulate`.

    A context manager (``with record(mesh) as rec:``); ``rec.profile`` is the :class:`Profile`.

    The same records (:class:`Record`) as :func:`trace` (one rank's: this process's on real
    ranks, rank 0's shapes under ``simulate``), forward and backward, with the module that
    issued each. Unlike
    :func:`trace` the step runs for real (data, memory, and on real ranks the communication);
    use it to profile the very step you train with, :func:`trace` to profile without running.

    Args:
        mesh: the mesh the step's collectives use (it names the axes of the records).
        meshes: further meshes the step uses.
        modules: modules whose submodules name the ``module`` field of each record.

    Every fastdist collective this process runs while the block is open is recorded, on any
    thread (the backward may run on autograd's threads), eager code only: a compiled step is
    recorded once, when dynamo traces it. Data-dependent sizes are charged as :func:`trace`
    charges them (``ragged_all_to_all``: the send buffer, ``bound=True``).

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 4})
    >>> with record(mesh) as rec:
    ...     out = fd.simulate(lambda x: fd.all_gather(x, mesh, "tp"), mesh)(torch.ones(4, 2, 3))
    >>> rec.profile == trace(lambda x: fd.all_gather(x, mesh, "tp"), mesh, torch.ones(2, 3))
    True
    """
    for m in [mesh, *meshes]:
        if not isinstance(m, Mesh):
            raise ProfileError(
                "record",
                f"expected a fastdist.Mesh, got {type(m).__name__}",
                "pass the Mesh the step runs on",
            )
    return Recording(mesh, meshes, modules)


# ====================================================================== the network and the
# alpha-beta model
@dataclass(frozen=True)
class Link:
    """One level of the network, seen from one GPU.

    Attributes:
        bandwidth: bytes per second one GPU can send (one direction).
        latency: seconds per message (alpha).
    """

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Network:
    """Two levels: GPUs within a node (``intra``) and across nodes (``inter``), and optionally
    the device's compute.

    Attributes:
        name: for tables.
        gpus_per_node: consecutive ranks ``[k*g, (k+1)*g)`` share node ``k``.
        intra: the link between GPUs of one node.
        inter: one GPU's share of the links between nodes.
        flops: achieved matmul FLOP/s of one device (0: compute is not charged).
        memory_bandwidth: achieved bytes/s of the other kernels (0: not charged).
        kernel_latency: seconds charged per kernel launch (0: not charged).
    """

    name: str
    gpus_per_node: int
    intra: Link
    inter: Link
    flops: float = 0.0
    memory_bandwidth: float = 0.0
    kernel_latency: float = 0.0

    def link(self, mesh_sizes: Sequence[int], axes: Sequence[int]) -> Link:
        """The link a group along ``axes`` of a row-major mesh runs over: ``intra`` if the
        group of rank 0 lies in one node, else ``inter`` (the slowest link bounds a ring).

        Args:
            mesh_sizes: the mesh's axis sizes, outer to inner (row-major).
            axes: the positions of the group's axes among them.

        Returns:
            ``intra`` or ``inter``.
        """
        return self.intra if _in_node(mesh_sizes, axes, self.gpus_per_node) else self.inter

    def collective_time(self, r: Record, mesh_sizes: Sequence[int], axes: Sequence[int]) -> float:
        """The ring's ``steps x latency + bus_bytes / bandwidth`` on :meth:`link`."""
        link = self.link(mesh_sizes, axes)
        return r.steps * link.latency + r.bus_bytes / link.bandwidth

    def compute_time(self, work: Work) -> float:
        """``flops / flops + bytes / memory_bandwidth + kernels x kernel_latency`` (a rate of 0:
        that term is not charged)."""
        return _compute_time(work, self.flops, self.memory_bandwidth, self.kernel_latency)


def _in_node(mesh_sizes: Sequence[int], axes: Sequence[int], gpus_per_node: int) -> bool:
    """The group of rank 0 along ``axes`` of a row-major mesh lies in one node."""
    strides = [math.prod(mesh_sizes[i + 1 :]) for i in range(len(mesh_sizes))]
    # rank 0's group: ranks 0 .. span
    span = sum((mesh_sizes[a] - 1) * strides[a] for a in axes)
    return span < gpus_per_node


def _compute_time(work: Work, flops: float, bandwidth: float, latency: float) -> float:
    t = work.kernels * latency
    if flops > 0:
        t += work.flops / flops
    if bandwidth > 0:
        t += work.bytes / bandwidth
    return t


#: Documented defaults (see docs/profile.md for the sources). Bandwidths are per GPU and per
#: direction; latencies are per message and are rough assumptions, not measurements.
NETWORKS: dict[str, Network] = {
    # DGX H100: NVLink 4, 900 GB/s bidirectional per GPU (450 GB/s each way); 8x ConnectX-7 NDR 400
    # Gb/s (50 GB/s) per GPU.
    "dgx-h100": Network("dgx-h100", 8, Link(450e9, 3e-6), Link(50e9, 10e-6)),
    # DGX A100: NVLink 3, 600 GB/s bidirectional per GPU (300 GB/s each way); 8x ConnectX-6 HDR 200
    # Gb/s (25 GB/s) per GPU.
    "dgx-a100": Network("dgx-a100", 8, Link(300e9, 3e-6), Link(25e9, 10e-6)),
    # 8 PCIe GPUs per node without NVLink (PCIe 4 x16, ~25 GB/s each way in practice) and 100 Gb/s
    # Ethernet per node shared by 8 GPUs.
    "pcie-ethernet": Network("pcie-ethernet", 8, Link(25e9, 5e-6), Link(12.5e9 / 8, 30e-6)),
}


# ====================================================== a cost model measured on the job:
# calibrate
#: the collective kinds :func:`calibrate` measures, and the fastdist op that measures each
CALIBRATED_KINDS = ("allreduce", "allgather", "reducescatter", "alltoall", "sendrecv")
# kinds priced with another kind's fit (the same bus factor (n-1)/n, or one hop)
_SAME_AS = {"gather": "allgather", "scatter": "allgather", "broadcast": "allgather"}


@dataclass(frozen=True)
class Fit:
    """``time = latency + size / bandwidth`` of one collective kind over a group of ``n`` ranks.

    Attributes:
        kind: the nccl-tests kind (:func:`bus_factor`).
        n: ranks in the group.
        intra: the groups it was measured on lie in one node (``CostModel.gpus_per_node``).
        latency: seconds (the fit's intercept).
        per_byte: seconds per byte of S (nccl-tests' size of ``kind``).
        error: the largest ``|fit / measured - 1|`` over the points it was fitted to.
    """

    kind: str
    n: int
    intra: bool
    latency: float
    per_byte: float
    error: float

    def time(self, size: float) -> float:
        return self.latency + self.per_byte * size


@dataclass(frozen=True)
class Point:
    """One measurement of :func:`calibrate`: the median over repetitions of the slowest rank."""

    kind: str
    axis: str
    n: int
    intra: bool
    size: int
    seconds: float


@dataclass(frozen=True)
class CostModel:
    """A cost model measured on a running job (:func:`calibrate`); the planner takes it where it
    takes a :class:`Network`.

    Collectives: one :class:`Fit` per (kind, group size, in a node or not). A group size that
    was not measured is priced by the rule :meth:`fit` states. Compute: measured matmul FLOP/s,
    memory bandwidth and per-kernel time, as :meth:`Network.compute_time` charges them.

    Attributes:
        name: for tables.
        gpus_per_node: ranks per node of the job it was measured on.
        fits: the fitted collectives.
        flops: matmul FLOP/s of one rank (every rank computing at once).
        memory_bandwidth: bytes/s of an elementwise kernel on one rank (every rank at once).
        kernel_latency: seconds per aten kernel of a chain of tiny ops, forward and backward.
        points: the measurements the fits come from.
        kernel_times: ``(key, seconds)`` of each kernel :func:`calibrate_kernels` replayed (one
            call, the kernel alone); empty: every kernel is charged by the rates above.
        kernel_overhead: seconds added to each replayed kernel's time for what a step spends
            around it (autograd, Python, dispatch beyond the kernel; see
            :func:`calibrate_kernels`).
    """

    name: str
    gpus_per_node: int
    fits: tuple[Fit, ...]
    flops: float
    memory_bandwidth: float
    kernel_latency: float
    points: tuple[Point, ...] = ()
    kernel_times: tuple[tuple[str, float], ...] = ()
    kernel_overhead: float = 0.0
    _times: dict[str, float] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_times", dict(self.kernel_times))

    def fit(self, kind: str, n: int, intra: bool = True) -> Fit:
        """The cost of ``kind`` over ``n`` ranks.

        A measured group size: its fit. Between two measured sizes ``n1 < n < n2``: latency and
        per-byte cost interpolated linearly in ``n``. Outside the measured sizes: the nearest
        measured fit scaled as the ring scales, latency by ``steps(n) / steps(n0)`` (``2(n-1)``
        for all-reduce, ``n-1`` otherwise, 1 for send/recv) and per-byte cost by
        ``bus_factor(n) / bus_factor(n0)``. ``gather``, ``scatter`` and ``broadcast`` are priced
        as ``allgather``.

        Args:
            kind: the nccl-tests kind (`bus_factor`).
            n: the ranks in the group.
            intra: the group lies in one node.

        Returns:
            the `Fit` that prices ``kind`` over ``n`` ranks.
        """
        kind = _SAME_AS.get(kind, kind)
        have = sorted((f.n, f) for f in self.fits if f.kind == kind and f.intra == intra)
        if not have:
            where = "inside a node" if intra else "across nodes"
            raise ProfileError(
                "CostModel",
                f"{self.name!r} has no measurement of {kind} over a group {where}",
                "calibrate on a job whose mesh has such a group (e.g. an axis that crosses "
                "nodes), with that kind in kinds=",
            )
        for m, f in have:
            if m == n:
                return f
        below = [f for m, f in have if m < n]
        above = [f for m, f in have if m > n]
        if below and above:
            lo, hi = below[-1], above[0]
            w = (n - lo.n) / (hi.n - lo.n)
            return Fit(
                kind,
                n,
                intra,
                lo.latency + w * (hi.latency - lo.latency),
                lo.per_byte + w * (hi.per_byte - lo.per_byte),
                max(lo.error, hi.error),
            )
        near = below[-1] if below else above[0]
        alpha = _steps(kind, n) / max(_steps(kind, near.n), 1)
        beta = bus_factor(kind, n) / max(bus_factor(kind, near.n), 1e-12)
        return Fit(kind, n, intra, near.latency * alpha, near.per_byte * beta, near.error)

    def collective_time(self, r: Record, mesh_sizes: Sequence[int], axes: Sequence[int]) -> float:
        """The fitted time of one collective: ``latency + per_byte x size`` of its kind and
        group size (see :meth:`fit`)."""
        return self.fit(r.kind, r.n, _in_node(mesh_sizes, axes, self.gpus_per_node)).time(r.size)

    def compute_time(self, work: Work) -> float:
        """Seconds of ``work``: each of its kernels (:attr:`Work.calls`) that
        :func:`calibrate_kernels` timed costs its replayed time plus ``kernel_overhead``; the
        others (and work without calls) as :meth:`Network.compute_time` charges them, with the
        measured rates."""
        if not self._times or not work.calls:
            return _compute_time(work, self.flops, self.memory_bandwidth, self.kernel_latency)
        t = 0.0
        for key, count, flops, nbytes in work.calls:
            known = self._times.get(key)
            if known is not None:
                t += count * (known + self.kernel_overhead)
            else:
                one = Work(work.phase, flops, 1, nbytes)
                t += count * _compute_time(
                    one, self.flops, self.memory_bandwidth, self.kernel_latency
                )
        return t

    def to_json(self) -> str:
        """The model as JSON (:meth:`from_json` reads it back)."""
        return json.dumps(
            {
                "format": "fastdist.profile.CostModel/1",
                "name": self.name,
                "gpus_per_node": self.gpus_per_node,
                "flops": self.flops,
                "memory_bandwidth": self.memory_bandwidth,
                "kernel_latency": self.kernel_latency,
                "fits": [asdict(f) for f in self.fits],
                "points": [asdict(p) for p in self.points],
                "kernel_overhead": self.kernel_overhead,
                "kernel_times": dict(self.kernel_times),
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        """Read :meth:`to_json`'s output."""
        try:
            d = json.loads(text)
            if d.get("format") != "fastdist.profile.CostModel/1":
                raise ValueError(f"format {d.get('format')!r}")
            return cls(
                str(d["name"]),
                int(d["gpus_per_node"]),
                tuple(Fit(**f) for f in d["fits"]),
                float(d["flops"]),
                float(d["memory_bandwidth"]),
                float(d["kernel_latency"]),
                tuple(Point(**p) for p in d["points"]),
                tuple((str(k), float(v)) for k, v in d.get("kernel_times", {}).items()),
                float(d.get("kernel_overhead", 0.0)),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ProfileError(
                "CostModel.from_json",
                f"not a saved CostModel ({e})",
                "pass the text CostModel.to_json() (or save()) wrote",
            ) from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_json` to ``path``."""
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModel:
        """Read a model :meth:`save` wrote."""
        return cls.from_json(Path(path).read_text())


def _fit_points(points: Sequence[Point]) -> tuple[Fit, ...]:
    """One Fit per (kind, n, intra): least squares of the relative error of ``a + b S`` (in plain
    floats: every rank fits bit-identical models), a and b kept >= 0."""
    groups: dict[tuple[str, int, bool], list[Point]] = {}
    for pt in points:
        groups.setdefault((pt.kind, pt.n, pt.intra), []).append(pt)
    fits = []
    for (kind, n, intra), pts in sorted(groups.items()):
        # rows u = 1/t, v = S/t: minimise sum (a u + b v - 1)^2 (the normal equations)
        u = [1.0 / p.seconds for p in pts]
        v = [p.size / p.seconds for p in pts]
        uu, uv, vv = sum(x * x for x in u), sum(x * y for x, y in zip(u, v)), sum(y * y for y in v)
        su, sv = sum(u), sum(v)
        det = uu * vv - uv * uv
        alpha, beta = (
            ((su * vv - sv * uv) / det, (sv * uu - su * uv) / det) if det > 0 else (-1.0, -1.0)
        )
        if alpha < 0 or beta < 0:  # one term alone: the better of the two
            only = [(su / uu, 0.0), (0.0, sv / vv)]
            alpha, beta = min(
                only, key=lambda ab: max(abs((ab[0] + ab[1] * p.size) / p.seconds - 1) for p in pts)
            )
        err = max(abs((alpha + beta * p.size) / p.seconds - 1) for p in pts)
        fits.append(Fit(kind, n, intra, alpha, beta, err))
    return tuple(fits)


def _measure(
    fn: Callable[[], Any],
    reps: int,
    calls: int = 1,
    least: float = 0.0,
    sync: Callable[[], None] = lambda: None,
) -> float:
    """Seconds per call: the median over ``reps`` repetitions, each started after a barrier of the
    whole job, of ``calls`` back-to-back calls (one warm-up call first). ``least``: a local
    kernel is repeated for at least that many seconds per repetition (sharing a core shows in a
    window longer than a time slice); never for a collective (every rank must call it as
    often). ``sync`` waits for the device (CUDA kernels are asynchronous)."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    fn()
    sync()
    if least > 0:
        calls = max(calls, math.ceil(least / max(time.perf_counter() - t0, 1e-7)))
    times = []
    for _ in range(reps):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _collective_call(
    kind: str, size: int, n: int, dtype: torch.dtype, mesh: Mesh, axis: Any, dev: torch.device
) -> tuple[Callable[[], Any], int]:
    """A call of the fastdist collective of ``kind`` with S about ``size`` bytes over ``n`` ranks,
    and its exact S."""
    from fastdist.ops import collectives as C

    elems = max(n, size // dtype.itemsize // n * n)  # a multiple of n
    if kind == "allreduce":
        x = torch.zeros(elems, dtype=dtype, device=dev)
        return (lambda: C.psum(x, mesh, axis)), elems * dtype.itemsize
    if kind == "allgather":  # S: the gathered output
        x = torch.zeros(elems // n, dtype=dtype, device=dev)
        return (lambda: C.all_gather(x, mesh, axis)), elems * dtype.itemsize
    if kind == "reducescatter":  # S: the input
        x = torch.zeros(elems, dtype=dtype, device=dev)
        return (lambda: C.psum_scatter(x, mesh, axis)), elems * dtype.itemsize
    if kind == "alltoall":  # S: one rank's send buffer; [n, elems/n] -> n blocks
        x = torch.zeros(n, elems // n, dtype=dtype, device=dev)
        return (lambda: C.all_to_all(x, mesh, axis, 0, 0)), elems * dtype.itemsize
    if kind == "sendrecv":
        x = torch.zeros(elems, dtype=dtype, device=dev)
        return (lambda: C.ring_shift(x, mesh, axis, 1)), elems * dtype.itemsize
    raise ProfileError(
        "calibrate",
        f"cannot measure collective kind {kind!r}",
        f"choose kinds among {', '.join(CALIBRATED_KINDS)}",
    )


def _burst(size: int) -> int:
    """Calls timed back to back for a point of S = ``size`` bytes: 8 up to 64 KiB, fewer above,
    1 from 1 MiB."""
    return max(1, min(8, (1 << 19) // max(size, 1)))


def _kernel_chain(length: int, dev: torch.device) -> Callable[[], None]:
    """Forward and backward of ``length`` tiny elementwise ops (the per-kernel cost)."""
    x = torch.ones(16, device=dev, requires_grad=True)

    def run() -> None:
        y = x
        for _ in range(length):
            y = y * 1.0001
        y.sum().backward()  # type: ignore[no-untyped-call]

    return run


class _KernelCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts aten kernels as :func:`trace` counts them."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kernels = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if func.namespace == "aten" and not func.is_view and func not in _NOT_KERNELS:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def _calibration_device(device: Any) -> torch.device:
    """Where calibration measures: ``device``, else the current CUDA device under NCCL, else
    the CPU."""
    import torch.distributed as dist

    if device is not None:
        return torch.device(device)
    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def calibrate(
    mesh: Mesh,
    *,
    axes: Sequence[str | tuple[str, ...]] | None = None,
    kinds: Sequence[str] = CALIBRATED_KINDS,
    sizes: Sequence[int] = (1 << 12, 1 << 16, 1 << 20, 1 << 22),
    reps: int = 5,
    matmul: int = 512,
    dtype: torch.dtype = torch.float32,
    gpus_per_node: int | None = None,
    device: str | torch.device | None = None,
    name: str = "calibrated",
) -> CostModel:
    """Measure the running job's collectives and compute, and fit a :class:`CostModel`.

    A collective: every rank of ``mesh`` must call it (same arguments). For each axis (or
    tuple of axes) in ``axes``, each collective kind in ``kinds`` and each size in ``sizes``
    (S in bytes, nccl-tests' definition, rounded to a multiple of the group size), the
    fastdist collective is timed ``reps`` times after a warm-up, each time after a barrier of
    the job (below 1 MiB, a burst of up to 8 back-to-back calls, divided by their number); a
    point is the median over the repetitions of the slowest rank. Points of the same
    kind and group size (on any axis) are fitted together by ``latency + size / bandwidth``
    (least squares of the relative error; see :meth:`CostModel.fit` for group sizes that were
    not measured). Compute is measured the same way, every rank at once: a ``matmul`` x
    ``matmul`` x ``matmul`` matmul (FLOP/s), an elementwise add of 4 Mi elements (bytes/s) and
    a chain of tiny ops forward and backward (seconds per kernel), each repeated for at least
    50 ms per repetition (so that ranks sharing a core show it). With the defaults and
    two axes, a few seconds on 4 CPU processes; widen ``sizes`` and ``reps`` for a finer fit.

    Args:
        mesh: a mesh over the running job (``Mesh.from_torch``).
        axes: what to measure: axis names or tuples of names (default: each axis of size > 1,
            and the tuple of all of them when there are several).
        kinds: collective kinds among :data:`CALIBRATED_KINDS`.
        sizes: S in bytes.
        reps: timed calls per point.
        matmul: the side of the square matmul timed for the FLOP/s.
        dtype: element type of the buffers and the matmul.
        gpus_per_node: ranks per node (default: ``LOCAL_WORLD_SIZE`` from the environment, else
            the whole job).
        device: where the buffers and the compute live (default: this process's CUDA device
            when the job's default process group is NCCL, else the CPU).
        name: the model's name in tables.

    Raises:
        ProfileError: ``mesh`` is a plain mesh (simulated ranks: nothing to measure), or an
            argument is invalid.
    """
    if not isinstance(mesh, Mesh):
        raise ProfileError(
            "calibrate",
            f"expected a fastdist.Mesh, got {type(mesh).__name__}",
            "pass Mesh.from_torch(...) of the running job",
        )
    if mesh.backend is None:
        raise ProfileError(
            "calibrate",
            f"{mesh!r} is a plain mesh: its ranks are simulated in this process, so there are no "
            "links or devices to measure",
            "run calibrate inside the job on Mesh.from_torch(...) and save() the model (then "
            "CostModel.load(path) anywhere), or plan with a documented Network from NETWORKS",
        )
    bad = [k for k in kinds if k not in CALIBRATED_KINDS]
    if bad or not kinds or not sizes or any(s < 1 for s in sizes) or reps < 1 or matmul < 1:
        raise ProfileError(
            "calibrate",
            f"kinds={tuple(kinds)}, sizes={tuple(sizes)}, reps={reps}, matmul={matmul}",
            f"kinds among {', '.join(CALIBRATED_KINDS)}, positive sizes, reps >= 1, matmul >= 1",
        )
    import torch.distributed as dist

    names = mesh.axis_names
    if axes is None:
        big = tuple(a for a in names if mesh.shape[a] > 1)
        groups: list[str | tuple[str, ...]] = [*big, *([big] if len(big) > 1 else [])]
    else:
        groups = list(axes)
    for g in groups:
        parts = (g,) if isinstance(g, str) else tuple(g)
        if not parts or any(a not in names for a in parts):
            raise ProfileError(
                "calibrate",
                f"{g!r} is not an axis (or tuple of axes) of {mesh!r}",
                f"name axes among {names}",
            )
    node = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    dev = _calibration_device(device)
    sizes_now = tuple(mesh.shape.values())
    plan_: list[tuple[str, str, int, bool, int, Callable[[], Any]]] = []
    for g in groups:
        parts = (g,) if isinstance(g, str) else tuple(g)
        n = math.prod(mesh.shape[a] for a in parts)
        if n < 2:
            continue
        intra = _in_node(sizes_now, [names.index(a) for a in parts], node)
        axis: Any = g if isinstance(g, str) else parts
        for kind in kinds:
            for size in sizes:
                fn, exact = _collective_call(kind, size, n, dtype, mesh, axis, dev)
                plan_.append((kind, "+".join(parts), n, intra, exact, fn))
    # small buffers: bursts of back-to-back calls (as in a step), not one call after a barrier
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    seconds = [_measure(fn, reps, _burst(exact), sync=sync) for *_, exact, fn in plan_]
    a = torch.randn(matmul, matmul, dtype=dtype, device=dev)
    b = torch.randn(matmul, matmul, dtype=dtype, device=dev)
    x = torch.randn(1 << 22, dtype=dtype, device=dev)
    y, z = torch.randn_like(x), torch.empty_like(x)
    chain = _kernel_chain(64, dev)
    counter = _KernelCounter()
    with counter:
        chain()
    compute = [  # each repetition at least 50 ms: every rank computing at once, sharing
        _measure(lambda: torch.mm(a, b), reps, least=0.05, sync=sync),
        _measure(lambda: torch.add(x, y, out=z), reps, least=0.05, sync=sync),
        _measure(chain, reps, least=0.05, sync=sync),
    ]
    # the slowest rank's medians, on every rank (every rank then fits the same model)
    slowest = torch.tensor([*seconds, *compute], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    times = slowest.tolist()
    points = tuple(
        Point(kind, axis_name, n, intra, exact, t)
        for (kind, axis_name, n, intra, exact, _), t in zip(plan_, times)
    )
    t_mm, t_add, t_chain = times[len(plan_) :]
    return CostModel(
        name,
        node,
        _fit_points(points),
        flops=2.0 * matmul**3 / t_mm,
        memory_bandwidth=3.0 * x.numel() * x.dtype.itemsize / t_add,
        kernel_latency=t_chain / max(counter.kernels, 1),
        points=points,
    )


def _replay(kernel: _Kernel, dev: torch.device, least: float, sync: Callable[[], None]) -> float:
    """Seconds per call of one kernel on real tensors of its shapes: a warm-up call, then back to
    back calls for at least ``least`` seconds; ``inf`` when it cannot be replayed."""
    try:
        args, kwargs = pytree.tree_map(lambda a: _materialize(a, dev), (kernel.args, kernel.kwargs))
        with torch.no_grad():
            t0 = time.perf_counter()
            kernel.func(*args, **kwargs)
            sync()
            calls = max(1, min(10_000, math.ceil(least / max(time.perf_counter() - t0, 1e-7))))
            t0 = time.perf_counter()
            for _ in range(calls):
                kernel.func(*args, **kwargs)
            sync()
            return (time.perf_counter() - t0) / calls
    except Exception:  # noqa: BLE001 - a kernel that cannot run on made-up data: not timed
        return math.inf


def _chain_step(x: Tensor) -> None:
    y = x
    for _ in range(64):
        y = y * 1.0001
    y.sum().backward()  # type: ignore[no-untyped-call]


def calibrate_kernels(
    mesh: Mesh,
    profiles: Profile | Sequence[Profile],
    model: CostModel,
    *,
    reps: int = 5,
    least: float = 2e-3,
    device: str | torch.device | None = None,
) -> CostModel:
    """Time the kernels the traced steps issue on this job's devices: ``model`` with
    :attr:`CostModel.kernel_times` (a collective over ``mesh``'s job).

    Every distinct kernel of ``profiles`` (:attr:`Profile.kernels`: the aten op with its shapes,
    strides, dtypes and other arguments: matmuls, attention, elementwise kernels, forward and
    backward) is replayed on real tensors of those shapes (floats drawn from a normal, integers
    0, bools True): a warm-up call, then back-to-back calls for at least ``least`` seconds. The
    kernels are timed in ``reps`` interleaved rounds (each round after a barrier, every rank at
    once, as in a step: ranks sharing a core show it); a kernel's time is its median over the
    rounds, then the slowest rank's. A kernel that cannot be replayed (or on any rank) is left
    out and charged by ``model``'s rates.

    ``kernel_overhead``: a step also spends time around each kernel (autograd, Python,
    dispatch). A chain of 64 tiny multiplications, forward and backward, is timed the same
    way, whole and kernel by kernel: the overhead is ``(whole - sum of its kernels) / kernels``
    (at least 0).

    :meth:`CostModel.compute_time` then charges each timed kernel ``kernel_times[key] +
    kernel_overhead``; a :class:`Work` without calls (DataParallel's packing) and kernels not
    timed keep the rates. Contract: every rank passes profiles with the same kernels (trace the
    same layouts on every rank), else :class:`ProfileError`; every rank returns the same model.

    Args:
        mesh: a mesh over the running job (``Mesh.from_torch``): every rank calls this.
        profiles: :func:`trace` results (one per layout to price).
        model: the :func:`calibrate` model to extend (collectives and fallback rates).
        reps: interleaved rounds.
        least: seconds of back-to-back calls per kernel per round.
        device: where to replay (default: as :func:`calibrate`).

    Returns:
        ``model`` with ``kernel_times`` and ``kernel_overhead`` set (``name`` unchanged).

    Raises:
        ProfileError: ``mesh`` is a plain mesh, the ranks' profiles differ, or an argument is
            invalid.
    """
    if not isinstance(mesh, Mesh) or mesh.backend is None:
        raise ProfileError(
            "calibrate_kernels",
            f"{mesh!r} is not a mesh over a running job",
            "pass Mesh.from_torch(...) inside the job (every rank calls calibrate_kernels)",
        )
    if reps < 1 or least <= 0:
        raise ProfileError(
            "calibrate_kernels", f"reps={reps}, least={least}", "reps >= 1 and least > 0"
        )
    import torch.distributed as dist

    profs = [profiles] if isinstance(profiles, Profile) else list(profiles)
    dev = _calibration_device(device)
    sync: Callable[[], None] = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    kernels: dict[str, _Kernel] = {}
    for p in profs:
        for k, v in p.kernels.items():
            kernels.setdefault(k, v)
    keys = sorted(kernels)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, keys)
    differ = [r for r, other in enumerate(every) if other != keys]
    if differ:
        raise ProfileError(
            "calibrate_kernels",
            f"rank {dist.get_rank()}'s profiles issue {len(keys)} distinct kernels, rank "
            f"{differ[0]}'s {len(every[differ[0]])} others or more",
            "trace the same steps (the same layouts and one rank's shapes) on every rank",
        )
    chain = trace(_chain_step, Mesh({"one": 1}), torch.ones(16, requires_grad=True))
    chain_calls = [c for w in chain.events if isinstance(w, Work) for c in w.calls]
    chain_kernels = sum(c[1] for c in chain_calls)
    chain_keys = sorted({c[0] for c in chain_calls} - set(keys))
    todo = [kernels[k] for k in keys] + [chain.kernels[k] for k in chain_keys]
    x = torch.ones(16, device=dev, requires_grad=True)
    rounds: list[list[float]] = []
    for _ in range(reps):
        dist.barrier()
        row = [_replay(k, dev, least, sync) for k in todo]
        t0 = time.perf_counter()
        calls = 0
        while time.perf_counter() - t0 < least * 5 or calls < 2:
            _chain_step(x)
            calls += 1
        sync()
        rounds.append([*row, (time.perf_counter() - t0) / calls])
    # (kernels + 1,): each kernel's median over the rounds
    per = torch.tensor([statistics.median(col) for col in zip(*rounds)], dtype=torch.float64)
    dist.all_reduce(per, op=dist.ReduceOp.MAX)  # the slowest rank; inf: not replayable somewhere
    times = per.tolist()
    timed = dict(zip(keys + chain_keys, times))
    replayed = sum(c * timed.get(k, math.inf) for k, c in ((c[0], c[1]) for c in chain_calls))
    overhead = (
        max(0.0, (times[-1] - replayed) / max(chain_kernels, 1)) if math.isfinite(replayed) else 0.0
    )
    return replace(
        model,
        kernel_times=tuple((k, t) for k, t in zip(keys, times) if math.isfinite(t)),
        kernel_overhead=overhead,
    )


def calibrate_step(
    mesh: Mesh,
    step: Callable[[], Any],
    profile: Profile,
    model: CostModel,
    *,
    data_parallel: str | Sequence[str] | None = None,
    bucket_mb: float = 25.0,
    reps: int = 5,
) -> CostModel:
    """Fit ``model.kernel_overhead`` to one real step of the running job (a collective over
    ``mesh``'s job).

    ``step()`` runs, on this rank, the step ``profile`` traced: the same model, layout and
    shapes, with the data-parallel engine ``data_parallel`` and ``bucket_mb`` describe to
    :func:`predict`. It is called once (warm-up), then ``reps`` times, each after a barrier of
    the job; the measured step is the slowest rank's median. With ``predicted =
    predict(profile, model, ...).time`` and ``kernels`` the number of the step's kernels
    ``model`` has replayed times for (:func:`calibrate_kernels`), the returned model's overhead
    is ``max(0, model.kernel_overhead + (measured - predicted) / kernels)``: what this model's
    steps spend beyond their replayed kernels and fitted collectives (the Python of the model
    and of fastdist's real-rank paths, autograd, host synchronizations), charged per kernel to
    every layout it then prices. Price other layouts of the same model with it; the layout it
    was fitted on is no longer a prediction.

    Args:
        mesh: a mesh over the running job (every rank calls this).
        step: one step on this rank (forward, backward, the engine's reduction).
        profile: :func:`trace` (or :func:`trace_model`) of that step on one rank.
        model: a :func:`calibrate_kernels` model.
        data_parallel: as for :func:`predict`.
        bucket_mb: as for :func:`predict`.
        reps: timed steps.

    Returns:
        ``model`` with the fitted ``kernel_overhead`` (every rank the same).

    Raises:
        ProfileError: ``mesh`` is a plain mesh, ``model`` has no kernel times for the step, or
            ``reps < 1``.
    """
    if not isinstance(mesh, Mesh) or mesh.backend is None:
        raise ProfileError(
            "calibrate_step",
            f"{mesh!r} is not a mesh over a running job",
            "pass Mesh.from_torch(...) inside the job (every rank calls calibrate_step)",
        )
    kernels = sum(
        c[1] for e in profile.events if isinstance(e, Work) for c in e.calls if c[0] in model._times
    )
    if kernels == 0 or reps < 1:
        raise ProfileError(
            "calibrate_step",
            f"{model.name!r} has replayed times for {kernels} of the step's kernels (reps={reps})",
            "call calibrate_kernels(mesh, profile, model) on the step's profile first, reps >= 1",
        )
    import torch.distributed as dist

    step()
    seconds: list[float] = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t0)
    measured = torch.tensor([statistics.median(seconds)], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    predicted = predict(profile, model, data_parallel=data_parallel, bucket_mb=bucket_mb).time
    overhead = model.kernel_overhead + (float(measured) - predicted) / kernels
    return replace(model, kernel_overhead=max(0.0, overhead))


@dataclass(frozen=True)
class Pipeline:
    """How a step is pipelined over a mesh axis: :func:`predict` and :func:`plan` price it.

    The profile given to :func:`predict` is then **one micro-batch's** step through the whole
    model (forward and backward, on the other axes: tp, sp, ep; nothing over ``axis``), and
    ``microbatches`` of them make a step. The model is cut into ``pp x virtual`` stages (``pp``:
    the size of ``axis`` on the profile's mesh; stage ``j`` on rank ``j % pp``, as
    :mod:`fastdist.train.schedules` places them).

    Attributes:
        microbatches: micro-batches per step.
        schedule: a name in :data:`fastdist.train.schedules.NAMES` (``"gpipe"``, ``"1f1b"``,
            ``"interleaved_1f1b"``).
        virtual: stages per rank: ``1``, or 2 and more for ``"interleaved_1f1b"``.
        axis: the mesh axis the stages lie along.
        boundary_bytes: bytes one rank sends across a stage boundary per micro-batch (the hidden
            states, and as many back for their gradient); ``None``: the output of a traced layer
            module (``model.layers.N``: :attr:`Profile.outputs`, so trace with ``modules=``).

    >>> str(Pipeline(8))
    '1f1b, 8 micro-batches'
    """

    microbatches: int
    schedule: str = "1f1b"
    virtual: int = 1
    axis: str = "pp"
    boundary_bytes: int | None = None

    def __post_init__(self) -> None:
        from fastdist.train.schedules import NAMES

        def count(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        if not count(self.microbatches) or not count(self.virtual):
            raise ProfileError(
                "Pipeline",
                f"microbatches={self.microbatches!r}, virtual={self.virtual!r}",
                "pass positive ints",
            )
        if self.schedule not in NAMES:
            raise ProfileError(
                "Pipeline",
                f"schedule {self.schedule!r} is not known",
                f"use one of {', '.join(NAMES)}",
            )
        interleaved = self.schedule == "interleaved_1f1b"
        if interleaved != (self.virtual > 1):
            raise ProfileError(
                "Pipeline",
                f"schedule {self.schedule!r} with virtual={self.virtual}",
                "use virtual >= 2 with 'interleaved_1f1b' and virtual=1 with the others",
            )
        if self.boundary_bytes is not None and not count(self.boundary_bytes):
            raise ProfileError(
                "Pipeline",
                f"boundary_bytes={self.boundary_bytes!r}",
                "pass the positive bytes of one micro-batch's hidden states on one rank, or None "
                "to take them from the trace",
            )

    def __str__(self) -> str:
        v = f", {self.virtual} stages per rank" if self.virtual > 1 else ""
        return f"{self.schedule}, {self.microbatches} micro-batches{v}"


@dataclass(frozen=True)
class PipelineCost:
    """What :func:`predict` charged for a :class:`Pipeline` (seconds, bytes), as
    ``Prediction.pipeline``.

    Attributes:
        schedule: the schedule (``pp x virtual`` stages, stage ``j`` on rank ``j % pp``).
        boundary_bytes: bytes one rank sends across a boundary per micro-batch and direction.
        transfer: seconds of one such send on the link of the pipeline axis: the time a stage's
            output (or input gradient) takes to reach the next (previous) stage on another
            rank, charged on that dependency, not to either rank.
        forward: per stage, one micro-batch's forward through it: its compute and its
            collectives over the other axes (tp, sp, ep), in series; the sends excluded.
        backward: the same for the backward.
        makespan: the schedule's timeline with those costs and ``transfer`` (:meth:`timeline`):
            first action to last.
        bubble: the share of ``pp x makespan`` that ranks sit idle in that timeline (fill and
            drain, waits for slower stages, waits for transfers).
        finish: per pipeline rank, when its step ends: its last backward, then the data-parallel
            reduction of its stages' gradients not hidden behind that backward.
        memory: per pipeline rank, its memory (its stages' parameters, gradients, optimizer
            state, and activations of ``peak_in_flight(rank)`` micro-batch-stages).
    """

    schedule: Schedule = field(repr=False)
    boundary_bytes: int
    transfer: float
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    makespan: float
    bubble: float
    finish: tuple[float, ...]
    memory: tuple[Memory, ...]

    def timeline(self) -> list[Slot]:
        """The predicted timeline: every action of the step placed in time
        (:meth:`fastdist.train.schedules.Schedule.timeline` with :attr:`forward`,
        :attr:`backward` and :attr:`transfer`)."""
        return self.schedule.timeline(self.forward, self.backward, transfer=self.transfer)


@dataclass(frozen=True)
class Layout:
    """Axis sizes in mesh order (outer to inner: the last axis varies fastest, so it is the one
    kept inside a node).

    Attributes:
        axes: ``(name, size)`` pairs of the axes of size > 1, outer to inner.
        unit: names of further axes of size 1 (:func:`layouts` leaves them out of ``axes``); the
            :attr:`mesh` has them too, innermost, so a step may use every axis whatever the layout
            (a collective over a size-1 axis moves nothing and is not recorded). Not compared.
        pipeline: how the step is pipelined over ``pipeline.axis`` (:class:`Pipeline`), or None.

    >>> dict(Layout((("dp", 4),), unit=("tp",)).mesh.shape)
    {'dp': 4, 'tp': 1}
    >>> str(Layout((("pp", 2), ("tp", 4)), pipeline=Pipeline(8)))
    'pp2 x tp4 (1f1b, 8 micro-batches)'
    """

    axes: tuple[tuple[str, int], ...]
    unit: tuple[str, ...] = field(default=(), compare=False)
    pipeline: Pipeline | None = None

    @property
    def mesh(self) -> Mesh:
        return Mesh((*self.axes, *((name, 1) for name in self.unit if name not in dict(self.axes))))

    def __str__(self) -> str:
        name = " x ".join(f"{a}{s}" for a, s in self.axes)
        return f"{name} ({self.pipeline})" if self.pipeline is not None else name


@dataclass(frozen=True)
class Prediction:
    """The predicted step of one layout (seconds): in total, and its parts.

    Attributes:
        layout: the layout.
        time: the predicted step: compute and the collectives on the critical path, and the
            part of the overlapped gradient reduction that backward does not hide. With a
            network that charges no compute and no ``data_parallel``, the sum of the
            collectives' times.
        by_axis: time of the collectives per axis (all of it, overlapped or not).
        by_phase: time of the collectives per phase.
        profile: the profile it was predicted from.
        compute: time of the compute (:class:`Work`), including packing the gradient buckets.
        comm: time of every collective (overlapped or not).
        exposed: the part of ``time`` spent waiting for collectives (``time - compute``).
        memory: one rank's memory (:meth:`Profile.memory`), or None when not asked for; with a
            pipeline, the rank with the most.
        fits: ``memory.total`` is within the memory budget (True when no budget is given).
        pipeline: with a :class:`Pipeline`, what it charged (:class:`PipelineCost`); then
            ``by_axis``, ``by_phase``, ``compute`` and ``comm`` are one rank's over the whole
            step (the rank that finishes last; on the pipeline axis, the sends it issues), and
            ``exposed`` includes the bubble.
    """

    layout: Layout
    time: float
    by_axis: dict[str, float] = field(default_factory=dict)
    by_phase: dict[str, float] = field(default_factory=dict)
    profile: Profile | None = None
    compute: float = 0.0
    comm: float = 0.0
    exposed: float = 0.0
    memory: Memory | None = None
    fits: bool = True
    pipeline: PipelineCost | None = None


def _axis_index(names: Sequence[str], axis: str) -> list[int]:
    parts = axis.split("+")
    return [names.index(a) for a in parts] if all(a in names for a in parts) else []


def _buckets(params: Sequence[Param], cap: int) -> list[list[int]]:
    """DataParallel's buckets: reverse registration order, one open bucket per dtype, a new one
    when the next parameter would pass ``cap`` bytes."""
    out: list[list[int]] = []
    used: list[int] = []
    current: dict[torch.dtype, int] = {}
    for i in reversed(range(len(params))):
        b = current.get(params[i].dtype)
        if b is None or used[b] + params[i].bytes > cap:
            b = current[params[i].dtype] = len(out)
            out.append([])
            used.append(0)
        out[b].append(i)
        used[b] += params[i].bytes
    return out


def predict(
    profile: Profile,
    network: Network | CostModel,
    *,
    data_parallel: str | Sequence[str] | None = None,
    bucket_mb: float = 25.0,
    optimizer: str | float = "adamw",
    memory: float | None = None,
    pipeline: Pipeline | None = None,
) -> Prediction:
    """Predict one step of ``profile`` on ``network``: its compute, its collectives, and what
    overlaps.

    The traced step is walked in issue order (:attr:`Profile.events`): each compute run costs
    ``network.compute_time`` and each collective ``network.collective_time`` (the ring's
    alpha-beta on the link of its group for a :class:`Network`, the fitted cost of its kind
    and group size for a :class:`CostModel`), one after the other: tensor-parallel
    collectives are on the critical path. With ``data_parallel`` the gradient reduction of
    :class:`fastdist.train.DataParallel` is added and overlapped: the gradients (``Param``)
    are packed into its buckets (reverse registration order, ``bucket_mb`` MiB), a bucket's
    all-reduce over the data axes starts when its last gradient is ready (:class:`GradReady`)
    and the previous bucket has started, the all-reduces run one after another beside the
    backward, and the end of backward waits for the last one. Packing and unpacking a bucket
    (4 x its bytes of memory traffic) is compute on the critical path. Trace the step
    *without* a data-parallel engine attached when you pass ``data_parallel``; an all-reduce
    your step calls itself after backward is charged where it is issued, not overlapped.

    A profile from :func:`record` (no events) is charged collective by collective.

    With ``pipeline`` (:class:`Pipeline`) the profile is one micro-batch through the whole
    model, and the step is the pipeline's: each stage runs the traced forward and backward
    (compute and collectives, in series as above) of its layers (by the module that ran
    them: ``model.layers.N``; the embedding on the first stage, the head and loss on the last),
    at its own cost; the hidden states reach the next stage, and their gradient the previous
    one, ``transfer`` seconds after they are made (a ``send`` record on the pipeline axis, per
    boundary and direction; stages on one rank pass them for free), while the sending rank
    goes on computing. The schedule's timeline
    (:meth:`fastdist.train.schedules.Schedule.timeline` with the per-stage costs and the
    transfer on its edges) gives the step and its bubble; each rank then reduces its stages'
    gradients over ``data_parallel``. Memory per rank: its stages' parameters and
    ``peak_in_flight`` micro-batch-stages of activations.
    See docs/profile.md, "Pipelines", for every assumption.

    Args:
        profile: a :func:`trace` of the step (or a :func:`record`).
        network: a :class:`Network` (documented links; compute charged when its ``flops`` etc.
            are set) or a :class:`CostModel` from :func:`calibrate`.
        data_parallel: the data axis (or axes) whose gradient reduction DataParallel overlaps.
        bucket_mb: DataParallel's bucket size (MiB).
        optimizer: for the memory: a name in :data:`OPTIMIZER_STATE` or bytes of state per
            parameter byte.
        memory: a budget in bytes per rank: ``fits`` says whether :meth:`Profile.memory`'s
            total is within it.
        pipeline: how the step is pipelined over one of the mesh's axes (:class:`Pipeline`).

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 4})
    >>> prof = trace(lambda x: fd.psum(x, mesh, "tp"), mesh, torch.empty(1000, device="meta"))
    >>> net = Network("toy", 4, Link(1e9, 1e-6), Link(1e8, 1e-5))
    >>> round(predict(prof, net).time * 1e6, 3)   # 6 steps * 1 us + 4000 * 1.5 B / 1 GB/s
    12.0
    """
    sizes = tuple(profile.mesh.shape.values())
    names = profile.mesh.axis_names
    by_axis: dict[str, float] = {}
    by_phase: dict[str, float] = {}
    t = compute = comm = 0.0

    def collective(r: Record) -> float:
        nonlocal comm
        dt = network.collective_time(r, sizes, _axis_index(names, r.axis))
        comm += dt
        by_axis[r.axis] = by_axis.get(r.axis, 0.0) + dt
        by_phase[r.phase] = by_phase.get(r.phase, 0.0) + dt
        return dt

    def work(w: Work) -> float:
        nonlocal compute
        dt = network.compute_time(w)
        compute += dt
        return dt

    # the data-parallel reduction: buckets over the data axes
    dp = _data_axes(data_parallel)
    missing = [a for a in dp if a not in names]
    if missing:
        raise ProfileError(
            "predict",
            f"data_parallel axis {missing[0]!r} is not an axis of the profile's mesh {names}",
            "pass the data axis by the name the step's mesh uses (e.g. 'dp')",
        )
    if pipeline is not None:
        return _predict_pipeline(profile, network, pipeline, dp, bucket_mb, optimizer, memory)
    n_dp = math.prod(profile.mesh.shape[a] for a in dp)
    buckets = (
        _buckets(profile.params, int(bucket_mb * 2**20)) if n_dp > 1 and profile.params else []
    )
    bucket_of = {i: b for b, members in enumerate(buckets) for i in members}
    ready: list[set[int]] = [set() for _ in buckets]
    launched = 0
    channel = 0.0  # when the data-parallel all-reduces in flight are done

    def launch(b: int) -> None:
        nonlocal t, channel
        nbytes = sum(profile.params[i].bytes for i in buckets[b])
        dtype = profile.params[buckets[b][0]].dtype
        t += work(Work("backward", 0.0, 1, 2.0 * nbytes))  # pack
        channel = max(channel, t) + collective(_bucket_record(nbytes, dtype, dp, n_dp))

    events: tuple[Work | Record | GradReady, ...] = profile.events or profile.records
    last = max(
        (i for i, e in enumerate(events) if isinstance(e, GradReady)),
        default=-1,
    )
    last = max(
        [last]
        + [
            i
            for i, e in enumerate(events)
            if isinstance(e, (Work, Record)) and e.phase == "backward"
        ]
    )
    for i, e in enumerate(events):
        if isinstance(e, Work):
            t += work(e)
        elif isinstance(e, Record):
            t += collective(e)
        elif buckets and e.param in bucket_of:
            ready[bucket_of[e.param]].add(e.param)
            while launched < len(buckets) and len(ready[launched]) == len(buckets[launched]):
                launch(launched)
                launched += 1
        if i == last and buckets:  # the end of backward launches the rest and waits
            while launched < len(buckets):
                launch(launched)
                launched += 1
            t = max(t, channel)
            for b in buckets:  # unpack
                t += work(Work("backward", 0.0, 1, 2.0 * sum(profile.params[j].bytes for j in b)))
    mem = profile.memory(optimizer) if memory is not None or profile.params else None
    axes = tuple((a, n) for a, n in zip(names, sizes) if n > 1) or tuple(zip(names, sizes))[:1]
    return Prediction(
        Layout(axes, tuple(a for a in names if a not in dict(axes))),
        t,
        by_axis,
        by_phase,
        profile,
        compute=compute,
        comm=comm,
        exposed=t - compute,
        memory=mem,
        fits=memory is None or (mem is not None and mem.total <= memory),
    )


# ====================================================================== pipelines
_NUMBERED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")  # the first numbered part: model.layers, 3
_NUMBERED_MODULE = re.compile(r"^(.*)\.(\d+)$")  # a numbered module: model.layers.3


def _pipeline_schedule(pipe: Pipeline, pp: int) -> Schedule:
    """``pipe``'s schedule over ``pp`` ranks; the schedule's own refusal as a ProfileError."""
    from fastdist.errors import PipelineError
    from fastdist.train.schedules import schedule

    try:
        return schedule(pipe.schedule, pp, pipe.microbatches, pipe.virtual)
    except PipelineError as e:
        problem, _, fix = str(e).partition(". Fix: ")
        raise ProfileError("predict", f"pipeline over {pipe.axis}={pp}: {problem}", fix) from None


def _stage_params(params: Sequence[Param], stages: int) -> list[list[Param]]:
    """The parameters each stage holds, in registration order.

    Parameters of numbered layers (the first ``prefix.N.`` in their names, ``model.layers.3.``)
    go to stage ``N // (layers / stages)``; the others before the first layer (embeddings) to
    the first stage, those after it (final norm, head) to the last. Without numbered layers,
    every parameter is split evenly (``bytes // stages`` on each stage).
    """
    found = [_NUMBERED.match(p.name) for p in params]
    prefix = _layer_prefix(found)
    if prefix is None:
        return [[replace(p, bytes=p.bytes // stages) for p in params] for _ in range(stages)]
    index = [int(m.group(2)) if m and m.group(1) == prefix else None for m in found]
    layers = _layer_count(index, stages, prefix)
    first = next(k for k, i in enumerate(index) if i is not None)
    out: list[list[Param]] = [[] for _ in range(stages)]
    for k, (p, i) in enumerate(zip(params, index)):
        stage = i // (layers // stages) if i is not None else (0 if k < first else stages - 1)
        out[stage].append(p)
    return out


def _layer_prefix(found: Sequence[re.Match[str] | None]) -> str | None:
    """The prefix most numbered names share (``model.layers``), or None."""
    counts = collections.Counter(m.group(1) for m in found if m)
    return counts.most_common(1)[0][0] if counts else None


def _layer_count(index: Sequence[int | None], stages: int, prefix: str) -> int:
    """The layers ``prefix.N`` numbers (the largest N + 1); they must split evenly into
    ``stages``."""
    layers = max(i for i in index if i is not None) + 1
    if layers % stages:
        fits = [d for d in range(1, layers + 1) if layers % d == 0]
        raise ProfileError(
            "predict",
            f"the traced model has {layers} layers ({prefix}.N), which do not split evenly into "
            f"{stages} pipeline stages",
            f"use pp x virtual among {', '.join(map(str, fits))}",
        )
    return layers


def _stage_costs(
    profile: Profile, network: Network | CostModel, stages: int
) -> list[dict[tuple[str, str], float]]:
    """Seconds of one micro-batch's work on each stage, keyed ``(phase, axis)`` (axis ``""``:
    compute).

    Compute runs and collectives of a numbered module (the first ``prefix.N`` of its path, the
    prefix most of them share: ``model.layers.3.mlp``) go to the stage holding layer ``N``
    (``layers / stages`` consecutive layers a stage); the others to the stage of the numbered
    work before them in the same phase, or, before any, to the first stage in the forward (the
    embedding) and the last in the backward (the loss and the head). Without numbered modules
    every stage gets ``1 / stages`` of everything.
    """
    sizes, names = tuple(profile.mesh.shape.values()), profile.mesh.axis_names
    events = [e for e in profile.events or profile.records if isinstance(e, (Work, Record))]

    def cost(e: Work | Record) -> tuple[tuple[str, str], float]:
        if isinstance(e, Work):
            return (e.phase, ""), network.compute_time(e)
        return (e.phase, e.axis), network.collective_time(e, sizes, _axis_index(names, e.axis))

    out: list[dict[tuple[str, str], float]] = [{} for _ in range(stages)]
    found = [_NUMBERED.match(e.module) for e in events]
    prefix = _layer_prefix(found)
    index = [int(m.group(2)) if m and m.group(1) == prefix else None for m in found]
    per = _layer_count(index, stages, prefix) // stages if prefix is not None else 0
    at = {"forward": 0, "backward": stages - 1}
    for e, i in zip(events, index):
        key, dt = cost(e)
        if prefix is None:  # no layers to go by: evenly
            for st in out:
                st[key] = st.get(key, 0.0) + dt / stages
            continue
        if i is not None:
            at[e.phase] = i // per
        st = out[at[e.phase]]
        st[key] = st.get(key, 0.0) + dt
    return out


def _boundary_bytes(profile: Profile, pipe: Pipeline) -> int:
    """Bytes one rank sends across a stage boundary per micro-batch: given, or the largest
    output of the outermost numbered modules the trace saw (``model.layers.N``)."""
    if pipe.boundary_bytes is not None:
        return pipe.boundary_bytes
    numbered = [
        (m.group(1), b) for name, b in profile.outputs if (m := _NUMBERED_MODULE.match(name))
    ]
    if not numbered:
        raise ProfileError(
            "predict",
            "the profile has no numbered layer module (e.g. model.layers.0) whose output would "
            "cross a stage boundary",
            "pass Pipeline(boundary_bytes=...) (one micro-batch's hidden states on one rank), or "
            "trace the model with modules=[model] (trace_model does)",
        )
    outer = min((prefix for prefix, _ in numbered), key=len)
    return max(b for prefix, b in numbered if prefix == outer)


def _predict_pipeline(
    profile: Profile,
    network: Network | CostModel,
    pipe: Pipeline,
    dp: tuple[str, ...],
    bucket_mb: float,
    optimizer: str | float,
    memory: float | None,
) -> Prediction:
    """:func:`predict` of a pipelined step (see docs/profile.md, "Pipelines")."""
    sizes = tuple(profile.mesh.shape.values())
    names = profile.mesh.axis_names
    if pipe.axis not in names or pipe.axis in dp:
        raise ProfileError(
            "predict",
            f"pipeline axis {pipe.axis!r} is not a non-data axis of the profile's mesh {names} "
            f"(data_parallel={dp})",
            "trace on a mesh with the pipeline axis (e.g. Layout((('pp', 2), ...)).mesh) and "
            "name it in Pipeline(axis=...), apart from the data axes",
        )
    on_pp = [r for r in profile.records if pipe.axis in r.axis.split("+")]
    if on_pp:
        raise ProfileError(
            "predict",
            f"the traced step issues {on_pp[0].op} over the pipeline axis {on_pp[0].axis!r} "
            f"({on_pp[0].module or 'outside any module'})",
            "trace one micro-batch through the whole model with collectives over the other axes "
            "only: predict adds the pipeline's sends",
        )
    pp, m = profile.mesh.shape[pipe.axis], pipe.microbatches
    sched = _pipeline_schedule(pipe, pp)
    stages = sched.stages
    # one micro-batch's work on each stage: compute, and collectives per axis
    costs = _stage_costs(profile, network, stages)
    # the sends between consecutive stages, one micro-batch: activations forward (sent by stage
    # j), their gradients backward (sent by stage j + 1)
    nbytes = _boundary_bytes(profile, pipe) if pp > 1 else 0
    sends = tuple(
        Record(
            op="send",
            axis=pipe.axis,
            n=pp,
            kind="sendrecv",
            size=nbytes,
            bus_bytes=float(nbytes),
            steps=_steps("sendrecv", pp),
            phase=phase,
            module=f"pipeline.stage{j if phase == 'forward' else j + 1}",
            dtype=torch.uint8,
            shape=(nbytes,),
        )
        for phase in ("forward", "backward")
        for j in range(stages - 1 if pp > 1 else 0)  # stages on one rank pass in memory
    )
    transfer = network.collective_time(sends[0], sizes, [names.index(pipe.axis)]) if sends else 0.0

    def on_stage(st: dict[tuple[str, str], float], phase: str, axis: str | None = None) -> float:
        return sum(t for (ph, ax), t in st.items() if ph == phase and axis in (None, ax))

    # each stage at its own cost; the sends on the timeline's edges between ranks
    fwd = tuple(on_stage(st, "forward") for st in costs)
    bwd = tuple(on_stage(st, "backward") for st in costs)
    for j in range(stages):
        if fwd[j] <= 0 or bwd[j] <= 0:
            raise ProfileError(
                "predict",
                f"pipeline stage {j} (rank {sched.rank_of(j)} of {pipe.axis}): its forward "
                f"({fwd[j]:g} s) or backward ({bwd[j]:g} s) of a micro-batch costs nothing on "
                "this network",
                "trace the backward too (call backward() in the step) and charge compute "
                "(Network(..., flops=...) or a CostModel from calibrate)",
            )
    slots = sched.timeline(fwd, bwd, transfer=transfer)
    makespan = max(s.end for s in slots)
    bubble = 1.0 - sum(s.end - s.start for s in slots) / (pp * makespan)
    # each rank: its stages' gradients reduced over dp, overlapped with its last backward
    held = _stage_params(profile.params, stages)
    n_dp = math.prod(profile.mesh.shape[a] for a in dp)
    finish, reduce, pack, mems = [], [], [], []
    for r in range(pp):
        mine = [p for j in sched.stages_of(r) for p in held[j]]
        last = max((s for s in slots if s.rank == r), key=lambda s: s.end)
        end, busy_dp, busy_pack = _reduce_overlapped(
            mine, last.start, last.end, network, sizes, names, dp, n_dp, bucket_mb
        )
        finish.append(end)
        reduce.append(busy_dp)
        pack.append(busy_pack)
        act = profile.activations * sched.peak_in_flight(r) // stages
        mems.append(replace(profile, params=tuple(mine), activations=act).memory(optimizer))
    c = max(range(pp), key=lambda r: finish[r])  # the rank that finishes last
    by_axis: dict[str, float] = {}
    by_phase = {"forward": 0.0, "backward": 0.0}
    for (phase, ax), t in ((k, t) for j in sched.stages_of(c) for k, t in costs[j].items()):
        if ax:
            by_axis[ax] = by_axis.get(ax, 0.0) + m * t
            by_phase[phase] += m * t
    if sends:  # the sends rank c issues: forward out of all but the last stage, backward out of
        # all but the first
        out_f = sum(1 for j in sched.stages_of(c) if j < stages - 1)
        out_b = sum(1 for j in sched.stages_of(c) if j > 0)
        by_axis[pipe.axis] = m * (out_f + out_b) * transfer
        by_phase["forward"] += m * out_f * transfer
        by_phase["backward"] += m * out_b * transfer
    if reduce[c] > 0:
        dp_name = "+".join(dp)
        by_axis[dp_name] = by_axis.get(dp_name, 0.0) + reduce[c]
        by_phase["backward"] += reduce[c]
    phases = ("forward", "backward")
    busy = m * sum(on_stage(costs[j], ph, "") for j in sched.stages_of(c) for ph in phases)
    busy += pack[c]
    worst = max(mems, key=lambda mem: mem.total)
    cost = PipelineCost(
        sched, nbytes, transfer, fwd, bwd, makespan, bubble, tuple(finish), tuple(mems)
    )
    axes = tuple((a, n) for a, n in zip(names, sizes) if n > 1) or tuple(zip(names, sizes))[:1]
    return Prediction(
        Layout(axes, tuple(a for a in names if a not in dict(axes)), pipe),
        finish[c],
        {a: t for a, t in by_axis.items() if t > 0 or a == pipe.axis},
        by_phase,
        replace(
            profile,
            records=profile.records + sends,
            events=profile.events + sends if profile.events else (),
        ),
        compute=busy,
        comm=sum(by_axis.values()),
        exposed=finish[c] - busy,
        memory=worst,
        fits=memory is None or worst.total <= memory,
        pipeline=cost,
    )


def _bucket_record(nbytes: int, dtype: torch.dtype, dp: tuple[str, ...], n_dp: int) -> Record:
    """The all-reduce of one `fastdist.train.DataParallel` bucket of ``nbytes`` over ``dp``."""
    return Record(
        op="psum",
        axis="+".join(dp),
        n=n_dp,
        kind="allreduce",
        size=nbytes,
        bus_bytes=nbytes * bus_factor("allreduce", n_dp),
        steps=_steps("allreduce", n_dp),
        phase="backward",
        module="DataParallel",
        dtype=dtype,
        shape=(nbytes // dtype.itemsize,),  # the bucket's flat buffer
    )


def _reduce_overlapped(
    params: Sequence[Param],
    start: float,
    end: float,
    network: Network | CostModel,
    sizes: tuple[int, ...],
    names: Sequence[str],
    dp: tuple[str, ...],
    n_dp: int,
    bucket_mb: float,
) -> tuple[float, float, float]:
    """One pipeline rank's data-parallel reduction: ``(when its step ends, seconds of
    all-reduce, seconds of packing)``.

    DataParallel's buckets of ``params`` (reverse registration order); the backward that ends at
    ``end`` (the rank's last, from ``start``) makes their gradients final in proportion to
    their bytes, so bucket ``b`` is ready at ``start + (end - start) x (bytes of buckets 0..b) /
    (all bytes)``; the all-reduces run one after another from then; packing and unpacking
    (4 x the bytes of memory traffic per bucket) comes after the last one.
    """
    if n_dp <= 1 or not params:
        return end, 0.0, 0.0
    total = sum(p.bytes for p in params)
    done = 0
    channel = reduced = packed = 0.0
    for bucket in _buckets(params, int(bucket_mb * 2**20)):
        nbytes = sum(params[i].bytes for i in bucket)
        dtype = params[bucket[0]].dtype
        done += nbytes
        r = _bucket_record(nbytes, dtype, dp, n_dp)
        dt = network.collective_time(r, sizes, [names.index(a) for a in dp])
        channel = max(channel, start + (end - start) * done / max(total, 1)) + dt
        reduced += dt
        packed += network.compute_time(Work("backward", 0.0, 2, 4.0 * nbytes))
    return max(end, channel) + packed, reduced, packed


def _factorizations(world: int, k: int) -> Iterator[tuple[int, ...]]:
    if k == 1:
        yield (world,)
        return
    for d in range(1, world + 1):
        if world % d == 0:
            for rest in _factorizations(world // d, k - 1):
                yield (d, *rest)


def layouts(
    world: int,
    axes: Sequence[str],
    *,
    max_size: Mapping[str, int] | None = None,
    orders: bool = True,
) -> list[Layout]:
    """Every layout of ``world`` ranks over ``axes``: sizes multiplying to ``world`` (each at most
    ``max_size[axis]``), and with ``orders`` every order of the axes of size > 1 onto the ranks
    (which axes stay inside a node); otherwise the order given. Axes of size 1 are left out of
    the name and the order (they are the layout's ``unit`` axes: its mesh has them, with size 1).

    Args:
        world: the number of ranks.
        axes: the axis names.
        max_size: the largest size of each axis named (others: up to ``world``).
        orders: every order of the axes of size > 1 onto the ranks; ``False``: the order given.

    Returns:
        the layouts, as `Layout` values.

    >>> [str(l) for l in layouts(4, ("dp", "tp"), orders=False)]
    ['tp4', 'dp2 x tp2', 'dp4']
    >>> len(layouts(8, ("dp", "tp")))   # tp8, dp8, and dp2 x tp4, dp4 x tp2 in both orders
    6
    """
    if world < 1 or not axes or len(set(axes)) != len(axes):
        raise ProfileError(
            "layouts",
            f"world={world!r}, axes={tuple(axes)!r}",
            "pass a positive world size and distinct axis names",
        )
    limit = dict(max_size or {})
    out: list[Layout] = []
    seen: set[tuple[tuple[str, int], ...]] = set()
    for sizes in _factorizations(world, len(axes)):
        if any(s > limit.get(a, world) for a, s in zip(axes, sizes)):
            continue
        kept = [(a, s) for a, s in zip(axes, sizes) if s > 1] or [(axes[0], 1)]
        unit = tuple(a for a in axes if a not in dict(kept))
        for perm in itertools.permutations(kept) if orders else [tuple(kept)]:
            if perm not in seen:
                seen.add(perm)
                out.append(Layout(tuple(perm), unit))
    return out


@dataclass(frozen=True)
class Plan:
    """Layouts ranked by predicted step time (fastest first; layouts over the memory budget
    after those that fit)."""

    network: Network | CostModel
    predictions: tuple[Prediction, ...]

    @property
    def best(self) -> Prediction:
        return self.predictions[0]

    def table(self) -> str:
        """One line per layout: predicted time, its share per axis, and (when compute or memory
        was charged) compute, exposed communication, memory per rank and whether it fits; with
        pipelined layouts, the bubble (idle share of the pipeline's timeline)."""
        axes = sorted({a for p in self.predictions for a in p.by_axis})
        extra = any(p.compute > 0 or p.memory is not None for p in self.predictions)
        piped = any(p.pipeline is not None for p in self.predictions)
        head = ["rank", "layout", "time (ms)", *(f"{a} (ms)" for a in axes)]
        if extra:
            head += ["compute (ms)", "exposed (ms)", "memory (MB)", "fits"]
        if piped:
            head += ["bubble"]
        body = [
            [
                str(i + 1),
                str(p.layout),
                f"{p.time * 1e3:.3f}",
                *(f"{p.by_axis.get(a, 0.0) * 1e3:.3f}" for a in axes),
                *(
                    [
                        f"{p.compute * 1e3:.3f}",
                        f"{p.exposed * 1e3:.3f}",
                        f"{p.memory.total / 1e6:.1f}" if p.memory is not None else "",
                        "yes" if p.fits else "no",
                    ]
                    if extra
                    else []
                ),
                *([f"{p.pipeline.bubble:.3f}" if p.pipeline else ""] if piped else []),
            ]
            for i, p in enumerate(self.predictions)
        ]
        widths = [max(len(c[i]) for c in [head, *body]) for i in range(len(head))]
        return f"network: {self.network.name}\n" + "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]
        )

    def plot(self, ax: Any = None) -> Any:
        """A horizontal stacked bar per layout (time per axis); returns the matplotlib Axes.

        Args:
            ax: the matplotlib ``Axes`` to draw on; default: a new figure.

        Returns:
            the matplotlib ``Axes``.
        """
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(7, 0.35 * len(self.predictions) + 1))
        labels = [str(p.layout) for p in self.predictions]
        left = [0.0] * len(labels)
        for a in sorted({a for p in self.predictions for a in p.by_axis}):
            w = [p.by_axis.get(a, 0.0) * 1e3 for p in self.predictions]
            ax.barh(labels, w, left=left, label=a)
            left = [x + y for x, y in zip(left, w)]
        ax.invert_yaxis()
        ax.set_xlabel(f"predicted communication time (ms), {self.network.name}")
        ax.legend()
        return ax

    def __str__(self) -> str:
        return self.table()


def plan(
    build: Callable[[Mesh], Profile],
    candidates: Iterable[Layout] | int,
    network: Network | CostModel | str,
    *,
    axes: Sequence[str] = ("dp", "tp"),
    max_size: Mapping[str, int] | None = None,
    orders: bool = True,
    data_parallel: str | Sequence[str] | None = None,
    bucket_mb: float = 25.0,
    optimizer: str | float = "adamw",
    memory: float | None = None,
    pipeline: Pipeline | None = None,
) -> Plan:
    """Profile ``build(layout.mesh)`` for every candidate layout and rank them by :func:`predict`
    (layouts whose memory per rank passes ``memory`` last, marked ``fits=False``).

    Args:
        build: makes the step for a mesh and traces it (usually ``lambda mesh:
            trace(step_for(mesh), mesh, ...)``): the per-rank shapes depend on the layout (a batch
            split over ``dp``, weights over ``tp``), which only the step's author knows. The mesh
            has every axis of ``axes``, those of size 1 included, so the step may call its
            collectives whatever the layout.
        candidates: a list of :class:`Layout` (e.g. from :func:`layouts`), or a world size: then
            ``layouts(candidates, axes, max_size=max_size, orders=orders)``.
        network: a :class:`Network`, the name of one in :data:`NETWORKS`, or a
            :class:`CostModel` from :func:`calibrate`.
        axes: the axis names, for a world size given as ``candidates`` (see :func:`layouts`).
        max_size: the largest size of each axis, for a world size given as ``candidates``.
        orders: every order of the axes onto the ranks, for a world size given as ``candidates``.
        data_parallel: as for :func:`predict`: the data axes whose gradient reduction
            DataParallel overlaps with backward.
        bucket_mb: as for :func:`predict`.
        optimizer: as for :func:`predict` (the optimizer state in the memory per rank).
        memory: a memory budget per rank (bytes), as for :func:`predict`.
        pipeline: how a layout whose ``pipeline.axis`` has size > 1 pipelines its step (a
            :class:`Layout` given with its own ``pipeline`` keeps it); ``build`` then traces one
            micro-batch (its mesh has the pipeline axis, so it can tell). Put the axis among
            ``axes`` (e.g. ``axes=("pp", "dp", "tp")``, ``max_size={"pp": 4}``) to rank layouts
            with and without a pipeline together.

    >>> import torch, fastdist as fd
    >>> def build(mesh):   # a TP MLP (tokens 512, hidden 1024) with its dp gradient all-reduce
    ...     dp, tp = mesh.shape["dp"], mesh.shape["tp"]
    ...     def step(x, w):
    ...         fd.psum(fd.pvary(x, mesh, "tp") @ w @ w.T, mesh, "tp").sum().backward()
    ...         fd.psum(w.grad, mesh, "dp")
    ...     x = torch.empty(512 // dp, 1024, device="meta")
    ...     w = torch.empty(1024, 4096 // tp, device="meta", requires_grad=True)
    ...     return trace(step, mesh, x, w)
    >>> p = plan(build, 16, "dgx-h100", axes=("dp", "tp"), max_size={"tp": 8})
    >>> str(p.best.layout)   # the 16 MiB/tp gradient all-reduce over dp stays inside a node
    'tp2 x dp8'
    """
    if isinstance(network, str):
        if network not in NETWORKS:
            raise ProfileError(
                "plan",
                f"no network named {network!r}",
                f"use one of {', '.join(NETWORKS)}, or pass a Network",
            )
        network = NETWORKS[network]
    cands = (
        layouts(candidates, axes, max_size=max_size, orders=orders)
        if isinstance(candidates, int)
        else list(candidates)
    )
    if not cands:
        raise ProfileError(
            "plan",
            "no candidate layout",
            "pass a world size, layouts(world, axes) or a non-empty list of Layout",
        )
    preds = []
    for layout in cands:
        if layout.pipeline is None and pipeline is not None:
            if layout.mesh.shape.get(pipeline.axis, 1) > 1:
                layout = replace(layout, pipeline=pipeline)
        prof = build(layout.mesh)
        if not isinstance(prof, Profile):
            raise ProfileError(
                "plan",
                f"build returned {type(prof).__name__} for {layout}, not a Profile",
                "return trace(step, mesh, ...) from build",
            )
        pred = predict(
            prof,
            network,
            data_parallel=[a for a in _data_axes(data_parallel) if a in layout.mesh.axis_names],
            bucket_mb=bucket_mb,
            optimizer=optimizer,
            memory=memory,
            pipeline=layout.pipeline,
        )
        preds.append(replace(pred, layout=layout))
    return Plan(network, tuple(sorted(preds, key=lambda p: (not p.fits, p.time))))


def _data_axes(data_parallel: str | Sequence[str] | None) -> tuple[str, ...]:
    if isinstance(data_parallel, str):
        return (data_parallel,)
    return tuple(data_parallel or ())


def trace_model(
    model: Any, *args: Any, backward: bool = True, routing: str = "balanced", **kwargs: Any
) -> Profile:
    """:func:`trace` of one forward (and backward) of a :func:`fastdist.nn.parallelize` model.

    Args:
        model: a ``fastdist.nn.ParallelModel`` (simulated or on real ranks); its parameters
            become fake tensors of one rank's shard (nothing is copied).
        *args: one rank's positional inputs (no rank dim).
        backward: also run ``backward()`` of the output's ``loss`` (or of its sum when the
            output is a tensor).
        routing: MoE layers charged at a balanced router's expected load (``"balanced"``, the
            default here: what a planner should price) or at the worst case (``"bound"``);
            see :func:`trace`.
        **kwargs: one rank's keyword inputs (no rank dim), e.g. ``input_ids=``, ``labels=``.

    Records carry the model's module paths (``model.layers.0.mlp.down_proj``).
    """
    params = {n: p[0] if model.simulated else p for n, p in model.module.named_parameters()}

    def step(params: dict[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        out = model._run(params, args, {**model._no_cache, **kwargs})
        if backward:
            loss = out if isinstance(out, Tensor) else out.loss
            if loss is None:
                raise ProfileError(
                    "trace_model",
                    "the model's output has no loss to differentiate",
                    "pass labels=..., or backward=False",
                )
            loss.sum().backward()

    return trace(step, model.mesh, params, args, kwargs, modules=[model.module], routing=routing)
