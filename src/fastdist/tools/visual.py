"""Pictures of meshes, groups and shardings: HTML in Jupyter (``_repr_html_``), text tables
elsewhere.

>>> import fastdist as fd
>>> print(fd.Mesh({"dp": 2, "tp": 4}).show("tp"))
Mesh({'dp': 2, 'tp': 4}): 8 ranks; groups along 'tp' are lettered
        tp=0  tp=1  tp=2  tp=3
  dp=0   0 A   1 A   2 A   3 A
  dp=1   4 B   5 B   6 B   7 B
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fastdist.core.mesh_view import COLOURS, MeshView, text_table
from fastdist.core.sharding import block_of
from fastdist.errors import MeshError

if TYPE_CHECKING:
    from fastdist.core.mesh import AxisName, Mesh

__all__ = ["MeshView", "RanksView", "ShardingView", "plot_ranks", "show_ranks", "show_sharding"]


def _coords_text(mesh: Mesh, rank: int) -> str:
    """``rank``'s coordinates as ``"dp=0 tp=1"``."""
    return " ".join(f"{a}={v}" for a, v in mesh.coords(rank).items())


class ShardingView:
    """Which block of a global tensor each rank holds under a ``PartitionSpec``.

    The blocks come from :func:`fastdist.core.sharding.block_of`, the one block function that
    ``spmd``, ``fastdist.nn`` and ``fastdist.testing`` use, so a spec they refuse (a dim that
    the axes' sizes do not divide, an unknown axis) raises :class:`~fastdist.MeshError` here too.
    For 1-D and 2-D shapes ``str()`` starts with a picture: one box per block, naming the
    ranks that hold it (like JAX's ``visualize_array_sharding``).
    """

    def __init__(self, shape: Sequence[int], spec: Any, mesh: Mesh) -> None:
        self.shape, self.spec, self.mesh = tuple(int(s) for s in shape), spec, mesh
        if len(getattr(spec, "dims", ())) > len(self.shape):
            raise MeshError(
                f"show_sharding: {spec!r} has {len(spec.dims)} entries but the shape "
                f"{list(self.shape)} has {len(self.shape)} dims. "
                "Fix: one entry per leading dim at most"
            )
        self._ranges = [self._block(r) for r in range(mesh.size)]  # raises what spmd raises

    def _block(self, rank: int) -> list[tuple[int, int]]:
        """[start, stop) per dim of ``rank``'s block, read off block_of on an index probe per dim
        (no memory)."""
        out = []
        for d, size in enumerate(self.shape):
            probe = (
                torch.arange(size)
                .reshape([size if i == d else 1 for i in range(len(self.shape))])
                .expand(self.shape)
            )
            blk = block_of(probe, self.spec, self.mesh, rank)
            out.append((int(blk.min()), int(blk.max()) + 1) if blk.numel() else (0, blk.shape[d]))
        return out

    def rows(self) -> list[tuple[int, str, str, tuple[int, ...]]]:
        """(rank, coordinates, block as ``[a:b, ...]`` (``:`` for a whole dim), local shape) per
        rank."""
        out = []
        for r, ranges in enumerate(self._ranges):
            slices = [
                ":" if (lo, hi) == (0, size) else f"{lo}:{hi}"
                for (lo, hi), size in zip(ranges, self.shape)
            ]
            coords = _coords_text(self.mesh, r)
            out.append(
                (r, coords, "[" + ", ".join(slices) + "]", tuple(hi - lo for lo, hi in ranges))
            )
        return out

    def blocks(self) -> dict[tuple[tuple[int, int], ...], list[int]]:
        """Each distinct block (its [start, stop) per dim) and the ranks holding it, in block
        order."""
        held: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for r, ranges in enumerate(self._ranges):
            held.setdefault(tuple(ranges), []).append(r)
        return dict(sorted(held.items()))

    def _cells(
        self,
    ) -> (
        tuple[list[tuple[int, int]], list[tuple[int, int]], dict[tuple[int, int], list[int]]] | None
    ):
        """For a 1-D/2-D shape: row ranges, column ranges and the ranks of each (row, column)
        block."""
        if len(self.shape) not in (1, 2) or 0 in self.shape:
            return None
        blocks = {
            ((k[0], k[1]) if len(k) > 1 else ((0, self.shape[0]), k[0])): v
            for k, v in self.blocks().items()
        }  # 1-D: one row
        rows, cols = sorted({k[0] for k in blocks}), sorted({k[1] for k in blocks})
        return (
            rows,
            cols,
            {(i, j): blocks[(rr, cc)] for i, rr in enumerate(rows) for j, cc in enumerate(cols)},
        )

    def picture(self) -> str:
        """Box-drawing picture of the blocks (1-D and 2-D shapes; empty string otherwise)."""
        cells = self._cells()
        if cells is None:
            return ""
        rows, cols, ranks = cells
        text = {
            k: "rank " + ",".join(map(str, v)) if len(v) == 1 else "ranks " + ",".join(map(str, v))
            for k, v in ranks.items()
        }
        w = max(len(t) for t in text.values()) + 2
        two_d = len(self.shape) == 2

        def label(lo: int, hi: int) -> str:
            return f"{lo}:{hi}" if two_d else ""  # a 1-D shape is one row, unlabelled

        lw = max(len(label(lo, hi)) for lo, hi in rows)

        def edge(left: str, mid: str, right: str) -> str:
            return " " * (lw + 1) + left + mid.join("─" * w for _ in cols) + right

        lines = [
            " " * (lw + 1) + " " + " ".join(f"{lo}:{hi}".center(w) for lo, hi in cols),
            edge("┌", "┬", "┐"),
        ]
        for i, (lo, hi) in enumerate(rows):
            lines.append(
                label(lo, hi).rjust(lw)
                + " │"
                + "│".join(text[(i, j)].center(w) for j in range(len(cols)))
                + "│"
            )
            lines.append(edge("├", "┼", "┤") if i < len(rows) - 1 else edge("└", "┴", "┘"))
        return "\n".join(line.rstrip() for line in lines)

    def _title(self) -> str:
        return f"global {list(self.shape)} as {self.spec!r} on {self.mesh!r}"

    def __str__(self) -> str:
        body = [[str(r), c, s, str(list(loc))] for r, c, s, loc in self.rows()]
        pic = self.picture()
        return (
            self._title()
            + "\n"
            + (pic + "\n" if pic else "")
            + text_table(["rank", "coords", "block", "local shape"], body)
        )

    __repr__ = __str__

    def _repr_html_(self) -> str:
        out = [f"<div><b>{html.escape(self._title())}</b>"]
        cells = self._cells()
        if cells is not None:  # the picture: one coloured box per block
            rows, cols, ranks = cells
            out.append(
                "<table style='border-collapse:collapse;font-family:monospace;margin:6px 0'>"
            )
            out.append(
                "<tr><th></th>"
                + "".join(f"<th style='padding:2px 8px'>{lo}:{hi}</th>" for lo, hi in cols)
                + "</tr>"
            )
            for i, (lo, hi) in enumerate(rows):
                out.append(
                    "<tr><th style='padding:2px 8px;text-align:right'>"
                    f"{f'{lo}:{hi}' if len(self.shape) == 2 else ''}</th>"
                )
                for j in range(len(cols)):
                    held = ranks[(i, j)]
                    colour = COLOURS[(i * len(cols) + j) % len(COLOURS)]
                    out.append(
                        "<td style='border:1px solid #999;padding:8px 14px;text-align:center;"
                        f"background:{colour}'>{','.join(map(str, held))}</td>"
                    )
                out.append("</tr>")
            out.append("</table>")
        table = "".join(
            f"<tr><td>{r}</td><td>{html.escape(c)}</td><td>{html.escape(s)}</td>"
            f"<td>{list(loc)}</td></tr>"
            for r, c, s, loc in self.rows()
        )
        out.append(
            "<table><tr><th>rank</th><th>coords</th><th>block</th><th>local shape</th></tr>"
            f"{table}</table></div>"
        )
        return "".join(out)


