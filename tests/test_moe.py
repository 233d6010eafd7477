"""Expert parallelism (fastdist.nn.moe) against one device: the functional layer, and transformers'
Mixtral made expert-parallel with a plan. float64 throughout, so outputs, losses and every gradient
must agree to 1e-10."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import fastdist as fd
from fastdist.nn import moe as M
from fastdist.nn.moe import routing
from tests import tiny_models

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}
H, I = 6, 4  # hidden, expert intermediate


def reference_experts(
    x: Tensor, weights: Tensor, experts: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor:
    """transformers' MixtralExperts forward, on one device: (T, H)."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tok, slot = torch.where(experts == e)
        if tok.numel() == 0:
            continue
        g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e]) * weights[tok, slot, None]
        out = out.index_add(0, tok, y)
    return out


def expert_weights(E: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, dtype=F64, generator=g), torch.randn(
        E, H, I, dtype=F64, generator=g
    )


def run_layer(
    x: Tensor,
    weights: Tensor,
    experts: Tensor,
    gate_up: Tensor,
    down: Tensor,
    mesh: fd.Mesh,
    *,
    strategy: str,
    tp: str | None = None,
    capacity_factor: float | None = None,
    capacity: int | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The layer on simulated ranks: tokens split over ep (x: (ep*T, H)), experts sharded over ep
    (and their features over tp).

    Returns (out (ep*T, H), dropped per rank, single-device-view gradients) for ``(out * c).sum()``
    with c = out's index."""
    ep = mesh.axis_size("ep")
    E = gate_up.shape[0]
    world = mesh.size
    T = x.shape[0] // ep
    gu_l = (
        fd.nn.Layout(fd.P("ep", tp, None), parts=(I, I), at=1) if tp else fd.nn.Layout(fd.P("ep"))
    )
    dn_l = fd.nn.Layout(fd.P("ep", None, tp)) if tp else fd.nn.Layout(fd.P("ep"))
    gus = torch.stack([gu_l.shard(gate_up, mesh, r) for r in range(world)]).requires_grad_()
    dns = torch.stack([dn_l.shard(down, mesh, r) for r in range(world)]).requires_grad_()
    ep_of = [mesh.index(r, "ep") for r in range(world)]
    xs = torch.stack([x.reshape(ep, T, H)[i] for i in ep_of]).detach().requires_grad_()
    ws = torch.stack([weights.reshape(ep, T, -1)[i] for i in ep_of]).detach().requires_grad_()
    es = torch.stack([experts.reshape(ep, T, -1)[i] for i in ep_of])

    def layer(x: Tensor, w: Tensor, e: Tensor, gu: Tensor, dn: Tensor) -> tuple[Tensor, Tensor]:
        def expert(rows: Tensor, i: int) -> Tensor:
            g, u = F.linear(rows, gu[i]).chunk(2, dim=-1)
            return F.linear(F.silu(g) * u, dn[i])

        r = M.moe(
            x,
            w,
            e,
            expert,
            mesh,
            "ep",
            E,
            strategy=strategy,
            tp_axis=tp,
            capacity_factor=capacity_factor,
            capacity=capacity,
        )  # type: ignore[arg-type]
        return r.out, r.dropped

    out, dropped = fd.simulate(layer, mesh)(xs, ws, es, gus, dns)
    c = torch.arange(out[0].numel(), dtype=F64).reshape(out[0].shape) / 10
    (out * c).sum().backward()
    # one rank per ep index
    first = [mesh.rank_of({"ep": i, **({tp: 0} if tp else {})}) for i in range(ep)]
    grads = {
        "x": xs.grad[first].reshape(ep * T, H),  # type: ignore[index]
        "weights": ws.grad[first].reshape(ep * T, -1),  # type: ignore[index]
        "gate_up": gu_l.join(gus.grad, mesh),  # type: ignore[arg-type]
        "down": dn_l.join(dns.grad, mesh),  # type: ignore[arg-type]
    }
    return out[first].reshape(ep * T, H).detach(), dropped[first], grads


def check_layer(
    x: Tensor,
    weights: Tensor,
    experts: Tensor,
    E: int,
    mesh: fd.Mesh,
    strategy: str,
    tp: str | None = None,
    seed: int = 0,
    keep: Tensor | None = None,
    **kw: Any,
) -> Tensor:
    gate_up, down = expert_weights(E, seed)
    out, dropped, grads = run_layer(
        x, weights, experts, gate_up, down, mesh, strategy=strategy, tp=tp, **kw
    )
    ep = mesh.axis_size("ep")
    T = x.shape[0] // ep
    leaves = {
        k: t.clone().requires_grad_()
        for k, t in {"x": x, "weights": weights, "gate_up": gate_up, "down": down}.items()
    }
    w_eff = leaves["weights"] if keep is None else torch.where(keep, leaves["weights"], 0)
    e_eff = experts if keep is None else torch.where(keep, experts, E)
    want = reference_experts(leaves["x"], w_eff, e_eff, leaves["gate_up"], leaves["down"])
    torch.testing.assert_close(out, want.detach(), **TOL)
    c = torch.arange(T * H, dtype=F64).reshape(T, H) / 10
    (want * c.repeat(ep, 1)).sum().backward()
    for k, leaf in leaves.items():
        torch.testing.assert_close(grads[k], leaf.grad, **TOL, msg=lambda m, k=k: f"{k}: {m}")
    return dropped


def random_routing(ep: int, T: int, E: int, k: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ep * T, H, dtype=F64, generator=g)
    r = M.route(torch.randn(ep * T, E, dtype=F64, generator=g), k)
    return x, r.weights, r.experts


# ============================================================================ the functional layer
@pytest.mark.parametrize("strategy", ["all_to_all", "allgather"])
@pytest.mark.parametrize("ep, E, k", [(2, 4, 2), (4, 8, 2), (4, 4, 1)])
def test_layer_matches_one_device(strategy: str, ep: int, E: int, k: int) -> None:
    x, w, e = random_routing(ep, 5, E, k, seed=ep + E)
    check_layer(x, w, e, E, fd.Mesh({"ep": ep}), strategy)


@pytest.mark.parametrize("strategy", ["all_to_all", "allgather"])
def test_ep_x_tp(strategy: str) -> None:
    """Experts over ep, each expert's features over tp (dp outside:
    test_dp_outside_ep_each_replica_with_its_own_tokens)."""
    x, w, e = random_routing(2, 4, 4, 2, seed=3)
    check_layer(x, w, e, 4, fd.Mesh({"ep": 2, "tp": 2}), strategy, tp="tp")


@pytest.mark.parametrize("strategy", ["all_to_all", "allgather"])
def test_dp_outside_ep_each_replica_with_its_own_tokens(strategy: str) -> None:
    """dp x ep: each of the 4 ranks routes its own tokens; the experts are sharded over ep and
    replicated over dp (pvary'd there, so their gradients sum over the dp replicas): everything
    equals one device."""
    mesh, E, T = fd.Mesh({"dp": 2, "ep": 2}), 4, 3
    x, w, e = random_routing(4, T, E, 2, seed=11)  # token group r on rank r
    gate_up, down = expert_weights(E, 5)
    leaves = {
        k: t.clone().requires_grad_()
        for k, t in {"x": x, "weights": w, "gate_up": gate_up, "down": down}.items()
    }
    want = reference_experts(leaves["x"], leaves["weights"], e, leaves["gate_up"], leaves["down"])
    c = torch.randn(want.shape, dtype=F64, generator=torch.Generator().manual_seed(2))
    (want * c).sum().backward()

    half = E // 2  # experts per ep rank
    shard = lambda t: torch.stack(
        [t[mesh.index(r, "ep") * half : (mesh.index(r, "ep") + 1) * half] for r in range(4)]
    )
    xs, ws = (
        x.reshape(4, T, H).clone().requires_grad_(),
        w.reshape(4, T, -1).clone().requires_grad_(),
    )
    gus, dns = shard(gate_up).requires_grad_(), shard(down).requires_grad_()

    def layer(x: Tensor, w: Tensor, e: Tensor, gu: Tensor, dn: Tensor) -> Tensor:
        # replicated over dp, used with dp-varying tokens
        gu, dn = (
            fd.pvary(gu, mesh, "dp"),
            fd.pvary(dn, mesh, "dp"),
        )

        def expert(rows: Tensor, i: int) -> Tensor:
            g, u = F.linear(rows, gu[i]).chunk(2, dim=-1)
            return F.linear(F.silu(g) * u, dn[i])

        return M.moe(x, w, e, expert, mesh, "ep", E, strategy=strategy).out  # type: ignore[arg-type]

    out = fd.simulate(layer, mesh)(xs, ws, e.reshape(4, T, -1), gus, dns)
    torch.testing.assert_close(out.reshape(4 * T, H), want.detach(), **TOL)
    (out * c.reshape(4, T, H)).sum().backward()
    torch.testing.assert_close(xs.grad.reshape(4 * T, H), leaves["x"].grad, **TOL)
    torch.testing.assert_close(ws.grad.reshape(4 * T, -1), leaves["weights"].grad, **TOL)
    for r in range(4):  # every dp replica holds the whole gradient of its ep shard
        i = mesh.index(r, "ep")
        torch.testing.assert_close(
            gus.grad[r], leaves["gate_up"].grad[i * half : (i + 1) * half], **TOL
        )
        torch.testing.assert_close(
            dns.grad[r], leaves["down"].grad[i * half : (i + 1) * half], **TOL
        )


@pytest.mark.parametrize("strategy", ["all_to_all", "allgather"])
def test_skewed_routing_and_empty_experts(strategy: str) -> None:
    """Every token to expert 5 (the other experts, and rank 0's, get nothing); then ranks with no
    tokens for anyone."""
    ep, T, E, k = 4, 3, 8, 1
    x, w, _ = random_routing(ep, T, E, k, seed=7)
    check_layer(x, w, torch.full((ep * T, k), 5), E, fd.Mesh({"ep": ep}), strategy)
    x, w, e = random_routing(ep, T, E, 2, seed=8)
    e = torch.where(e < 4, e, e % 2)  # experts 4..7 (ranks 2, 3) empty
    check_layer(x, w, e, E, fd.Mesh({"ep": ep}), strategy)


@pytest.mark.parametrize("strategy", ["all_to_all", "allgather"])
def test_token_dropping_reports_what_it_dropped(strategy: str) -> None:
    ep, T, E, k = 2, 6, 4, 2
    x, w, _ = random_routing(ep, T, E, k, seed=9)
    # every token to experts 0 and 1: capacity ceil(1.0 * 6 * 2 / 4) = 3 each per rank
    e = torch.tensor([[0, 1]] * (ep * T))
    keep = torch.cat(
        [
            routing.capacity_keep_mask(chunk, E, M.expert_capacity(T, k, E, 1.0))
            for chunk in e.reshape(ep, T, k)
        ]
    )
    assert keep.sum().item() == ep * 2 * 3
    dropped = check_layer(x, w, e, E, fd.Mesh({"ep": ep}), strategy, keep=keep, capacity_factor=1.0)
    assert dropped.tolist() == [T * k - 6] * ep


@settings(max_examples=15, deadline=None)
@given(
    ep=st.sampled_from([1, 2, 4]),
    T=st.integers(1, 5),
    k=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    strategy=st.sampled_from(["all_to_all", "allgather"]),
)
def test_random_assignments_round_trip(ep: int, T: int, k: int, seed: int, strategy: str) -> None:
    """Random token-to-expert assignments (any skew): dispatch + identity experts + combine gives
    back sum_j w_j x_t, in order; and the whole layer's gradients equal one device's."""
    E = 4
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ep * T, H, dtype=F64, generator=g)
    # distinct experts per token
    e = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(ep * T)])
    w = torch.rand(ep * T, k, dtype=F64, generator=g)
    mesh = fd.Mesh({"ep": ep})
    ident = fd.simulate(
        lambda x, w, e: (
            M.moe(x, w, e, lambda rows, i: rows * 1.0, mesh, "ep", E, strategy=strategy).out
        ),
        mesh,
    )  # type: ignore[arg-type]
    back = ident(x.reshape(ep, T, H), w.reshape(ep, T, k), e.reshape(ep, T, k))
    torch.testing.assert_close(back.reshape(ep * T, H), x * w.sum(-1, keepdim=True), **TOL)
    check_layer(x, w, e, E, mesh, strategy, seed=seed)


