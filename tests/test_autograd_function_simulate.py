"""A user's own torch.autograd.Function whose backward calls a collective, under simulate.

Megatron-LM's tensor-parallel regions are written this way: "copy to the region" is the
identity forward with a psum backward, "reduce from the region" a psum forward with the
identity backward, "gather from the region" an all_gather forward whose backward keeps the
rank's own slice. The backward runs after simulate returned; simulate leaves on each
Function's autograd node what a collective there needs to find the simulation again
(fastdist.sim.simulate._Resume). Every gradient is checked against one device in float64.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import Tensor

import fastdist as fd
from fastdist import P

F64 = torch.float64
TP = 2


def _regions(mesh: fd.Mesh) -> dict[str, Any]:
    """The three Functions as a user writes them (generate_vmap_rule + setup_context)."""

    class CopyToRegion(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x: Tensor, scale: float) -> Tensor:
            return x * scale

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Tensor, float], output: Tensor) -> None:
            ctx.scale = inputs[1]  # non-tensor state on ctx

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
            return fd.psum(g, mesh, "tp") * ctx.scale, None

    class ReduceFromRegion(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x: Tensor) -> Tensor:
            return fd.psum(x, mesh, "tp")

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
            pass

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            return g

    class GatherFromRegion(torch.autograd.Function):
        """All-gather the last dim; backward keeps this rank's slice (axis_index in backward),
        with a saved tensor."""

        generate_vmap_rule = True

        @staticmethod
        def forward(x: Tensor) -> Tensor:
            return fd.all_gather(x, mesh, "tp", dim=-1, tiled=True)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            (x,) = ctx.saved_tensors
            i = fd.axis_index(mesh, "tp")
            # [..., tp * d] -> [..., tp, d] -> this rank's [..., d]
            own = g.unflatten(-1, (TP, x.shape[-1])).index_select(-2, i.reshape(1)).squeeze(-2)
            return own

    return {"copy": CopyToRegion, "reduce": ReduceFromRegion, "gather": GatherFromRegion}


def _per_rank(mesh: fd.Mesh):
    r = _regions(mesh)

    def mlp(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
        """Column-parallel w1, row-parallel w2, column-parallel w3 gathered: [b, 4] -> [b, 6]."""
        h = torch.tanh(r["copy"].apply(x, 0.5) @ w1)  # [b, 8 / tp]
        y = r["reduce"].apply(h @ w2)  # [b, 5], replicated
        return r["gather"].apply(torch.sin(r["copy"].apply(y, 1.0) @ w3))  # [b, 6]

    return mlp


def _reference(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
    return torch.sin((torch.tanh((x * 0.5) @ w1) @ w2) @ w3)


def _problem() -> tuple[list[Tensor], Tensor, list[Tensor]]:
    """Global inputs, the cotangent, and the single-device gradients (float64)."""
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(*s, dtype=F64, generator=g) for s in ((3, 4), (4, 8), (8, 5), (5, 6))]
    c = torch.randn(3, 6, dtype=F64, generator=g)
    leaves = [t.clone().requires_grad_() for t in full]
    grads = torch.autograd.grad((_reference(*leaves) * c).sum(), leaves)
    return full, c, list(grads)


def _stacked(full: list[Tensor]) -> list[Tensor]:
    """Each rank's inputs stacked: x replicated, w1 and w3 split by columns, w2 by rows."""
    x, w1, w2, w3 = full
    return [
        x.expand(TP, *x.shape).clone(),
        torch.stack(w1.chunk(TP, 1)),
        torch.stack(w2.chunk(TP, 0)),
        torch.stack(w3.chunk(TP, 1)),
    ]


def _check_rank_grads(grads: list[Tensor], ref: list[Tensor]) -> None:
    """x's gradient whole on every rank, each weight's gradient the rank's block."""
    gx, g1, g2, g3 = grads
    for r in range(TP):
        torch.testing.assert_close(gx[r], ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g1[r], ref[1].chunk(TP, 1)[r], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g2[r], ref[2].chunk(TP, 0)[r], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g3[r], ref[3].chunk(TP, 1)[r], rtol=1e-12, atol=1e-12)


def test_backward_after_simulate_returned_gives_the_single_device_gradient() -> None:
    mesh = fd.Mesh({"tp": TP})
    full, c, ref = _problem()
    leaves = [t.requires_grad_() for t in _stacked(full)]
    out = fd.simulate(_per_rank(mesh), mesh)(*leaves)  # [tp, 3, 6]
    torch.testing.assert_close(out, _reference(*full).expand(TP, 3, 6), rtol=1e-12, atol=1e-12)
    (out * c).sum().backward()  # every rank's backward of its own loss
    _check_rank_grads([t.grad for t in leaves], ref)