def show_sharding(x: Tensor | Sequence[int], spec: Any, mesh: Mesh) -> ShardingView:
    """How ``x`` (a tensor or a shape) splits over ``mesh`` under ``spec``: each rank's block.

    Raises :class:`~fastdist.MeshError` for a spec ``spmd`` would refuse (a dim its axes'
    sizes do not divide, an unknown axis, more entries than dims).

    Args:
        x: the global tensor, or its shape.
        spec: a ``PartitionSpec`` (``fd.P("dp", "tp")``): the mesh axes each dim is split over.
        mesh: the mesh whose ranks hold the blocks.

    Returns:
        a display that prints as the box picture and per-rank table below (and as a coloured table
        in Jupyter).

    >>> import fastdist as fd
    >>> print(fd.show_sharding((4, 6), fd.P("dp", "tp"), fd.Mesh({"dp": 2, "tp": 2})))
    global [4, 6] as P('dp', 'tp') on Mesh({'dp': 2, 'tp': 2})
           0:3      3:6
        ┌────────┬────────┐
    0:2 │ rank 0 │ rank 1 │
        ├────────┼────────┤
    2:4 │ rank 2 │ rank 3 │
        └────────┴────────┘
    rank     coords       block  local shape
       0  dp=0 tp=0  [0:2, 0:3]       [2, 3]
       1  dp=0 tp=1  [0:2, 3:6]       [2, 3]
       2  dp=1 tp=0  [2:4, 0:3]       [2, 3]
       3  dp=1 tp=1  [2:4, 3:6]       [2, 3]
    """
    shape = tuple(x.shape) if isinstance(x, Tensor) else tuple(x)
    return ShardingView(shape, spec, mesh)