# ============================================================================ auxiliary losses
def test_load_balancing_loss_global_and_per_replica() -> None:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(8, 4, dtype=F64, generator=g) for _ in range(2)]  # two layers, 8 tokens
    hf = load_balancing_loss_func(tuple(logits), 4, 2)  # float32 inside
    torch.testing.assert_close(M.load_balancing_loss(logits, 2).float(), hf, rtol=1e-6, atol=1e-6)
    mesh = fd.Mesh({"dp": 2, "ep": 2})
    leaves = [lg.clone().requires_grad_() for lg in logits]
    want = M.load_balancing_loss(leaves, 2) + 0.1 * M.router_z_loss(leaves)
    want.backward()
    # tokens over dp x ep (rank = dp * 2 + ep)
    split = [lg.detach().reshape(4, 2, 4).clone().requires_grad_() for lg in logits]
    got = fd.simulate(
        lambda a, b: (
            M.load_balancing_loss([a, b], 2, mesh=mesh, axes=("dp", "ep"))
            + 0.1 * M.router_z_loss([a, b], mesh=mesh, axes=("dp", "ep"))
        ),
        mesh,
    )(*split)
    torch.testing.assert_close(got, want.detach().expand(4), **TOL)  # every rank: the global loss
    got.sum().backward()  # each rank's backward of its own copy
    for s, leaf in zip(split, leaves):
        torch.testing.assert_close(s.grad.reshape(8, 4), leaf.grad, **TOL)  # type: ignore[union-attr]
    per_replica = fd.simulate(lambda a: M.load_balancing_loss(a, 2), mesh)(
        logits[0].reshape(4, 2, 4)
    )
    torch.testing.assert_close(per_replica[1], M.load_balancing_loss(logits[0][2:4], 2), **TOL)


