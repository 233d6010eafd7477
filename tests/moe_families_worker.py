"""Rank function for tests/test_moe_families.py's gloo run (importable by
fastdist.testing.run_on_gloo): every mixture-of-experts family in sequence on the same processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastdist as fd


def moe_families_on_gloo(families: list[str], root: str) -> list[str]:
    """One rank: for each family, twice: its ready plan over this mesh (experts over the tp
    ranks), then the sequence-parallel plan (a batch of 2 sequences: each MoE block's gathered
    input must be contiguous for the model's ``view``). The first time the model is built from
    other random weights and loads this rank's slices of ``root/<family>``, its
    ``save_pretrained`` output. Each time: a forward/backward (logits, loss with the aux loss,
    every gradient) and an AdamW step compared with one device (the weights after the step too),
    in float64 to 1e-10. DeepSeek's routers and OLMoE's q/k norms compute in float32 inside the
    float64 model: as in the simulated test, float32 is float64 for them on both sides.

    Then Mixtral's plan on a Qwen3-MoE model (its per-head q/k norms not in the plan) is refused
    at parallelize, on every rank."""
    from tests.test_moe_families import LOADS_SAVE_PRETRAINED, build, float64_inside

    mesh = fd.connect(tp=torch.distributed.get_world_size(), timeout=120)
    done = []
    for family in families:
        with float64_inside(family):
            for sp in (False, True):
                loads = family in LOADS_SAVE_PRETRAINED and not sp
                model = build(family, seed=7) if loads else build(family)
                plan = fd.nn.plans.plan(model, mesh, sequence_parallel=sp)
                pm = fd.nn.parallelize(model, mesh, plan)
                if loads:  # this rank's slices only (per-expert tensors fused as they are read)
                    fd.checkpoint.load(Path(root) / family, pm)
                _step_matches_one_device(family, pm, mesh, f"{family} sp={sp}")
        done.append(family)
    with (
        float64_inside("qwen3_moe"),
        pytest.raises(fd.nn.ParallelizeError, match=r"q_norm\.weight.*PvaryParams\('tp'\)"),
    ):
        model = build("qwen3_moe")
        fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, family="mixtral"))
    return done


def _step_matches_one_device(
    family: str, pm: fd.nn.ParallelModel, mesh: fd.Mesh, what: str
) -> None:
    """One forward/backward and AdamW step of ``pm`` against the family's one-device model."""
    from tests.test_hf_models import VOCAB, batch
    from tests.test_moe_families import TOL, build, reference, weights_tolerance

    ref = build(family)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ids, labels = batch(30)  # (2, 8): two sequences
    want_logits, want_loss, want_aux = reference(ref, ids, labels)
    out = pm(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss, want_loss, **TOL, msg=lambda m: f"{what}: {m}")
    if want_aux is not None:
        torch.testing.assert_close(out.aux_loss, want_aux, **TOL, msg=lambda m: f"{what}: {m}")
    whole = fd.all_gather_invariant(out.logits, mesh, "tp", dim=-1)[..., :VOCAB]
    torch.testing.assert_close(whole, want_logits, **TOL, msg=lambda m: f"{what}: {m}")
    want_loss.backward()
    out.loss.backward()
    grads = pm.grads()  # a collective: gathered on every rank, replicas checked
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=f"{what} {name}")
    for o in (opt_ref, opt):
        o.step()
        o.zero_grad()
    state = pm.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            state[name], p.detach(), **weights_tolerance(family), msg=f"{what} {name}"
        )
