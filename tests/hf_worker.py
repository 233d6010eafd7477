"""Rank functions for tests/test_hf_models.py's real-process runs (importable by
fastdist.testing.run_on_gloo)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

import fastdist as fd


def parallel_training_on_gloo(
    family: str, ckpt: str, sequence_parallel: bool, steps: int, compiled: bool = False
) -> str:
    """One rank: load the single-device checkpoint's slices, train ``steps`` AdamW steps, compare
    with one device.

    The single-device model runs in every process too (it is small); the parallel model
    starts from other random weights, so everything it knows comes from its slices.
    """
    import transformers

    from tests.test_hf_models import VOCAB, batch, build

    mesh = fd.connect(tp=torch.distributed.get_world_size(), timeout=120)
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).eval()
    model = build(family, kv=ref.config.num_key_value_heads if family != "gpt2" else 4, seed=99)
    pm = fd.nn.parallelize(
        model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=sequence_parallel)
    )
    fd.checkpoint.load(ckpt, pm)  # this rank's slices only (safe_open(...).get_slice)
    # a shard, padded
    assert pm.module.lm_head.weight.shape[0] == -(-VOCAB // mesh.size), (
        pm.module.lm_head.weight.shape
    )

    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for step in range(steps):
        ids, labels = batch(20 + step)
        logits_ref = ref(input_ids=ids).logits
        loss_ref = F.cross_entropy(
            logits_ref[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        out = pm(input_ids=ids, labels=labels)
        torch.testing.assert_close(out.loss, loss_ref, rtol=1e-10, atol=1e-10)
        # every rank's vocabulary shard
        whole = fd.all_gather_invariant(out.logits, mesh, "tp", dim=-1)[..., :VOCAB]
        torch.testing.assert_close(whole, logits_ref, rtol=1e-10, atol=1e-10)
        loss_ref.backward()
        out.loss.backward()
        if step == 0:
            grads = pm.grads()  # a collective: gathered on every rank, replicas checked
            for name, p in ref.named_parameters():
                torch.testing.assert_close(
                    grads[name],
                    p.grad,
                    rtol=1e-10,
                    atol=1e-10,
                    msg=lambda m: f"{name}: {m}",  # noqa: B023 (called at once)
                )
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    if compiled:
        # the compiled step on real ranks: one graph, equal to eager (the groups exist before
        # tracing)
        from torch._dynamo.utils import counters

        fd.comm.create_groups(mesh, *mesh.axis_names)
        ids, labels = batch(30)
        eager = pm(input_ids=ids, labels=labels).loss
        eager.backward()
        want = {n: p.grad.clone() for n, p in pm.named_parameters()}
        opt.zero_grad()
        got = torch.compile(lambda i, lab: pm(input_ids=i, labels=lab).loss, fullgraph=True)(
            ids, labels
        )
        got.backward()
        assert not counters["graph_break"], dict(counters["graph_break"])
        # Llama's rotary runs in float32 by design
        torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-7)
        for name, p in pm.named_parameters():
            torch.testing.assert_close(
                p.grad,
                want[name],
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m: f"compiled {name}: {m}",  # noqa: B023 (called at once)
            )
        opt.zero_grad()
    if not sequence_parallel:
        # serving: a KV cache step on real ranks (each rank caches its heads) equals the whole
        # sequence's forward
        with torch.no_grad():
            ids, _ = batch(40)
            full = pm(input_ids=ids).logits
            prefix = pm(input_ids=ids[:, :-1], use_cache=True)
            step = pm(input_ids=ids[:, -1:], past_key_values=prefix.past_key_values).logits
            torch.testing.assert_close(step[:, -1], full[:, -1], rtol=1e-10, atol=1e-10)
    out_file = Path(ckpt) / "trained.safetensors"
    fd.checkpoint.save(out_file, pm)  # gathered; rank 0 writes
    state = pm.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            state[name],
            p.detach(),
            rtol=1e-10,
            atol=1e-10,
            msg=lambda m: f"{name}: {m}",  # noqa: B023 (called at once)
        )
    return "ok"
