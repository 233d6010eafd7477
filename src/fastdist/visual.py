"""Pictures of meshes, groups and shardings: HTML in Jupyter (``_repr_html_``), text tables elsewhere.

>>> import fastdist as fd
>>> print(fd.Mesh({"dp": 2, "tp": 4}).show("tp"))
Mesh({'dp': 2, 'tp': 4}): 8 ranks; groups along 'tp' are lettered
        tp=0  tp=1  tp=2  tp=3
  dp=0   0 A   1 A   2 A   3 A
  dp=1   4 B   5 B   6 B   7 B
"""

from __future__ import annotations

import html
import string
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .mesh import AxisName, Mesh

__all__ = ["MeshView", "ShardingView", "RanksView", "show_sharding", "show_ranks", "plot_ranks"]

_COLOURS = ["#cfe8fc", "#fde2c8", "#d5f5d5", "#f9d0e0", "#e6dcfa", "#fff3b0", "#d0f0f0", "#f0d8c0"]


def _label(i: int) -> str:
    letters = string.ascii_uppercase
    return letters[i] if i < 26 else letters[i // 26 - 1] + letters[i % 26]


def _grid(mesh: Mesh) -> tuple[list[str], list[tuple[str, list[int]]]]:
    """Column headers (the last axis) and rows (every combination of the other axes)."""
    last = mesh.axis_names[-1] if mesh.ndim else ""
    cols = [f"{last}={i}" for i in range(mesh.shape[last])] if mesh.ndim else ["rank"]
    width = len(cols)
    rows = []
    for start in range(0, mesh.size, width):
        c = mesh.coords(start)
        label = " ".join(f"{a}={c[a]}" for a in mesh.axis_names[:-1])
        rows.append((label, list(range(start, start + width))))
    return cols, rows


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(v).rjust(w) for v, w in zip(r, widths)) for r in [header, *rows]]
    return "\n".join(line.rstrip() for line in lines)


class MeshView:
    """A mesh's rank grid (last axis as columns); with ``axis``, the groups along it lettered and coloured."""

    def __init__(self, mesh: Mesh, axis: AxisName | None = None) -> None:
        self.mesh, self.axis = mesh, axis
        self._group_of: dict[int, int] = {}
        if axis is not None:
            self._group_of = {r: g for g, ranks in enumerate(mesh.groups(axis)) for r in ranks}

    def _title(self) -> str:
        t = f"{self.mesh!r}: {self.mesh.size} ranks"
        return t + (f"; groups along {self.axis!r} are lettered" if self.axis is not None else "")

    def __str__(self) -> str:
        cols, rows = _grid(self.mesh)
        cell = (lambda r: f"{r} {_label(self._group_of[r])}") if self._group_of else str
        body = [[label, *(cell(r) for r in ranks)] for label, ranks in rows]
        return self._title() + "\n" + "\n".join("  " + line for line in _table(["", *cols], body).splitlines())

    __repr__ = __str__

    def _repr_html_(self) -> str:
        cols, rows = _grid(self.mesh)
        out = [f"<div><b>{html.escape(self._title())}</b><table style='border-collapse:collapse;font-family:monospace'>"]
        out.append("<tr><th></th>" + "".join(f"<th style='padding:2px 8px'>{html.escape(c)}</th>" for c in cols) + "</tr>")
        for label, ranks in rows:
            out.append(f"<tr><th style='padding:2px 8px;text-align:right'>{html.escape(label)}</th>")
            for r in ranks:
                g = self._group_of.get(r)
                style = "border:1px solid #999;padding:4px 10px;text-align:center"
                if g is not None:
                    style += f";background:{_COLOURS[g % len(_COLOURS)]}"
                text = f"{r}" + (f"<sub>{_label(g)}</sub>" if g is not None else "")
                out.append(f"<td style='{style}'>{text}</td>")
            out.append("</tr>")
        out.append("</table></div>")
        return "".join(out)


class ShardingView:
    """Which block of a global tensor each rank holds under a ``PartitionSpec``."""

    def __init__(self, shape: Sequence[int], spec: Any, mesh: Mesh) -> None:
        self.shape, self.spec, self.mesh = tuple(shape), spec, mesh

    def rows(self) -> list[tuple[int, str, str, tuple[int, ...]]]:
        out = []
        for r in range(self.mesh.size):
            slices, local = [], []
            for d, size in enumerate(self.shape):
                names = self.spec.axes_of(d) if d < len(self.spec.dims) else ()
                if names:
                    n, i = self.mesh.axis_size(names), self.mesh.index(r, names)
                    step = size // n
                    slices.append(f"{i * step}:{(i + 1) * step}")
                    local.append(step)
                else:
                    slices.append(":")
                    local.append(size)
            coords = " ".join(f"{a}={v}" for a, v in self.mesh.coords(r).items())
            out.append((r, coords, "[" + ", ".join(slices) + "]", tuple(local)))
        return out

    def __str__(self) -> str:
        head = f"global {list(self.shape)} as {self.spec!r} on {self.mesh!r}"
        body = [[str(r), c, s, str(list(loc))] for r, c, s, loc in self.rows()]
        return head + "\n" + _table(["rank", "coords", "block", "local shape"], body)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{r}</td><td>{html.escape(c)}</td><td>{html.escape(s)}</td><td>{list(loc)}</td></tr>" for r, c, s, loc in self.rows()
        )
        head = html.escape(f"global {list(self.shape)} as {self.spec!r} on {self.mesh!r}")
        return f"<div><b>{head}</b><table><tr><th>rank</th><th>coords</th><th>block</th><th>local shape</th></tr>{rows}</table></div>"


