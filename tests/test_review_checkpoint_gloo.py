"""Review of fastdist.checkpoint on real (gloo) ranks: replicated buffers that differ between
the ranks holding them (BatchNorm's running statistics under data parallelism) are refused at
save, not silently written from one rank."""

from __future__ import annotations

from pathlib import Path

import torch

from fastdist import checkpoint
from fastdist.testing import run_on_gloo
from tests.review_checkpoint_worker import bn_dp2, conv_bn


def test_differing_batchnorm_statistics_refused_at_save(tmp_path: Path) -> None:
    """dp=2, each rank its own batches: the ranks' running statistics differ (a checkpoint keeps
    one copy: before, the writer's choice, rank 1's here, or a mix of ranks over one module's
    buffers); save raises on every rank naming the buffer and the fix, and writes nothing.
    Averaged over dp, the save is written and a plain model loads exactly the averages."""
    got = run_on_gloo(bn_dp2, 2, str(tmp_path))
    own = [g["own"] for g in got]
    assert not torch.equal(own[0]["running_mean"], own[1]["running_mean"])  # the premise
    for g in got:
        assert "'1.running_mean' differs between process ranks 0 and 1" in g["first save"]
        assert "SyncBatchNorm" in g["first save"]
    assert torch.equal(got[0]["synced"]["running_var"], got[1]["synced"]["running_var"])
    plain = conv_bn()
    checkpoint.load(tmp_path, plain)
    for k, v in got[0]["synced"].items():
        assert torch.equal(plain[1].state_dict()[k], v), k
    want = (own[0]["running_mean"] + own[1]["running_mean"]) / 2
    torch.testing.assert_close(plain[1].running_mean, want, rtol=1e-15, atol=0)
