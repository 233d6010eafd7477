"""Region styles: forward pre-hooks that move a module's input hidden states in or out of a
parallel region (`SequenceShard`, `GatherSequence`, `PrepareInput`), and `PvaryParams` for
replicated parameters that meet rank-varying data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.layers import column_input
from fastdist.nn.styles.base import Style, StyleContext, runs_whole
from fastdist.ops import all_gather_invariant, local_chunk

__all__ = ["SequenceShard", "GatherSequence", "PrepareInput", "PvaryParams"]


def _hidden_hook(fn: Callable[[nn.Module, Tensor], Tensor]) -> Callable[..., Any]:
    """A forward pre-hook applying ``fn(module, hidden states)`` to a module's hidden states
    (first positional or ``hidden_states=``)."""

    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (fn(module, args[0]), *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise ParallelizeError(
                f"parallelize: {type(module).__name__} was called without hidden states to prepare "
                "(no positional argument and no hidden_states=)"
            )
        return args, {**kwargs, "hidden_states": fn(module, kwargs["hidden_states"])}

    return hook


# ============================================================================ regions
class _InputHook(Style):
    """A style that transforms the module's input hidden states with one collective (a forward
    pre-hook)."""

    axis: str
    seq_dim: int

    def prepare(self, x: Tensor, mesh: Mesh) -> Tensor:
        raise NotImplementedError

    def whole(self, x: Tensor, mesh: Mesh) -> Tensor:
        """``prepare`` on the whole, replicated sequence (`whole_sequence`): nothing to move."""
        return x

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        mesh = ctx.mesh
        module.register_forward_pre_hook(
            _hidden_hook(
                lambda m, x: self.whole(x, mesh) if runs_whole(m) else self.prepare(x, mesh)
            ),
            with_kwargs=True,
        )
        return module


@dataclass(frozen=True)
class SequenceShard(_InputHook):
    """Cut the module's input hidden states to this rank's sequence shard (forward: slice;
    backward: all-gather).

    Megatron-style sequence parallelism starts here (the first decoder layer): the model
    computes positions and masks from the whole sequence before it.

    Args:
        axis: the mesh axis the sequence is split over.
        seq_dim: the sequence dim of the hidden states.
    """

    axis: str = "tp"
    seq_dim: int = 1

    def prepare(self, x: Tensor, mesh: Mesh) -> Tensor:
        n = mesh.axis_size(self.axis)
        if x.shape[self.seq_dim] % n:
            raise ParallelizeError(
                f"sequence parallelism over {self.axis!r}: the sequence (dim {self.seq_dim} of "
                f"shape {tuple(x.shape)}) does not divide by the {n} ranks. Fix: "
                f"pad the batch to a multiple of {n} tokens (padding masked with attention_mask "
                "and labels=-100)"
            )
        return local_chunk(x, mesh, self.axis, dim=self.seq_dim)


@dataclass(frozen=True)
class GatherSequence(_InputHook):
    """Gather the module's input hidden states from the sequence shards (forward: all-gather;
    backward: this rank's slice): the end of a sequence-parallel region. The module then runs
    on the whole, replicated sequence (e.g. the final norm before a view by the whole length).

    ``after=True`` gathers the module's output instead: the module runs on this rank's shard
    (1/n of its work) and its parameters are ``pvary``'d as `PvaryParams` does (their gradients
    summed over ``axis``). Only for a module that works token by token (a final norm: RMSNorm,
    LayerNorm), whose output on the shards, gathered, equals its output on the whole sequence;
    the output must be a tensor.

    Args:
        axis: the mesh axis the sequence is split over.
        seq_dim: the sequence dim of the hidden states.
        after: gather the module's output (the module on the shard) instead of its input.
    """

    axis: str = "tp"
    seq_dim: int = 1
    after: bool = False

    def prepare(self, x: Tensor, mesh: Mesh) -> Tensor:
        # contiguous: on real ranks the gather along the sequence dim of a batch of several
        # sequences is a strided view, which model code that .view()s its input (transformers'
        # MoE blocks: hidden_states.view(-1, hidden)) cannot take
        return all_gather_invariant(x, mesh, self.axis, dim=self.seq_dim).contiguous()

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        if not self.after:
            return super().apply(module, name, ctx)
        PvaryParams(self.axis).apply(module, name, ctx)
        mesh = ctx.mesh

        def gather(mod: nn.Module, args: Any, out: Any) -> Any:
            if runs_whole(mod):  # the whole sequence on every rank (whole_sequence)
                return out
            if not isinstance(out, Tensor):
                raise ParallelizeError(
                    f"parallelize: GatherSequence(after=True) on {name!r} "
                    f"({type(mod).__name__}): its output is a {type(out).__name__}, not a "
                    "tensor to gather. Fix: GatherSequence() (gather its input), or put the "
                    "style on a module returning the hidden states"
                )
            return self.prepare(out, mesh)

        module.register_forward_hook(gather)
        return module


@dataclass(frozen=True)
class PrepareInput(_InputHook):
    """The input collective of the column-parallel layers inside the module, run once for all of
    them.

    ``"replicated"``: ``pvary`` (backward all-reduces dx); ``"sequence"``: all-gather of the
    sequence dim (backward reduce-scatter), so the module sees the whole sequence.

    Args:
        axis: the mesh axis of the column-parallel layers inside the module.
        kind: ``"replicated"`` (``pvary``; backward all-reduces dx) or ``"sequence"`` (all-gather of
            the sequence dim; backward reduce-scatter).
        seq_dim: the sequence dim of the hidden states.
    """

    axis: str = "tp"
    kind: Literal["replicated", "sequence"] = "replicated"
    seq_dim: int = 1

    def prepare(self, x: Tensor, mesh: Mesh) -> Tensor:
        # contiguous: as GatherSequence's, for modules that .view() their gathered input
        return column_input(x, mesh, self.axis, self.kind == "sequence", self.seq_dim).contiguous()

    def whole(self, x: Tensor, mesh: Mesh) -> Tensor:
        return column_input(x, mesh, self.axis, False, self.seq_dim)  # already whole: replicated


@dataclass(frozen=True)
class PvaryParams(Style):
    """The module's replicated parameters meet rank-varying data (a norm on a sequence shard, a
    per-head norm on a head shard): ``pvary`` them at every call, so each rank's gradient is
    summed over ``axis`` (without it every rank keeps only its shard's partial gradient).

    Args:
        axis: the mesh axis the data the parameters meet varies over.
    """

    axis: str = "tp"

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        ctx.pvary.extend((module, n, self.axis) for n, _ in module.named_parameters(recurse=False))
        return module