@pytest.mark.parametrize(
    "gating, normalize",
    [("softmax", True), ("softmax", False), ("sigmoid", True), ("sigmoid", False)],
)
def test_route_gating_and_normalize_match_plain_torch(gating: str, normalize: bool) -> None:
    """`route` against the plain-torch formula in float64: the experts, the gates and their
    gradient to the logits; and `load_balancing_loss`'s sigmoid gating (statistics of the sigmoid
    scores) likewise."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 6, dtype=F64, generator=g)
    c = torch.randn(9, 3, dtype=F64, generator=g)
    got_in, want_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    r = M.route(got_in, 3, gating=gating, normalize=normalize)  # type: ignore[arg-type]
    probs = want_in.softmax(-1) if gating == "softmax" else 1 / (1 + torch.exp(-want_in))
    # (T, 3): the 3 largest, largest first
    top_e = probs.detach().argsort(-1, descending=True)[:, :3]
    top = probs.gather(1, top_e)
    want = top / top.sum(-1, keepdim=True) if normalize else top
    assert torch.equal(r.experts, top_e)
    torch.testing.assert_close(r.weights, want.detach(), **TOL)
    torch.testing.assert_close(r.probs, probs.detach(), **TOL)
    (r.weights * c).sum().backward()
    (want * c).sum().backward()
    torch.testing.assert_close(got_in.grad, want_in.grad, **TOL)
    if gating == "sigmoid" and normalize:
        got_in.grad = want_in.grad = None
        loss = M.load_balancing_loss(got_in, 3, gating="sigmoid")
        chosen = F.one_hot(top_e, 6).sum(1).to(F64)  # (T, E)
        want_loss = 6 * (chosen.mean(0) * (1 / (1 + torch.exp(-want_in))).mean(0)).sum()
        torch.testing.assert_close(loss, want_loss.detach(), **TOL)
        loss.backward()
        want_loss.backward()
        torch.testing.assert_close(got_in.grad, want_in.grad, **TOL)


@pytest.mark.parametrize("normalize", [True, False])
def test_route_sigmoid_matches_deepseek_v3_router(normalize: bool) -> None:
    """transformers' DeepSeek-V3 router (sigmoid gating; one expert group, no score-correction
    bias, scale 1, so its group-limited choice is the plain top-k) against
    `route(gating="sigmoid")`. The router casts its input and weight to float32
    (modeling_deepseek_v3.py, DeepseekV3TopkRouter.forward:
    ``F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))``), so the
    comparison is in float32 (same ops: 1e-6)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(
        hidden_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=normalize,
    )
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=g))
    h = torch.randn(10, 16, generator=g)
    logits, hf_w, hf_e = router(h)
    r = M.route(logits, 2, gating="sigmoid", normalize=normalize)
    hf_e, perm = hf_e.sort(-1)  # transformers' top-k is unsorted: compare by expert id
    mine_e, mperm = r.experts.sort(-1)
    assert torch.equal(mine_e, hf_e)
    torch.testing.assert_close(
        r.weights.gather(1, mperm), hf_w.gather(1, perm), rtol=1e-6, atol=1e-7
    )


