"""How a global tensor is split over a mesh: ``PartitionSpec`` and the block arithmetic.

One place computes which block of a global tensor a rank holds (:func:`block_of`); ``spmd``,
``fastdist.nn`` (state dicts, layouts), ``fastdist.testing`` and the sharding pictures of
``fastdist.tools.visual`` all use it, so they cannot disagree.

>>> import torch, fastdist as fd
>>> mesh = fd.Mesh({"dp": 2, "tp": 2})
>>> block_of(torch.arange(16).reshape(4, 4), P("dp", "tp"), mesh, rank=1)
tensor([[2, 3],
        [6, 7]])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fastdist.errors import MeshError

if TYPE_CHECKING:
    from fastdist.core.mesh import Mesh

__all__ = ["PartitionSpec", "P", "block_of", "check_spec", "holders", "blocks"]


class PartitionSpec:
    """How a global tensor splits over mesh axes: one entry per leading dim.

    ``PartitionSpec("dp", None)``: dim 0 split over ``dp``, dim 1 whole. A tuple entry
    ``("dp", "tp")`` splits one dim over both axes (row-major, ``dp`` major). Axes not
    named are replicated. ``partial=("tp",)`` (out_specs only) says the per-rank values
    are addends: the global value is their sum over ``tp``.

    Args:
        *dims: one entry per leading dim: an axis name, a tuple of names (the dim split over all of
            them, row-major) or ``None`` (whole).
        partial: out_specs only: the axes over which the per-rank values are addends of the global
            value.

    >>> PartitionSpec(("dp", "tp"), None)
    P(('dp', 'tp'), None)
    """

    def __init__(
        self, *dims: None | str | tuple[str, ...], partial: str | Sequence[str] = ()
    ) -> None:
        for d in dims:
            if not (
                d is None
                or isinstance(d, str)
                or (isinstance(d, tuple) and d and all(isinstance(a, str) for a in d))
            ):
                raise MeshError(
                    "PartitionSpec: each entry is None, an axis name or a tuple of names, got "
                    f"{d!r}. Fix: e.g. P('dp', None) or P(('dp', 'tp'))"
                )
        self.dims = tuple(dims)
        self.partial = (partial,) if isinstance(partial, str) else tuple(partial)

    def axes_of(self, i: int) -> tuple[str, ...]:
        d = self.dims[i] if i < len(self.dims) else None
        return () if d is None else (d,) if isinstance(d, str) else d

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(a for i in range(len(self.dims)) for a in self.axes_of(i))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PartitionSpec) and (self.dims, self.partial) == (
            other.dims,
            other.partial,
        )

    def __hash__(self) -> int:
        return hash((self.dims, self.partial))

    def __repr__(self) -> str:
        inner = ", ".join(repr(d) for d in self.dims)
        if self.partial:
            inner += f"{', ' if inner else ''}partial={self.partial!r}"
        return f"P({inner})"


P = PartitionSpec


def block_of(x: Tensor, spec: PartitionSpec, mesh: Mesh, rank: int) -> Tensor:
    """The block of global ``x`` that ``rank`` holds under ``spec`` (a view; replicated axes: the
    whole dim)."""
    for d in range(len(spec.dims)):
        names = spec.axes_of(d)
        if names:
            n, i = mesh.axis_size(names), mesh.index(rank, names)
            if x.shape[d] % n:
                raise MeshError(
                    f"PartitionSpec: {spec!r} splits dim {d} (size {x.shape[d]}) over {names} ({n} "
                    f"ranks), which does not divide it. Fix: pad dim {d} to a multiple of {n}"
                )
            x = x.narrow(d, i * (x.shape[d] // n), x.shape[d] // n)
    return x


def check_spec(where: str, mesh: Mesh, spec: Any, t: Tensor | None) -> PartitionSpec:
    if not isinstance(spec, PartitionSpec):
        raise MeshError(
            f"spmd: {where} must be a fastdist.P(...), got {spec!r}. Fix: e.g. P('dp') (dim 0 "
            "split over 'dp'), P() (replicated)"
            + (", or None for an argument that is not a tensor" if where.startswith("in") else "")
        )
    seen = list(spec.sharded_axes) + list(spec.partial)
    for a in seen:
        mesh.axis_indices(a, f"spmd {where}")
    if len(set(seen)) != len(seen):
        raise MeshError(
            f"spmd: {where} {spec!r} uses a mesh axis twice. "
            "Fix: name each axis at most once per spec"
        )
    if t is not None:
        if len(spec.dims) > t.dim():
            raise MeshError(
                f"spmd: {where} {spec!r} has {len(spec.dims)} entries but the tensor is "
                f"{t.dim()}-d {tuple(t.shape)}. Fix: give at most {t.dim()} "
                f"entr{'y' if t.dim() == 1 else 'ies'}, one per leading dim of the tensor (dims "
                "left out are replicated)"
            )
        for i in range(len(spec.dims)):
            n = mesh.axis_size(spec.axes_of(i)) if spec.axes_of(i) else 1
            if t.shape[i] % n:
                raise MeshError(
                    f"spmd: {where} {spec!r} splits dim {i} (size {t.shape[i]}) over "
                    f"{spec.axes_of(i)} ({n} ranks), which does not divide it. "
                    f"Fix: pad dim {i} to a multiple of {n}"
                )
    return spec


def holders(spec: PartitionSpec, mesh: Mesh) -> list[int]:
    """One rank per block of ``spec``: the ranks at coordinate 0 on every axis the spec does not
    shard."""
    unsharded = [a for a in mesh.axis_names if a not in spec.sharded_axes]
    return [r for r in range(mesh.size) if all(mesh.index(r, a) == 0 for a in unsharded)]


def blocks(x: Tensor, spec: PartitionSpec, mesh: Mesh) -> Tensor:
    """``[world, *local]``: every rank's block of global ``x`` under ``spec``, stacked (one
    copy)."""
    return torch.stack([block_of(x, spec, mesh, r) for r in range(mesh.size)])
