"""Storage: a distributed checkpoint directory of ``torch.distributed.checkpoint`` (DCP).

`write` stores the boxes the planner chose (`fastdist.checkpoint.planner`), each rank its own,
one ``__<rank>_<save>_0.distcp`` file per writing rank plus ``.metadata``; `read` reads the boxes
this process holds from whichever chunks hold them. The keys are the single-device state dict's
(``model.<name>``, ``optim.state.<name>.<key>``, ``optim.param_groups.<i>.<hp>``,
``extra.<key>``), so torch's own DCP tools read the directory
(``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``).

Failing whole: a save writes new file names and commits by one atomic rename of ``.metadata``
(`Writer`); a load reads every box into staging tensors, checks each stored item's length and
CRC-32 (`Reader`), and copies into the model only once everything was read.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
import uuid
import warnings
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import IO, Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from fastdist.checkpoint.optimizer import (
    Saved,
    apply_optimizer_state,
    plan_optimizer,
    save_optimizer,
)
from fastdist.checkpoint.planner import (
    FORMAT,
    HEADER,
    Box,
    Entry,
    LoadPlanner,
    Target,
    agree,
    few,
    gather_job,
    model_entries,
    target,
)
from fastdist.checkpoint.planner import SavePlanner as BoxSavePlanner
from fastdist.checkpoint.staged import Staged
from fastdist.errors import CheckpointError
from fastdist.nn.materialize import resolve_device
from fastdist.nn.parallelize import ParallelModel
from fastdist.nn.state import materialize_

__all__ = ["write", "read", "Writer", "Reader"]

_OURS = re.compile(r"__\d+_.*\.distcp|__\d+\.metadata")  # files a DCP save writes


def _crc_key(info: _StorageInfo) -> str:
    return f"{info.relative_path}:{info.offset}"


class Writer(FileSystemWriter):
    """A ``FileSystemWriter`` whose save replaces an earlier checkpoint atomically.

    Every save writes files of new names (``__<rank>_<save id>_<n>.distcp``; the save id is the
    coordinator's), so no byte of the checkpoint already at ``path`` is touched while ranks write;
    each rank records the CRC-32 of every item it wrote (read back from its file); the
    coordinator then writes ``.metadata.tmp`` (with the CRCs in the fastdist header) and renames it
    over ``.metadata`` (``os.replace``: the commit point), and only then removes the files of the
    checkpoint it replaced. A save that dies before the rename leaves the old checkpoint whole
    (plus files no ``.metadata`` names, removed by the next save)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, overwrite=True)
        self.save_id = uuid.uuid4().hex[:8]

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_{self.save_id}_"))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner).wait()
        results = []
        for wr in written:
            info = wr.storage_data
            with open(os.path.join(self.path, info.relative_path), "rb") as f:
                f.seek(info.offset)
                crc = zlib.crc32(f.read(info.length))
            results.append(dataclasses.replace(wr, storage_data=(info, crc)))
        out: Future[list[WriteResult]] = Future()
        out.set_result(results)
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage: dict[Any, _StorageInfo] = {}
        crcs: dict[str, int] = {}
        for wr in (wr for rank in results for wr in rank):
            info, crc = wr.storage_data
            storage[wr.index], crcs[_crc_key(info)] = info, crc
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        data = dict(metadata.planner_data or {})
        data[HEADER] = {**data.get(HEADER, {}), "crc32": crcs}
        metadata.planner_data = data
        final = os.path.join(self.path, ".metadata")
        with open(final + ".tmp", "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(final + ".tmp", final)  # the commit
        keep = {info.relative_path for info in storage.values()}
        for name in sorted(os.listdir(self.path)):
            if _OURS.fullmatch(name) and name not in keep:
                os.remove(os.path.join(self.path, name))


class Reader(FileSystemReader):
    """A ``FileSystemReader`` that checks each stored item it reads before torch parses it: its
    length (a truncated file) and, where the save recorded one, its CRC-32 (damaged bytes),
    raising `fastdist.errors.CheckpointError` naming the file."""

    def __init__(self, path: str, crcs: Mapping[str, int], where: str, op: str) -> None:
        super().__init__(path)
        self.crcs, self.where, self.op = crcs, where, op

    def _slice_file(self, file: Any, sinfo: _StorageInfo) -> IO[bytes]:
        data = super()._slice_file(file, sinfo).read()
        name = os.path.join(self.path, sinfo.relative_path)
        problem = None
        if len(data) != sinfo.length:
            problem = (
                f"is truncated: it holds {len(data)} of the {sinfo.length} bytes stored at "
                f"offset {sinfo.offset}"
            )
        elif (want := self.crcs.get(_crc_key(sinfo))) is not None and zlib.crc32(data) != want:
            problem = (
                f"is damaged: the {sinfo.length} bytes at offset {sinfo.offset} fail their CRC-32"
            )
        if problem is not None:
            raise CheckpointError(
                f"{self.op} on {self.where}: {name} {problem}. Nothing was loaded: the model and "
                "optimizer are as they were. Fix: load another (older) checkpoint, or save again"
            )
        return io.BytesIO(data)


@contextmanager
def _quiet(distributed: bool, failed: str, fix: str) -> Iterator[None]:
    """Silence DCP's "saving in a single process" warning where one process is the intent, and
    turn DCP's ``CheckpointException`` (a ``BaseException``) into a `CheckpointError`: a fastdist
    error a rank raised as itself, any other as ``failed`` with the first rank's cause and
    ``fix``."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        try:
            yield
        except CheckpointException as e:
            causes = {r: f[0] for r, f in sorted(e.failures.items())}
            ours = [c for c in causes.values() if isinstance(c, CheckpointError)]
            if ours:
                raise ours[0] from e
            rank, cause = next(iter(causes.items())) if causes else (0, e)
            text = (str(cause).strip().splitlines() or [""])[0]
            raise CheckpointError(
                f"{failed} (process rank {rank}: {type(cause).__name__}: {text}). Fix: {fix}"
            ) from e


def write(
    path: str | os.PathLike[str],
    model: ParallelModel | nn.Module | Staged,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write ``model``'s state (and ``optimizer``'s, and ``extra``) as a distributed checkpoint
    in directory ``path``, each rank writing only its own slices.

    Args:
        path: a directory (created, parents too). An earlier checkpoint there is replaced
            atomically (`Writer`): the new files get new names, the commit is one rename of
            ``.metadata``, and the old checkpoint's files are removed only after it; a save that
            dies before the commit leaves the old checkpoint loadable, never a mix. Other files
            in the directory are left alone.
        model: a `fastdist.nn.ParallelModel` on a simulated mesh (this one process writes every
            rank's slices) or on real ranks (a **collective**: call it on every rank of the
            job; each rank writes one ``__<rank>_<save id>_0.distcp`` file with its slices, a slice
            several ranks hold written by one of them), or a plain ``nn.Module`` (one device;
            a collective over the default process group when torch.distributed is initialised,
            e.g. data-parallel replicas or FSDP2 ``DTensor`` parameters), or a pipeline
            (`fastdist.checkpoint.staged.Staged`: every stage held here writes its parameters
            under the model's own names, so the checkpoint is the whole model's, loadable on any
            other pipeline or none; on real ranks a collective of every rank).
        optimizer: a ``torch.optim`` optimizer over the model's parameters (a pipeline's:
            over ``pipe.parameters()``, its param groups' names joined over the stages): its
            per-parameter state (tensors of the parameter's shape split like the parameter;
            scalars such as ``step`` stored once) by parameter name, and its param groups'
            hyperparameters. A
            `fastdist.train.ZeroOptimizer` writes the same keys from its flat chunks (each data
            rank the runs it holds), so a plain optimizer loads them and the other way round.
        extra: small values every rank agrees on (a step counter, an LR scheduler's
            ``state_dict()``, RNG states), written once (by rank 0); they must load with
            ``torch.load(weights_only=True)``: tensors, numbers, strings, containers of them.

    Raises `fastdist.errors.CheckpointError` (on every rank, before anything is written) for
    optimizer parameters the model lacks, optimizer state of another shape than its
    parameter's, or an ``extra`` value that would not load; and (on every rank) for a write
    that fails (a full disk), the earlier checkpoint at ``path`` then left as it was. Ranks that
    hold the same slice are not compared (one of them writes it): ``pm.state_dict()`` checks that
    replicas of a parameter agree. A persistent buffer is written by the lowest rank holding it
    (BatchNorm's running statistics, which each data rank updates from its own batch: the
    lowest rank's whole set, as torch's DDP broadcasts them, never a mix of ranks).
    """
    op = "fastdist.checkpoint.save"
    tgt = target(model, op)
    where = os.fspath(path)
    if os.path.exists(where) and not os.path.isdir(where):
        raise CheckpointError(
            f"{op} on {tgt.where}: {where} is a file; a distributed checkpoint is a directory. "
            "Fix: pass a directory path (it is created)"
        )
    entries: dict[str, Entry] = {}
    values: dict[str, Any] = {}
    header: dict[str, Any] = {
        "format": FORMAT,
        "mesh": dict(tgt.mesh.shape) if tgt.mesh is not None else None,
        "simulated": tgt.simulated,
        "model": tgt.name,
        "optimizer": None,
        "pipeline": tgt.pipeline,
    }
    failure = None
    try:
        entries = model_entries(tgt)
        if optimizer is not None:
            header["optimizer"] = save_optimizer(tgt, optimizer, entries, values, op)
        for k, v in (extra or {}).items():
            if not isinstance(k, str) or not k:
                raise CheckpointError(
                    f"{op} on {tgt.where}: extra key {k!r} is not a non-empty string. Fix: name "
                    "each extra value with a string"
                )
            values[f"extra.{k}"] = v
    except CheckpointError as e:
        failure = e
    agree(tgt, failure)  # a pipeline on real ranks: every rank raises, or none
    n_groups = len(optimizer.param_groups) if optimizer is not None else 0
    groups = [list(values.get(f"optim.param_groups.{i}.params", [])) for i in range(n_groups)]
    model_keys = {k for k in entries if k.startswith("model.")}
    gather_job(tgt, model_keys, groups if optimizer is not None else None)
    if tgt.job is not None and tgt.job.groups is not None:  # each group: every stage's names
        for i, names in enumerate(tgt.job.groups):
            values[f"optim.param_groups.{i}.params"] = names
    planner = BoxSavePlanner(list(entries.values()), values, header, tgt.where)
    failed = f"{op} on {tgt.where}: writing {where} failed; a checkpoint there before is unchanged"
    with _quiet(tgt.distributed, failed, "free space or fix the directory's permissions"):
        dcp_save(
            {},
            storage_writer=Writer(where),
            planner=planner,
            no_dist=not tgt.distributed,
        )


def _read_metadata(path: str, where: str, op: str) -> Metadata:
    try:
        metadata = FileSystemReader(path).read_metadata()
    except (OSError, EOFError, ValueError, TypeError, AttributeError, ImportError) as e:
        raise CheckpointError(
            f"{op} on {where}: {path} is not a distributed checkpoint (no readable .metadata: "
            f"{type(e).__name__}: {e}). Fix: pass the directory that fastdist.checkpoint.save (or "
            "torch.distributed.checkpoint.save) wrote, or format='safetensors' for a "
            "save_pretrained directory or a safetensors file"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"{op} on {where}: {path}/.metadata holds a {type(metadata).__name__}, not DCP "
            "metadata. Fix: pass the directory that fastdist.checkpoint.save wrote"
        )
    return metadata


def _read_values(path: str, keys: list[str], crcs: Mapping[str, int], where: str) -> dict[str, Any]:
    """The small values under ``keys``, read by this process alone (no collective)."""
    if not keys:
        return {}
    op = "fastdist.checkpoint.load"
    planner = LoadPlanner([], keys, where)
    with _quiet(False, f"{op} on {where}: reading {path} failed; nothing was loaded", _REREAD):
        dcp_load({}, storage_reader=Reader(path, crcs, where, op), planner=planner, no_dist=True)
    return planner.values


def _read_scalars(
    path: str, keys: list[str], stored: Mapping[str, Any], crcs: Mapping[str, int], where: str
) -> dict[str, Tensor]:
    """The 0-d tensors stored under ``keys``, read by this process alone (no collective)."""
    op = "fastdist.checkpoint.load"
    entries = [
        Entry(k, (), stored[k].properties.dtype, [Box((), (), [torch.empty((), dtype=d)])])
        for k in keys
        for d in [stored[k].properties.dtype]
    ]
    planner = LoadPlanner(entries, [], where)
    with _quiet(False, f"{op} on {where}: reading {path} failed; nothing was loaded", _REREAD):
        dcp_load({}, storage_reader=Reader(path, crcs, where, op), planner=planner, no_dist=True)
    planner.apply()
    return {e.key: e.boxes[0].views[0] for e in entries}


_REREAD = "load another (older) checkpoint, or save again (the files may be damaged or missing)"


def read(
    path: str | os.PathLike[str],
    model: ParallelModel | nn.Module | Staged,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[dict[str, Any], list[str], list[str]]:
    """Load a checkpoint that `write` wrote (on any mesh) into ``model`` (and ``optimizer``);
    returns the ``extra`` values and the keys a non-strict load skipped.

    Each rank reads only the boxes it holds, from whichever chunks hold them: the checkpoint
    may come from another tensor-parallel size, data-parallel size, sequence-parallel setting,
    simulated ranks, real ranks or one device. Padding rows are zero-filled. On real ranks a
    **collective**: call it on every rank. A checkpoint that ``torch.distributed.checkpoint``
    wrote from torch's ``get_state_dict`` (``{"model": ..., "optim": ...}``) loads too.

    Everything is checked on every rank before anything is read: the keys (strict like
    ``load_state_dict``: a missing or unexpected key raises; ``strict=False`` skips them), every
    shape (the single-device shapes must match), the optimizer (same class, same parameters in
    each param group). A mismatch raises `fastdist.errors.CheckpointError` naming the key, the rank
    and the fix, and leaves the model and optimizer untouched. The optimizer's state is
    replaced (``optimizer.load_state_dict``), hyperparameters included.

    Args:
        path: the checkpoint directory `write` wrote.
        model: the model to load into (a `fastdist.nn.ParallelModel` or a module).
        optimizer: an optimizer whose state to replace too.
        strict: raise on missing or unexpected keys (``False``: skip them).
        device: where the tensors of a `fastdist.nn.ParallelModel` built on the meta device
            get their storage (default cpu): each only its rank's shard (its local shape), no
            whole tensor and no init first; non-persistent buffers are recomputed by the
            model's own init. A load that fails puts them back on the meta device.
        dtype: the dtype of floating-point meta parameters (default: their own).

    Returns:
        ``(extra, missing_keys, unexpected_keys)``: the ``extra`` values saved with the
        checkpoint; the model's tensors (held here) the checkpoint has no key for, and the
        checkpoint's model keys no tensor of the model (of the whole job, for a pipeline) reads,
        both sorted, by the model's names (without the ``model.`` prefix of the storage).
    """
    op = "fastdist.checkpoint.load"
    tgt = target(model, op)
    parts: list[Any] = [model]
    if isinstance(model, Staged) and not isinstance(model, (ParallelModel, nn.Module)):
        parts = [model.stages[j] for j in sorted(model.stages)]
    made = _materialize(parts, tgt, device, dtype, op)
    try:
        out = _read_into(
            os.fspath(path), tgt, optimizer, strict, {f"model.{n}" for n, _ in made}, op
        )
    except BaseException:
        for _, t in made:  # back to the meta device: as it was
            materialize_(t, "meta")
        raise
    if made:
        for part in parts:
            if isinstance(part, ParallelModel):
                part.settle_meta()
    return out


def _materialize(
    parts: list[Any],
    tgt: Target,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    op: str,
) -> list[tuple[str, Tensor]]:
    """Storage for this rank's shards of the tensors still on the meta device (values written by
    the load); returns them with their names. ``parts``: the model, or a pipeline's stages held
    here."""
    if not tgt.meta_names():
        if device is not None or dtype is not None:
            raise CheckpointError(
                f"{op}: device={device!r} / dtype={dtype!r} choose where tensors on the meta "
                f"device get their storage, but {tgt.name} has none there. Fix: drop them"
            )
        return []
    if not all(isinstance(part, ParallelModel) for part in parts):
        return []  # model_entries names them and the fix
    for part in parts:
        part.recompute_buffers(resolve_device(device))
    made = []
    for name, t, is_param in tgt.named_tensors():
        if t.is_meta:
            materialize_(t, device, dtype if is_param and t.is_floating_point() else None)
            made.append((name, t))
    return made


def _read_into(
    source: str,
    tgt: Target,
    optimizer: torch.optim.Optimizer | None,
    strict: bool,
    fresh: set[str],
    op: str,
) -> tuple[dict[str, Any], list[str], list[str]]:
    """`read` of a model whose tensors all have storage (``fresh``: the keys given storage for
    this load, which must then be in the checkpoint); returns what `read` returns."""
    held = {id(p): n for n, p in tgt.named_parameters()}
    groups = (
        [[held[id(p)] for p in g["params"] if id(p) in held] for g in optimizer.param_groups]
        if optimizer is not None
        else None
    )
    gather_job(tgt, {f"model.{n}" for n, _, _ in tgt.named_tensors()}, groups)
    try:
        checked = _check_read(source, tgt, optimizer, strict, fresh, op)
    except CheckpointError as e:
        agree(tgt, e)
        raise
    agree(tgt, None)  # a pipeline on real ranks: every rank found the checkpoint good
    entries, values, restore, crcs, skipped = checked
    planner = LoadPlanner(list(entries.values()), [], tgt.where)
    failed = f"{op} on {tgt.where}: reading {source} failed; nothing was loaded"
    with _quiet(tgt.distributed, failed, _REREAD):
        dcp_load(
            {},
            storage_reader=Reader(source, crcs, tgt.where, op),
            planner=planner,
            no_dist=not tgt.distributed,
        )
    planner.apply()  # every rank read everything: now into the model
    if optimizer is not None and restore is not None:
        apply_optimizer_state(optimizer, *restore)
    extra = {k[len("extra.") :]: v for k, v in values.items() if k.startswith("extra.")}
    return extra, *skipped


Checked = tuple[
    dict[str, Entry], dict[str, Any], Any, Mapping[str, int], tuple[list[str], list[str]]
]
"""(the entries to read, the small values read, the optimizer's plan, the CRC-32s, the missing
and unexpected keys by the model's names)"""


def _check_read(
    source: str,
    tgt: Target,
    optimizer: torch.optim.Optimizer | None,
    strict: bool,
    fresh: set[str],
    op: str,
) -> Checked:
    """Everything `_read_into` checks before reading a tensor: keys, shapes, the optimizer;
    reads the small values (this process alone)."""
    metadata = _read_metadata(source, tgt.where, op)
    stored = metadata.state_dict_metadata
    header = metadata.planner_data.get(HEADER) if isinstance(metadata.planner_data, dict) else None
    crcs = header.get("crc32", {}) if isinstance(header, dict) else {}
    entries = model_entries(tgt)
    aliases = {f"model.{a}": f"model.{n}" for a, n in tgt.tied_aliases().items()}
    known = tgt.job.keys if tgt.job is not None else set(entries)  # a pipeline: every stage's
    missing = sorted(k for k in entries if k not in stored)
    unexpected = sorted(
        k for k in stored if k.startswith("model.") and k not in known and k not in aliases
    )
    if not any(k.startswith("model.") for k in stored) and stored:
        raise CheckpointError(
            f"{op} on {tgt.where}: {source} holds no model.* keys (it has e.g. "
            f"{sorted(stored)[:3]}): not a model checkpoint. Fix: pass the directory that "
            "fastdist.checkpoint.save wrote"
        )
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{op} on {tgt.where}: {source} does not match {tgt.name}: missing keys "
            f"{few(missing)}, unexpected keys {few(unexpected)} ({len(missing)} missing, "
            f"{len(unexpected)} unexpected). Fix: load the checkpoint of the same model (same "
            "config), or pass strict=False to skip them"
        )
    if fresh & set(missing):
        raise CheckpointError(
            f"{op} on {tgt.where}: {few(sorted(fresh & set(missing)))} are on the meta device and "
            f"{source} has no key for them: they would stay without values. Fix: load a "
            "checkpoint that has them, or fastdist.nn.init_weights(pm, seed=...) first"
        )
    for key in [k for k in missing if k in entries]:
        del entries[key]
    for alias, key in aliases.items():
        if alias in stored and key in stored:
            _check_shape(alias, stored[alias], stored[key], tgt.where, op, source)
            if strict and key in entries:
                _check_tied(source, alias, key, entries[key], header, stored, crcs, tgt, op)
    values_wanted = [k for k, v in stored.items() if isinstance(v, BytesStorageMetadata)]
    values_wanted = [
        k for k in values_wanted if k.startswith("extra.") or (optimizer and k.startswith("optim"))
    ]
    values = _read_values(source, values_wanted, crcs, tgt.where)
    restore = (
        plan_optimizer(
            tgt,
            optimizer,
            Saved(
                stored,
                values,
                header,
                strict,
                lambda keys: _read_scalars(source, keys, stored, crcs, tgt.where),
            ),
            entries,
        )
        if optimizer is not None
        else None
    )
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
    names = ([k[len("model.") :] for k in missing], [k[len("model.") :] for k in unexpected])
    return entries, values, restore, crcs, names


def _check_tied(
    source: str,
    alias: str,
    key: str,
    entry: Entry,
    header: Any,
    stored: Mapping[str, Any],
    crcs: Mapping[str, int],
    tgt: Target,
    op: str,
) -> None:
    """Raise when the checkpoint holds a tied weight's second name as a tensor of its own with
    other values (saved from a model where they were not tied): the load would silently drop
    it. fastdist writes a tied weight once, so in its checkpoints the second name alone says
    so; torch's (``get_state_dict``: both names) are compared on this process's boxes."""
    differ = header is not None
    if not differ:
        got = _read_boxes(source, [(k, entry) for k in (alias, key)], stored, crcs, tgt.where)
        differ = any(not torch.equal(a, b) for a, b in zip(got[alias], got[key]))
    if differ:
        raise CheckpointError(
            f"{op} on {tgt.where}: {alias[len('model.') :]!r} is tied to "
            f"{key[len('model.') :]!r} in {tgt.name}, but {source} holds it as a tensor of its "
            "own with other values (saved from a model where they were not tied, e.g. "
            "tie_word_embeddings=False): loading would drop it and use the other's values. "
            "Fix: build the model with the same config (untied), or pass strict=False to load "
            "the tied weight's values only"
        )


def _read_boxes(
    path: str,
    wanted: list[tuple[str, Entry]],
    stored: Mapping[str, Any],
    crcs: Mapping[str, int],
    where: str,
) -> dict[str, list[Tensor]]:
    """Key -> the boxes ``entry`` holds, read from ``key`` into new tensors by this process
    alone (no collective), for each ``(key, entry)`` of ``wanted``."""
    op = "fastdist.checkpoint.load"
    entries = [
        Entry(
            key,
            e.shape,
            stored[key].properties.dtype,
            [
                Box(b.offsets, b.sizes, [torch.empty(b.sizes, dtype=stored[key].properties.dtype)])
                for b in e.boxes
            ],
        )
        for key, e in wanted
    ]
    planner = LoadPlanner(entries, [], where)
    with _quiet(False, f"{op} on {where}: reading {path} failed; nothing was loaded", _REREAD):
        dcp_load({}, storage_reader=Reader(path, crcs, where, op), planner=planner, no_dist=True)
    planner.apply()
    return {e.key: [b.views[0] for b in e.boxes] for e in entries}


def _check_shape(alias: str, a: Any, b: Any, where: str, op: str, source: str) -> None:
    sa, sb = getattr(a, "size", None), getattr(b, "size", None)
    if sa != sb:
        raise CheckpointError(
            f"{op} on {where}: {alias!r} is tied to another parameter in the model, but "
            f"{source} gives them shapes {sa} and {sb}. Fix: load the checkpoint of the same "
            "model"
        )
