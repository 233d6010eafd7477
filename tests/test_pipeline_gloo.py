"""`fastdist.train.pipeline` on real gloo processes (issue 34 points 3 and 5): every schedule, pp x
tp (+ sequence parallelism), pp4, pp x dp x tp with different data per dp rank, the whole-model
clip and an AdamW step, each against one device in float64 (loss by hand, every gradient, to
1e-9); then faults: ranks built with different schedules, a stage rank that raises mid-step, a
stage that exits mid-step. The workers are in tests/pipeline_worker.py; each launch runs several
cases (spawning the processes is most of the time)."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch

import fastdist as fd
from tests import pipeline_worker as W
from tests import tiny_models
from tests.dist_harness import run_on_gloo

TOL = 1e-9


def _stage_of(name: str, layers: int, stages: int) -> int:
    """The stage that holds parameter ``name`` of `tiny_models.tiny_llama` split evenly into
    ``stages``."""
    if name.startswith("model.embed_tokens."):
        return 0
    if name.startswith(("model.norm.", "lm_head.")):
        return stages - 1
    layer = int(re.match(r"model\.layers\.(\d+)\.", name).group(1))  # type: ignore[union-attr]
    return layer // (layers // stages)


def _check_case(got: list[dict[str, Any]], layers: int, stages: int) -> None:
    """Each rank: loss and gradients equal one device; the loss is 0-d and the same on every rank
    (of a dp group); every parameter has its gradient on exactly the ranks of its stage."""
    for g, r in enumerate(got):
        assert r["loss_shape"] == () and r["loss_err"] <= TOL, (g, r["loss_err"])
        assert r["grad_err"] <= TOL, (g, r["grad_err"])
        mine = sorted(n for n in r["model"] if _stage_of(n, layers, stages) in r["stages"])
        assert r["names"] == r["held"] == mine, g
    covered = {n for r in got for n in r["names"]}
    assert covered == set(got[0]["model"])


def _names_the_transfer(msg: str, g: int, peer: int) -> bool:
    """Whether ``msg`` is pp=0 rank ``g``'s error for a transfer with stage 1 on ``peer``: the
    receive of an early gradient, or the send of an activation (whichever it was in when the
    peer failed), naming the micro-batch, both stages, the peer's index and rank, and saying
    that the peer did not reach the call."""
    return bool(
        re.match(
            rf"fastdist\.pipeline (recv|send)\(axis='pp'\) on rank {g} \(group ranks \[{g}, "
            rf"{peer}\]\): (the gradient of micro-batch [01] from stage 1 \(pp=1, rank {peer}\) "
            rf"for stage 0|the delivery of the activation of micro-batch [0-3] from stage 0 for "
            rf"stage 1 \(pp=1, rank {peer}\)) failed: .*; rank {peer} did not reach this call",
            msg,
        )
    )


# ----------------------------------------------------------------------------- correct
@pytest.fixture(scope="module")
def on_4() -> list[dict[str, Any]]:
    return run_on_gloo(W.schedules_on_4, 4, timeout=300)


@pytest.mark.parametrize(
    ("case", "stages"),
    [("gpipe", 2), ("1f1b", 2), ("interleaved_1f1b", 4), ("1f1b_sp", 2)],
)
def test_pp2_tp2_each_schedule_equals_one_device(
    on_4: list[dict[str, Any]], case: str, stages: int
) -> None:
    got = [r[case] for r in on_4]
    _check_case(got, layers=4, stages=stages)
    assert [r["pp"] for r in got] == [0, 0, 1, 1]
    # interleaved: pp=0 holds stages 0 and 2, pp=1 stages 1 and 3
    assert [r["stages"] for r in got] == (
        [[0, 2], [0, 2], [1, 3], [1, 3]] if stages == 4 else [[0], [0], [1], [1]]
    )
    assert len({r["loss"] for r in got}) == 1


def test_pp4_1f1b_over_8_layers_equals_one_device(on_4: list[dict[str, Any]]) -> None:
    """pp=4 alone: each stage's mesh has no axes (fastdist's loss, float64 throughout)."""
    got = [r["pp4"] for r in on_4]
    _check_case(got, layers=8, stages=4)
    assert [r["stages"] for r in got] == [[0], [1], [2], [3]]
    assert len({r["loss"] for r in got}) == 1
    # pipe.reset() with nothing failed: fresh groups, no gradients, the same step again
    assert got[0]["stage_axes"] == ("dp",)  # fastdist.connect(pp=4) adds dp=1
    for g, r in enumerate(got):
        assert r["again"]["loss_err"] <= TOL and r["again"]["grad_err"] <= TOL, (g, r["again"])


def test_steps_of_new_input_shapes_send_headers_again() -> None:
    """The first step with an input shape sends each transfer's header and the next ones only
    the tensors: steps of sequence length 8, 8, 6, 8 all equal one device, and the shapes the
    headers taught grow only when a new input shape comes (this rank's sends or receives: 2
    micro-batches x 1 boundary per step shape). Then ranks given different masks refuse."""
    per_rank = run_on_gloo(W.shapes_change_on_2, 2, timeout=300)
    for g, (*steps, mixed) in enumerate(per_rank):
        for r in steps:
            assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, (g, r)
        assert [r["headers_known"] for r in steps] == [4, 4, 8, 8], (g, steps)
        # then the two ranks get different attention masks: both refuse, naming the input
        assert mixed["type"] == "PipelineError", (g, mixed)
        assert "the ranks along 'pp' were given different attention_mask" in mixed["msg"], mixed


def test_meta_model_loads_each_stage_and_rank_slices_on_gloo(tmp_path: Any) -> None:
    """A model built on the meta device on every rank of pp2 x tp2: each rank materialises only
    its stage's tp slices from save_pretrained output (it holds well under half the model's
    parameters: its stage's half, split over tp, plus replicated norms and the kv heads), and
    the step equals one device."""
    tiny_models.tiny_llama(4, seed=3).save_pretrained(tmp_path)
    per_rank = run_on_gloo(W.meta_load_on_4, 4, str(tmp_path), timeout=300)
    for g, r in enumerate(per_rank):
        assert r["was_meta"], g
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, (g, r)
        assert r["held"] < 0.45 * r["whole"], (g, r["held"], r["whole"])


def test_reset_on_a_simulated_pipeline_is_refused() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    pipe = fd.train.pipeline(LlamaForCausalLM(cfg), fd.Mesh({"pp": 2}))
    with pytest.raises(fd.PipelineError, match=r"^Pipeline\.reset: a simulated pipeline has no"):
        pipe.reset()


def test_clip_and_adamw_equal_torch_on_one_device(on_4: list[dict[str, Any]]) -> None:
    """``clip_grad_norm_(0.1)``: the whole model's norm (not a stage's) on every rank, gradients
    scaled as torch's clip scales them; one AdamW step then gives torch's weights."""
    for g, r in enumerate(c["clip_adamw"] for c in on_4):
        assert r["ref_total"] > 1.0  # the clip does scale
        assert abs(r["total"] - r["ref_total"]) <= TOL, (g, r)
        assert r["clipped_err"] <= TOL and r["weight_err"] <= TOL, (g, r)
        assert r["clipped_norm"] < 0.1  # this rank's stage's share of the clipped norm
    names = {n for c in on_4 for n in c["clip_adamw"]["names"]}
    assert names == set(on_4[0]["1f1b"]["model"])


@pytest.fixture(scope="module")
def on_8() -> list[dict[str, Any]]:
    return run_on_gloo(W.data_parallel_on_8, 8, timeout=300)


@pytest.mark.parametrize(("case", "stages"), [("1f1b", 2), ("interleaved_sp", 4)])
def test_pp2_dp2_tp2_data_parallel_is_the_mean_over_dp_ranks(
    on_8: list[dict[str, Any]], case: str, stages: int
) -> None:
    """Each dp rank its own batch: the loss is this rank's batch's, the gradient the mean of the
    two batches' (checked against the mean, to 1e-9, so a missing reduction fails); a second
    step without ``zero_grad`` adds its dp-mean gradient to the first's."""
    got = [r[case] for r in on_8]
    _check_case(got, layers=4, stages=stages)
    assert [(r["pp"], r["dp"]) for r in on_8] == [
        (p, d) for p in (0, 1) for d in (0, 1) for _ in "tp"
    ]
    for g, r in enumerate(got):
        assert abs(r["loss"] - r["other_loss"]) > 1e-3  # the dp ranks' data differ
        # a second step accumulates: the sum of the two steps' dp-mean gradients
        acc = r["accumulated"]
        assert acc["loss_err"] <= TOL and acc["grad_err"] <= TOL, (g, acc)


