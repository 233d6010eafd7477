"""Activation checkpointing through a parallel model is exact, or refused at the first call.

transformers' ``gradient_checkpointing_enable`` (reentrant and not, before or after
`parallelize`) with the sequence-parallel Llama and Mixtral plans, and ``torch.utils.checkpoint``
in per-rank code, on simulated ranks and on 2 gloo processes: every gradient equals the
unmodified model's on one device (the replicated norms' gradients are summed over ``tp`` in the
recomputation too: their ``pvary`` runs inside the norm's own forward). What simulated ranks
cannot run (a checkpoint inside per-rank code given to `fastdist.simulate`) raises a fastdist
error naming the fix.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fastdist as fd
from tests import checkpointing_worker as cw
from tests.test_hf_models import rep

pytest.importorskip("transformers")
# the tests call the name users know (transformers 5 calls it an alias of
# activation_checkpointing_enable)
pytestmark = pytest.mark.filterwarnings(
    "ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning"
)
TOL = 1e-10


@pytest.mark.parametrize(
    "family, sp, reentrant, before",
    cw.HF_CASES,
    ids=[
        f"{f}-{'reentrant' if r else 'nonreentrant'}-{'before' if b else 'after'}"
        for f, _, r, b in cw.HF_CASES
    ],
)
def test_hf_checkpointing_on_simulated_ranks(
    family: str, sp: bool, reentrant: bool, before: bool
) -> None:
    """Simulated ranks run checkpointed layers without recomputing (a recomputation would run
    outside the simulation): the same gradients as one device, the model's flag kept."""
    model = cw.hf_model(family, reentrant)
    ids = cw.batch(family)
    want = cw.one_device_grads(model, ids)
    mesh = fd.Mesh({"tp": 2})
    pm = cw.checkpointed(model, mesh, sp, reentrant, before)
    pm(input_ids=rep(ids, mesh), labels=rep(ids, mesh)).loss.sum().backward()
    assert cw.worst(pm.grads(), want) < TOL
    assert model.model.layers[0].gradient_checkpointing  # turned off for the call only


def test_hf_checkpointing_with_data_parallel_on_simulated_ranks() -> None:
    """dp x tp with fastdist's reducer and reentrant checkpointing (refused on real ranks: a
    backward inside a backward): nothing is recomputed on simulated ranks, so nothing nests."""
    model = cw.hf_model("llama", True)
    ids = cw.batch("llama")
    want = cw.one_device_grads(model, ids)
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    pm = cw.checkpointed(model, mesh, True, True, False)
    fd.train.DataParallel(pm, "dp")
    pm(input_ids=rep(ids, mesh), labels=rep(ids, mesh)).loss.sum().backward()
    assert cw.worst(pm.grads(), want) < TOL


def test_hf_checkpointing_on_gloo() -> None:
    """The same cases on 2 gloo processes, where checkpoints do recompute in backward (reentrant:
    after the model's call returned)."""
    from tests.dist_harness import run_on_gloo

    for rank in run_on_gloo(cw.hf_cases_on_gloo, 2, timeout=300):
        for case, diff in zip(cw.HF_CASES, rank):
            assert diff < TOL, (case, diff)


def test_checkpoint_in_per_rank_code_on_gloo() -> None:
    """``torch.utils.checkpoint`` around a parallel model call in per-rank code: its
    recomputation pvary's the replicated parameters again."""
    from tests.dist_harness import run_on_gloo

    for rank in run_on_gloo(cw.per_rank_checkpoint_on_gloo, 2, timeout=120):
        assert max(rank) < TOL, rank


def test_hf_checkpointing_with_data_parallel_engines_on_gloo() -> None:
    """dp 2 x tp 2 on 4 gloo processes with fastdist's reducer, DDP and FSDP2: exact; fastdist's
    reducer refuses reentrant checkpointing (a backward inside a backward) with the fix."""
    from tests.dist_harness import run_on_gloo

    for rank in run_on_gloo(cw.engines_on_gloo, 4, timeout=400):
        for (engine, reentrant), got in zip(cw.ENGINE_CASES, rank):
            if engine == "fastdist" and reentrant:
                assert isinstance(got, str) and "use_reentrant=False" in got, got
            else:
                assert isinstance(got, float) and got < TOL, (engine, reentrant, got)


def test_frozen_embeddings_with_reentrant_checkpointing_on_gloo() -> None:
    """Frozen embeddings: transformers' hook that makes the layers' input require grad (without
    it reentrant checkpoints compute no gradient for the layers) is installed again on the
    vocabulary-parallel embedding when checkpointing was enabled before `parallelize`."""
    from tests.dist_harness import run_on_gloo

    for rank in run_on_gloo(cw.frozen_embeddings_on_gloo, 2, timeout=120):
        assert max(rank) < TOL, rank


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_around_a_simulated_call_is_exact(reentrant: bool) -> None:
    """A checkpoint around the whole simulated call recomputes the whole simulation: exact."""
    norm, x = cw.norm_and_input()
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(norm, mesh, {"": fd.nn.PvaryParams("tp")})
    shards = torch.stack(x.chunk(2, dim=1)).requires_grad_()  # [rank, 2, 4, 6]
    y = checkpoint(pm, shards, use_reentrant=reentrant)
    (y**2).sum().backward()
    assert cw.worst(pm.grads(), cw.norm_reference()) < TOL


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_inside_simulate_is_refused_at_the_first_call(reentrant: bool) -> None:
    """Per-rank code given to `fastdist.simulate` that checkpoints: its recomputation would run
    in backward outside the simulation's vmap; refused in the forward, naming the fix."""
    norm, x = cw.norm_and_input()
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(norm, mesh, {"": fd.nn.PvaryParams("tp")})
    params = dict(norm.named_parameters())

    def per_rank(p: dict[str, torch.Tensor], xs: torch.Tensor) -> torch.Tensor:
        def region(t: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(pm.module, p, (t,))

        return checkpoint(region, xs, use_reentrant=reentrant)

    shards = torch.stack(x.chunk(2, dim=1)).requires_grad_()
    variant = f"use_reentrant={reentrant}"
    with pytest.raises(fd.NoBackendError, match=rf"(?s){variant}\) inside fastdist.simulate.*Fix"):
        fd.simulate(per_rank, mesh)(params, shards)


@pytest.mark.parametrize("before", [True, False])
def test_input_require_grads_hook_on_simulated_ranks(before: bool) -> None:
    """transformers' ``enable_input_require_grads`` (installed by ``gradient_checkpointing_enable``)
    is a no-op on embeddings that train; on frozen ones torch.vmap cannot start tracking
    gradients: a fastdist error naming the fix."""
    model = cw.hf_model("llama", False)
    mesh = fd.Mesh({"tp": 2})
    ids = cw.batch("llama")
    frozen = copy.deepcopy(model)
    pm = cw.checkpointed(frozen, mesh, True, False, before)
    frozen.model.embed_tokens.weight.requires_grad_(False)
    with pytest.raises(fd.NoBackendError, match=r"disable_input_require_grads"):
        pm(input_ids=rep(ids, mesh), labels=rep(ids, mesh))
    frozen.disable_input_require_grads()
    pm(input_ids=rep(ids, mesh), labels=rep(ids, mesh)).loss.sum().backward()
    want = cw.one_device_grads(model, ids)
    got = pm.grads()
    assert "model.embed_tokens.weight" not in got
    assert max((got[n] - want[n]).abs().max().item() for n in got) < TOL
