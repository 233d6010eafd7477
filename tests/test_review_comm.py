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
