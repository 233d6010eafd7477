"""Issue 40's last pipeline gaps on real gloo processes (workers in
tests/pipeline_ckpt_gloo_worker.py): transformers' activation checkpointing, reentrant and not,
inside a pp2 x tp2 pipeline equals one device without checkpointing; FSDP2 under a pipeline
(pp2 x dp2 on 4 processes, pp2 x dp2 x tp2 on 8) equals one device, and its refusals;
``pipe.save_pretrained`` of a tied MoE loads in plain ``from_pretrained`` bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests import pipeline_ckpt_gloo_worker as W
from tests import tiny_models
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


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("fsdp_pipe")
    got = run_on_gloo(W.fsdp_on_4, 4, str(out), timeout=300)
    return [{**r, "saved": out} for r in got]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_fsdp2_under_a_pipeline_on_gloo_equals_one_device(
    fsdp: list[dict[str, Any]], schedule: str
) -> None:
    """pp2 x dp2, FSDP2 on each stage: gradients (mean over the dp ranks' batches), the
    whole-model clip's norm and an AdamW step equal one device."""
    assert [(r["pp"], r["dp"]) for r in fsdp] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    got = [r[schedule] for r in fsdp]
    for g, r in enumerate(got):
        assert r["dtensor"], g  # FSDP2 did shard the stage
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, (g, r["loss_err"], r["grad_err"])
        assert r["names"] == r["held"] and r["names"], g
        assert abs(r["total"] - r["ref_total"]) <= TOL, (g, r["total"], r["ref_total"])
        assert r["weight_err"] <= 1e-12, (g, r["weight_err"])
    assert set(got[0]["names"]) | set(got[2]["names"]) == set(got[0]["names"] + got[2]["names"])
    assert not set(got[0]["names"]) & set(got[2]["names"])


def test_save_pretrained_of_a_pipeline_under_fsdp2(fsdp: list[dict[str, Any]]) -> None:
    """The FSDP2-sharded stages' ``save_pretrained``: plain ``from_pretrained`` loads every
    rank's (gathered) weights bitwise."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(fsdp[0]["saved"], dtype=torch.float64).state_dict()
    assert {k for r in fsdp for k in r["weights"]} == set(state)
    for g, r in enumerate(fsdp):
        assert all(torch.equal(w, state[k]) for k, w in r["weights"].items()), g


def test_ddp_and_tied_fsdp2_under_a_pipeline_are_refused(fsdp: list[dict[str, Any]]) -> None:
    for r in fsdp:
        assert r["ddp"].startswith(
            "PipelineError: fastdist.train.DataParallel(engine='ddp'): "
            "not supported under a pipeline"
        ), r["ddp"]
        assert "1F1B runs several forwards before their backwards" in r["ddp"]
        assert r["tied"].startswith(
            "PipelineError: fastdist.train.DataParallel(engine='fsdp'): the tied weights"
        ), r["tied"]
        assert "Fix: engine='fastdist'" in r["tied"]


def test_fsdp2_under_a_simulated_pipeline_is_refused() -> None:
    import fastdist as fd

    pipe = fd.train.pipeline(
        tiny_models.tiny_llama(4), fd.Mesh({"pp": 2, "dp": 2}), schedule="1f1b", microbatches=2
    )
    with pytest.raises(fd.MeshError, match=r"FSDP2 needs real ranks .* engine='fastdist'"):
        fd.train.DataParallel(pipe, "dp", engine="fsdp")


def test_tied_moe_pipeline_save_pretrained_on_gloo(tmp_path: Path) -> None:
    """pp2 x tp2 on 4 processes: ``pipe.save_pretrained`` of a tied Qwen3-MoE writes what plain
    ``from_pretrained`` loads bitwise equal to every rank's stage weights (per-expert tensors,
    the tied weight once), and a fresh pipeline loads it back bitwise."""
    from transformers import AutoModelForCausalLM

    got = run_on_gloo(W.tied_moe_save_pretrained_on_4, 4, str(tmp_path), timeout=300)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    state = back.state_dict()
    assert {k for r in got for k in r["weights"]} == set(state)
    for g, r in enumerate(got):
        assert r["reloaded"], g
        assert all(torch.equal(w, state[k]) for k, w in r["weights"].items()), g


def test_fsdp2_under_a_pipeline_with_tp_on_8_gloo_processes() -> None:
    """pp2 x dp2 x tp2 (sequence parallel), FSDP2 over dp on each stage: one device's
    gradients."""
    got = run_on_gloo(W.fsdp_tp_on_8, 8, timeout=400)
    for g, r in enumerate(got):
        assert r["dtensor"], g
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, (g, r["loss_err"], r["grad_err"])
    assert {n for r in got for n in r["names"]} == set(got[0]["model"])


def test_checkpoint_of_a_pipeline_under_fsdp2(tmp_path: Path) -> None:
    """``fd.checkpoint.save``/``load`` of FSDP2-sharded stages and their AdamW state (pp2 x dp2):
    the weights load bitwise, and the next step (which reads the AdamW moments) agrees bitwise."""
    got = run_on_gloo(W.fsdp_checkpoint_on_4, 4, str(tmp_path), timeout=300)
    for g, r in enumerate(got):
        assert r["loaded"] == 0.0 and r["stepped"] == 0.0, (g, r)
