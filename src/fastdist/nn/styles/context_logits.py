"""The loss on each rank's own tokens: ``CausalContextParallel(logits="split")`` leaves the base
model's output split, the LM head runs on the rank's ``S / n`` tokens (logits ``(B, S / n, V)``),
and a ``labels=`` loss equals one device's mean exactly: the labels shifted by one over the
WHOLE sequence first (a shard's last token predicts a label another rank holds), then cut to
the rank's tokens; the rank's sum divided by the WHOLE batch's count of labels not ignored
(``num_items_in_batch``; one a caller passes is kept); summed over the axis (`psum`: every rank
returns the same loss; its gradient is the identity). The head's parameters meet the rank's
tokens: the plan pvary's them (`PvaryTree` on the head). The loss is fastdist's
(`HFCausalLMLoss`, the model's dtype), vocabulary-parallel over ``tp`` where the head is.
In a pipeline (`fastdist.train.pipeline`) the last stage's causal LM gets each micro-batch's
labels and the pipeline's WHOLE-batch ``num_items_in_batch`` (kept), so the micro-batches'
summed losses are one device's mean; the other stages get no labels (the hook does nothing).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.loss import HFCausalLMLoss
from fastdist.nn.styles.base import Style, StyleContext
from fastdist.nn.styles.context_llm import SPLIT_GENERATE, STATE_ATTR, ContextState
from fastdist.ops import psum

__all__ = ["ShardedLoss", "SummedLoss"]


class SummedLoss:
    """A causal LM's ``loss_function`` on a rank's own tokens: ``inner`` (fastdist's loss over
    the rank's logits and its share of the shifted labels, divided by the whole batch's count)
    summed over ``axis``: the same 0-d loss on every rank, one device's."""

    def __init__(self, inner: HFCausalLMLoss, mesh: Mesh, axis: str) -> None:
        self.inner, self.mesh, self.axis = inner, mesh, axis

    def __call__(
        self, logits: Tensor, labels: Tensor, vocab_size: int | None = None, **kwargs: Any
    ) -> Tensor:
        if kwargs.get("shift_labels") is None or kwargs.get("num_items_in_batch") is None:
            raise ParallelizeError(
                f"context parallelism over {self.axis!r} (logits='split'): the loss was called "
                "without the rank's shifted labels and the batch's count (ShardedLoss's "
                "forward pre-hook on the causal LM gives them). Fix: call the causal LM with "
                "labels=, not its loss_function"
            )
        return psum(self.inner(logits, labels, vocab_size, **kwargs), self.mesh, self.axis)


@dataclass(frozen=True)
class ShardedLoss(Style):
    """On a causal LM whose base model has ``CausalContextParallel(logits="split")`` (plan key
    ``""``; the family plans add it): a ``labels=`` call's labels shifted over the whole
    sequence, cut to the rank's tokens, counted over the whole batch, and the model's loss
    summed over ``axis`` (see the module docstring). ``logits_to_keep`` is refused.

    Args:
        axis: the context-parallel axis (the base model's style's).
        base: the base model's name in the causal LM (``"model"``).
    """

    axis: str = "cp"
    base: str = "model"

    def unverifiable(self) -> str | None:
        return (
            "with logits='split' the LM head gives each rank's own tokens, which verify does not "
            "compare with the single-device logits"
        )

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        mesh.axis_indices(self.axis, "ShardedLoss")
        if name or not hasattr(type(module), "loss_function"):
            raise ParallelizeError(
                f"parallelize: ShardedLoss on {name!r} ({type(module).__name__}): it goes on "
                "the causal LM itself (plan key ''), a transformers model with a loss_function. "
                "Fix: fastdist.nn.plans.plan(model, mesh, context_parallel="
                "CausalContextParallel('cp', logits='split'))"
            )
        try:
            module.get_submodule(self.base)
        except AttributeError as e:
            raise ParallelizeError(
                f"parallelize: ShardedLoss: {type(module).__name__} has no base model "
                f"{self.base!r}. Fix: ShardedLoss(base=...) naming it"
            ) from e

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        self.check(module, name, ctx.mesh)
        hook = functools.partial(_shard_labels, self, ctx.mesh)
        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _shard_labels(
    style: ShardedLoss, mesh: Mesh, module: nn.Module, args: tuple[Any, ...], kw: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of the causal LM: ``labels`` (the whole batch's, the same on every rank)
    -> this rank's share of the labels shifted over the whole sequence (``shift_labels``, and
    ``labels`` so that the model computes a loss), ``num_items_in_batch`` the whole batch's
    count; the model's loss function wrapped in `SummedLoss`."""
    state = module.get_submodule(style.base).__dict__.get(STATE_ATTR)
    if not isinstance(state, ContextState) or state.logits != "split":
        raise ParallelizeError(
            f"ShardedLoss over {style.axis!r}: the base model {style.base!r} has no "
            "CausalContextParallel(logits='split'). Fix: put both in the plan (the family "
            "plans do, for context_parallel=CausalContextParallel('cp', logits='split'))"
        )
    if state.switch.decoding:  # a generation's prefill, its decoding steps
        raise ParallelizeError(SPLIT_GENERATE.format(axis=style.axis))
    if args:  # positional arguments by the forward's own parameter names
        names = list(inspect.signature(module.forward).parameters)
        kw = {**dict(zip(names, args)), **kw}
    keep = kw.get("logits_to_keep", 0)
    if not isinstance(keep, int) or keep:
        raise ParallelizeError(
            f"context parallelism over {style.axis!r}: logits_to_keep={keep!r} with "
            "logits='split' would keep the last tokens of each rank's shard, not of the "
            "sequence. Fix: logits_to_keep=0, or CausalContextParallel(logits='gathered')"
        )
    labels = kw.get("labels")
    if labels is None or labels.shape[-1] % state.chunks:  # the base model refuses the length
        return (), kw
    ignore = int(kw.get("ignore_index", -100))
    shift = kw.pop("shift_labels", None)
    if shift is None:  # over the whole sequence: token t predicts label t + 1
        shift = torch.nn.functional.pad(labels, (0, 1), value=ignore)[..., 1:]
    if kw.get("num_items_in_batch") is None:
        kw["num_items_in_batch"] = (shift != ignore).sum()
    kw["labels"] = kw["shift_labels"] = state.shard(shift, 1)
    fn = module.loss_function
    if not isinstance(fn, SummedLoss):  # parallelize sets the tp loss after the styles
        inner = fn if isinstance(fn, HFCausalLMLoss) else HFCausalLMLoss(mesh, style.axis, True)
        module.loss_function = SummedLoss(inner, mesh, style.axis)  # type: ignore[assignment]
    return (), kw
