"""Rank function for tests/test_families.py's gloo run (importable by fastdist.testing.run_on_gloo):
every ready-plan family in sequence on the same two processes."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

import fastdist as fd


def families_on_gloo(families: list[tuple[str, str]], root: str) -> list[str]:
    """One rank: for each ``(builder, family)``, load this rank's slices of the checkpoint in
    ``root/<index>`` into a model built from other random weights, run a sequence-parallel step
    (logits, loss, every gradient) and an AdamW step, and compare with one device (the weights
    after the step too)."""
    from tests.test_families import VOCAB, batch, builder, tolerance

    mesh = fd.connect(tp=torch.distributed.get_world_size(), timeout=120)
    done = []
    for i, (ref_name, family) in enumerate(families):
        build = builder(ref_name)
        ref = build(family)  # the weights that were saved (seed 0)
        model = build(family, seed=7)
        pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=True))
        fd.checkpoint.load(Path(root) / str(i), pm)  # this rank's slices only
        tol = tolerance(family)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        ids, labels = batch(30)
        logits_ref = ref(input_ids=ids).logits
        loss_ref = F.cross_entropy(
            logits_ref[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        out = pm(input_ids=ids, labels=labels)
        torch.testing.assert_close(out.loss, loss_ref, **tol, msg=lambda m: f"{family}: {m}")  # noqa: B023
        whole = fd.all_gather_invariant(out.logits, mesh, "tp", dim=-1)[..., :VOCAB]
        torch.testing.assert_close(whole, logits_ref, **tol, msg=lambda m: f"{family}: {m}")  # noqa: B023
        loss_ref.backward()
        out.loss.backward()
        grads = pm.grads()  # a collective: gathered on every rank, replicas checked
        for name, p in ref.named_parameters():
            torch.testing.assert_close(
                grads[name],
                p.grad,
                **tol,
                msg=lambda m: f"{family} {name}: {m}",  # noqa: B023
            )
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        state = pm.state_dict()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(
                state[name],
                p.detach(),
                **tol,
                msg=lambda m: f"{family} {name}: {m}",  # noqa: B023
            )
        done.append(family)
    return done
