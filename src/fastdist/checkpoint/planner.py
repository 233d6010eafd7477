"""The planner of a distributed checkpoint: which bytes of which tensor each rank writes and
reads.

A rank's block of a parameter maps to rectangular boxes of the single-device tensor through its
`fastdist.nn.Layout` (`Layout.boxes`): fused ``q|k|v`` parts give three boxes, vocabulary padding
rows none. An `Entry` is one checkpoint key with the boxes this process holds (every simulated
rank's, or this real rank's; a ``DTensor``'s local part); `SavePlanner` and `LoadPlanner` are
``torch.distributed.checkpoint`` planners over those boxes: one writer per box on save, and on
load each box read from whichever chunks hold it (resharding). How the boxes are stored is the
storage's concern (`fastdist.checkpoint.dcp`).
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
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
from torch.distributed.tensor import DTensor

from fastdist.checkpoint.staged import Staged
from fastdist.core.mesh import Mesh
from fastdist.errors import CheckpointError
from fastdist.nn.parallelize import ParallelModel
from fastdist.nn.state import Layout, meta_names, named_tensors, param_layouts, tied_aliases

__all__ = [
    "FORMAT",
    "HEADER",
    "Box",
    "Entry",
    "Target",
    "Job",
    "target",
    "gather_job",
    "agree",
    "merge",
    "entry",
    "clip_box",
    "model_entries",
    "chunk",
    "SavePlanner",
    "LoadPlanner",
    "few",
]

FORMAT = 1  # the version of this layout of keys (planner_data["fastdist"]["format"])
HEADER = "fastdist"  # the key of this library's header in the metadata's planner_data


# ============================================================================ what a rank holds
@dataclass
class Box:
    """One rectangular box of a single-device tensor that this process holds: ``views`` are the
    box's elements in each local copy (simulated ranks holding the same block: one view each)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    views: list[Tensor]


@dataclass
class Entry:
    """One checkpoint key: its single-device shape and dtype, and the boxes this process holds."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: list[Box] = field(default_factory=list)
    padded: list[Tensor] = field(default_factory=list)  # zero-filled before a load
    lowest: bool = False  # written by the lowest rank holding it (buffers: see `SavePlanner`)


@dataclass
class Job:
    """What the other ranks of a pipeline hold (gathered: a rank holds only its stages): every
    model key held anywhere, and the union of each param group's parameter names."""

    keys: set[str]
    groups: list[list[str]] | None


@dataclass
class Target:
    """How a model is held: on a simulated mesh (stacked), real ranks, or one device per
    process; a pipeline as its stages held here (``modules``: parameters of distinct names, a
    buffer of the model's skeleton in every stage)."""

    modules: tuple[nn.Module, ...]
    mesh: Mesh | None
    layouts: dict[str, Layout]
    distributed: bool  # a collective over torch.distributed's default group
    where: str  # "simulated ranks", "rank 3", "one device"
    simulated: bool = False  # every rank's block stacked, [mesh.size, *local]
    pipeline: dict[str, Any] | None = None  # a pipeline's whole mesh and axis
    job: Job | None = None  # a pipeline on real ranks: what every rank holds (`gather_job`)
    renames: dict[str, str] = field(default_factory=dict)  # a tied copy's name -> the first's

    @property
    def name(self) -> str:
        """The model's class name (for messages)."""
        return type(self.modules[0]).__name__ if self.modules else "Pipeline"

    @property
    def staged(self) -> bool:
        """A pipeline on real ranks: other ranks hold other parameters."""
        return self.pipeline is not None and self.distributed

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every parameter held here by the model's name (tied ones once; a pipeline's copy of
        a weight tied across stages under the first stage's name, beside it)."""
        return [(self.renames.get(n, n), p) for m in self.modules for n, p in m.named_parameters()]

    def named_tensors(self) -> list[tuple[str, Tensor, bool]]:
        """(name, tensor, is a parameter) of every parameter and persistent buffer held here; a
        skeleton buffer once per stage; a copy of a tied weight under the first's name."""
        return [
            (self.renames.get(n, n), t, is_p)
            for m in self.modules
            for n, (t, is_p) in named_tensors(m).items()
        ]

    def tied_aliases(self) -> dict[str, str]:
        return {a: n for m in self.modules for a, n in tied_aliases(m).items()}

    def meta_names(self) -> list[str]:
        return [n for m in self.modules for n in meta_names(m)]


