"""Issue 40's last pipeline gaps on real gloo processes (workers in
tests/pipeline_ckpt_gloo_worker.py): transformers' activation checkpointing, reentrant and not,
inside a pp2 x tp2 pipeline equals one device without checkpointing; FSDP2 under a pipeline."""

from __future__ import annotations

from typing import Any

import pytest

from tests import pipeline_ckpt_gloo_worker as W
from tests.dist_harness import run_on_gloo

TOL = 1e-9


@pytest.fixture(scope="module")
def checkpointing() -> list[dict[str, Any]]:
    return run_on_gloo(W.checkpointing_on_4, 4, timeout=300)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_in_a_pipeline_on_gloo_equals_one_device(
    checkpointing: list[dict[str, Any]], reentrant: bool
) -> None:
    got = [r[f"reentrant={reentrant}"] for r in checkpointing]
    assert [r["pp"] for r in checkpointing] == [0, 0, 1, 1]
    for g, r in enumerate(got):
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, (g, r["loss_err"], r["grad_err"])
        assert r["names"] == r["held"] and r["names"], g
        # checkpointing is on: 2 own layers x 2 micro-batches, each run again in the backward
        assert len(r["calls"]) == 8, (g, len(r["calls"]))
    # the two stages together hold every parameter's gradient
    assert {n for r in got for n in r["names"]} == set(got[0]["names"]) | set(got[2]["names"])
    assert not set(got[0]["names"]) & set(got[2]["names"])
