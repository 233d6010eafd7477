"""Context (sequence) parallelism of a whole transformer: `ContextParallel` splits the token
sequence over one mesh axis (or two: Ulysses x ring) where it enters the blocks, keeps it split
through every block, runs each self-attention as Ulysses, ring or USP
(`SequenceParallelAttention`) and gathers it where it leaves.

The model's own forward runs unchanged; only hooks and per-rank attributes are added, so the
parameter names (and checkpoints) stay the single-device model's:

* the first block's ``hidden_states`` are cut to this rank's tokens (`TokenSplit.shard`:
  backward gathers the gradient, so the patch embedding before it gets the whole gradient); a
  token count the ranks do not divide is split unevenly, exactly (see
  `fastdist.nn.styles.ring_split`). With ``frames`` (Wan's ``patch_embedding``), the patch
  embedding's input is cut to the rank's frames instead, where its tokens are whole frames, and
  its parameters are ``pvary``'d (`fastdist.nn.styles.context_region.FrameEmbed`);
* the ``rotary`` module's output (the rotary embedding of the whole position grid) is cut the
  same way, so each rank rotates its own tokens by their own positions; rotary tables, a text
  stream or a key mask that the model hands its blocks as arguments are cut before every block
  (`fastdist.nn.styles.context_args`);
* the outputs of the ``whole`` modules that feed every block (a DiT's condition embedder:
  timestep embedding, text states) are ``pvary``'d: they meet this rank's tokens, so their
  gradient is summed over the axes; per-token timesteps (Wan 2.2 TI2V) are cut with the tokens;
* every parameter of the split region (the blocks, the output norm and projection, the model's
  own parameters such as Wan's ``scale_shift_table``) is ``pvary``'d in its module's forward
  (`fastdist.nn.pvary_sites`), so its gradient is the sum over the ranks' tokens;
* in each self-attention the one ``F.scaled_dot_product_attention`` its processor calls (after
  the projections, q/k norms and rotary embedding, all token-local) is replaced by the
  sequence-parallel attention (`fastdist.nn.styles.ring_split.split_attention`); cross-attentions
  to replicated encoder states run on the rank's queries as they are;
* the ``output`` module's result is gathered along the tokens, so what follows (the unpatchify)
  sees the whole sequence, replicated;
* every block's input and output tensors carry their forward's split and text count (recorded
  weakly, `fastdist.nn.styles.context_recompute`): a block that gradient checkpointing
  recomputes in backward runs with its own forward's split, whatever forwards ran since; where a
  reentrant checkpoint drops what the inputs carry, the one alive forward that fits is used, and
  several are refused.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.attention import ulysses_sdpa
from fastdist.nn.styles.base import Style, StyleContext, get_child
from fastdist.nn.styles.context_args import BlockArgs, Signatures, hook, refuse_model_args
from fastdist.nn.styles.context_recompute import (
    CurrentSplit,
    SplitRotary,
    carried_split,
    carry_outputs,
)
from fastdist.nn.styles.context_region import (
    FrameEmbed,
    enter_block,
    feed_outputs,
    gather_tokens,
    new_forward,
    record_text,
    shard_rotary,
    shard_tokens,
)
from fastdist.nn.styles.ring_split import (
    AttentionSwap,
    DispatchSwap,
    TokenSplit,
    joint_attention,
    split_attention,
)

__all__ = [
    "ContextParallel",
    "SequenceParallelAttention",
    "KNOWN_PROCESSORS",
    "JOINT_PROCESSORS",
    "JOINS_BEFORE_PROJECTION",
    "MODES",
]

#: attention processors whose forward `SequenceParallelAttention` knows: q, k, v projected by
#: ``to_q``/``to_k``/``to_v``, normalized and rotated token by token, attended by one call of
#: ``F.scaled_dot_product_attention`` (the native backend), projected by ``to_out``
KNOWN_PROCESSORS = frozenset({"WanAttnProcessor", "LTXVideoAttnProcessor", "JointAttnProcessor2_0"})

#: joint text-image attention processors (MM-DiT) `SequenceParallelAttention(joint=True)` knows,
#: with whether they put the text rows first: they project the image rows (``to_q``...) and the
#: text rows (``add_q_proj``..., or ``to_q`` too: `JOINS_BEFORE_PROJECTION`), normalize and rotate
#: them token by token, join them along the tokens and call ``F.scaled_dot_product_attention``
#: once on the joint sequence (with at most a key mask: `fastdist.nn.styles.ring_split`)
JOINT_PROCESSORS = {
    "JointAttnProcessor2_0": False,  # SD3
    "FluxAttnProcessor": True,
    "Flux2AttnProcessor": True,
    "Flux2ParallelSelfAttnProcessor": True,  # Flux 2's single-stream blocks (joined)
    "CogVideoXAttnProcessor2_0": True,
    "QwenDoubleStreamAttnProcessor2_0": True,
    "HunyuanVideoAttnProcessor2_0": False,
}

#: joint processors that may join the text (encoder states) to the image rows before projecting
#: both with ``to_q``/``to_k``/``to_v`` (CogVideoX; HunyuanVideo's single-stream blocks): their
#: attention needs no ``add_q_proj``
JOINS_BEFORE_PROJECTION = frozenset({"CogVideoXAttnProcessor2_0", "HunyuanVideoAttnProcessor2_0"})

#: the attention modes: Ulysses (heads <-> tokens all-to-all), ring (k/v passed around the
#: axis), USP (Ulysses over ``axis``, ring over ``ring_axis``)
MODES = ("ulysses", "ring", "usp")

Mode = Literal["ulysses", "ring", "usp"]


def _split_axes(
    style: str, axis: str, mode: str, ring_axis: str | None, mesh: Mesh
) -> tuple[tuple[str, ...], str | None, str | None]:
    """(the token split's axes, the Ulysses axis, the ring axis) of a mode; refuses bad
    combinations."""
    if mode not in MODES:
        raise ParallelizeError(
            f"parallelize: {style}(mode={mode!r}) is not a mode. Fix: one of {list(MODES)}"
        )
    mesh.axis_indices(axis, style)
    if mode == "usp":
        if ring_axis is None or ring_axis == axis:
            raise ParallelizeError(
                f"parallelize: {style}(mode='usp') runs Ulysses over axis={axis!r} and the ring "
                f"over another axis, but ring_axis={ring_axis!r}. Fix: ring_axis=<a second mesh "
                f"axis>, e.g. Mesh({{'cp': 2, {axis!r}: 2}}) with ring_axis='cp'"
            )
        mesh.axis_indices(ring_axis, style)
        return (ring_axis, axis), axis, ring_axis
    if ring_axis is not None:
        raise ParallelizeError(
            f"parallelize: {style}(mode={mode!r}, ring_axis={ring_axis!r}): ring_axis is for "
            f"mode='usp' only. Fix: mode='usp', or drop ring_axis"
        )
    return (axis,), (axis if mode == "ulysses" else None), (axis if mode == "ring" else None)


class SplitProcessor:
    """An attention processor that runs ``inner`` (the model's own) with its one
    ``F.scaled_dot_product_attention`` replaced by the sequence-parallel attention over this
    forward's token split."""

    def __init__(
        self,
        inner: Any,
        where: str,
        mesh: Mesh,
        axes: tuple[str, ...],
        ulysses_axis: str | None,
        ring_axis: str | None,
        current: CurrentSplit,
    ) -> None:
        self.inner, self.where, self.mesh, self.axes = inner, where, mesh, axes
        self.ulysses_axis, self.ring_axis, self.current = ulysses_axis, ring_axis, current
        # Wan's, LTX-Video's: their attention call swapped without a TorchFunctionMode
        self.direct = DispatchSwap(inner, where) if DispatchSwap.fits(inner) else None
        # diffusers' Attention passes a processor only the keywords its __call__'s signature
        # names (image_rotary_emb...): show it the model's own processor's signature
        call = functools.partial(type(self).__call__, self)
        call.__signature__ = inspect.signature(inner.__call__)  # type: ignore[attr-defined]
        setattr(self, "__call__", call)  # noqa: B010  (what inspect finds; calls use the type's)

    # diffusers sets these on every processor (model.set_attention_backend, enable_parallelism):
    # they reach the model's own processor, whose attention call the swap then checks
    @property
    def _attention_backend(self) -> Any:
        return getattr(self.inner, "_attention_backend", None)

    @_attention_backend.setter
    def _attention_backend(self, value: Any) -> None:
        self.inner._attention_backend = value

    @property
    def _parallel_config(self) -> Any:
        return getattr(self.inner, "_parallel_config", None)

    @_parallel_config.setter
    def _parallel_config(self, value: Any) -> None:
        self.inner._parallel_config = value

    def _image_rows(self, hidden_states: Tensor, split: TokenSplit) -> int:
        """The image rows of the hidden states the processor gets."""
        return hidden_states.shape[1]

    def _split(self, hidden_states: Tensor, args: tuple[Any, ...], kwargs: Any) -> TokenSplit:
        """This forward's token split (carried by the rotary argument, else the current one)."""
        carried = [a for a in (*args, *kwargs.values()) if isinstance(a, SplitRotary)]
        split = carried[0].split if carried else self.current.split
        if split is None:  # used without ContextParallel: the rows are an even split
            n = self.mesh.axis_size(self.axes[0] if len(self.axes) == 1 else self.axes)
            split = TokenSplit(self.mesh, self.axes, hidden_states.shape[1] * n)
        if self._image_rows(hidden_states, split) != split.rows:
            raise ParallelizeError(
                f"sequence-parallel attention {self.where!r} got {hidden_states.shape[1]} tokens, "
                f"not this rank's {split.rows} rows of the {split.tokens} split over "
                f"{split.axes}. Fix: call it on the hidden states of the split blocks"
            )
        return split

    def _attend(
        self, split: TokenSplit, hidden_states: Tensor, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        """The attention over ``(B, S, H, D)`` q, k, v that replaces the processor's SDPA."""
        if self.ring_axis is None and self.ulysses_axis is not None:  # q, k, v in one exchange
            # the padding keys of an uneven split: (1, 1, 1, n * rows)
            flags = None if split.even else split.key_flags(None, hidden_states.device)
            mask = None if flags is None else flags.view(1, 1, 1, -1)
            return functools.partial(
                ulysses_sdpa, mesh=split.mesh, axis=self.ulysses_axis, attn_mask=mask
            )
        return functools.partial(
            split_attention, split=split, ulysses_axis=self.ulysses_axis, ring_axis=self.ring_axis
        )

    def __call__(self, attn: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # eager, one graph break (why: context_graph's doc)
            from fastdist.nn.styles.context_graph import attention_outside_the_graph

            return attention_outside_the_graph(self, attn, hidden_states, *args, **kwargs)
        split = self._split(hidden_states, args, kwargs)
        attend = self._attend(split, hidden_states, args, kwargs)
        masks = getattr(attend, "func", None) is joint_attention  # it takes text key masks
        direct = self.direct
        if direct is not None and direct.inner is self.inner:
            out, calls = direct.run(attend, masks, attn, hidden_states, *args, **kwargs)
        else:
            swap = AttentionSwap(attend, self.where, key_masks=masks)
            with swap:
                out = self.inner(attn, hidden_states, *args, **kwargs)
            calls = swap.calls
        if calls != 1:
            raise ParallelizeError(
                f"sequence-parallel attention {self.where!r}: its processor called "
                f"scaled_dot_product_attention {calls} times, not once (another attention "
                "backend, e.g. set_attention_backend(...)?). Fix: the native backend "
                "(attn.processor._attention_backend = None) or a plan for this attention"
            )
        return out


class JointSplitProcessor(SplitProcessor):
    """A joint text-image attention processor (`JOINT_PROCESSORS`) whose one SDPA call over the
    joined ``[image rows; text]`` (or ``[text; image rows]``) runs as
    `fastdist.nn.styles.ring_split.joint_attention`; called without encoder states (SD3.5's
    second, image-only attention) it is a plain split self-attention. With ``joined``, the text
    rows are already the first rows of its hidden states (Flux's single-stream blocks)."""

    text_first: bool = False
    joined: bool = False

    def _image_rows(self, hidden_states: Tensor, split: TokenSplit) -> int:
        if not self.joined:
            return hidden_states.shape[1]
        text = self.current.text  # the text tokens of this forward, where the plan records them
        if text is None:  # not recorded: whatever precedes the image rows
            return min(hidden_states.shape[1], split.rows)
        return hidden_states.shape[1] - text

    def _attend(
        self, split: TokenSplit, hidden_states: Tensor, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        if self.joined:  # [text; image rows]
            text = hidden_states.shape[1] - split.rows
        else:
            states = kwargs.get("encoder_hidden_states", args[0] if args else None)
            text = 0 if states is None else states.shape[1]
        if text == 0:
            return super()._attend(split, hidden_states, args, kwargs)
        return functools.partial(
            joint_attention,
            split=split,
            text=text,
            text_first=self.text_first,
            ulysses_axis=self.ulysses_axis,
            ring_axis=self.ring_axis,
        )


def _self_attention_only(
    name: str,
    refused: tuple[str, ...],
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Forward pre-hook of a sequence-parallel attention: refuse the ``refused`` arguments
    (encoder states of an attention planned as self-attention, masks: a mask over the whole
    sequence does not fit a rank's block of queries), and a processor set after ``parallelize``
    (it would attend within the rank's tokens alone)."""
    if not isinstance(getattr(module, "processor", None), SplitProcessor):
        raise ParallelizeError(
            f"sequence-parallel attention {name!r}: its processor was replaced after parallelize "
            f"(now {type(getattr(module, 'processor', None)).__name__}, e.g. by "
            "set_attn_processor); it would attend within this rank's tokens alone. Fix: set the "
            "processor before parallelize"
        )
    given = dict(zip(("hidden_states", "encoder_hidden_states", "attention_mask"), args))
    given.update(kwargs)
    for key in refused:
        if given.get(key) is not None:
            raise ParallelizeError(
                f"sequence-parallel attention {name!r} was called with {key}: only unmasked "
                "self-attention is split so far. Fix: list this attention in "
                "ContextParallel(cross=...) if it attends to replicated encoder states without "
                "a mask, or run the model without sequence parallelism"
            )


@dataclass(frozen=True)
class SequenceParallelAttention(Style):
    """A diffusers self-attention (``to_q``/``to_k``/``to_v``/``to_out``, e.g. Wan's
    ``WanAttention``) on a token sequence split over ``axis`` (and ``ring_axis``). Its processor
    runs unchanged (projections, q/k norms over all heads of a token, the rotary embedding of
    the rank's own positions: all token-local); only its one ``F.scaled_dot_product_attention``
    runs over the whole sequence, as

    * ``"ulysses"``: an all-to-all gives each rank every token of ``heads / n`` heads, torch's
      attention runs on them, the inverse all-to-all gives the rank its tokens back;
    * ``"ring"``: queries stay, key/value blocks go around ``axis`` (`fastdist.nn.RingAttention`,
      online softmax); any head count;
    * ``"usp"``: Ulysses over ``axis``, ring over ``ring_axis`` (the tokens split over
      ``(ring_axis, axis)``, ring-major).

    Use it inside `ContextParallel` (which splits the tokens and the rotary embedding, and sums
    the parameters' gradients over the axes); alone it takes its input as an even split.

    Refused at ``parallelize``: heads the Ulysses degree does not divide (naming the module and
    the fix: ``mode="ring"`` or another size), fused projections (``fuse_projections()``),
    cross-attention modules, a processor other than those in `KNOWN_PROCESSORS`; at the call:
    encoder states, an attention mask, a processor that does not call
    ``F.scaled_dot_product_attention`` exactly once unmasked (a joint attention: with at most a
    boolean key mask ``(batch, 1, 1, keys)``, text padding, which it then applies).

    With ``joint=True`` it is a joint text-image attention (MM-DiT, a processor of
    `JOINT_PROCESSORS`: SD3's ``JointAttnProcessor2_0``, Flux's, Flux 2's, QwenImage's,
    CogVideoX's, HunyuanVideo's): the text tokens (its
    ``encoder_hidden_states``, replicated on every rank) join the rank's image rows inside the
    attention and attend, and are attended, over the whole sequence
    (`fastdist.nn.styles.ring_split.joint_attention`); the text output is the same on every rank.

    Args:
        axis: the mesh axis of the sequence split (Ulysses or ring axis by ``mode``).
        mode: ``"ulysses"``, ``"ring"`` or ``"usp"``.
        ring_axis: for ``"usp"``: the second axis, the ring's.
        joint: a joint text-image attention (``add_q_proj``/``add_k_proj``/``add_v_proj``).
        joined: a joint attention whose hidden states already hold the text rows, first
            (Flux's single-stream blocks: ``[text; the rank's image rows]``).
    """

    axis: str = "sp"
    mode: Mode = "ulysses"
    ring_axis: str | None = None
    joint: bool = False
    joined: bool = False

    def _check_processor(self, module: nn.Module, name: str) -> None:
        kind = type(module).__name__
        processor = type(getattr(module, "processor", None)).__name__
        joint = self.joint or self.joined
        known = sorted(JOINT_PROCESSORS if joint else KNOWN_PROCESSORS)
        if self.joined:
            known = [k for k in known if JOINT_PROCESSORS[k]]  # those that put the text first
        if processor not in known:
            raise ParallelizeError(
                f"parallelize: {name!r} ({kind}) runs the processor {processor}, whose forward "
                f"SequenceParallelAttention(joint={joint}) does not know (known: {known}); "
                "splitting around an unknown forward could compute something else. Fix: "
                "module.set_processor(<a known processor>) or a plan for this attention"
            )
        if getattr(module, "fused_projections", False):
            raise ParallelizeError(
                f"parallelize: {name!r} ({kind}) has fused projections (to_qkv). Fix: call "
                "unfuse_projections() on the model before parallelize"
            )
        added = getattr(module, "add_k_proj", None) is not None
        if self.joint and not added and processor not in JOINS_BEFORE_PROJECTION:
            raise ParallelizeError(
                f"parallelize: {name!r} ({kind}) has no add_q_proj/add_k_proj/add_v_proj: not a "
                "joint text-image attention. Fix: list it in ContextParallel(attention=...)"
            )
        if self.joined and added:
            raise ParallelizeError(
                f"parallelize: {name!r} ({kind}) has add_q_proj/add_k_proj/add_v_proj: its text "
                "comes as encoder states, not joined in its hidden states. Fix: list it in "
                "ContextParallel(joint=...)"
            )
        if not joint and (getattr(module, "is_cross_attention", False) or added):
            raise ParallelizeError(
                f"parallelize: {name!r} ({kind}) is a cross-attention; SequenceParallelAttention "
                "splits self-attention. Fix: list it in ContextParallel(cross=...) (or "
                "joint=... if its text tokens join the image tokens: an MM-DiT)"
            )

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        _, ulysses, _ = _split_axes(
            "SequenceParallelAttention", self.axis, self.mode, self.ring_axis, mesh
        )
        kind = type(module).__name__
        self._check_processor(module, name)
        # a single-stream attention may have no output projection of its own (Flux,
        # HunyuanVideo), or one projection for q, k, v and the MLP (Flux 2)
        joint = self.joint or self.joined
        children: tuple[str, ...] = ("to_q", "to_k", "to_v", *(() if joint else ("to_out",)))
        if self.joined and hasattr(module, "to_qkv_mlp_proj"):
            children = ("to_qkv_mlp_proj",)
        for child in children:
            get_child(module, child, name)
        heads = getattr(module, "heads", None)
        n = mesh.axis_size(ulysses) if ulysses is not None else 1
        if type(heads) is not int or heads % n:
            raise ParallelizeError(
                f"parallelize: {name!r} ({kind}) has {heads} heads, which the {n} ranks of "
                f"{ulysses!r} do not divide: Ulysses gives each rank heads / {n} whole heads. "
                "Fix: mode='ring' (any head count: the ready plan's mode, e.g. "
                "plan=fastdist.nn.plans.wan(model, mesh, mode='ring'), or "
                f"ContextParallel(mode='ring')), or an {ulysses!r} size that divides {heads}"
                + (
                    " (mode='usp': a smaller Ulysses axis, a larger ring axis)"
                    if self.ring_axis
                    else ""
                )
            )

    def install(self, module: nn.Module, name: str, mesh: Mesh, current: CurrentSplit) -> None:
        """Put the split processor in place (``check`` first); ``current`` is where the running
        forward's token split is found."""
        axes, ulysses, ring = _split_axes(
            "SequenceParallelAttention", self.axis, self.mode, self.ring_axis, mesh
        )
        inner = module.processor
        processor = SplitProcessor(inner, name, mesh, axes, ulysses, ring, current)
        refused: tuple[str, ...] = ("encoder_hidden_states", "attention_mask")
        if self.joint or self.joined:
            joint = JointSplitProcessor(inner, name, mesh, axes, ulysses, ring, current)
            joint.text_first, joint.joined = JOINT_PROCESSORS[type(inner).__name__], self.joined
            processor, refused = joint, ()  # a mask: a key mask the swap takes, or refused
        object.__setattr__(module, "processor", processor)
        module.register_forward_pre_hook(
            functools.partial(_self_attention_only, name, refused), with_kwargs=True
        )

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        self.check(module, name, ctx.mesh)
        self.install(module, name, ctx.mesh, CurrentSplit())
        return module


@dataclass(frozen=True)
class ContextParallel(Style):
    """A whole transformer with its token sequence split over ``axis`` (context parallelism),
    applied to the model itself (plan pattern ``""``).

    Args:
        axis: the mesh axis the tokens are split over (for ``"usp"``: the Ulysses axis).
        blocks: the ``nn.ModuleList`` of transformer blocks; the first one's ``hidden_states``
            (``(batch, tokens, dim)``) are cut to this rank's tokens.
        attention: in every block, the self-attentions run sequence-parallel
            (`SequenceParallelAttention` in ``mode``).
        cross: in every block, the cross-attentions to replicated encoder states: they run on the
            rank's queries as they are.
        joint: in every block, the joint text-image attentions (MM-DiT: SD3's ``attn``), whose
            text tokens (replicated) join the rank's image tokens inside the attention
            (`SequenceParallelAttention` with ``joint=True``). A block whose attribute is
            ``None`` (SD3.5's ``attn2`` outside its dual-attention layers) is skipped, for
            ``attention`` too.
        single_blocks: a second ``nn.ModuleList`` of blocks after ``blocks`` (Flux's
            single-stream ``single_transformer_blocks``), on the same split tokens.
        joined: in every block of ``single_blocks``, the joint attentions whose hidden states
            already hold the text rows, first (``[text; the rank's image rows]``).
        text: the module (in ``whole``) whose output ``(batch, text tokens, dim)`` is the text
            stream: its length is recorded for the rotary embedding (whose first rows, the text
            tokens', are kept whole) and the ``joined`` attentions.
        rotary_dim: the dim of the rotary module's outputs that holds the tokens (Wan, LTX: 1;
            Flux's ``(tokens, dim)`` tables: 0).
        whole: modules that run on the whole, replicated input before the split (patch
            embedding, rotary embedding, condition embedder); their parameters get whole
            gradients and are not ``pvary``'d.
        feeds: those of ``whole`` whose outputs every block uses next to its tokens (a DiT's
            timestep and text embeddings): ``pvary``'d.
        output: the module whose output (``(batch, tokens, features)``) is gathered along the
            tokens; what follows it (a DiT's unpatchify) runs on the whole sequence.
        mode: ``"ulysses"``, ``"ring"`` or ``"usp"`` (see `SequenceParallelAttention`).
        ring_axis: for ``"usp"``: the ring's axis; the tokens are split over
            ``(ring_axis, axis)``, ring-major.
        rotary: the module (in ``whole``) whose outputs ``(1, tokens, ...)`` are the rotary
            embedding of every position: cut to this rank's positions; ``None``: none.
        per_token: with per-token timesteps (a ``timestep_seq_len`` keyword to a ``feeds``
            module, Wan 2.2 TI2V), the indices of that module's outputs that hold one row per
            token (Wan: the timestep embedding and its projection): cut with the tokens, not
            ``pvary``'d. Only these: a text state as long as the video is still replicated.
        rotary_outputs: the indices of the rotary tables to cut (QwenImage's ``pos_embed``
            returns ``(image tables, text tables)``: ``(0,)``); ``None``: every one.
        rotary_arg: the blocks' argument holding rotary tables of every position (tokens along
            ``rotary_dim``; ``text`` leading rows kept) where no module computes them
            (CogVideoX's ``image_rotary_emb``, a model input; Flux 2's ``[text; image]``
            tables, joined in the model's forward): cut to the rank's positions before every
            block (`fastdist.nn.styles.context_args`).
        text_input: the first block's argument holding the text stream when no ``feeds`` module
            outputs it alone (CogVideoX slices it off its patch embedding): ``pvary``'d there.
        key_mask: the blocks' argument holding a key mask over the whole ``[image; text]``
            sequence, ``(batch, 1, 1, image + text)`` (HunyuanVideo's ``attention_mask``: text
            padding): cut to this rank's ``[image rows; text]`` before every block; the joint
            attentions then mask those keys.
        single_joint: in every block of ``single_blocks``, the joint attentions that get the
            text as encoder states (HunyuanVideo's single-stream blocks).
        frames: the module of ``whole`` that patch-embeds the latent ``(batch, channels,
            frames, height, width)``, an ``nn.Conv3d`` with kernel = stride and no padding whose
            output the model flattens frame-major into the tokens (Wan's ``patch_embedding``):
            each rank embeds its own frames where its tokens are whole frames (the rest of the
            time the whole latent, its rows cut at the first block), and its parameters are
            ``pvary``'d like the split region's (`fastdist.nn.styles.context_region.FrameEmbed`).
            Not such a convolution (a pipeline stage's placeholder): kept whole. ``None``: none.

    Every other parameter of the model is in the split region and is ``pvary``'d over the split
    axes. ``check`` refuses a block attention listed in neither ``attention`` nor ``cross`` (it
    would silently attend only within a rank's tokens).
    """

    axis: str = "sp"
    blocks: str = "blocks"
    attention: tuple[str, ...] = ("attn1",)
    cross: tuple[str, ...] = ("attn2",)
    whole: tuple[str, ...] = ("rope", "patch_embedding", "condition_embedder")
    feeds: tuple[str, ...] = ("condition_embedder",)
    output: str = "proj_out"
    mode: Mode = "ulysses"
    ring_axis: str | None = None
    rotary: str | None = "rope"
    per_token: tuple[int, ...] = (0, 1)
    joint: tuple[str, ...] = ()
    single_blocks: str | None = None
    joined: tuple[str, ...] = ()
    text: str | None = None
    rotary_dim: int = 1
    rotary_outputs: tuple[int, ...] | None = None
    rotary_arg: str | None = None
    text_input: str | None = None
    key_mask: str | None = None
    single_joint: tuple[str, ...] = ()
    frames: str | None = None

    def _blocks(self, model: nn.Module, name: str, attr: str | None = None) -> nn.ModuleList:
        attr = attr or self.blocks
        try:
            blocks = model.get_submodule(attr)
        except AttributeError:
            blocks = None
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise ParallelizeError(
                f"parallelize: ContextParallel: {type(model).__name__} has no non-empty "
                f"ModuleList {attr!r}. Fix: name the list of transformer blocks"
            )
        return blocks

    def _all_blocks(self, model: nn.Module, name: str) -> list[tuple[str, nn.Module, bool]]:
        """(name, block, whether single-stream) of every block, ``blocks`` then
        ``single_blocks``."""
        found = [(f"{self.blocks}.{i}", b, False) for i, b in enumerate(self._blocks(model, name))]
        if self.single_blocks is not None:
            single = self._blocks(model, name, self.single_blocks)
            found += [(f"{self.single_blocks}.{i}", b, True) for i, b in enumerate(single)]
        return found

    def _attentions(
        self, block: nn.Module, where: str, single: bool
    ) -> list[tuple[str, nn.Module, SequenceParallelAttention]]:
        """(name, module, style) of the block's split attentions (``None`` ones skipped)."""
        kinds = [(self.joined, False, True), (self.single_joint, True, False)] if single else []
        if not single:
            kinds = [(self.attention, False, False), (self.joint, True, False)]
        found = []
        for rels, joint, joined in kinds:
            style = SequenceParallelAttention(self.axis, self.mode, self.ring_axis, joint, joined)
            for rel in rels:
                if getattr(block, rel, True) is not None:
                    found.append((f"{where}.{rel}", get_child(block, rel, where), style))
        return found

    def _block_args(self, mesh: Mesh) -> BlockArgs:
        """The block arguments cut per rank (`fastdist.nn.styles.context_args`)."""
        axes, _, _ = _split_axes("ContextParallel", self.axis, self.mode, self.ring_axis, mesh)
        return BlockArgs(
            mesh, axes, self.rotary_arg, self.rotary_dim, self.rotary_outputs, self.text_input,
            self.key_mask,
        )  # fmt: skip

    def _check_outside(self, model: nn.Module) -> None:
        """Refuse an attention outside the block lists and ``whole`` (e.g. Flux's single-stream
        blocks without ``single_blocks``): it would run on the rank's tokens alone."""
        lists = (self.blocks, *((self.single_blocks,) if self.single_blocks else ()))
        inside = (*lists, *self.whole)
        for rel, sub in model.named_modules():
            if hasattr(sub, "to_q") and not any(rel.startswith(f"{p}.") for p in inside):
                raise ParallelizeError(
                    f"parallelize: {rel} ({type(sub).__name__}) is an attention outside "
                    f"ContextParallel's blocks {list(lists)} and whole={self.whole}: it was not "
                    "told about it, and on a rank's tokens alone it would attend within them. "
                    "Fix: ContextParallel(single_blocks=...) naming its list of blocks (with "
                    "joined=... or ...), or whole=(..., its module) if it runs before the split"
                )

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        _split_axes("ContextParallel", self.axis, self.mode, self.ring_axis, mesh)
        kind = type(module).__name__
        if name:
            raise ParallelizeError(
                f"parallelize: ContextParallel applies to the whole model (plan pattern ''), not "
                f"{name!r}. Fix: plan={{'': ContextParallel(...)}}"
            )
        if self.rotary is not None and self.rotary not in self.whole:
            raise ParallelizeError(
                f"parallelize: ContextParallel(rotary={self.rotary!r}) is not one of whole="
                f"{self.whole}: the rotary embedding is computed for the whole grid, then cut. "
                "Fix: add it to whole"
            )
        if self.frames is not None and self.frames not in self.whole:
            raise ParallelizeError(
                f"parallelize: ContextParallel(frames={self.frames!r}) is not one of whole="
                f"{self.whole}: the patch embedding runs before the split. Fix: add it to whole"
            )
        if self.text is not None and self.text not in self.whole:
            raise ParallelizeError(
                f"parallelize: ContextParallel(text={self.text!r}) is not one of whole="
                f"{self.whole}: the text stream is computed whole. Fix: add it to whole"
            )
        for child in (*self.whole, *self.feeds, self.output):
            try:
                module.get_submodule(child)
            except AttributeError:
                raise ParallelizeError(
                    f"parallelize: ContextParallel: {kind} has no module {child!r}. Fix: name "
                    f"its modules ({[n for n, _ in module.named_children()]})"
                ) from None
        for where, block, single in self._all_blocks(module, name):
            for at, sub, style in self._attentions(block, where, single):
                style.check(sub, at, mesh)
            self._block_args(mesh).check(block, where)
            for rel in () if single else self.cross:
                get_child(block, rel, where)
            listed = (
                {*self.joined, *self.single_joint}
                if single
                else {*self.attention, *self.cross, *self.joint}
            )
            for rel, sub in block.named_modules():
                if rel and rel.split(".")[0] not in listed and hasattr(sub, "to_q"):
                    raise ParallelizeError(
                        f"parallelize: {where}.{rel} ({type(sub).__name__}) is an attention "
                        "ContextParallel was not told about: on a rank's tokens alone it would "
                        "attend within them and compute something else. Fix: "
                        f"ContextParallel(attention=(..., {rel!r})) for a self-attention, "
                        f"cross=(..., {rel!r}) for one to replicated encoder states, "
                        f"joint=(..., {rel!r}) for one whose text tokens join the image tokens "
                        f"(joined=(..., {rel!r}) in single_blocks)"
                    )
        self._check_outside(module)

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        self.check(module, name, ctx.mesh)
        mesh = ctx.mesh
        axes, _, _ = _split_axes("ContextParallel", self.axis, self.mode, self.ring_axis, mesh)
        if self.ring_axis is not None:
            ctx.axes.append(self.ring_axis)
        current = CurrentSplit()
        blocks = self._blocks(module, name)
        first = f"{self.blocks}.0"
        module.register_forward_pre_hook(functools.partial(new_forward, current))
        embed = module.get_submodule(self.frames) if self.frames is not None else None
        frames = None
        if embed is not None and FrameEmbed.fits(embed):
            frames = FrameEmbed(mesh, axes, tuple(embed.kernel_size))  # type: ignore[arg-type]
            embed.register_forward_pre_hook(frames)
        # ControlNet residuals, per-token timesteps: rows per token the split does not cut
        module.register_forward_pre_hook(
            functools.partial(refuse_model_args, axes, Signatures()), with_kwargs=True
        )
        blocks[0].register_forward_pre_hook(
            functools.partial(shard_tokens, mesh, axes, first, current, frames=frames),
            with_kwargs=True,
        )
        if self.text is not None:
            module.get_submodule(self.text).register_forward_hook(
                functools.partial(record_text, current)
            )
        if self.rotary is not None:
            module.get_submodule(self.rotary).register_forward_hook(
                functools.partial(
                    shard_rotary,
                    mesh,
                    axes,
                    self.rotary,
                    self.rotary_dim,
                    self.rotary_outputs,
                    current,
                )
            )
        for feed in self.feeds:
            module.get_submodule(feed).register_forward_hook(
                functools.partial(feed_outputs, mesh, axes, feed, self.per_token),
                with_kwargs=True,
            )
        module.get_submodule(self.output).register_forward_hook(
            functools.partial(gather_tokens, current)
        )
        for i, (where, block, single) in enumerate(self._all_blocks(module, name)):
            if i and not single:  # a block whose hidden states no block gave splits them
                block.register_forward_pre_hook(
                    functools.partial(enter_block, mesh, axes, where, current, frames=frames),
                    with_kwargs=True,
                )
            elif i:  # the first one's is shard_tokens
                block.register_forward_pre_hook(
                    functools.partial(carried_split, current, axes, where), with_kwargs=True
                )
            block.register_forward_hook(functools.partial(carry_outputs, current))
            if self._block_args(mesh).names:  # after the split's pre-hook
                block.register_forward_pre_hook(
                    hook(self._block_args(mesh), current, where, i == 0), with_kwargs=True
                )
            for at, sub, style in self._attentions(block, where, single):
                style.install(sub, at, mesh, current)
        # every parameter of the split region meets this rank's tokens: its gradient is summed
        axis = cast(str, axes[0] if len(axes) == 1 else axes)  # pvary takes a tuple of axes too
        # the patch embedding cut by frames joins them (its rank's tokens only: FrameEmbed)
        whole = tuple(w for w in self.whole if frames is None or w != self.frames)
        for mod_name, sub in module.named_modules():
            if any(mod_name == w or mod_name.startswith(f"{w}.") for w in whole):
                continue
            ctx.pvary.extend((sub, p, axis) for p, _ in sub.named_parameters(recurse=False))
        return module
