"""Context parallelism inside pipeline stages (`fastdist.train.pipeline` with a plan holding
`CausalContextParallel`) on simulated ranks against one device, in float64: pp=2 x cp=2 (ring
and Ulysses, zig-zag and contiguous layouts; GPipe, 1F1B and interleaved 1F1B) for Llama and
Qwen3, pp x cp x tp, pp x dp x cp with different data per data rank, and left padding with
position ids; the loss and every parameter's gradient equal one device's, with ignored labels
(-100) spread unevenly over the cp ranks' shards. What cannot be right is refused. Then
pp=2 x cp=2 on four gloo processes (1F1B ring, GPipe Ulysses, 1F1B Ulysses with
``logits="split"``).

How the stages split the tokens: every stage's base model takes this rank's positions and masks
(the whole batch reaches every stage), the first stage cuts its embedding output to the rank's
chunks, the activations travel between the stages split (each cp rank to the same cp rank of the
next stage), and the last stage gathers its final norm's output, so the head and the loss see
the whole sequence, exactly as context parallelism without a pipeline. With
``CausalContextParallel(logits="split")`` the last stage does not gather: its head and loss run
on each rank's own tokens (the micro-batch's labels shifted over the whole sequence, then cut),
each micro-batch's loss is its ranks' summed losses over the whole batch's count of predicted
tokens, summed over cp.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor

import fastdist as fd
from fastdist import PipelineError
from tests.test_pipeline import (
    FAMILIES,
    TOL,
    VOCAB,
    assert_grads,
    check_left_padding,
    family_model,
    hand_loss,
    llama,
    rep,
)

transformers = pytest.importorskip("transformers")

S = 16  # tokens: 2 x cp chunks of 4 (zig-zag at cp=2)


def make_batch(seed: int, B: int = 4) -> tuple[Tensor, Tensor]:
    """(input_ids, labels) [B, S] with ignored labels (-100) spread unevenly over the cp ranks'
    zig-zag shards (cp=2: rank 0 holds tokens 0-3 and 12-15, rank 1 tokens 4-11): row 1 ignores
    every label of rank 1's shard, row 0 most of rank 0's, so the two shards predict different
    numbers of tokens (a mean of per-shard means would differ from one device's mean)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    labels[0, 12:15] = -100
    labels[1, 4:12] = -100
    labels[B - 1, -2] = -100
    return ids, labels


def shard_counts(labels: Tensor, n: int) -> list[int]:
    """Predicted tokens (shifted labels not -100) of each of ``n`` ranks' zig-zag shards."""
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    chunks = shifted.chunk(2 * n, dim=1)
    return [int((torch.cat([chunks[r], chunks[2 * n - 1 - r]], 1) != -100).sum()) for r in range(n)]


def cp_plan(ref: Any, mesh: fd.Mesh, **cp: Any) -> dict[str, Any]:
    """The family's ready plan over the stage mesh (``mesh`` without pp) with the tokens split
    over ``cp``."""
    style = fd.nn.CausalContextParallel("cp", **cp)
    return fd.nn.plans.plan(ref, mesh.without("pp"), context_parallel=style)


def check_step(
    ref: Any,
    mesh: fd.Mesh,
    schedule: str,
    *,
    virtual: int = 1,
    tol: dict[str, float] = TOL,
    **cp: Any,
) -> None:
    """A step of ``ref``'s pipeline over ``mesh`` with the tokens split over cp: the loss and
    every gradient equal one device's. With ``logits="split"`` the last stage's LM head must
    see each rank's ``S / cp`` tokens (with the default, the whole ``S``)."""
    pipe = fd.train.pipeline(
        copy.deepcopy(ref),
        mesh,
        schedule=schedule,
        microbatches=2,
        virtual=virtual,
        plan=cp_plan(ref, mesh, **cp),
    )
    seen: list[int] = []
    for pm in pipe.stages.values():  # the last stage's head (the others never reach theirs)
        pm.module.lm_head.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[-2]))
    ids, labels = make_batch(1)
    assert len(set(shard_counts(labels, mesh.axis_size("cp")))) > 1  # uneven per shard
    loss_ref = hand_loss(ref, ids, labels)
    loss_ref.backward()
    loss = pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, rep(loss_ref.detach(), mesh), **tol)
    assert_grads(pipe, ref, tol)
    split = cp.get("logits") == "split"
    assert set(seen) == {S // mesh.axis_size("cp") if split else S}


# ============================================================================ pp x cp
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_pp2_cp2_equals_one_device(family: str, schedule: str, mode: str) -> None:
    ref = llama(4) if family == "llama" else family_model("qwen3", layers=4)
    check_step(ref, fd.Mesh({"pp": 2, "cp": 2}), schedule, mode=mode)


def test_interleaved_and_contiguous_layout_equal_one_device() -> None:
    """Two stages per rank (each its own base model and split state), and the contiguous
    layout (rank r holds block r)."""
    mesh = fd.Mesh({"pp": 2, "cp": 2})
    check_step(llama(4), mesh, "interleaved_1f1b", virtual=2)
    check_step(llama(4), mesh, "1f1b", layout="contiguous", mode="ulysses")


def test_pp2_cp2_tp2_equals_one_device() -> None:
    """pp x cp x tp: each stage's layers split over tp (heads, vocabulary-parallel head) and
    their tokens over cp."""
    check_step(llama(4), fd.Mesh({"pp": 2, "cp": 2, "tp": 2}), "1f1b")


def test_pp2_dp2_cp2_equals_one_device() -> None:
    """pp x dp x cp, a different batch per data rank: the mean of the data ranks' losses."""
    ref = llama(4)
    mesh = fd.Mesh({"pp": 2, "dp": 2, "cp": 2})
    pipe = fd.train.pipeline(
        copy.deepcopy(ref), mesh, schedule="1f1b", microbatches=2, plan=cp_plan(ref, mesh)
    )
    fd.train.DataParallel(pipe, "dp")
    batches = [make_batch(3 + 17 * i) for i in range(2)]
    index = [mesh.coords(r)["dp"] for r in range(mesh.size)]
    ids = torch.stack([batches[i][0] for i in index])
    labels = torch.stack([batches[i][1] for i in index])
    loss = pipe.step(input_ids=ids, labels=labels)
    losses = [hand_loss(ref, i, lab) for i, lab in batches]
    (sum(losses) / 2).backward()
    want = torch.stack([losses[i].detach() for i in index])
    torch.testing.assert_close(loss, want, **TOL)
    assert_grads(pipe, ref)


@pytest.mark.parametrize("logits", ["gathered", "split"])
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_padding_mask_and_positions_are_the_ranks_own(mode: str, logits: str) -> None:
    """Left-padded rows with their position ids: every stage masks the padding keys and rotates
    its tokens by their own positions (a stage that took the whole mask or positions, or none,
    would differ from one device)."""
    ref = llama(4)
    ids, labels = make_batch(5)
    mesh = fd.Mesh({"pp": 2, "cp": 2})
    check_left_padding(
        ref,
        ids,
        labels,
        {0: 6, 2: 3},
        mesh,
        lambda model: fd.train.pipeline(
            model,
            mesh,
            schedule="1f1b",
            microbatches=2,
            plan=cp_plan(ref, mesh, mode=mode, logits=logits),
        ),
    )


def test_the_stages_attention_is_the_context_attention() -> None:
    """Every stage's decoder layers run the context-parallel attention: the layers a stage takes
    over read the model's config, which the stages share (a copy per stage left the layers on
    the single-device attention over the rank's tokens alone: the loss was off by 5e-3)."""
    ref = llama(4)
    mesh = fd.Mesh({"pp": 2, "cp": 2})
    pipe = fd.train.pipeline(copy.deepcopy(ref), mesh, plan=cp_plan(ref, mesh))
    for pm in pipe.stages.values():
        for i in pipe.layers[next(j for j, p in pipe.stages.items() if p is pm)]:
            attn = pm.module.model.layers[i].self_attn
            assert attn.config._attn_implementation == "fastdist_context"


# ============================================================================ logits="split"
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_split_logits_pp2_cp2_equals_one_device(schedule: str, mode: str) -> None:
    """``logits="split"``: the last stage's norm, head and loss on each cp rank's own S/cp
    tokens (the labels shifted over the whole micro-batch's sequence, then cut: a shard's last
    token predicts a label of another rank's shard), each micro-batch's loss summed over cp and
    divided by the WHOLE batch's count (the -100s fall unevenly over the shards: a mean of
    per-shard or per-micro-batch means would differ)."""
    check_step(llama(4), fd.Mesh({"pp": 2, "cp": 2}), schedule, mode=mode, logits="split")


def test_split_logits_with_tp_interleaved_contiguous_and_tied_embeddings() -> None:
    """``logits="split"`` with a vocabulary-parallel head (pp x cp x tp), two stages per rank,
    the contiguous layout, Mixtral (its experts' own pvary), and Gemma's embeddings tied across
    the first and the last stage (the head's gradient of the rank's tokens summed over cp, then
    with the embedding's)."""
    mesh = fd.Mesh({"pp": 2, "cp": 2})
    check_step(llama(4), fd.Mesh({"pp": 2, "cp": 2, "tp": 2}), "1f1b", logits="split")
    check_step(llama(4), mesh, "interleaved_1f1b", virtual=2, logits="split")
    check_step(llama(4), mesh, "1f1b", layout="contiguous", mode="ulysses", logits="split")
    check_step(family_model("mixtral", layers=4), mesh, "1f1b", logits="split")
    ref = family_model("gemma", tie=True, layers=4)
    tol = FAMILIES["gemma"][1]
    pipe = fd.train.pipeline(
        copy.deepcopy(ref), mesh, microbatches=2, plan=cp_plan(ref, mesh, logits="split")
    )
    ids, labels = make_batch(2)
    loss_ref = hand_loss(ref, ids, labels)
    loss_ref.backward()
    loss = pipe.step(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    torch.testing.assert_close(loss, rep(loss_ref.detach(), mesh), **tol)
    grads = pipe.grads()
    assert pipe.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert torch.equal(grads.pop("lm_head.weight"), grads["model.embed_tokens.weight"])
    want = {n: p.grad for n, p in ref.named_parameters()}
    assert grads.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_split_logits_with_shift_labels_equals_one_device() -> None:
    """Labels already shifted (``shift_labels=``, transformers' aligned form) with
    ``logits="split"``: cut to the rank's tokens as given (not shifted again)."""
    ref = llama(4)
    mesh = fd.Mesh({"pp": 2, "cp": 2})
    pipe = fd.train.pipeline(
        copy.deepcopy(ref), mesh, microbatches=2, plan=cp_plan(ref, mesh, logits="split")
    )
    ids, labels = make_batch(4)
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    loss_ref = hand_loss(ref, ids, labels)
    loss_ref.backward()
    loss = pipe.step(input_ids=rep(ids, mesh), shift_labels=rep(shifted, mesh))
    torch.testing.assert_close(loss, rep(loss_ref.detach(), mesh), **TOL)
    assert_grads(pipe, ref)


# ============================================================================ refused
def test_a_length_the_chunks_do_not_divide_is_refused() -> None:
    ref = llama(4)
    mesh = fd.Mesh({"pp": 2, "cp": 2})
    pipe = fd.train.pipeline(copy.deepcopy(ref), mesh, plan=cp_plan(ref, mesh))
    ids, labels = make_batch(1)
    with pytest.raises(fd.nn.ParallelizeError, match="pad the batch to a multiple of 4"):
        pipe.step(input_ids=rep(ids[:, :14], mesh), labels=rep(labels[:, :14], mesh))


def test_the_diffusion_token_split_is_refused() -> None:
    """`ContextParallel` (a DiT's token split, at the first block and the output module) cannot
    be right on a causal LM's stages: refused at build time, naming CausalContextParallel."""
    model = llama(4)
    plan = {"model": fd.nn.ContextParallel("cp", blocks="layers")}
    with pytest.raises(PipelineError, match="ContextParallel.*Fix: for a decoder LLM"):
        fd.train.pipeline(model, fd.Mesh({"pp": 2, "cp": 2}), plan=plan)


# ============================================================================ gloo processes
def cp_on_4() -> dict[str, Any]:
    """A gloo worker, 4 ranks, pp=2 x cp=2 (`run_on_gloo`): each rank builds the tiny Llama and
    its one-device reference, runs a step of its own stage on the whole batch, and returns its
    loss error, largest gradient error and the names it holds gradients for, per case."""
    torch.set_num_threads(1)
    mesh = fd.connect(pp=2, cp=2, timeout=60)
    out: dict[str, Any] = {"pp": mesh.index(mesh.rank, "pp")}
    for case, schedule, mode, logits in (
        ("1f1b-ring", "1f1b", "ring", "gathered"),
        ("gpipe-ulysses", "gpipe", "ulysses", "gathered"),
        ("1f1b-ulysses-split", "1f1b", "ulysses", "split"),
    ):
        ref = llama(4)
        ids, labels = make_batch(1)
        loss_ref = hand_loss(ref, ids, labels)
        loss_ref.backward()
        pipe = fd.train.pipeline(
            copy.deepcopy(ref),
            mesh,
            schedule=schedule,
            microbatches=2,
            plan=cp_plan(ref, mesh, mode=mode, logits=logits),
        )
        loss = pipe.step(input_ids=ids, labels=labels)
        got = pipe.grads()
        want = {n: p.grad for n, p in ref.named_parameters()}
        out[case] = {
            "shape": tuple(loss.shape),
            "loss_err": abs(loss.item() - loss_ref.item()),
            "grad_err": max((got[n] - want[n]).abs().max().item() for n in got),
            "names": sorted(got),
            "model": sorted(want),
        }
    return out


def test_pp2_cp2_on_gloo_processes_equals_one_device() -> None:
    """Real ranks: each cp rank of stage 0 sends its shard of the activations to the same cp
    rank of stage 1 (and the gradients back); every rank's loss and its stage's gradients equal
    one device's, and the ranks together cover every parameter; also with ``logits="split"``
    (stage 1's head and loss on each rank's own tokens, the loss summed over cp)."""
    from tests.dist_harness import run_on_gloo

    per_rank = run_on_gloo(cp_on_4, 4, timeout=300)
    assert [r["pp"] for r in per_rank] == [0, 0, 1, 1]
    for case in ("1f1b-ring", "gpipe-ulysses", "1f1b-ulysses-split"):
        got = [r[case] for r in per_rank]
        for g, r in enumerate(got):
            assert r["shape"] == () and r["loss_err"] <= 1e-9, (case, g, r["loss_err"])
            assert r["grad_err"] <= 1e-9, (case, g, r["grad_err"])
        assert got[0]["names"] == got[1]["names"] and got[2]["names"] == got[3]["names"]
        assert not set(got[0]["names"]) & set(got[2]["names"])
        assert set(got[0]["names"]) | set(got[2]["names"]) == set(got[0]["model"])
