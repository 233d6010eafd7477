"""The vocabulary-parallel loss's chunked passes on the CPU (``nn.loss._CHUNK_ELEMS``): with chunks
of a few rows (so every path crosses chunk borders) the values and every rank's gradient equal
``F.cross_entropy`` on the unsharded float64 logits, simulated (vmap), under ``torch.func.grad``, on
real gloo ranks, for empty and non-contiguous logits; and the saved logits are guarded."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import fastdist as fd
import fastdist.nn.loss as loss_module
from fastdist import P
from fastdist.testing import assert_matches_single_device
from tests.dist_harness import run_on_gloo

F64 = torch.float64
SMALL = 7  # elements per chunk: 1-3 rows of the logits below, so chunks end mid-tensor


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_module, "_CHUNK_ELEMS", SMALL)


def full_and_target(
    shape: tuple[int, ...], cols: int, vocab: int, seed: int
) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    full = 4 * torch.randn(*shape, cols, dtype=F64, generator=g)
    full[..., vocab:] = 1e3  # padding columns: no probability, no gradient
    target = torch.randint(0, vocab, shape, generator=g)
    return full, torch.where(torch.rand(shape, generator=g) < 0.3, -100, target)


def reference(full: Tensor, target: Tensor, vocab: int, reduction: str) -> Tensor:
    out = F.cross_entropy(
        full[..., :vocab].reshape(-1, vocab), target.reshape(-1), reduction=reduction
    )
    return out.reshape(target.shape) if reduction == "none" else out


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize(
    ("tp", "shape", "v_local", "vocab"), [(2, (5, 3), 3, 6), (3, (7,), 2, 5), (4, (2, 2, 3), 1, 4)]
)
def test_chunked_loss_equals_torch_simulated(
    tp: int, shape: tuple[int, ...], v_local: int, vocab: int, reduction: str
) -> None:
    full, target = full_and_target(shape, tp * v_local, vocab, seed=tp)
    mesh = fd.Mesh({"tp": tp})
    assert_matches_single_device(
        lambda lg: fd.nn.cross_entropy(
            lg, target, mesh, "tp", vocab_size=vocab, reduction=reduction
        ),
        lambda lg: reference(lg, target, vocab, reduction),
        mesh,
        [full],
        in_specs=(P(*([None] * len(shape)), "tp"),),
        out_specs=P(),
        rtol=1e-12,
        atol=1e-12,
    )


@pytest.mark.usefixtures("small_chunks")
def test_chunked_loss_under_func_grad_and_an_outer_vmap() -> None:
    mesh, vocab = fd.Mesh({"tp": 2}), 7
    full, target = full_and_target((4, 3), 8, vocab, seed=1)
    want = torch.func.grad(lambda lg: reference(lg, target, vocab, "mean"))(full)
    shards, want_shards = torch.stack(full.chunk(2, -1)), torch.stack(want.chunk(2, -1))

    def loss(lg: Tensor) -> Tensor:
        return fd.nn.cross_entropy(lg, target, mesh, vocab_size=vocab)

    inside = fd.simulate(lambda lg: torch.func.grad(loss)(lg), mesh)(shards)
    torch.testing.assert_close(inside, want_shards, rtol=1e-12, atol=1e-12)
    batched = torch.vmap(lambda s: fd.simulate(loss, mesh)(s), in_dims=1, out_dims=1)(
        torch.stack([shards, 2 * shards], 1)
    )
    torch.testing.assert_close(batched[:, 1], fd.simulate(loss, mesh)(2 * shards))


@pytest.mark.usefixtures("small_chunks")
def test_empty_and_non_contiguous_logits() -> None:
    mesh = fd.Mesh({"tp": 1})
    empty = torch.zeros(0, 5, dtype=F64, requires_grad=True)
    out = fd.nn.cross_entropy(empty, torch.zeros(0, dtype=torch.long), mesh, reduction="none")
    assert out.shape == (0,)
    out.sum().backward()
    assert empty.grad is not None and empty.grad.shape == (0, 5)
    full, target = full_and_target((6,), 4, 4, seed=3)
    strided = full.t().contiguous().t().requires_grad_()  # (6, 4), column-major
    assert not strided.is_contiguous()
    ref_in = full.clone().requires_grad_()
    got = fd.nn.cross_entropy(strided, target, mesh, reduction="sum")
    want = reference(ref_in, target, 4, "sum")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got.backward()
    want.backward()
    assert strided.grad is not None and ref_in.grad is not None
    torch.testing.assert_close(strided.grad, ref_in.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk", [SMALL, 1 << 18])
def test_out_passes_equal_the_in_place_passes_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Plain tensors take the ``out=`` passes (the largest logit per chunk, ``sub(out=)`` into a
    reused buffer and into the gradient); a vmap level (``fd.simulate``) the in-place ones the loss
    had before. Both must give the same bits: loss and gradient, padding columns included."""
    monkeypatch.setattr(loss_module, "_CHUNK_ELEMS", chunk)
    mesh = fd.Mesh({"tp": 1})
    full, target = full_and_target((9, 5), 11, 10, seed=5)

    def loss_and_grad(lg: Tensor) -> tuple[Tensor, Tensor]:
        return torch.func.grad_and_value(
            lambda x: fd.nn.cross_entropy(x, target, mesh, vocab_size=10, reduction="sum")
        )(lg)[::-1]

    plain = full.clone().requires_grad_()
    got = fd.nn.cross_entropy(plain, target, mesh, vocab_size=10, reduction="sum")
    got.backward()
    sim_loss, sim_grad = fd.simulate(loss_and_grad, mesh)(full.unsqueeze(0))
    assert plain.grad is not None
    assert torch.equal(got.detach(), sim_loss[0]) and torch.equal(plain.grad, sim_grad[0])
    torch.testing.assert_close(got, reference(full, target, 10, "sum"), rtol=1e-12, atol=1e-12)


def test_logits_changed_in_place_before_the_backward_raise() -> None:
    """The backward recomputes the exponentials from the saved logits: changing them in place in
    between must raise, not give the gradient of other logits."""
    mesh = fd.Mesh({"tp": 1})
    leaf = torch.randn(3, 4, dtype=F64, requires_grad=True)
    logits = leaf * 1  # a non-leaf, as a head's output
    loss = fd.nn.cross_entropy(logits, torch.tensor([0, 3, 1]), mesh)
    with torch.no_grad():
        logits.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _gloo_rank(full: Tensor, target: Tensor, vocab: int) -> dict[str, Any]:
    loss_module._CHUNK_ELEMS = SMALL  # this process's module (the rank is a fresh process)
    mesh = fd.connect(tp=2, timeout=60)
    mine = full.chunk(2, -1)[mesh.rank].clone().requires_grad_()
    loss = fd.nn.causal_lm_loss(mine, target, mesh, "tp", vocab_size=vocab)
    loss.backward()
    return {"loss": loss.detach(), "grad": mine.grad}


def test_chunked_causal_lm_loss_on_two_gloo_ranks() -> None:
    vocab = 9
    full, labels = full_and_target((2, 5), 10, vocab, seed=4)
    ref_in = full.clone().requires_grad_()
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]  # token t predicts label t + 1
    want = reference(ref_in, shifted, vocab, "mean")
    want.backward()
    assert ref_in.grad is not None
    got = run_on_gloo(_gloo_rank, 2, full, labels, vocab, timeout=120)
    for rank, r in enumerate(got):
        torch.testing.assert_close(r["loss"], want.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(
            r["grad"], ref_in.grad.chunk(2, -1)[rank], rtol=1e-12, atol=1e-12
        )
