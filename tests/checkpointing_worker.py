"""Rank functions for tests/test_activation_checkpointing.py's gloo runs (importable by
fastdist.testing.run_on_gloo), and the cases both the simulated and the real-rank tests run."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import fastdist as fd
from tests import tiny_models
from tests.tiny_models import VOCAB

#: (family, sequence parallel, use_reentrant, gradient_checkpointing_enable before parallelize)
HF_CASES = [
    ("llama", True, True, True),
    ("llama", True, True, False),
    ("llama", True, False, True),
    ("llama", True, False, False),
    ("mixtral", True, False, False),
    ("mixtral", True, True, True),
]


def hf_model(family: str, reentrant: bool) -> Any:
    """A tiny model in training mode (no dropout). Mixtral adds the router's aux loss, except
    under reentrant checkpointing: transformers records the router logits in a forward run under
    no_grad there, so the aux loss's gradient is lost on one device too."""
    over = {"output_router_logits": not reentrant} if family == "mixtral" else {}
    return tiny_models.build(family, kv=2, seed=0, fill_zeros=True, **over).train()


def batch(family: str) -> Tensor:
    """Token ids ``[B, 8]``: one sequence for Mixtral (its sequence-parallel plan on real ranks
    at batch > 1 is issue 40's point 5, not this file's), two otherwise."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (1 if family == "mixtral" else 2, 8), generator=g)


def one_device_grads(model: Any, ids: Tensor) -> dict[str, Tensor]:
    """The unmodified model's gradients of its ``labels=`` loss (+ router aux loss) on one
    device, without checkpointing."""
    model = copy.deepcopy(model)
    out = model(input_ids=ids)
    loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    if getattr(out, "aux_loss", None) is not None:
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def checkpointed(model: Any, mesh: fd.Mesh, sp: bool, reentrant: bool, before: bool) -> Any:
    """``model`` parallelized over ``mesh`` with transformers' gradient checkpointing enabled
    before or after `parallelize`."""
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
    if before:
        model.gradient_checkpointing_enable(**kwargs)
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=sp))
    if not before:
        model.gradient_checkpointing_enable(**kwargs)
    return pm


def worst(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    """The largest difference between two gradient dicts (inf where a name is missing)."""
    if got.keys() != want.keys():
        return float("inf")
    return max((got[n] - want[n]).abs().max().item() for n in want)


def hf_cases_on_gloo() -> list[float]:
    """One rank: every case of `HF_CASES` on ``tp=2``; the worst gradient difference of each
    from the unmodified model on one device (``pm.grads()`` checks the replicas agree)."""
    mesh = fd.connect(tp=torch.distributed.get_world_size(), timeout=120)
    out = []
    for family, sp, reentrant, before in HF_CASES:
        model = hf_model(family, reentrant)
        ids = batch(family)
        want = one_device_grads(model, ids)
        pm = checkpointed(model, mesh, sp, reentrant, before)
        pm(input_ids=ids, labels=ids).loss.backward()
        out.append(worst(pm.grads(), want))
    return out


def norm_and_input(seed: int = 0) -> tuple[torch.nn.LayerNorm, Tensor]:
    """A LayerNorm (weights drawn) and a sequence ``[2, 8, 6]`` to run it on."""
    torch.manual_seed(seed)
    norm = torch.nn.LayerNorm(6, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    return norm, torch.randn(2, 8, 6, dtype=torch.float64)


def norm_reference(seed: int = 0) -> dict[str, Tensor]:
    """The LayerNorm's gradients on one device of ``(norm(x) ** 2).sum()`` over the sequence."""
    norm, x = norm_and_input(seed)
    (norm(x) ** 2).sum().backward()
    return {n: p.grad for n, p in norm.named_parameters()}


def per_rank_checkpoint_on_gloo() -> list[float]:
    """One rank: ``torch.utils.checkpoint`` in per-rank code around a parallel LayerNorm on this
    rank's sequence shard (its replicated parameters pvary'd over ``tp``), reentrant and not;
    the worst gradient difference from one device."""
    mesh = fd.connect(tp=torch.distributed.get_world_size(), timeout=120)
    out = []
    for reentrant in (True, False):
        norm, x = norm_and_input()
        pm = fd.nn.parallelize(norm, mesh, {"": fd.nn.PvaryParams("tp")})
        # this rank's half of the sequence: [2, 4, 6]
        shard = x.chunk(mesh.size, dim=1)[mesh.rank].requires_grad_()
        y = torch.utils.checkpoint.checkpoint(pm, shard, use_reentrant=reentrant)
        (y**2).sum().backward()
        out.append(worst(pm.grads(), norm_reference()))
    return out


#: (data-parallel engine, use_reentrant) the 4-rank run checks
ENGINE_CASES = [
    ("fastdist", False),
    ("fastdist", True),  # refused: a backward inside a backward
    ("ddp", False),
    ("ddp", True),
    ("fsdp", False),
    ("fsdp", True),
]


def engines_on_gloo() -> list[float | str]:
    """One rank of dp 2 x tp 2: the sequence-parallel Llama with transformers' checkpointing under
    each data-parallel engine, each dp rank its own batch; per case the worst gradient difference
    from one device (the mean loss over both batches), or the error raised."""
    mesh = fd.connect(tp=2, timeout=120)  # dp = 2
    me = mesh.coords(mesh.rank)["dp"]
    out: list[float | str] = []
    for engine, reentrant in ENGINE_CASES:
        model = hf_model("llama", reentrant)
        batches = [(batch("llama") + i) % VOCAB for i in range(2)]
        ref = copy.deepcopy(model)
        losses = []
        for ids in batches:
            logits = ref(input_ids=ids).logits
            losses.append(
                F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            )
        (sum(losses) / 2).backward()
        want = {n: p.grad for n, p in ref.named_parameters()}
        try:
            pm = checkpointed(model, mesh, True, reentrant, False)
            fd.train.DataParallel(pm, "dp", engine=engine)
            ids = batches[me]
            pm(input_ids=ids, labels=ids).loss.backward()
            out.append(worst(pm.grads(), want))
        except fd.MeshError as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def frozen_embeddings_on_gloo() -> list[float]:
    """One rank: reentrant checkpointing with frozen embeddings (transformers'
    ``enable_input_require_grads`` makes the layers' input require grad, and must survive the
    embedding's swap when enabled before `parallelize`), enabled before and after; the worst
    gradient difference from one device (checkpointed the same way) of each."""
    mesh = fd.connect(tp=torch.distributed.get_world_size(), timeout=120)
    out = []
    for before in (True, False):
        model = hf_model("llama", True)
        model.model.embed_tokens.weight.requires_grad_(False)
        ids = batch("llama")
        want = one_device_grads(model, ids)
        pm = checkpointed(model, mesh, True, True, before)
        pm(input_ids=ids, labels=ids).loss.backward()
        out.append(worst(pm.grads(), want))
    return out
