"""Activation checkpointing inside a domain-parallel region (real ranks): a module that
``torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False)`` recomputes in the backward
runs inside its region again, with the region's state of its own forward.

A non-reentrant checkpoint recomputes its function in the backward with the same input tensors.
Where a module of the region starts under a checkpoint that its enclosing module did not (the
top of autograd's saved-tensor hooks changed between them: the module is the checkpoint's
function, or its first module), `Recompute` records the region's state then (the pooled axes,
the uneven blocks, the attention running) on its input tensors (weakly). When that module runs
again in the backward outside any region, its forward pre-hook finds the record on its inputs and
re-enters the region (depth, the functional guard, the state) until its forward returns.

Refused with the reason: a module recomputed in the backward whose inputs carry no record (a
reentrant checkpoint detaches its inputs; a checkpointed function whose first module gets a
tensor the function computed), and, at the forward, an ``F.interpolate`` or attention that the
functional guard runs domain-parallel inside a checkpointed function but outside its modules
(the recompute would run it without the guard, on the block as if it were the whole domain).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from fastdist.errors import ParallelizeError
from fastdist.nn.domain.windows import region

__all__ = ["Recompute", "saved_hooks_top", "check_converted", "in_backward"]


def saved_hooks_top() -> Any:
    """The pack hook on top of autograd's saved-tensor hooks (a checkpoint's while its function
    runs), or ``None``."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if top is None else top[0]


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a checkpointed module
    is being recomputed)."""
    return bool(torch._C._current_graph_task_id() != -1)


@dataclass(frozen=True)
class _State:
    """The region's state where a checkpointed module started."""

    pooled: frozenset[str]
    ragged: tuple[tuple[int, tuple[int, ...]], ...]
    attention: tuple[Any, ...]


def check_converted(where: str, what: str) -> None:
    """At the forward: ``what`` (an ``F.interpolate`` or attention the guard runs
    domain-parallel) inside a checkpointed function but outside the modules of the region that
    started under that checkpoint: refused (its recompute would run without the guard)."""
    frames = region().frames
    if not frames or saved_hooks_top() is frames[-1]:
        return
    raise ParallelizeError(
        f"DomainParallel on {where!r}: the model calls {what} inside a function that "
        "torch.utils.checkpoint recomputes in the backward, outside a module of the region: "
        "the recompute would run it outside the region, on this rank's block as if it were the "
        "whole domain. Fix: checkpoint a module (checkpoint(module, x, use_reentrant=False)), "
        "with the call inside its forward, or no checkpointing there"
    )


class Recompute:
    """The forward hooks of every module inside one domain-parallel region: the record of the
    region's state on a checkpointed module's inputs, and the re-entry where it is recomputed.
    ``guard``: the region's functional guard (a ``TorchFunctionMode``); ``where``: the region's
    name for messages."""

    def __init__(self, guard: Any, where: str) -> None:
        self.guard, self.where = guard, where
        self.records: Any = WeakIdKeyDictionary()  # Tensor -> _State

    def install(self, module: nn.Module, name: str) -> None:
        """The pre-hook and hook on ``module`` (named ``name`` for messages)."""
        module.register_forward_pre_hook(
            lambda m, args, kwargs: self._before(m, name, args, kwargs), with_kwargs=True
        )
        module.register_forward_hook(lambda m, args, out: self._after(m), always_call=True)

    def _before(self, m: nn.Module, name: str, args: Any, kwargs: Any) -> None:
        state = region()
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        if state.depth:  # the forward: the saved-tensor hooks this module starts under
            top = saved_hooks_top()
            if state.frames and top is not state.frames[-1]:  # a checkpoint began here
                snap = _State(
                    frozenset(state.pooled), tuple(state.ragged.items()), tuple(state.attention)
                )
                for t in tensors:
                    self.records[t] = snap
            state.frames.append(top)
            return
        if not in_backward():
            return  # called directly: the domain layers refuse it
        snap = next((self.records[t] for t in tensors if t in self.records), None)
        if snap is None:
            raise ParallelizeError(
                f"DomainParallel on {self.where!r}: {name!r} ({type(m).__name__}) is recomputed "
                "in the backward (activation checkpointing) on inputs that carry no record of "
                "its forward's domain-parallel region (a reentrant checkpoint detaches them, or "
                "the checkpointed function computed them before its first module), so it cannot "
                "run inside its region again. Fix: checkpoint the module itself with "
                "use_reentrant=False (torch.utils.checkpoint.checkpoint(module, x, "
                "use_reentrant=False)), or no checkpointing inside the region"
            )
        state.pooled, state.ragged = set(snap.pooled), dict(snap.ragged)
        state.attention = list(snap.attention)
        self.guard.__enter__()
        state.depth += 1
        state.frames.append(saved_hooks_top())
        state.reentered.append(id(m))

    def _after(self, m: nn.Module) -> None:
        state = region()
        if state.reentered and state.reentered[-1] == id(m):
            state.reentered.pop()
            state.frames.pop()
            state.depth -= 1
            self.guard.__exit__(None, None, None)
            state.pooled.clear()
            state.ragged.clear()
            state.attention.clear()
        elif state.depth and state.frames:
            state.frames.pop()
