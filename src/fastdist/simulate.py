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
``fastdist._primitive``). ``torch.func.grad`` of the per-rank loss inside ``fn``
gives the same, and so does ``torch.compile(simulate(fn, mesh))`` + backward.

How collectives find the simulation: while ``fn`` runs, ``simulate`` registers a
binding (the vmapped rank id) for the mesh values it was given, on this thread
(``fastdist._context``), and drops it when ``fn`` returns or raises. A collective
looks its mesh up by value, so an equal mesh built elsewhere works; a collective on a
mesh that no running simulation covers fails loudly instead of guessing. Threads
simulate independently, the same mesh too.

``F.scaled_dot_product_attention`` (which Hugging Face models call in every layer) has
no vmap rule for its fused kernels in torch 2.13, so vmap would warn and loop over the
ranks; while ``fn`` runs, ``simulate`` pushes ``fastdist._sdpa.SdpaMode``, which folds
the rank dim into the batch dim and calls the kernel once (``batch_sdpa=False`` leaves
it out).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from ._context import pop_simulation, push_simulation, simulation_of
from ._sdpa import SdpaMode
from .errors import MeshError, NoBackendError
from .mesh import Mesh

__all__ = ["simulate", "rank_binding", "promote"]

R = TypeVar("R")


class _Binding:
    """The rank a simulated call is running on: a 0-dim int64 tensor vmapped over ranks."""

    __slots__ = ("rank", "zero", "world")

    def __init__(self, rank: Tensor, world: int) -> None:
        self.rank = rank
        self.zero = rank * 0  # vmapped zero: adding it makes any tensor vary over ranks
        self.world = world


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
            per-rank code that never calls SDPA (see ``fastdist._sdpa``).

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
    for other in meshes:
        if not isinstance(other, Mesh) or other.size != mesh.size:
            raise MeshError(
                f"simulate: every mesh in meshes= must be a Mesh of {mesh.size} ranks like "
                f"{mesh!r}, got {other!r}"
            )

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> R:
        leaves, _ = pytree.tree_flatten(args)
        tensors = [t for t in leaves if isinstance(t, Tensor)]
        for t in tensors:
            if t.dim() == 0 or t.shape[0] != mesh.size:
                raise MeshError(
                    f"simulate({getattr(fn, '__name__', 'fn')}): a tensor argument has shape "
                    f"{tuple(t.shape)}; every tensor needs a leading rank dimension of size "
                    f"{mesh.size} for {mesh!r}. Fix: stack the per-rank values (torch.stack) or "
                    f"expand a replicated one (x.expand({mesh.size}, *x.shape))"
                )
        in_dims = pytree.tree_map(lambda a: 0 if isinstance(a, Tensor) else None, args)
        device = tensors[0].device if tensors else None

        def per_rank(rank: Tensor, *rank_args: Any) -> R:
            # this thread, for this call only
            push_simulation(all_meshes, _Binding(rank, mesh.size))
            try:
                if batch_sdpa:
                    # F.scaled_dot_product_attention folded over the ranks (fastdist._sdpa)
                    with SdpaMode():
                        return fn(*rank_args, **kwargs)
                return fn(*rank_args, **kwargs)
            finally:
                pop_simulation(len(all_meshes))

        ranks = torch.arange(mesh.size, device=device)
        return torch.vmap(per_rank, in_dims=(0, *in_dims), randomness=randomness)(ranks, *args)

    return run


def rank_binding(op: str, mesh: Mesh) -> _Binding | None:
    """The innermost simulation running over ``mesh``, or ``None`` on a one-rank mesh.

    Raises :class:`NoBackendError` when ``mesh`` has several ranks and no
    simulation is running over it.
    """
    binding: _Binding | None = simulation_of(mesh)
    if binding is not None:
        return binding
    if mesh.size == 1:
        return None
    raise NoBackendError(
        f"fastdist.{op}: {mesh!r} has {mesh.size} ranks but no backend here: no simulation of "
        "this mesh is running. "
        "Fix: call the per-rank code through fastdist.simulate(fn, mesh) "
        "(pass further meshes it uses as simulate(fn, mesh, meshes=[...]))"
    )


def promote(op: str, x: Tensor, binding: _Binding | None) -> Tensor:
    """Make ``x`` carry the simulated rank dimension (a tensor built inside ``fn`` from constants
    does not).

    In eager mode also refuses an input that a ``torch.vmap`` *inside* the simulation
    batches: the collective's vmap rule would take that vmap's dimension for the ranks.
    """
    if binding is None:
        return x
    if torch.compiler.is_compiling():
        return x + binding.zero.to(device=x.device, dtype=x.dtype)
    if _has_rank_dim(op, x, binding):  # the usual case: no copy (adding zero costs a pass over x)
        return x
    return x + binding.zero.to(device=x.device, dtype=x.dtype)


def _has_rank_dim(op: str, x: Tensor, binding: _Binding) -> bool:
    """Whether ``x`` is already batched over the simulated ranks; refuses one batched by an inner
    vmap."""
    functorch = torch._C._functorch
    rank_level = functorch.maybe_get_level(binding.rank)
    t = x
    while (level := functorch.maybe_get_level(t)) is not None and level > rank_level:
        if functorch.is_batchedtensor(t):
            raise NoBackendError(
                f"fastdist.{op}: its input is batched by a torch.vmap inside fastdist.simulate; "
                "the collective would take that vmap's dimension for the ranks. Fix: "
                "move the vmap outside simulate (vmap over simulate is supported), or loop instead"
            )
        t = functorch.get_unwrapped(t)  # a torch.func.grad wrapper: look underneath
    return bool(functorch.maybe_get_level(t) == rank_level and functorch.is_batchedtensor(t))
