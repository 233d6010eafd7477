"""Distributed checkpoints that reshard: every rank writes only its own slices, any layout reads.

`save` writes a model's parameters (and an optimizer's state, and small ``extra`` values)
through ``torch.distributed.checkpoint`` (DCP): each rank writes the slices it holds, in
parallel, one file per writing rank; a slice held by several ranks (a replicated parameter, a
tensor-parallel block repeated over data-parallel replicas) is written by exactly one of them,
the writers chosen to balance the bytes. `load` reads into a model laid out on **another**
mesh (tensor parallel 4 -> 2, data parallel 2 -> 4, sequence parallelism on or off, simulated
ranks, one device): each rank reads only the boxes it holds.

The format is the **single-device state dict, chunked**: every tensor is stored under its
single-device name and shape (padding dropped), as rectangular chunks of the single-device
tensor, with torch's ``get_state_dict`` naming:

* ``model.<name>``: parameters and persistent buffers (tied parameters once, under the first
  name);
* ``optim.state.<name>.<key>``: optimizer state by *parameter name*, not index (AdamW's
  ``exp_avg``/``exp_avg_sq`` split like their parameter, the scalar ``step`` stored once);
* ``optim.param_groups.<i>.<hyperparameter>``: the groups (``params`` lists names);
* ``extra.<key>``: what ``extra=`` held (a step counter, an LR scheduler's ``state_dict()``).

A rank's block maps to boxes of the single-device tensor through its `fastdist.nn.Layout`
(`Layout.boxes`): fused ``q|k|v`` parts give three boxes, vocabulary padding rows are not
written (and are zero-filled on load). A parameter that is a ``DTensor`` (FSDP2's
``fully_shard`` over a data-parallel axis, its local rows a shard of this rank's tensor-parallel
block) contributes the part of each box it holds; a `fastdist.train.ZeroOptimizer`'s flat
chunk of the state, the runs of each parameter's block it covers. So a checkpoint written on
simulated ranks loads on real ranks and back, ZeRO and plain optimizers load each other's, and
torch's own DCP tools read it (``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``
gives the single-device dicts).

>>> import tempfile, torch, fastdist as fd
>>> from fastdist.train.checkpoint import load, save
>>> def mlp():
...     return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
>>> plan = {"0": fd.nn.ColwiseParallel(input="replicated"), "2": fd.nn.RowwiseParallel()}
>>> torch.manual_seed(0) and None
>>> pm4 = fd.nn.parallelize(mlp(), fd.Mesh({"tp": 4}), plan)       # simulated: 4 ranks
>>> with tempfile.TemporaryDirectory() as path:
...     save(path, pm4, extra={"step": 7})
...     pm2 = fd.nn.parallelize(mlp(), fd.Mesh({"tp": 2}), plan)   # other weights, 2 ranks
...     extra = load(path, pm2)
>>> extra, all(torch.equal(pm4.state_dict()[k], v) for k, v in pm2.state_dict().items())
({'step': 7}, True)
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from fastdist.core.mesh import Mesh
from fastdist.nn.parallelize import ParallelModel
from fastdist.nn.state import CheckpointError, Layout, param_layouts
from fastdist.train.zero import ZeroOptimizer

__all__ = ["save", "load"]

FORMAT = 1  # the version of this layout of keys (planner_data["fastdist"]["format"])
_HEADER = "fastdist"  # the key of this library's header in the metadata's planner_data


# ============================================================================ what a rank holds
@dataclass
class _Box:
    """One rectangular box of a single-device tensor that this process holds: ``views`` are the
    box's elements in each local copy (simulated ranks holding the same block: one view each)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    views: list[Tensor]


@dataclass
class _Entry:
    """One checkpoint key: its single-device shape and dtype, and the boxes this process holds."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: list[_Box] = field(default_factory=list)
    padded: list[Tensor] = field(default_factory=list)  # zero-filled before a load


@dataclass
class _Target:
    """How a model is held: on a simulated mesh (stacked), real ranks, or one device per
    process."""

    module: nn.Module
    mesh: Mesh | None
    layouts: dict[str, Layout]
    distributed: bool  # a collective over torch.distributed's default group
    where: str  # "simulated ranks", "rank 3", "one device"

    @property
    def simulated(self) -> bool:
        return self.mesh is not None and self.mesh.backend is None


def _target(model: ParallelModel | nn.Module, op: str) -> _Target:
    if isinstance(model, ParallelModel):
        mesh = model.mesh
        if mesh.backend is None:
            return _Target(
                model.module, mesh, param_layouts(model.module), False, "simulated ranks"
            )
        return _Target(model.module, mesh, param_layouts(model.module), True, f"rank {mesh.rank}")
    if not isinstance(model, nn.Module):
        raise CheckpointError(
            f"{op}: model is a {type(model).__name__}, not a fastdist.nn.ParallelModel nor a "
            "torch.nn.Module. Fix: pass what fastdist.nn.parallelize returned, or a plain module"
        )
    distributed = dist.is_available() and dist.is_initialized()
    where = f"rank {dist.get_rank()}" if distributed else "one device"
    return _Target(model, None, {}, distributed, where)


def _named_tensors(module: nn.Module) -> dict[str, tuple[Tensor, bool]]:
    """Parameters (tied ones once) and persistent buffers by name, each with "is a parameter"."""
    out: dict[str, tuple[Tensor, bool]] = {n: (p, True) for n, p in module.named_parameters()}
    keys = set(module.state_dict(keep_vars=True))
    out.update({n: (b, False) for n, b in module.named_buffers() if n in keys})
    return out


def _tied_aliases(module: nn.Module) -> dict[str, str]:
    """Second names of tied parameters -> the first name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first.setdefault(id(p), name)
    return aliases


