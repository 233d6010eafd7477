"""Independent references for the collectives, on stacked ``[world, ...]`` tensors.

Written as explicit loops over ``mesh.groups(axis)`` with plain torch ops on each
member's tensor, so they share nothing with the reshape/permute code under test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from hypothesis import strategies as st
from torch import Tensor

import fastdist as fd


def per_group(
    xs: Tensor, mesh: fd.Mesh, axis: fd.AxisName, fn: Callable[[list[Tensor]], Sequence[Tensor]]
) -> Tensor:
    """Apply ``fn(members) -> outputs`` to every group along ``axis``; restack by rank."""
    out: list[Tensor | None] = [None] * mesh.size
    for group in mesh.groups(axis):
        for rank, y in zip(group, fn([xs[r] for r in group])):
            out[rank] = y
    return torch.stack(out)  # type: ignore[arg-type]


def ref(op: str, xs: Tensor, mesh: fd.Mesh, axis: fd.AxisName, **kw) -> Tensor:
    """What ``simulate(lambda x: fd.<op>(x, mesh, axis, **kw), mesh)(xs)`` must return."""

    def f(m: list[Tensor]) -> Sequence[Tensor]:
        n = len(m)
        if op in ("psum", "pmean", "pmax", "pmin"):
            red = {
                "psum": lambda t: t.sum(0).to(t.dtype),
                "pmean": lambda t: t.mean(0),
                "pmax": lambda t: t.amax(0),
                "pmin": lambda t: t.amin(0),
            }[op]
            return [red(torch.stack(m))] * n
        if op == "pvary":
            return m
        if op == "all_gather":
            return [
                torch.cat(m, kw["dim"]) if kw.get("tiled", True) else torch.stack(m, kw["dim"])
            ] * n
        if op == "psum_scatter":
            total = torch.stack(m).sum(0).to(m[0].dtype)
            if kw.get("tiled", True):
                return list(total.chunk(n, kw["dim"]))
            return list(total.unbind(kw["dim"]))
        if op == "all_to_all":
            s, c = kw["split_dim"], kw["concat_dim"]
            return [torch.cat([mi.chunk(n, s)[j] for mi in m], c) for j in range(n)]
        if op == "ppermute":
            out = [mi * 0 for mi in m]  # zeros, still connected to the graph
            for src, dst in kw["perm"]:
                out[dst] = m[src]
            return out
        if op == "broadcast":
            return [m[kw["src"]]] * n
        raise KeyError(op)

    return per_group(xs, mesh, axis, f)


# ----------------------------------------------------------------------------- strategies
@st.composite
def meshes(draw, max_size: int = 16, max_axes: int = 3) -> fd.Mesh:
    """Meshes of 1-3 axes with at most ``max_size`` ranks."""
    k = draw(st.integers(1, max_axes))
    names = ["a", "b", "c"][:k]
    sizes: list[int] = []
    for _ in names:
        budget = max_size // max(1, int(torch.tensor(sizes).prod().item()) if sizes else 1)
        sizes.append(draw(st.integers(1, max(1, min(4, budget)))))
    return fd.Mesh(dict(zip(names, sizes)))


@st.composite
def axes_of(draw, mesh: fd.Mesh) -> fd.AxisName:
    """A single axis name, or a tuple of distinct names in any order."""
    names = list(mesh.axis_names)
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    return chosen[0] if len(chosen) == 1 and draw(st.booleans()) else tuple(chosen)