# ----------------------------------------------------------------------------- faults
@pytest.fixture(scope="module")
def faults() -> list[dict[str, Any]]:
    return run_on_gloo(W.faults_on_4, 4, timeout=300)


def test_ranks_with_different_schedules_raise_and_recover(faults: list[dict[str, Any]]) -> None:
    """4 micro-batches on pp=0, 2 on pp=1: the pp=1 ranks raise at their first receive (the
    header says the sender's pipeline), dropping the groups so that the pp=0 ranks raise at
    once too (in the receive of the first gradient, or a send of the warm-up's activations);
    none hangs until the timeout or computes on. Then ``reset()`` and a step equal to one
    device. The same for pipelines of equal counts over different layer splits."""
    for g, r in enumerate(faults):
        e = r["mismatch"]
        assert e["fastdist"] and e["type"] == "CommError", (g, e)
        assert e["elapsed"] < W.TIMEOUT, (g, e)  # no wait for the timeout
        if r["pp"] == 1:
            assert e["msg"].startswith(
                f"fastdist.pipeline recv(axis='pp') on rank {g} (group ranks [{g - 2}, {g}]): "
                f"expected the activation of micro-batch 0 from stage 0 (pp=0, rank {g - 2}) for "
                f"stage 1, but pp=0 (rank {g - 2}) sent F0 of stage 1 from a pipeline of 4 "
                "micro-batches over 2 stages (this rank: 2 over 2): the ranks run different "
                "schedules. Fix: build the Pipeline with the same schedule"
            ), e["msg"]
        else:  # waiting for the first gradient, or still sending the warm-up's activations
            assert _names_the_transfer(e["msg"], g, g + 2), e["msg"]
        after = r["after_mismatch"]
        assert after["loss_err"] <= TOL and after["grad_err"] <= TOL, (g, after)
        # the same counts, another layer split: the checksum tells
        e = r["split"]
        assert e["fastdist"] and e["type"] == "CommError" and e["elapsed"] < W.TIMEOUT, (g, e)
        if r["pp"] == 1:
            assert (
                "from a pipeline of 2 micro-batches over 2 stages (this rank: 2 over 2, but "
                "another schedule or layer split): the ranks run different schedules"
            ) in e["msg"], e["msg"]
        else:
            assert _names_the_transfer(e["msg"], g, g + 2), e["msg"]


