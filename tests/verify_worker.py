"""Rank functions for tests/test_verify_auto.py's real-process run (importable by
fastdist.testing.run_on_gloo)."""

from __future__ import annotations

import copy
import dataclasses

import torch

import fastdist as fd


def verify_on_gloo() -> tuple[str, str]:
    """One rank: the ready Llama plan passes verify on real ranks (and the model then matches one
    device on this rank's logits), and a silently wrong plan is refused on every rank with the
    same message. Returns (the fused q|k|v layout of the plan auto verified, the refusal's
    message)."""
    from tests.test_verify_auto import V, build, ids

    world = torch.distributed.get_world_size()
    mesh = fd.connect(tp=world, timeout=120)
    model = build("llama")
    ref = copy.deepcopy(model)
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, family="llama"), verify=True)
    x = ids()
    got = pm(input_ids=x).logits  # this rank's vocabulary shard (61 padded to 62 over 2)
    width = got.shape[-1]
    want = ref(input_ids=x).logits[..., mesh.rank * width : (mesh.rank + 1) * width]
    torch.testing.assert_close(got[..., : want.shape[-1]], want, rtol=1e-10, atol=1e-10)
    assert width * world >= V

    bad = build("llama")
    plan = fd.nn.plans.plan(bad, family="llama")
    plan["model.layers.*.self_attn"] = dataclasses.replace(
        plan["model.layers.*.self_attn"], attrs=(("scaling", lambda hq, hkv, d: 1.0),)
    )
    try:
        fd.nn.parallelize(bad, mesh, plan, verify=True)
    except fd.nn.ParallelizeError as e:
        message = str(e)
    else:
        raise AssertionError("verify accepted a wrong plan")
    auto = fd.nn.parallelize(build("falcon_new"), mesh, "auto").plan  # the candidate that verified
    return repr(auto["transformer.h.*.self_attention"].qkv_layout), message
