"""The hooks of `fastdist.nn.styles.context.ContextParallel` around its split region: the
first block's hidden states cut to this rank's tokens (and a later block's, where the blocks
before it were skipped), or the patch embedding's input cut to the rank's frames
(`FrameEmbed`), the rotary module's output cut to the rank's positions, the text count
recorded, the outputs of the modules feeding every block ``pvary``'d (or cut, per token), and the
output module's result gathered."""

from __future__ import annotations

import itertools
from typing import Any

import torch
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
from fastdist.ops import axis_index, local_chunk, pvary
from fastdist.ops.packed import pvary_packed

__all__ = [
    "FrameEmbed",
    "own_rows",
    "shard_tokens",
    "enter_block",
    "shard_rotary",
    "record_text",
    "feed_outputs",
    "gather_tokens",
    "new_forward",
]


class FrameEmbed:
    """Forward pre-hook of a DiT's patch embedding (`ContextParallel`'s ``frames``): a
    ``Conv3d`` whose kernel is its stride (Wan's ``patch_embedding``: patches of ``p_t x p_h x
    p_w``, no padding) over the latent ``(batch, channels, frames, height, width)``, whose
    output the model flattens frame-major into the ``T = F' x H' x W'`` tokens (``F' = frames //
    p_t``...). Where this rank's tokens of the split are whole frames (an even split, ``T / n``
    a multiple of ``H' x W'``, on a CPU), the latent is cut to this rank's ``p_t``-frame groups
    (`fastdist.ops.local_chunk`) and the convolution computes this rank's tokens only (the same
    values: a convolution over a slice of frames is bit-equal to the same rows of the whole one,
    checked on CPU for float16 to float64 and 1 and 2 threads, not on a GPU). Otherwise it runs
    on the whole latent and the first block cuts its rows (`own_rows`).

    Either way its parameters are ``pvary``'d (`ContextParallel` lists them with the split
    region's): each rank's convolution contributes the gradient of its own tokens only, summed
    over the axes; the latent's gradient is gathered from the ranks' frames (``local_chunk``'s
    backward) or, on the whole latent, summed (``pvary``).

    ``pending``: the split of the latent the hook cut last (the first block's pre-hook takes it).
    """

    def __init__(self, mesh: Mesh, axes: tuple[str, ...], patch: tuple[int, ...]) -> None:
        self.mesh, self.axes, self.patch = mesh, axes, patch
        self.pending: TokenSplit | None = None

    @staticmethod
    def fits(module: nn.Module) -> bool:
        """Whether ``module`` is a patch embedding this hook can cut: an ``nn.Conv3d`` with
        kernel = stride, no padding, no dilation (else the plan keeps it whole)."""
        return (
            type(module) is nn.Conv3d
            and module.kernel_size == module.stride
            and module.padding == (0, 0, 0)
            and module.dilation == (1, 1, 1)
        )

    def _mine(self, x: Tensor) -> tuple[TokenSplit, int] | None:
        """The split of ``x``'s tokens and the latent frames the convolution reads, if this
        rank's tokens are whole frames (else ``None``)."""
        if x.dim() != 5 or x.device.type != "cpu":
            return None
        frames, h, w = (s // p for s, p in zip(x.shape[2:], self.patch))
        tokens = frames * h * w
        n = self.mesh.axis_size(self.axes[0] if len(self.axes) == 1 else self.axes)
        if n == 1 or tokens == 0 or frames % n:  # frames % n == 0: T / n is whole frames
            return None
        return TokenSplit(self.mesh, self.axes, tokens), frames * self.patch[0]

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        self.pending = None
        x = args[0] if args else None
        if not isinstance(x, Tensor):
            return None
        axis = self.axes[0] if len(self.axes) == 1 else self.axes
        found = self._mine(x)
        if found is None:  # the whole latent: its gradient (if any) summed over the ranks
            # (not only where x.requires_grad: a simulation's vmapped x does not show it)
            if torch.is_grad_enabled():
                return (pvary(x, self.mesh, axis), *args[1:])
            return None
        split, used = found
        if used != x.shape[2]:  # trailing frames short of a patch: the convolution drops them
            x = x.narrow(2, 0, used)
        self.pending = split
        return (local_chunk(x, self.mesh, axis, dim=2), *args[1:])  # (B, C, used / n, H, W)


def own_rows(split: TokenSplit, x: Tensor, dim: int = 1) -> Tensor:
    """This rank's rows of ``x`` (the ``T`` tokens along ``dim``, computed by every rank from
    ``pvary``'d parameters): its tokens, then zero rows up to ``split.rows``, the layout of
    ``split.shard``. Backward: the gradient of these rows only, zeros elsewhere (no collective:
    the ranks' parameter gradients are partial sums, summed by their ``pvary``)."""
    if x.shape[dim] != split.tokens:
        raise ParallelizeError(
            f"context parallelism over {split.axes}: a tensor {tuple(x.shape)} meant to be "
            f"split with the {split.tokens} tokens has {x.shape[dim]} along dim {dim}. Fix: a "
            "plan whose split tensors all follow the tokens"
        )
    rank = axis_index(split.mesh, split.axis).to(x.device).view(1)
    starts = torch.tensor([0, *itertools.accumulate(split.sizes[:-1])], device=x.device)
    rows = torch.arange(split.rows, device=x.device)
    index = starts.index_select(0, rank) + rows  # (rows,): this rank's tokens
    if not split.even:  # its padding rows read a zero row appended at index T
        size = torch.tensor(split.sizes, device=x.device).index_select(0, rank)
        index = torch.where(rows < size, index, split.tokens)
        x = torch.cat([x, torch.zeros_like(x.narrow(dim, 0, 1))], dim)
    return x.index_select(dim, index)


def shard_tokens(
    mesh: Mesh,
    axes: tuple[str, ...],
    where: str,
    current: CurrentSplit,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Any,
    frames: FrameEmbed | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of the first block: its hidden states cut to this rank's tokens; the
    split is recorded for the attentions and the output. With ``frames`` (the patch embedding
    cut by `FrameEmbed`): hidden states of this rank's rows are its tokens already; whole ones
    are cut by `own_rows` (the embedding's parameters are ``pvary``'d)."""
    key = "hidden_states" if not args else None
    x = kwargs[key] if key is not None else args[0]
    if not isinstance(x, Tensor) or x.dim() != 3:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ParallelizeError(
            f"context parallelism over {axes}: {where} gets hidden states {got}, not "
            "(batch, tokens, dim). Fix: ContextParallel(blocks=...) naming the list of "
            "transformer blocks"
        )
    tokens = x.shape[1]
    forward = current.found((x,), {})
    if forward is None and in_backward():  # recomputed by a checkpoint that detached x
        fit = (lambda f: tokens in (f.split.tokens, f.split.rows)) if frames else None
        forward = lost_carry(
            current,
            where,
            axes,
            fit or (lambda f: f.split.tokens == tokens),
            f"{tokens} tokens" if frames is None else f"{tokens} tokens or rows",
        )
    if forward is None:  # a new forward
        cut = frames.pending if frames is not None else None
        if frames is not None:
            frames.pending = None
        split = cut if cut is not None and cut.rows == tokens else TokenSplit(mesh, axes, tokens)
        forward = Forward(split, current.text)
    current.carried[x] = forward
    current.enter(forward)
    split = forward.split
    if frames is None:
        mine = split.shard(x, dim=1)  # (B, rows, D)
    elif tokens == split.rows != split.tokens:
        mine = x  # this rank's tokens already (FrameEmbed)
    else:
        mine = own_rows(split, x, dim=1)
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
    frames: FrameEmbed | None = None,
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
        return shard_tokens(mesh, axes, where, current, module, args, kwargs, frames)
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
