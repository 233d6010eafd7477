"""End-to-end oracles: parallel models on simulated ranks against the same model on one device."""

from __future__ import annotations

import pytest
import torch
from einops import rearrange, repeat
from torch import Tensor

import fastdist as fd
from fastdist.tools.demo import run_demo, tp_mlp

F64 = torch.float64


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ============================================================================ tensor-parallel MLP
class TPMLPCase:
    """Global tensors, their per-rank shards on a dp x tp mesh, and single-device gradients."""

    def __init__(self, dp: int, tp: int, B: int = 3, D: int = 5, H_per: int = 2) -> None:
        self.mesh = fd.Mesh({"dp": dp, "tp": tp})
        self.dp, self.tp, H = dp, tp, H_per * tp
        g = gen(dp * 10 + tp)
        self.x = torch.randn(dp * B, D, dtype=F64, generator=g)
        self.W1 = torch.randn(D, H, dtype=F64, generator=g)
        self.b1 = torch.randn(H, dtype=F64, generator=g)
        self.W2 = torch.randn(H, D, dtype=F64, generator=g)
        leaves = [t.clone().requires_grad_() for t in (self.x, self.W1, self.b1, self.W2)]
        x, w1, b1, w2 = leaves
        self.ref_loss = (torch.tanh(x @ w1 + b1) @ w2).sin().sum()
        self.ref_loss.backward()
        self.ref_grads = self.shard(*(t.grad for t in leaves))

    def shard(self, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor) -> tuple[Tensor, ...]:
        dp, tp = self.dp, self.tp
        return (
            repeat(x, "(dp b) d -> (dp tp) b d", dp=dp, tp=tp),  # data over dp, replicated over tp
            repeat(w1, "d (tp h) -> (dp tp) d h", dp=dp, tp=tp),  # column shards
            repeat(b1, "(tp h) -> (dp tp) h", dp=dp, tp=tp),
            repeat(w2, "(tp h) d -> (dp tp) h d", dp=dp, tp=tp),  # row shards
        )

    def leaves(self) -> list[Tensor]:
        return [t.clone().requires_grad_() for t in self.shard(self.x, self.W1, self.b1, self.W2)]

    def loss(self, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor) -> Tensor:
        return tp_mlp(x, w1, b1, w2, self.mesh).sin().sum()

    def check(self, grads: list[Tensor], sync_dp: bool = True) -> None:
        for i, (got, want) in enumerate(zip(grads, self.ref_grads)):
            if i > 0 and sync_dp:  # weights: each dp replica has its batch's share; sum over dp
                got = fd.simulate(lambda g: fd.psum(g, self.mesh, "dp"), self.mesh)(got)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


MESHES = [(1, 4), (2, 2), (2, 3), (3, 1)]


@pytest.mark.parametrize("dp, tp", MESHES)
def test_tp_mlp_backward(dp: int, tp: int) -> None:
    case = TPMLPCase(dp, tp)
    leaves = case.leaves()
    losses = fd.simulate(case.loss, case.mesh)(*leaves)
    total = rearrange(losses, "(dp tp) -> dp tp", dp=dp)[:, 0].sum()
    torch.testing.assert_close(total, case.ref_loss.detach())
    losses.sum().backward()
    case.check([t.grad for t in leaves])


@pytest.mark.parametrize("dp, tp", MESHES)
def test_tp_mlp_func_grad_inside_simulate(dp: int, tp: int) -> None:
    case = TPMLPCase(dp, tp)
    grads = fd.simulate(lambda *a: torch.func.grad(case.loss, argnums=(0, 1, 2, 3))(*a), case.mesh)(
        *case.shard(case.x, case.W1, case.b1, case.W2)
    )
    case.check(list(grads))


@pytest.mark.parametrize("dp, tp", [(2, 2)])
def test_tp_mlp_compiled_gradients_equal_eager_and_single_device(dp: int, tp: int) -> None:
    torch._dynamo.reset()
    case = TPMLPCase(dp, tp)
    step = fd.simulate(case.loss, case.mesh)
    eager, comp = case.leaves(), case.leaves()
    step(*eager).sum().backward()
    torch.compile(step, fullgraph=True)(*comp).sum().backward()
    for a, b in zip(comp, eager):
        torch.testing.assert_close(a.grad, b.grad)
    case.check([t.grad for t in comp])