def test_router_z_loss_matches_switch_transformers() -> None:
    """`router_z_loss` against transformers' Switch Transformers ``router_z_loss_func`` in float64
    (it has no cast): one device, then tokens split over dp x ep on simulated ranks: global
    (``axes=("dp", "ep")``, every rank the loss of the whole batch and its gradient), per ep group
    (``axes=("ep",)``) and per replica (``axes=()``); values and gradients."""
    from transformers.models.switch_transformers.modeling_switch_transformers import (
        router_z_loss_func,
    )

    g = torch.Generator().manual_seed(12)
    # two layers, (groups, tokens, E)
    logits = [3 * torch.randn(2, 4, 4, dtype=F64, generator=g) for _ in range(2)]
    hf_in = [lg.clone().requires_grad_() for lg in logits]
    want = router_z_loss_func(torch.cat(hf_in, 1))  # all tokens of both layers: the mean over them
    want.backward()
    one = [lg.clone().requires_grad_() for lg in logits]
    got = M.router_z_loss([lg.reshape(-1, 4) for lg in one])
    torch.testing.assert_close(got, want.detach(), **TOL)
    got.backward()
    for a, b in zip(one, hf_in):
        torch.testing.assert_close(a.grad, b.grad, **TOL)

    mesh = fd.Mesh({"dp": 2, "ep": 2})  # 8 tokens per layer: 2 on each rank (rank = dp * 2 + ep)
    split = [lg.reshape(4, 2, 4).clone().requires_grad_() for lg in logits]
    out = fd.simulate(
        lambda a, b: torch.stack(
            [M.router_z_loss([a, b], mesh=mesh, axes=ax) for ax in (("dp", "ep"), ("ep",), ())]
        ),
        mesh,
    )(*split)
    torch.testing.assert_close(out[:, 0], want.detach().expand(4), **TOL)  # global
    flat = [lg.reshape(4, 2, 4) for lg in logits]
    for r in range(4):
        d = r // 2
        # this dp replica's ep group
        group = torch.cat([f[2 * d : 2 * d + 2].reshape(-1, 4) for f in flat]).reshape(1, -1, 4)
        torch.testing.assert_close(out[r, 1], router_z_loss_func(group), **TOL)
        torch.testing.assert_close(
            out[r, 2], router_z_loss_func(torch.cat([f[r] for f in flat]).reshape(1, -1, 4)), **TOL
        )
    out[:, 0].sum().backward()  # each rank's backward of its own copy of the global loss
    for s, b in zip(split, hf_in):
        torch.testing.assert_close(s.grad.reshape(2, 4, 4), b.grad, **TOL)  # type: ignore[union-attr]


