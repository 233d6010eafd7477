"""Helpers shared by the modules of ``fastdist.profile`` (a private module): the module stack a
trace and a recording name their records by, one collective's :class:`Record`, the per-thread
state of a recording, and the arithmetic :func:`predict` and the pipeline cost share."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from fastdist.profile.bytes import bus_factor, ring_steps, traffic
from fastdist.profile.records import Param, Record, Work

META_KEY = (
    "fastdist.profile.module"  # autograd node metadata: the module whose forward recorded the node
)


class ModuleStack:
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
        # fastdist.nn (about 0.2 s) is imported when a trace first hooks modules, not by
        # `import fastdist.profile` (issue 42.4); the hooks themselves are fastdist.nn's
        from fastdist.nn.replicas import module_stack

        with module_stack(modules, self.stack, on_output=self._output):
            yield

    def _output(self, name: str, out: Any) -> None:
        first = next((t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)), None)
        if first is not None:
            self.outputs[name] = first.numel() * first.dtype.itemsize


class RankShare:
    """Shape and dtype of one rank's share of a stacked ``[world, ...]`` tensor (nothing is
    indexed)."""

    def __init__(self, t: Tensor) -> None:
        self.shape, self.dtype = tuple(t.shape[1:]), t.dtype


def make_record(
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
    moved = traffic(op, n, tensors, params, out)
    if moved is None or n <= 1:
        return None
    kind, size, senders, bound = moved
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
        steps=ring_steps(kind, n),
        phase="backward" if backward else "forward",
        module=module,
        dtype=tensors[0].dtype,
        shape=tuple(tensors[0].shape),
        bound=bound,
    )


class Running(threading.local):
    """Per thread: how deep inside recorded collectives (their inner calls are not recorded
    again) or inside :func:`~fastdist.profile.trace` (:func:`quiet`) this thread is."""

    def __init__(self) -> None:  # instance attributes: dynamo traces them (core.context)
        self.depth = 0


#: the per-thread state of :func:`~fastdist.profile.record`
RUNNING = Running()


@contextmanager
def quiet() -> Iterator[None]:
    """Collectives run here are not recorded by :func:`~fastdist.profile.record` (the trace
    records its own)."""
    RUNNING.depth += 1
    try:
        yield
    finally:
        RUNNING.depth -= 1


def in_node(mesh_sizes: Sequence[int], axes: Sequence[int], gpus_per_node: int) -> bool:
    """The group of rank 0 along ``axes`` of a row-major mesh lies in one node."""
    strides = [math.prod(mesh_sizes[i + 1 :]) for i in range(len(mesh_sizes))]
    # rank 0's group: ranks 0 .. span
    span = sum((mesh_sizes[a] - 1) * strides[a] for a in axes)
    return span < gpus_per_node


def compute_time(work: Work, flops: float, bandwidth: float, latency: float) -> float:
    """``flops / flops + bytes / bandwidth + kernels x latency`` of one compute run (a rate of 0:
    that term is not charged)."""
    t = work.kernels * latency
    if flops > 0:
        t += work.flops / flops
    if bandwidth > 0:
        t += work.bytes / bandwidth
    return t


def axis_positions(names: Sequence[str], axis: str) -> list[int]:
    """The positions among ``names`` of a record's axis (``"dp+tp"``); ``[]`` if one is not
    there."""
    parts = axis.split("+")
    return [names.index(a) for a in parts] if all(a in names for a in parts) else []


def buckets(params: Sequence[Param], cap: int) -> list[list[int]]:
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


def bucket_record(nbytes: int, dtype: torch.dtype, dp: tuple[str, ...], n_dp: int) -> Record:
    """The all-reduce of one `fastdist.train.DataParallel` bucket of ``nbytes`` over ``dp``."""
    return Record(
        op="psum",
        axis="+".join(dp),
        n=n_dp,
        kind="allreduce",
        size=nbytes,
        bus_bytes=nbytes * bus_factor("allreduce", n_dp),
        steps=ring_steps("allreduce", n_dp),
        phase="backward",
        module="DataParallel",
        dtype=dtype,
        shape=(nbytes // dtype.itemsize,),  # the bucket's flat buffer
    )


def data_parallel_axes(data_parallel: str | Sequence[str] | None) -> tuple[str, ...]:
    """``predict``'s ``data_parallel`` argument as a tuple of axis names."""
    if isinstance(data_parallel, str):
        return (data_parallel,)
    return tuple(data_parallel or ())