def target(model: ParallelModel | nn.Module | Staged, op: str) -> Target:
    if isinstance(model, ParallelModel):
        mesh = model.mesh
        layouts = param_layouts(model.module)
        if mesh.backend is None:
            return Target((model.module,), mesh, layouts, False, "simulated ranks", True)
        return Target((model.module,), mesh, layouts, True, f"rank {mesh.rank}")
    if isinstance(model, Staged) and not isinstance(model, nn.Module):
        return _staged_target(model, op)
    if not isinstance(model, nn.Module):
        raise CheckpointError(
            f"{op}: model is a {type(model).__name__}, not a fastdist.nn.ParallelModel nor a "
            "torch.nn.Module. Fix: pass what fastdist.nn.parallelize returned, or a plain module"
        )
    distributed = dist.is_available() and dist.is_initialized()
    where = f"rank {dist.get_rank()}" if distributed else "one device"
    return Target((model,), None, {}, distributed, where)


def _staged_target(pipe: Staged, op: str) -> Target:
    """A pipeline: the stages held here, under the model's names, over their common stage mesh."""
    stages = [pipe.stages[j] for j in sorted(pipe.stages)]
    meshes = {pm.mesh for pm in stages}
    if not stages or len(meshes) != 1:
        raise CheckpointError(
            f"{op}: the pipeline holds {len(stages)} stages here over {len(meshes)} meshes; a "
            "checkpoint needs at least one stage, all over the same stage mesh. Fix: pass what "
            "fastdist.train.pipeline returned"
        )
    mesh = stages[0].mesh
    layouts: dict[str, Layout] = {}
    for pm in stages:
        layouts.update(param_layouts(pm.module))
    renames = dict(pipe.tied)
    for alias, name in renames.items():  # split alike (the pipeline checks): one layout
        if alias in layouts:
            layouts.setdefault(name, layouts.pop(alias))
    real = pipe.mesh.backend is not None
    info = {"mesh": dict(pipe.mesh.shape), "axis": pipe.axis}
    return Target(
        tuple(pm.module for pm in stages),
        mesh,
        layouts,
        real,
        f"rank {pipe.mesh.rank}" if real else "simulated ranks",
        not real,
        info,
        renames=renames,
    )


def gather_job(tgt: Target, keys: set[str], groups: list[list[str]] | None) -> None:
    """A pipeline on real ranks: set ``tgt.job`` to the union of every rank's model ``keys``
    and of each param group's names (``groups``: this rank's; None: no optimizer). A
    collective over the default group (every rank holds a pipeline); elsewhere nothing."""
    if not tgt.staged:
        return
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, (sorted(keys), groups))
    union: list[list[str]] | None = None
    if groups is not None:
        union = [[] for _ in groups]
        for _, theirs in got:
            for i, names in enumerate((theirs or [])[: len(union)]):
                union[i] += [n for n in names if n not in union[i]]
    tgt.job = Job({k for mine, _ in got for k in mine}, union)


def agree(tgt: Target, failure: CheckpointError | None) -> None:
    """A pipeline on real ranks: raise on every rank when any rank found a problem (its own
    error, or the first failing rank's), so that no rank waits in a collective the others left;
    elsewhere: raise ``failure``, if any. A collective for a pipeline on real ranks."""
    if tgt.staged:
        got: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(got, None if failure is None else str(failure))
        bad = [(r, m) for r, m in enumerate(got) if m is not None]
        if failure is None and bad:
            rank, msg = bad[0]
            raise CheckpointError(f"process rank {rank} refused the checkpoint: {msg}")
    if failure is not None:
        raise failure


def _local(t: Tensor) -> tuple[Tensor, tuple[int, ...]] | None:
    """(the elements this process holds, their offset in ``t``'s own coordinates); a DTensor's
    local shard and its offset, None where this rank is not in its mesh."""
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if t.device_mesh.get_coordinate() is None:
            return None
        if any(p.is_partial() for p in t.placements):
            raise CheckpointError(
                f"fastdist.checkpoint: a DTensor with placements {t.placements} holds "
                "partial sums, which no checkpoint can store. Fix: reduce it first "
                "(redistribute to Replicate or Shard)"
            )
        _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(offsets)
    return t, (0,) * t.dim()


