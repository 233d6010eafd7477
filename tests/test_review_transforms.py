"""Collectives under nested transforms, compiled per-rank code and unusual inputs, on simulated
ranks, against plain torch on the unsharded tensor on one device, in float64.

Found silent: ``torch.compile(per_rank_fn, dynamic=True)`` called inside ``fastdist.simulate``
made ``ppermute`` and ``ring_shift`` return zeros on every rank (values and gradients): the
stacked rule, run at a graph break, was compiled by dynamo as a frame of its own with ``perm`` as
SymInts, where dynamo answers ``1 in [0, 1]`` False, so every member was taken for idle and
zeroed. The other cases here guard compositions that were right: second derivatives through
each exchange, ``vmap`` over ``simulate`` with other ``in_dims`` / ``out_dims``, in-place ops on
outputs, ``inference_mode``, 0-d and non-contiguous inputs, one mesh in several threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.func import grad, vmap

import fastdist as fd

F64 = torch.float64
MESH = fd.Mesh({"dp": 2, "tp": 3})
TP = fd.Mesh({"tp": 4})


def rand(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def tp_roll(x: Tensor, shift: int) -> Tensor:
    """One device: rank (dp, tp) of a stacked [6, ...] tensor gets rank (dp, tp - shift)'s row."""
    return x.reshape(2, 3, *x.shape[1:]).roll(shift, 1).reshape(x.shape)


def partial_perm(x: Tensor) -> Tensor:
    """One device: tp rank 0 sends to 2 and 2 to 1; tp rank 0 receives nothing (zeros)."""
    y = x.reshape(2, 3, *x.shape[1:])
    out = torch.zeros_like(y)
    out[:, 2], out[:, 1] = y[:, 0], y[:, 2]
    return out.reshape(x.shape)


EXCHANGES: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]] = {
    "ring_shift": (lambda x: fd.ring_shift(x, MESH, "tp", 1), lambda x: tp_roll(x, 1)),
    "ppermute": (
        lambda x: fd.ppermute(x, MESH, "tp", [(0, 1), (1, 2), (2, 0)]),
        lambda x: tp_roll(x, 1),
    ),
    "partial": (lambda x: fd.ppermute(x, MESH, "tp", [(0, 2), (2, 1)]), partial_perm),
}


@pytest.mark.parametrize("name", sorted(EXCHANGES))
def test_exchange_compiled_with_dynamic_shapes_equals_one_device(name: str) -> None:
    """A per-rank function compiled with dynamic=True, called inside simulate on two sizes:
    values (an input without grad, the evaluation case) and gradients equal one device (the old
    code gave zeros everywhere without grad)."""
    op, ref = EXCHANGES[name]
    torch._dynamo.reset()
    per = torch.compile(lambda x: op(torch.sin(x)) * 2.0, dynamic=True, backend="aot_eager")
    for rows in (3, 5):
        x = rand(6, rows, 2, seed=rows)
        torch.testing.assert_close(
            fd.simulate(per, MESH)(x), ref(torch.sin(x)) * 2.0, rtol=0, atol=1e-12
        )
        x.requires_grad_()
        w = rand(6, rows, 2, seed=10 + rows)
        out = fd.simulate(per, MESH)(x)
        (out * w).sum().backward()
        xr = x.detach().clone().requires_grad_()
        expected = ref(torch.sin(xr)) * 2.0
        (expected * w).sum().backward()
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=1e-12)


def second_order(
    per_rank: Callable[..., Tensor],
    one_device: Callable[[Tensor], Tensor],
    x: Tensor,
    *extra: Tensor,
) -> None:
    """grad of <grad of sum(w * op(x)^3), c> per rank (simulate) == the same second derivative of
    the one-device program on the stacked tensor (each rank's loss differs: varying cotangents,
    which every exchange here carries)."""
    w, c = rand(*one_device(x).shape, seed=1), rand(*x.shape, seed=2)

    def per(x: Tensor, w: Tensor, c: Tensor, *extra: Tensor) -> Tensor:
        inner = grad(lambda x: (w * per_rank(x, *extra) ** 3).sum())
        return grad(lambda x: (inner(x) * c).sum())(x)

    got = fd.simulate(per, TP)(x, w, c, *extra)
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad((w * one_device(xr) ** 3).sum(), xr, create_graph=True)
    (expected,) = torch.autograd.grad((g * c).sum(), xr)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_second_order_through_all_gather() -> None:
    x = rand(4, 3)
    second_order(lambda x: fd.all_gather(x, TP, "tp"), lambda x: x.reshape(1, 12).expand(4, 12), x)


def test_second_order_through_psum_scatter() -> None:
    y = rand(4, 8)
    second_order(
        lambda y: fd.psum_scatter(y * y, TP, "tp"), lambda y: (y * y).sum(0).reshape(4, 2), y
    )


def test_second_order_through_ppermute_and_all_to_all() -> None:
    second_order(
        lambda x: fd.ppermute(torch.sin(x), TP, "tp", [(0, 1), (1, 2), (2, 3), (3, 0)]),
        lambda x: torch.sin(x).roll(1, 0),
        rand(4, 3),
    )
    z = rand(4, 8, 3)  # rank q's rows [2r, 2r + 2) go to rank r, concatenated along dim 1
    second_order(
        lambda x: fd.all_to_all(torch.sin(x), TP, "tp", 0, 1),
        lambda x: (
            torch.sin(x).reshape(4, 4, 2, 3).transpose(0, 1).permute(0, 2, 1, 3).reshape(4, 2, 12)
        ),
        z,
    )


