"""Review of fastdist.checkpoint on real (gloo) ranks: replicated buffers that differ between
the ranks holding them (BatchNorm's running statistics under data parallelism) are written from
one rank, the lowest, as a whole set."""

from __future__ import annotations

from pathlib import Path

import torch

from fastdist import checkpoint
from tests.dist_harness import run_on_gloo
from tests.review_checkpoint_worker import bn_dp2, conv_bn


def test_differing_batchnorm_statistics_saved_from_rank_0(tmp_path: Path) -> None:
    """dp=2, each rank its own batches: the ranks' running statistics differ. A checkpoint keeps
    one copy; before, each buffer's writer was the load balancer's choice (rank 1's here, and
    over a larger model a mix: one module's running_mean from one rank, running_var from the
    other, statistics no rank ever had). Now every buffer comes from rank 0, the copy torch's
    DDP broadcasts: a plain model loads exactly rank 0's BatchNorm state."""
    got = run_on_gloo(bn_dp2, 2, str(tmp_path))
    assert not torch.equal(got[0]["running_mean"], got[1]["running_mean"])  # the premise
    plain = conv_bn()
    checkpoint.load(tmp_path, plain)
    for k, v in got[0].items():
        assert torch.equal(plain[1].state_dict()[k], v), k
