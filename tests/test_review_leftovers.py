"""Three gaps a demanding user would hit, closed and checked against one device in float64.

1. `fastdist.train.DataParallel` broadcasts buffers as torch's DDP does (``broadcast_buffers=
   True``): before, BatchNorm's running statistics stayed per rank and the ranks' models gave
   different outputs in eval mode (2 gloo ranks, 3 steps: eval outputs 0.16 apart, running
   variance 0.69). Now every rank's buffers and eval output equal one device's (rank 0's
   statistics) and DDP's, bit for bit (tests/review_leftovers_worker.py).
2. ``fastdist.checkpoint.load(..., strict=False)`` reports the keys it skipped
   (``missing_keys`` / ``unexpected_keys``, torch's ``load_state_dict`` contract).
3. ``label_smoothing=`` of the vocabulary-parallel losses is ``F.cross_entropy``'s (it was
   refused): loss and gradient equal one device on simulated tp ranks, in row chunks, with a
   padded vocabulary and ``ignore_index``, compiled, and on 2 gloo ranks.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import fastdist as fd
import fastdist.nn.loss as loss_module
from tests.dist_harness import run_on_gloo

F64 = torch.float64


# ============================================================================ 1. buffers
def test_data_parallel_broadcasts_buffers_as_ddp_on_gloo() -> None:
    """BatchNorm on 2 gloo ranks fed different data, 3 steps of two micro-batches (the first
    under no_sync), then an eval forward: every rank's buffers, weights and eval output equal one
    device's (the mean gradient, rank 0's running statistics) and torch's DDP's, for fastdist's
    engine, engine="ddp" and engine="fsdp". With ``broadcast_buffers=False`` (what fastdist did
    before) rank 1's differ: the check can fail."""
    from tests.review_leftovers_worker import buffers_as_ddp

    got = run_on_gloo(buffers_as_ddp, 2, timeout=300)
    ref_state, ref_out = got[0]["reference"]
    exact = {"rtol": 1e-13, "atol": 1e-13}
    for name in ("fastdist", "ddp", "engine-ddp", "fsdp"):
        for rank in (0, 1):
            out, state = got[rank][name]
            torch.testing.assert_close(out, ref_out, **exact, msg=f"{name} rank {rank}")
            for key, value in state.items():
                torch.testing.assert_close(value, ref_state[key], **exact, msg=f"{name} {key}")
    # the old behaviour: rank 1 keeps its own statistics and its eval output differs
    out, state = got[1]["off"]
    assert float((state["1.running_var"] - ref_state["1.running_var"]).abs().max()) > 0.1
    assert float((out - ref_out).abs().max()) > 0.05
    torch.testing.assert_close(got[0]["off"][0], ref_out, **exact)
    # sync_buffers() by hand: rank 1 holds rank 0's buffers
    for key, value in got[0]["by-hand"][1].items():
        assert torch.equal(got[1]["by-hand"][1][key], value), key
    # a non-persistent buffer is the rank's own (and without a persistent one, no collective)
    assert [got[r]["own-cache"].tolist() for r in (0, 1)] == [[0.0, 0.0], [1.0, 1.0]]


def test_broadcast_buffers_argument_and_simulated_ranks() -> None:
    """A non-bool ``broadcast_buffers`` raises; on simulated ranks (one copy of each buffer for
    every rank) the broadcast is nothing and an eval-mode BatchNorm model trains as one device."""
    mesh = fd.Mesh({"dp": 2})
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).to(F64).eval()
    net[1].running_mean.uniform_()
    pm = fd.nn.parallelize(copy.deepcopy(net), mesh, {})
    with pytest.raises(fd.errors.MeshError, match="broadcast_buffers='yes' must be True or False"):
        fd.train.DataParallel(pm, "dp", broadcast_buffers="yes")  # type: ignore[arg-type]
    dp = fd.train.DataParallel(pm, "dp")
    x = torch.randn(2, 5, 3, dtype=F64)
    pm(x).pow(2).mean((1, 2)).sum().backward()  # each rank's own loss
    dp.sync_buffers()
    net(x.reshape(10, 3)).pow(2).sum().div(10 * 4).backward()
    for name, g in pm.grads().items():
        torch.testing.assert_close(g, dict(net.named_parameters())[name].grad)
    assert torch.equal(pm.module[1].running_mean, net[1].running_mean)


# ============================================================================ 2. load's keys
def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4), torch.nn.LayerNorm(4)
    ).to(F64)


_PLAN = {"0": fd.nn.ColwiseParallel(input="replicated"), "2": fd.nn.RowwiseParallel()}