def show_sharding(x: Tensor | Sequence[int], spec: Any, mesh: Mesh) -> ShardingView:
    """How ``x`` (a tensor or a shape) splits over ``mesh`` under ``spec``: each rank's block.

    >>> import fastdist as fd
    >>> print(fd.show_sharding((4, 6), fd.P("dp", "tp"), fd.Mesh({"dp": 2, "tp": 2})))
    global [4, 6] as P('dp', 'tp') on Mesh({'dp': 2, 'tp': 2})
    rank     coords       block  local shape
       0  dp=0 tp=0  [0:2, 0:3]       [2, 3]
       1  dp=0 tp=1  [0:2, 3:6]       [2, 3]
       2  dp=1 tp=0  [2:4, 0:3]       [2, 3]
       3  dp=1 tp=1  [2:4, 3:6]       [2, 3]
    """
    shape = tuple(x.shape) if isinstance(x, Tensor) else tuple(x)
    return ShardingView(shape, spec, mesh)


class RanksView:
    """Per-rank values of a stacked ``[world, ...]`` tensor side by side, labelled with coordinates."""

    def __init__(self, x: Tensor, mesh: Mesh, precision: int = 3) -> None:
        if x.dim() == 0 or x.shape[0] != mesh.size:
            raise ValueError(f"show_ranks: expected a leading rank dimension of {mesh.size}, got shape {tuple(x.shape)}")
        self.x, self.mesh, self.precision = x.detach(), mesh, precision

    def _fmt(self, t: Tensor) -> str:
        if t.is_floating_point():
            vals = [round(v, self.precision) for v in t.double().flatten().tolist()]
        else:
            vals = t.flatten().tolist()
        text = str(vals if t.dim() else vals[0])
        return text if len(text) <= 60 else text[:57] + "..."

    def __str__(self) -> str:
        body = [[str(r), " ".join(f"{a}={v}" for a, v in self.mesh.coords(r).items()), self._fmt(self.x[r])] for r in range(self.mesh.size)]
        return _table(["rank", "coords", f"value {list(self.x.shape[1:])}"], body)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{r}</td><td>{html.escape(' '.join(f'{a}={v}' for a, v in self.mesh.coords(r).items()))}</td><td><code>{html.escape(self._fmt(self.x[r]))}</code></td></tr>"
            for r in range(self.mesh.size)
        )
        return f"<table><tr><th>rank</th><th>coords</th><th>value {list(self.x.shape[1:])}</th></tr>{rows}</table>"


def show_ranks(x: Tensor, mesh: Mesh, precision: int = 3) -> RanksView:
    """Each rank's slice of a stacked ``[world, ...]`` tensor (what :func:`fastdist.simulate` returns).

    >>> import torch, fastdist as fd
    >>> print(fd.show_ranks(torch.tensor([1.0, 2.0]), fd.Mesh({"tp": 2})))
    rank  coords  value []
       0    tp=0       1.0
       1    tp=1       2.0
    """
    return RanksView(x, mesh, precision)



def plot_ranks(x: Tensor, mesh: Mesh, axis: AxisName | None = None, *, ax: Any = None, title: str | None = None) -> Any:
    """Plot each rank's slice of a stacked ``[world, ...]`` tensor (needs matplotlib).

    A scalar per rank is a bar per rank; a vector per rank is a line per rank. With ``axis``,
    ranks in the same group along it share a colour. Returns the matplotlib ``Axes``.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("fastdist.plot_ranks needs matplotlib. Fix: pip install matplotlib") from e
    values = RanksView(x, mesh).x.double().reshape(mesh.size, -1)
    group_of = {r: g for g, ranks in enumerate(mesh.groups(axis)) for r in ranks} if axis is not None else {r: r for r in range(mesh.size)}
    cmap = plt.get_cmap("tab10")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    labels = [" ".join(f"{a}={v}" for a, v in mesh.coords(r).items()) for r in range(mesh.size)]
    if values.shape[1] == 1:
        ax.bar(range(mesh.size), values[:, 0].tolist(), color=[cmap(group_of[r] % 10) for r in range(mesh.size)])
        ax.set_xticks(range(mesh.size), [f"{r}\n{labels[r]}" for r in range(mesh.size)], fontsize=7)
        ax.set_xlabel("rank")
    else:
        for r in range(mesh.size):
            ax.plot(values[r].tolist(), color=cmap(group_of[r] % 10), label=f"rank {r} ({labels[r]})", marker="o", markersize=3)
        ax.set_xlabel("element")
        ax.legend(fontsize=7, ncol=2)
    ax.set_ylabel("value")
    ax.set_title(title or (f"per-rank values on {mesh!r}" + (f", coloured by group along {axis!r}" if axis is not None else "")), fontsize=9)
    return ax