# ============================================================================ errors
def test_errors_name_the_layer_and_the_fix() -> None:
    x, w, e = random_routing(2, 3, 4, 2, seed=1)
    with pytest.raises(
        fd.nn.MoEError,
        match=r"layer 'blocks\.0\.moe'.*4 experts do not divide over the 3 ranks of 'ep'.*Fix",
    ):
        fd.simulate(
            lambda x, w, e: (
                M.moe(
                    x, w, e, lambda r, i: r, fd.Mesh({"ep": 3}), "ep", 4, layer="blocks.0.moe"
                ).out
            ),
            fd.Mesh({"ep": 3}),
        )(x[:3].expand(3, 3, H), w[:3].expand(3, 3, 2), e[:3].expand(3, 3, 2))
    with pytest.raises(
        fd.nn.MoEError,
        match=r"layer 'blocks\.1\.router': top_k=5 but there are 4 experts.*Fix: 1 <= top_k <= 4",
    ):
        M.route(torch.zeros(3, 4), 5, layer="blocks.1.router")
    with pytest.raises(
        fd.nn.MoEError,
        match=r"layer 'blocks\.2\.aux': top_k=0 but there are 4 experts.*Fix: 1 <= top_k <= 4",
    ):
        M.load_balancing_loss(torch.zeros(3, 4), 0, layer="blocks.2.aux")
    mesh = fd.Mesh({"ep": 2})
    with pytest.raises(
        fd.nn.MoEError,
        match=r"layer 'blocks\.3\.moe': top_k=3 but there are 2 experts.*Fix: 1 <= top_k <= 2",
    ):
        fd.simulate(
            lambda x, w, e: M.moe(x, w, e, lambda r, i: r, mesh, "ep", 2, layer="blocks.3.moe").out,
            mesh,
        )(x.reshape(2, 3, H), torch.ones(2, 3, 3), torch.zeros(2, 3, 3, dtype=torch.long))
    with pytest.raises(
        fd.nn.MoEError,
        match=r"layer 'blocks\.4\.moe': strategy='ring'.*Fix: 'allgather' or 'all_to_all'",
    ):
        fd.simulate(
            lambda x, w, e: (
                M.moe(
                    x, w, e, lambda r, i: r, mesh, "ep", 4, strategy="ring", layer="blocks.4.moe"
                ).out
            ),  # type: ignore[arg-type]
            mesh,
        )(x.reshape(2, 3, H), w.reshape(2, 3, 2), e.reshape(2, 3, 2))
    skew = torch.zeros(2, 3, 2, dtype=torch.long)
    skew[..., 1] = 1  # every assignment to rank 0: 12 rows arrive
    with pytest.raises(
        fd.nn.MoEError,
        match=r"layer 'blocks\.5\.moe': .*receives more token assignments than "
        r"capacity=8.*simulated ranks.*capacity >= 12",
    ):
        fd.simulate(
            lambda x, w, e: (
                M.moe(x, w, e, lambda r, i: r, mesh, "ep", 4, capacity=8, layer="blocks.5.moe").out
            ),
            mesh,
        )(x.reshape(2, 3, H), w.reshape(2, 3, 2), skew)