class RanksView:
    """Per-rank values of a stacked ``[world, ...]`` tensor side by side, labelled with
    coordinates."""

    def __init__(self, x: Tensor, mesh: Mesh, precision: int = 3) -> None:
        if x.dim() == 0 or x.shape[0] != mesh.size:
            raise ValueError(
                f"show_ranks: expected a leading rank dimension of {mesh.size}, got shape "
                f"{tuple(x.shape)}"
            )
        self.x, self.mesh, self.precision = x.detach(), mesh, precision

    def _fmt(self, t: Tensor) -> str:
        if t.is_floating_point():
            vals = [round(v, self.precision) for v in t.double().flatten().tolist()]
        else:
            vals = t.flatten().tolist()
        text = str(vals if t.dim() else vals[0])
        return text if len(text) <= 60 else text[:57] + "..."

    def __str__(self) -> str:
        body = [
            [str(r), _coords_text(self.mesh, r), self._fmt(self.x[r])]
            for r in range(self.mesh.size)
        ]
        return text_table(["rank", "coords", f"value {list(self.x.shape[1:])}"], body)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{r}</td><td>{html.escape(_coords_text(self.mesh, r))}</td>"
            f"<td><code>{html.escape(self._fmt(self.x[r]))}</code></td></tr>"
            for r in range(self.mesh.size)
        )
        return (
            "<table><tr><th>rank</th><th>coords</th>"
            f"<th>value {list(self.x.shape[1:])}</th></tr>{rows}</table>"
        )


def show_ranks(x: Tensor, mesh: Mesh, precision: int = 3) -> RanksView:
    """Each rank's slice of a stacked ``[world, ...]`` tensor (what :func:`fastdist.simulate`
    returns).

    Args:
        x: a stacked ``[world, ...]`` tensor, slice ``r`` being rank ``r``'s value.
        mesh: the mesh whose ranks the slices belong to (``x.shape[0] == mesh.size``).
        precision: the decimal places values are rounded to.

    Returns:
        a display that prints one line per rank (a table in Jupyter).

    >>> import torch, fastdist as fd
    >>> print(fd.show_ranks(torch.tensor([1.0, 2.0]), fd.Mesh({"tp": 2})))
    rank  coords  value []
       0    tp=0       1.0
       1    tp=1       2.0
    """
    return RanksView(x, mesh, precision)


def plot_ranks(
    x: Tensor, mesh: Mesh, axis: AxisName | None = None, *, ax: Any = None, title: str | None = None
) -> Any:
    """Plot each rank's slice of a stacked ``[world, ...]`` tensor (needs matplotlib).

    A scalar per rank is a bar per rank; a vector per rank is a line per rank. With ``axis``,
    ranks in the same group along it share a colour. Returns the matplotlib ``Axes``.

    Args:
        x: a stacked ``[world, ...]`` tensor, slice ``r`` being rank ``r``'s value (flattened: one
            value per rank draws bars, more draw lines).
        mesh: the mesh whose ranks the slices belong to.
        axis: colour the ranks by their group along this axis; default: one colour per rank.
        ax: the matplotlib ``Axes`` to draw on; default: a new figure.
        title: the plot's title; default: ``per-rank values on <mesh>`` (and the axis).

    Returns:
        the matplotlib ``Axes`` drawn on.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "fastdist.plot_ranks needs matplotlib. Fix: pip install matplotlib"
        ) from e
    values = RanksView(x, mesh).x.double().reshape(mesh.size, -1)
    group_of = (
        {r: g for g, ranks in enumerate(mesh.groups(axis)) for r in ranks}
        if axis is not None
        else {r: r for r in range(mesh.size)}
    )
    cmap = plt.get_cmap("tab10")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    labels = [_coords_text(mesh, r) for r in range(mesh.size)]
    if values.shape[1] == 1:
        ax.bar(
            range(mesh.size),
            values[:, 0].tolist(),
            color=[cmap(group_of[r] % 10) for r in range(mesh.size)],
        )
        ax.set_xticks(range(mesh.size), [f"{r}\n{labels[r]}" for r in range(mesh.size)], fontsize=7)
        ax.set_xlabel("rank")
    else:
        for r in range(mesh.size):
            ax.plot(
                values[r].tolist(),
                color=cmap(group_of[r] % 10),
                label=f"rank {r} ({labels[r]})",
                marker="o",
                markersize=3,
            )
        ax.set_xlabel("element")
        ax.legend(fontsize=7, ncol=2)
    ax.set_ylabel("value")
    ax.set_title(
        title
        or (
            f"per-rank values on {mesh!r}"
            + (f", coloured by group along {axis!r}" if axis is not None else "")
        ),
        fontsize=9,
    )
    return ax