def test_load_strict_false_reports_skipped_keys_safetensors(tmp_path: Path) -> None:
    """A state dict (and a ``.safetensors`` file) without ``3.bias`` and with an extra key: a
    strict load raises; ``strict=False`` loads the rest and names both (as torch's
    ``load_state_dict`` does on the single-device model), ``3.bias`` left as it was."""
    from safetensors.torch import save_file

    one = _mlp()
    source = {k: v + 1 for k, v in one.state_dict().items() if k != "3.bias"}
    source["head.weight"] = torch.ones(2, dtype=F64)
    want = one.load_state_dict(source, strict=False)
    assert (want.missing_keys, want.unexpected_keys) == (["3.bias"], ["head.weight"])
    save_file(source, str(tmp_path / "w.safetensors"))
    for src in (source, tmp_path / "w.safetensors"):
        pm = fd.nn.parallelize(_mlp(), fd.Mesh({"tp": 2}), _PLAN)
        bias = pm.module[3].bias.clone()
        with pytest.raises(fd.errors.CheckpointError, match="missing keys"):
            fd.checkpoint.load(src, pm)
        got = fd.checkpoint.load(src, pm, strict=False)
        assert got == {} and got.missing_keys == want.missing_keys
        assert got.unexpected_keys == want.unexpected_keys
        assert torch.equal(pm.module[3].bias, bias)
        assert all(
            torch.equal(pm.state_dict()[k], v) for k, v in one.state_dict().items() if k != "3.bias"
        )
    # rename=: unexpected keys under the checkpoint's names, missing ones under the model's
    pm = fd.nn.parallelize(_mlp(), fd.Mesh({"tp": 2}), _PLAN)
    got = fd.checkpoint.load(source, pm, strict=False, rename={"3.weight": "norm.w"})
    assert got.missing_keys == ["3.bias", "3.weight"]
    assert got.unexpected_keys == ["3.weight", "head.weight"]
    full = fd.checkpoint.load(one.state_dict(), pm)
    assert (full.missing_keys, full.unexpected_keys) == ([], [])


def test_load_strict_false_reports_skipped_keys_dcp(tmp_path: Path) -> None:
    """A distributed checkpoint of a model with an extra module, loaded into one without it and
    with a module of its own: ``strict=False`` names both sides; the extra values still come
    back as the dict."""
    saved = torch.nn.Sequential(_mlp(), torch.nn.Linear(4, 2).to(F64))
    pm = fd.nn.parallelize(saved, fd.Mesh({"tp": 2}), {f"0.{k}": v for k, v in _PLAN.items()})
    fd.checkpoint.save(tmp_path / "ck", pm, extra={"step": 7})
    other = torch.nn.Sequential(_mlp(), torch.nn.Identity(), torch.nn.LayerNorm(4).to(F64))
    pm2 = fd.nn.parallelize(other, fd.Mesh({"tp": 4}), {f"0.{k}": v for k, v in _PLAN.items()})
    with pytest.raises(fd.errors.CheckpointError, match="missing keys"):
        fd.checkpoint.load(tmp_path / "ck", pm2)
    got = fd.checkpoint.load(tmp_path / "ck", pm2, strict=False)
    assert got == {"step": 7} and got["step"] == 7
    assert got.missing_keys == ["2.bias", "2.weight"]
    assert got.unexpected_keys == ["1.bias", "1.weight"]
    for key, value in pm.state_dict().items():
        if key.startswith("0."):
            assert torch.equal(pm2.state_dict()[key], value), key
    same = fd.checkpoint.load(tmp_path / "ck", pm)
    assert same == {"step": 7} and (same.missing_keys, same.unexpected_keys) == ([], [])


def test_load_strict_false_reports_skipped_keys_of_a_pipeline() -> None:
    """A pipeline (pp 2 x tp 2, simulated) from a state dict without one layer's weight and
    with a key no stage reads: each stage reads its part of the whole model's checkpoint, so a
    key only another stage reads is not unexpected; the result names what the pipeline lacks
    and what nothing read, as ``load_state_dict`` on the one-device model."""
    from tests.test_pipeline import llama

    ref = llama(4)
    source = {k: v for k, v in ref.state_dict().items() if k != "model.layers.3.mlp.up_proj.weight"}
    source["model.extra.weight"] = torch.ones(3, dtype=F64)
    want = llama(4).load_state_dict(source, strict=False)
    pipe = fd.train.pipeline(llama(4, seed=1), fd.Mesh({"pp": 2, "tp": 2}), microbatches=2)
    got = fd.checkpoint.load(source, pipe, strict=False)
    assert got == {} and got.missing_keys == want.missing_keys
    assert got.unexpected_keys == want.unexpected_keys == ["model.extra.weight"]


