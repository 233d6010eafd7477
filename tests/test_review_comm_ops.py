"""Review of the ops the first real-rank sweep (tests/test_review_comm.py) left out:
``halo_exchange``, ``all_to_all_qkv``, ``indexed_all_to_all_v``, ``ragged_all_to_all``, the static
v-ops with exact-size shards and ``pvary_packed``, on four gloo ranks and on the ctypes backend
over the fake NCCL, against simulated ranks (values, errors, gradients) and one device (uneven
halo blocks and v-op shards of exactly their own rows, which simulated ranks cannot hold); the
input changed in place after the call must not change the result; and a bad shard, index or
width on ONE rank raises on every rank of the group at once (it used to raise on that rank
alone, its peers waiting until the timeout)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import fastdist as fd
from fastdist.comm.native import fake
from tests import review_comm_ops_worker as W
from tests.dist_harness import run_on_gloo

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc for the fake NCCL")


def _same(a: Any, b: Any, tol: float = 1e-2) -> bool:
    if a is None or b is None:  # a gradient that never came equals zeros
        t = b if a is None else a
        return t is None or (isinstance(t, torch.Tensor) and not bool(t.ne(0).any()))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point() or a.is_complex():
            wide = torch.complex128 if a.is_complex() else torch.float64
            return torch.allclose(a.to(wide), b.to(wide), rtol=tol, atol=tol, equal_nan=True)
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(p, q, tol) for p, q in zip(a, b, strict=True))
    return bool(a == b)


def _simulated(fn: W.Fn, inputs: W.Inputs, grad: bool) -> Any:
    """(per-rank outputs [4, ...] each, grads or None) on simulated ranks."""
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    xs = [t.clone() for t in inputs()]
    if grad:
        xs = [x.requires_grad_(True) if x.is_floating_point() else x for x in xs]
    ys = W.flat(fd.simulate(lambda *a: fn(mesh, *a), mesh)(*xs))
    grads = None
    if grad:
        loss: Any = 0
        for y in ys:
            if y.is_floating_point() and y.requires_grad:
                w = torch.stack([W.weight_for(y.shape[1:], r) for r in range(W.WORLD)])
                loss = loss + (y.to(torch.float64) * w).sum()
        if isinstance(loss, torch.Tensor):
            loss.backward()
        grads = [x.grad if x.is_floating_point() else None for x in xs]
    return [y.detach() for y in ys], grads


def _rank(v: Any, r: int) -> Any:
    return None if v is None else [None if t is None else t[r] for t in v]


@pytest.fixture(scope="module")
def simulated() -> dict[str, Any]:
    """Every case's outcome on simulated ranks (computed once for both backends)."""
    return {
        key: W.outcome(
            lambda fn=fn, inputs=inputs, key=key: _simulated(fn, inputs, W.wants_grad(key))
        )
        for key, (fn, inputs) in W.all_cases().items()
    }


def _compare(res: list[dict[str, Any]], simulated: dict[str, Any]) -> list[Any]:
    bad: list[Any] = []
    for key, want in simulated.items():
        grad = W.wants_grad(key)
        for r in range(W.WORLD):
            got = res[r][key]
            if want[0] != got[0] or (want[0] == "err" and want[1] != got[1]):
                bad.append((key, r, str(want)[:160], str(got)[:160]))
                continue
            if want[0] == "err":
                continue
            outs, aliased, grads = got[1]
            tol = 1e-1 if "bfloat16" in key or "float16" in key else 1e-6
            if not _same(outs, _rank(want[1][0], r), tol):
                bad.append((key, r, "values", str(_rank(want[1][0], r))[:300], str(outs)[:300]))
            if any(aliased):
                bad.append((key, r, "the result changed with the input after the call"))
            if grad and not _same(grads, _rank(want[1][1], r), tol):
                bad.append((key, r, "grads", str(_rank(want[1][1], r))[:300], str(grads)[:300]))
    return bad