def clip_box(
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


def entry(key: str, t: Tensor, layout: Layout, tgt: Target, stacked: bool) -> Entry:
    """The boxes this process holds of tensor ``t`` (a parameter, a buffer, an optimizer state)
    split like ``layout``."""
    t = t.detach()
    mesh = tgt.mesh
    if stacked:  # simulated ranks: every rank's block, [world, *local]
        assert mesh is not None
        full = layout.full_shape(tuple(t.shape[1:]), mesh)
        found: dict[tuple[tuple[int, ...], tuple[int, ...]], Box] = {}
        for r in range(mesh.size):
            for glob, block in layout.boxes(full, mesh, r):
                offsets = tuple(s.start for s in glob)
                sizes = tuple(s.stop - s.start for s in glob)
                box = found.setdefault((offsets, sizes), Box(offsets, sizes, []))
                box.views.append(t[r][block])
        entry = Entry(key, full, t.dtype, list(found.values()))
        entry.padded = [t] if layout.size is not None else []
        return entry
    if mesh is None or mesh.backend is None:  # whole on every rank (a simulated scalar, buffer)
        full = tuple(t.shape)
        boxes = [(tuple(slice(0, n) for n in full),) * 2]
    else:
        full = layout.full_shape(tuple(t.shape), mesh)
        boxes = layout.boxes(full, mesh, mesh.rank)
    entry = Entry(key, full, t.dtype)
    held = _local(t)
    if held is None:
        return entry
    local, origin = held
    for glob, block in boxes:
        part = clip_box(glob, block, local, origin)
        if part is not None:
            entry.boxes.append(Box(part[0], part[1], [part[2]]))
    entry.padded = [local] if layout.size is not None else []
    return entry


def model_entries(tgt: Target) -> dict[str, Entry]:
    """``model.<name>`` -> entry, for every parameter (tied ones once) and persistent buffer held
    here."""
    out: dict[str, Entry] = {}
    for name, t, is_param in tgt.named_tensors():
        if t.is_meta:
            raise CheckpointError(
                f"fastdist.checkpoint on {tgt.where}: {name!r} is on the meta device: "
                "there is nothing to save or load into. Fix: materialise the model first "
                "(fastdist.nn.init_weights(pm, seed=...) or "
                "fastdist.checkpoint.load(<safetensors>, pm, device=...)), then load"
            )
        layout = tgt.layouts.get(name, Layout()) if is_param else Layout()
        new = entry(f"model.{name}", t, layout, tgt, tgt.simulated and is_param)
        new.lowest = not is_param  # running statistics: each rank's own (see `SavePlanner`)
        if new.key in out:  # a skeleton buffer in every stage, a tied weight: written once,
            merge(out[new.key], new)  # read into each copy
        else:
            out[new.key] = new
    return out


def merge(into: Entry, other: Entry) -> None:
    """``other``'s copies of the same boxes added to ``into``'s (one write, every copy read)."""
    boxes = {(b.offsets, b.sizes): b for b in into.boxes}
    for b in other.boxes:
        if (b.offsets, b.sizes) in boxes:
            boxes[(b.offsets, b.sizes)].views += b.views
        else:
            into.boxes.append(b)
    into.padded += other.padded


# ============================================================================ planners
def chunk(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))