def _local(t: Tensor) -> tuple[Tensor, tuple[int, ...]] | None:
    """(the elements this process holds, their offset in ``t``'s own coordinates); a DTensor's
    local shard and its offset, None where this rank is not in its mesh."""
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if t.device_mesh.get_coordinate() is None:
            return None
        if any(p.is_partial() for p in t.placements):
            raise CheckpointError(
                f"fastdist.train.checkpoint: a DTensor with placements {t.placements} holds "
                "partial sums, which no checkpoint can store. Fix: reduce it first "
                "(redistribute to Replicate or Shard)"
            )
        _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(offsets)
    return t, (0,) * t.dim()


def _clip(
    glob: tuple[slice, ...], block: tuple[slice, ...], local: Tensor, origin: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...], Tensor] | None:
    """The part of a box (``glob`` of the single-device tensor, ``block`` of the rank's block)
    that ``local`` holds (it starts at ``origin`` of the block): (offsets, sizes, view)."""
    offsets, sizes, index = [], [], []
    for d, (g, b) in enumerate(zip(glob, block)):
        lo, hi = max(b.start, origin[d]), min(b.stop, origin[d] + local.shape[d])
        if hi <= lo and b.stop > b.start:
            return None  # no overlap
        hi = max(hi, lo)
        offsets.append(g.start + lo - b.start)
        sizes.append(hi - lo)
        index.append(slice(lo - origin[d], hi - origin[d]))
    return tuple(offsets), tuple(sizes), local[tuple(index)]


def _entry(key: str, t: Tensor, layout: Layout, tgt: _Target, stacked: bool) -> _Entry:
    """The boxes this process holds of tensor ``t`` (a parameter, a buffer, an optimizer state)
    split like ``layout``."""
    t = t.detach()
    mesh = tgt.mesh
    if stacked:  # simulated ranks: every rank's block, [world, *local]
        assert mesh is not None
        full = layout.full_shape(tuple(t.shape[1:]), mesh)
        found: dict[tuple[tuple[int, ...], tuple[int, ...]], _Box] = {}
        for r in range(mesh.size):
            for glob, block in layout.boxes(full, mesh, r):
                offsets = tuple(s.start for s in glob)
                sizes = tuple(s.stop - s.start for s in glob)
                box = found.setdefault((offsets, sizes), _Box(offsets, sizes, []))
                box.views.append(t[r][block])
        entry = _Entry(key, full, t.dtype, list(found.values()))
        entry.padded = [t] if layout.size is not None else []
        return entry
    if mesh is None or mesh.backend is None:  # whole on every rank (a simulated scalar, buffer)
        full = tuple(t.shape)
        boxes = [(tuple(slice(0, n) for n in full),) * 2]
    else:
        full = layout.full_shape(tuple(t.shape), mesh)
        boxes = layout.boxes(full, mesh, mesh.rank)
    entry = _Entry(key, full, t.dtype)
    held = _local(t)
    if held is None:
        return entry
    local, origin = held
    for glob, block in boxes:
        part = _clip(glob, block, local, origin)
        if part is not None:
            entry.boxes.append(_Box(part[0], part[1], [part[2]]))
    entry.padded = [local] if layout.size is not None else []
    return entry


def _model_entries(tgt: _Target) -> dict[str, _Entry]:
    """``model.<name>`` -> entry, for every parameter (tied ones once) and persistent buffer."""
    out = {}
    for name, (t, is_param) in _named_tensors(tgt.module).items():
        if t.is_meta:
            raise CheckpointError(
                f"fastdist.train.checkpoint on {tgt.where}: {name!r} is on the meta device: "
                "there is nothing to save or load into. Fix: materialise the model first "
                "(pm.init_weights(seed=...) or pm.load(<safetensors>, device=...)), then load"
            )
        layout = tgt.layouts.get(name, Layout()) if is_param else Layout()
        out[f"model.{name}"] = _entry(f"model.{name}", t, layout, tgt, tgt.simulated and is_param)
    return out


def _param_names(tgt: _Target, optimizer: torch.optim.Optimizer, op: str) -> list[list[str]]:
    """The names of each param group's parameters; raises for a parameter the model lacks."""
    names = {id(p): n for n, p in tgt.module.named_parameters()}
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        foreign = [j for j, p in enumerate(group["params"]) if id(p) not in names]
        if foreign:
            raise CheckpointError(
                f"{op} on {tgt.where}: param group {i} of the {type(optimizer).__name__} holds "
                f"parameters (positions {foreign[:5]}) that are not the model's. Fix: build the "
                "optimizer over pm.parameters() of this model, after parallelize"
            )
        groups.append([names[id(p)] for p in group["params"]])
    return groups