# ============================================================================ 3. smoothing
def _shards(full: Tensor, n: int) -> Tensor:
    return torch.stack(full.chunk(n, -1)).requires_grad_()


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "row-chunks"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    ("n", "vocab", "ignore_index", "eps"),
    [(2, 12, -100, 0.1), (3, 10, -1, 0.25), (4, 13, 2, 1.0), (2, 11, -100, 0.0)],
    ids=["tp2", "tp3-padded", "tp4-padded-ignore-a-class", "tp2-padded-no-smoothing"],
)
def test_cross_entropy_label_smoothing_equals_one_device(
    n: int,
    vocab: int,
    ignore_index: int,
    eps: float,
    reduction: str,
    chunked: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``fd.nn.cross_entropy(..., label_smoothing=eps)`` on simulated tp ranks ==
    ``F.cross_entropy`` of the whole (unpadded) vocabulary, loss and gradient, float64 (the
    padding columns get no gradient; tokens labelled ``ignore_index`` none either)."""
    if chunked:
        monkeypatch.setattr(loss_module, "_CHUNK_ELEMS", 7)  # a row or two per chunk
    cols = -(-vocab // n) * n
    g = torch.Generator().manual_seed(n * 100 + vocab)
    full = torch.randn(3, 5, cols, generator=g, dtype=F64) * 3
    target = torch.randint(0, vocab, (3, 5), generator=g)
    target[0, 1], target[2, :] = ignore_index, ignore_index
    mesh = fd.Mesh({"tp": n})
    shards = _shards(full, n)

    def par(lg: Tensor) -> Tensor:
        return fd.nn.cross_entropy(
            lg,
            target,
            mesh,
            ignore_index=ignore_index,
            reduction=reduction,  # type: ignore[arg-type]
            vocab_size=vocab,
            label_smoothing=eps,
        )

    out = fd.simulate(par, mesh)(shards)
    ref_in = full[..., :vocab].clone().requires_grad_()
    ref = F.cross_entropy(
        ref_in.reshape(-1, vocab),
        target.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=eps,
    ).reshape(out.shape[1:])
    for r in range(n):
        torch.testing.assert_close(out[r], ref, rtol=1e-13, atol=1e-13)
    weights = torch.rand(ref.shape, generator=g, dtype=F64)
    (ref * weights).sum().backward()
    (out * weights).sum().backward()  # rank r's copy carries rank r's columns' gradient
    assert shards.grad is not None and ref_in.grad is not None
    grad = torch.cat(list(shards.grad), -1)
    torch.testing.assert_close(grad[..., :vocab], ref_in.grad, rtol=1e-13, atol=1e-13)
    assert torch.equal(grad[..., vocab:], torch.zeros_like(grad[..., vocab:]))


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("num_items", [None, 9])
def test_causal_lm_losses_label_smoothing_equal_one_device(
    gathered: bool, num_items: int | None
) -> None:
    """``causal_lm_loss`` / ``gathered_causal_lm_loss`` with ``label_smoothing=0.2`` (and a padded
    vocabulary, -100 labels, ``num_items_in_batch``) == ``F.cross_entropy`` on the shifted labels,
    loss and gradient."""
    from fastdist.nn.loss import gathered_causal_lm_loss

    mesh = fd.Mesh({"tp": 2})
    full = torch.randn(2, 6, 8, dtype=F64, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([[1, 4, -100, 2, 6, 0], [-100, -100, 3, 5, 5, 1]])
    kw = {"vocab_size": 7, "label_smoothing": 0.2, "num_items_in_batch": num_items}
    if gathered:
        logits = full.expand(2, *full.shape).clone().requires_grad_()
        out = fd.simulate(lambda lg: gathered_causal_lm_loss(lg, labels, mesh, **kw), mesh)(logits)
    else:
        logits = _shards(full, 2)
        out = fd.simulate(lambda lg: fd.nn.causal_lm_loss(lg, labels, mesh, **kw), mesh)(logits)
    ref_in = full.clone().requires_grad_()
    per = F.cross_entropy(
        ref_in[:, :-1, :7].reshape(-1, 7),
        labels[:, 1:].reshape(-1),
        label_smoothing=0.2,
        reduction="sum" if num_items else "mean",
    )
    ref = per / num_items if num_items else per
    torch.testing.assert_close(out, ref.detach().expand(2), rtol=1e-13, atol=1e-13)
    out.sum().backward()
    ref.backward()
    assert logits.grad is not None and ref_in.grad is not None
    grad = logits.grad[0] if gathered else torch.cat(list(logits.grad), -1)
    torch.testing.assert_close(grad, ref_in.grad, rtol=1e-13, atol=1e-13)


def test_model_forward_with_label_smoothing_equals_one_device() -> None:
    """``pm(input_ids=, labels=, label_smoothing=0.1)`` of a tp=2 Llama (transformers passes the
    keyword to the model's loss_function, whose own ForCausalLMLoss drops it): the loss and the
    gradients of F.cross_entropy with label smoothing on one device."""
    from tests import tiny_models
    from tests.test_hf_models import VOCAB, batch

    ref = tiny_models.build("llama")
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(copy.deepcopy(ref), mesh, fd.nn.plans.plan(ref, family="llama"))
    ids, labels = batch(0)
    rep = {"input_ids": ids.expand(2, *ids.shape), "labels": labels.expand(2, *labels.shape)}
    loss = pm(**rep, label_smoothing=0.1).loss
    logits = ref(input_ids=ids).logits
    want = F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), label_smoothing=0.1
    )
    plain = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    assert abs(float((want - plain).detach())) > 1e-3  # the smoothing changes the loss
    torch.testing.assert_close(loss, want.detach().expand(2), rtol=1e-12, atol=1e-12)
    loss.sum().backward()  # every rank its own copy
    want.backward()
    named = dict(ref.named_parameters())
    for name, g in pm.grads().items():
        torch.testing.assert_close(g, named[name].grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.1"])
def test_label_smoothing_out_of_range_raises(bad: Any) -> None:
    """``F.cross_entropy`` takes a float in [0, 1]; anything else raises naming the keyword."""
    mesh = fd.Mesh({"tp": 2})
    logits = torch.zeros(2, 3, 4, dtype=F64)
    for fn in (
        lambda lg: fd.nn.cross_entropy(lg, torch.tensor([0, 1, 2]), mesh, label_smoothing=bad),
        lambda lg: fd.nn.vocab_parallel_cross_entropy(
            lg, torch.tensor([0, 1, 2]), mesh, label_smoothing=bad
        ),
        lambda lg: fd.nn.causal_lm_loss(
            lg[None], torch.tensor([[0, 1, 2]]), mesh, label_smoothing=bad
        ),
    ):
        with pytest.raises(fd.errors.CollectiveError, match="label_smoothing="):
            fd.simulate(fn, mesh)(logits)


def test_label_smoothing_low_precision_and_vocab_parallel_per_token() -> None:
    """bfloat16 logits compute in float32 (as without smoothing); ``vocab_parallel_cross_entropy``
    gives the per-token smoothed loss (0 for -100)."""
    mesh = fd.Mesh({"tp": 2})
    full = torch.randn(4, 8, dtype=F64, generator=torch.Generator().manual_seed(5))
    target = torch.tensor([7, -100, 0, 3])
    per = fd.simulate(
        lambda lg: fd.nn.vocab_parallel_cross_entropy(lg, target, mesh, label_smoothing=0.3), mesh
    )(torch.stack(full.chunk(2, -1)))
    ref = F.cross_entropy(full, target, label_smoothing=0.3, reduction="none")
    torch.testing.assert_close(per[1], ref, rtol=1e-13, atol=1e-13)
    low = full.to(torch.bfloat16)
    got = fd.simulate(lambda lg: fd.nn.cross_entropy(lg, target, mesh, label_smoothing=0.3), mesh)(
        torch.stack(low.chunk(2, -1))
    )
    assert got.dtype == torch.float32
    torch.testing.assert_close(
        got[0], F.cross_entropy(low.float(), target, label_smoothing=0.3), rtol=1e-6, atol=1e-6
    )


def test_label_smoothing_compiled_fullgraph_equals_one_device() -> None:
    """torch.compile(fullgraph=True) of a simulated step (the plain-ops path, a padded
    vocabulary): the same loss and gradient."""
    mesh = fd.Mesh({"tp": 4})
    full = torch.randn(2, 3, 12, dtype=F64, generator=torch.Generator().manual_seed(2))
    target = torch.tensor([[9, -100, 0], [4, 5, -100]])
    step = torch.compile(
        fd.simulate(
            lambda lg, t: fd.nn.cross_entropy(lg, t, mesh, vocab_size=10, label_smoothing=0.2),
            mesh,
        ),
        fullgraph=True,
    )
    shards = _shards(full, 4)
    out = step(shards, target.expand(4, 2, 3).clone())
    ref_in = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_in[..., :10].reshape(-1, 10), target.reshape(-1), label_smoothing=0.2)
    torch.testing.assert_close(out, ref.detach().expand(4), rtol=1e-12, atol=1e-12)
    out.sum().backward()
    ref.backward()
    assert shards.grad is not None and ref_in.grad is not None
    torch.testing.assert_close(
        shards.grad, torch.stack(ref_in.grad.chunk(4, -1)), rtol=1e-12, atol=1e-12
    )


def test_label_smoothing_on_gloo() -> None:
    from tests.review_leftovers_worker import label_smoothing_on_gloo

    assert run_on_gloo(label_smoothing_on_gloo, 2, timeout=300) == ["ok"] * 2
