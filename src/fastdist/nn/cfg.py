"""Classifier-free guidance over a mesh axis (xDiT's CFG parallelism): the conditional and the
unconditional branch of a diffusion model's prediction run on different ranks of a ``cfg`` axis
of size 2, and every rank combines them into the guided prediction.

On one device a guided step runs the model twice (or once on a doubled batch):
``uncond + scale * (cond - uncond)``. Over ``cfg``, rank ``0`` of the axis runs the model with the
prompt's encoder states, rank ``1`` with the negative prompt's, each at the batch size of one
branch; one all-gather of the two predictions gives every rank both, and the same guided
prediction. The model itself may be split over other axes (context parallelism over ``sp``:
a ``cfg`` x ``sp`` mesh); its parameters are replicated over ``cfg``.

* `cfg_branch` and `cfg_combine` are the two steps as per-rank functions (inside
  `fastdist.simulate`, `fastdist.spmd` or on real ranks);
* `GuidedModel` wraps a `fastdist.nn.ParallelModel` and does a whole guided prediction on a
  simulated mesh and on real ranks alike, returning one tensor (no rank dim).

Guidance is inference: `GuidedModel` runs without gradients (a gradient through it would need
the parameters' gradients summed over ``cfg`` as well, which the model's plan does not do).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.ops import all_gather_invariant, axis_index
from fastdist.sim.simulate import simulate

__all__ = ["cfg_branch", "cfg_combine", "GuidedModel"]

#: diffusers keywords that carry the prompt besides its encoder states (SD3's, Flux's and
#: HunyuanVideo's pooled text embedding; LTX-Video's and HunyuanVideo's text mask, QwenImage's):
#: the negative prompt has its own, so a guided call must say what the unconditional branch gets
PROMPT_KEYWORDS = ("pooled_projections", "encoder_attention_mask", "encoder_hidden_states_mask")


def _check_axis(mesh: Mesh, axis: str, where: str) -> None:
    mesh.axis_indices(axis, where)
    if mesh.axis_size(axis) != 2:
        raise ParallelizeError(
            f"{where}: the guidance axis {axis!r} has {mesh.axis_size(axis)} ranks, not 2 (one "
            f"for the conditional branch, one for the unconditional). Fix: Mesh({{{axis!r}: 2, "
            "...}})"
        )


def cfg_branch(cond: Tensor, uncond: Tensor, mesh: Mesh, axis: str = "cfg") -> Tensor:
    """This rank's branch input: ``cond`` on index 0 of ``axis``, ``uncond`` on index 1.

    Args:
        cond: the conditional input (the prompt's encoder states), the same on every rank.
        uncond: the unconditional one (the negative prompt's), shaped like ``cond``.
        mesh: the mesh.
        axis: the guidance axis (size 2).

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"cfg": 2})
    >>> fd.simulate(lambda c, u: cfg_branch(c, u, mesh), mesh)(
    ...     torch.ones(2, 1), torch.zeros(2, 1))
    tensor([[1.],
            [0.]])
    """
    _check_axis(mesh, axis, "cfg_branch")
    if cond.shape != uncond.shape:
        raise ParallelizeError(
            f"cfg_branch: the conditional input {tuple(cond.shape)} and the unconditional "
            f"{tuple(uncond.shape)} differ in shape; each rank runs one of them through the same "
            "model. Fix: pad the negative prompt's states to the prompt's length (as diffusers' "
            "pipelines do)"
        )
    first = axis_index(mesh, axis).to(cond.device) == 0
    return torch.where(first, cond, uncond)


def cfg_combine(pred: Tensor, guidance_scale: float, mesh: Mesh, axis: str = "cfg") -> Tensor:
    """The guided prediction ``uncond + guidance_scale * (cond - uncond)`` from this rank's branch
    prediction (index 0 of ``axis``: conditional, 1: unconditional); the same on every rank.

    Args:
        pred: this rank's branch prediction.
        guidance_scale: the guidance scale (1: the conditional prediction alone).
        mesh: the mesh.
        axis: the guidance axis (size 2).

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"cfg": 2})
    >>> fd.simulate(lambda p: cfg_combine(p, 3.0, mesh), mesh)(torch.tensor([[2.0], [1.0]]))
    tensor([[4.],
            [4.]])
    """
    _check_axis(mesh, axis, "cfg_combine")
    both = all_gather_invariant(pred.unsqueeze(0), mesh, axis, dim=0)  # (2, *pred): cond, uncond
    return both[1] + guidance_scale * (both[0] - both[1])


def _prediction(out: Any) -> Tensor:
    """A model output's prediction: ``.sample`` (diffusers), the first of a tuple, or itself."""
    if isinstance(out, Tensor):
        return out
    if hasattr(out, "sample"):
        return out.sample  # type: ignore[no-any-return]
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise ParallelizeError(
        f"GuidedModel: the model returned {type(out).__name__}, with no prediction tensor "
        "(.sample, or a tensor first). Fix: a model returning its prediction"
    )