def test_a_stage_rank_that_raises_mid_step_is_named_and_pipe_reset_recovers(
    faults: list[dict[str, Any]],
) -> None:
    """Rank 3 (pp=1, tp=1) raises in its second forward, and drops the groups of the mesh and of
    its stage mesh on the way out: its peers raise a fastdist error at once, not at the mesh's
    timeout. Ranks 0 and 1 are in their receive of a gradient from stage 1 (naming it and the
    peer) or, when their own pp peer dropped the groups first, in a transfer or a collective of
    a mesh already dropped (naming this step's failure), or in their own stage's collective
    whose peer left it (naming the collective's slice); rank 2, the stage peer, in the stage's
    collective or a transfer. Then ``pipe.reset()`` on every rank (resetting the mesh alone leaves
    the stage mesh broken) and a step equal to one device."""
    assert faults[3]["raised"]["type"] == "RuntimeError"
    assert faults[3]["raised"]["msg"] == "injected failure in the stage's forward"
    for g in (0, 1, 2):
        e = faults[g]["raised"]
        assert e["fastdist"] and e["type"] in ("CommError", "CollectiveTimeout"), (g, e)
        assert e["elapsed"] < W.TIMEOUT - 1, (g, e)  # no wait for the timeout
        assert (
            "the pipeline step failed on this rank" in e["msg"]  # a group dropped by a peer
            or "micro-batch" in e["msg"]  # the transfer it was in
            or "slice pp=" in e["msg"]  # a stage's collective (its peer left it)
        ), (g, e["msg"])
    for g in (0, 1):
        msg = faults[g]["raised"]["msg"]
        if msg.startswith("fastdist.pipeline recv"):
            assert re.match(
                rf"fastdist\.pipeline recv\(axis='pp'\) on rank {g} "
                rf"\(group ranks \[{g}, {g + 2}\]\).*the gradient of micro-batch [01] "
                rf"from stage 1 \(pp=1, rank {g + 2}\) for stage 0",
                msg,
            ), msg
    for g, r in enumerate(faults):
        after = r["after_raised"]
        assert after["loss_err"] <= TOL and after["grad_err"] <= TOL, (g, after)


def test_a_stage_that_exits_mid_step_makes_its_peers_raise_within_the_timeout(
    tmp_path: Any,
) -> None:
    """The pp=1 ranks ``os._exit(3)`` in their second forward: the pp=0 ranks raise a fastdist
    error within the mesh's timeout plus the roll call, and never hang. The first to fail names
    the transfer it was in (the gradient of micro-batch 0 or 1 from stage 1, or the sending of
    an activation to it), the peer and its rank; when the two pp=0 ranks were at different
    points (one got micro-batch 0's gradient before the exit, the other not), the one already in
    the backward raises in its stage's collective when the other process ends."""
    with pytest.raises(fd.GlooRunError) as info:
        run_on_gloo(W.stage_exits, 4, str(tmp_path), timeout=300, grace=W.TIMEOUT + 10)
    assert info.value.exitcodes == {0: 0, 1: 0, 2: 3, 3: 3}, info.value
    named = 0
    for g in (0, 1):
        r = torch.load(os.path.join(tmp_path, f"rank{g}.pt"))
        assert r["pp"] == 0 and r["fastdist"], r
        assert r["type"] in ("CommError", "CollectiveTimeout"), r
        assert r["elapsed"] < W.TIMEOUT + 4, r
        mine = _names_the_transfer(r["msg"], g, g + 2)
        named += mine
        assert mine or r["msg"].startswith(
            f"fastdist.psum(axis='tp') on rank {g} (group ranks [0, 1]): the collective (slice "
            "pp=0: global ranks [0, 1]) failed"
        ), r["msg"]
    assert named >= 1
