"""The arguments of a context-parallel model's blocks that hold whole-sequence tensors, cut to
each rank's part before the block runs (`fastdist.nn.ContextParallel`'s ``rotary_arg``,
``text_input`` and ``key_mask``): where a DiT computes them outside any module the style could
hook, and passes the same tensors to every block.

* rotary tables given to the blocks (CogVideoX's ``image_rotary_emb``, a model input; Flux 2's
  ``[text; image]`` tables, concatenated in the model's forward): cut to the rank's image
  positions (`cut_positions`, the same cut as a rotary module's outputs), the text rows kept;
* a text stream computed whole outside a ``feeds`` module (CogVideoX slices it off its patch
  embedding's output): ``pvary``'d where it enters the first block, so its gradient is summed
  over the ranks;
* a key mask over the whole ``[image; text]`` sequence (HunyuanVideo's ``attention_mask``,
  ``(batch, 1, 1, image + text)``): this rank's image rows (padding rows masked) and the text.

The arguments are found by name through the block's signature, so a block called positionally
(diffusers' gradient checkpointing) is handled the same way.

`refuse_model_args`, a forward pre-hook of the model itself, refuses the model arguments that
hold a row per token but are not cut with the tokens (ControlNet residuals, LTX-Video's
per-token timesteps): the model would add or broadcast them against the rank's tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.styles.context_recompute import CurrentSplit, SplitRotary
from fastdist.nn.styles.ring_split import TokenSplit
from fastdist.ops import pvary

__all__ = ["REFUSED_MODEL_ARGS", "BlockArgs", "cut_positions", "hook", "refuse_model_args"]

#: model arguments holding a row per image token that the token split does not cut: the model
#: adds them to every block's hidden states (ControlNet residuals, ``(batch, tokens, dim)`` each)
REFUSED_MODEL_ARGS = {
    "block_controlnet_hidden_states": "SD3's ControlNet residuals",
    "controlnet_block_samples": "Flux's ControlNet residuals of its double-stream blocks",
    "controlnet_single_block_samples": "Flux's ControlNet residuals of its single-stream blocks",
}
#: the models whose per-token timesteps (``timestep`` ``(batch, tokens)``) the split cuts (Wan
#: 2.2's, through its ``timestep_seq_len``; `fastdist.nn.ContextParallel`'s ``per_token``)
PER_TOKEN_TIMESTEPS = ("WanTransformer3DModel", "WanVACETransformer3DModel")


def cut_positions(
    axes: tuple[str, ...],
    where: str,
    dim: int,
    text: int,
    indices: tuple[int, ...] | None,
    out: Any,
    split: Callable[[int], TokenSplit],
) -> Any:
    """``out`` (rotary tables, a tensor or a tuple) with the tensors at ``indices`` (``None``:
    all) cut to this rank's positions along ``dim``: their ``text`` leading rows kept whole, the
    image rows after them cut by ``split(image positions)``; a tuple comes back a `SplitRotary`
    carrying the split."""
    outs = out if isinstance(out, tuple) else (out,)
    picked = range(len(outs)) if indices is None else indices
    if not all(
        i < len(outs) and isinstance(outs[i], Tensor) and outs[i].dim() > dim for i in picked
    ):
        raise ParallelizeError(
            f"context parallelism over {axes}: the rotary tables {where!r} are "
            f"{type(out).__name__}, not tensors with the tokens along dim {dim} at "
            f"{list(picked)}. Fix: ContextParallel(rotary=None) and a plan that gives each rank "
            "its positions"
        )
    tokens = {outs[i].shape[dim] for i in picked}
    if len(tokens) != 1 or min(tokens) <= text:
        raise ParallelizeError(
            f"context parallelism over {axes}: the rotary tables {where!r} hold "
            f"{sorted(tokens)} positions along dim {dim}, not one count above the {text} text "
            "tokens. Fix: ContextParallel(rotary=None) and a plan that gives each rank its "
            "positions (or rotary_outputs=... naming the image tables)"
        )
    mine = split(tokens.pop() - text)

    def cut(t: Tensor) -> Tensor:  # (.., text + rows, ..): the text rows, this rank's rows
        image = mine.shard(t.narrow(dim, text, mine.tokens), dim=dim)
        return torch.cat([t.narrow(dim, 0, text), image], dim) if text else image

    cuts = tuple(cut(t) if i in picked else t for i, t in enumerate(outs))
    return SplitRotary(cuts, mine) if isinstance(out, tuple) else cuts[0]


class Signatures:
    """``inspect.signature`` of modules' ``forward``, computed once per forward function (one
    costs 15-20 us; the hooks bind every block's and the model's call, every forward).

    The key is the function itself (a bound method's ``__func__``: every instance of a class
    shares it, and a bound method's signature is its function's without the first parameter),
    or the callable itself when ``forward`` is no bound method (an instance attribute); the
    kept keys hold their functions alive, so a key is never another function's reused id.
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[bool, Any], inspect.Signature] = {}

    def of(self, module: nn.Module) -> inspect.Signature:
        """The signature ``inspect.signature(module.forward)`` returns."""
        fwd = module.forward
        func = getattr(fwd, "__func__", None)
        key = (True, func) if func is not None else (False, fwd)
        sig = self._kept.get(key)
        if sig is None:
            sig = self._kept[key] = inspect.signature(fwd)
        return sig


