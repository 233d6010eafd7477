"""``Mesh.without``: the mesh of the other axes; on real ranks over this process's slice (issue 34,
pipeline stages)."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

import fastdist as fd
from tests import mesh_without_worker as W
from tests.dist_harness import run_on_gloo


# ----------------------------------------------------------------------------- plain meshes
def test_without_on_a_plain_mesh_is_the_mesh_of_the_other_axes() -> None:
    mesh = fd.Mesh({"pp": 2, "dp": 2, "tp": 2})
    assert mesh.without("pp") == fd.Mesh({"dp": 2, "tp": 2})
    assert mesh.without("dp") == fd.Mesh({"pp": 2, "tp": 2})
    assert mesh.without(("tp", "pp")) == fd.Mesh({"dp": 2})  # kept axes stay in mesh order
    assert mesh.without(["pp", "dp"]) == fd.Mesh({"tp": 2})
    assert mesh.without("pp").without("tp") == mesh.without(("pp", "tp"))
    assert mesh.without("pp")._comm is None


def test_without_every_axis_is_the_one_rank_mesh_of_no_axes() -> None:
    assert fd.Mesh({"pp": 4}).without("pp") == fd.Mesh({})
    empty = fd.Mesh({"dp": 2, "tp": 2}).without(("dp", "tp"))
    assert empty == fd.Mesh({}) and empty.size == 1 and empty.axis_names == ()
    assert empty.coords(0) == {} and empty.rank_of({}) == 0
    with pytest.raises(fd.MeshError, match="axis=\\(\\) names no mesh axis"):
        empty.groups(())


@pytest.mark.parametrize(
    ("axis", "match"),
    [
        ("cp", "Mesh.without: unknown mesh axis 'cp'"),
        (("pp", "pp"), "Mesh.without: axis .* repeats an axis"),
        ((), "Mesh.without: axis=\\(\\) names no mesh axis"),
        (3, "Mesh.without: axis must be an axis name"),
    ],
)
def test_without_refuses_bad_axes(axis: object, match: str) -> None:
    with pytest.raises(fd.MeshError, match=match):
        fd.Mesh({"pp": 2, "tp": 2}).without(axis)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- real ranks
@pytest.fixture(scope="module")
def pp_tp() -> list[dict[str, Any]]:
    """Each rank's results of the pp=2 x tp=2 checks (one launch of 4 gloo processes)."""
    return run_on_gloo(W.pp_tp_checks, 4, timeout=150)


def test_slices_of_pp2_tp2_talk_only_inside_the_slice(pp_tp: list[dict[str, Any]]) -> None:
    got = [r["slices"] for r in pp_tp]
    for g, r in enumerate(got):
        stage, members = g // 2, [2 * (g // 2), 2 * (g // 2) + 1]
        assert r["rank"] == g % 2 and r["index"] == g % 2, (g, r)
        assert r["shape"] == {"dp": 1, "tp": 2} and r["same"] and r["plain_differs"], (g, r)
        assert r["timeout"] == 30.0  # inherited
        assert r["psum_tp"] == r["psum_all"] == sum(members), (g, stage, r)
        assert r["gather_tp"] == [float(m) for m in members] and r["objects"] == members, (g, r)
        assert r["whole"] == 0 + 1 + 2 + 3
        # still the slice, with its own groups and the new timeout
        assert r["with_timeout"] == (g % 2, False, 7.0, float(sum(members))), r
        # named after the parent mesh (pp2_dp1_tp2, the first of its shape) and the slice
        assert (
            r["group_name"]
            == f"fastdist.pp2_dp1_tp2.0-pp{stage}.0.e0.{g - g % 2}-{g - g % 2 + 1}.gloo"
        )
        assert r["empty"] == (0, 1, ()) and "names no mesh axis" in r["empty_error"], r
        assert r["check"] is True
        if stage == 1:  # check mode: both members of the slice raise, naming global ranks
            assert "rank 2: psum(shapes=[(1,)]" in r["consistency"], r
            assert "rank 3: psum(shapes=[(2,)]" in r["consistency"], r
            assert f"on rank {g} (group ranks [2, 3])" in r["consistency"], r


def test_each_slice_parallelizes_its_own_model(pp_tp: list[dict[str, Any]]) -> None:
    """Different shapes per stage: a gather that strayed into the other slice would fail or hang;
    grads and state equal one device's (float64)."""
    got = [r["model"] for r in pp_tp]
    assert [r["stage"] for r in got] == [0, 0, 1, 1]
    assert [r["local_w"] for r in got] == [(4, 4), (4, 4), (5, 6), (5, 6)]  # colwise: h/2 rows
    for r in got:
        assert r["names"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert r["err"] <= 1e-12, r


def test_a_failure_in_one_slice_names_its_ranks_and_spares_the_other() -> None:
    got = run_on_gloo(W.one_slice_fails, 4, timeout=120)
    assert [r["first"] for r in got] == [1.0, 1.0, 5.0, 5.0]
    assert got[0]["second"] == got[1]["second"] == [1.0, 1.0, 1.0]  # slice pp=0 unaffected
    r = got[2]
    assert r["error"] == "CollectiveTimeout", r
    assert r["ranks"] == [2, 3] and r["err_rank"] == 2, r  # global ranks
    msg = r["message"]
    assert "fastdist.psum(axis='tp') on rank 2 (group ranks [2, 3])" in msg, msg
    assert "slice pp=1: global ranks [2, 3]" in msg and "rank 3 did not reach this call" in msg
    assert "Fix: " in msg
    assert r["seconds"] < 3 + 6, r  # the mesh's timeout (3 s), plus the roll call and load
    assert got[2]["after_reset"] == got[3]["after_reset"] == 5.0  # reset within the slice only
    msg = got[2]["all_axes_error"]  # over all of the slice's axes: still only its ranks
    assert "psum(axis=('dp', 'tp')) on rank 2 (group ranks [2, 3])" in msg, msg
    assert "(slice pp=1: global ranks [2, 3]) within the timeout (3 s)" in msg, msg


def test_slices_of_pp2_dp2_tp2_on_eight_ranks() -> None:
    got = run_on_gloo(W.slices_pp_dp_tp, 8, timeout=150)
    for g, r in enumerate(got):
        base = 4 * (g // 4)
        assert r["rank"] == g % 4
        assert r["all"] == sum(range(base, base + 4)), (g, r)
        assert r["dp"] == g + (g + 2 if g % 4 < 2 else g - 2), (g, r)
        pair = 2 * (g // 2)
        assert r["tp_nested"] == r["tp_two"] == pair + pair + 1, (g, r)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the fake library")
def test_a_slice_keeps_the_ctypes_backend(tmp_path: object) -> None:
    from fastdist.comm.native import fake

    lib = fake.build(tmp_path)
    got = run_on_gloo(W.slice_on_fake_nccl, 4, lib, timeout=120)
    for g, r in enumerate(got):
        scale = sum(m + 1 for m in (2 * (g // 2), 2 * (g // 2) + 1))
        assert r["backend"] == "nccl-ctypes" and r["psum"] == [scale, 2.0 * scale], (g, r)
        assert "ncclAllReduce" in r["calls"], r
