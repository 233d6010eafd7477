"""Vocabulary-parallel losses against torch / transformers on the unsharded logits: values and every
rank's gradient."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import fastdist as fd
from fastdist import P
from fastdist.errors import CollectiveError, TargetError
from fastdist.testing import assert_matches_single_device, shard_for_rank
from tests.dist_harness import run_on_gloo

F64 = torch.float64
GARBAGE = 1e3  # what the padding columns hold: must get no probability and no gradient


def make_logits(
    shape: tuple[int, ...],
    tp: int,
    v_local: int,
    vocab: int,
    dtype: torch.dtype = F64,
    seed: int = 0,
) -> Tensor:
    """Unsharded logits (*shape, tp * v_local) whose columns >= vocab are padding full of
    garbage."""
    full = torch.randn(
        *shape, tp * v_local, dtype=dtype, generator=torch.Generator().manual_seed(seed)
    )
    full[..., vocab:] = GARBAGE
    return full


def make_targets(
    shape: tuple[int, ...], vocab: int, ignore_index: int, ignored: float, seed: int = 0
) -> Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    target = torch.randint(0, vocab, shape, generator=g)
    return torch.where(torch.rand(shape, generator=g) < ignored, ignore_index, target)


def check_cross_entropy(
    mesh: fd.Mesh,
    full: Tensor,
    target: Tensor,
    vocab: int,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    check: bool = True,
) -> None:
    """cross_entropy on the vocabulary split over 'tp' == F.cross_entropy on the real columns, on
    every rank (values, gradients)."""
    kw: dict[str, Any] = {"ignore_index": ignore_index, "reduction": reduction}

    def par(logits: Tensor) -> Tensor:
        return fd.nn.cross_entropy(logits, target, mesh, "tp", vocab_size=vocab, **kw)

    def ref(logits: Tensor) -> Tensor:  # the padding columns are not part of the vocabulary
        real = logits[..., :vocab]
        return F.cross_entropy(real.reshape(-1, vocab), target.reshape(-1), **kw).reshape(
            target.shape if reduction == "none" else ()
        )

    spec = P(*([None] * (full.dim() - 1)), "tp")
    # NaN, which assert_matches_single_device cannot compare
    if reduction == "mean" and bool((target == ignore_index).all()):
        check_all_ignored_mean(mesh, full, par)
        return
    assert_matches_single_device(
        par, ref, mesh, [full], in_specs=(spec,), out_specs=P(), check=check, rtol=1e-10, atol=1e-10
    )


def check_all_ignored_mean(mesh: fd.Mesh, full: Tensor, par: Any) -> None:
    """The mean over no tokens: NaN on every rank (as F.cross_entropy), and a zero gradient (as
    F.cross_entropy's), not NaN."""
    shards = torch.stack(
        [
            shard_for_rank(full, P(*([None] * (full.dim() - 1)), "tp"), mesh, r)
            for r in range(mesh.size)
        ]
    ).requires_grad_()
    out = fd.simulate(par, mesh)(shards)
    assert out.shape == (mesh.size,) and bool(out.isnan().all())
    out.sum().backward()
    assert shards.grad is not None and torch.equal(shards.grad, torch.zeros_like(shards))


@given(
    tp=st.sampled_from([1, 2, 3, 4]),
    shape=st.sampled_from([(5,), (2, 3), (1, 2, 2)]),
    v_local=st.integers(1, 3),
    pad=st.integers(0, 3),
    ignored=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
    ignore_index=st.sampled_from([-100, -1, 0, "vocab"]),
    reduction=st.sampled_from(["none", "sum", "mean"]),
    check=st.booleans(),
    seed=st.integers(0, 99),
)
def test_cross_entropy_matches_torch(
    tp: int,
    shape: tuple[int, ...],
    v_local: int,
    pad: int,
    ignored: float,
    ignore_index: Any,
    reduction: str,
    check: bool,
    seed: int,
) -> None:
    """Any split, any padding (up to whole padding ranks), any share of ignored tokens (all of them
    too), every reduction."""
    vocab = max(1, tp * v_local - pad)
    # an ignore_index may also lie in or above the vocabulary
    ii = vocab if ignore_index == "vocab" else ignore_index
    full = make_logits(shape, tp, v_local, vocab, seed=seed)
    check_cross_entropy(
        fd.Mesh({"tp": tp}),
        full,
        make_targets(shape, vocab, ii, ignored, seed),
        vocab,
        ignore_index=ii,
        reduction=reduction,
        check=check,
    )


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_all_ignored(reduction: str) -> None:
    """Every target ignored: 0 per token, sum 0 (zero gradients), mean NaN with a zero gradient, as
    F.cross_entropy."""
    check_cross_entropy(
        fd.Mesh({"tp": 2}),
        make_logits((2, 3), 2, 3, 6),
        torch.full((2, 3), -100),
        6,
        reduction=reduction,
    )


def test_padded_vocabulary_10_over_4_ranks() -> None:
    """Vocabulary 10 split over tp=4 as 4 x 3 columns: columns 10, 11 (rank 3) hold 1e3 and do not
    matter; a target of 9 is on rank 3."""
    mesh = fd.Mesh({"tp": 4})
    full = make_logits((4, 2), 4, 3, 10)
    target = torch.tensor([[9, 0], [-100, 5], [3, 9], [8, -100]])
    for reduction in ("none", "sum", "mean"):
        check_cross_entropy(mesh, full, target, 10, reduction=reduction)
    out = fd.simulate(
        lambda lg: fd.nn.cross_entropy(lg, target, mesh, vocab_size=10, reduction="none"), mesh
    )(torch.stack(full.chunk(4, -1)))
    # with the garbage counted, every loss would be ~1e3
    assert bool(torch.isfinite(out).all()) and out.max() < 100


def test_rank_of_padding_only_and_very_negative_logits() -> None:
    """Vocabulary 5 over tp=4 as 4 x 2 columns: rank 3 holds padding only (its largest logit is
    -inf), and the real logits sit near -1e4 (a shift by 0 would underflow every exponential):
    values and gradients as F.cross_entropy's."""
    mesh = fd.Mesh({"tp": 4})
    full = make_logits((3, 2), 4, 2, 5) - 1e4
    target = torch.tensor([[4, 0], [-100, 2], [3, 4]])
    for reduction in ("none", "sum", "mean"):
        check_cross_entropy(mesh, full, target, 5, reduction=reduction)


def test_one_collective_in_the_forward_none_in_the_backward() -> None:
    """The loss crosses the axis once per step: one all-gather of (largest logit, sum of
    exponentials, target's logit) per token; the backward crosses nothing."""
    mesh = fd.Mesh({"tp": 4})
    target = torch.tensor([[9, 0], [-100, 5]])

    def step(logits: Tensor) -> None:
        fd.nn.cross_entropy(logits, target, mesh, "tp", vocab_size=10).backward()

    logits = torch.randn(2, 2, 3, dtype=F64, requires_grad=True)
    records = fd.profile.trace(step, mesh, logits).records
    assert [(r.op, r.phase, r.shape) for r in records] == [
        ("all_gather_invariant", "forward", (1, 3, 2, 2))
    ]


def test_torch_func_grad_inside_and_around_simulate_equals_one_device() -> None:
    """The eager loss is a Function with its own backward: torch.func.grad (per rank, and around
    simulate) and vmap over an extra batch dim give F.cross_entropy's gradient, padding columns and
    a whole padding rank included."""
    # 4 x 2 columns: rank 2 holds columns 4 and 5 (padding), rank 3 only padding
    mesh, vocab = (
        fd.Mesh({"tp": 4}),
        5,
    )
    full = make_logits((3, 2), 4, 2, vocab, seed=5)
    target = torch.tensor([[4, -100], [0, 3], [2, 4]])
    want = torch.func.grad(
        lambda lg: F.cross_entropy(lg[..., :vocab].reshape(-1, vocab), target.reshape(-1))
    )(full)
    want_shards = torch.stack(want.chunk(4, -1))
    shards = torch.stack(full.chunk(4, -1))

    def loss(lg: Tensor) -> Tensor:
        return fd.nn.cross_entropy(lg, target, mesh, vocab_size=vocab)

    inside = fd.simulate(lambda lg: torch.func.grad(loss)(lg), mesh)(shards)
    torch.testing.assert_close(inside, want_shards, rtol=1e-12, atol=1e-12)
    # each rank backpropagates its own copy
    around = torch.func.grad(lambda s: fd.simulate(loss, mesh)(s).sum())(shards)
    torch.testing.assert_close(around, want_shards, rtol=1e-12, atol=1e-12)
    batched = torch.vmap(lambda s: fd.simulate(loss, mesh)(s), in_dims=1, out_dims=1)(
        torch.stack([shards, 2 * shards], 1)
    )
    torch.testing.assert_close(batched[:, 0], fd.simulate(loss, mesh)(shards))
    torch.testing.assert_close(batched[:, 1], fd.simulate(loss, mesh)(2 * shards))


def test_vocab_parallel_cross_entropy_is_per_token_and_ignores_minus_100() -> None:
    mesh = fd.Mesh({"tp": 3})
    full = make_logits((2, 4), 3, 2, 6)
    target = make_targets((2, 4), 6, -100, 0.4, seed=3)
    assert bool((target == -100).any()) and bool((target != -100).any())

    def ref(logits: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, 6), target.reshape(-1), reduction="none").reshape(
            2, 4
        )

    assert_matches_single_device(
        lambda lg: fd.nn.vocab_parallel_cross_entropy(lg, target, mesh, "tp"),
        ref,
        mesh,
        [full],
        in_specs=(P(None, None, "tp"),),
        out_specs=P(),
    )
    n = int((target == -100).sum())  # each becomes a 6, one past the vocabulary
    with pytest.raises(
        TargetError,
        match=(
            rf"fastdist\.vocab_parallel_cross_entropy\(axis='tp'\) on simulated rank 0: {n} of 8 "
            r"targets are out of range, bad values \[6\] \(also on simulated ranks \[1, 2\]\)"
        ),
    ):
        fd.simulate(
            lambda lg: fd.nn.vocab_parallel_cross_entropy(
                lg, target.masked_fill(target == -100, 6), mesh, "tp"
            ),
            mesh,
        )(torch.stack(full.chunk(3, -1)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_compute_in_float32(dtype: torch.dtype) -> None:
    mesh = fd.Mesh({"tp": 2})
    full = make_logits((3, 4), 2, 4, 7, dtype=torch.float32).to(dtype)
    target = torch.tensor([[6, 0, -100, 3], [1, 1, 2, 5], [-100, -100, 4, 0]])
    shards = torch.stack(full.chunk(2, -1)).requires_grad_()
    out = fd.simulate(lambda lg: fd.nn.cross_entropy(lg, target, mesh, vocab_size=7), mesh)(shards)
    assert out.dtype == torch.float32
    ref_in = full.float().requires_grad_()
    # the same rounded inputs, in float32
    ref = F.cross_entropy(ref_in[..., :7].reshape(-1, 7), target.reshape(-1))
    torch.testing.assert_close(out, ref.detach().expand(2), rtol=1e-6, atol=1e-6)
    out.sum().backward()
    assert shards.grad is not None and shards.grad.dtype == dtype
    ref.backward()
    assert ref_in.grad is not None
    # each rank: its own loss's gradient
    torch.testing.assert_close(shards.grad, torch.stack(ref_in.grad.to(dtype).chunk(2, -1)))


# ----------------------------------------------------------------------------- out-of-range targets
# (description, target value) on a vocabulary of 10 split over tp=4 (12 columns, 10 and 11 padding)
BAD = [
    ("negative", -1),
    ("vocab_size", 10),
    ("padding column", 11),
    ("past every column", 40),
]


@pytest.mark.parametrize(("kind", "value"), BAD)
def test_out_of_range_target_raises_on_simulated_ranks(kind: str, value: int) -> None:
    """Per-rank targets, bad on rank 2 only: the error names the op, the axis, the rank, the value,
    the count, the range and ignore_index."""
    mesh = fd.Mesh({"tp": 4})
    full = make_logits((2, 3), 4, 3, 10)
    target = make_targets((2, 3), 10, -100, 0.3).expand(4, 2, 3).clone()
    target[2, 0, 1] = target[2, 1, 2] = value
    f = fd.simulate(lambda lg, t: fd.nn.cross_entropy(lg, t, mesh, "tp", vocab_size=10), mesh)
    expected = (
        r"fastdist\.cross_entropy\(axis='tp'\) on simulated rank 2: 2 of 6 targets are out of "
        rf"range, bad values \[{value}\]; valid targets are class ids in \[0, 10\) or "
        r"ignore_index=-100"
    )
    with pytest.raises(TargetError, match=expected) as info:
        f(torch.stack(full.chunk(4, -1)), target)
    e = info.value
    assert isinstance(e, ValueError) and (
        e.op,
        e.axis,
        e.rank,
        e.simulated,
        e.bad,
        e.count,
        e.total,
        e.vocab_size,
        e.ignore_index,
    ) == ("cross_entropy", "tp", 2, True, [value], 2, 6, 10, -100)


def test_out_of_range_replicated_target_names_every_rank_and_custom_ignore_index() -> None:
    """A replicated (closed-over) target is bad on every rank; -100 is out of range once
    ignore_index is -1."""
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    target = torch.tensor([3, -100, -1, 12, 12, 12, 12, 13])
    # dp-major rank order: tp shards 0, 1, 0, 1
    shards = torch.stack(make_logits((8,), 2, 2, 4).chunk(2, -1) * 2)
    with pytest.raises(
        TargetError,
        match=(
            r"on simulated rank 0: 6 of 8 targets are out of range, bad values \[-100, 12, 13\] "
            r"\(also on simulated ranks \[1, 2, 3\]\); valid targets are class ids in \[0, 4\) "
            r"or ignore_index=-1"
        ),
    ):
        fd.simulate(lambda lg: fd.nn.cross_entropy(lg, target, mesh, "tp", ignore_index=-1), mesh)(
            shards
        )


@pytest.mark.parametrize(("kind", "value"), BAD)
def test_out_of_range_target_raises_on_a_one_rank_mesh(kind: str, value: int) -> None:
    mesh = fd.Mesh({"tp": 1})
    logits = make_logits((3,), 1, 12, 10)
    assert torch.allclose(
        fd.nn.cross_entropy(logits, torch.tensor([9, 0, -100]), mesh, vocab_size=10),
        F.cross_entropy(logits[:, :10], torch.tensor([9, 0, -100])),
    )
    with pytest.raises(
        TargetError,
        match=(
            r"fastdist\.cross_entropy\(axis='tp'\) on rank 0: 1 of 3 targets are out of range, "
            rf"bad values \[{value}\]; valid targets are class ids in \[0, 10\) or "
            r"ignore_index=-100"
        ),
    ):
        fd.nn.cross_entropy(logits, torch.tensor([9, value, -100]), mesh, vocab_size=10)


def test_compiled_step_fullgraph_matches_torch_and_raises_on_bad_targets() -> None:
    """torch.compile(fullgraph=True) of a simulated step: no graph break, the same values and
    gradients, and the check runs with the data."""
    mesh = fd.Mesh({"tp": 4})
    full = make_logits((2, 3), 4, 3, 10)
    step = torch.compile(
        fd.simulate(lambda lg, t: fd.nn.cross_entropy(lg, t, mesh, "tp", vocab_size=10), mesh),
        fullgraph=True,
    )
    target = torch.tensor([[9, -100, 0], [4, 5, -100]])
    shards = torch.stack(full.chunk(4, -1)).requires_grad_()
    out = step(shards, target.expand(4, 2, 3).clone())
    ref_in = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_in[..., :10].reshape(-1, 10), target.reshape(-1))
    torch.testing.assert_close(out, ref.detach().expand(4), rtol=1e-10, atol=1e-10)
    out.sum().backward()
    ref.backward()
    assert shards.grad is not None and ref_in.grad is not None
    torch.testing.assert_close(
        shards.grad, torch.stack(ref_in.grad.chunk(4, -1)), rtol=1e-10, atol=1e-10
    )
    for value in (11, -7):  # a padding column; a negative other than ignore_index
        bad = target.expand(4, 2, 3).clone()
        bad[3, 1, 0] = value
        with pytest.raises(Exception) as info:  # it may surface wrapped by torch.compile
            step(shards, bad)
        assert (
            "fastdist.cross_entropy(axis='tp') on simulated rank 3: 1 of 6 targets are out of "
            f"range, bad values [{value}]" in str(info.value)
        )


def test_check_targets_op_passes_opcheck() -> None:
    args = (
        torch.tensor([[1, -100], [2, 3]]),
        torch.tensor(0),
        5,
        -100,
        "cross_entropy",
        "'tp'",
        True,
    )
    torch.library.opcheck(torch.ops.fastdist.check_targets.default, args)
    with pytest.raises(
        TargetError, match=r"on simulated rank 1: 1 of 2 targets are out of range, bad values \[7\]"
    ):
        torch.ops.fastdist.check_targets(
            torch.tensor([[1, -100], [7, 3]]),
            torch.tensor([[0], [1]]),
            5,
            -100,
            "cross_entropy",
            "'tp'",
            True,
        )


def test_rejects_bad_arguments() -> None:
    mesh = fd.Mesh({"tp": 1})
    logits, target = torch.randn(2, 4, dtype=F64), torch.tensor([1, 2])
    cases: list[tuple[dict[str, Any], str]] = [
        ({"reduction": "avg"}, r"reduction='avg' is not one of 'none', 'mean', 'sum'"),
        ({"vocab_size": 5}, r"vocab_size=5 must be an int in \[1, 4\]"),
        ({"vocab_size": 0}, r"vocab_size=0 must be an int in \[1, 4\]"),
        (
            {"target": torch.tensor([1.0, 2.0])},
            r"target must hold integer class ids, got torch.float32",
        ),
        (
            {"target": torch.tensor([1, 2, 3])},
            r"target has shape \(3,\), logits \(2, 4\): target must be logits.shape\[:-1\]",
        ),
    ]
    for kw, msg in cases:
        args = {"logits": logits, "target": kw.pop("target", target), "mesh": mesh, **kw}
        with pytest.raises(CollectiveError, match=msg):
            fd.nn.cross_entropy(**args)


# ------------------------------------------------------------------- causal_lm_loss vs transformers
@pytest.mark.parametrize("with_num_items", [False, True])
@pytest.mark.parametrize("with_shift_labels", [False, True])
def test_causal_lm_loss_matches_transformers(with_num_items: bool, with_shift_labels: bool) -> None:
    """The call a transformers model makes, loss_function(logits=, labels=, vocab_size=, **kwargs),
    with the vocabulary padded 7 -> 8 over tp=2."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    mesh, vocab = fd.Mesh({"tp": 2}), 7
    full = make_logits((2, 5), 2, 4, vocab, dtype=torch.float32)
    labels = make_targets((2, 5), vocab, -100, 0.3, seed=4)
    # extra kwargs are ignored, as transformers' loss functions do
    kwargs: dict[str, Any] = {"output_attentions": False}
    if with_num_items:
        kwargs["num_items_in_batch"] = torch.tensor(11)
    if with_shift_labels:
        kwargs["shift_labels"] = make_targets((2, 5), vocab, -100, 0.3, seed=5)
    loss_function = functools.partial(fd.nn.causal_lm_loss, mesh=mesh, axis="tp")
    shards = torch.stack(full.chunk(2, -1)).requires_grad_()
    out = fd.simulate(
        lambda lg: loss_function(logits=lg, labels=labels, vocab_size=vocab, **kwargs), mesh
    )(shards)
    ref_in = full[..., :vocab].clone().requires_grad_()
    ref = ForCausalLMLoss(logits=ref_in, labels=labels, vocab_size=vocab, **kwargs)
    torch.testing.assert_close(out, ref.detach().expand(2), rtol=1e-6, atol=1e-6)
    out.sum().backward()
    ref.backward()
    assert shards.grad is not None and ref_in.grad is not None
    # each rank's gradient of its own loss, joined
    grad = torch.cat([shards.grad[0], shards.grad[1]], -1)
    torch.testing.assert_close(grad[..., :vocab], ref_in.grad, rtol=1e-5, atol=1e-7)
    assert bool((grad[..., vocab:] == 0).all())


@pytest.mark.parametrize("num_items", [None, 9])
def test_causal_lm_loss_float64_to_1e_10(num_items: int | None) -> None:
    """float64 stays float64 (transformers would upcast to float32 only): shifted cross entropy to
    1e-10, gradients on every rank."""
    mesh, vocab = fd.Mesh({"tp": 3}), 8
    full = make_logits((2, 4), 3, 3, vocab)
    labels = make_targets((2, 4), vocab, -100, 0.25, seed=6)

    def ref(logits: Tensor) -> Tensor:
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
        if num_items is None:
            return F.cross_entropy(logits[..., :vocab].reshape(-1, vocab), shifted.reshape(-1))
        return (
            F.cross_entropy(
                logits[..., :vocab].reshape(-1, vocab), shifted.reshape(-1), reduction="sum"
            )
            / num_items
        )

    def par(logits: Tensor) -> Tensor:
        return fd.nn.causal_lm_loss(
            logits, labels, mesh, "tp", vocab_size=vocab, num_items_in_batch=num_items
        )

    assert_matches_single_device(
        par,
        ref,
        mesh,
        [full],
        in_specs=(P(None, None, "tp"),),
        out_specs=P(),
        rtol=1e-10,
        atol=1e-10,
    )


# ----------------------------------------------------------------------------- real ranks
def gloo_cross_entropy() -> str:
    """On 2 gloo ranks: -100 labels and a padded vocabulary (5 over 2 x 3 columns), every reduction;
    a bad target raises on the rank."""
    mesh = fd.connect(tp=2)
    full = make_logits((3, 2), 2, 3, 5)
    target = torch.tensor([[4, -100], [-100, 0], [2, 3]])
    for reduction in ("none", "sum", "mean"):
        check_cross_entropy(mesh, full, target, 5, reduction=reduction)
    local = full.chunk(2, -1)[mesh.rank]
    with pytest.raises(
        TargetError,
        match=(
            rf"fastdist\.cross_entropy\(axis='tp'\) on rank {mesh.rank}: 1 of 6 targets are out "
            r"of range, bad values \[5\]"
        ),
    ):
        fd.nn.cross_entropy(local, target.masked_fill(target == 3, 5), mesh, vocab_size=5)
    return "ok"


def test_cross_entropy_on_gloo() -> None:
    assert run_on_gloo(gloo_cross_entropy, 2, timeout=120) == ["ok"] * 2
