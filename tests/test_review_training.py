"""Review of the training engine's less-travelled paths against one device, in float64.

Gradient accumulation under ``no_sync`` x data parallelism, tied embeddings, frozen parameters,
parameter groups, ZeRO-1, bf16 autocast and ``torch.compile`` of the step, compared with the
unmodified model on the whole batch; and the two silent results this review found, now refused:
the causal-LM losses dropping ``reduction=`` / ``weight=`` (``label_smoothing=`` is computed
now: tests/test_review_leftovers.py), and
`fastdist.train.ZeroOptimizer` never updating a parameter unfrozen after it was built.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fastdist as fd
from tests import tiny_models
from tests.test_hf_models import batch, reference_loss

F64 = torch.float64


def _dp_tp(ref: Any, sp: bool = True) -> tuple[Any, Any, fd.Mesh]:
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    pm = fd.nn.parallelize(
        copy.deepcopy(ref), mesh, fd.nn.plans.plan(ref, family="llama", sequence_parallel=sp)
    )
    return pm, fd.train.DataParallel(pm, "dp"), mesh


def _stacked(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """dp rank 0 holds ``a``, dp rank 1 ``b``, each repeated over tp (mesh {dp: 2, tp: 2})."""
    return torch.stack([a, a, b, b])


def _groups(named: list[tuple[str, torch.nn.Parameter]], lead: int) -> list[dict[str, Any]]:
    """AdamW groups as a training script builds them: weight decay on matrices only, another lr
    for the rest (``lead``: 1 for stacked simulated parameters)."""
    train = [(n, p) for n, p in named if p.requires_grad]
    return [
        {"params": [p for _, p in train if p.dim() - lead >= 2], "weight_decay": 0.1},
        {"params": [p for _, p in train if p.dim() - lead < 2], "weight_decay": 0.0, "lr": 3e-3},
    ]


@pytest.mark.parametrize("zero", [False, True], ids=["adamw-groups", "zero1"])
def test_accumulation_tied_frozen_groups_and_zero_equal_one_device(zero: bool) -> None:
    """dp2 x tp2 (sequence parallel), tied embeddings that are frozen, two micro-batches per step
    (the first under no_sync, each loss / 2), clipping, 3 steps of AdamW with parameter groups
    (or ZeRO-1): weights and norms equal one device on the mean loss of the whole batch."""
    ref = tiny_models.build("llama", tie_word_embeddings=True)
    ref.model.embed_tokens.weight.requires_grad_(False)
    pm, dp, _ = _dp_tp(ref)
    opt_ref = torch.optim.AdamW(_groups(list(ref.named_parameters()), 0), lr=1e-2)
    if zero:
        opt_ref = torch.optim.AdamW(
            [p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
        )
        opt: Any = fd.train.ZeroOptimizer(pm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(_groups(list(pm.named_parameters()), 1), lr=1e-2)
    for step in range(3):
        for micro in range(2):
            (i0, l0), (i1, l1) = batch(10 * step + 2 * micro), batch(10 * step + 2 * micro + 1)
            with dp.no_sync() if micro == 0 else contextlib.nullcontext():
                out = pm(input_ids=_stacked(i0, i1), labels=_stacked(l0, l1))
                (out.loss / 2).sum().backward()
            ((reference_loss(ref, i0, l0)[1] + reference_loss(ref, i1, l1)[1]) / 4).backward()
        norm = fd.nn.clip_grad_norm_(pm, 0.5)
        live = [p for p in ref.parameters() if p.grad is not None]
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(live, 0.5).expand(4))
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    state = pm.state_dict()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(state[name], want, rtol=1e-10, atol=1e-12, msg=name)


def test_bf16_autocast_and_compiled_forward_follow_one_device() -> None:
    """bf16 autocast around the forward (CPU) of dp2 x tp2: the loss and gradients are one
    device's under the same autocast to bf16 precision; a compiled forward with no_sync
    accumulation gives one device's float64 gradients."""
    ref = tiny_models.build("llama").float()
    pm, dp, _ = _dp_tp(ref, sp=False)
    (i0, l0), (i1, l1) = batch(0), batch(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pm(input_ids=_stacked(i0, i1), labels=_stacked(l0, l1))
        want = (ref(input_ids=i0, labels=l0).loss + ref(input_ids=i1, labels=l1).loss) / 2
    assert out.logits.dtype == torch.bfloat16
    torch.testing.assert_close(out.loss.view(2, 2)[:, 0].mean(), want, rtol=2e-3, atol=2e-3)
    out.loss.sum().backward()
    want.backward()
    grads = pm.grads()
    for name, p in ref.named_parameters():
        scale = float(p.grad.abs().max()) + 1e-3
        assert float((grads[name] - p.grad).abs().max()) < 2e-2 * scale, name

    lin = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    lin = lin.to(F64)
    mesh = fd.Mesh({"dp": 2})
    pml = fd.nn.parallelize(copy.deepcopy(lin), mesh, {})
    dpl = fd.train.DataParallel(pml, "dp")
    x = torch.randn(2, 2, 5, 4, dtype=F64)  # [micro, dp, batch, features]
    step = torch.compile(lambda v: pml(v).pow(2).mean(dim=(1, 2)).sum())
    for k in range(2):
        with dpl.no_sync() if k == 0 else contextlib.nullcontext():
            step(x[k]).backward()
    sum(lin(x[k, r]).pow(2).mean() for k in range(2) for r in range(2)).div(2).backward()
    for name, g in pml.grads().items():
        torch.testing.assert_close(g, dict(lin.named_parameters())[name].grad)


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize(
    "kwargs",
    [{"reduction": "sum"}, {"weight": torch.rand(6, dtype=F64)}],
    ids=["reduction", "weight"],
)
def test_causal_lm_loss_refuses_keywords_it_would_drop(
    kwargs: dict[str, Any], gathered: bool
) -> None:
    """``F.cross_entropy(..., reduction="sum")`` is 6.68 on this batch; ``causal_lm_loss`` took
    ``**kwargs`` (for transformers' loss_function call) and returned the mean, 2.23, silently
    (class weights likewise). Now refused, naming the keyword (label smoothing is computed:
    tests/test_review_leftovers.py)."""
    mesh = fd.Mesh({"tp": 2})
    full = torch.randn(1, 5, 6, dtype=F64, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[1, 4, -100, 2, 3]])
    if gathered:
        from fastdist.nn.loss import gathered_causal_lm_loss

        def fn(lg: torch.Tensor, **kw: Any) -> torch.Tensor:
            return gathered_causal_lm_loss(lg, labels, mesh, "tp", **kw)

        logits = full.expand(2, 1, 5, 6)
    else:

        def fn(lg: torch.Tensor, **kw: Any) -> torch.Tensor:
            return fd.nn.causal_lm_loss(lg, labels, mesh, "tp", **kw)

        logits = torch.stack(full.chunk(2, dim=-1))
    plain = fd.simulate(fn, mesh)(logits)[0]  # other keywords (transformers') still ignored
    torch.testing.assert_close(plain, F.cross_entropy(full[0, :-1], labels[0, 1:]))
    assert float(fd.simulate(lambda lg: fn(lg, output_attentions=False), mesh)(logits)[0]) == float(
        plain
    )
    with pytest.raises(fd.errors.CollectiveError, match=next(iter(kwargs))):
        fd.simulate(lambda lg: fn(lg, **kwargs), mesh)(logits)


