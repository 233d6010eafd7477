"""Review of the collectives as a new user: results on real ranks (gloo, the ctypes backend over
the host-memory fake NCCL) against the simulated ones, for layouts torch calls contiguous whose
last stride is not 1, and for groups of one member (the result must not be a view of the input)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import fastdist as fd
from fastdist.comm.native import NativeCommunicator, fake, load_library
from tests import review_comm_worker as W
from tests.dist_harness import run_on_gloo

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc for the fake NCCL")


def _solo(path: str) -> NativeCommunicator:
    return NativeCommunicator.create(
        load_library("nccl", path),
        n=1,
        index=0,
        exchange=lambda b: b if b is not None else b"",
        label="tp",
        ranks=[0],
        rank=0,
    )


@needs_gcc
def test_ctypes_wire_takes_tensors_torch_calls_contiguous_with_a_last_stride_not_1(
    tmp_path: Path,
) -> None:
    """A column ``x.t()[:, :1]`` and an empty shard ``x.t()[:0]`` are "contiguous" to torch with a
    last stride of 8 / 4: the wire's ``view_as_real`` / ``view(torch.uint8)`` refused them before
    (an all_gather_v over dim=-1 where a rank sends no rows broke the mesh)."""
    comm = _solo(fake.build(tmp_path))
    base = torch.arange(32.0).reshape(4, 8)
    col = torch.complex(base, -base).t()[:, :1]  # [8, 1], strides (1, 8)
    assert col.is_contiguous() and col.stride(-1) != 1
    assert torch.equal(comm.all_reduce("psum", col, "sum"), col)  # complex: its real view
    flags = (base > 3).t()[:, :1]
    assert torch.equal(comm.all_reduce("pmax", flags, "max"), flags)  # bool: as uint8
    assert torch.equal(comm.broadcast("broadcast", col, 0), col)  # complex64 moved as bytes
    empty = torch.complex(base, base).t()[:0]  # [0, 4], strides (1, 4)
    got = comm.all_gather_v_rows("all_gather_v", empty, [0])
    assert got.shape == (0, 4) and got.dtype == torch.complex64
    comm.close()


def test_a_group_of_one_member_returns_new_memory_like_simulate() -> None:
    """dp=2 x tp=1 on two gloo processes: every op over "tp" (one member) returned a view of its
    input for gathers, all-to-alls, broadcast, local_chunk: scaling the input in place after the
    call changed the result (and the other way round); simulated ranks never alias."""
    res = run_on_gloo(W.one_member, 2, timeout=120)
    mesh = fd.Mesh({"dp": 2, "tp": 1})
    xs = W.make_input(torch.float64, (4, 8), 2)
    bad = []
    for op, fn in W.ONE_OPS.items():

        def per_rank(x: torch.Tensor, fn: W.Op = fn) -> torch.Tensor:
            y = fn(x, mesh, "tp")
            return y[0] if isinstance(y, tuple) else y

        want = fd.simulate(per_rank, mesh)(xs.clone())
        for r in range(2):
            if not torch.equal(res[r][op, "in"], want[r]):
                bad.append((op, r, "the result changed with the input"))
            if not torch.equal(res[r][op, "out"], xs[r]):
                bad.append((op, r, "the input changed with the result"))
    assert not bad, bad


# ------------------------------------------------------------------ the sweep: every op x dtype x
# layout x axis (both orders of ("dp", "tp")) on dp=2 x tp=2 gloo ranks == simulate
def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point() or a.is_complex():
            wide = torch.complex128 if a.is_complex() else torch.float64
            return torch.allclose(a.to(wide), b.to(wide), rtol=1e-2, atol=1e-2, equal_nan=True)
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(p, q) for p, q in zip(a, b, strict=True))
    return a == b


def _at(v: object, r: int) -> object:
    if isinstance(v, torch.Tensor):
        return v[r]
    return tuple(_at(t, r) for t in v) if isinstance(v, tuple) else v


def _simulated(op: str, dt: str, lay: str, ax: object, shape: tuple[int, ...]) -> object:
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    xs = W.make_input(W.dtype_of(dt), shape)
    return W.outcome(lambda: fd.simulate(lambda x: W.run_case(x, mesh, op, lay, ax), mesh)(xs))


def _sim_grad(op: str, ax: object, view: bool) -> object:
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    xs = W.make_input(torch.float64, (4, 8)).requires_grad_(True)

    def per_rank(x: torch.Tensor) -> torch.Tensor:
        y = W.run_case(x[:, :] if view else x, mesh, op, "plain", ax)
        return y[0] if isinstance(y, tuple) else y

    ys = fd.simulate(per_rank, mesh)(xs)
    w = torch.stack([W.weight_for(ys.shape[1:], r) for r in range(4)])
    (ys * w).sum().backward()
    return ys.detach(), xs.grad


@pytest.mark.parametrize("backend", ["torch", pytest.param("nccl-ctypes", marks=needs_gcc)])
def test_every_op_on_real_ranks_matches_simulate(backend: str, tmp_path: Path) -> None:
    """On gloo (``"torch"``) and on the ctypes backend over the fake NCCL: values (or the error's
    type) of every case of ``W.cases()`` on four gloo processes equal the
    simulated ones; the extras: input / output changed in place after the call, gradients (also
    through a view of a leaf), no_grad and inference-mode inputs, on "tp" and ("dp", "tp")."""
    lib = None if backend == "torch" else fake.build(tmp_path / "lib")
    res = run_on_gloo(W.sweep, 4, lib, str(tmp_path), timeout=240)
    assert [r["backend"] for r in res] == [backend] * 4
    bad = []
    for case in W.cases():
        want = _simulated(*case)
        for r, got in enumerate(res[r][repr(case)] for r in range(4)):
            if want[0] != got[0] or (want[0] == "ok" and not _same(got[1], _at(want[1], r))):
                bad.append((case, r, str(want)[:200], str(got)[:200]))
    x0 = W.make_input(torch.float64, (4, 8))
    for op in W.OPS:
        for ax in ["tp", ("dp", "tp")]:
            plain = _simulated(op, "torch.float64", "plain", ax, (4, 8))
            first = (
                ("ok", plain[1][0]) if plain[0] == "ok" and isinstance(plain[1], tuple) else plain
            )
            wants = {
                "mut_in": first,
                "nograd": plain,
                "inference": plain,
                "mut_out": ("ok", x0),
                "grad": W.outcome(lambda op=op, ax=ax: _sim_grad(op, ax, False)),
                "grad_view": W.outcome(lambda op=op, ax=ax: _sim_grad(op, ax, True)),
            }
            for kind, want in wants.items():
                for r in range(4):
                    got = res[r]["extras"][kind, op, ax]
                    if want[0] != got[0] or (
                        want[0] == "ok" and not _same(got[1], _at(want[1], r))
                    ):
                        bad.append((kind, op, ax, r, str(want)[:200], str(got)[:200]))
    assert not bad, bad[:10]
    ran = sum(res[0][repr(c)][0] == "ok" for c in W.cases())
    assert ran > 1500, ran  # most cases ran (not all refused alike)
    objects = [r["extras"]["bco"] for r in res]
    assert all(o[0] == "ok" and o[1][1]["r"] == 2 and o[1][3] == b"\0\0" for o in objects)