class SavePlanner(DefaultSavePlanner):
    """Writes the boxes this process holds, one ``WriteItem`` each, in single-device coordinates.

    The coordinator keeps one writer per box (ranks holding the same box: the one with the fewest
    bytes so far, biggest boxes first) and records the header and the nesting of keys. A
    buffer's box is written by the lowest rank holding it: ranks may hold different running
    statistics (BatchNorm under data parallelism, each rank updating them from its own batch),
    and the checkpoint then holds one rank's whole set, the one torch's DDP broadcasts
    (``broadcast_buffers``), never a mix of ranks. (Replacing an earlier checkpoint atomically
    is the storage's concern: `fastdist.checkpoint.dcp.Writer`.)"""

    def __init__(
        self,
        entries: list[Entry],
        values: Mapping[str, Any],
        header: dict[str, Any],
        where: str,
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries, self.values, self.header = entries, values, header
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
                    chunk=chunk(box),
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
        lowest = [(e.key, box.offsets) for e in self.entries if e.lowest for box in e.boxes]
        self.plan = SavePlan(items, planner_data=lowest)
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
                f"fastdist.checkpoint.save on {self.where}: {name} (a {type(value).__name__}) "
                f"would not load with torch.load(weights_only=True): {str(e).splitlines()[0]}. "
                "Fix: store tensors, numbers, strings and lists/tuples/dicts of them (e.g. a "
                "state_dict())"
            ) from None
        return buf.getvalue()

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        lowest = {(k, tuple(o)) for p in all_plans for k, o in (p.planner_data or [])}
        all_plans = [dataclasses.replace(p, planner_data=None) for p in all_plans]
        plans, metadata = super().create_global_plan(_one_writer_per_box(all_plans, lowest))
        nesting: dict[str, Any] = {k: _nesting(k) for k in metadata.state_dict_metadata}
        nesting[HEADER] = self.header
        self.metadata = dataclasses.replace(metadata, planner_data=nesting)
        return plans, self.metadata

    def resolve_data(self, write_item: WriteItem) -> Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.blobs[write_item.index.fqn])
        offset = write_item.index.offset
        return self.sources[(write_item.index.fqn, tuple(offset) if offset is not None else ())]


def _one_writer_per_box(
    plans: list[SavePlan], lowest: set[tuple[str, tuple[int, ...]]]
) -> list[SavePlan]:
    """Each box that several ranks hold kept in one plan only: the plan with the fewest bytes so
    far, biggest boxes first (replicated parameters spread over their holders); a box in
    ``lowest`` (key, offsets) by the lowest rank holding it."""

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
        if key[:2] in lowest:
            w = min(holders[key])
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


class LoadPlanner(DefaultLoadPlanner):
    """Reads the boxes this process holds from whatever chunks the checkpoint has (resharding);
    small values into ``values``.

    Nothing is written into the model while DCP reads: every piece goes to a staging tensor, and
    `apply` (called once the whole read succeeded on every rank) copies them into every local
    copy and zero-fills padding rows, so a read that fails leaves the model as it was."""

    def __init__(self, entries: list[Entry], value_keys: list[str], where: str) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries, self.value_keys, self.where = entries, value_keys, where
        self.values: dict[str, Any] = {}
        self.by_key = {e.key: e for e in entries}
        self.staged: list[tuple[ReadItem, Tensor]] = []

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
            reads = create_read_items_for_chunk_list(e.key, md, [chunk(b) for b in e.boxes])
            got = [0] * len(e.boxes)
            for r in reads:
                got[r.dest_index.index or 0] += math.prod(r.lengths)
            for box, n in zip(e.boxes, got):
                if n != math.prod(box.sizes):
                    raise CheckpointError(
                        f"fastdist.checkpoint.load on {self.where}: the checkpoint's chunks of "
                        f"{e.key!r} cover {n} of the {math.prod(box.sizes)} elements at offsets "
                        f"{box.offsets} (sizes {box.sizes}): the checkpoint is incomplete or "
                        "damaged. Fix: load a checkpoint whose save finished"
                    )
            items += reads
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
        view = self._view(read_item, 0)
        return torch.empty(view.shape, dtype=view.dtype)  # staged: see `apply`

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        self.staged.append((read_item, tensor))

    def apply(self) -> None:
        """Copy what was read into the model (every local copy of each box); padding rows, in no
        box, zero-filled. Call it only after the whole read succeeded."""
        with torch.no_grad():
            for e in self.entries:
                for t in e.padded:
                    t.zero_()
            for item, tensor in self.staged:
                box = self.by_key[item.dest_index.fqn].boxes[item.dest_index.index or 0]
                for copy in range(len(box.views)):
                    self._view(item, copy).copy_(tensor)
        self.staged = []

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def few(keys: list[str]) -> str:
    return f"{keys[:6]}{' ...' if len(keys) > 6 else ''}"