def test_zero_refuses_a_parameter_unfrozen_after_it_was_built() -> None:
    """Embeddings frozen when ZeRO-1 is built, unfrozen later (the reducer rebuilt, as its own
    error asks): before, ``step()`` left them unchanged forever (max change 0.0) where a torch
    optimizer over ``pm.parameters()`` updates them; now it raises naming them."""
    ref = tiny_models.build("llama")
    ref.model.embed_tokens.weight.requires_grad_(False)
    mesh = fd.Mesh({"dp": 2, "tp": 1})
    pm = fd.nn.parallelize(copy.deepcopy(ref), mesh, fd.nn.plans.plan(ref, family="llama"))
    dp = fd.train.DataParallel(pm, "dp")
    opt = fd.train.ZeroOptimizer(pm, torch.optim.AdamW, lr=1e-2)
    emb = pm.module.model.embed_tokens.weight
    emb.requires_grad_(True)
    dp.remove()
    fd.train.DataParallel(pm, "dp")
    ids, labels = batch(0)
    pm(
        input_ids=ids.expand(2, *ids.shape), labels=labels.expand(2, *labels.shape)
    ).loss.sum().backward()
    assert emb.grad is not None
    with pytest.raises(fd.errors.MeshError, match="embed_tokens.*did not require grad"):
        opt.step()


