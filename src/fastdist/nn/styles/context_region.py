"""The hooks of `fastdist.nn.styles.context.ContextParallel` around its split region: the
first block's hidden states cut to this rank's tokens (and a later block's, where the blocks
before it were skipped), the rotary module's output cut to the rank's positions, the text count
recorded, the outputs of the modules feeding every block ``pvary``'d (or cut, per token), and the
output module's result gathered."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.styles.context_args import cut_positions
from fastdist.nn.styles.context_recompute import (
    CurrentSplit,
    Forward,
    carried_split,
    in_backward,
    lost_carry,
)
from fastdist.nn.styles.ring_split import TokenSplit
from fastdist.ops.packed import pvary_packed

__all__ = [
    "shard_tokens",
    "enter_block",
    "shard_rotary",
    "record_text",
    "feed_outputs",
    "gather_tokens",
    "new_forward",
]


def shard_tokens(
    mesh: Mesh,
    axes: tuple[str, ...],
    where: str,
    current: CurrentSplit,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Any,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of the first block: its hidden states cut to this rank's tokens; the
    split is recorded for the attentions and the output."""
    key = "hidden_states" if not args else None
    x = kwargs[key] if key is not None else args[0]
    if not isinstance(x, Tensor) or x.dim() != 3:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ParallelizeError(
            f"context parallelism over {axes}: {where} gets hidden states {got}, not "
            "(batch, tokens, dim). Fix: ContextParallel(blocks=...) naming the list of "
            "transformer blocks"
        )
    forward = current.found((x,), {})
    if forward is None and in_backward():  # recomputed by a checkpoint that detached x
        tokens = x.shape[1]
        forward = lost_carry(
            current, where, axes, lambda f: f.split.tokens == tokens, f"{tokens} tokens"
        )
    if forward is None:  # a new forward
        forward = Forward(TokenSplit(mesh, axes, x.shape[1]), current.text)
    current.carried[x] = forward
    current.enter(forward)
    split = forward.split
    mine = split.shard(x, dim=1)  # (B, rows, D)
    if key is not None:
        return args, {**kwargs, key: mine}
    return (mine, *args[1:]), kwargs


def enter_block(
    mesh: Mesh,
    axes: tuple[str, ...],
    where: str,
    current: CurrentSplit,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Any,
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Forward pre-hook of every block of ``blocks`` after the first: the forward its inputs
    carry (`carried_split`); but a block whose hidden states no earlier block gave (the blocks
    before it skipped: SD3's ``skip_layers=[0]``; none split the tokens in this forward), or
    that gave them whole in a recomputation, splits them as the first block does."""
    x = kwargs.get("hidden_states", args[0] if args else None)
    forward = current.found(args, kwargs)
    # no forward carried and none running: no block before it split the tokens in this forward
    # (a pipeline stage's handed-in activation carries none, but its placeholder first block
    # split the stage's forward)
    whole = (forward is None and current.split is None and not in_backward()) or (
        forward is not None
        and isinstance(x, Tensor)
        and x.dim() == 3
        and x.shape[1] == forward.split.tokens != forward.split.rows
    )
    if whole:
        return shard_tokens(mesh, axes, where, current, module, args, kwargs)
    carried_split(current, axes, where, module, args, kwargs)
    return None


def shard_rotary(
    mesh: Mesh,
    axes: tuple[str, ...],
    where: str,
    dim: int,
    indices: tuple[int, ...] | None,
    current: CurrentSplit,
    module: nn.Module,
    args: Any,
    out: Any,
) -> Any:
    """Forward hook of the rotary module: its outputs (those at ``indices``; tokens along
    ``dim``) cut to this rank's positions; with text tokens recorded
    (``ContextParallel(text=...)``: Flux's rotary embedding of ``[text; image]``), the leading
    text rows are kept whole and the image rows after them are cut."""
    text = current.text or 0
    return cut_positions(axes, where, dim, text, indices, out, lambda n: TokenSplit(mesh, axes, n))


def record_text(current: CurrentSplit, module: nn.Module, args: Any, out: Any) -> None:
    """Forward hook of the text module: the number of text tokens of this forward."""
    current.text = out.shape[1]  # (B, text, D)


def feed_outputs(
    mesh: Mesh,
    axes: tuple[str, ...],
    where: str,
    per_token: tuple[int, ...],
    module: nn.Module,
    args: Any,
    kwargs: Any,
    out: Any,
) -> Any:
    """Forward hook of a ``whole`` module feeding the blocks: every tensor output ``pvary``'d;
    with per-token timesteps (a ``timestep_seq_len`` keyword, Wan 2.2 TI2V) its outputs at the
    indices ``per_token`` hold one row per token (dim 1) and are cut to this rank's tokens
    instead."""
    axis = axes[0] if len(axes) == 1 else axes
    tokens = kwargs.get("timestep_seq_len")
    outs = out if isinstance(out, tuple) else (out,)
    if not all(t is None or isinstance(t, Tensor) for t in outs):
        raise ParallelizeError(
            f"context parallelism over {axes}: {where} returned {type(out).__name__}, not a "
            "tensor or a tuple of them. Fix: a plan naming the modules whose outputs feed the "
            "blocks"
        )

    def one(i: int, t: Tensor | None) -> Tensor | None:
        if t is None or tokens is None or i not in per_token:
            return t  # pvary'd below, all in one
        if t.dim() < 2 or t.shape[1] != tokens:
            raise ParallelizeError(
                f"context parallelism over {axes}: {where} got per-token timesteps "
                f"(timestep_seq_len={tokens}) but its output {i} is {tuple(t.shape)}, not one row "
                "per token. Fix: ContextParallel(per_token=...) naming the outputs that carry a "
                "row per token"
            )
        return TokenSplit(mesh, axes, tokens).shard(t, dim=1)  # per-token: (B, rows, ...)

    mine = [one(i, t) for i, t in enumerate(outs)]
    whole = [i for i, t in enumerate(outs) if t is not None and mine[i] is t]
    # their gradients summed over the axes in one psum (not one per output)
    for i, v in zip(whole, pvary_packed([mine[i] for i in whole], mesh, axis)):
        mine[i] = v
    return tuple(mine) if isinstance(out, tuple) else mine[0]


def gather_tokens(current: CurrentSplit, module: nn.Module, args: Any, out: Tensor) -> Tensor:
    """Forward hook of the output module: the whole sequence, replicated on every rank."""
    if current.split is None:  # reset by new_forward: no block ran in this forward
        raise ParallelizeError(
            f"context parallelism: {type(module).__name__} (the output module) ran in a forward "
            "in which no block split the tokens: every block was skipped (SD3's skip_layers "
            "naming them all?), and the split region's parameters would get their gradients "
            "summed over ranks that all computed the same. Fix: run at least one block"
        )
    return current.split.gather(out, dim=1)  # (B, T, F)


def new_forward(current: CurrentSplit, module: nn.Module, args: Any) -> None:
    """Forward pre-hook of the model: no split yet in this forward (the first block that runs
    sets it)."""
    current.split = None
