"""Rank functions for tests/test_moe.py's real-process runs (importable by
fastdist.testing.run_on_gloo).

One launch of 4 gloo processes runs every scenario (each launch costs seconds of start-up): several
meshes over the same 4 ranks (ep=4; ep=2 x tp=2; dp=2 x ep=2), each scenario checked against one
device (every process runs the reference) in float64 to 1e-10, on real ranks (exact receive sizes,
each expert run on its own rows only)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import fastdist as fd

TOL = {"rtol": 1e-10, "atol": 1e-10}
AUX_TOL = {"rtol": 1e-6, "atol": 1e-6}  # a float32 quantity (a few ulps)


@contextlib.contextmanager
def scenario(name: str) -> Iterator[None]:
    """Name the scenario in any failure (one launch runs them all)."""
    try:
        yield
    except AssertionError as e:
        raise AssertionError(f"[{name}] {e}") from None


def layer_routings(
    groups: int, T: int, E: int
) -> dict[str, tuple[Tensor, Tensor, Tensor, float | None]]:
    """Routing cases for the functional layer over ``groups`` token groups of ``T``: name -> (x,
    gates, experts, capacity_factor)."""
    from tests.test_moe import random_routing

    x, w, e = random_routing(groups, T, E, 2, seed=11)
    skew = e.clone()
    skew[: groups * T // 2, 0] = 1  # half the tokens to expert 1 (and one other, distinct)
    skew[:, 1] = torch.where(skew[:, 0] == skew[:, 1], (skew[:, 0] + 1) % E, skew[:, 1])
    x1, w1, _ = random_routing(groups, T, E, 1, seed=12)
    # every token to the lower half of the experts: the upper ranks get nothing
    low = torch.where(e < E // 2, e, e - E // 2)
    low[:, 1] = torch.where(low[:, 0] == low[:, 1], (low[:, 0] + 1) % (E // 2), low[:, 1])
    # every token to experts 0 and 1, past their capacity: dropped
    crowd = torch.tensor([[0, 1]] * (groups * T))
    return {
        "skewed": (x, w, skew, None),
        "all to expert 5 (top-1)": (x1, w1, torch.full((groups * T, 1), 5), None),
        "upper experts empty": (x, w, low, None),
        "dropping (capacity_factor=1)": (x, w, crowd, 1.0),
    }


def check_layer_on_ranks(mesh: fd.Mesh, name: str) -> None:
    """The functional layer on each rank's own tokens (split over dp and ep, replicated over tp),
    experts over ep (their features over tp, replicated over dp), both strategies, every routing
    case: out, dropped, and the gradients of the tokens, the gates, gate_up and down against one
    device."""
    import math

    from fastdist.nn import moe as M
    from tests.test_moe import I, expert_weights, hand_keep, reference_experts

    T, E = 4, 8
    ep, dp = mesh.axis_size("ep"), mesh.axis_size("dp")
    tp = "tp" if "tp" in mesh.axis_names and mesh.axis_size("tp") > 1 else None
    # which token group this rank holds
    group = mesh.index(mesh.rank, "dp") * ep + mesh.index(mesh.rank, "ep")
    gu_l = (
        fd.nn.Layout(fd.P("ep", tp, None), parts=(I, I), at=1) if tp else fd.nn.Layout(fd.P("ep"))
    )
    dn_l = fd.nn.Layout(fd.P("ep", None, tp)) if tp else fd.nn.Layout(fd.P("ep"))
    gate_up, down = expert_weights(E, 0)
    mine = lambda t: t.reshape(dp * ep, T, *t.shape[1:])[group]  # noqa: E731
    for case, (x, w, e, cf) in layer_routings(dp * ep, T, E).items():
        keep = None
        if cf is not None:
            cap = math.ceil(cf * T * e.shape[1] / E)
            keep = torch.cat([hand_keep(chunk, E, cap) for chunk in e.reshape(dp * ep, T, -1)])
        c = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(3))
        leaves = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
        want = reference_experts(
            leaves[0],
            leaves[1] if keep is None else torch.where(keep, leaves[1], 0),
            e if keep is None else torch.where(keep, e, E),
            leaves[2],
            leaves[3],
        )
        (want * c).sum().backward()
        for strategy in ("all_to_all", "allgather"):
            with scenario(f"layer {name} {case} {strategy}"):
                xs, ws = mine(x).clone().requires_grad_(), mine(w).clone().requires_grad_()
                gu = gu_l.shard(gate_up, mesh, mesh.rank).clone().requires_grad_()
                dn = dn_l.shard(down, mesh, mesh.rank).clone().requires_grad_()
                gu_v, dn_v = (
                    (fd.pvary(gu, mesh, "dp"), fd.pvary(dn, mesh, "dp")) if dp > 1 else (gu, dn)
                )  # replicated over dp

                def expert(rows: Tensor, i: int, gu: Tensor = gu_v, dn: Tensor = dn_v) -> Tensor:
                    g, u = F.linear(rows, gu[i]).chunk(2, dim=-1)
                    return F.linear(F.silu(g) * u, dn[i])

                r = M.moe(
                    xs,
                    ws,
                    mine(e),
                    expert,
                    mesh,
                    "ep",
                    E,
                    strategy=strategy,
                    tp_axis=tp,
                    capacity_factor=cf,
                )  # type: ignore[arg-type]
                torch.testing.assert_close(r.out, mine(want.detach()), **TOL)
                assert int(r.dropped) == (0 if keep is None else int((~mine(keep)).sum())), (
                    int(r.dropped),
                    case,
                )
                (r.out * mine(c)).sum().backward()
                torch.testing.assert_close(
                    xs.grad, mine(leaves[0].grad), **TOL, msg=lambda m: f"x: {m}"
                )
                torch.testing.assert_close(
                    ws.grad, mine(leaves[1].grad), **TOL, msg=lambda m: f"weights: {m}"
                )
                torch.testing.assert_close(
                    gu.grad,
                    gu_l.shard(leaves[2].grad, mesh, mesh.rank),
                    **TOL,
                    msg=lambda m: f"gate_up: {m}",
                )
                torch.testing.assert_close(
                    dn.grad,
                    dn_l.shard(leaves[3].grad, mesh, mesh.rank),
                    **TOL,
                    msg=lambda m: f"down: {m}",
                )
        assert keep is None or 0 < int((~keep).sum()) < keep.numel()


def snapshot(model: Any) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_mixtral_on_ranks(
    mesh: fd.Mesh,
    axis: str,
    strategy: str,
    *,
    steps: int = 3,
    skew: bool = False,
    capacity_factor: float | None = None,
) -> None:
    """Mixtral made expert-parallel by its plan, against one device: ``steps`` AdamW steps, each
    with the logits, the aux loss, the loss, the cross-entropy's gradients and the aux loss's
    gradients (every parameter) to 1e-10; then every weight. ``skew``: a router sending every token
    to experts 0 and 1 (the other ranks' experts get nothing); ``capacity_factor``: token dropping,
    the one-device model dropping the same assignments, and the reported counts against a hand
    count."""
    from fastdist.nn import moe as M
    from tests.test_moe import build_mixtral, drop_like_ep, lm_batch, reference

    ref = build_mixtral(seed=2 if not skew else 3)
    if skew:

        def to_experts_0_and_1(
            module: Any, args: Any, out: tuple[Tensor, Tensor, Tensor]
        ) -> tuple[Tensor, Tensor, Tensor]:
            logits, scores, idx = out
            return logits, scores, torch.cat([idx[:, :1] * 0, idx[:, :1] * 0 + 1], dim=-1)

        for layer in ref.model.layers:
            # kept by deepcopy: the parallel model routes the same
            layer.mlp.gate.register_forward_hook(to_experts_0_and_1)
    model = copy.deepcopy(ref)
    counts = (
        drop_like_ep(ref, mesh.axis_size("ep"), capacity_factor)
        if capacity_factor is not None
        else None
    )
    pm = fd.nn.parallelize(
        model,
        mesh,
        fd.nn.plans.plan(model, axis=axis, strategy=strategy, capacity_factor=capacity_factor),
    )
    opt_ref, opt = (
        torch.optim.AdamW(ref.parameters(), lr=1e-2),
        torch.optim.AdamW(pm.parameters(), lr=1e-2),
    )
    coef = ref.config.router_aux_loss_coef
    for step in range(steps):
        ids, labels = lm_batch(10 + step)
        logits, ce, aux = reference(ref, ids, labels)
        out = pm(input_ids=ids, labels=labels)
        torch.testing.assert_close(
            fd.all_gather_invariant(out.logits, mesh, axis, dim=-1)[..., : logits.shape[-1]],
            logits,
            **TOL,
        )
        # transformers computes the aux loss in float32 whatever the model's dtype: sums over
        # the ranks' tokens in another order may differ from one device's by a float32 ulp
        torch.testing.assert_close(out.aux_loss, aux, **AUX_TOL)
        torch.testing.assert_close(out.loss, ce + coef * aux, rtol=0, atol=1e-10 + coef * 1e-6)
        if counts is not None:
            got = {n: int(c) for n, c in M.dropped_counts(model).items()}
            assert got == {n: c[-1] for n, c in counts.items()}, (got, counts)
            assert all(c[-1] > 0 for c in counts.values())
        ce.backward(retain_graph=True)
        ref_ce = snapshot(ref)
        (coef * aux).backward()
        ref_all = snapshot(ref)
        (out.loss - coef * out.aux_loss).backward(retain_graph=True)
        got_ce = pm.grads()
        assert got_ce.keys() == ref_ce.keys()
        for n, g in ref_ce.items():
            torch.testing.assert_close(
                got_ce[n],
                g,
                **TOL,
                msg=lambda m, n=n, step=step: f"step {step} cross-entropy grad {n}: {m}",
            )
        (coef * out.aux_loss).backward()
        got_all = pm.grads()
        for n, g in ref_all.items():  # the aux loss's own gradient, then the total
            torch.testing.assert_close(
                (got_all[n] - got_ce[n]) / coef,
                (g - ref_ce[n]) / coef,
                **TOL,
                msg=lambda m, n=n, step=step: f"step {step} aux-loss grad {n}: {m}",
            )
            torch.testing.assert_close(
                got_all[n], g, **TOL, msg=lambda m, n=n, step=step: f"step {step} grad {n}: {m}"
            )
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    state = pm.state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(
            state[n], p.detach(), **TOL, msg=lambda m, n=n: f"after {steps} AdamW steps, {n}: {m}"
        )


def moe_on_gloo() -> str:
    """One rank of 4 gloo processes: the functional layer on ep=4, ep=2 x tp=2 and dp=2 x ep=2;
    Mixtral's plan on ep=4 and ep=2 x tp=2 with both strategies (3 AdamW steps each), with skewed
    routing and empty experts, and with token dropping."""
    assert torch.distributed.get_world_size() == 4
    ep4 = fd.connect(ep=4, timeout=60)
    ep2tp2 = fd.connect(ep=2, tp=2, timeout=60)
    dp2ep2 = fd.connect(ep=2, timeout=60)  # dp inferred: 2
    for mesh, name in ((ep4, "ep=4"), (ep2tp2, "ep=2 x tp=2"), (dp2ep2, "dp=2 x ep=2")):
        check_layer_on_ranks(mesh, name)
    for mesh, axis, name in ((ep4, "ep", "ep=4"), (ep2tp2, "tp", "ep=2 x tp=2")):
        for strategy in ("all_to_all", "allgather"):
            with scenario(f"mixtral {name} {strategy}"):
                check_mixtral_on_ranks(mesh, axis, strategy)
    for strategy in ("all_to_all", "allgather"):
        with scenario(
            f"mixtral ep=4 {strategy}, every token to experts 0 and 1 (experts 2, 3 empty)"
        ):
            check_mixtral_on_ranks(ep4, "ep", strategy, steps=1, skew=True)
    with scenario("mixtral ep=2 x tp=2 all_to_all, capacity_factor=0.5"):
        check_mixtral_on_ranks(ep2tp2, "tp", "all_to_all", steps=2, capacity_factor=0.5)
    return "ok"