def _pad_index(length: int, lo: int, hi: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the whole domain that padding it picks, and which of them are real (not zeros)."""
    p = torch.arange(-lo, length + hi)
    if mode == "circular":
        return p % length, torch.ones_like(p, dtype=torch.bool)
    if mode == "replicate":
        return p.clamp(0, length - 1), torch.ones_like(p, dtype=torch.bool)
    if mode == "reflect":
        return torch.where(p < 0, -p, torch.where(p >= length, 2 * (length - 1) - p, p)), (
            torch.ones_like(p, dtype=torch.bool)
        )
    inside = (p >= 0) & (p < length)
    return p.clamp(0, length - 1), inside


def _halo_oracle(axis: Any, width: Any, mode: str, idx: int) -> Any:
    """One device, float64: rank ``idx``'s window of the padded whole domain, and the gradient of
    every rank's weighted window sum with respect to its own block."""
    sizes = W._halo_sizes(axis)
    lo, hi = (width, width) if isinstance(width, int) else width
    if mode == "reflect" and (lo >= sizes[0] or hi >= sizes[-1]):
        # fastdist's documented limit (the end blocks reflect their own rows), on every rank
        raise fd.CollectiveError("halo_exchange", axis, "reflect past an end block", "")
    whole = W.make(torch.float64, (sum(sizes), 3))[0].clone().requires_grad_(True)
    rows, real = _pad_index(sum(sizes), lo, hi, mode)
    padded = whole.index_select(0, rows) * real.unsqueeze(1)
    loss: Any = 0
    for r, s in enumerate(sizes):
        win = padded[sum(sizes[:r]) : sum(sizes[:r]) + lo + s + hi]
        loss = loss + (win * W.weight_for(win.shape, r)).sum()
    loss.backward()
    start = sum(sizes[:idx])
    y = padded[start : start + lo + sizes[idx] + hi].detach()
    assert whole.grad is not None
    return y, whole.grad[start : start + sizes[idx]]


def _exact_bad(res: list[dict[str, Any]]) -> list[Any]:
    """The real-rank-only cases against one device."""
    bad = []
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    for r in range(W.WORLD):
        for key, got in res[r].items():
            if not (isinstance(key, tuple) and key[0] in ("exact", "exact-agv")):
                continue
            ax = key[1]
            idx = mesh.index(r, ax)
            if key[0] == "exact":
                want = W.outcome(lambda ax=ax, k=key, i=idx: _halo_oracle(ax, k[2], k[3], i))
            else:
                want = W.outcome(lambda ax=ax, i=idx: _agv_oracle(ax, i))
            if want[0] != got[0] or (
                not _same(got[1], want[1], 1e-9) if want[0] == "ok" else want[1] != got[1]
            ):
                bad.append((key, r, str(want)[:300], str(got)[:300]))
    return bad


def _agv_oracle(axis: Any, i: int) -> Any:
    sizes = W._vsizes(axis)
    n = len(sizes)
    whole = W.make(torch.float64, (sum(sizes), 2))[0]
    start = sum(sizes[:i])
    # all_gather_v's gradient: the sum over ranks of each rank's weights, this rank's rows
    g = sum(W.weight_for(whole.shape, j) for j in range(n))
    total = whole * sum(j + 1 for j in range(n))
    rs = total[start : start + sizes[i]]
    gv = whole if i == 0 else whole[:0]
    sv = whole[start : start + sizes[i]] * 2  # index 1's whole * (1 + 1)
    return whole, g[start : start + sizes[i]], rs, gv, sv


@pytest.mark.parametrize("backend", ["torch", pytest.param("nccl-ctypes", marks=needs_gcc)])
def test_ops_on_real_ranks_match_simulate_and_one_device(
    backend: str, tmp_path: Path, simulated: dict[str, Any]
) -> None:
    """On gloo (``"torch"``) and the ctypes backend over the fake NCCL: every case of
    ``W.all_cases()`` equals simulated ranks (values or error type, gradients, no aliasing of
    the input); uneven halo blocks and v-op shards of exactly their own rows equal one device;
    a bad argument on one rank raises a CollectiveError on every rank of the group within
    seconds, and the mesh works afterwards."""
    lib = None if backend == "torch" else fake.build(tmp_path / "lib")
    res = run_on_gloo(W.sweep, 4, lib, str(tmp_path), timeout=240)
    assert [r["backend"] for r in res] == [backend] * 4
    bad = _compare(res, simulated) + _exact_bad(res)
    assert not bad, (len(bad), bad[:8])
    ran = sum(res[0][k][0] == "ok" for k in W.all_cases())
    assert ran > 350, ran
    slow = []
    for name in W.ONE_RANK:
        got = [res[r]["one-rank"].get(name) for r in range(4)]
        if any(g is None or g[0] != ("err", "CollectiveError") or g[2] > 5 for g in got):
            slow.append((name, got))
    assert not slow, slow
    assert all(r["one-rank"]["after"][0] == "ok" for r in res)
    first = res[0]["one-rank"]
    assert "rank" in first["agv-short"][1] and "all_gather_v" in first["agv-short"][1]


def test_qkv_equals_three_all_to_all_4d() -> None:
    """The packed exchange is three all_to_all_4d calls, for every layout of the sweep (simulated
    ranks; the sweep then checks real ranks against them)."""
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    for ax in W.AXES:
        for lay in ["plain", "bhsd", "gqa", "stride", "flip"]:
            fn, inp = W.qkv_case(ax, lay, 2)
            xs = inp(torch.float64)()  # type: ignore[operator]

            def each(
                q: torch.Tensor,
                k: torch.Tensor,
                v: torch.Tensor,
                ax: Any = ax,
                fn: W.Fn = fn,
                lay: str = lay,
            ) -> Any:
                # the layouts of fn, then one all_to_all_4d per tensor
                fn_q = fn(mesh, q, k, v)
                return fn_q, tuple(
                    fd.all_to_all_4d(t.contiguous(), mesh, ax) for t in _layout(lay, q, k, v)
                )

            got, want = fd.simulate(each, mesh)(*xs)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (ax, lay)


def _layout(lay: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
    if lay == "bhsd":
        return tuple(t.transpose(1, 2) for t in (q, k, v))
    if lay == "gqa":
        return q, k[:, :, :1].expand(-1, -1, 4, -1), v[:, :, :1].expand(-1, -1, 4, -1)
    if lay == "stride":
        return tuple(t[..., ::2] for t in (q, k, v))
    if lay == "flip":
        return tuple(t.flip(1) for t in (q, k, v))
    return q, k, v