class GuidedModel:
    """A parallel diffusion model with classifier-free guidance over ``axis``: each call is one
    guided prediction, the branches on the two ranks of ``axis``.

    Args:
        model: a `fastdist.nn.ParallelModel` whose mesh has ``axis`` (size 2) and whose plan
            does not split over it.
        guidance_scale: ``uncond + guidance_scale * (cond - uncond)``.
        axis: the guidance axis.
        condition: the keyword of the model's forward that takes the branch's input (diffusers'
            ``encoder_hidden_states``).

    Call it with the model's keyword inputs, whole and the same on every rank (no rank dim,
    also on a simulated mesh; tensors, or tuples, lists and dicts of them, such as CogVideoX's
    ``image_rotary_emb=(cos, sin)``), the conditional branch's; and ``uncond=``, the unconditional
    branch's input under ``condition`` (a tensor), or a dict of every keyword whose value the
    unconditional branch gets instead (e.g. SD3's ``{"encoder_hidden_states": negative,
    "pooled_projections": negative_pooled}``). A prompt keyword of `PROMPT_KEYWORDS` given but
    not in ``uncond`` is refused (never the prompt's value silently used for both branches):
    to share it, name it in the dict with the same value. It returns the guided prediction,
    one tensor, the same on every rank.
    """

    def __init__(
        self,
        model: Any,
        guidance_scale: float,
        *,
        axis: str = "cfg",
        condition: str = "encoder_hidden_states",
    ) -> None:
        mesh = model.mesh
        _check_axis(mesh, axis, "GuidedModel")
        if axis in model.axes:
            raise ParallelizeError(
                f"GuidedModel: the model's plan splits over {axis!r}, the guidance axis; the "
                f"branches need it whole. Fix: a plan over the other axes of {mesh!r}"
            )
        self.model, self.mesh, self.axis = model, mesh, axis
        self.guidance_scale, self.condition = float(guidance_scale), condition

    def _overrides(
        self, uncond: Tensor | Mapping[str, Any], inputs: Mapping[str, Any]
    ) -> dict[str, Tensor]:
        """The unconditional branch's inputs that differ from the conditional one's, checked."""
        over = dict(uncond) if isinstance(uncond, Mapping) else {self.condition: uncond}
        missing = [k for k in PROMPT_KEYWORDS if inputs.get(k) is not None and k not in over]
        if self.condition not in over or missing:
            what = [self.condition] if self.condition not in over else missing
            keys = ", ".join(f"{k!r}: ..." for k in [self.condition, *missing])
            raise ParallelizeError(
                f"GuidedModel: the inputs give the prompt's {what}, and uncond= does not say "
                "what the unconditional branch gets instead (the negative prompt has its own). "
                f"Fix: uncond={{{keys}}} (the same value to share one)"
            )
        for k, v in over.items():
            if not isinstance(v, Tensor) or not isinstance(inputs.get(k), Tensor):
                raise ParallelizeError(
                    f"GuidedModel: uncond[{k!r}] is {type(v).__name__} and the input is "
                    f"{type(inputs.get(k)).__name__}: both branches' values must be tensors of "
                    "one shape. Fix: pass the conditional value under that keyword, and a "
                    "tensor like it (e.g. an all-ones mask) for the unconditional branch"
                )
        return over

    def _simulated(self, over: Mapping[str, Tensor], inputs: Mapping[str, Any]) -> Tensor:
        world = self.mesh.size

        def replicate(v: Any) -> Any:
            return v.expand(world, *v.shape) if isinstance(v, Tensor) else v

        # every tensor gets the rank dim, nested ones too (CogVideoX's image_rotary_emb=(cos, sin))
        per_rank = {k: pytree.tree_map(replicate, v) for k, v in inputs.items()}
        branch = simulate(lambda c, u: cfg_branch(c, u, self.mesh, self.axis), self.mesh)
        for k, uncond in over.items():
            cond = inputs[k]
            per_rank[k] = branch(
                cond.expand(world, *cond.shape), uncond.expand(world, *uncond.shape)
            )
        pred = _prediction(self.model(**per_rank))  # (world, *pred): each rank's branch
        combine = simulate(
            lambda p: cfg_combine(p, self.guidance_scale, self.mesh, self.axis), self.mesh
        )
        return combine(pred)[0]  # every rank holds the same

    def __call__(self, *, uncond: Tensor | Mapping[str, Tensor], **inputs: Any) -> Tensor:
        """One guided prediction.

        Args:
            uncond: the unconditional input under the model's ``condition`` keyword (a tensor),
                or a dict of the unconditional branch's inputs by keyword (``condition`` and
                every prompt keyword of `PROMPT_KEYWORDS` that ``inputs`` give).
            inputs: the model's keyword inputs, the conditional branch's.

        Returns:
            the guided prediction (no rank dim), the same on every rank.
        """
        if self.condition not in inputs:
            raise ParallelizeError(
                f"GuidedModel: no {self.condition!r} among the inputs {sorted(inputs)}: it "
                "carries the conditional branch. Fix: pass it, or GuidedModel(condition=...)"
            )
        over = self._overrides(uncond, inputs)
        with torch.no_grad():
            if self.mesh.backend is None:
                return self._simulated(over, inputs)
            branches = {k: cfg_branch(inputs[k], u, self.mesh, self.axis) for k, u in over.items()}
            pred = _prediction(self.model(**{**inputs, **branches}))
            return cfg_combine(pred, self.guidance_scale, self.mesh, self.axis)
