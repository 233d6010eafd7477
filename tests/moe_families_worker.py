"""Rank function for tests/test_moe_families.py's gloo run (importable by
fastdist.testing.run_on_gloo): every mixture-of-experts family in sequence on the same processes."""

from __future__ import annotations

from pathlib import Path

import torch

import fastdist as fd


def moe_families_on_gloo(families: list[str], root: str) -> list[str]:
    """One rank: for each family, build the model from other random weights, then load this
    rank's slices of ``root/<family>``, its ``save_pretrained`` output, parallelize it with its
    ready plan over this mesh (experts over the tp ranks), run a forward/backward (logits, loss
    with the aux loss, every gradient) and an AdamW step, and compare with one device (the
    weights after the step too), in float64 to 1e-10. DeepSeek's routers and OLMoE's q/k norms
    compute in float32 inside the float64 model: as in the simulated test, float32 is float64
    for them on both sides."""
    from tests.test_hf_models import VOCAB, batch
    from tests.test_moe_families import (
        LOADS_SAVE_PRETRAINED,
        TOL,
        build,
        float64_inside,
        reference,
        weights_tolerance,
    )

    mesh = fd.connect(tp=torch.distributed.get_world_size(), timeout=120)
    done = []
    for family in families:
        with float64_inside(family):
            ref = build(family)
            loads = family in LOADS_SAVE_PRETRAINED
            model = build(family, seed=7) if loads else build(family)
            pm = fd.nn.parallelize(model, mesh)
            if loads:  # this rank's slices only (per-expert tensors fused as they are read)
                fd.checkpoint.load(Path(root) / family, pm)
            opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
            ids, labels = batch(30)
            want_logits, want_loss, want_aux = reference(ref, ids, labels)
            out = pm(input_ids=ids, labels=labels)
            torch.testing.assert_close(out.loss, want_loss, **TOL)
            if want_aux is not None:
                torch.testing.assert_close(out.aux_loss, want_aux, **TOL)
            whole = fd.all_gather_invariant(out.logits, mesh, "tp", dim=-1)[..., :VOCAB]
            torch.testing.assert_close(whole, want_logits, **TOL)
            want_loss.backward()
            out.loss.backward()
            grads = pm.grads()  # a collective: gathered on every rank, replicas checked
            for name, p in ref.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, **TOL, msg=f"{family} {name}")
            for o in (opt_ref, opt):
                o.step()
                o.zero_grad()
            state = pm.state_dict()
            for name, p in ref.named_parameters():
                torch.testing.assert_close(
                    state[name], p.detach(), **weights_tolerance(family), msg=f"{family} {name}"
                )
        done.append(family)
    return done
