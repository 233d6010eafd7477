"""Optimizer state in a distributed checkpoint: by parameter name, split like its parameter.

``optim.state.<name>.<key>`` holds each parameter's state (a tensor of the parameter's shape
split like the parameter, a scalar such as ``step`` stored once), ``optim.param_groups.<i>.<hp>``
the groups (``params`` lists names), as torch's ``get_state_dict`` names them. A ZeRO-1 optimizer
(`ShardedOptimizer`, e.g. `fastdist.train.ZeroOptimizer`) writes the same keys from its flat
chunks, so a plain optimizer loads them and the other way round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from fastdist.checkpoint.planner import Box, Entry, Target, clip_box, entry, few, merge
from fastdist.core.mesh import Mesh
from fastdist.errors import CheckpointError
from fastdist.nn.state import Layout

__all__ = [
    "ShardedOptimizer",
    "Saved",
    "flat_boxes",
    "save_optimizer",
    "plan_optimizer",
    "apply_optimizer_state",
]


@runtime_checkable
class ShardedOptimizer(Protocol):
    """A ZeRO-1 optimizer: ``inner`` (the torch optimizer) steps flat shards, each the data
    rank's chunk of its parameters (this rank's blocks, side by side, padded) over ``axes``."""

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The torch optimizer that steps the flat shards."""
        ...

    @property
    def axes(self) -> tuple[str, ...]:
        """The data axes the shards split over."""
        ...

    @property
    def flat_groups(self) -> Sequence[tuple[Sequence[nn.Parameter], nn.Parameter]]:
        """(the parameters, their flat shard) of each flat group, in ``inner``'s order."""
        ...


PlanResult = tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]
"""(param groups, state by parameter index): what ``load_state_dict`` takes, once read."""


@dataclass(frozen=True)
class Saved:
    """What a load knows of a checkpoint before reading its tensors: each key's storage
    metadata, the values (non-tensors) read, the fastdist header, whether state the
    optimizer does not hold is an error, and a reader of stored scalar tensors (key -> value,
    read by this process alone, before anything is loaded; None: not readable here)."""

    stored: Mapping[str, Any]
    values: Mapping[str, Any]
    header: Any
    strict: bool
    scalars: Callable[[list[str]], dict[str, Tensor]] | None = None

    def n_groups(self) -> int:
        """How many param groups the saved optimizer had (0: no optimizer state)."""
        return len({k.split(".")[2] for k in self.values if k.startswith("optim.param_groups.")})

    def check_kind(self, tgt: Target, kind: str, op: str, wrapped: str, fix: str) -> None:
        """Raise unless the checkpoint holds the state of a ``kind`` optimizer (or says not)."""
        saved_kind = self.header.get("optimizer") if isinstance(self.header, dict) else None
        if saved_kind is not None and saved_kind != kind:
            raise CheckpointError(
                f"{op} on {tgt.where}: the checkpoint holds the state of a {saved_kind}, not of a "
                f"{kind}{wrapped}. Fix: {fix}"
            )

    def group(
        self, tgt: Target, i: int, names: list[str], holder: str, fix: str, op: str
    ) -> dict[str, Any]:
        """Param group ``i``'s hyperparameters (``params``: the saved names); raises unless it
        holds the parameters ``names``."""
        saved = list(self.values.get(f"optim.param_groups.{i}.params", []))
        if tgt.job is not None and tgt.job.groups is not None and i < len(tgt.job.groups):
            names = tgt.job.groups[i]  # a pipeline on real ranks: every rank's stages together
        if sorted(saved) != sorted(names):
            raise CheckpointError(
                f"{op} on {tgt.where}: param group {i} holds other parameters in the checkpoint "
                f"than in this {holder} (they differ in {few(sorted(set(saved) ^ set(names)))}"
                f"). Fix: {fix}"
            )
        prefix = f"optim.param_groups.{i}."
        return {k[len(prefix) :]: v for k, v in self.values.items() if k.startswith(prefix)}

    def state_keys(
        self, tgt: Target, known: Container[str], holder: str, fix: str, op: str
    ) -> Iterator[tuple[str, str, str]]:
        """(key, parameter name, state name) of each saved state of a parameter in ``known``;
        one of another parameter raises when strict (a pipeline on real ranks: unless another
        rank's stage holds it)."""
        elsewhere = {k[len("model.") :] for k in tgt.job.keys} if tgt.job is not None else set()
        for key in self.stored:
            if not key.startswith("optim.state."):
                continue
            name, _, sub = key[len("optim.state.") :].rpartition(".")
            if name in known:
                yield key, name, sub
            elif self.strict and name not in elsewhere:
                raise CheckpointError(
                    f"{op} on {tgt.where}: the checkpoint holds optimizer state {key!r} for a "
                    f"parameter this {holder} does not hold. Fix: {fix}, or pass strict=False"
                )