def _optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _state_layout(
    tgt: _Target, name: str, key: str, value: Tensor, param: Tensor, op: str
) -> tuple[Layout, bool]:
    """How optimizer state ``value`` of parameter ``name`` splits: like its parameter when it has
    the parameter's shape, replicated when a scalar. (layout, stacked)."""
    if tuple(value.shape) == tuple(param.shape):
        return tgt.layouts.get(name, Layout()), tgt.simulated
    if value.dim() == 0:
        return Layout(), False
    raise CheckpointError(
        f"{op} on {tgt.where}: optimizer state {key!r} has shape {tuple(value.shape)}, neither "
        f"its parameter's {tuple(param.shape)} nor a scalar, so its layout is unknown. Fix: use "
        "an optimizer whose per-parameter state has the parameter's shape (AdamW, Adam, SGD)"
    )


# ============================================================================ planners
def _chunk(box: _Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))


class _SavePlanner(DefaultSavePlanner):
    """Writes the boxes this process holds, one ``WriteItem`` each, in single-device coordinates.

    The coordinator keeps one writer per box (ranks holding the same box: the one with the fewest
    bytes so far, biggest boxes first), records the header and the nesting of keys, and removes
    an earlier checkpoint's files from ``path`` before any rank writes (so a save that dies
    half-way leaves no ``.metadata`` pointing into half-overwritten files)."""

    def __init__(
        self,
        entries: list[_Entry],
        values: Mapping[str, Any],
        header: dict[str, Any],
        path: str,
        where: str,
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries, self.values, self.header, self.path = entries, values, header, path
        self.where = where
        self.blobs: dict[str, bytes] = {}
        self.sources = {(e.key, box.offsets): box.views[0] for e in entries for box in e.boxes}

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(e.key, box.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=_chunk(box),
                    properties=TensorProperties(dtype=e.dtype),
                    size=torch.Size(e.shape),
                ),
            )
            for e in self.entries
            for box in e.boxes
        ]
        if self.is_coordinator:  # small values: written once, by the coordinator
            self.blobs = {k: self._blob(k, v) for k, v in self.values.items()}
            items += [
                WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self.blobs
            ]
        self.plan = SavePlan(items)
        return self.plan

    def _blob(self, key: str, value: Any) -> bytes:
        """``value`` as torch.save bytes, checked to load with ``weights_only=True`` (raised
        inside DCP's planning, so every rank raises it)."""
        name = f"extra[{key[len('extra.') :]!r}]" if key.startswith("extra.") else repr(key)
        try:
            buf = io.BytesIO()
            torch.save(value, buf)
            torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"fastdist.train.save on {self.where}: {name} (a {type(value).__name__}) would "
                f"not load with torch.load(weights_only=True): {str(e).splitlines()[0]}. Fix: "
                "store tensors, numbers, strings and lists/tuples/dicts of them (e.g. a "
                "state_dict())"
            ) from None
        return buf.getvalue()

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(_one_writer_per_box(all_plans))
        # no rank writes before this plan is scattered: remove the earlier checkpoint here
        for name in sorted(os.listdir(self.path)):
            if name == ".metadata" or re.fullmatch(r"__\d+_\d+\.distcp|__\d+\.metadata", name):
                os.remove(os.path.join(self.path, name))
        nesting: dict[str, Any] = {k: _nesting(k) for k in metadata.state_dict_metadata}
        nesting[_HEADER] = self.header
        self.metadata = dataclasses.replace(metadata, planner_data=nesting)
        return plans, self.metadata

    def resolve_data(self, write_item: WriteItem) -> Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.blobs[write_item.index.fqn])
        offset = write_item.index.offset
        return self.sources[(write_item.index.fqn, tuple(offset) if offset is not None else ())]


def _one_writer_per_box(plans: list[SavePlan]) -> list[SavePlan]:
    """Each box that several ranks hold kept in one plan only: the plan with the fewest bytes so
    far, biggest boxes first (replicated parameters spread over their holders)."""

    def ident(item: WriteItem) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        assert item.tensor_data is not None
        chunk = item.tensor_data.chunk
        return item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes)

    holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    nbytes: dict[tuple[str, tuple[int, ...], tuple[int, ...]], int] = {}
    for i, plan in enumerate(plans):
        for item in plan.items:
            if item.type == WriteItemType.SHARD and item.tensor_data is not None:
                holders.setdefault(ident(item), []).append(i)
                nbytes[ident(item)] = math.prod(item.tensor_data.chunk.sizes) * (
                    torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
                )
    load = [0] * len(plans)
    writer = {}
    for key in sorted(holders, key=lambda k: (-nbytes[k], k)):
        w = min(holders[key], key=lambda i: (load[i], i))
        writer[key] = w
        load[w] += nbytes[key]
    return [
        dataclasses.replace(
            plan,
            items=[
                it
                for it in plan.items
                if it.type != WriteItemType.SHARD or writer.get(ident(it)) == i
            ],
        )
        for i, plan in enumerate(plans)
    ]


def _nesting(key: str) -> tuple[str | int, ...]:
    """Where a flat key sits in torch's nested ``get_state_dict`` layout (as DCP records it)."""
    top, _, rest = key.partition(".")
    if top == "optim" and rest.startswith("state."):
        name, _, sub = rest[len("state.") :].rpartition(".")
        return ("optim", "state", name, sub)
    if top == "optim" and rest.startswith("param_groups."):
        i, _, hp = rest[len("param_groups.") :].partition(".")
        return ("optim", "param_groups", int(i), hp)
    return (top, rest)


