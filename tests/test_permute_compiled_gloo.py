"""``ppermute`` and ``ring_shift`` compiled with ``dynamic=True`` on real gloo ranks (grad off):
torch 2.13's dynamo answers ``1 in [0, 1]`` wrongly for symbolic ints, and the distributed rule,
compiled as a frame of its own after a graph break, found no destination: every rank got zeros
(``tests/test_review_transforms.py`` has the simulated case; this is the real-rank rule)."""

from __future__ import annotations

import torch

import fastdist as fd
from tests.dist_harness import run_on_gloo

N = 3


def compiled_exchanges() -> list[list[float]]:
    """One rank of 3: a ring ppermute and ring_shift compiled with dynamic=True, two sizes."""
    mesh = fd.connect(tp=N, timeout=120)
    perm = [(i, (i + 1) % N) for i in range(N)]
    per = torch.compile(lambda x: fd.ppermute(x, mesh, "tp", perm), dynamic=True)
    shift = torch.compile(lambda x: fd.ring_shift(x, mesh, "tp", 1), dynamic=True)
    me = float(torch.distributed.get_rank())
    out = []
    with torch.no_grad():
        for size in (3, 5):
            x = torch.full((size,), me + 1, dtype=torch.float64)
            out.append(per(x).tolist())
            out.append(shift(x).tolist())
    return out


def test_compiled_dynamic_exchanges_on_gloo() -> None:
    for r, got in enumerate(run_on_gloo(compiled_exchanges, N, timeout=240)):
        sender = (r - 1) % N  # ring: rank r receives from r - 1
        for row in got:
            assert row == [float(sender + 1)] * len(row), (r, got)