def test_torch_func_grad_inside_simulate() -> None:
    """Per-rank torch.func.grad: the backward runs while simulate is running."""
    mesh = fd.Mesh({"tp": TP})
    full, c, ref = _problem()
    mlp = _per_rank(mesh)

    def grads(*args: Tensor) -> tuple[Tensor, ...]:
        return torch.func.grad(lambda *a: (mlp(*a) * c).sum(), argnums=(0, 1, 2, 3))(*args)

    _check_rank_grads(list(fd.simulate(grads, mesh)(*_stacked(full))), ref)


def test_vmap_over_simulate_and_a_wider_mesh() -> None:
    """Two independent problems (a vmap over simulate) on a dp x tp mesh: the backward's vmap
    over the ranks sits under the outer vmap, and tp groups are (0, 1) and (2, 3)."""
    mesh = fd.Mesh({"dp": 2, "tp": TP})
    full, c, ref = _problem()
    # [2 problems, 4 ranks, ...]: problem p is the inputs scaled by (p + 1), ranks dp-replicated
    per_rank = [torch.cat([s, s]) for s in _stacked(full)]
    leaves = [torch.stack([t, 2 * t]).requires_grad_() for t in per_rank]
    out = torch.vmap(fd.simulate(_per_rank(mesh), mesh))(*leaves)  # [2, 4, 3, 6]
    (out[0] * c).sum().backward()  # problem 1 gets no loss: its gradients must be zero
    for d in range(2):
        _check_rank_grads([t.grad[0, d * TP : (d + 1) * TP] for t in leaves], ref)
        assert all(bool((t.grad[1] == 0).all()) for t in leaves)