def param_names(tgt: Target, optimizer: torch.optim.Optimizer, op: str) -> list[list[str]]:
    """The names of each param group's parameters; raises for a parameter the model lacks."""
    names = {id(p): n for n, p in tgt.named_parameters()}
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


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def state_layout(
    tgt: Target, name: str, key: str, value: Tensor, param: Tensor, op: str
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


def optimizer_plan(
    tgt: Target, optimizer: torch.optim.Optimizer, saved: Saved, entries: dict[str, Entry]
) -> PlanResult:
    """Check the optimizer against the checkpoint; add its state's entries (new tensors) to
    ``entries``; return the param groups and the state to hand ``optimizer.load_state_dict``."""
    op = "fastdist.checkpoint.load"
    n_groups = saved.n_groups()
    if n_groups == 0:
        raise CheckpointError(
            f"{op} on {tgt.where}: the checkpoint holds no optimizer state. Fix: load it without "
            "optimizer= (or save with optimizer=)"
        )
    saved.check_kind(
        tgt, optimizer_kind(optimizer), op, "", "build the optimizer it was saved with"
    )
    names = param_names(tgt, optimizer, op)
    if n_groups != len(names):
        raise CheckpointError(
            f"{op} on {tgt.where}: the checkpoint's optimizer has {n_groups} param groups, this "
            f"{type(optimizer).__name__} {len(names)}. Fix: build the optimizer with the same "
            "param groups"
        )
    # by position, as load_state_dict numbers them (a weight tied across a pipeline's stages:
    # two parameters, one name)
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    where: dict[str, list[int]] = {}
    for i, n in enumerate(n for group in names for n in group):
        where.setdefault(n, []).append(i)
    fix = "build the optimizer with the same param groups"
    groups, start = [], 0
    for i, group in enumerate(names):
        hps = saved.group(tgt, i, list(dict.fromkeys(group)), "optimizer", fix, op)
        groups.append({**hps, "params": list(range(start, start + len(group)))})
        start += len(group)
    state: dict[int, dict[str, Any]] = {}
    fix = "load the checkpoint of the same model and optimizer"
    for key, name, sub in saved.state_keys(tgt, where, "optimizer", fix, op):
        md = saved.stored[key]
        for i in where[name]:
            if isinstance(md, BytesStorageMetadata):
                state.setdefault(i, {})[sub] = saved.values[key]
                continue
            dest, layout, stacked = _state_dest(tgt, key, name, md, flat[i], entries, op)
            new = entry(key, dest, layout, tgt, stacked)
            if key in entries:  # the second copy of a tied weight: read into both
                merge(entries[key], new)
            else:
                entries[key] = new
            state.setdefault(i, {})[sub] = dest
    return groups, state


def _state_dest(
    tgt: Target, key: str, name: str, md: Any, p: Tensor, entries: dict[str, Entry], op: str
) -> tuple[Tensor, Layout, bool]:
    """A new tensor for saved optimizer state ``key`` of parameter ``p``: (tensor, its layout,
    stacked over simulated ranks)."""
    full = entries[f"model.{name}"].shape if f"model.{name}" in entries else None
    if tuple(md.size) == full:
        dest = torch.empty_like(p.detach(), dtype=md.properties.dtype)
        return dest, tgt.layouts.get(name, Layout()), tgt.simulated
    if len(md.size) == 0:
        return torch.empty((), dtype=md.properties.dtype), Layout(), False
    raise CheckpointError(
        f"{op} on {tgt.where}: optimizer state {key!r} has shape {tuple(md.size)} in the "
        f"checkpoint, neither its parameter's {full} nor a scalar. Fix: load the checkpoint of "
        "the same model and optimizer"
    )


# ============================================================================ ZeRO-1
# `ZeroOptimizer` holds each data rank's chunk of the flattened parameters (this rank's blocks,
# side by side, padded). A chunk's part of one parameter is a run of its block in row-major
# order: a few boxes of the block (`flat_boxes`), each then cut by the layout's boxes. On disk
# it is the plain optimizer's state (``optim.state.<name>.<key>``), so either loads the other.
def flat_boxes(a: int, b: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], ...]]:
    """Elements ``[a, b)`` (row-major) of a tensor of ``shape`` as boxes (offsets, sizes), each
    contiguous in that order.

    >>> flat_boxes(2, 9, (3, 4))    # the rest of row 0, then row 1, then row 2's first element
    [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 1))]
    """
    if a >= b:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = a // inner, (b - 1) // inner

    def within(row: int, lo: int, hi: int) -> list[tuple[tuple[int, ...], ...]]:
        return [((row, *o), (1, *n)) for o, n in flat_boxes(lo, hi, shape[1:])]

    if first == last:
        return within(first, a - first * inner, b - first * inner)
    full_lo, full_hi = -(-a // inner), b // inner  # whole rows
    out = within(first, a - first * inner, inner) if a < full_lo * inner else []
    if full_hi > full_lo:
        out.append(((full_lo, *[0] * (len(shape) - 1)), (full_hi - full_lo, *shape[1:])))
    return out + (within(last, 0, b - last * inner) if b > full_hi * inner else [])


def zero_entry(
    key: str, state: Tensor, p: Tensor, offset: int, layout: Layout, tgt: Target, z: Any
) -> Entry:
    """The boxes of parameter ``p``'s state that this process's chunk(s) of the flat ``state``
    hold (``p`` starts at ``offset`` of the flattened vector)."""
    mesh = cast(Mesh, tgt.mesh)
    local = tuple(p.shape[1:]) if tgt.simulated else tuple(p.shape)
    full = layout.full_shape(local, mesh)
    strides = [math.prod(local[d + 1 :]) for d in range(len(local))]
    state = state.detach()
    c = state.shape[-1]
    found: dict[tuple[tuple[int, ...], tuple[int, ...]], Box] = {}
    for r in range(mesh.size) if tgt.simulated else [mesh.rank]:
        i = mesh.index(r, z.axes)
        chunk = state[r] if tgt.simulated else state
        lo, hi = max(offset, i * c), min(offset + math.prod(local), (i + 1) * c)
        for offs, sizes in flat_boxes(lo - offset, hi - offset, local):
            start = offset + sum(o * st for o, st in zip(offs, strides)) - i * c
            piece = chunk[start : start + math.prod(sizes)].view(sizes)
            for glob, block in layout.boxes(full, mesh, r):
                part = clip_box(glob, block, piece, offs)
                if part is not None:
                    found.setdefault(part[:2], Box(part[0], part[1], [])).views.append(part[2])
    return Entry(key, full, state.dtype, list(found.values()))


def zero_groups(tgt: Target, z: Any, op: str) -> list[tuple[Tensor, list[tuple[str, Tensor, int]]]]:
    """Each flat shard of ``z`` with its parameters: (shard, [(name, parameter, offset)])."""
    if tgt.mesh is None or not all(hasattr(z, a) for a in ("flat_groups", "axes", "inner")):
        raise CheckpointError(
            f"{op} on {tgt.where}: this ZeroOptimizer is not laid out as fastdist.checkpoint "
            "expects (a mesh, its flat groups). Fix: build it as ZeroOptimizer(pm, ...) over the "
            "ParallelModel being saved"
        )
    names = {id(p): n for n, p in tgt.named_parameters()}
    out = []
    for plist, shard in z.flat_groups:
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


def zero_save(
    tgt: Target, z: Any, entries: dict[str, Entry], values: dict[str, Any], op: str
) -> None:
    """A ZeroOptimizer's groups and state, written as the plain optimizer's would be."""
    shards = zero_groups(tgt, z, op)
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
                    entries[key] = entry(key, v, Layout(), tgt, False)
                elif v.shape == shard.shape:
                    layout = tgt.layouts.get(name, Layout())
                    entries[key] = zero_entry(key, v, p, offset, layout, tgt, z)
                else:
                    raise CheckpointError(
                        f"{op} on {tgt.where}: ZeroOptimizer state {k!r} has shape "
                        f"{tuple(v.shape)}, neither the flat shard's {tuple(shard.shape)} nor a "
                        "scalar. Fix: use an elementwise optimizer (AdamW, Adam, SGD)"
                    )


def zero_plan(tgt: Target, z: Any, saved: Saved, entries: dict[str, Entry]) -> PlanResult:
    """Check a ZeroOptimizer against the checkpoint (a plain or a ZeRO optimizer's); add the
    entries that fill new flat state tensors; return what ``z.inner.load_state_dict`` takes."""
    op = "fastdist.checkpoint.load"
    shards = zero_groups(tgt, z, op)
    wrapped = " (wrapped by this ZeroOptimizer)"
    saved.check_kind(
        tgt, optimizer_kind(z.inner), op, wrapped, "wrap the optimizer it was saved with"
    )
    by_shard = {id(shard): [n for n, _, _ in params] for shard, params in shards}
    index = {id(shard): i for i, (shard, _) in enumerate(shards)}
    n_groups = saved.n_groups()
    if n_groups != len(z.inner.param_groups):
        raise CheckpointError(
            f"{op} on {tgt.where}: the checkpoint's optimizer has {n_groups} param groups, this "
            f"ZeroOptimizer {len(z.inner.param_groups)} (all its parameters in one). Fix: load "
            "a checkpoint of an optimizer over all the model's parameters in one group"
            + (" (it holds no optimizer state: load without optimizer=)" if not n_groups else "")
        )
    fix = "load the checkpoint of an optimizer over the same parameters"
    groups = []
    for i, group in enumerate(z.inner.param_groups):
        mine = [n for s in group["params"] for n in by_shard[id(s)]]
        hps = saved.group(tgt, i, mine, "ZeroOptimizer", fix, op)
        groups.append({**hps, "params": [index[id(s)] for s in group["params"]]})
    known = {n for names in by_shard.values() for n in names}
    subs: dict[str, set[str]] = {}
    fix = "load the checkpoint of the same model"
    for _, name, sub in saved.state_keys(tgt, known, "ZeroOptimizer", fix, op):
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
            md = saved.stored[first]
            if isinstance(md, BytesStorageMetadata) or len(md.size) == 0:
                _one_per_group(tgt, saved, [n for n, _, _ in params], sub, op)
            if isinstance(md, BytesStorageMetadata):
                st[sub] = saved.values[first]
            elif len(md.size) == 0:
                st[sub] = torch.zeros((), dtype=md.properties.dtype)
                entries[first] = entry(first, st[sub], Layout(), tgt, False)
            else:
                st[sub] = torch.zeros_like(shard.detach(), dtype=md.properties.dtype)
                for name, p, offset in params:
                    key = f"optim.state.{name}.{sub}"
                    layout = tgt.layouts.get(name, Layout())
                    entries[key] = zero_entry(key, st[sub], p, offset, layout, tgt, z)
                    size = tuple(saved.stored[key].size)
                    if size != entries[key].shape:
                        raise CheckpointError(
                            f"{op} on {tgt.where}: optimizer state {key!r} has shape {size} in "
                            f"the checkpoint, not its parameter's {entries[key].shape}. Fix: "
                            "load the checkpoint of the same model"
                        )
        if st:
            state[index[id(shard)]] = st
    return groups, state


def _one_per_group(tgt: Target, saved: Saved, names: list[str], sub: str, op: str) -> None:
    """Raise unless every parameter of a flat ZeRO group has the same saved scalar ``sub``
    (``step``): the ZeroOptimizer keeps one per group, and a plain optimizer steps a
    parameter only when it has a gradient, so its parameters' steps may differ."""
    keys = [f"optim.state.{n}.{sub}" for n in names]
    if len(keys) < 2:
        return
    if all(k in saved.values for k in keys):
        got: Mapping[str, Any] = saved.values
    elif saved.scalars is not None:
        got = saved.scalars(keys)
    else:
        return
    differ = [k for k in keys if not _same(got[k], got[keys[0]])]
    if differ:
        raise CheckpointError(
            f"{op} on {tgt.where}: the checkpoint's optimizer state {sub!r} differs between "
            f"parameters that this ZeroOptimizer updates as one flat group ({keys[0]!r}: "
            f"{_shown(got[keys[0]])}, {differ[0]!r}: {_shown(got[differ[0]])}): the plain "
            "optimizer that saved it skipped some parameters in some steps (no gradient), and "
            "a flat group keeps one value for all, so the next step would differ. Fix: resume with "
            "the optimizer it was saved with (torch.optim over pm.parameters())"
        )


def _same(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if isinstance(a, Tensor) and isinstance(b, Tensor) else bool(a == b)


def _shown(v: Any) -> Any:
    return v.item() if isinstance(v, Tensor) else v


# ============================================================================ entry points
def save_optimizer(
    tgt: Target,
    optimizer: torch.optim.Optimizer,
    entries: dict[str, Entry],
    values: dict[str, Any],
    op: str,
) -> str:
    """Add ``optimizer``'s state to ``entries`` (tensors) and ``values`` (the rest); returns
    the optimizer's kind for the header (a ZeRO optimizer: the wrapped one's)."""
    if isinstance(optimizer, ShardedOptimizer):
        _no_zero_pipeline(tgt, op)
        zero_save(tgt, optimizer, entries, values, op)
        return optimizer_kind(optimizer.inner)
    groups = param_names(tgt, optimizer, op)
    params = dict(tgt.named_parameters())
    for i, (group, names) in enumerate(zip(optimizer.param_groups, groups)):
        for hp, v in group.items():  # a weight tied across a pipeline's stages: named once
            values[f"optim.param_groups.{i}.{hp}"] = (
                list(dict.fromkeys(names)) if hp == "params" else v
            )
    for names in groups:
        for name in dict.fromkeys(names):
            for k, v in optimizer.state.get(params[name], {}).items():
                key = f"optim.state.{name}.{k}"
                if not isinstance(v, Tensor):
                    values[key] = v
                    continue
                layout, stacked = state_layout(tgt, name, key, v, params[name], op)
                entries[key] = entry(key, v, layout, tgt, stacked)
    return optimizer_kind(optimizer)


def plan_optimizer(
    tgt: Target, optimizer: torch.optim.Optimizer, saved: Saved, entries: dict[str, Entry]
) -> PlanResult:
    """Check ``optimizer`` against the checkpoint and add the entries its state is read into;
    returns (param groups, state) for `apply_optimizer_state` once they are read."""
    if isinstance(optimizer, ShardedOptimizer):
        _no_zero_pipeline(tgt, "fastdist.checkpoint.load")
        return zero_plan(tgt, optimizer, saved, entries)
    return optimizer_plan(tgt, optimizer, saved, entries)


def _no_zero_pipeline(tgt: Target, op: str) -> None:
    if tgt.pipeline is not None:
        raise CheckpointError(
            f"{op} on {tgt.where}: a ZeRO optimizer over a pipeline's stages is not supported "
            "(its flat shards are laid out per ParallelModel). Fix: a torch optimizer over "
            "pipe.parameters()"
        )


def apply_optimizer_state(
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]],
    state: dict[int, dict[str, Any]],
) -> None:
    """Hand the read state to the optimizer (a ZeRO optimizer: to the one it wraps)."""
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.inner.load_state_dict({"state": state, "param_groups": groups})
        # the wrapper shows the wrapped optimizer's (now new) groups and state
        optimizer.param_groups, optimizer.state = (
            optimizer.inner.param_groups,
            optimizer.inner.state,
        )
        return
    optimizer.load_state_dict({"state": state, "param_groups": groups})
