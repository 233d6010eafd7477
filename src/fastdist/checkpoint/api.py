"""One save/load pair for every checkpoint: a distributed (DCP) directory, or single-device
safetensors (a ``save_pretrained`` directory, a ``.safetensors`` file, a state dict in memory).

The format is chosen by ``format=``, or else by what is at ``path``: a directory holding DCP
``.metadata`` is a distributed checkpoint; a mapping, a ``.safetensors`` file or a directory of
them is single-device safetensors. Both read only this rank's slices, for any layout of the
model (`fastdist.checkpoint.planner` says which; `fastdist.checkpoint.dcp` and
`fastdist.checkpoint.safetensors_io` store them).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import nn

from fastdist.checkpoint import safetensors_io
from fastdist.checkpoint.hf import fused_experts, has_fused_experts, hf_checkpoint_renames
from fastdist.checkpoint.staged import Staged
from fastdist.core.mesh import Mesh
from fastdist.errors import CheckpointError
from fastdist.nn.materialize import resolve_device
from fastdist.nn.parallelize import ParallelModel
from fastdist.nn.state import meta_names, module_and_mesh

__all__ = ["save", "load", "is_dcp", "Format", "Staged", "LoadResult"]

#: ``"dcp"``: a distributed checkpoint directory (every rank writes its slices; model, optimizer
#: and ``extra``); ``"safetensors"``: single-device weights (one file, or a ``save_pretrained``
#: directory; model only)
Format = Literal["dcp", "safetensors"]
_FORMATS = ("dcp", "safetensors")


class LoadResult(dict[str, Any]):
    """What `load` returns: the ``extra`` values saved with the checkpoint (this is that dict;
    ``{}`` for safetensors) and, as torch's ``load_state_dict`` reports them, the keys a
    ``strict=False`` load skipped, each a sorted list of names:

    * ``missing_keys``: the model's tensors (parameters and persistent buffers, by the names of
      ``pm.state_dict()``) the checkpoint has no key for: left as they were;
    * ``unexpected_keys``: the checkpoint's keys (its own names: after ``rename=``, the file's)
      that no tensor of the model reads: not loaded.

    Both are empty after a strict load, which raises instead. On real ranks each rank reports
    its own (the same, unless a pipeline's stages differ); a pipeline's are those of the stages
    held here: a key is missing when a stage held here lacks it, and unexpected (safetensors)
    when no stage held here reads it.

    >>> r = LoadResult({"step": 7}, ["lm_head.weight"], [])
    >>> r, r["step"], r.missing_keys, r.unexpected_keys
    ({'step': 7}, 7, ['lm_head.weight'], [])
    """

    def __init__(
        self,
        extra: Mapping[str, Any] | None = None,
        missing_keys: list[str] | None = None,
        unexpected_keys: list[str] | None = None,
    ) -> None:
        super().__init__(extra or {})
        self.missing_keys: list[str] = list(missing_keys or [])
        self.unexpected_keys: list[str] = list(unexpected_keys or [])


def is_dcp(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a directory holding DCP metadata (``.metadata``, the file
    ``torch.distributed.checkpoint``'s writer commits last).

    >>> import tempfile
    >>> is_dcp(tempfile.mkdtemp())
    False
    """
    return os.path.isfile(os.path.join(os.fspath(path), ".metadata"))


def _format(path: Any, format: str | None, op: str, default: str) -> str:
    if format is not None:
        if format not in _FORMATS:
            raise CheckpointError(
                f"{op}: format={format!r}; expected one of {_FORMATS}. Fix: 'dcp' for a "
                "distributed checkpoint directory, 'safetensors' for single-device weights"
            )
        return format
    if isinstance(path, Mapping):
        return "safetensors"
    if os.path.isdir(os.fspath(path)) and is_dcp(path):
        return "dcp"
    if os.fspath(path).endswith(".safetensors") or (
        os.path.isdir(os.fspath(path))
        and any(f.endswith(".safetensors") for f in os.listdir(os.fspath(path)))
    ):
        return "safetensors"
    return default


def save(
    path: str | os.PathLike[str],
    model: ParallelModel | nn.Module | Staged,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    format: Format | None = None,
    extra: Mapping[str, Any] | None = None,
    mesh: Mesh | None = None,
    dst: int = 0,
) -> None:
    """Write ``model``'s state (and ``optimizer``'s, and ``extra``) to ``path``.

    Args:
        path: ``format="dcp"`` (the default): a directory (created; an earlier checkpoint there
            is replaced), each rank writing only its own slices, loadable on any other layout.
            ``format="safetensors"`` (the default for a path ending ``.safetensors``): the
            single-device weights gathered and written as one file by rank ``dst`` (written
            to ``.tmp`` and renamed into place); a path not ending ``.safetensors`` is a
            directory (created) holding ``model.safetensors`` (a diffusers model's:
            ``diffusion_pytorch_model.safetensors``) and, for a transformers or diffusers
            model, its ``config.json``: a plain ``from_pretrained`` loads it (an earlier sharded
            save there, its index and shards, is removed: nothing reads stale weights).
            (``model.save_pretrained`` of a parallelized transformers model writes the whole
            model too: `fastdist.nn.hf_save`.)
        model: a `fastdist.nn.ParallelModel` (simulated or real ranks; on real ranks a
            **collective**: call it on every rank), or a module: with ``mesh=`` a module of
            fastdist layers, without it a plain module on one device (``"dcp"`` only); or a
            pipeline (`Staged`, ``"dcp"`` only): the stages held here write the whole model's
            checkpoint under its own names, loadable into any other pipeline layout (pp, tp,
            dp) or into the model without a pipeline.
        optimizer: an optimizer over the model's parameters (``"dcp"`` only; a pipeline's over
            ``pipe.parameters()``), its state stored by parameter name (a
            `fastdist.train.ZeroOptimizer` writes the same keys).
        format: ``"dcp"`` or ``"safetensors"``.
        extra: small values every rank agrees on (a step, an LR scheduler's ``state_dict()``),
            ``"dcp"`` only; they must load with ``torch.load(weights_only=True)``.
        mesh: the mesh of a plain module of fastdist layers (``"safetensors"``).
        dst: the rank that writes the ``"safetensors"`` file.

    Raises `fastdist.errors.CheckpointError` before anything is written (see
    `fastdist.checkpoint.dcp.write`), or when a write fails (the checkpoint that was at
    ``path`` then left as it was: a save replaces it atomically).

    >>> import tempfile, torch, fastdist as fd
    >>> def mlp():
    ...     return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
    ...                                torch.nn.Linear(8, 4))
    >>> plan = {"0": fd.nn.ColwiseParallel(input="replicated"), "2": fd.nn.RowwiseParallel()}
    >>> torch.manual_seed(0) and None
    >>> pm4 = fd.nn.parallelize(mlp(), fd.Mesh({"tp": 4}), plan)       # simulated: 4 ranks
    >>> with tempfile.TemporaryDirectory() as path:
    ...     fd.checkpoint.save(path, pm4, extra={"step": 7})
    ...     pm2 = fd.nn.parallelize(mlp(), fd.Mesh({"tp": 2}), plan)   # other weights, 2 ranks
    ...     extra = fd.checkpoint.load(path, pm2)
    >>> extra, all(torch.equal(pm4.state_dict()[k], v) for k, v in pm2.state_dict().items())
    ({'step': 7}, True)
    """
    op = "fastdist.checkpoint.save"
    guess = "safetensors" if os.fspath(path).endswith(".safetensors") else "dcp"
    fmt = _format(path, format or guess, op, "dcp")
    if _is_pipeline(model) and fmt != "dcp":
        raise CheckpointError(
            f"{op}: format={fmt!r} of a pipeline is not supported (each stage holds part of the "
            "model). Fix: format='dcp' (the default for a directory); it loads into the model "
            "without a pipeline too, whose fastdist.checkpoint.save(path, model, "
            "format='safetensors') then writes single-device weights"
        )
    if fmt == "dcp":
        if mesh is not None:
            raise CheckpointError(
                f"{op}: mesh= is for format='safetensors' of a module of fastdist layers. Fix: "
                "pass the ParallelModel parallelize returned"
            )
        # torch.distributed.checkpoint (DTensor, sympy: about a second) is imported by the first
        # distributed save or load, not by `import fastdist.checkpoint` (issue 42.4)
        from fastdist.checkpoint import dcp

        dcp.write(path, model, optimizer, extra=extra)
        return
    if optimizer is not None or extra:
        raise CheckpointError(
            f"{op}: format='safetensors' holds the model's weights only, not optimizer= or "
            "extra=. Fix: format='dcp' (the default) for a training checkpoint"
        )
    module, mesh = module_and_mesh(model, mesh, op)
    safetensors_io.write(module, path, mesh, dst=dst)


def _is_pipeline(model: Any) -> bool:
    return isinstance(model, Staged) and not isinstance(model, (ParallelModel, nn.Module))


def load(
    path: str | os.PathLike[str] | Mapping[str, Any],
    model: ParallelModel | nn.Module | Staged,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    format: Format | None = None,
    strict: bool | Literal["missing"] = True,
    rename: Mapping[str, str] | Callable[[str], str] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    mesh: Mesh | None = None,
) -> LoadResult:
    """Load a checkpoint into ``model`` (and ``optimizer``), each rank reading only its slices;
    returns the ``extra`` values saved with it (``{}`` for safetensors) as a `LoadResult`, a
    dict whose ``missing_keys`` and ``unexpected_keys`` list the keys ``strict=False`` skipped
    (torch's ``load_state_dict`` contract).

    Args:
        path: a directory `save` wrote (``"dcp"``: from any mesh, simulated or real ranks, ZeRO
            or not; torch's own DCP ``{"model": ..., "optim": ...}`` checkpoints too), or
            single-device weights (``"safetensors"``): a ``save_pretrained`` directory (one
            file or an index of several), a ``.safetensors`` file, or a state dict.
        model: a `fastdist.nn.ParallelModel`; a module (with ``mesh=``: of fastdist layers;
            without: one device, ``"dcp"`` only); or a pipeline (`Staged`: every stage held
            here reads its part of the whole model's checkpoint, single-device safetensors or
            a distributed checkpoint of any layout, pipelined or not; with ``optimizer=`` over
            ``pipe.parameters()`` from a distributed checkpoint).
        optimizer: an optimizer whose state to replace too (``"dcp"`` only).
        format: ``"dcp"`` or ``"safetensors"``; default: what is at ``path`` (a state dict, a
            ``.safetensors`` file or a directory holding one: safetensors; else DCP).
        strict: like ``load_state_dict``: a missing or unexpected key raises; ``False`` skips
            them (shapes are always checked) and the result's ``missing_keys`` /
            ``unexpected_keys`` name them; ``"missing"`` (safetensors) raises for missing keys
            only (the default for a pipeline's stages).
        rename: (safetensors) model key -> checkpoint key, a mapping or a function; default:
            the renamings transformers applies to this model's checkpoints
            (`fastdist.checkpoint.hf.hf_checkpoint_renames`), and per-expert tensors read under
            the model's fused names (`fastdist.checkpoint.hf.fused_experts`).
        device: where tensors on the meta device get their storage (default cpu), each rank
            only its shards' (safetensors and DCP alike: no init first); non-persistent meta
            buffers are recomputed first by the model's own init, as ``from_pretrained`` does.
        dtype: the dtype of floating-point meta parameters (default: their own).
        mesh: the mesh of a plain module of fastdist layers.

    Everything is checked before anything is read; a mismatch raises
    `fastdist.errors.CheckpointError` naming the key and the fix. A load fails whole: a
    checkpoint that cannot be read completely (a missing, truncated or damaged file: each item
    of a distributed checkpoint carries a CRC-32) raises `fastdist.errors.CheckpointError` (an
    ``Exception``) naming the file, with the model and optimizer as they were.

    >>> import torch, fastdist as fd
    >>> lin = torch.nn.Linear(2, 2)
    >>> pm = fd.nn.parallelize(lin, fd.Mesh({"tp": 2}), {})
    >>> r = fd.checkpoint.load({"weight": torch.ones(2, 2), "scale": torch.ones(())}, pm,
    ...                        strict=False)
    >>> r.missing_keys, r.unexpected_keys
    (['bias'], ['scale'])
    """
    op = "fastdist.checkpoint.load"
    if _is_pipeline(model) and _format(path, format, op, "dcp") == "safetensors":
        assert isinstance(model, Staged)
        if optimizer is not None:
            raise CheckpointError(
                f"{op}: {path if not isinstance(path, Mapping) else 'a state dict'} holds "
                "single-device weights, no optimizer state. Fix: load without optimizer= (a "
                "training checkpoint is the directory fastdist.checkpoint.save writes)"
            )
        results = []
        for j in sorted(model.stages):
            stage = model.stages[j]
            held = {n for n, _ in stage.module.named_parameters()}
            tied = {a: n for a, n in model.tied.items() if a in held}
            fuse = rename is None and not isinstance(path, Mapping)
            if tied and fuse and has_fused_experts(stage.module):
                # per-expert tensors seen under the fused names first: a rename= (the tied
                # weight's) would skip that view
                with fused_experts(stage.module, path) as fused:
                    results.append(_load_stage(fused, stage, tied, strict, device, dtype))
                continue
            results.append(
                load(
                    path,
                    stage,
                    format=format,
                    strict="missing" if strict is True else strict,
                    rename=_tied_rename(rename, tied, stage.module, path) if tied else rename,
                    device=device,
                    dtype=dtype,
                )
            )
        return _of_stages(results)
    fmt = _format(path, format, op, "dcp")
    if fmt == "dcp":
        if isinstance(path, Mapping):
            raise CheckpointError(f"{op}: format='dcp' needs a directory, not a state dict")
        if rename is not None:
            raise CheckpointError(
                f"{op}: rename= applies to single-device safetensors, not to a distributed "
                "checkpoint. Fix: drop rename= (a DCP checkpoint loads under the model's own names)"
            )
        if strict == "missing" or mesh is not None:
            raise CheckpointError(
                f"{op}: strict='missing' and mesh= apply to single-device safetensors. Fix: "
                "strict=True or False, and a ParallelModel"
            )
        from fastdist.checkpoint import dcp  # imported on first use: see `save`

        extra, missing, unexpected = dcp.read(
            path, model, optimizer, strict=bool(strict), device=device, dtype=dtype
        )
        return LoadResult(extra, missing, unexpected)
    if optimizer is not None:
        raise CheckpointError(
            f"{op}: {path if not isinstance(path, Mapping) else 'a state dict'} holds "
            "single-device weights, no optimizer state. Fix: load without optimizer= (a "
            "training checkpoint is the directory fastdist.checkpoint.save writes)"
        )
    assert isinstance(model, (ParallelModel, nn.Module))  # a pipeline's stages: above
    missing, unexpected = _load_weights(path, model, mesh, strict, rename, device, dtype, op)
    return LoadResult({}, missing, unexpected)


def _of_stages(results: list[LoadResult]) -> LoadResult:
    """The keys a pipeline's stages (held here) skipped: missing in any stage; unexpected in
    every stage (a stage reads its part of the whole model's checkpoint)."""
    missing = sorted({k for r in results for k in r.missing_keys})
    unexpected = set.intersection(*(set(r.unexpected_keys) for r in results)) if results else set()
    return LoadResult({}, missing, sorted(unexpected))


def _load_stage(
    fused: Mapping[str, Any],
    stage: ParallelModel,
    tied: Mapping[str, str],
    strict: bool | Literal["missing"],
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> LoadResult:
    """A pipeline stage holding a tied weight's copy, from a checkpoint already seen with the
    model's fused expert names: the copy reads the first stage's name."""
    return load(
        fused,
        stage,
        strict="missing" if strict is True else strict,
        rename=_tied_rename(None, tied, stage.module, fused),
        device=device,
        dtype=dtype,
    )


def _tied_rename(
    rename: Mapping[str, str] | Callable[[str], str] | None,
    tied: Mapping[str, str],
    module: nn.Module,
    path: Any,
) -> Mapping[str, str] | Callable[[str], str]:
    """A pipeline's last stage: its copy of a tied weight reads the first stage's name (a tied
    model's checkpoint holds it once), after ``rename`` (default: transformers' renamings)."""
    base = rename if rename is not None else (hf_checkpoint_renames(module, path) or {})
    if isinstance(base, Mapping):
        return {**base, **{alias: base.get(name, name) for alias, name in tied.items()}}
    return lambda key: base(tied.get(key, key))


def _load_weights(
    path: str | os.PathLike[str] | Mapping[str, Any],
    model: ParallelModel | nn.Module,
    mesh: Mesh | None,
    strict: bool | Literal["missing"],
    rename: Mapping[str, str] | Callable[[str], str] | None,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    op: str,
) -> tuple[list[str], list[str]]:
    """Single-device safetensors into a parallel model: transformers' names, fused experts, meta
    tensors given storage (this rank's shards only); returns the missing and unexpected keys."""
    module, mesh = module_and_mesh(model, mesh, op)
    if (device is not None or dtype is not None) and not meta_names(module):
        raise CheckpointError(
            f"{op}: device={device!r} / dtype={dtype!r} choose where tensors on the meta device "
            f"get their storage, but {type(module).__name__} has none on the meta device. Fix: "
            "drop them (the checkpoint is converted to the parameters' own device and dtype)"
        )
    if rename is None and not isinstance(path, Mapping) and has_fused_experts(module):
        # one tensor per expert (transformers' save_pretrained of Mixtral, Qwen2/3-MoE, OLMoE,
        # DeepSeek): read under the model's fused 3-D names, by slices
        with fused_experts(module, path) as fused:
            return _load_weights(fused, model, mesh, strict, None, device, dtype, op)
    if isinstance(model, ParallelModel):
        model.recompute_buffers(resolve_device(device))
    if rename is None:  # transformers' own renamings of this model's checkpoints (GPT-NeoX)
        rename = hf_checkpoint_renames(module, path)
    left = bool(meta_names(module))
    skipped = safetensors_io.read(
        module,
        path,
        mesh,
        strict=strict,
        rename=rename,
        device=device if left else None,
        dtype=dtype if left else None,
    )
    if isinstance(model, ParallelModel):
        model.settle_meta()
    return skipped