class _LoadPlanner(DefaultLoadPlanner):
    """Reads the boxes this process holds from whatever chunks the checkpoint has (resharding),
    into every local copy; small values into ``values``."""

    def __init__(self, entries: list[_Entry], value_keys: list[str], where: str) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries, self.value_keys, self.where = entries, value_keys, where
        self.values: dict[str, Any] = {}
        self.by_key = {e.key: e for e in entries}

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for e in self.entries:
            md = self.metadata.state_dict_metadata[e.key]
            assert isinstance(md, TensorStorageMetadata)
            reads = create_read_items_for_chunk_list(e.key, md, [_chunk(b) for b in e.boxes])
            got = [0] * len(e.boxes)
            for r in reads:
                got[r.dest_index.index or 0] += math.prod(r.lengths)
            for box, n in zip(e.boxes, got):
                if n != math.prod(box.sizes):
                    raise CheckpointError(
                        f"fastdist.train.load on {self.where}: the checkpoint's chunks of "
                        f"{e.key!r} cover {n} of the {math.prod(box.sizes)} elements at offsets "
                        f"{box.offsets} (sizes {box.sizes}): the checkpoint is incomplete or "
                        "damaged. Fix: load a checkpoint whose save finished"
                    )
            items += reads
        with torch.no_grad():  # every rank's plan is checked before any rank reads
            for e in self.entries:
                for t in e.padded:
                    t.zero_()  # padding rows: in no box
        items += [
            ReadItem(
                type=LoadItemType.BYTE_IO,
                dest_index=MetadataIndex(k),
                dest_offsets=torch.Size((0,)),
                storage_index=MetadataIndex(k),
                storage_offsets=torch.Size((0,)),
                lengths=torch.Size((0,)),
            )
            for k in self.value_keys
        ]
        return LoadPlan(items)

    def _view(self, item: ReadItem, copy: int) -> Tensor:
        box = self.by_key[item.dest_index.fqn].boxes[item.dest_index.index or 0]
        return narrow_tensor_by_index(box.views[copy], item.dest_offsets, item.lengths)

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        return self._view(read_item, 0)

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        box = self.by_key[read_item.dest_index.fqn].boxes[read_item.dest_index.index or 0]
        for copy in range(1, len(box.views)):
            self._view(read_item, copy).copy_(tensor)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


# ============================================================================ save and load
@contextmanager
def _quiet(distributed: bool) -> Iterator[None]:
    """Silence DCP's "saving in a single process" warning where one process is the intent, and
    raise a fastdist error that DCP wrapped (a rank's planner raised it) as itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        try:
            yield
        except CheckpointException as e:
            ours = [f[0] for f in e.failures.values() if isinstance(f[0], CheckpointError)]
            if ours:
                raise ours[0] from e
            raise


def save(
    path: str | os.PathLike[str],
    model: ParallelModel | nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write ``model``'s state (and ``optimizer``'s, and ``extra``) as a distributed checkpoint
    in directory ``path``, each rank writing only its own slices.

    Args:
        path: a directory (created). An earlier checkpoint there is replaced: its files are
            removed before any rank writes, so a save that dies half-way leaves no checkpoint
            (no ``.metadata``), never a mix; other files are left alone.
        model: a `fastdist.nn.ParallelModel` on a simulated mesh (this one process writes every
            rank's slices) or on real ranks (a **collective**: call it on every rank of the
            job; each rank writes one ``__<rank>_0.distcp`` file with its slices, a slice
            several ranks hold written by one of them), or a plain ``nn.Module`` (one device;
            a collective over the default process group when torch.distributed is initialised,
            e.g. data-parallel replicas or FSDP2 ``DTensor`` parameters).
        optimizer: a ``torch.optim`` optimizer over the model's parameters: its per-parameter
            state (tensors of the parameter's shape split like the parameter; scalars such as
            ``step`` stored once) by parameter name, and its param groups' hyperparameters. A
            `fastdist.train.ZeroOptimizer` writes the same keys from its flat chunks (each data
            rank the runs it holds), so a plain optimizer loads them and the other way round.
        extra: small values every rank agrees on (a step counter, an LR scheduler's
            ``state_dict()``, RNG states), written once (by rank 0); they must load with
            ``torch.load(weights_only=True)``: tensors, numbers, strings, containers of them.

    Raises `fastdist.nn.CheckpointError` (on every rank, before anything is written) for
    optimizer parameters the model lacks, optimizer state of another shape than its
    parameter's, or an ``extra`` value that would not load. Ranks that hold the same slice are
    not compared (one of them writes it): ``pm.state_dict()`` checks that replicas agree.
    """
    op = "fastdist.train.save"
    tgt = _target(model, op)
    target = os.fspath(path)
    if os.path.exists(target) and not os.path.isdir(target):
        raise CheckpointError(
            f"{op} on {tgt.where}: {target} is a file; a distributed checkpoint is a directory. "
            "Fix: pass a directory path (it is created)"
        )
    entries = _model_entries(tgt)
    values: dict[str, Any] = {}
    header: dict[str, Any] = {
        "format": FORMAT,
        "mesh": dict(tgt.mesh.shape) if tgt.mesh is not None else None,
        "simulated": tgt.simulated,
        "model": type(tgt.module).__name__,
        "optimizer": None,
    }
    if isinstance(optimizer, ZeroOptimizer):
        header["optimizer"] = _optimizer_kind(optimizer.inner)
        _zero_save(tgt, optimizer, entries, values, op)
    elif optimizer is not None:
        header["optimizer"] = _optimizer_kind(optimizer)
        groups = _param_names(tgt, optimizer, op)
        params = dict(tgt.module.named_parameters())
        for i, (group, names) in enumerate(zip(optimizer.param_groups, groups)):
            for hp, v in group.items():
                values[f"optim.param_groups.{i}.{hp}"] = names if hp == "params" else v
        for names in groups:
            for name in names:
                for k, v in optimizer.state.get(params[name], {}).items():
                    key = f"optim.state.{name}.{k}"
                    if not isinstance(v, Tensor):
                        values[key] = v
                        continue
                    layout, stacked = _state_layout(tgt, name, key, v, params[name], op)
                    entries[key] = _entry(key, v, layout, tgt, stacked)
    for k, v in (extra or {}).items():
        if not isinstance(k, str) or not k:
            raise CheckpointError(
                f"{op} on {tgt.where}: extra key {k!r} is not a non-empty string. Fix: name "
                "each extra value with a string"
            )
        values[f"extra.{k}"] = v
    planner = _SavePlanner(list(entries.values()), values, header, target, tgt.where)
    with _quiet(tgt.distributed):
        dcp_save(
            {},
            storage_writer=FileSystemWriter(target, overwrite=True),
            planner=planner,
            no_dist=not tgt.distributed,
        )


