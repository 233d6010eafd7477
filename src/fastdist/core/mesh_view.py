"""``MeshView``: a mesh's rank grid as text, and as HTML in Jupyter (pure Python, no torch).

:meth:`fastdist.Mesh.show` and the mesh's Jupyter repr use it; :mod:`fastdist.tools.visual`
draws shardings and per-rank values with the same table and colours.

>>> from fastdist.core.mesh import Mesh
>>> print(MeshView(Mesh({"dp": 2, "tp": 2}), "dp"))
Mesh({'dp': 2, 'tp': 2}): 4 ranks; groups along 'dp' are lettered
        tp=0  tp=1
  dp=0   0 A   1 B
  dp=1   2 A   3 B
"""

from __future__ import annotations

import html
import string
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastdist.core.mesh import AxisName, Mesh

__all__ = ["MeshView", "COLOURS", "text_table"]

#: Background colours of lettered groups and blocks in HTML pictures, in order.
COLOURS = ["#cfe8fc", "#fde2c8", "#d5f5d5", "#f9d0e0", "#e6dcfa", "#fff3b0", "#d0f0f0", "#f0d8c0"]


def _label(i: int) -> str:
    """The letter(s) of group ``i``: A..Z, then AA, AB, ..."""
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


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``header`` and ``rows`` as right-aligned text columns, two spaces apart.

    >>> print(text_table(["rank", "x"], [["0", "1.5"], ["1", "2"]]))
    rank    x
       0  1.5
       1    2
    """
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(v).rjust(w) for v, w in zip(r, widths)) for r in [header, *rows]]
    return "\n".join(line.rstrip() for line in lines)


class MeshView:
    """A mesh's rank grid (last axis as columns); with ``axis``, the groups along it lettered and
    coloured."""

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
        return (
            self._title()
            + "\n"
            + "\n".join("  " + line for line in text_table(["", *cols], body).splitlines())
        )

    __repr__ = __str__

    def _repr_html_(self) -> str:
        cols, rows = _grid(self.mesh)
        out = [
            f"<div><b>{html.escape(self._title())}</b>"
            "<table style='border-collapse:collapse;font-family:monospace'>"
        ]
        out.append(
            "<tr><th></th>"
            + "".join(f"<th style='padding:2px 8px'>{html.escape(c)}</th>" for c in cols)
            + "</tr>"
        )
        for label, ranks in rows:
            out.append(
                f"<tr><th style='padding:2px 8px;text-align:right'>{html.escape(label)}</th>"
            )
            for r in ranks:
                g = self._group_of.get(r)
                style = "border:1px solid #999;padding:4px 10px;text-align:center"
                if g is not None:
                    style += f";background:{COLOURS[g % len(COLOURS)]}"
                text = f"{r}" + (f"<sub>{_label(g)}</sub>" if g is not None else "")
                out.append(f"<td style='{style}'>{text}</td>")
            out.append("</tr>")
        out.append("</table></div>")
        return "".join(out)
