"""Storage: single-device safetensors (a ``.safetensors`` file, a ``save_pretrained`` directory of
one file or an index of several, or a state dict in memory), each rank reading only its slices.

`read` loads such a source into a parallel module through each parameter's
`fastdist.nn.Layout` (``safe_open(...).get_slice``: only this rank's bytes); `write` gathers a
parallel module's single-device state dict and writes it as one ``.safetensors`` file on one
rank. The names transformers renames and the experts it fuses live in `fastdist.checkpoint.hf`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.errors import CheckpointError
from fastdist.nn.state import (
    Getter,
    Layout,
    full_state_dict,
    listed,
    materialize_,
    named_tensors,
    param_layouts,
    tied_aliases,
)

__all__ = ["open_source", "read", "write", "Source"]

#: what `read` reads: a ``.safetensors`` file, a ``save_pretrained`` directory, or a state dict
Source = str | os.PathLike[str] | Mapping[str, Any]


#: the weight file names save_pretrained writes: transformers', diffusers'
_WEIGHT_NAMES = ("model", "diffusion_pytorch_model")


def _directory_files(path: str) -> dict[str, str]:
    """key -> file of a save_pretrained directory (``{"": file}``: one file holding every key),
    transformers' (``model.safetensors``) or diffusers' (``diffusion_pytorch_model.safetensors``),
    one file or sharded with an index. Where a directory holds both the file and an index, the
    one the library's own ``from_pretrained`` reads: transformers the file, diffusers the
    index (so both read the same weights)."""
    for name in _WEIGHT_NAMES:
        index = os.path.join(path, f"{name}.safetensors.index.json")
        single = os.path.join(path, f"{name}.safetensors")
        if os.path.exists(single) and (name == "model" or not os.path.exists(index)):
            return {"": single}
        if os.path.exists(index):
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            return {k: os.path.join(path, v) for k, v in weight_map.items()}
    raise CheckpointError(
        f"fastdist.checkpoint.load: {path} holds neither model.safetensors nor "
        "model.safetensors.index.json (nor diffusers' diffusion_pytorch_model.safetensors). Fix: "
        "pass the directory save_pretrained(..., safe_serialization=True) wrote, or the "
        ".safetensors file itself"
    )


@contextmanager
def open_source(
    source: Source,
) -> Iterator[tuple[dict[str, tuple[int, ...]], Callable[[str], Getter]]]:
    """(shape of every key, key -> slicing reader) for a state dict, a .safetensors file or a
    save_pretrained directory."""
    if isinstance(source, Mapping):
        yield {k: tuple(v.shape) for k, v in source.items()}, lambda k: lambda s: source[k][s]
        return
    from safetensors import safe_open

    path = os.fspath(source)
    if not os.path.exists(path):
        raise CheckpointError(
            f"fastdist.checkpoint.load: {path} does not exist. Fix: pass a .safetensors file, "
            "a save_pretrained directory (model.safetensors or model.safetensors.index.json) or "
            "a state dict"
        )
    if os.path.isdir(path):
        files = _directory_files(path)
    else:
        files = {"": path}
    handles: dict[str, Any] = {}
    for file in sorted(set(files.values())):  # every file opened (its header read) before any read
        try:
            handles[file] = safe_open(file, framework="pt")
        except Exception as e:  # noqa: BLE001 (missing, truncated, not safetensors: all one answer)
            raise CheckpointError(
                f"fastdist.checkpoint.load: {file} cannot be read ({type(e).__name__}: "
                f"{(str(e).strip().splitlines() or [''])[0]}); nothing was loaded. Fix: load "
                "another checkpoint, or write this one again (it may be truncated or missing)"
            ) from e
    try:
        where = (
            {k: h for h in handles.values() for k in h.keys()}
            if "" in files
            else {k: handles[f] for k, f in files.items()}
        )
        shapes = {}
        for k, h in where.items():
            try:
                shapes[k] = tuple(h.get_slice(k).get_shape())
            except Exception as e:  # noqa: BLE001 (an index naming a tensor its file lacks)
                raise CheckpointError(
                    f"fastdist.checkpoint.load: {files.get(k, path)} has no tensor {k!r} "
                    f"({type(e).__name__}: {e}); nothing was loaded. Fix: write the checkpoint "
                    "again (its index and files disagree)"
                ) from e
        yield shapes, lambda k: lambda s: where[k].get_slice(k)[s]
    finally:
        handles.clear()


def read(
    module: nn.Module,
    source: Source,
    mesh: Mesh,
    *,
    strict: bool | Literal["missing"] = True,
    rename: Mapping[str, str] | Callable[[str], str] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[list[str], list[str]]:
    """Load a single-device checkpoint into a parallel module, each rank reading only its own
    slices; returns ``(missing_keys, unexpected_keys)``, the keys a non-strict load skipped
    (sorted): the module's names the checkpoint has no key for, and the checkpoint's keys (its
    own names) that no tensor of the module reads.

    Args:
        module: a module with per-rank parameters (``fastdist.nn`` layers, or a model after
            `fastdist.nn.parallelize`); its parameters' local shapes and layouts say what to read.
        source: a ``.safetensors`` file, a ``save_pretrained`` directory (one file or an index
            of several), or a single-device state dict. Files are read with
            ``safe_open(...).get_slice``: only this rank's bytes.
        mesh: the mesh the module was built for: on real ranks this rank's shard is read; on a
            simulated mesh the module holds every rank's shard stacked (``[world, *local]``, as
            `fastdist.nn.parallelize` leaves it) and every rank's is read.
        strict: like ``load_state_dict``: a missing key, an unexpected key or a shape that does not
            match raises `CheckpointError` naming the key and both shapes. ``False`` skips missing
            and unexpected keys (shapes are always checked). ``"missing"`` raises for missing
            keys only (a pipeline stage reads its part of the whole model's checkpoint).
        rename: model key -> checkpoint key (a mapping or a function), e.g. for a module whose
            merged projection is named differently from the checkpoint.
        device: where parameters and persistent buffers still on the meta device (a model built
            under ``torch.device("meta")``, then parallelized) get their storage: each gets only
            its shard's, allocated as it is read (default cpu).
        dtype: the dtype of floating-point meta parameters (default: their own; the checkpoint's
            values are converted). Buffers keep theirs.

    Raises `CheckpointError` (before anything is read) for a meta tensor the load would not
    fill: a key missing under ``strict=False``, or a non-persistent buffer (no checkpoint holds
    one; `fastdist.checkpoint.load` of a ParallelModel recomputes them).
    """
    layouts = param_layouts(module)
    tensors = named_tensors(module)
    stacked = mesh.backend is None
    rank = None if stacked else mesh.rank
    to_file = (
        (lambda k: rename[k] if k in rename else k)
        if isinstance(rename, Mapping)
        else (rename or (lambda k: k))
    )
    tied = {to_file(alias): to_file(name) for alias, name in tied_aliases(module).items()}
    with open_source(source) as (shapes, reader):
        wanted = {to_file(name): name for name in tensors}
        missing = sorted(k for k in wanted if k not in shapes)
        # a tied copy (HF's state_dict has both) is known
        unexpected = sorted(k for k in shapes if k not in wanted and k not in tied)
        for alias, key in tied.items():
            if alias in shapes and key in shapes and tuple(shapes[alias]) != tuple(shapes[key]):
                raise CheckpointError(
                    f"fastdist.checkpoint.load: {alias!r} is tied to {key!r} in the model, but "
                    "the checkpoint gives "
                    f"them shapes {tuple(shapes[alias])} and {tuple(shapes[key])}"
                )
        if (missing and strict) or (unexpected and strict is True):
            raise CheckpointError(
                "fastdist.checkpoint.load: missing keys "
                f"{missing[:10]}{' ...' if len(missing) > 10 else ''}, unexpected keys "
                f"{unexpected[:10]}{' ...' if len(unexpected) > 10 else ''} ({len(missing)} "
                f"missing, {len(unexpected)} unexpected). Fix: load the checkpoint of the same "
                "model (same config), map names with rename=, or pass strict=False"
            )
        if strict:
            _check_tied(module, shapes, reader, to_file, mesh, stacked)
        unfilled = [n for k, n in wanted.items() if k not in shapes and tensors[n][0].is_meta]
        if unfilled:
            raise CheckpointError(
                f"fastdist.checkpoint.load: {listed(unfilled)} are on the meta device and "
                f"the checkpoint has no key for them ({len(unfilled)} in all): strict=False skips "
                "a missing key, but these would stay without storage. Fix: load a checkpoint "
                "that has them, or initialise the model first (fastdist.nn.init_weights("
                "pm, seed=...)) and then load with strict=False"
            )
        computed = [n for n, b in module.named_buffers() if b.is_meta and n not in tensors]
        if computed:
            raise CheckpointError(
                f"fastdist.checkpoint.load: the non-persistent buffers {listed(computed)} are "
                "on the meta device; no checkpoint holds them (the model computes them when it is "
                "built, e.g. a rotary embedding's inv_freq). Fix: load into the ParallelModel "
                "fastdist.nn.parallelize returned (its own init recomputes them), or assign them "
                "yourself before loading"
            )
        with torch.no_grad():
            for key, name in wanted.items():
                if key not in shapes:
                    continue
                (t, is_param), layout = tensors[name], layouts.get(name, Layout())
                # simulated: parameters hold every rank's shard; buffers are whole
                per_rank = stacked and is_param
                local = tuple(t.shape[1:]) if per_rank else tuple(t.shape)
                expect = layout.full_shape(local, mesh)
                if tuple(shapes[key]) != expect:
                    raise CheckpointError(
                        f"fastdist.checkpoint.load: {key!r} has shape {tuple(shapes[key])} in "
                        f"the checkpoint but the model expects {expect} (each rank holds {local}). "
                        "Fix: load the checkpoint of the same config"
                    )
                get = reader(key)
                if t.is_meta:  # storage for this rank's shard only, allocated now
                    floating = is_param and t.is_floating_point()
                    materialize_(t, device, dtype if floating else None)
                if per_rank:  # rank by rank: no stacked copy in flight
                    for r in range(mesh.size):
                        t[r].copy_(layout.read(get, expect, mesh, r, key))
                else:
                    t.copy_(layout.read(get, expect, mesh, rank or 0, key))
    return sorted(wanted[k] for k in missing), unexpected


def _check_tied(
    module: nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    reader: Callable[[str], Getter],
    to_file: Callable[[str], str],
    mesh: Mesh,
    stacked: bool,
) -> None:
    """Raise when the checkpoint holds both names of a tied weight with other values (saved from
    a model where they were not tied; transformers then unties them): the load would drop one.
    Each rank compares its own slices of both (on a simulated mesh: every rank's)."""
    layouts = param_layouts(module)
    tensors = named_tensors(module)
    for alias, name in tied_aliases(module).items():
        a, b = to_file(alias), to_file(name)
        if a == b or a not in shapes or b not in shapes or name not in tensors:
            continue
        layout = layouts.get(name, Layout())
        t = tensors[name][0]
        full = layout.full_shape(tuple(t.shape[1:]) if stacked else tuple(t.shape), mesh)
        if tuple(shapes[b]) != full:
            continue  # the shape check below names it
        for r in range(mesh.size) if stacked else [mesh.rank]:
            mine = layout.read(reader(b), full, mesh, r, b)
            if not torch.equal(layout.read(reader(a), full, mesh, r, a), mine):
                raise CheckpointError(
                    f"fastdist.checkpoint.load: {alias!r} is tied to {name!r} in "
                    f"{type(module).__name__}, but the checkpoint holds {a!r} and {b!r} with "
                    "different values (saved from a model where they were not tied, e.g. "
                    "tie_word_embeddings=False; transformers' from_pretrained unties them): "
                    "loading would drop one. Nothing was loaded. Fix: build the model with the "
                    "same config (untied), or pass strict=False to load the tied weight's values"
                )


def write(
    module: nn.Module, path: str | os.PathLike[str], mesh: Mesh, *, dst: int = 0
) -> dict[str, Tensor]:
    """Gather a parallel module's weights and write them as one single-device ``.safetensors`` file
    on rank ``dst``.

    Returns the single-device state dict (on every rank). Tied parameters are written once,
    under the first name, as ``save_pretrained`` does. The file is written as ``<file>.tmp`` and
    renamed into place (``os.replace``), so a crash while writing leaves an earlier file whole.

    Args:
        module: the parallel module.
        path: the ``.safetensors`` file to write (its directory created), or any other path: a
            directory (created) holding ``model.safetensors`` (a diffusers model:
            ``diffusion_pytorch_model.safetensors``) and, for a transformers or diffusers model,
            its ``config.json``: what the class's ``from_pretrained`` reads. An earlier sharded
            save there (an index and its shards) is removed, so that nothing reads stale
            weights; a directory holding a distributed checkpoint raises `CheckpointError`
            (``fastdist.checkpoint.load(path)`` reads that first). A path that does not exist
            never becomes a file unless it ends in ``.safetensors``.
        mesh: the mesh it runs on.
        dst: the rank (global, on real ranks) that writes the file.

    Returns:
        the single-device state dict (on every rank).
    """
    from safetensors.torch import save_file

    where = os.fspath(path)
    as_file = where.endswith(".safetensors") and not os.path.isdir(where)
    if not as_file and os.path.isfile(where):
        raise CheckpointError(
            f"fastdist.checkpoint.save: {where} is a file and does not end in .safetensors. Fix: "
            "pass a directory (it is created) or a path ending in .safetensors"
        )
    if not as_file and os.path.isfile(os.path.join(where, ".metadata")):
        raise CheckpointError(
            f"fastdist.checkpoint.save: {where} holds a distributed checkpoint (.metadata), "
            "which fastdist.checkpoint.load(path) reads first: it would go on loading that one, "
            "not these weights. Nothing was written. Fix: write the safetensors to another "
            "directory (or a path ending .safetensors)"
        )
    state = full_state_dict(module, mesh)
    if mesh.backend is None or mesh.rank == dst:
        folder = os.path.dirname(os.path.abspath(where)) if as_file else where
        os.makedirs(folder, exist_ok=True)
        diffusers = callable(getattr(module, "save_config", None))  # a diffusers ModelMixin
        name = _WEIGHT_NAMES[1] if diffusers else _WEIGHT_NAMES[0]
        target = where if as_file else os.path.join(where, f"{name}.safetensors")
        aliases = tied_aliases(module)
        tensors = {k: v.contiguous() for k, v in state.items() if k not in aliases}
        save_file(tensors, target + ".tmp", metadata={"format": "pt"})
        os.replace(target + ".tmp", target)
        if not as_file:
            _remove_stale_index(where, name)
        config = getattr(module, "config", None)
        if not as_file and callable(getattr(config, "save_pretrained", None)):
            config.save_pretrained(where)  # type: ignore[union-attr]
        elif not as_file and diffusers:
            module.save_config(where)  # type: ignore[operator]
    return state


def _remove_stale_index(folder: str, name: str) -> None:
    """Remove an earlier sharded save's ``<name>.safetensors.index.json`` and the shards it
    names from ``folder``, where one ``<name>.safetensors`` was just written: left there,
    diffusers' ``from_pretrained`` would read the old shards (it prefers the index)."""
    index = os.path.join(folder, f"{name}.safetensors.index.json")
    if not os.path.exists(index):
        return
    try:
        with open(index) as f:
            shards = set(json.load(f).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        shards = set()
    for shard in sorted(shards):
        file = os.path.join(folder, os.path.basename(str(shard)))
        if file.endswith(".safetensors") and os.path.basename(file) != f"{name}.safetensors":
            if os.path.isfile(file):
                os.remove(file)
    os.remove(index)
