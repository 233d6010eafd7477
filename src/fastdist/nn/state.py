"""Moving weights between the single-device view and per-rank shards."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ..checking import P, PartitionSpec, block_of
from ..errors import MeshError
from ..mesh import Mesh

__all__ = ["param_specs", "shard_state", "stack_state", "unstack", "load_sharded"]


def param_specs(module: nn.Module) -> dict[str, PartitionSpec]:
    """``PartitionSpec`` of every parameter of ``module`` by dotted name (replicated unless a submodule says otherwise)."""
    specs: dict[str, PartitionSpec] = {name: P() for name, _ in module.named_parameters()}
    for prefix, sub in module.named_modules():
        own = getattr(sub, "param_specs", None)
        if callable(own):
            for name, spec in own().items():
                specs[f"{prefix}.{name}" if prefix else name] = spec
    return specs


def shard_state(full: Mapping[str, Tensor], specs: Mapping[str, PartitionSpec], mesh: Mesh, rank: int) -> dict[str, Tensor]:
    """Rank ``rank``'s shard of every tensor of a single-device state dict."""
    missing = set(specs) - set(full)
    if missing:
        raise MeshError(f"fastdist.nn: the state dict lacks {sorted(missing)}. Fix: load a state dict of the matching single-device module")
    return {name: block_of(full[name], spec, mesh, rank).clone() for name, spec in specs.items()}


def stack_state(full: Mapping[str, Tensor], specs: Mapping[str, PartitionSpec], mesh: Mesh) -> dict[str, Tensor]:
    """Every rank's shard stacked on a leading rank dim ``[world, *local]``, for :func:`fastdist.simulate`."""
    per_rank = [shard_state(full, specs, mesh, r) for r in range(mesh.size)]
    return {name: torch.stack([p[name] for p in per_rank]) for name in specs}


def unstack(stacked: Tensor, spec: PartitionSpec, mesh: Mesh) -> Tensor:
    """The single-device tensor from stacked shards (inverse of :func:`stack_state` for one tensor).

    Shards are joined along their dims; over axes the spec does not name, the copy at index 0 is used.
    """
    rank_of: dict[tuple[int, ...], int] = {}
    for r in range(mesh.size):
        key = tuple(mesh.index(r, spec.axes_of(d)) if spec.axes_of(d) else 0 for d in range(len(spec.dims)))
        rank_of.setdefault(key, r)

    def join(d: int, prefix: tuple[int, ...]) -> Tensor:
        if d == len(spec.dims):
            return stacked[rank_of[prefix]]
        n = mesh.axis_size(spec.axes_of(d)) if spec.axes_of(d) else 1
        return torch.cat([join(d + 1, (*prefix, i)) for i in range(n)], dim=d)

    return join(0, ())


def load_sharded(module: nn.Module, full: Mapping[str, Tensor], mesh: Mesh) -> None:
    """Copy this process's shard of a single-device state dict into ``module`` (a mesh from ``Mesh.from_torch``)."""
    local = shard_state(full, param_specs(module), mesh, mesh.rank)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(local[name])
