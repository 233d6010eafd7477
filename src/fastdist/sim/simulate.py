"""Simulated ranks: run a per-rank SPMD function on every rank of a mesh, in one process.

``simulate(fn, mesh)(*args)`` calls ``fn`` once per rank, vectorised with
``torch.vmap`` over a leading rank dimension: every tensor argument and result
has shape ``[mesh.size, ...]``, and slice ``r`` is what rank ``r`` holds. Inside,
each collective's vmap rule turns the vmapped rank dimension into the collective
(a sum over the group for ``psum``, a ``movedim`` for ``all_gather``, ...).

Gradients are those of a real multi-process run: ``out.sum().backward()`` (the
sum over ranks of the per-rank losses) leaves in slice ``r`` of each ``.grad``
exactly what rank ``r`` would get by calling ``backward()`` on its own loss,
because each collective's registered *per-rank* backward rule runs (see
``fastdist.core.primitive``). ``torch.func.grad`` of the per-rank loss inside ``fn``
gives the same, and so does ``torch.compile(simulate(fn, mesh))`` + backward (which refuses
a ``torch.autograd.Function`` of the user's own: see below).

How collectives find the simulation: while ``fn`` runs, ``simulate`` registers a
binding (the vmapped rank id) for the mesh values it was given, on this thread
(``fastdist.core.context``), and drops it when ``fn`` returns or raises. A collective
looks its mesh up by value, so an equal mesh built elsewhere works; a collective on a
mesh that no running simulation covers fails loudly instead of guessing. Threads
simulate independently, the same mesh too.

A user's ``torch.autograd.Function`` whose ``backward`` calls a collective (Megatron's
"copy to the tensor-parallel region": identity forward, ``psum`` backward) runs that
backward after ``simulate`` returned, when nothing is registered any more. torch runs it
under a fresh vmap over the ranks (the Function's generated vmap rule), so what is missing is
only the binding: while ``fn`` runs, simulate's ``TorchFunctionMode`` sees each such
Function applied (torch routes it through ``custom_function_call``) and leaves a
:class:`_Resume` on its autograd node; a collective called in that node's backward finds it
(``fastdist.core.context.simulation_of``) and binds to the vmap torch re-created. See
docs/testing.md, "Your own autograd.Function". Under ``torch.compile`` torch 2.13 drops such a
Function's backward under vmap (wrong gradients, in torch itself), so while dynamo traces
``fn`` with grad mode on, a Function applied there raises :class:`NoBackendError` naming it
(:func:`_refuse_traced_functions`).

``F.scaled_dot_product_attention`` (which Hugging Face models call in every layer) has
no vmap rule for its fused kernels in torch 2.13, so vmap would warn and loop over the
ranks; while ``fn`` runs, ``simulate`` pushes :class:`_SimulationMode` (a
``fastdist.sim.sdpa.SdpaMode``), which folds the rank dim into the batch dim and calls the
kernel once, and marks the autograd.Functions applied (``batch_sdpa=False`` leaves the mode
out, and with it both).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor
from torch._functorch.autograd_function import custom_function_call
from torch._functorch.predispatch import _add_batch_dim
from torch._functorch.pyfunctorch import coerce_cinterpreter
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from fastdist.core.binding import RankBinding
from fastdist.core.context import pop_simulation, push_simulation
from fastdist.core.mesh import Mesh
from fastdist.errors import MeshError, NoBackendError
from fastdist.sim.sdpa import TORCH_SDPA, SdpaMode, sdpa

__all__ = ["simulate"]

R = TypeVar("R")


_functorch: Any = torch._C._functorch
_VMAP = _functorch.TransformType.Vmap


class _Resume:
    """Left on the autograd node of a ``torch.autograd.Function`` applied inside a simulation: how
    a collective in its ``backward`` finds the simulation again.

    The backward runs after ``simulate`` returned, under the vmaps that torch re-creates for
    the Function's generated vmap rule, in the order they had: the one over the ranks comes
    after the ``outer`` vmaps that were running around ``simulate``. (Other transforms around
    ``simulate`` may be running or over by then: ``torch.func.grad`` runs the backward inside
    itself, ``torch.func.vjp``'s function later; they are not counted.)
    """

    __slots__ = ("meshes", "world", "outer", "device", "function")

    def __init__(
        self,
        meshes: tuple[Mesh, ...],
        world: int,
        outer: int,
        device: torch.device | None,
        function: str,
    ) -> None:
        self.meshes, self.world, self.outer, self.device = meshes, world, outer, device
        self.function = function  # the autograd.Function's name, for errors

    def covers(self, mesh: Mesh) -> bool:
        """Whether the simulation ran over a mesh equal to ``mesh``."""
        return any(m is mesh or m == mesh for m in self.meshes)

    def binding(self, mesh: Mesh) -> RankBinding:
        """The binding at the re-created vmap over the ranks; raises if the backward runs without
        one."""
        vmaps = [i for i in _functorch.get_interpreter_stack() or () if i.key() == _VMAP]
        if len(vmaps) > self.outer:
            interpreter = vmaps[self.outer]
            vmap: Any = coerce_cinterpreter(interpreter)
            if vmap.batch_size() == self.world:
                rank = torch.arange(self.world, device=self.device)
                return RankBinding(_add_batch_dim(rank, 0, interpreter.level()), self.world)
        raise NoBackendError(
            f"the backward of autograd.Function {self.function}, applied inside "
            f"fastdist.simulate over {mesh!r}, calls a collective but runs without simulate's vmap "
            "over the ranks (torch re-creates it only from a generated vmap rule). Fix: give "
            f"{self.function} generate_vmap_rule = True and a setup_context staticmethod "
            '(not a vmap staticmethod); see docs/testing.md, "Your own autograd.Function"'
        )


def _mark_function_node(output: Any, resume: _Resume) -> None:
    """Leave ``resume`` on the autograd node of the Function that produced ``output`` (the
    innermost of nested simulations last).

    The node is on the plain tensor under the vmap wrappers, or, under a ``torch.func`` grad
    transform around ``simulate``, on that transform's wrapper: every level is looked at.
    """
    for t in pytree.tree_leaves(output):
        if not isinstance(t, Tensor):
            continue
        marked = False
        while True:
            if isinstance(t.grad_fn, torch.autograd.function.BackwardCFunction):
                node: Any = t.grad_fn
                node._fastdist_resume = (*getattr(node, "_fastdist_resume", ()), resume)
                marked = True
            if not (_functorch.is_batchedtensor(t) or _functorch.is_gradtrackingtensor(t)):
                break
            t = _functorch.get_unwrapped(t)
        if marked:
            return  # the outputs of one Function share its nodes


class _SimulationMode(SdpaMode):
    """What ``simulate`` pushes while ``fn`` runs: SDPA folded over the ranks
    (:class:`~fastdist.sim.sdpa.SdpaMode`), and a :class:`_Resume` on the node of every
    ``torch.autograd.Function`` applied."""

    def __init__(
        self, meshes: tuple[Mesh, ...], world: int, outer: int, device: torch.device | None
    ) -> None:
        super().__init__()
        self.simulation = (meshes, world, outer, device)
        # saved-tensor hooks pushed inside the simulation are not these (a checkpoint)
        self.hooks_at_start = _top_saved_tensors_hooks()

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # Every torch call in fn comes here (attribute reads too): one frame, the common case
        # (none of the functions below, no checkpoint entered) first.
        if func is TORCH_SDPA or func is custom_function_call or func is _REQUIRES_GRAD:
            return self.call(func, args, kwargs or {})
        if not _is_compiling() and _saved_tensors_hooks(False) != self.hooks_at_start:
            _refuse_recomputation(self.simulation[0][0])
        return func(*args, **kwargs) if kwargs else func(*args)

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func is TORCH_SDPA:
            return sdpa(*args, **kwargs)
        if func is custom_function_call and not torch.compiler.is_compiling():
            out = func(*args, **kwargs)  # args[0]: the user's autograd.Function class
            _mark_function_node(out, _Resume(*self.simulation, getattr(args[0], "__name__", "?")))
            return out
        if func is _REQUIRES_GRAD:
            return _requires_grad_(func, args, kwargs)
        return super().call(func, args, kwargs)


_REQUIRES_GRAD = Tensor.requires_grad_
_is_compiling = torch.compiler.is_compiling
_saved_tensors_hooks: Any = torch._C._autograd._top_saved_tensors_default_hooks


def _top_saved_tensors_hooks() -> Any:
    """The innermost saved-tensor hooks (pack, unpack) now, or None (also while dynamo traces:
    it traces checkpoints as a higher-order op, without these hooks)."""
    if torch.compiler.is_compiling():
        return None
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _refuse_recomputation(mesh: Mesh) -> None:
    """Raise for non-reentrant ``torch.utils.checkpoint`` entered inside the simulation (its
    saved-tensor hooks are innermost), at its first op."""
    hooks = _top_saved_tensors_hooks()
    pack = getattr(hooks[0], "__qualname__", "") if hooks else ""
    if pack.startswith("_checkpoint_hook."):
        raise NoBackendError(_checkpoint_inside(mesh, "use_reentrant=False"))


def _checkpoint_inside(mesh: Mesh, variant: str) -> str:
    """What `simulate` says about ``torch.utils.checkpoint`` called inside it."""
    return (
        f"torch.utils.checkpoint(..., {variant}) inside fastdist.simulate over {mesh!r}: a "
        "checkpoint recomputes its region in backward, after the simulation returned, on "
        "tensors of the simulation's vmap over the ranks, which torch.vmap cannot do (torch "
        "transforms support neither saved-tensor hooks nor a Function without setup_context). "
        "Fix: checkpoint only on real ranks (e.g. `if mesh.backend is not None`; simulated ranks "
        "hold every activation anyway), or put the checkpoint around the whole simulated call. "
        "A fastdist.nn.ParallelModel turns transformers' gradient checkpointing off by itself "
        "for its simulated calls"
    )


def _reentrant_checkpoint(e: RuntimeError) -> bool:
    """Whether ``e`` is torch refusing reentrant ``torch.utils.checkpoint`` under vmap (its
    ``CheckpointFunction`` has no ``setup_context``)."""
    if isinstance(e, NoBackendError) or "setup_context" not in str(e):
        return False
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is checkpoint.__code__:
            return True
        tb = tb.tb_next
    return False


def _in_place_into_unranked(e: RuntimeError) -> bool:
    """Whether ``e`` is torch.vmap refusing an in-place op that would write rank-dependent
    values into a tensor without the rank dimension."""
    text = str(e)
    return text.startswith("vmap: ") and "use out-of-place operators" in text


def _in_place_message(e: RuntimeError, mesh: Mesh) -> str:
    """The fastdist error for `_in_place_into_unranked`."""
    op = str(e)[len("vmap: ") :].split("(", 1)[0]
    return (
        f"fastdist.simulate over {mesh!r}: {op} writes values that differ by rank, in place, "
        "into a tensor made inside the simulation that holds one value for all ranks, which "
        "torch.vmap cannot do. transformers' "
        "load_balancing_loss_func does this when a mixture-of-experts model is called with "
        "output_router_logits=True and an attention_mask. Fix: run it on real ranks "
        "(fastdist.testing.run_on_gloo), or call it without the attention_mask (no padded "
        f"row) or with output_router_logits=False; in code of your own, the out-of-place "
        f"{op.rstrip('_')}(...)"
    )


def _requires_grad_(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``Tensor.requires_grad_`` inside the simulation, where torch.vmap refuses it: a no-op on a
    tensor whose ranks already require grad (transformers' ``enable_input_require_grads`` hook on
    the embeddings' output); a fastdist error for any other."""
    try:
        return func(*args, **kwargs)
    except RuntimeError as e:
        t = inner = args[0]
        while _functorch.is_batchedtensor(inner) or _functorch.is_gradtrackingtensor(inner):
            inner = _functorch.get_unwrapped(inner)
        if "inside of a function being transformed" not in str(e):
            raise
        if inner is t or inner.requires_grad:
            # already tracked, or made inside the simulation from no input (a pipeline stage's
            # stub embedding): a leaf nobody reads the gradient of; simulated ranks do not
            # recompute, so the hook's purpose (reentrant checkpointing) does not arise
            return t
        raise NoBackendError(
            "Tensor.requires_grad_() inside fastdist.simulate on a tensor that does not require "
            "grad: torch.vmap cannot start tracking gradients inside the simulation (e.g. "
            "transformers' enable_input_require_grads on frozen embeddings, which only matters "
            "for reentrant checkpointing, and simulated ranks do not recompute). Fix: make the "
            "tensor require grad before the simulated call (an input), or remove the hook "
            "(model.disable_input_require_grads())"
        ) from e


def _traced_code() -> list[Any]:
    """While dynamo traces: the code objects it has traced in this frame so far, in the order
    it finished them (``torch._guards.TracingContext.get_traced_code()``)."""
    from torch._guards import TracingContext

    codes = TracingContext.get_traced_code()
    if codes is None:  # a torch without the list: fail loudly rather than check nothing
        raise NoBackendError(
            "fastdist.simulate under torch.compile: this torch's compiler keeps no list of the "
            "code it traced (torch._guards.TracingContext.get_traced_code()), which simulate "
            "needs to refuse a torch.autograd.Function that the compiler would get wrong under "
            "vmap. Fix: run the step eagerly under fastdist.simulate, or use torch 2.13"
        )
    return codes


def _traced_code_count() -> int:
    """While dynamo traces: how many code objects it has traced in this frame so far.

    Called by dynamo at trace time, its result a constant of the graph: the attribute below is
    what ``torch.compiler.assume_constant_result`` sets (which would import ``torch._dynamo``
    with ``fastdist.simulate``).
    """
    return len(_traced_code())


_traced_code_count._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _refuse_traced_functions(start: int, mesh: str) -> bool:
    """While dynamo traces ``simulate``'s ``fn`` with gradients on: raise if dynamo traced the
    ``forward`` of a ``torch.autograd.Function`` since its ``start``-th code object (``fn``
    applied one). Called by dynamo at trace time, like :func:`_traced_code_count`.

    torch 2.13's compiler gets a Function under vmap wrong: it ignores the generated vmap rule
    and, as no tensor inside vmap requires grad in its trace, inlines the ``forward`` and
    differentiates that, dropping the Function's ``backward`` (a ``psum`` there never runs);
    ``torch.compile(torch.vmap(f))`` does the same without fastdist. Dynamo lists every function
    it inlined (``TracingContext.traced_code``), the Function's ``forward`` included, whichever
    way it traced the Function. Raised here, outside the traced code, the error stops the
    compilation (torch.compile re-raises it inside its ``InternalTorchDynamoError``, with or
    without ``fullgraph``); raised in traced code it would be a graph break, after which dynamo
    would run the call eagerly.
    """
    codes = set(_traced_code()[start:])
    pending = list(torch.autograd.Function.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if getattr(getattr(cls, "forward", None), "__code__", None) not in codes:
            continue
        name = cls.__name__
        raise NoBackendError(
            f"fastdist.simulate over {mesh} under torch.compile: autograd.Function {name} is "
            "applied with gradients on, and torch's compiler (2.13) gets a Function under "
            "simulate's vmap wrong: it drops the Function's backward and differentiates its "
            "forward instead (wrong gradients, silently; torch.compile(torch.vmap(...)) does "
            "the same). Fix: run the step eagerly under fastdist.simulate (exact), test the "
            "compiled step on real ranks (fastdist.testing.run_on_gloo; exact there), or replace "
            f"{name} by fastdist's collectives and fastdist.nn layers (custom ops with their "
            "own rules, exact when compiled); a forward-only step may be compiled under "
            'torch.no_grad(). See docs/testing.md, "Your own autograd.Function"'
        )
    return False


_refuse_traced_functions._dynamo_marked_constant = True  # type: ignore[attr-defined]


def simulate(
    fn: Callable[..., R],
    mesh: Mesh,
    *,
    meshes: Sequence[Mesh] = (),
    randomness: Literal["error", "different", "same"] = "error",
    batch_sdpa: bool = True,
) -> Callable[..., R]:
    """Run per-rank function ``fn`` on every rank of ``mesh`` in this process.

    Args:
        fn: per-rank SPMD code: takes one rank's tensors, may call any fastdist
            collective on ``mesh``, returns a tensor or a pytree of tensors.
        mesh: the mesh whose ranks to simulate.
        meshes: further mesh objects ``fn`` uses (e.g. a TP=1 draft model's mesh
            beside a TP=4 one); each must have ``mesh.size`` ranks.
        randomness: passed to ``torch.vmap``; ``"different"`` gives each rank its
            own random numbers (dropout), ``"same"`` the same on every rank.
        batch_sdpa: run ``F.scaled_dot_product_attention`` once over all ranks (the
            rank dim folded into the batch dim) instead of torch's per-rank loop with a
            warning (torch has no vmap rule for the fused kernels), with the values and
            gradients of the per-rank calls. It costs a ``TorchFunctionMode`` while ``fn``
            runs: a few microseconds per torch call in ``fn``; ``False`` saves that for
            per-rank code that never calls SDPA (see ``fastdist.sim.sdpa``) and never applies
            a ``torch.autograd.Function`` whose backward calls a collective (the same mode
            lets that backward, which runs after simulate returned, find the simulation).

    Returns:
        A function taking the same arguments as ``fn``, except that every tensor
        (at any depth of a list/tuple/dict argument) carries a leading dimension
        of size ``mesh.size`` indexed by rank. Non-tensor arguments and keyword
        arguments go to every rank unchanged. Results carry the rank dimension.

    >>> import torch, fastdist
    >>> mesh = fastdist.Mesh({"dp": 2, "tp": 2})
    >>> x = torch.arange(4.0)  # rank r holds the scalar r
    >>> fastdist.simulate(lambda x: fastdist.psum(x, mesh, "tp"), mesh)(x)
    tensor([1., 1., 5., 5.])
    """
    if not isinstance(mesh, Mesh):
        raise MeshError(f"simulate: mesh must be a fastdist.Mesh, got {type(mesh).__name__}")
    all_meshes = [mesh, *meshes]
    described = repr(mesh)  # for an error raised while dynamo traces
    meshes_tuple = tuple(all_meshes)
    for other in meshes:
        if not isinstance(other, Mesh) or other.size != mesh.size:
            raise MeshError(
                f"simulate: every mesh in meshes= must be a Mesh of {mesh.size} ranks like "
                f"{mesh!r}, got {other!r}"
            )

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> R:
        leaves, treespec = pytree.tree_flatten(args)
        at = [i for i, t in enumerate(leaves) if isinstance(t, Tensor)]  # the tensors' places
        tensors = [leaves[i] for i in at]
        for t in tensors:
            if t.dim() == 0 or t.shape[0] != mesh.size:
                raise MeshError(
                    f"simulate({getattr(fn, '__name__', 'fn')}): a tensor argument has shape "
                    f"{tuple(t.shape)}; every tensor needs a leading rank dimension of size "
                    f"{mesh.size} for {mesh!r}. Fix: stack the per-rank values (torch.stack) or "
                    f"expand a replicated one (x.expand({mesh.size}, *x.shape))"
                )
        # vmap gets the tensors only, flat (its own flattening and in_dims broadcast of the whole
        # argument tree cost more than the call of a small model); the rest goes around it
        rest = [None if isinstance(t, Tensor) else t for t in leaves]
        device = tensors[0].device if tensors else None
        # the vmaps running around this simulation (an ensemble of simulations)
        outer = (
            0
            if torch.compiler.is_compiling()
            else sum(i.key() == _VMAP for i in _functorch.get_interpreter_stack() or ())
        )

        def per_rank(rank: Tensor, *rank_tensors: Tensor) -> R:
            mine = list(rest)
            for i, t in zip(at, rank_tensors):
                mine[i] = t
            rank_args = pytree.tree_unflatten(mine, treespec)
            # this thread, for this call only
            push_simulation(all_meshes, RankBinding(rank, mesh.size))
            try:
                # while dynamo traces with gradients on: where the trace of fn starts
                traced = torch.compiler.is_compiling() and torch.is_grad_enabled()
                start = _traced_code_count() if traced else 0
                try:
                    if batch_sdpa:
                        # F.scaled_dot_product_attention folded over the ranks (fastdist.sim.sdpa),
                        # the nodes of autograd.Functions marked for their backward
                        with _SimulationMode(meshes_tuple, mesh.size, outer, device):
                            out = fn(*rank_args, **kwargs)
                    else:
                        out = fn(*rank_args, **kwargs)
                except RuntimeError as e:
                    if _reentrant_checkpoint(e):
                        raise NoBackendError(_checkpoint_inside(mesh, "use_reentrant=True")) from e
                    if _in_place_into_unranked(e):
                        raise NoBackendError(_in_place_message(e, mesh)) from e
                    raise
                if traced:
                    _refuse_traced_functions(start, described)
                return out
            finally:
                pop_simulation(len(all_meshes))

        ranks = torch.arange(mesh.size, device=device)
        return torch.vmap(per_rank, randomness=randomness)(ranks, *tensors)

    return run
