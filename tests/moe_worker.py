"""Rank functions for tests/test_moe.py's real-process runs (importable by fastdist.testing.run_on_gloo)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import fastdist as fd


def moe_on_gloo(tp: int) -> str:
    """One rank of ep x tp gloo processes: the functional layer on this rank's own tokens (exact sizes, dropless), both
    strategies, and Mixtral made expert-parallel by its plan, each against one device (every process runs the reference)."""
    from fastdist.nn import moe as M
    from tests.test_moe import (
        H,
        build_mixtral,
        compare_grads,
        expert_weights,
        lm_batch,
        random_routing,
        reference,
        reference_experts,
    )

    world = torch.distributed.get_world_size()
    ep = world // tp
    mesh = fd.Mesh.from_torch(ep=ep, tp=tp, timeout=60) if tp > 1 else fd.Mesh.from_torch(ep=ep, timeout=60)
    me = mesh.index(mesh.rank, "ep")
    T, E = 5, 4
    x, w, e = random_routing(ep, T, E, 2, seed=11)
    e[: T * ep // 2] = 1  # skewed: half the tokens to expert 1 (and whatever else they chose)
    e[:, 1] = torch.where(e[:, 0] == e[:, 1], 3 - e[:, 0] % 2, e[:, 1])  # two distinct experts per token
    gate_up, down = expert_weights(E, 0)
    tol = {"rtol": 1e-10, "atol": 1e-10}
    for strategy in ("all_to_all", "allgather"):
        leaves = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
        want = reference_experts(leaves[0], leaves[1], e, leaves[2], leaves[3])
        want.sum().backward()
        el, it = E // ep, gate_up.shape[1] // 2 // tp
        t_i = mesh.index(mesh.rank, "tp") if tp > 1 else 0
        gu = torch.cat([g[:, t_i * it : (t_i + 1) * it] for g in gate_up[me * el : (me + 1) * el].chunk(2, dim=1)], 1).requires_grad_()
        dn = down[me * el : (me + 1) * el, :, t_i * it : (t_i + 1) * it].clone().requires_grad_()
        xs = x.reshape(ep, T, H)[me].clone().requires_grad_()
        ws = w.reshape(ep, T, -1)[me].clone().requires_grad_()

        def expert(rows: torch.Tensor, i: int, gu: torch.Tensor = gu, dn: torch.Tensor = dn) -> torch.Tensor:
            g, u = F.linear(rows, gu[i]).chunk(2, dim=-1)
            return F.linear(F.silu(g) * u, dn[i])

        out = M.moe(xs, ws, e.reshape(ep, T, -1)[me], expert, mesh, "ep", E, strategy=strategy, tp_axis="tp" if tp > 1 else None).out
        torch.testing.assert_close(out, want.detach().reshape(ep, T, H)[me], **tol)
        out.sum().backward()
        torch.testing.assert_close(xs.grad, leaves[0].grad.reshape(ep, T, H)[me], **tol)
        torch.testing.assert_close(ws.grad, leaves[1].grad.reshape(ep, T, -1)[me], **tol)
        torch.testing.assert_close(dn.grad, leaves[3].grad[me * el : (me + 1) * el, :, t_i * it : (t_i + 1) * it], **tol)

    ref = build_mixtral()
    model = copy.deepcopy(ref)
    axis = "tp" if tp > 1 else "ep"
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.mixtral(model, axis=axis))
    ids, labels = lm_batch()
    logits, ce, aux = reference(ref, ids, labels)
    out = pm(input_ids=ids, labels=labels)
    torch.testing.assert_close(fd.all_gather_invariant(out.logits, mesh, axis, dim=-1)[..., : logits.shape[-1]], logits, **tol)
    torch.testing.assert_close(out.aux_loss, aux, **tol)
    coef = ref.config.router_aux_loss_coef
    torch.testing.assert_close(out.loss, ce + coef * aux, **tol)
    ce.backward()
    (out.loss - coef * out.aux_loss).backward()
    compare_grads(pm, ref, **tol)
    return "ok"
