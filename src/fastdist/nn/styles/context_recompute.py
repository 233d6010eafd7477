"""What a context-parallel forward carries for gradient checkpointing: the token split and text
count of each forward, recorded (weakly) on the tensors between its blocks, so that a block
recomputed in backward runs with its own forward's split, whatever forwards ran since.

`CurrentSplit` is the running forward's split, shared by one model's hooks and attention
processors; `carried_split` (every block after the first) and `carry_outputs` (every block) are
the block hooks `fastdist.nn.ContextParallel` installs; `SplitRotary` carries the split on the
rotary tables the attention processors get. A reentrant checkpoint detaches a block's inputs
and loses the record: `lost_carry` then takes the one alive forward that fits, and refuses when
several do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from fastdist.errors import ParallelizeError
from fastdist.nn.styles.ring_split import TokenSplit

__all__ = [
    "CurrentSplit",
    "Forward",
    "SplitRotary",
    "carried_split",
    "carry_outputs",
    "in_backward",
    "lost_carry",
]


class SplitRotary(tuple):  # type: ignore[type-arg]
    """The rotary module's outputs cut to this rank's positions, carrying the forward's token
    split: the attention processors read the split off their rotary argument, so a block that
    gradient checkpointing recomputes in backward uses its own forward's split, whatever ran
    since."""

    split: TokenSplit

    def __new__(cls, items: tuple[Any, ...], split: TokenSplit) -> SplitRotary:
        self = super().__new__(cls, items)
        self.split = split
        return self


@dataclass(frozen=True)
class Forward:
    """One forward's token split and text tokens (``None``: not recorded): what the tensors
    between its blocks carry."""

    split: TokenSplit
    text: int | None

    @property
    def key(self) -> tuple[int, int | None]:
        return self.split.tokens, self.text


class CurrentSplit:
    """The token split of the forward running now (set where the tokens are split, and again
    before every block from what its inputs carry), shared by the hooks and attention processors
    of one model.

    Every block's input and output tensors are recorded in ``carried`` (weakly) with their
    forward: a block that gradient checkpointing recomputes in backward gets the same input
    tensors, so it runs with its own forward's split and text count, whatever forward ran since
    (SD3 has no rotary embedding that could carry them)."""

    def __init__(self) -> None:
        self.split: TokenSplit | None = None
        self.text: int | None = None  # the text tokens of this forward (ContextParallel(text=))
        self.carried: Any = WeakIdKeyDictionary()  # Tensor -> Forward

    def enter(self, forward: Forward) -> None:
        """Make ``forward`` the running one (a block of it starts)."""
        self.split, self.text = forward.split, forward.text

    def found(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Forward | None:
        """The forward the tensors among a block's arguments carry, if any."""
        for a in (*args, *kwargs.values()):
            if isinstance(a, Tensor) and a in self.carried:
                return cast(Forward, self.carried[a])
        return None

    def alive(self, fits: Callable[[Forward], bool]) -> list[Forward]:
        """The distinct forwards (by split and text) whose carrying tensors are alive (their
        graphs not freed) and ``fits(forward)``."""
        seen: dict[tuple[int, int | None], Forward] = {}
        for forward in list(self.carried.values()):
            if fits(forward):
                seen.setdefault(forward.key, forward)
        return list(seen.values())


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a checkpointed block
    is being recomputed)."""
    return bool(torch._C._current_graph_task_id() != -1)


def lost_carry(
    current: CurrentSplit,
    where: str,
    axes: tuple[str, ...],
    fits: Callable[[Forward], bool],
    what: str,
) -> Forward | None:
    """The forward of a block recomputed in backward whose inputs carry none (a reentrant
    checkpoint detaches them): the one alive forward that ``fits``; ``None`` if none does;
    refused if several do."""
    alive = current.alive(fits)
    if len(alive) > 1:
        raise ParallelizeError(
            f"context parallelism over {axes}: {where} is recomputed in backward (gradient "
            "checkpointing) on inputs that do not carry their forward's token split (a "
            f"reentrant checkpoint detaches them), and forwards of {what} "
            f"{sorted(f.key for f in alive)} (image tokens, text tokens) are alive: which one "
            "this is cannot be known, and the wrong one would give wrong gradients. Fix: "
            "non-reentrant checkpointing (diffusers' default: enable_gradient_checkpointing() "
            "without a function, or use_reentrant=False), or each forward's backward before "
            "the next forward of another size"
        )
    return alive[0] if alive else None


def carried_split(
    current: CurrentSplit,
    axes: tuple[str, ...],
    where: str,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Forward pre-hook of every block after the first: its forward (split, text count) is the
    one its input tensors carry (a block recomputed by gradient checkpointing gets its own
    forward's inputs); without any, the running forward's, or in backward the one alive
    forward whose rows fit: this rank's image rows, or its text and image rows (Flux2's
    single-stream blocks get ``[text; image rows]``, joined by the model between blocks)."""
    forward = current.found(args, kwargs)
    if forward is None and in_backward():
        x = kwargs.get("hidden_states", args[0] if args else None)
        rows = x.shape[1] if isinstance(x, Tensor) and x.dim() == 3 else None
        what = f"{rows} rows per rank"
        forward = lost_carry(
            current,
            where,
            axes,
            lambda f: rows in (f.split.rows, f.split.rows + (f.text or 0)),
            what,
        )
        if forward is None:
            raise ParallelizeError(
                f"context parallelism over {axes}: {where} is recomputed in backward on "
                "inputs that carry no token split, and no alive forward has their rows. Fix: "
                "non-reentrant gradient checkpointing (diffusers' default)"
            )
    if forward is not None:
        current.enter(forward)


def carry_outputs(current: CurrentSplit, module: nn.Module, args: Any, out: Any) -> None:
    """Forward hook of every block: its tensor outputs (the next block's inputs) carry the
    running forward."""
    if current.split is None:
        return
    forward = Forward(current.split, current.text)
    for t in out if isinstance(out, tuple) else (out,):
        if isinstance(t, Tensor):
            current.carried[t] = forward
