"""Mesh, sharding and per-rank views: text tables and Jupyter HTML."""

from __future__ import annotations

import re

import pytest
import torch

import fastdist as fd
from fastdist.testing import shard_for_rank


def test_mesh_text_grid_letters_the_groups() -> None:
    text = str(fd.Mesh({"dp": 2, "tp": 3}).show("dp"))
    assert text.splitlines() == [
        "Mesh({'dp': 2, 'tp': 3}): 6 ranks; groups along 'dp' are lettered",
        "        tp=0  tp=1  tp=2",
        "  dp=0   0 A   1 B   2 C",
        "  dp=1   3 A   4 B   5 C",
    ]


def test_mesh_html_colours_each_group_and_lists_every_rank() -> None:
    mesh = fd.Mesh({"dp": 2, "sp": 2, "tp": 2})
    page = mesh.show("tp")._repr_html_()
    cells = re.findall(r"<td style='([^']*)'>(\d+)<sub>([A-Z])</sub></td>", page)
    assert sorted(int(r) for _, r, _ in cells) == list(range(8))
    by_group: dict[str, set[str]] = {}
    for style, rank, letter in cells:
        by_group.setdefault(letter, set()).add(style)
        assert mesh.groups("tp")["ABCD".index(letter)].count(int(rank)) == 1
    assert (
        all(len(styles) == 1 for styles in by_group.values())
        and len({s for v in by_group.values() for s in v}) == 4
    )
    assert "<table" in mesh._repr_html_() and "<sub>" not in mesh._repr_html_()


def test_sharding_view_blocks_match_the_shards() -> None:
    mesh, spec = fd.Mesh({"dp": 2, "tp": 2}), fd.P(("tp", "dp"), None)
    x = torch.arange(24.0).reshape(8, 3)
    view = fd.show_sharding(x, spec, mesh)
    for rank, _, block, local in view.rows():
        start, stop = (int(v) for v in block[1:].split(",")[0].split(":"))
        assert torch.equal(x[start:stop], shard_for_rank(x, spec, mesh, rank)) and local == (2, 3)
    assert "block" in str(view) and "<table>" in view._repr_html_()


def test_sharding_picture_and_refusals_match_spmd() -> None:
    """The picture names every block's holders; what spmd refuses (issue 21: (8, 6) over tp=4)
    raises the same MeshError."""
    mesh = fd.Mesh({"dp": 2, "tp": 4})
    view = fd.show_sharding((8, 8), fd.P(None, "tp"), mesh)
    assert view.blocks() == {((0, 8), (2 * j, 2 * j + 2)): [j, j + 4] for j in range(4)}
    lines = str(view).splitlines()
    assert lines[3] == "0:8 │ ranks 0,4 │ ranks 1,5 │ ranks 2,6 │ ranks 3,7 │"
    assert lines[1].split() == ["0:2", "2:4", "4:6", "6:8"]
    page = view._repr_html_()
    assert re.findall(r"background:#[0-9a-f]{6}'>([\d,]+)</td>", page) == [
        "0,4",
        "1,5",
        "2,6",
        "3,7",
    ]
    x = torch.arange(64.0).reshape(8, 8)
    with pytest.raises(
        fd.MeshError,
        match=(
            r"splits dim 1 \(size 6\) over \('tp',\) \(4 ranks\).*Fix: pad dim 1 to a multiple "
            r"of 4"
        ),
    ):
        fd.show_sharding((8, 6), fd.P("dp", "tp"), mesh)
    with pytest.raises(fd.MeshError, match="splits dim 1"):  # spmd refuses the same split
        fd.spmd(lambda a: a, mesh, in_specs=(fd.P("dp", "tp"),), out_specs=fd.P("dp", "tp"))(
            x[:, :6]
        )
    with pytest.raises(fd.MeshError, match=r"has 3 entries but the shape \[8, 8\] has 2 dims"):
        fd.show_sharding((8, 8), fd.P("dp", "tp", None), mesh)
    one_d = str(
        fd.show_sharding((8,), fd.P(("tp", "dp")), fd.Mesh({"dp": 2, "tp": 2}))
    ).splitlines()
    assert one_d[3] == " │ rank 0 │ rank 2 │ rank 1 │ rank 3 │"  # tp major, dp minor along the dim


def test_show_ranks_side_by_side_and_errors() -> None:
    mesh = fd.Mesh({"tp": 2})
    out = fd.simulate(lambda x: fd.all_gather(x, mesh, "tp"), mesh)(torch.tensor([[1.0], [2.0]]))
    assert str(fd.show_ranks(out, mesh)).splitlines()[1:] == [
        "   0    tp=0  [1.0, 2.0]",
        "   1    tp=1  [1.0, 2.0]",
    ]
    with pytest.raises(ValueError, match=r"leading rank dimension of 2, got shape \(3,\)"):
        fd.show_ranks(torch.zeros(3), mesh)


def test_plot_ranks_draws_one_bar_or_line_per_rank(tmp_path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    ax = fd.plot_ranks(
        fd.simulate(lambda x: fd.psum(x, mesh, "tp"), mesh)(torch.arange(4.0)), mesh, "tp"
    )
    assert [round(p.get_height()) for p in ax.patches] == [1, 1, 5, 5]
    assert (
        ax.patches[0].get_facecolor()
        == ax.patches[1].get_facecolor()
        != ax.patches[2].get_facecolor()
    )
    ax2 = fd.plot_ranks(torch.arange(12.0).reshape(4, 3), mesh)
    assert len(ax2.lines) == 4 and list(ax2.lines[3].get_ydata()) == [9.0, 10.0, 11.0]
    ax.figure.savefig(tmp_path / "ranks.png")
    assert (tmp_path / "ranks.png").stat().st_size > 1000
