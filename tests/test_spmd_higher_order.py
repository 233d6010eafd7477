"""Higher-order autodiff through ``fd.spmd`` on simulated meshes, against plain torch on one device.

Second-order gradients (``create_graph=True``), Hessian-vector products and gradient penalties
must not depend on how many replicas hold an input: a replicated axis once divided them by the
replica count (the backward's mean over holders was differentiated as a mean). Batched transforms
(``torch.vmap``, ``vmap(grad)``, ``jacrev(jacrev)``) run; forward mode (``jvp``, ``jacfwd``,
``hessian``, ``forward_ad``) is refused with a fastdist error, since the simulated collectives
drop tangents. All in float64.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import fastdist as fd
from fastdist import P

F64 = torch.float64
Fn = Callable[..., Tensor]

# meshes with an axis the input is replicated over (dp x tp in both orders, three axes), and
# one with none (the input split over every axis)
MESHES = [{"dp": 2, "tp": 3}, {"tp": 3, "dp": 2}, {"pp": 2, "dp": 2, "tp": 2}, {"tp": 3}]


def rand(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def leaves(*ts: Tensor) -> list[Tensor]:
    return [t.clone().requires_grad_() for t in ts]


def second_order(f: Fn, x: Tensor) -> tuple[Tensor, Tensor]:
    """The gradient of sum(f(x)^3) and the gradient of <that gradient, cos x>: second order,
    with the first-order cotangent depending on x."""
    xx = x.clone().requires_grad_()
    (g,) = torch.autograd.grad((f(xx) ** 3).sum(), xx, create_graph=True)
    (gg,) = torch.autograd.grad((g * torch.cos(xx)).sum(), xx)
    return g.detach(), gg


def close(a: Tensor, b: Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_second_derivative_of_x_squared_is_two(shape: dict[str, int]) -> None:
    """d2/dx2 sum(x*x) = 2 everywhere, however many replicas hold each block of x."""
    mesh = fd.Mesh(shape)
    f = fd.spmd(lambda x: x * x, mesh, in_specs=(P("tp"),), out_specs=P("tp"))
    x = rand(6, seed=0).requires_grad_()
    (g,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    close(g, 2 * x.detach())
    close(gg, torch.full_like(gg, 2.0))


@pytest.mark.parametrize("shape", MESHES, ids=str)
@pytest.mark.parametrize("spec", [P("tp", None), P(None, "tp"), P()], ids=str)
def test_second_order_elementwise(shape: dict[str, int], spec: P) -> None:
    """An elementwise program, its input split over tp (dims 0 or 1) or replicated everywhere."""
    mesh = fd.Mesh(shape)
    ref: Fn = lambda x: torch.tanh(x) * x  # noqa: E731
    f = fd.spmd(ref, mesh, in_specs=(spec,), out_specs=spec)
    x = rand(6, 6, seed=1)
    for a, b in zip(second_order(f, x), second_order(ref, x)):
        close(a, b)


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_second_order_through_a_collective(shape: dict[str, int]) -> None:
    """all_to_all re-shards rows over tp to columns over tp, then a nonlinearity."""
    mesh = fd.Mesh(shape)

    def prog(x: Tensor) -> Tensor:
        y = fd.all_to_all(x, mesh, "tp", split_dim=1, concat_dim=0)
        return torch.tanh(y) * y

    f = fd.spmd(prog, mesh, in_specs=(P("tp", None),), out_specs=P(None, "tp"))
    ref: Fn = lambda x: torch.tanh(x) * x  # noqa: E731
    x = rand(6, 6, seed=2)
    for a, b in zip(second_order(f, x), second_order(ref, x)):
        close(a, b)


def dp_loss(mesh: fd.Mesh) -> tuple[Fn, Fn]:
    """A data-parallel loss: x split over dp, w replicated over every axis, the loss pmean-ed."""

    def prog(x: Tensor, w: Tensor) -> Tensor:
        return fd.pmean(((x @ w) ** 3).mean(), mesh, "dp")

    f = fd.spmd(prog, mesh, in_specs=(P("dp", None), P()), out_specs=P())
    return f, lambda x, w: ((x @ w) ** 3).mean()


@pytest.mark.parametrize("shape", [{"dp": 2, "tp": 2}, {"dp": 2}, {"tp": 2, "dp": 3}], ids=str)
def test_hessian_vector_product(shape: dict[str, int]) -> None:
    """The Hessian-vector product by double backward equals torch.func.hessian(plain) @ v."""
    mesh = fd.Mesh(shape)
    f, ref = dp_loss(mesh)
    x, v = rand(6 * mesh.axis_size("dp"), 3, seed=3), rand(3, 2, seed=4)
    w = rand(3, 2, seed=5).requires_grad_()
    (g,) = torch.autograd.grad(f(x, w), w, create_graph=True)
    (hv,) = torch.autograd.grad((g * v).sum(), w)
    h = torch.func.hessian(ref, argnums=1)(x, w.detach())  # [3, 2, 3, 2]
    close(g.detach(), torch.func.grad(ref, argnums=1)(x, w.detach()))
    close(hv, (h * v).sum((2, 3)))


def test_gradient_penalty() -> None:
    """A critic's loss plus the gradient penalty ||d critic / d x||^2 (WGAN-GP): its gradients
    with respect to the replicated weights, on dp 2 x tp 2 (x split over dp)."""
    mesh = fd.Mesh({"dp": 2, "tp": 2})

    def critic(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        return torch.tanh(x @ w1) @ w2  # [batch, 1]

    def loss(c: Fn, x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        x = x.clone().requires_grad_()
        out = c(x, w1, w2)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return out.mean() + ((gx.norm(dim=1) - 1) ** 2).mean()

    f = fd.spmd(critic, mesh, in_specs=(P("dp", None), P(), P()), out_specs=P("dp", None))
    x, w1, w2 = rand(4, 3, seed=6), rand(3, 5, seed=7), rand(5, 1, seed=8)
    got = torch.autograd.grad(loss(f, x, *(ws := leaves(w1, w2))), ws)
    want = torch.autograd.grad(loss(critic, x, *(ws := leaves(w1, w2))), ws)
    for a, b in zip(got, want):
        close(a, b)


def test_third_order() -> None:
    """d3/dx3 sum(x^4) = 24 x, x replicated over dp (each order through the entry and exit)."""
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    f = fd.spmd(lambda x: x**4, mesh, in_specs=(P("tp"),), out_specs=P("tp"))
    x = rand(4, seed=9).requires_grad_()
    (g,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x, create_graph=True)
    (ggg,) = torch.autograd.grad(gg.sum(), x)
    close(ggg, 24 * x.detach())


def test_reverse_mode_hessian_and_vmap() -> None:
    """jacrev(jacrev(f)), torch.vmap(f) and vmap(grad(f)) through spmd equal plain torch."""
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    f, ref = dp_loss(mesh)
    x, w = rand(4, 3, seed=10), rand(3, 2, seed=11)
    hess = lambda fn: torch.func.jacrev(torch.func.jacrev(fn, argnums=1), argnums=1)  # noqa: E731
    close(hess(f)(x, w), hess(ref)(x, w))
    ws = rand(3, 3, 2, seed=12)
    close(torch.vmap(f, in_dims=(None, 0))(x, ws), torch.vmap(ref, in_dims=(None, 0))(x, ws))
    vg = lambda fn: torch.vmap(torch.func.grad(fn, argnums=1), in_dims=(None, 0))  # noqa: E731
    close(vg(f)(x, ws), vg(ref)(x, ws))


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian", "forward_ad"])
def test_forward_mode_is_refused(transform: str) -> None:
    """Forward mode would drop the simulated collectives' tangents (a psum's comes out zero):
    refused, naming spmd and the reverse-mode fix."""
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    f, _ = dp_loss(mesh)
    x, w = rand(4, 3, seed=13), rand(3, 2, seed=14)
    g = lambda w: f(x, w)  # noqa: E731
    with pytest.raises(fd.errors.MeshError, match=r"spmd.*forward-mode.*jacrev"):
        if transform == "jvp":
            torch.func.jvp(g, (w,), (torch.ones_like(w),))
        elif transform == "jacfwd":
            torch.func.jacfwd(g)(w)
        elif transform == "hessian":
            torch.func.hessian(g)(w)
        else:
            import torch.autograd.forward_ad as fwad

            with fwad.dual_level():
                g(fwad.make_dual(w, torch.ones_like(w)))


def test_out_spec_splitting_a_missing_dim_is_refused() -> None:
    """An out spec that splits a dim the per-rank output lacks: a fastdist error naming the
    output and the spec (was an IndexError from the assembly)."""
    mesh = fd.Mesh({"tp": 2})
    f = fd.spmd(lambda x: x.sum(), mesh, in_specs=(P("tp"),), out_specs=P("tp"))
    with pytest.raises(fd.errors.MeshError, match=r"output 0 has 0 dims.*P\('tp'\)"):
        f(rand(4, seed=15))
