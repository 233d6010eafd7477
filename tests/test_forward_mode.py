"""Forward-mode AD through the collectives on simulated ranks: ``torch.func.jvp``, ``jacfwd``,
``hessian`` (``jacfwd`` over reverse mode) and ``torch.autograd.forward_ad`` dual tensors, against
plain torch on the unsharded (stacked) tensor, in float64.

Each case is a per-rank function ``y = op(sin(x)); y * y`` and its plain-torch reference on the
stacked ``[world, ...]`` tensor. Forward mode is the true derivative of the simulated program (a
psum's tangent is the psum of the tangents), whatever fastdist's reverse-mode convention for
replicated outputs. Before the ``jvp`` rules (core/primitive.py) every tangent here came out zero
or wrong, and dual tensors came back without a tangent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwad
from torch import Tensor

import fastdist as fd
from fastdist.errors import CollectiveError

W = 4
MESH = fd.Mesh({"dp": W})
SIZES = (1, 3, 2, 2)

# name -> (op on one rank's tensor, reference on the stacked tensor, output invariant over dp)
Case = tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor], bool]


def _a2a_ref(s: Tensor) -> Tensor:
    # rank r receives chunk r (of dim 0) of every rank, side by side along dim 1
    c = s.reshape(W, W, s.shape[1] // W, s.shape[2])  # [src, chunk, rows, cols]
    return c.permute(1, 2, 0, 3).reshape(W, s.shape[1] // W, W * s.shape[2])


def _halo_ref(s: Tensor) -> Tensor:
    # rank r: [rank r-1's last row | its rows | rank r+1's first row], zeros at the ends
    z = torch.zeros_like(s[0, :1])
    return torch.stack(
        [
            torch.cat([s[r - 1, -1:] if r else z, s[r], s[r + 1, :1] if r < W - 1 else z])
            for r in range(W)
        ]
    )


CASES: dict[str, Case] = {
    "psum": (
        lambda x: fd.psum(x, MESH, "dp"),
        lambda s: s.sum(0, keepdim=True).expand_as(s),
        True,
    ),
    "pmean": (
        lambda x: fd.pmean(x, MESH, "dp"),
        lambda s: s.mean(0, keepdim=True).expand_as(s),
        True,
    ),
    "pmax": (
        lambda x: fd.pmax(x, MESH, "dp"),
        lambda s: s.amax(0, keepdim=True).expand_as(s),
        True,
    ),
    "pmin": (
        lambda x: fd.pmin(x, MESH, "dp"),
        lambda s: s.amin(0, keepdim=True).expand_as(s),
        True,
    ),
    "pvary": (lambda x: fd.pvary(x, MESH, "dp"), lambda s: s, False),
    "all_gather": (
        lambda x: fd.all_gather(x, MESH, "dp", dim=0),
        lambda s: s.reshape(1, -1, s.shape[2]).expand(W, -1, -1),
        False,  # declared varying
    ),
    "all_gather_untiled": (
        lambda x: fd.all_gather(x, MESH, "dp", dim=1, tiled=False),
        lambda s: s.permute(1, 0, 2).unsqueeze(0).expand(W, -1, -1, -1),
        False,  # declared varying
    ),
    "psum_scatter": (
        lambda x: fd.psum_scatter(x, MESH, "dp", dim=0),
        lambda s: s.reshape(W, W, -1, s.shape[2]).sum(0),
        False,
    ),
    "all_to_all": (
        lambda x: fd.all_to_all(x, MESH, "dp", split_dim=0, concat_dim=1),
        _a2a_ref,
        False,
    ),
    "ring_shift": (
        lambda x: fd.ring_shift(x, MESH, "dp"),
        lambda s: torch.roll(s, 1, 0),
        False,
    ),
    "ppermute": (
        lambda x: fd.ppermute(x, MESH, "dp", [(0, 2), (2, 0), (1, 3), (3, 1)]),
        lambda s: s[[2, 3, 0, 1]],
        False,
    ),
    "broadcast": (
        lambda x: fd.broadcast(x, MESH, "dp", src=1),
        lambda s: s[1:2].expand_as(s),
        True,
    ),
    "halo_exchange": (
        lambda x: fd.halo_exchange(x, MESH, "dp", 0, 1),
        lambda s: _halo_ref(s),
        False,
    ),
    "all_gather_v": (
        lambda x: fd.all_gather_v(x, MESH, "dp", SIZES),
        lambda s: torch.cat([s[r, : SIZES[r]] for r in range(W)]).unsqueeze(0).expand(W, -1, -1),
        False,  # declared varying
    ),
}


def _fn(op: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    def per_rank(x: Tensor) -> Tensor:
        y = op(x.sin())
        return y * y

    return per_rank


def _ref(ref: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    return lambda xs: ref(xs.sin()) ** 2


def _inputs(seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(W, 4, 3, dtype=torch.float64, generator=g)
    return xs, torch.randn(W, 4, 3, dtype=torch.float64, generator=g)


@pytest.mark.parametrize("name", sorted(CASES))
def test_jvp(name: str) -> None:
    op, ref, _ = CASES[name]
    xs, v = _inputs()
    out, tangent = torch.func.jvp(fd.simulate(_fn(op), MESH), (xs,), (v,))
    want_out, want = torch.func.jvp(_ref(ref), (xs,), (v,))
    torch.testing.assert_close(out, want_out)
    assert want.abs().max() > 0
    torch.testing.assert_close(tangent, want)


@pytest.mark.parametrize("name", sorted(CASES))
def test_jvp_inside_simulate(name: str) -> None:
    """A jvp per rank (simulate's vmap outside): every rank's tangent at once, exchanged by the
    collectives, is the outer jvp."""
    op, ref, _ = CASES[name]
    xs, v = _inputs(1)
    per_rank = _fn(op)
    _, tangent = fd.simulate(lambda x, t: torch.func.jvp(per_rank, (x,), (t,)), MESH)(xs, v)
    _, want = torch.func.jvp(_ref(ref), (xs,), (v,))
    torch.testing.assert_close(tangent, want)


@pytest.mark.parametrize("name", ["psum", "pmax", "all_gather", "psum_scatter", "ring_shift"])
def test_jacfwd(name: str) -> None:
    op, ref, _ = CASES[name]
    xs, _ = _inputs(2)
    got = torch.func.jacfwd(fd.simulate(_fn(op), MESH))(xs)
    torch.testing.assert_close(got, torch.autograd.functional.jacobian(_ref(ref), xs))


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_ad_dual(name: str) -> None:
    op, ref, _ = CASES[name]
    xs, v = _inputs(3)
    with fwad.dual_level():
        out = fd.simulate(_fn(op), MESH)(fwad.make_dual(xs, v))
        primal, tangent = fwad.unpack_dual(out)
    _, want = torch.func.jvp(_ref(ref), (xs,), (v,))
    assert tangent is not None
    torch.testing.assert_close(tangent, want)
    torch.testing.assert_close(primal, _ref(ref)(xs))


@pytest.mark.parametrize("name", sorted(set(CASES) - {"pvary"}))
def test_hessian(name: str) -> None:
    """jacfwd over ``simulate(grad(loss))``: forward mode through the backward rules.

    Each rank's loss is ``sum(y * y)``; the gradient fastdist's convention gives (checked first)
    is that of the global loss: one copy of a replicated (invariant) loss, else the sum over ranks.
    (pvary is left out: its convention is for an input replicated over the axis.)"""
    op, ref, invariant = CASES[name]
    per_rank = _fn(op)
    xs, _ = _inputs(4)

    def global_loss(ys: Tensor) -> Tensor:
        out = _ref(ref)(ys)
        return out[0].sum() if invariant else out.sum()

    grad = fd.simulate(torch.func.grad(lambda x: per_rank(x).sum()), MESH)
    torch.testing.assert_close(grad(xs), torch.func.grad(global_loss)(xs))
    got = torch.func.jacfwd(grad)(xs)
    torch.testing.assert_close(got, torch.func.hessian(global_loss)(xs))


def test_jvp_twice() -> None:
    """Forward over forward: the jvp rules are themselves collectives with jvp rules."""
    op, ref, _ = CASES["psum"]
    xs, v = _inputs(5)
    sim = fd.simulate(_fn(op), MESH)

    def inner(f: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        return lambda x: torch.func.jvp(f, (x,), (v,))[1]

    _, got = torch.func.jvp(inner(sim), (xs,), (v,))
    _, want = torch.func.jvp(inner(_ref(ref)), (xs,), (v,))
    torch.testing.assert_close(got, want)


def test_vmap_over_simulate_jvp() -> None:
    """jacfwd's outer vmap over jvp over simulate is tested above; here a vmap over a batch of
    simulations, each differentiated in forward mode."""
    op, ref, _ = CASES["all_to_all"]
    xs, v = _inputs(6)
    xb, vb = torch.stack([xs, xs.cos()]), torch.stack([v, -v])

    def one(x: Tensor, t: Tensor) -> Any:
        return torch.func.jvp(fd.simulate(_fn(op), MESH), (x,), (t,))[1]

    got = torch.vmap(one)(xb, vb)
    want = torch.stack([torch.func.jvp(_ref(ref), (x,), (t,))[1] for x, t in zip(xb, vb)])
    torch.testing.assert_close(got, want)


def test_no_rule_is_refused() -> None:
    """A primitive declared without a jvp rule refuses forward mode at its first call (never a
    dropped tangent): ragged_all_to_all (data-dependent sizes) declares none."""
    from fastdist.core.primitive import PRIMITIVES

    assert PRIMITIVES["ragged_all_to_all"].jvp is None
    mesh = fd.Mesh({"ep": 2})
    sizes = torch.tensor([[1, 2], [2, 0]])
    xs = torch.randn(2, 3, 2, dtype=torch.float64)
    v = torch.randn_like(xs)
    sim = fd.simulate(lambda x, s: fd.ragged_all_to_all(x, mesh, "ep", s, capacity=3)[0], mesh)
    sim(xs, sizes)  # without a tangent it runs
    with pytest.raises(CollectiveError, match="forward-mode tangent.*reverse mode"):
        torch.func.jvp(lambda x: sim(x, sizes), (xs,), (v,))
    with fwad.dual_level(), pytest.raises(CollectiveError, match="ragged_all_to_all"):
        sim(fwad.make_dual(xs, v), sizes)


@pytest.mark.parametrize("how", ["jvp_inside", "dual"])
def test_compiled_forward_mode_is_refused(how: str) -> None:
    """torch.compile records the ops, which carry no tangent: refused while dynamo traces
    (before: the jvp inside a compiled function came out wrong, the dual tensor's tangent None)."""
    torch._dynamo.reset()
    op, _, _ = CASES["psum"]
    xs, v = _inputs(8)
    sim = fd.simulate(_fn(op), MESH)
    with pytest.raises(Exception, match="forward-mode tangent.*under torch.compile"):
        if how == "jvp_inside":
            torch.compile(lambda x, t: torch.func.jvp(sim, (x,), (t,))[1])(xs, v)
        else:
            with fwad.dual_level():
                torch.compile(sim)(fwad.make_dual(xs, v))


# ---------------------------------------------------------------------- real ranks (gloo)
def _forward_mode_on_real_ranks() -> tuple[str, str, Tensor]:
    """On a rank: a forward_ad dual tensor and a torch.func.jvp through psum are refused (nothing
    is sent); the mesh stays usable."""
    mesh = fd.connect(dp=2, timeout=60)
    x = torch.arange(3, dtype=torch.float64)
    with fwad.dual_level():
        try:
            fd.psum(fwad.make_dual(x, torch.ones(3, dtype=torch.float64)), mesh, "dp")
            dual = "no error"
        except CollectiveError as e:
            dual = str(e)
    try:
        torch.func.jvp(lambda t: fd.psum(t, mesh, "dp"), (x,), (x,))
        jvp = "no error"
    except CollectiveError as e:
        jvp = str(e)
    return dual, jvp, fd.psum(x, mesh, "dp")


def test_real_ranks_refuse_forward_mode() -> None:
    from tests.dist_harness import run_on_gloo

    for dual, jvp, total in run_on_gloo(_forward_mode_on_real_ranks, 2, timeout=120):
        assert "fastdist.psum(axis='dp')" in dual and "forward_ad" in dual, dual
        assert "reverse mode" in dual, dual
        assert "forward-mode tangent" in jvp and "reverse mode" in jvp, jvp
        torch.testing.assert_close(total, 2 * torch.arange(3, dtype=torch.float64))


@pytest.mark.parametrize(
    "name", ["all_gather_v", "reduce_scatter_v", "halo_exchange", "all_gather", "all_to_all"]
)
def test_vmap_over_simulate_uneven(name: str) -> None:
    """A vmap over simulate batches the stacked op's data, which goes after every per-rank dim:
    placed in front (before), all_gather_v took it for its rows and returned a [7, 4, 4, 3]
    tensor for a [2, 4, 8, 3] one, halo_exchange's values were wrong (no error), and jacfwd over
    all_gather_v failed."""
    ops: dict[str, Callable[[Tensor], Tensor]] = {
        "all_gather_v": lambda x: fd.all_gather_v(x, MESH, "dp", SIZES),
        "reduce_scatter_v": lambda x: fd.reduce_scatter_v(x, MESH, "dp", (1, 1, 1, 1)),
        "halo_exchange": lambda x: fd.halo_exchange(x, MESH, "dp", 0, 1),
        "all_gather": lambda x: fd.all_gather(x, MESH, "dp", dim=1, tiled=False),
        "all_to_all": lambda x: fd.all_to_all(x, MESH, "dp", split_dim=0, concat_dim=1),
    }
    sim = fd.simulate(ops[name], MESH)
    xb = torch.randn(2, W, 4, 3, dtype=torch.float64)
    torch.testing.assert_close(torch.vmap(sim)(xb), torch.stack([sim(x) for x in xb]))