def test_uneven_padding_recipe_equals_the_global_token_mean() -> None:
    """The documented recipe for padding that differs across data ranks (each rank's summed
    token loss over ``num_items_in_batch = global count / D``), with no_sync accumulation over
    two micro-batches, one of which ignores every token of dp rank 1: dp2 x tp2 gradients equal
    one device's mean over every counted token of the global batch."""
    from tests.review_training_worker import counted, one_device_step, uneven_batches

    ref = tiny_models.build("llama")
    pm, dp, _ = _dp_tp(ref)
    batches = uneven_batches(0, 2)
    total = sum(counted(lab) for row in batches for _, lab in row)
    for micro, row in enumerate(batches):
        (i0, l0), (i1, l1) = row
        n = torch.tensor(total / 2, dtype=F64)  # 0-d: every rank gets it as is
        with dp.no_sync() if micro == 0 else contextlib.nullcontext():
            out = pm(input_ids=_stacked(i0, i1), labels=_stacked(l0, l1), num_items_in_batch=n)
            out.loss.sum().backward()
    one_device_step(ref, batches)
    grads = pm.grads()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_uneven_padding_zero1_on_gloo() -> None:
    """tests/review_training_worker.py uneven_padding_zero_on_gloo on 2 gloo processes (dp=2,
    tied embeddings, ~1 KiB buckets, ZeRO-1, clipping, 3 steps): weights equal one device."""
    from tests.dist_harness import run_on_gloo
    from tests.review_training_worker import uneven_padding_zero_on_gloo

    assert run_on_gloo(uneven_padding_zero_on_gloo, 2, timeout=300) == ["ok"] * 2


@pytest.mark.parametrize("then", ["zero_step", "clip"])
def test_accumulating_only_under_no_sync_is_refused_at_the_step(then: str) -> None:
    """Every micro-batch under ``no_sync`` ("the step syncs", as DeepSpeed's engine does): the
    gradients are never reduced. Before, ZeRO-1 stepped each rank's chunk with its own gradient
    and all-gathered it, so the replicas agreed and were 0.02 off one device (lr 1e-2);
    ``clip_grad_norm_`` on real ranks clipped per-rank gradients. Both now raise, naming the
    parameters and the fix; a synced last micro-batch is unaffected."""
    ref = tiny_models.build("llama")
    pm, dp, _ = _dp_tp(ref)
    opt = fd.train.ZeroOptimizer(pm, torch.optim.AdamW, lr=1e-2)
    (i0, l0), (i1, l1) = batch(0), batch(1)
    ids, labels = _stacked(i0, i1), _stacked(l0, l1)
    with dp.no_sync():
        for _ in range(2):
            pm(input_ids=ids, labels=labels).loss.sum().backward()
    with pytest.raises(fd.errors.MeshError, match="no_sync.*never reduced"):
        opt.step() if then == "zero_step" else fd.nn.clip_grad_norm_(pm, 1.0)
    assert "lm_head.weight" in dp.unreduced()
    pm(input_ids=ids, labels=labels).loss.sum().backward()  # synced: reduces all three
    assert dp.unreduced() == []
    fd.nn.clip_grad_norm_(pm, 1.0)
    opt.step()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):  # as many backwards (HF's eager softmax runs in float32: scaling by 3
        # once rounds differently there)
        ((reference_loss(ref, i0, l0)[1] + reference_loss(ref, i1, l1)[1]) / 2).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt_ref.step()
    state = pm.state_dict()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(state[name], want, rtol=1e-10, atol=1e-12, msg=name)


def test_optimizer_built_before_fsdp_raises_at_step_on_gloo() -> None:
    """tests/review_training_worker.py optimizer_before_fsdp on 2 gloo processes (dp=2, FSDP2)."""
    from tests.dist_harness import run_on_gloo
    from tests.review_training_worker import optimizer_before_fsdp

    assert run_on_gloo(optimizer_before_fsdp, 2, timeout=300) == ["ok"] * 2