def test_tp_mlp_without_pvary_gets_dx_wrong() -> None:
    """Why pvary exists: without it each rank keeps only its partial dx (the classic silent bug)."""
    case = TPMLPCase(1, 4)

    def no_pvary(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor) -> Tensor:
        return fd.psum(torch.tanh(x @ w1 + b1) @ w2, case.mesh, "tp").sin().sum()

    leaves = case.leaves()
    fd.simulate(no_pvary, case.mesh)(*leaves).sum().backward()
    assert (leaves[0].grad - case.ref_grads[0]).abs().max() > 1e-3
    # the partials sum to dx
    torch.testing.assert_close(leaves[0].grad.sum(0), case.ref_grads[0][0])


def test_demo_matches_single_device() -> None:
    res = run_demo(2, 2)
    assert res.ok, res
    assert res.max_grad_diff.keys() == {"x", "W1", "b1", "W2"} and len(res.rank_losses) == 4


# ============================================================================ data parallel
def test_data_parallel_gradient_averaging_with_pmean() -> None:
    dp, B, D = 4, 3, 5
    mesh = fd.Mesh({"dp": dp})
    g = gen(7)
    x, y, W = (
        torch.randn(dp * B, D, dtype=F64, generator=g),
        torch.randn(dp * B, dtype=F64, generator=g),
        torch.randn(D, dtype=F64, generator=g),
    )
    w = W.clone().requires_grad_()
    ((x @ w - y) ** 2).mean().backward()  # single device, full batch

    def rank_step(x: Tensor, y: Tensor, w: Tensor) -> Tensor:
        grad = torch.func.grad(lambda w: ((x @ w - y) ** 2).mean())(w)  # local batch mean
        return fd.pmean(grad, mesh, "dp")  # average over replicas = full-batch gradient

    grads = fd.simulate(rank_step, mesh)(
        rearrange(x, "(dp b) d -> dp b d", dp=dp),
        rearrange(y, "(dp b) -> dp b", dp=dp),
        repeat(W, "d -> dp d", dp=dp),
    )
    torch.testing.assert_close(grads, repeat(w.grad, "d -> dp d", dp=dp))


# ============================================================== Ulysses sequence parallel attention
def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """(B, S, H, Dh) -> (B, S, H, Dh), softmax attention per head."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    "mesh_axes, axis",
    [({"sp": 4}, "sp"), ({"dp": 2, "sp": 2}, "sp"), ({"sp": 2, "tp": 2}, ("sp", "tp"))],
)
def test_ulysses_attention_matches_single_device(mesh_axes: dict[str, int], axis) -> None:
    mesh = fd.Mesh(mesh_axes)
    P = mesh.axis_size(axis)
    reps = mesh.size // P  # other axes hold replicas of the same problem
    B, S, H, Dh, D = 2, 4 * P, 2 * P, 3, 5
    g = gen(11)
    q, k, v = (torch.randn(B, S, H, Dh, dtype=F64, generator=g) for _ in range(3))
    Wo = torch.randn(H * Dh, D, dtype=F64, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, Wo)]
    out = rearrange(attention(*leaves[:3]), "b s h d -> b s (h d)") @ leaves[3]
    (out.sin().sum()).backward()

    def shard_seq(
        t: Tensor,
    ) -> Tensor:  # (B, S, H, Dh) -> [world, B, S/P, H, Dh]; rank index along axis = seq chunk
        chunks = rearrange(t, "b (p s) h d -> p b s h d", p=P)
        return torch.stack([chunks[mesh.index(r, axis)] for r in range(mesh.size)])

    def rank_loss(q: Tensor, k: Tensor, v: Tensor, wo: Tensor) -> Tensor:
        # (B, S, H/P, Dh): all tokens, my heads
        q, k, v = (fd.all_to_all_4d(t, mesh, axis) for t in (q, k, v))
        # (B, S/P, H, Dh)
        o = fd.all_to_all_4d(attention(q, k, v), mesh, axis, scatter_dim=1, gather_dim=2)
        # my tokens' share of the loss
        return (rearrange(o, "b s h d -> b s (h d)") @ wo).sin().sum()

    sq, sk, sv = (shard_seq(t).requires_grad_() for t in (q, k, v))
    swo = repeat(Wo, "i o -> w i o", w=mesh.size).clone().requires_grad_()
    losses = fd.simulate(rank_loss, mesh)(sq, sk, sv, swo)
    torch.testing.assert_close(losses.sum() / reps, out.sin().sum().detach())
    losses.sum().backward()
    for got, leaf in zip((sq, sk, sv), leaves):
        torch.testing.assert_close(got.grad, shard_seq(leaf.grad))
    # Wo is replicated: each rank has its tokens' share; sum over the sequence axis.
    dwo = fd.simulate(lambda g: fd.psum(g, mesh, axis), mesh)(swo.grad)
    torch.testing.assert_close(dwo, repeat(leaves[3].grad, "i o -> w i o", w=mesh.size))
