"""Rank functions for tests/test_meta.py's real-process run (importable by
fastdist.testing.run_on_gloo)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fastdist as fd


def meta_llama_on_gloo(ckpt: str) -> str:
    """One rank: a Llama built on the meta device, parallelized (tp = world, sequence parallel),
    loads its slices of a save_pretrained checkpoint and matches the one-device model (logits,
    loss, every gradient); a second one, initialised with init_weights, equals the one-device
    model that fastdist.nn.init_weights gives."""
    import transformers

    from tests.test_hf_models import VOCAB, batch, build

    tol = {"rtol": 1e-10, "atol": 1e-10}
    world = torch.distributed.get_world_size()
    mesh = fd.connect(tp=world, timeout=120)
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).eval()
    with torch.device("meta"):
        model = build("llama")
    pm = fd.nn.parallelize(
        model, mesh, fd.nn.plans.plan(model, family="llama", sequence_parallel=True)
    )
    up = model.model.layers[0].mlp.up_proj.weight
    assert up.is_meta and tuple(up.shape) == (48 // world, 32), up.shape  # this rank's shard
    fd.checkpoint.load(ckpt, pm)  # storage for this rank's shards only, read by slices
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)

    ids, labels = batch()
    out = pm(input_ids=ids, labels=labels)
    logits = ref(input_ids=ids).logits
    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(out.loss, loss, **tol)
    whole = fd.all_gather_invariant(out.logits, mesh, "tp", dim=-1)[..., :VOCAB]
    torch.testing.assert_close(whole, logits, **tol)
    out.loss.backward()
    loss.backward()
    grads = pm.grads()  # a collective
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **tol, msg=lambda m, n=name: f"{n}: {m}")

    with torch.device("meta"):
        fresh = build("llama")
    pm2 = fd.nn.parallelize(
        fresh, mesh, fd.nn.plans.plan(fresh, family="llama", sequence_parallel=True)
    )
    fd.nn.init_weights(pm2, seed=11)  # each rank computes its shards only
    with torch.device("meta"):
        one = build("llama")
    want = fd.nn.init_weights(one, seed=11).state_dict()
    got = pm2.state_dict()  # a collective: the single-device view
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    return "ok"