def _read_metadata(path: str, where: str, op: str) -> Metadata:
    try:
        metadata = FileSystemReader(path).read_metadata()
    except (OSError, EOFError, ValueError, TypeError, AttributeError, ImportError) as e:
        raise CheckpointError(
            f"{op} on {where}: {path} is not a distributed checkpoint (no readable .metadata: "
            f"{type(e).__name__}: {e}). Fix: pass the directory that fastdist.train.save (or "
            "torch.distributed.checkpoint.save) wrote; a save_pretrained directory or a "
            "safetensors file loads with pm.load"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"{op} on {where}: {path}/.metadata holds a {type(metadata).__name__}, not DCP "
            "metadata. Fix: pass the directory that fastdist.train.save wrote"
        )
    return metadata


def _read_values(path: str, keys: list[str], where: str) -> dict[str, Any]:
    """The small values under ``keys``, read by this process alone (no collective)."""
    if not keys:
        return {}
    planner = _LoadPlanner([], keys, where)
    with _quiet(False):
        dcp_load({}, storage_reader=FileSystemReader(path), planner=planner, no_dist=True)
    return planner.values


def load(
    path: str | os.PathLike[str],
    model: ParallelModel | nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint that `save` wrote (on any mesh) into ``model`` (and ``optimizer``);
    returns the ``extra`` values.

    Each rank reads only the boxes it holds, from whichever chunks hold them: the checkpoint
    may come from another tensor-parallel size, data-parallel size, sequence-parallel setting,
    simulated ranks, real ranks or one device. Padding rows are zero-filled. On real ranks a
    **collective**: call it on every rank. A checkpoint that ``torch.distributed.checkpoint``
    wrote from torch's ``get_state_dict`` (``{"model": ..., "optim": ...}``) loads too.

    Everything is checked on every rank before anything is read: the keys (strict like
    ``load_state_dict``: a missing or unexpected key raises; ``strict=False`` skips them), every
    shape (the single-device shapes must match), the optimizer (same class, same parameters in
    each param group). A mismatch raises `fastdist.nn.CheckpointError` naming the key, the rank
    and the fix, and leaves the model and optimizer untouched. The optimizer's state is
    replaced (``optimizer.load_state_dict``), hyperparameters included.

    Args:
        path: the checkpoint directory `save` wrote.
        model: the model to load into (a `fastdist.nn.ParallelModel` or a module).
        optimizer: an optimizer whose state to replace too.
        strict: raise on missing or unexpected keys (``False``: skip them).

    Returns:
        the ``extra`` values saved with the checkpoint.
    """
    op = "fastdist.train.load"
    tgt = _target(model, op)
    source = os.fspath(path)
    metadata = _read_metadata(source, tgt.where, op)
    stored = metadata.state_dict_metadata
    header = metadata.planner_data.get(_HEADER) if isinstance(metadata.planner_data, dict) else None
    entries = _model_entries(tgt)
    aliases = {f"model.{a}": f"model.{n}" for a, n in _tied_aliases(tgt.module).items()}
    missing = sorted(k for k in entries if k not in stored)
    unexpected = sorted(
        k for k in stored if k.startswith("model.") and k not in entries and k not in aliases
    )
    if not any(k.startswith("model.") for k in stored) and stored:
        raise CheckpointError(
            f"{op} on {tgt.where}: {source} holds no model.* keys (it has e.g. "
            f"{sorted(stored)[:3]}): not a model checkpoint. Fix: pass the directory that "
            "fastdist.train.save wrote"
        )
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{op} on {tgt.where}: {source} does not match {type(tgt.module).__name__}: missing "
            f"keys {_few(missing)}, unexpected keys {_few(unexpected)} ({len(missing)} missing, "
            f"{len(unexpected)} unexpected). Fix: load the checkpoint of the same model (same "
            "config), or pass strict=False to skip them"
        )
    for key in [k for k in missing if k in entries]:
        del entries[key]
    for alias, key in aliases.items():
        if alias in stored and key in stored:
            _check_shape(alias, stored[alias], stored[key], tgt.where, op, source)
    values_wanted = [k for k, v in stored.items() if isinstance(v, BytesStorageMetadata)]
    values_wanted = [
        k for k in values_wanted if k.startswith("extra.") or (optimizer and k.startswith("optim"))
    ]
    values = _read_values(source, values_wanted, tgt.where)
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    if isinstance(optimizer, ZeroOptimizer):
        groups, state = _zero_plan(tgt, optimizer, stored, values, header, entries, strict)
    elif optimizer is not None:
        groups, state = _optimizer_plan(tgt, optimizer, stored, values, header, entries, strict)
    for key, entry in entries.items():
        md = stored[key]
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(
                f"{op} on {tgt.where}: {key!r} is not a tensor in {source}. Fix: load the "
                "checkpoint of the same model"
            )
        if tuple(md.size) != entry.shape:
            raise CheckpointError(
                f"{op} on {tgt.where}: {key!r} has shape {tuple(md.size)} in {source} but the "
                f"model expects {entry.shape} (single-device shapes). Fix: load the checkpoint "
                "of the same config"
            )
    planner = _LoadPlanner(list(entries.values()), [], tgt.where)
    with _quiet(tgt.distributed):
        dcp_load(
            {},
            storage_reader=FileSystemReader(source),
            planner=planner,
            no_dist=not tgt.distributed,
        )
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.inner.load_state_dict({"state": state, "param_groups": groups})
        # the wrapper shows the wrapped optimizer's (now new) groups and state
        optimizer.param_groups, optimizer.state = (
            optimizer.inner.param_groups,
            optimizer.inner.state,
        )
    elif optimizer is not None:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    return {k[len("extra.") :]: v for k, v in values.items() if k.startswith("extra.")}


def _few(keys: list[str]) -> str:
    return f"{keys[:6]}{' ...' if len(keys) > 6 else ''}"


def _check_shape(alias: str, a: Any, b: Any, where: str, op: str, source: str) -> None:
    sa, sb = getattr(a, "size", None), getattr(b, "size", None)
    if sa != sb:
        raise CheckpointError(
            f"{op} on {where}: {alias!r} is tied to another parameter in the model, but "
            f"{source} gives them shapes {sa} and {sb}. Fix: load the checkpoint of the same "
            "model"
        )


def _optimizer_plan(
    tgt: _Target,
    optimizer: torch.optim.Optimizer,
    stored: Mapping[str, Any],
    values: Mapping[str, Any],
    header: Any,
    entries: dict[str, _Entry],
    strict: bool,
) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
    """Check the optimizer against the checkpoint; add its state's entries (new tensors) to
    ``entries``; return the param groups and the state to hand ``optimizer.load_state_dict``."""
    op = "fastdist.train.load"
    kind = _optimizer_kind(optimizer)
    saved_kind = header.get("optimizer") if isinstance(header, dict) else None
    n_groups = len({k.split(".")[2] for k in values if k.startswith("optim.param_groups.")})
    if n_groups == 0:
        raise CheckpointError(
            f"{op} on {tgt.where}: the checkpoint holds no optimizer state. Fix: load it without "
            "optimizer= (or save with optimizer=)"
        )
    if saved_kind is not None and saved_kind != kind:
        raise CheckpointError(
            f"{op} on {tgt.where}: the checkpoint holds the state of a {saved_kind}, not of a "
            f"{kind}. Fix: build the optimizer it was saved with"
        )
    names = _param_names(tgt, optimizer, op)
    if n_groups != len(names):
        raise CheckpointError(
            f"{op} on {tgt.where}: the checkpoint's optimizer has {n_groups} param groups, this "
            f"{type(optimizer).__name__} {len(names)}. Fix: build the optimizer with the same "
            "param groups"
        )
    index = {n: i for i, n in enumerate(n for group in names for n in group)}
    groups = []
    for i, group in enumerate(names):
        saved = list(values.get(f"optim.param_groups.{i}.params", []))
        if sorted(saved) != sorted(group):
            diff = sorted(set(saved) ^ set(group))
            raise CheckpointError(
                f"{op} on {tgt.where}: param group {i} holds other parameters in the checkpoint "
                f"than in this optimizer (they differ in {_few(diff)}). Fix: build the optimizer "
                "with the same param groups"
            )
        prefix = f"optim.param_groups.{i}."
        hps = {k[len(prefix) :]: v for k, v in values.items() if k.startswith(prefix)}
        groups.append({**hps, "params": [index[n] for n in group]})
    params = dict(tgt.module.named_parameters())
    state: dict[int, dict[str, Any]] = {}
    for key in stored:
        if not key.startswith("optim.state."):
            continue
        name, _, sub = key[len("optim.state.") :].rpartition(".")
        if name not in index:
            if strict:
                raise CheckpointError(
                    f"{op} on {tgt.where}: the checkpoint holds optimizer state {key!r} for a "
                    "parameter this optimizer does not hold. Fix: load the checkpoint of the "
                    "same model and optimizer, or pass strict=False"
                )
            continue
        md, p = stored[key], params[name]
        if isinstance(md, BytesStorageMetadata):
            state.setdefault(index[name], {})[sub] = values[key]
            continue
        full = entries[f"model.{name}"].shape if f"model.{name}" in entries else None
        if tuple(md.size) == full:
            dest = torch.empty_like(p.detach(), dtype=md.properties.dtype)
            layout, stacked = tgt.layouts.get(name, Layout()), tgt.simulated
        elif len(md.size) == 0:
            dest = torch.empty((), dtype=md.properties.dtype)
            layout, stacked = Layout(), False
        else:
            raise CheckpointError(
                f"{op} on {tgt.where}: optimizer state {key!r} has shape {tuple(md.size)} in the "
                f"checkpoint, neither its parameter's {full} nor a scalar. Fix: load the "
                "checkpoint of the same model and optimizer"
            )
        entries[key] = _entry(key, dest, layout, tgt, stacked)
        state.setdefault(index[name], {})[sub] = dest
    return groups, state


# ============================================================================ ZeRO-1
# `ZeroOptimizer` holds each data rank's chunk of the flattened parameters (this rank's blocks,
# side by side, padded). A chunk's part of one parameter is a run of its block in row-major
# order: a few boxes of the block (`_flat_boxes`), each then cut by the layout's boxes. On disk
# it is the plain optimizer's state (``optim.state.<name>.<key>``), so either loads the other.
def _flat_boxes(a: int, b: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], ...]]:
    """Elements ``[a, b)`` (row-major) of a tensor of ``shape`` as boxes (offsets, sizes), each
    contiguous in that order.

    >>> _flat_boxes(2, 9, (3, 4))    # the rest of row 0, then row 1, then row 2's first element
    [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 1))]
    """
    if a >= b:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = a // inner, (b - 1) // inner

    def within(row: int, lo: int, hi: int) -> list[tuple[tuple[int, ...], ...]]:
        return [((row, *o), (1, *n)) for o, n in _flat_boxes(lo, hi, shape[1:])]

    if first == last:
        return within(first, a - first * inner, b - first * inner)
    full_lo, full_hi = -(-a // inner), b // inner  # whole rows
    out = within(first, a - first * inner, inner) if a < full_lo * inner else []
    if full_hi > full_lo:
        out.append(((full_lo, *[0] * (len(shape) - 1)), (full_hi - full_lo, *shape[1:])))
    return out + (within(last, 0, b - last * inner) if b > full_hi * inner else [])


def _zero_entry(
    key: str, state: Tensor, p: Tensor, offset: int, layout: Layout, tgt: _Target, z: Any
) -> _Entry:
    """The boxes of parameter ``p``'s state that this process's chunk(s) of the flat ``state``
    hold (``p`` starts at ``offset`` of the flattened vector)."""
    mesh = cast(Mesh, tgt.mesh)
    local = tuple(p.shape[1:]) if tgt.simulated else tuple(p.shape)
    full = layout.full_shape(local, mesh)
    strides = [math.prod(local[d + 1 :]) for d in range(len(local))]
    state = state.detach()
    c = state.shape[-1]
    found: dict[tuple[tuple[int, ...], tuple[int, ...]], _Box] = {}
    for r in range(mesh.size) if tgt.simulated else [mesh.rank]:
        i = mesh.index(r, z.axes)
        chunk = state[r] if tgt.simulated else state
        lo, hi = max(offset, i * c), min(offset + math.prod(local), (i + 1) * c)
        for offs, sizes in _flat_boxes(lo - offset, hi - offset, local):
            start = offset + sum(o * st for o, st in zip(offs, strides)) - i * c
            piece = chunk[start : start + math.prod(sizes)].view(sizes)
            for glob, block in layout.boxes(full, mesh, r):
                part = _clip(glob, block, piece, offs)
                if part is not None:
                    found.setdefault(part[:2], _Box(part[0], part[1], [])).views.append(part[2])
    return _Entry(key, full, state.dtype, list(found.values()))


def _zero_groups(
    tgt: _Target, z: Any, op: str
) -> list[tuple[Tensor, list[tuple[str, Tensor, int]]]]:
    """Each flat shard of ``z`` with its parameters: (shard, [(name, parameter, offset)])."""
    if tgt.mesh is None or not all(hasattr(z, a) for a in ("_groups", "axes", "inner")):
        raise CheckpointError(
            f"{op} on {tgt.where}: this ZeroOptimizer is not laid out as fastdist.train.checkpoint "
            "expects (a mesh, its flat groups). Fix: build it as ZeroOptimizer(pm, ...) over the "
            "ParallelModel being saved"
        )
    names = {id(p): n for n, p in tgt.module.named_parameters()}
    out = []
    for plist, shard, _ in z._groups:
        params, offset = [], 0
        for p in plist:
            if id(p) not in names:
                raise CheckpointError(
                    f"{op} on {tgt.where}: the ZeroOptimizer holds a parameter that is not the "
                    "model's. Fix: build it over the ParallelModel being saved"
                )
            params.append((names[id(p)], p, offset))
            offset += math.prod(p.shape[1:] if tgt.simulated else p.shape)
        out.append((shard, params))
    return out


def _zero_save(
    tgt: _Target, z: Any, entries: dict[str, _Entry], values: dict[str, Any], op: str
) -> None:
    """A ZeroOptimizer's groups and state, written as the plain optimizer's would be."""
    shards = _zero_groups(tgt, z, op)
    by_shard = {id(shard): params for shard, params in shards}
    for i, group in enumerate(z.inner.param_groups):
        for hp, v in group.items():
            values[f"optim.param_groups.{i}.{hp}"] = (
                [n for s in v for n, _, _ in by_shard[id(s)]] if hp == "params" else v
            )
    for shard, params in shards:
        for k, v in z.inner.state.get(shard, {}).items():
            for name, p, offset in params:
                key = f"optim.state.{name}.{k}"
                if not isinstance(v, Tensor):
                    values[key] = v
                elif v.dim() == 0:
                    entries[key] = _entry(key, v, Layout(), tgt, False)
                elif v.shape == shard.shape:
                    layout = tgt.layouts.get(name, Layout())
                    entries[key] = _zero_entry(key, v, p, offset, layout, tgt, z)
                else:
                    raise CheckpointError(
                        f"{op} on {tgt.where}: ZeroOptimizer state {k!r} has shape "
                        f"{tuple(v.shape)}, neither the flat shard's {tuple(shard.shape)} nor a "
                        "scalar. Fix: use an elementwise optimizer (AdamW, Adam, SGD)"
                    )


def _zero_plan(
    tgt: _Target,
    z: Any,
    stored: Mapping[str, Any],
    values: Mapping[str, Any],
    header: Any,
    entries: dict[str, _Entry],
    strict: bool,
) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
    """Check a ZeroOptimizer against the checkpoint (a plain or a ZeRO optimizer's); add the
    entries that fill new flat state tensors; return what ``z.inner.load_state_dict`` takes."""
    op = "fastdist.train.load"
    shards = _zero_groups(tgt, z, op)
    kind = _optimizer_kind(z.inner)
    saved_kind = header.get("optimizer") if isinstance(header, dict) else None
    if saved_kind is not None and saved_kind != kind:
        raise CheckpointError(
            f"{op} on {tgt.where}: the checkpoint holds the state of a {saved_kind}, not of a "
            f"{kind} (wrapped by this ZeroOptimizer). Fix: wrap the optimizer it was saved with"
        )
    by_shard = {id(shard): [n for n, _, _ in params] for shard, params in shards}
    index = {id(shard): i for i, (shard, _) in enumerate(shards)}
    n_groups = len({k.split(".")[2] for k in values if k.startswith("optim.param_groups.")})
    if n_groups != len(z.inner.param_groups):
        raise CheckpointError(
            f"{op} on {tgt.where}: the checkpoint's optimizer has {n_groups} param groups, this "
            f"ZeroOptimizer {len(z.inner.param_groups)} (all its parameters in one). Fix: load "
            "a checkpoint of an optimizer over all the model's parameters in one group"
            + (" (it holds no optimizer state: load without optimizer=)" if not n_groups else "")
        )
    groups = []
    for i, group in enumerate(z.inner.param_groups):
        mine = [n for s in group["params"] for n in by_shard[id(s)]]
        saved = list(values.get(f"optim.param_groups.{i}.params", []))
        if sorted(saved) != sorted(mine):
            raise CheckpointError(
                f"{op} on {tgt.where}: param group {i} holds other parameters in the checkpoint "
                f"than in this ZeroOptimizer (they differ in {_few(sorted(set(saved) ^ set(mine)))}"
                "). Fix: load the checkpoint of an optimizer over the same parameters"
            )
        prefix = f"optim.param_groups.{i}."
        hps = {k[len(prefix) :]: v for k, v in values.items() if k.startswith(prefix)}
        groups.append({**hps, "params": [index[id(s)] for s in group["params"]]})
    known = {n for names in by_shard.values() for n in names}
    subs: dict[str, set[str]] = {}
    for key in stored:
        if key.startswith("optim.state."):
            name, _, sub = key[len("optim.state.") :].rpartition(".")
            if name not in known and strict:
                raise CheckpointError(
                    f"{op} on {tgt.where}: the checkpoint holds optimizer state {key!r} for a "
                    "parameter this ZeroOptimizer does not hold. Fix: load the checkpoint of the "
                    "same model, or pass strict=False"
                )
            subs.setdefault(name, set()).add(sub)
    state: dict[int, dict[str, Any]] = {}
    for shard, params in shards:
        have = [subs.get(n, set()) for n, _, _ in params]
        if any(h != have[0] for h in have):
            raise CheckpointError(
                f"{op} on {tgt.where}: the checkpoint holds optimizer state for some parameters "
                f"of a flat ZeRO group and not others ({params[0][0]!r}: {sorted(have[0])}); a "
                "flat update needs all or none. Fix: load a checkpoint saved after a step where "
                "every parameter had a gradient"
            )
        st: dict[str, Any] = {}
        for sub in sorted(have[0]):
            first = f"optim.state.{params[0][0]}.{sub}"
            md = stored[first]
            if isinstance(md, BytesStorageMetadata):
                st[sub] = values[first]
            elif len(md.size) == 0:
                st[sub] = torch.zeros((), dtype=md.properties.dtype)
                entries[first] = _entry(first, st[sub], Layout(), tgt, False)
            else:
                st[sub] = torch.zeros_like(shard.detach(), dtype=md.properties.dtype)
                for name, p, offset in params:
                    key = f"optim.state.{name}.{sub}"
                    layout = tgt.layouts.get(name, Layout())
                    entries[key] = _zero_entry(key, st[sub], p, offset, layout, tgt, z)
                    if tuple(stored[key].size) != entries[key].shape:
                        raise CheckpointError(
                            f"{op} on {tgt.where}: optimizer state {key!r} has shape "
                            f"{tuple(stored[key].size)} in the checkpoint, not its parameter's "
                            f"{entries[key].shape}. Fix: load the checkpoint of the same model"
                        )
        if st:
            state[index[id(shard)]] = st
    return groups, state
