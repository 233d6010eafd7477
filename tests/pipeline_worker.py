"""Gloo workers for tests/test_pipeline_gloo.py: `fastdist.train.pipeline` on real ranks (issue 34
points 3 and 5), run through ``fastdist.testing.run_on_gloo``.

Every worker builds a tiny float64 Llama from a fixed seed on every rank, computes the one-device
reference itself (loss by hand: ``F.cross_entropy`` of the shifted logits, ignored labels
dropped) and returns numbers for the parent test to assert: the largest differences from the
reference, the parameter names this rank holds gradients for, and what each failure said and
how long it took. Each launch runs several configurations (spawning gloo processes is the slow
part).
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import distributed_c10d as c10d

import fastdist as fd
from tests.tiny_models import tiny_llama

F64 = torch.float64
VOCAB, BATCH, SEQ = 64, 4, 8
TIMEOUT = 10.0  # the fault tests' mesh timeout (seconds)


# ============================================================================ the reference
def batch(seed: int) -> tuple[Tensor, Tensor]:
    """``(ids, labels)`` ``[BATCH, SEQ]``; some labels are -100, unevenly over the rows, so the
    micro-batches predict different numbers of tokens (the whole batch's mean must still come
    out)."""
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[0, 2:6] = -100
    labels[3, -1] = -100
    return ids, labels


def loss_by_hand(model: nn.Module, ids: Tensor, labels: Tensor) -> Tensor:
    """One device: the mean cross-entropy of position t's logits against label t + 1 over the
    labels that are not -100."""
    logits = model(input_ids=ids).logits  # [b, s, V]
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),  # [b * (s - 1), V]
        labels[:, 1:].reshape(-1),  # [b * (s - 1)]
        ignore_index=-100,
    )


def reference(model: nn.Module, seeds: list[int]) -> tuple[list[float], dict[str, Tensor]]:
    """Each seed's whole-batch loss on a copy of ``model``, and the gradient of their mean (the
    data-parallel gradient when each seed is one dp rank's batch)."""
    ref = copy.deepcopy(model)
    losses = []
    for s in seeds:
        loss = loss_by_hand(ref, *batch(s))
        (loss / len(seeds)).backward()
        losses.append(loss.item())
    return losses, {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def compare(pipe: Any, loss: Tensor, ref_loss: float, ref_grads: dict[str, Tensor]) -> dict:
    """This rank's loss error, its gradients' largest error, and which parameters it holds."""
    got = pipe.grads()
    return {
        "loss": loss.item(),
        "loss_shape": tuple(loss.shape),
        "loss_err": abs(loss.item() - ref_loss),
        "grad_err": max((got[n] - ref_grads[n]).abs().max().item() for n in got),
        "names": sorted(got),
        "held": sorted(n for n, _ in pipe.named_parameters()),
        "stages": sorted(pipe.stages),
    }


def _setup() -> int:
    torch.set_num_threads(1)
    return dist.get_rank()


def timed(call: Callable[[], Any]) -> dict[str, Any]:
    """What ``call()`` raised (type, message) and after how many seconds; type None if it
    returned."""
    t0 = time.monotonic()
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the parent asserts the type
        return {
            "type": type(e).__name__,
            "msg": str(e),
            "fastdist": isinstance(e, fd.FastdistError),
            "elapsed": time.monotonic() - t0,
        }
    return {"type": None, "msg": None, "fastdist": False, "elapsed": time.monotonic() - t0}


def meet(name: str, timeout: float = 60.0) -> None:
    """Wait, outside any mesh, until every rank got here."""
    store = c10d._get_default_store()
    world = dist.get_world_size()
    store.set(f"pipeline/{name}/{dist.get_rank()}", "1")
    store.wait([f"pipeline/{name}/{r}" for r in range(world)], datetime.timedelta(seconds=timeout))


# ============================================================================ point 3: correct
def _one_step(
    mesh: fd.Mesh, layers: int, seeds: list[int], mine: int, again: bool = False, **kw: Any
) -> dict[str, Any]:
    """Build a pipeline of a fresh tiny Llama, run one step on batch ``seeds[mine]``, compare
    with the one-device reference (the mean gradient over ``seeds``); ``again``: then
    ``pipe.reset()`` (no failure: the groups are remade, the gradients dropped) and the same
    step, compared again."""
    model = tiny_llama(layers, seed=1)
    losses, grads = reference(model, seeds)
    pipe = fd.train.pipeline(model, mesh, **kw)
    ids, labels = batch(seeds[mine])
    loss = pipe.step(input_ids=ids, labels=labels)
    out = {**compare(pipe, loss, losses[mine], grads), "model": sorted(grads)}
    out["stage_axes"] = pipe.stage_mesh.axis_names
    if again:
        pipe.reset()
        out["again"] = compare(pipe, pipe.step(input_ids=ids, labels=labels), losses[mine], grads)
    return out


def schedules_on_4() -> dict[str, Any]:
    """4 ranks: pp2 x tp2 under each schedule (and 1f1b with sequence parallelism), pp4 over 8
    layers under 1f1b, then the whole-model gradient clip and an AdamW step against torch's on
    one device."""
    _setup()
    out: dict[str, Any] = {}
    mesh = fd.connect(pp=2, tp=2, timeout=60)
    for name, kw in {
        "gpipe": {"schedule": "gpipe"},
        "1f1b": {"schedule": "1f1b"},
        "interleaved_1f1b": {"schedule": "interleaved_1f1b", "virtual": 2},
        "1f1b_sp": {"schedule": "1f1b", "sequence_parallel": True},
    }.items():
        t0 = time.monotonic()
        out[name] = _one_step(mesh, 4, [0], 0, microbatches=4, **kw)
        out[name]["pp"] = mesh.index(mesh.rank, "pp")
        out[name]["seconds"] = time.monotonic() - t0
    t0 = time.monotonic()
    pp4 = fd.connect(pp=4, timeout=60)  # no tp: the stage meshes have no axes
    out["pp4"] = _one_step(pp4, 8, [0], 0, again=True, schedule="1f1b", microbatches=4)
    out["pp4"]["pp"] = pp4.index(pp4.rank, "pp")
    out["pp4"]["seconds"] = time.monotonic() - t0
    out["clip_adamw"] = clip_and_adamw(mesh)
    return out


def clip_and_adamw(mesh: fd.Mesh) -> dict[str, Any]:
    """A 1f1b step, ``clip_grad_norm_(0.1)`` and one AdamW step against torch's clip and AdamW on
    one device: the total norm, the clipped gradients, the updated weights."""
    model = tiny_llama(4, seed=2)
    ref = copy.deepcopy(model)
    ids, labels = batch(5)
    loss_by_hand(ref, ids, labels).backward()
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt.step()
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    pipe.step(input_ids=ids, labels=labels)
    total = pipe.clip_grad_norm_(0.1)
    clipped = pipe.grads()
    ref_named = dict(ref.named_parameters())
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
    opt.step()
    weights = pipe.state_dict()
    return {
        "total": total.item(),
        "ref_total": ref_total.item(),
        "clipped_err": max((g - ref_named[n].grad).abs().max().item() for n, g in clipped.items()),
        "clipped_norm": math.sqrt(sum(g.pow(2).sum().item() for g in clipped.values())),
        "weight_err": max(
            (w - ref_named[n].detach()).abs().max().item() for n, w in weights.items()
        ),
        "names": sorted(weights),
    }


def data_parallel_on_8() -> dict[str, Any]:
    """8 ranks, pp2 x dp2 x tp2: each dp rank its own batch, gradients reduced over dp by
    ``fd.train.DataParallel(pipe, "dp")``: the mean over the dp ranks of each one's whole-batch
    gradient;
    under 1f1b and under interleaved 1f1b with sequence parallelism; then a second step that
    accumulates (no ``zero_grad``)."""
    _setup()
    mesh = fd.connect(pp=2, dp=2, tp=2, timeout=90)
    dp = mesh.index(mesh.rank, "dp")
    out: dict[str, Any] = {"pp": mesh.index(mesh.rank, "pp"), "dp": dp}
    for name, kw in {
        "1f1b": {"schedule": "1f1b"},
        "interleaved_sp": {"schedule": "interleaved_1f1b", "virtual": 2, "sequence_parallel": True},
    }.items():
        t0 = time.monotonic()
        model = tiny_llama(4, seed=3)
        losses, grads = reference(model, [10, 11])
        later, grads2 = reference(model, [12, 13])
        pipe = fd.train.pipeline(model, mesh, microbatches=4, **kw)
        fd.train.DataParallel(pipe, "dp")
        ids, labels = batch(10 + dp)
        loss = pipe.step(input_ids=ids, labels=labels)
        out[name] = {**compare(pipe, loss, losses[dp], grads), "model": sorted(grads)}
        out[name]["other_loss"] = losses[1 - dp]
        # a second step without zero_grad: the two steps' dp-mean gradients add up (the
        # reduction must not average what an earlier step already reduced in again, nor miss it)
        ids, labels = batch(12 + dp)
        loss = pipe.step(input_ids=ids, labels=labels)
        total = {n: grads[n] + grads2[n] for n in grads}
        out[name]["accumulated"] = compare(pipe, loss, later[dp], total)
        out[name]["seconds"] = time.monotonic() - t0
    return out


# ============================================================================ point 5: faults
def _fails_at(pipe: Any, forward: int, action: Callable[[], None]) -> None:
    """Make ``pipe`` run ``action`` (raise, exit) at its ``forward``-th stage forward (0 = the
    first) of each later step, instead of that forward."""
    real, calls = pipe._forward, [0]

    def failing(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == forward + 1:
            action()
        return real(*args)

    pipe._forward = failing


def _raise() -> None:
    raise RuntimeError("injected failure in the stage's forward")


def faults_on_4() -> dict[str, Any]:
    """pp2 x tp2, mesh timeout `TIMEOUT`, after a step that works (the groups exist):

    1. the ranks build different schedules (4 micro-batches on pp=0, 2 on pp=1): the pp=1 ranks
       raise at their first receive (the header names the other schedule), their peers at once;
       ``reset()`` on every rank and the next step equals one device; likewise for the same
       counts over another layer split;
    2. one rank of stage 1 (pp=1, tp=1) raises in its second forward, which drops the groups of
       the mesh and of its stage mesh: its stage peer and the pp=0 ranks raise at once (no
       timeout), in their receive (naming the micro-batch, the stage and the peer) or in the
       stage's collective; ``pipe.reset()`` on every rank and the next step equals one device.
    """
    _setup()
    out: dict[str, Any] = {}
    mesh = fd.connect(pp=2, tp=2, timeout=TIMEOUT)
    pp, tp = mesh.index(mesh.rank, "pp"), mesh.index(mesh.rank, "tp")
    out["pp"], out["tp"] = pp, tp
    model = tiny_llama(4, seed=4)
    losses, grads = reference(model, [7])
    ids, labels = batch(7)
    pipe = fd.train.pipeline(copy.deepcopy(model), mesh, schedule="1f1b", microbatches=4)
    pipe.step(input_ids=ids, labels=labels)
    pipe.zero_grad()

    # 1. different schedules
    bad = fd.train.pipeline(
        copy.deepcopy(model), mesh, schedule="1f1b", microbatches=4 if pp == 0 else 2
    )
    out["mismatch"] = timed(lambda: bad.step(input_ids=ids, labels=labels))
    meet("mismatch")
    t0 = time.monotonic()
    bad.reset()  # the mesh and the stage mesh (the failed step dropped both)
    out["mismatch_reset"] = time.monotonic() - t0
    loss = pipe.step(input_ids=ids, labels=labels)
    out["after_mismatch"] = compare(pipe, loss, losses[0], grads)
    pipe.zero_grad()

    # 1b. the same counts, another layer split (2 + 2 layers on pp=0, 1 + 3 on pp=1)
    split = fd.train.pipeline(
        copy.deepcopy(model), mesh, schedule="1f1b", layers_per_stage=[2, 2] if pp == 0 else [1, 3]
    )
    out["split"] = timed(lambda: split.step(input_ids=ids, labels=labels))
    meet("split")
    split.reset()

    # 2. one rank of a stage raises mid-step
    if (pp, tp) == (1, 1):
        _fails_at(pipe, 1, _raise)
    out["raised"] = timed(lambda: pipe.step(input_ids=ids, labels=labels))
    meet("raised")
    t0 = time.monotonic()
    pipe.reset()
    out["raised_reset"] = time.monotonic() - t0
    loss = pipe.step(input_ids=ids, labels=labels)
    out["after_raised"] = compare(pipe, loss, losses[0], grads)
    return out


def stage_exits(out_dir: str) -> None:
    """pp2 x tp2, mesh timeout 10 s: the pp=1 ranks exit (``os._exit(3)``) in their second forward;
    the pp=0 ranks write what they raised and when to ``out_dir/rank<r>.pt`` (run_on_gloo reports
    the exited ranks as failures, and so keeps no result)."""
    _setup()
    mesh = fd.connect(pp=2, tp=2, timeout=TIMEOUT)
    pp = mesh.index(mesh.rank, "pp")
    pipe = fd.train.pipeline(tiny_llama(4, seed=4), mesh, schedule="1f1b", microbatches=4)
    ids, labels = batch(7)
    pipe.step(input_ids=ids, labels=labels)  # a step that works: the groups exist
    if pp == 1:
        _fails_at(pipe, 1, lambda: os._exit(3))
    got = timed(lambda: pipe.step(input_ids=ids, labels=labels))
    torch.save({"pp": pp, **got}, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))


def shapes_change_on_2() -> list[dict[str, Any]]:
    """pp=2, 1f1b: steps over batches of sequence lengths 8, 8, 6, 8 (the first step of each
    input shape sends every transfer's header, the others only the tensors); each step alone
    (gradients dropped between) against one device."""
    _setup()
    mesh = fd.connect(pp=2, timeout=60)
    model = tiny_llama(4, seed=2)
    pipe = fd.train.pipeline(copy.deepcopy(model), mesh, schedule="1f1b", microbatches=2)
    out = []
    for seq in (8, 8, 6, 8):
        ids, labels = (t[:, :seq] for t in batch(seq))
        ref = copy.deepcopy(model)
        ref_loss = loss_by_hand(ref, ids, labels)
        ref_loss.backward()
        pipe.zero_grad()
        loss = pipe.step(input_ids=ids, labels=labels)
        out.append(
            compare(pipe, loss, ref_loss.item(), {n: p.grad for n, p in ref.named_parameters()})
        )
        out[-1]["headers_known"] = len(pipe._ranks.known) + len(pipe._ranks.sent)
    # the two ranks along pp given different masks: both refuse the step (no transfer yet)
    ids, labels = batch(8)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0 if mesh.rank == 1 else 1
    out.append(timed(lambda: pipe.step(input_ids=ids, labels=labels, attention_mask=mask)))
    return out


def meta_load_on_4(ckpt: str) -> dict[str, Any]:
    """pp2 x tp2: a Llama built on the meta device on every rank, split by the pipeline (each
    rank builds only its stage), ``fd.checkpoint.load(save_pretrained_dir, pipe)`` (each rank
    reads only its
    stage's and its tp slices), then a step against one device; and the bytes this rank holds."""
    from transformers import LlamaForCausalLM

    _setup()
    model = tiny_llama(4, seed=3)
    losses, grads = reference(model, [5])
    with torch.device("meta"):
        meta = LlamaForCausalLM(model.config)
    mesh = fd.connect(pp=2, tp=2, timeout=60)
    pipe = fd.train.pipeline(meta, mesh, schedule="1f1b", microbatches=2)
    was_meta = all(p.is_meta for p in pipe.parameters())
    fd.checkpoint.load(ckpt, pipe, dtype=F64)
    ids, labels = batch(5)
    loss = pipe.step(input_ids=ids, labels=labels)
    held = sum(p.numel() for p in pipe.parameters())
    return {
        **compare(pipe, loss, losses[0], grads),
        "was_meta": was_meta,
        "held": held,
        "whole": sum(p.numel() for p in model.parameters()),
    }
