"""The binding between a collective and the simulation running over its mesh.

A simulation (``fastdist.sim.simulate``) runs the per-rank function under a ``torch.vmap`` over a
rank id and registers a :class:`RankBinding` for its meshes in ``fastdist.core.context``. A
collective looks the binding up by mesh value (:func:`rank_binding`) and gives its input the rank
dimension (:func:`promote`). This lives in core, below the ops and the simulator, so that neither
imports the other.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastdist.core.context import simulation_of
from fastdist.core.mesh import Mesh
from fastdist.errors import NoBackendError

__all__ = ["RankBinding", "rank_binding", "promote"]

_functorch = torch._C._functorch


class RankBinding:
    """The rank a simulated call is running on: a 0-dim int64 tensor vmapped over ranks.

    ``fastdist.simulate`` pushes one per running simulation (``fastdist.core.context``); a
    collective finds it with :func:`rank_binding` and gives its input the rank dim with
    :func:`promote`.
    """

    __slots__ = ("rank", "zero", "world")

    def __init__(self, rank: Tensor, world: int) -> None:
        self.rank = rank
        self.zero = rank * 0  # vmapped zero: adding it makes any tensor vary over ranks
        self.world = world


def rank_binding(op: str, mesh: Mesh) -> RankBinding | None:
    """The innermost simulation running over ``mesh``, or ``None`` on a one-rank mesh.

    Raises :class:`NoBackendError` when ``mesh`` has several ranks and no
    simulation is running over it.
    """
    binding: RankBinding | None = simulation_of(mesh)
    if binding is not None:
        return binding
    if mesh.size == 1:
        return None
    node = None if torch.compiler.is_compiling() else torch._C._current_autograd_node()
    if node is not None:  # in a backward, after simulate (if any) returned
        raise NoBackendError(
            f"fastdist.{op}: called over {mesh!r} in the backward of autograd node "
            f"{type(node).__name__}, where no simulation of this mesh is running. The backward "
            "of a torch.autograd.Function applied inside fastdist.simulate finds its simulation "
            "when simulate ran over this mesh (or got it in meshes=) with batch_sdpa=True (the "
            "default). Fix: apply the Function inside simulate(fn, mesh), give it "
            "generate_vmap_rule = True and a setup_context staticmethod, and leave batch_sdpa "
            'on; see docs/testing.md, "Your own autograd.Function"'
        )
    raise NoBackendError(
        f"fastdist.{op}: {mesh!r} has {mesh.size} ranks but no backend here: no simulation of "
        "this mesh is running. "
        "Fix: call the per-rank code through fastdist.simulate(fn, mesh) "
        "(pass further meshes it uses as simulate(fn, mesh, meshes=[...]))"
    )


def promote(op: str, x: Tensor, binding: RankBinding | None) -> Tensor:
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
    rank_level = _functorch.maybe_get_level(binding.rank)  # -1: a plain rank (fastdist.profile)
    if rank_level >= 0 and all(
        i.level() != rank_level for i in _functorch.get_interpreter_stack() or ()
    ):
        # torch re-created the vmap over the ranks at another level and hid simulate's: the
        # forward of an autograd.Function applied under a torch.func transform outside simulate
        raise NoBackendError(
            f"fastdist.{op}: called where simulate's vmap over the ranks is hidden: in the forward "
            "of a torch.autograd.Function applied inside fastdist.simulate that itself runs "
            "under a torch.func transform (torch.func.grad(simulate(fn, mesh)), ...). Fix: "
            "differentiate per rank inside fn (torch.func.grad inside simulate), or call "
            ".backward() on simulate's output"
        )
    return x + binding.zero.to(device=x.device, dtype=x.dtype)


def _has_rank_dim(op: str, x: Tensor, binding: RankBinding) -> bool:
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