def test_transforms_around_simulate() -> None:
    """torch.func.grad(simulate(...)) runs the backward inside itself, torch.func.vjp's function
    after the transform is over, vmap(grad(...)) under one more vmap: the Function's backward
    binds to the right re-created vmap each time (the collective in forward is a plain psum:
    see the last test for a Function's forward)."""
    mesh = fd.Mesh({"tp": TP})
    full, c, ref = _problem()
    x, *ws = full
    copy = _regions(mesh)["copy"]
    _, w1, w2, _ = _stacked(full)

    def per_rank(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        return fd.psum(torch.tanh(copy.apply(x, 0.5) @ w1) @ w2, mesh, "tp")  # [3, 5]

    def outputs(x: Tensor) -> Tensor:  # [tp, 3, 5]
        return fd.simulate(per_rank, mesh)(x.expand(TP, *x.shape), w1, w2)

    def loss(x: Tensor) -> Tensor:  # the sum over ranks of each rank's loss
        return (outputs(x) * c[:, :5]).sum()

    # each rank's gradient is the single-device one; x's copies on the ranks sum them
    leaf = x.clone().requires_grad_()
    (((torch.tanh((leaf * 0.5) @ ws[0]) @ ws[1]) * c[:, :5]).sum() * TP).backward()
    torch.testing.assert_close(torch.func.grad(loss)(x), leaf.grad, rtol=1e-12, atol=1e-12)
    _, vjp = torch.func.vjp(outputs, x)
    (g,) = vjp(c[:, :5].expand(TP, 3, 5))
    torch.testing.assert_close(g, leaf.grad, rtol=1e-12, atol=1e-12)
    both = torch.vmap(torch.func.grad(loss))(torch.stack([x, x]))
    torch.testing.assert_close(both, leaf.grad.expand(2, *x.shape), rtol=1e-12, atol=1e-12)


def test_an_equal_mesh_built_elsewhere_and_meshes_argument() -> None:
    """The Functions use a mesh equal to simulate's, given as a further mesh of simulate."""
    mesh, other = fd.Mesh({"tp": TP}), fd.Mesh({"mp": TP})
    full, c, ref = _problem()
    leaves = [t.requires_grad_() for t in _stacked(full)]
    inner = _per_rank(fd.Mesh({"tp": TP}))
    (fd.simulate(inner, other, meshes=[mesh])(*leaves) * c).sum().backward()
    _check_rank_grads([t.grad for t in leaves], ref)


def test_without_the_simulation_mode_the_backward_says_what_to_do() -> None:
    mesh = fd.Mesh({"tp": TP})
    full, _, _ = _problem()
    leaves = [t.requires_grad_() for t in _stacked(full)]
    out = fd.simulate(_per_rank(mesh), mesh, batch_sdpa=False)(*leaves)
    with pytest.raises(
        fd.NoBackendError,
        match=r"(?s)fastdist\.(psum|axis_index): called over Mesh\(\{'tp': 2\}\) in the "
        r"backward of autograd node Vmapped\w+Backward.*batch_sdpa=True.*Fix: .*generate_vmap_rule",
    ):
        out.sum().backward()


def test_a_function_applied_outside_simulate_says_what_to_do() -> None:
    mesh = fd.Mesh({"tp": TP})
    x = torch.ones(3, dtype=F64, requires_grad=True)
    with pytest.raises(
        fd.NoBackendError, match=r"in the backward of autograd node CopyToRegionBackward.*Fix: "
    ):
        _regions(mesh)["copy"].apply(x, 1.0).sum().backward()


def test_a_function_with_its_own_vmap_rule_is_refused_in_backward() -> None:
    """With a vmap staticmethod torch runs the backward on the stacked tensors, with no vmap
    over the ranks: refused, naming the Function and the fix."""
    mesh = fd.Mesh({"tp": TP})

    class OwnVmap(torch.autograd.Function):
        @staticmethod
        def forward(x: Tensor) -> Tensor:
            return x.clone()

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
            pass

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            return fd.psum(g, mesh, "tp")

        @staticmethod
        def vmap(info: Any, in_dims: tuple[int | None], x: Tensor) -> tuple[Tensor, int | None]:
            return OwnVmap.apply(x), in_dims[0]

    x = torch.ones(TP, 3, dtype=F64, requires_grad=True)
    out = fd.simulate(lambda x: OwnVmap.apply(x), mesh)(x)
    with pytest.raises(
        fd.NoBackendError,
        match=r"backward of autograd\.Function OwnVmap, applied inside fastdist\.simulate .*"
        r"Fix: give OwnVmap generate_vmap_rule = True",
    ):
        out.sum().backward()


def test_grad_of_simulate_refuses_a_collective_in_a_functions_forward() -> None:
    """torch.func.grad(simulate(...)) hides simulate's vmap from the Function's forward (torch
    re-creates it at another level): a fastdist error, not torch's internal assert."""
    mesh = fd.Mesh({"tp": TP})
    reduce = _regions(mesh)["reduce"]
    x = torch.ones(3, dtype=F64)
    with pytest.raises(fd.NoBackendError, match=r"simulate's vmap over the ranks is hidden.*Fix: "):
        torch.func.grad(lambda x: fd.simulate(reduce.apply, mesh)(x.expand(TP, 3)).sum())(x)


# torch.compile. torch 2.13's compiler gets an autograd.Function under vmap wrong: it ignores
# the generated vmap rule and, since no tensor inside vmap requires grad in its trace, inlines the
# forward and differentiates that, dropping the Function's backward. simulate refuses a Function
# applied with gradients on while dynamo traces it, with or without fullgraph. The tests use
# backend="aot_eager": the refusal happens in dynamo's trace, before any backend.


def _compile_error(name: str) -> str:
    """The refusal's message, naming Function ``name``."""
    return (
        r"(?s)fastdist\.simulate over Mesh\(\{'tp': 2\}\) under torch\.compile: autograd\."
        rf"Function {name} is applied with gradients on.*drops the Function's backward.*Fix: run "
        rf"the step eagerly under fastdist\.simulate.*run_on_gloo.*replace {name} by fastdist's "
        r"collectives"
    )


def _plain_function() -> Any:
    """A Function with no collective whose backward is not its forward's derivative (a scaled
    gradient, as gradient-reversal and straight-through layers do)."""

    class ScaledGrad(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x: Tensor) -> Tensor:
            return x * 2

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
            pass

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            return g * 3

    return ScaledGrad


def _identity_copy(mesh: fd.Mesh) -> Any:
    """Megatron's copy_to_tensor_model_parallel_region exactly: the forward returns its input."""

    class IdentityCopy(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x: Tensor) -> Tensor:
            return x

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
            pass

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            return fd.psum(g, mesh, "tp")

    return IdentityCopy


def test_torch_compile_of_vmap_drops_a_functions_backward() -> None:
    """torch's own bug, without fastdist (why simulate refuses): if this fails, torch fixed it and
    the refusal below can be revisited."""
    scaled = _plain_function()
    x = torch.randn(2, 3, dtype=F64)
    grads = []
    for compile_ in (False, True):
        leaf = x.clone().requires_grad_()
        f = torch.vmap(lambda t: scaled.apply(t).sin())
        if compile_:
            torch._dynamo.reset()
            f = torch.compile(f, backend="aot_eager")
        f(leaf).sum().backward()
        grads.append(leaf.grad)
    cos = (2 * x).cos()
    torch.testing.assert_close(grads[0], 3 * cos)  # the Function's backward
    torch.testing.assert_close(grads[1], 2 * cos)  # the forward's derivative


@pytest.mark.parametrize("kind", ["copy", "identity_copy", "no_collective"])
def test_compiled_simulate_refuses_a_function_with_gradients(kind: str) -> None:
    """Each Function, the identity forward too (nothing of it is left in the compiled graph),
    with batch_sdpa on and off, with and without fullgraph: fastdist's error naming the
    Function, where the compiled gradients were wrong before."""
    mesh = fd.Mesh({"tp": TP})
    fn = {
        "copy": _regions(mesh)["copy"],
        "identity_copy": _identity_copy(mesh),
        "no_collective": _plain_function(),
    }[kind]
    name = fn.__name__

    def per_rank(x: Tensor, w: Tensor) -> Tensor:
        y = fn.apply(x, 1.0) if kind == "copy" else fn.apply(x)
        return fd.psum(torch.tanh(y @ w), mesh, "tp")

    x = torch.randn(TP, 3, 4, dtype=F64, requires_grad=True)
    w = torch.randn(TP, 4, 2, dtype=F64, requires_grad=True)
    for batch_sdpa in (True, False):
        for fullgraph in (True, False):
            torch._dynamo.reset()
            step = fd.simulate(per_rank, mesh, batch_sdpa=batch_sdpa)
            with pytest.raises(Exception, match=_compile_error(name)):
                torch.compile(step, backend="aot_eager", fullgraph=fullgraph)(x, w)


def test_what_compiles_with_such_functions() -> None:
    """simulate(torch.compile(fn)) runs fn eagerly (dynamo does not compile under an eager vmap)
    and gives one device's gradients; torch.compile(simulate(fn)) under torch.no_grad() (forward
    only: no backward to drop) gives one device's values, bit for bit the eager ones."""
    mesh = fd.Mesh({"tp": TP})
    full, c, ref = _problem()
    torch._dynamo.reset()
    leaves = [t.requires_grad_() for t in _stacked(full)]
    out = fd.simulate(torch.compile(_per_rank(mesh), backend="aot_eager"), mesh)(*leaves)
    torch.testing.assert_close(out, _reference(*full).expand(TP, 3, 6), rtol=1e-12, atol=1e-12)
    (out * c).sum().backward()
    _check_rank_grads([t.grad for t in leaves], ref)

    torch._dynamo.reset()
    with torch.no_grad():
        step = fd.simulate(_per_rank(mesh), mesh)
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(*_stacked(full))
        torch.testing.assert_close(compiled, step(*_stacked(full)), rtol=0, atol=0)
    torch.testing.assert_close(compiled, _reference(*full).expand(TP, 3, 6), rtol=1e-12, atol=1e-12)


class _Megatron(torch.nn.Module):
    """A tensor-parallel MLP written Megatron's way: copy to the region (identity forward, psum
    backward), column- then row-parallel weights, reduce from the region (psum forward)."""

    def __init__(self, mesh: fd.Mesh, w1: Tensor, w2: Tensor) -> None:
        super().__init__()
        regions = _regions(mesh)
        self.copy, self.reduce = _identity_copy(mesh), regions["reduce"]
        self.w1, self.w2 = torch.nn.Parameter(w1), torch.nn.Parameter(w2)  # this rank's blocks

    def forward(self, x: Tensor) -> Tensor:
        return self.reduce.apply(torch.tanh(self.copy.apply(x) @ self.w1) @ self.w2)


def test_compiled_module_forward_under_simulate() -> None:
    """A module's forward with such Functions: torch.compile(simulate(...)) refuses;
    simulate(torch.compile(...)) runs the module eagerly, with one device's gradients; under
    torch.no_grad() the compiled forward is exact."""
    mesh = fd.Mesh({"tp": TP})
    full, c, _ = _problem()
    x, w1, w2, _ = full
    c5 = c[:, :5]
    one = [t.clone().requires_grad_() for t in (x, w1, w2)]
    ((torch.tanh(one[0] @ one[1]) @ one[2]) * c5).sum().backward()  # one device
    gx, g1, g2 = (t.grad for t in one)
    _, sw1, sw2, _ = _stacked(full)
    names = ["w1", "w2"]

    def per_rank(module: torch.nn.Module, x: Tensor, *ws: Tensor) -> Tensor:
        return torch.func.functional_call(module, dict(zip(names, ws)), (x,))  # [3, 5]

    module = _Megatron(mesh, sw1[0], sw2[0])
    xs = x.expand(TP, 3, 4)
    torch._dynamo.reset()
    step = fd.simulate(functools.partial(per_rank, module), mesh)
    with pytest.raises(Exception, match=_compile_error("IdentityCopy")):
        torch.compile(step, backend="aot_eager")(xs, sw1, sw2)

    torch._dynamo.reset()
    inner = torch.compile(functools.partial(per_rank, module), backend="aot_eager")
    leaves = [
        xs.clone().requires_grad_(),
        sw1.clone().requires_grad_(),
        sw2.clone().requires_grad_(),
    ]
    (fd.simulate(inner, mesh)(*leaves) * c5).sum().backward()
    for r in range(TP):  # x's gradient whole on every rank, each weight's its block
        torch.testing.assert_close(leaves[0].grad[r], gx, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(leaves[1].grad[r], g1.chunk(TP, 1)[r], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(leaves[2].grad[r], g2.chunk(TP, 0)[r], rtol=1e-12, atol=1e-12)

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(step, backend="aot_eager")(xs, sw1, sw2)
    want = (torch.tanh(x @ w1) @ w2).expand(TP, 3, 5)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def gloo_compiled_megatron() -> list[Tensor]:
    """One gloo rank: the Megatron pair compiled, backward; this rank's gradients. (With
    fullgraph=True dynamo refuses to trace the backward's closure over the Mesh: torch's
    Unsupported "SourcelessBuilder.create does not know how to wrap Mesh".)"""
    mesh = fd.connect(tp=TP)
    regions = _regions(mesh)
    full, c, _ = _problem()
    x, w1, w2, _ = full
    r = mesh.rank
    leaves = [
        x.clone().requires_grad_(),
        w1.chunk(TP, 1)[r].clone().requires_grad_(),
        w2.chunk(TP, 0)[r].clone().requires_grad_(),
    ]

    def step(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        h = torch.tanh(regions["copy"].apply(x, 0.5) @ w1)  # [3, 8 / tp]
        return (regions["reduce"].apply(h @ w2) * c[:, :5]).sum()

    torch.compile(step, backend="aot_eager")(*leaves).backward()
    return [t.grad for t in leaves]


def test_compiled_functions_on_real_ranks_are_exact() -> None:
    """Where the refusal sends compiled steps: on gloo ranks (no vmap) torch.compile (without
    fullgraph) keeps the Functions' backwards, and each rank's gradients are one device's."""
    from tests.dist_harness import run_on_gloo

    full, c, _ = _problem()
    one = [t.clone().requires_grad_() for t in full[:3]]
    ((torch.tanh((one[0] * 0.5) @ one[1]) @ one[2]) * c[:, :5]).sum().backward()
    gx, g1, g2 = (t.grad for t in one)
    for r, (x_grad, w1_grad, w2_grad) in enumerate(run_on_gloo(gloo_compiled_megatron, TP)):
        torch.testing.assert_close(x_grad, gx, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(w1_grad, g1.chunk(TP, 1)[r], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(w2_grad, g2.chunk(TP, 0)[r], rtol=1e-12, atol=1e-12)


def test_compiled_spmd_refuses_too() -> None:
    """fd.spmd over a simulated mesh runs through simulate: the same refusal."""
    mesh = fd.Mesh({"tp": TP})
    copy = _identity_copy(mesh)

    def per_rank(x: Tensor, w: Tensor) -> Tensor:
        return torch.tanh(copy.apply(x) @ w)  # [3, 4 / tp]: column-parallel

    specs = {"in_specs": (P(), P(None, "tp")), "out_specs": P(None, "tp")}
    step = fd.spmd(per_rank, mesh, **specs, check=False)
    x = torch.randn(3, 4, dtype=F64, requires_grad=True)
    w = torch.randn(4, 4, dtype=F64, requires_grad=True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=_compile_error("IdentityCopy")):
        torch.compile(step, backend="aot_eager")(x, w)