def test_vmap_over_simulate_with_other_in_and_out_dims() -> None:
    """vmap(simulate(grad(...)), in_dims=1, out_dims=1) == the per-batch one-device gradient:
    grad of sum(psum(x)^2) per rank is 2 * sum over ranks (psum's backward is the identity)."""
    b = rand(5, 4, 3)
    per = fd.simulate(lambda x: grad(lambda x: (fd.psum(x, TP, "tp") ** 2).sum())(x), TP)
    got = vmap(per, in_dims=1, out_dims=1)(b.transpose(0, 1))
    expected = (2 * b.sum(1, keepdim=True)).expand(5, 4, 3).transpose(0, 1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


OUTPUT_OPS: dict[str, Callable[[Tensor], Tensor]] = {
    "psum": lambda x: fd.psum(x, TP, "tp"),
    "all_gather": lambda x: fd.all_gather(x, TP, "tp"),
    "ppermute": lambda x: fd.ppermute(x, TP, "tp", [(0, 1), (1, 0)]),
    "broadcast": lambda x: fd.broadcast(x, TP, "tp", src=3),
    "psum_scatter": lambda x: fd.psum_scatter(x, TP, "tp", dim=1),
}


@pytest.mark.parametrize("name", sorted(OUTPUT_OPS))
def test_in_place_on_an_output_equals_out_of_place(name: str) -> None:
    op = OUTPUT_OPS[name]
    x, w = rand(4, 3, 4).requires_grad_(), rand(4, 3, 4, seed=3)

    def in_place(x: Tensor) -> Tensor:
        y = op(x * 1.0)
        y.mul_(2.0).add_(1.0)
        return y

    out = fd.simulate(in_place, TP)(x)
    (out.sum(dim=tuple(range(1, out.dim()))) * w[:, 0, 0]).sum().backward()
    xr = x.detach().clone().requires_grad_()
    ref = fd.simulate(lambda x: op(x * 1.0) * 2.0 + 1.0, TP)(xr)
    (ref.sum(dim=tuple(range(1, ref.dim()))) * w[:, 0, 0]).sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)


def test_inference_mode_0d_and_non_contiguous_inputs() -> None:
    a = rand(4, 6, 8).transpose(1, 2)  # non-contiguous per-rank (8, 6) blocks
    with torch.inference_mode():
        gathered = fd.simulate(lambda x: fd.all_gather(x, TP, "tp", dim=-1), TP)(a)
        scattered = fd.simulate(lambda x: fd.psum_scatter(x, TP, "tp", dim=0), TP)(a)
        top = fd.simulate(lambda x: fd.pmax(x, TP, "tp"), TP)(a)
    torch.testing.assert_close(gathered, torch.cat(list(a), -1).expand(4, 8, 24))
    torch.testing.assert_close(scattered, a.sum(0).reshape(4, 2, 6))
    torch.testing.assert_close(top, a.amax(0).expand(4, 8, 6))
    z = rand(4)
    torch.testing.assert_close(
        fd.simulate(lambda x: fd.psum(x, TP, "tp"), TP)(z), z.sum().expand(4)
    )
    torch.testing.assert_close(
        fd.simulate(lambda x: fd.all_gather(x, TP, "tp", tiled=False), TP)(z), z.expand(4, 4)
    )


def test_one_mesh_in_several_threads() -> None:
    """Simulations over one mesh in four threads at once: each gets its own ranks' values."""
    results: dict[int, bool] = {}

    def work(i: int) -> None:
        x = rand(4, 50, seed=i)
        results[i] = all(
            torch.equal(
                fd.simulate(lambda t: fd.all_gather(t + 0.0, TP, "tp"), TP)(x)[2], x.reshape(-1)
            )
            for _ in range(20)
        )

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: True, 1: True, 2: True, 3: True}


def test_numpy_integers_name_ranks_as_ints_do() -> None:
    """A perm, src or shift built with NumPy (np.int64, as JAX takes them) works as the same
    Python ints (the old code refused np.int64(1) as 'not an index along the axis')."""
    np = pytest.importorskip("numpy")
    x = rand(6, 2)
    per = fd.simulate(
        lambda x: (
            fd.ppermute(x, MESH, "tp", [(np.int64(0), np.int64(2)), (np.int64(2), 1)]),
            fd.broadcast(x, MESH, "tp", src=np.int64(1)),
            fd.ring_shift(x, MESH, "tp", np.int64(1)),
        ),
        MESH,
    )
    moved, broadcast, shifted = per(x)
    torch.testing.assert_close(moved, partial_perm(x), rtol=0, atol=0)
    torch.testing.assert_close(broadcast, x.reshape(2, 3, 2)[:, 1:2].expand(2, 3, 2).reshape(6, 2))
    torch.testing.assert_close(shifted, tp_roll(x, 1), rtol=0, atol=0)
