"""What every style shares: the `Style` protocol and the `StyleContext` a plan is applied in.

A style says how one module of an unmodified model becomes parallel (``check``, then
``apply``); :func:`fastdist.nn.parallelize` walks the model, checks every match, then applies
them all with one `StyleContext`. Styles written outside this package (expert parallelism in
`fastdist.nn.moe`, the MoE families' attention styles) build on the same pieces: `StyleContext`,
`get_child` and `swap_child`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.state import Layout

__all__ = [
    "SequenceSwitch",
    "Style",
    "StyleContext",
    "decoding",
    "get_child",
    "install_switch",
    "runs_whole",
    "swap_child",
    "switch_of",
    "whole_sequence",
]

#: the attribute of every module of a parallel model holding the model's `SequenceSwitch`
SWITCH = "_fastdist_sequence_switch"


@dataclass
class SequenceSwitch:
    """One per parallel model, the same object on every one of its modules (`install_switch`,
    which `fastdist.nn.parallelize` calls once): how a call whose tokens the plan's sequence
    split cannot take runs. Both kinds of sequence splitting read it, with no walk over the
    modules per call:

    * ``decoding`` (`decoding`: the span of ``generate``): a call that cannot split (a decoding
      step's single new token against a KV cache, a prompt length the ranks do not divide) runs
      whole on every rank instead of raising; context parallelism (`CausalContextParallel`)
      decides at its base model's entry, a decoding step against a KV cache it left split
      attends over every rank's shard;
    * ``whole`` (`whole_sequence`): this call runs on the whole sequence on every rank;
      Megatron sequence parallelism's styles read it (`runs_whole`); its value is decided per
      call where the call enters (`fastdist.nn.generate`: from the token count).

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> switch = install_switch(model)
    >>> with decoding(model), whole_sequence(model):
    ...     print(switch.decoding, runs_whole(model[0]))
    True True
    >>> print(switch.decoding, runs_whole(model[0]))
    False False
    """

    decoding: bool = False
    whole: bool = False


def install_switch(model: nn.Module, switch: SequenceSwitch | None = None) -> SequenceSwitch:
    """Put ``switch`` (a new one when None) on every module of ``model`` (one walk, at
    ``parallelize``); returns it."""
    switch = switch if switch is not None else SequenceSwitch()
    for m in model.modules():
        m.__dict__[SWITCH] = switch  # a plain attribute, not a submodule or buffer
    return switch


def switch_of(module: nn.Module) -> SequenceSwitch | None:
    """The `SequenceSwitch` of the parallel model ``module`` belongs to (None: not parallel)."""
    found = module.__dict__.get(SWITCH)
    return found if isinstance(found, SequenceSwitch) else None


def runs_whole(module: nn.Module) -> bool:
    """Whether ``module``'s sequence-parallel collectives run on the whole sequence now
    (`whole_sequence`)."""
    switch = module.__dict__.get(SWITCH)
    return isinstance(switch, SequenceSwitch) and switch.whole


@contextlib.contextmanager
def whole_sequence(model: nn.Module, on: bool = True) -> Iterator[None]:
    """Within the block (``on``), Megatron sequence parallelism in ``model`` runs on the whole
    sequence, replicated on every rank: `SequenceShard` keeps the hidden states whole,
    `GatherSequence` has nothing to gather, a column-parallel layer's ``"sequence"`` input is
    taken as replicated and a row-parallel layer's ``"sequence"`` output is all-reduced. The
    values are the same as split (norms and dropout then run on every token on every rank): for
    a call whose tokens do not divide the ranks, a decoding step's single new token. Sets the
    model's `SequenceSwitch` (nothing to do for a model that is not parallel).

    Args:
        model: the parallelized model.
        on: whether to run whole (``False``: the block changes nothing).
    """
    switch = switch_of(model)
    if not on or switch is None:
        yield
        return
    old, switch.whole = switch.whole, True
    try:
        yield
    finally:
        switch.whole = old


@contextlib.contextmanager
def decoding(model: nn.Module) -> Iterator[None]:
    """Within the block, a forward of ``model`` whose tokens its sequence split cannot take (a
    decoding step with a KV cache, a length the ranks do not divide) runs whole on every rank,
    or, for context parallelism with a KV cache it left split, attends over every rank's shard,
    instead of raising (`SequenceSwitch`); nothing for a model that is not parallel."""
    switch = switch_of(model)
    if switch is None:
        yield
        return
    old, switch.decoding = switch.decoding, True
    try:
        yield
    finally:
        switch.decoding = old


@dataclass
class StyleContext:
    """What the styles of one ``parallelize`` call share: the mesh, the parameters already
    converted (tied weights stay tied), the parameters to ``pvary`` at every call, and what
    the model's loss must know. A style's ``apply`` takes it; `param` makes a parallel
    parameter from a single-device one.
    """

    mesh: Mesh
    #: id(single-device parameter) -> its parallel replacement, so tied weights stay tied
    converted: dict[int, nn.Parameter] = field(default_factory=dict)
    #: parameter (module, name) pairs to pvary over these axes at every call
    pvary: list[tuple[nn.Module, str, str]] = field(default_factory=list)
    #: the axis of a vocabulary-parallel LM head that gives sharded logits (the loss must know)
    sharded_logits: str | None = None
    #: the axis of a vocabulary-parallel LM head that gathers its logits (``gather_output``)
    gathered_logits: str | None = None
    #: every axis a style split something over
    axes: list[str] = field(default_factory=list)
    #: the model's one `SequenceSwitch` (put on every module after the styles are applied)
    switch: SequenceSwitch = field(default_factory=SequenceSwitch)

    def param(
        self, old: Tensor | None, layout: Layout, where: str, *, linear_weight: bool = False
    ) -> nn.Parameter | None:
        """The parallel parameter for single-device ``old`` (stacked over ranks on a simulated
        mesh).

        ``linear_weight``: an (out, in) weight that ``F.linear`` consumes. Stacked, it is stored
        (in, out)-contiguous and viewed as (out, in): the batched backward produces its gradient
        in that stride order, so gradient accumulation needs no copy (and the forward's batched
        matmul reads the transposed weight contiguously), as one device's ``mm`` does.
        """
        if old is None:
            return None
        if id(old) in self.converted:
            return self.converted[id(old)]
        full = old.detach()
        if full.is_meta:
            # a model built on the meta device: a meta shard of the local shape, no values (the
            # whole tensor is never made); fastdist.checkpoint.load / init_weights give it storage
            local = layout.local_shape(tuple(full.shape), self.mesh, where)
            stacked = self.mesh.backend is None
            data = torch.empty(
                (self.mesh.size, *local) if stacked else local, dtype=full.dtype, device="meta"
            )
            if stacked and linear_weight and data.dim() == 3:
                # as below: a [world, out, in] view of [world, in, out] memory
                data = data.transpose(1, 2).contiguous().transpose(1, 2)
        elif self.mesh.backend is None:
            data = torch.stack(
                [layout.shard(full, self.mesh, r, where) for r in range(self.mesh.size)]
            )  # [world, out, in]
            if linear_weight and data.dim() == 3:
                # [world, out, in] view of [world, in, out] memory
                data = data.transpose(1, 2).contiguous().transpose(1, 2)
        else:
            data = layout.shard(full, self.mesh, self.mesh.rank, where)
        new = nn.Parameter(data, requires_grad=old.requires_grad)
        self.converted[id(old)] = new
        return new


class Style:
    """How one module becomes parallel. ``apply`` returns the module to put in its place (possibly
    itself).

    ``check`` raises for a module the style cannot handle, changing nothing: ``parallelize``
    checks every match before it applies any, so a bad plan leaves the model as it was.
    """

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        pass

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        raise NotImplementedError

    def unverifiable(self) -> str | None:
        """Why ``parallelize(verify=True)`` cannot check this style (it compares every module's
        output with a block of the single-device output), or None: it can."""
        return None


def get_child(module: nn.Module, child: str, name: str) -> nn.Module:
    """``module``'s submodule ``child``; raises `ParallelizeError` naming ``name`` (the module's
    dotted name in the model) when there is none."""
    sub = getattr(module, child, None)
    if not isinstance(sub, nn.Module):
        raise ParallelizeError(
            f"parallelize: {name!r} ({type(module).__name__}) has no submodule {child!r}. Fix: "
            "name the projections of this attention class in the style (q=, k=, v=, o= or qkv=)"
        )
    return sub


def swap_child(parent: nn.Module, child: str, new: nn.Module) -> None:
    """Put ``new`` in place of ``parent``'s submodule ``child`` (nothing when it is already
    there)."""
    if getattr(parent, child) is not new:
        setattr(parent, child, new)
