"""An optimizer built before the model's parameters were replaced raises at its next step.

``fastdist.nn.parallelize`` replaces each parameter it splits (and FSDP2's ``fully_shard``
replaces every parameter with a DTensor shard). A torch optimizer built over the model before
that still holds the old tensors: its ``step()`` would update tensors the model no longer uses
and train nothing, with no error. `refuse_replaced_in_optimizers` makes such a step raise
:class:`~fastdist.ParallelizeError` (``parallelize``) or :class:`~fastdist.MeshError` (FSDP2)
naming the parameters, the replacement and the fix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fastdist.errors import FastdistError, MeshError

__all__ = ["refuse_replaced_in_optimizers"]


def refuse_replaced_in_optimizers(
    before: dict[str, nn.Parameter],
    after: dict[str, nn.Parameter],
    op: str,
    how: str,
    fix: str,
    error: type[FastdistError] = MeshError,
) -> None:
    """Make any torch optimizer that still holds a parameter of ``before`` that ``after`` no
    longer holds raise at its next ``step()``.

    A global optimizer step pre-hook (torch's ``register_optimizer_step_pre_hook``) holding the
    replaced parameters weakly: one dictionary lookup per parameter per step, one truth test
    once none of them is alive.

    Args:
        before: the model's parameters by name before the replacement.
        after: the model's parameters by name after it.
        op: the public name of the call that replaced them, for the error.
        how: what replaced them (e.g. ``"parallelize split them into per-rank shards"``).
        fix: the fix the error gives.
        error: the exception class raised.
    """
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from torch.utils.weak import WeakIdKeyDictionary

    now = {id(p) for p in after.values()}
    replaced = WeakIdKeyDictionary({p: n for n, p in before.items() if id(p) not in now})
    if not replaced:
        return

    def check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not replaced:  # every replaced parameter is gone (torch runs the hooks from an
            return  # OrderedDict it iterates: a hook cannot remove itself)
        stale = [replaced[p] for g in optimizer.param_groups for p in g["params"] if p in replaced]
        if stale:
            raise error(
                f"{op}: {type(optimizer).__name__} holds {stale[:3]} ({len(stale)} parameters) "
                f"as they were before {how}; its step would update tensors the model no longer "
                f"uses and train nothing. Fix: {fix}"
            )

    register_optimizer_step_pre_hook(check)