@dataclass(frozen=True)
class BlockArgs:
    """Which arguments of every block a forward pre-hook cuts to this rank's part.

    Args:
        mesh: the mesh.
        axes: the token split's axes.
        rotary: the blocks' argument holding rotary tables of every position (``None``: none).
        rotary_dim: the tables' token dim.
        rotary_outputs: the indices of the tables to cut (``None``: all).
        text_input: the first block's argument holding the whole text stream, ``pvary``'d.
        key_mask: the blocks' argument holding a key mask over ``[image; text]``.
    """

    mesh: Mesh
    axes: tuple[str, ...]
    rotary: str | None = None
    rotary_dim: int = 0
    rotary_outputs: tuple[int, ...] | None = None
    text_input: str | None = None
    key_mask: str | None = None
    signatures: Signatures = field(default_factory=Signatures, compare=False, repr=False)

    @property
    def names(self) -> list[str]:
        """The arguments cut (none: no hook needed)."""
        return [a for a in (self.rotary, self.text_input, self.key_mask) if a is not None]

    def check(self, block: nn.Module, where: str) -> None:
        """Refuse a block whose forward lacks an argument the plan cuts."""
        params = inspect.signature(block.forward).parameters
        for arg in self.names:
            if arg not in params:
                raise ParallelizeError(
                    f"parallelize: ContextParallel: {where} ({type(block).__name__}) has no "
                    f"argument {arg!r} (its arguments: {list(params)}). Fix: name one of them "
                    "in rotary_arg / text_input / key_mask, or None"
                )

    def __call__(
        self,
        current: CurrentSplit,
        where: str,
        first: bool,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Forward pre-hook of a block (after the one that sets the forward's split)."""
        split = current.split
        assert split is not None  # set by the split's pre-hook, registered before this one
        bound = self.signatures.of(module).bind(*args, **kwargs)
        given = bound.arguments
        rotary = given.get(self.rotary) if self.rotary is not None else None
        if rotary is not None and not isinstance(rotary, SplitRotary):
            assert self.rotary is not None
            given[self.rotary] = cut_positions(
                self.axes,
                f"{where}({self.rotary}=...)",
                self.rotary_dim,
                current.text or 0,
                self.rotary_outputs,
                rotary,
                lambda n: self._same(split, n, where),
            )
        if first and self.text_input is not None and given.get(self.text_input) is not None:
            axis = self.axes[0] if len(self.axes) == 1 else self.axes
            given[self.text_input] = pvary(given[self.text_input], self.mesh, axis)
        if self.key_mask is not None and given.get(self.key_mask) is not None:
            given[self.key_mask] = self._mask(given[self.key_mask], split, where)
        return bound.args, bound.kwargs

    def _same(self, split: TokenSplit, tokens: int, where: str) -> TokenSplit:
        """The forward's split, if the rotary tables hold its positions."""
        if tokens != split.tokens:
            raise ParallelizeError(
                f"context parallelism over {self.axes}: {where} got rotary tables "
                f"({self.rotary}) of {tokens} image positions for {split.tokens} image tokens. "
                "Fix: rotary tables of the input's positions"
            )
        return split

    def _mask(self, mask: Tensor, split: TokenSplit, where: str) -> Tensor:
        """This rank's part ``(B, 1, 1, rows + text)`` of a ``(B, 1, 1, image + text)`` key
        mask: its image rows (padding rows masked), then every text key."""
        if not (
            isinstance(mask, Tensor)
            and mask.dim() == 4
            and mask.shape[1] == mask.shape[2] == 1
            and mask.shape[3] >= split.tokens
        ):
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ParallelizeError(
                f"context parallelism over {self.axes}: {where}({self.key_mask}=...) is {got}, "
                f"not a key mask (batch, 1, 1, image + text) over {split.tokens} image tokens "
                "and the text. Fix: ContextParallel(key_mask=None) if it is not one"
            )
        image = mask[..., : split.tokens].to(torch.int8)  # (B, 1, 1, T): shard pads with 0
        mine = split.shard(image, dim=3).bool()  # (B, 1, 1, rows)
        return torch.cat([mine, mask[..., split.tokens :].bool()], 3)  # (B, 1, 1, rows + text)


def hook(
    spec: BlockArgs, current: CurrentSplit, where: str, first: bool
) -> Callable[..., tuple[tuple[Any, ...], dict[str, Any]]]:
    """``spec`` as a forward pre-hook of the block ``where``."""
    return lambda module, args, kwargs: spec(current, where, first, module, args, kwargs)


def refuse_model_args(
    axes: tuple[str, ...],
    signatures: Signatures,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Forward pre-hook of a context-parallel model: refuse, at the call, an argument of
    `REFUSED_MODEL_ARGS` given (not ``None``), and a per-token ``timestep`` (``(batch, tokens)``,
    more than one per row) of a model outside `PER_TOKEN_TIMESTEPS`; these hold a row per token
    of the whole sequence, which the model would add to (or broadcast against) the rank's
    tokens: a raw size error, or a wrong result where the sizes happen to fit."""
    try:
        given = signatures.of(module).bind_partial(*args, **kwargs).arguments
    except TypeError:  # the model's own call raises its own error
        return
    model = type(module).__name__
    for arg, what in REFUSED_MODEL_ARGS.items():
        if given.get(arg) is not None:
            raise ParallelizeError(
                f"context parallelism over {axes}: {model}({arg}=...), {what}, hold a row "
                "per token of the whole sequence, which the token split does not cut (the "
                f"model adds them to the rank's tokens). Fix: leave {arg} unset, or run the "
                "model with ControlNet without context parallelism"
            )
    timestep = given.get("timestep")
    if (
        model not in PER_TOKEN_TIMESTEPS
        and isinstance(timestep, Tensor)
        and timestep.dim() >= 2
        and timestep.shape[-1] > 1
    ):
        raise ParallelizeError(
            f"context parallelism over {axes}: {model}(timestep=...) of shape "
            f"{tuple(timestep.shape)} holds a timestep per token, which the token split does "
            "not cut (each rank's blocks would get every token's modulation). Fix: one "
            "timestep per sample (shape (batch,) or (batch, 1)), or run the model without "
            "context parallelism"
        )