# ============================================================================ transformers'
# Mixtral, expert-parallel
transformers = pytest.importorskip("transformers")
VOCAB = 61


def build_mixtral(seed: int = 0, experts: int = 4, layers: int = 2) -> Any:
    """A Mixtral with ``experts`` experts (intermediate 16), float64, eval mode."""
    return tiny_models.build(
        "mixtral", seed=seed, layers=layers, intermediate_size=16, num_local_experts=experts
    )


def lm_batch(seed: int = 1, B: int = 2, S: int = 7) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    return ids, labels


def reference(model: Any, ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(logits, cross-entropy, aux_loss) on one device; the cross-entropy in float64 (transformers'
    own upcasts to float32)."""
    out = model(input_ids=ids)
    ce = F.cross_entropy(
        out.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    return out.logits, ce, out.aux_loss


def compare_grads(pm: Any, ref: Any, **tol: float) -> None:
    grads = pm.grads()
    assert grads.keys() == {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            grads[name], p.grad, **tol, msg=lambda m, name=name: f"{name}: {m}"
        )


def rep(t: Tensor, mesh: fd.Mesh) -> Tensor:
    return t.expand(mesh.size, *t.shape)


def whole_logits(sharded: Tensor, mesh: fd.Mesh, axis: str) -> Tensor:
    return torch.cat(
        [
            sharded[mesh.rank_of({**{a: 0 for a in mesh.axis_names}, axis: i})]
            for i in range(mesh.axis_size(axis))
        ],
        -1,
    )[..., :VOCAB]


@pytest.mark.parametrize(
    "axes, strategy",
    [
        ({"ep": 2}, "all_to_all"),
        ({"ep": 4}, "all_to_all"),
        ({"ep": 2}, "allgather"),
        ({"ep": 2, "tp": 2}, "all_to_all"),
        ({"ep": 2, "tp": 2}, "allgather"),
    ],
)
def test_mixtral_matches_one_device(axes: dict[str, int], strategy: str) -> None:
    ref = build_mixtral()
    model = copy.deepcopy(ref)
    ids, labels = lm_batch()
    want_logits, want_ce, want_aux = reference(ref, ids, labels)
    coef = ref.config.router_aux_loss_coef
    mesh = fd.Mesh(axes)
    tp = "tp" if "tp" in axes else "ep"
    pm = fd.nn.parallelize(
        model, mesh, fd.nn.plans.plan(model, family="mixtral", axis=tp, strategy=strategy)
    )
    assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape) == (
        mesh.size,
        4 // axes["ep"],
        32 // (axes.get("tp", 1)),
        32,
    )
    # output_router_logits=True in the config
    out = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
    torch.testing.assert_close(whole_logits(out.logits, mesh, tp), want_logits.detach(), **TOL)
    torch.testing.assert_close(out.aux_loss, rep(want_aux.detach(), mesh), **TOL)
    torch.testing.assert_close(out.loss, rep((want_ce + coef * want_aux).detach(), mesh), **TOL)
    # The cross-entropy's gradients, then the aux loss's, each to 1e-10. transformers computes the
    # aux loss in float32 even
    # in a float64 model (modeling_mixtral.py, load_balancing_loss_func: ``router_prob_sum =
    # torch.zeros(num_experts,
    # dtype=torch.float32, ...)`` and ``routing_weights.float().sum(dim=0)``; the router too:
    # MixtralTopKRouter.forward's
    # ``softmax(router_logits.float(), dim=-1)``), so aux_loss is only float32-accurate. But both
    # sides run those same
    # float32 ops on float64 router logits that agree to ~1e-16 (which round to the same float32
    # values), and everything
    # before and after the casts is float64: the aux loss and its gradient still agree to 1e-10 (a
    # looser tolerance would
    # only be needed if a logit sat within 1e-16 of a float32 rounding boundary).
    want_ce.backward(retain_graph=True)
    (out.loss - coef * out.aux_loss).sum().backward(retain_graph=True)
    compare_grads(pm, ref, **TOL)
    ref.zero_grad(set_to_none=False)
    pm.module.zero_grad(set_to_none=False)
    want_aux.backward()
    out.aux_loss.sum().backward()
    compare_grads(pm, ref, **TOL)


def test_mixtral_three_adamw_steps_and_the_family_plan() -> None:
    ref = build_mixtral(seed=2)
    model = copy.deepcopy(ref)
    mesh = fd.Mesh({"ep": 2, "tp": 2})
    pm = fd.nn.parallelize(model, mesh)  # the mixtral row, experts over ep, attention over tp
    opt_ref, opt = (
        torch.optim.AdamW(ref.parameters(), lr=1e-2),
        torch.optim.AdamW(pm.parameters(), lr=1e-2),
    )
    coef = ref.config.router_aux_loss_coef
    for step in range(3):
        ids, labels = lm_batch(10 + step)
        _, ce, aux = reference(ref, ids, labels)
        (ce + coef * aux).backward()
        loss = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh)).loss
        torch.testing.assert_close(loss, rep((ce + coef * aux).detach(), mesh), **TOL)
        loss.sum().backward()
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    state = pm.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            state[name], p.detach(), **TOL, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_mixtral_skewed_routing_and_empty_experts() -> None:
    """A router that sends every token to experts 0 and 1 (rank 1's experts 2, 3 get nothing), then
    8 experts for 14 tokens."""
    ref = build_mixtral(seed=3)

    def to_experts_0_and_1(
        module: Any, args: Any, out: tuple[Tensor, Tensor, Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]:
        logits, scores, idx = out
        # (T, 2): experts 0, 1 for every token
        return (
            logits,
            scores,
            torch.cat([idx[:, :1] * 0, idx[:, :1] * 0 + 1], dim=-1),
        )

    for layer in ref.model.layers:
        # kept by deepcopy: the parallel model routes the same
        layer.mlp.gate.register_forward_hook(to_experts_0_and_1)
    for r, experts in ((ref, 4), (build_mixtral(seed=4, experts=8), 8)):
        model = copy.deepcopy(r)
        mesh = fd.Mesh({"ep": 2})
        ids, labels = lm_batch(5)
        logits, ce, aux = reference(r, ids, labels)
        pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, family="mixtral", axis="ep"))
        out = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
        torch.testing.assert_close(whole_logits(out.logits, mesh, "ep"), logits.detach(), **TOL)
        torch.testing.assert_close(out.aux_loss[0], aux.detach(), **TOL)
        (ce + r.config.router_aux_loss_coef * aux).backward()
        out.loss.sum().backward()
        compare_grads(pm, r, **TOL)
        del experts


def hand_keep(experts: Tensor, num_experts: int, per_expert: int) -> Tensor:
    """(T, k) bool, by hand: walk the assignments token by token (slot by slot) and keep the first
    ``per_expert`` of each expert."""
    seen = [0] * (num_experts + 1)
    keep = torch.ones(experts.shape, dtype=torch.bool)
    for t in range(experts.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            if e < num_experts:
                keep[t, j] = seen[e] < per_expert
                seen[e] += 1
    return keep


def drop_like_ep(model: Any, ep: int, capacity_factor: float) -> dict[str, list[int]]:
    """Make a one-device Mixtral drop what an ep-way ExpertParallel with ``capacity_factor`` drops:
    each of the ep shares of the (padded) tokens keeps ``ceil(capacity_factor * share * k / E)``
    assignments per expert, the others get gate 0 (they contribute nothing, and get no gradient).
    Returns {layer: [dropped count of each forward]}."""
    import math

    counts: dict[str, list[int]] = {}
    E = model.config.num_local_experts
    for i, layer in enumerate(model.model.layers):
        name = f"model.layers.{i}.mlp.experts"
        counts[name] = []

        def pre(
            module: Any, args: tuple[Tensor, Tensor, Tensor], name: str = name
        ) -> tuple[Tensor, Tensor, Tensor]:
            x, idx, w = args
            T, k = idx.shape
            share = -(-T // ep)  # tokens per rank after padding T to a multiple of ep
            cap = math.ceil(capacity_factor * share * k / E)
            keep = torch.cat([hand_keep(idx[s : s + share], E, cap) for s in range(0, T, share)])
            counts[name].append(int((~keep).sum()))
            return x, idx, torch.where(keep, w, 0)

        layer.mlp.experts.register_forward_pre_hook(pre)
    return counts


@pytest.mark.parametrize(
    "axes, strategy, capacity_factor",
    [
        ({"ep": 2}, "all_to_all", 0.5),
        ({"ep": 4}, "allgather", 0.75),
        ({"ep": 2, "tp": 2}, "all_to_all", 1.0),
    ],
)
def test_mixtral_token_dropping_reported_in_the_model_path(
    axes: dict[str, int], strategy: str, capacity_factor: float
) -> None:
    """plans.mixtral(capacity_factor=...): every ExpertParallelExperts reports after each forward
    the assignments its layer dropped (dropped_counts), equal to a hand count; the logits, loss and
    every gradient equal a one-device model whose experts drop the same assignments (gate 0)."""
    ref = build_mixtral(seed=6)
    model = copy.deepcopy(ref)  # before the hooks: the parallel model drops by itself
    ep = axes["ep"]
    counts = drop_like_ep(ref, ep, capacity_factor)
    mesh = fd.Mesh(axes)
    tp = "tp" if "tp" in axes else "ep"
    pm = fd.nn.parallelize(
        model,
        mesh,
        fd.nn.plans.plan(
            model, family="mixtral", axis=tp, strategy=strategy, capacity_factor=capacity_factor
        ),
    )
    assert M.dropped_counts(model) == {}  # nothing before the first forward
    coef = ref.config.router_aux_loss_coef
    for step in range(2):  # the count is the last forward's
        ids, labels = lm_batch(20 + step)  # 14 tokens: padded to 16 for ep=4
        logits, ce, aux = reference(ref, ids, labels)
        out = pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh))
        got = M.dropped_counts(model)
        assert {n: c.tolist() for n, c in got.items()} == {
            n: [c[-1]] * mesh.size for n, c in counts.items()
        }
        assert all(0 < c[-1] < 2 * 14 for c in counts.values())  # some dropped, not all
        torch.testing.assert_close(whole_logits(out.logits, mesh, tp), logits.detach(), **TOL)
        torch.testing.assert_close(out.loss, rep((ce + coef * aux).detach(), mesh), **TOL)
    (ce + coef * aux).backward()
    out.loss.sum().backward()
    compare_grads(pm, ref, **TOL)


def test_mixtral_plan_errors() -> None:
    with pytest.raises(
        fd.nn.MoEError,
        match=r"layer 'model\.layers\.0\.mlp\.experts': 4 experts do not divide over the 3 ranks "
        r"of 'ep'.*Fix",
    ):
        fd.nn.parallelize(
            build_mixtral(layers=1),
            fd.Mesh({"ep": 3}),
            {"model.layers.*.mlp.experts": fd.nn.moe.ExpertParallel()},
        )
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"'model\.layers\.0\.mlp\.gate' \(MixtralTopKRouter\) is not a 3-D-parameter experts",
    ):
        fd.nn.parallelize(
            build_mixtral(layers=1),
            fd.Mesh({"ep": 2}),
            {"model.layers.0.mlp.gate": fd.nn.moe.ExpertParallel()},
        )
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"'model\.layers\.0\.mlp\.experts' has experts of 16 intermediate features, not "
        r"divisible by the 3 ranks of 'tp'.*Fix",
    ):
        fd.nn.parallelize(
            build_mixtral(layers=1),
            fd.Mesh({"ep": 2, "tp": 3}),
            {"model.layers.*.mlp.experts": fd.nn.moe.ExpertParallel(tp_axis="tp")},
        )
    model = build_mixtral(layers=1)
    # a layout ExpertParallel does not implement: experts without a gate
    model.model.layers[0].mlp.experts.has_gate = False
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"'model\.layers\.0\.mlp\.experts' \(MixtralExperts\) has experts without a "
        r"gate.*Fix",
    ):
        fd.nn.parallelize(
            model, fd.Mesh({"ep": 2}), {"model.layers.*.mlp.experts": fd.nn.moe.ExpertParallel()}
        )
    ids = torch.zeros(2, 1, 4, dtype=torch.long)
    pm = fd.nn.parallelize(
        build_mixtral(layers=1),
        fd.Mesh({"ep": 2}),
        {"model.layers.*.mlp.experts": fd.nn.moe.ExpertParallel(capacity=1)},
    )
    with pytest.raises(
        fd.nn.MoEError,
        match=r"layer 'model\.layers\.0\.mlp\.experts': .*receives more token assignments than "
        r"capacity=1",
    ):
        pm(input_ids=ids)


def test_moe_on_gloo() -> None:
    """Real ranks (exact receive sizes; each expert on its own rows), one launch of 4 processes for
    every scenario (tests/moe_worker.py): the functional layer on ep=4, ep=2 x tp=2 and dp=2 x
    ep=2, both strategies, skewed routing, empty experts and dropping (out, dropped and every
    gradient); Mixtral's plan on ep=4 and ep=2 x tp=2, both strategies, 3 AdamW steps (logits, aux
    loss, loss, the cross-entropy's and the aux loss's gradients, weights), skewed routing with
    empty experts, and token dropping with its reported counts; all against one device in float64
    to 1e-10."""
    from tests.dist_harness import run_on_gloo
    from tests.moe_worker import moe_on_gloo

    assert run_on_gloo(moe_on_gloo, 4, timeout=300) == ["ok"] * 4
