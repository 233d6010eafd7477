"""Context (sequence) parallelism of a whole transformer: `ContextParallel` splits the token
sequence over one mesh axis where it enters the blocks, keeps it split through every block, runs
each self-attention as Ulysses (`SequenceParallelAttention`) and gathers it where it leaves.

The model's own forward runs unchanged; only hooks and per-rank attributes are added, so the
parameter names (and checkpoints) stay the single-device model's:

* the first block's ``hidden_states`` are cut to this rank's block of tokens (``local_chunk``:
  backward gathers the gradient, so the patch embedding before it gets the whole gradient);
* the outputs of the ``whole`` modules that feed every block (a DiT's condition embedder:
  timestep embedding, text states) are ``pvary``'d: they meet this rank's tokens, so their
  gradient is summed over the axis;
* every parameter of the split region (the blocks, the output norm and projection, the model's
  own parameters such as Wan's ``scale_shift_table``) is ``pvary``'d in its module's forward
  (`fastdist.nn.pvary_sites`), so its gradient is the sum over the ranks' tokens;
* the self-attentions exchange heads for sequence (all-to-all) around the attention itself;
  cross-attentions to replicated encoder states run on the rank's queries as they are;
* the ``output`` module's result is gathered (``all_gather_invariant`` along the tokens), so
  what follows (the unpatchify) sees the whole sequence, replicated.

Only the even split is built: a token count or head count the axis does not divide is refused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.styles.base import Style, StyleContext, get_child
from fastdist.ops import all_gather_invariant, all_to_all_4d, local_chunk, pvary

__all__ = ["ContextParallel", "SequenceParallelAttention"]

#: attention processors whose forward `SequenceParallelAttention` knows: q, k, v projected by
#: ``to_q``/``to_k``/``to_v``, q and k normalized over all heads by ``norm_q``/``norm_k``, then
#: unflattened into ``attn.heads`` heads, attended, flattened and projected by ``to_out[0]``
KNOWN_PROCESSORS = frozenset({"WanAttnProcessor"})


# ============================================================================ Ulysses exchanges
def _to_heads(mesh: Mesh, axis: str, heads: int, x: Tensor) -> Tensor:
    """(B, S/n, H*D) this rank's tokens of every head -> (B, S, H/n*D) every token of this rank's
    heads."""
    if x.dim() != 3 or x.shape[-1] % heads:
        raise ParallelizeError(
            f"sequence-parallel attention over {axis!r}: a projection gave {tuple(x.shape)}, "
            f"not (batch, tokens, {heads} heads x head_dim). Fix: a plan for this attention"
        )
    x4 = x.reshape(*x.shape[:2], heads, -1)  # (B, S/n, H, D)
    return all_to_all_4d(x4, mesh, axis).flatten(2)  # (B, S, H/n*D)


def _to_tokens(mesh: Mesh, axis: str, local_heads: int, x: Tensor) -> Tensor:
    """(B, S, H/n*D) every token of this rank's heads -> (B, S/n, H*D) this rank's tokens of
    every head (the attention output before ``to_out``)."""
    x4 = x.reshape(*x.shape[:2], local_heads, -1)  # (B, S, H/n, D)
    return all_to_all_4d(x4, mesh, axis, scatter_dim=1, gather_dim=2).flatten(2)  # (B, S/n, H*D)


def _output_to_heads(
    mesh: Mesh, axis: str, heads: int, module: nn.Module, args: Any, out: Tensor
) -> Tensor:
    """Forward hook of ``norm_q`` / ``norm_k`` / ``to_v``: its output exchanged to heads."""
    return _to_heads(mesh, axis, heads, out)


def _input_to_tokens(
    mesh: Mesh, axis: str, local_heads: int, module: nn.Module, args: tuple[Any, ...]
) -> tuple[Any, ...]:
    """Forward pre-hook of ``to_out[0]``: its input exchanged back to tokens."""
    return (_to_tokens(mesh, axis, local_heads, args[0]), *args[1:])


def _self_attention_only(
    name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Forward pre-hook of a sequence-parallel self-attention: refuse encoder states (this
    attention was planned as self-attention) and masks (a mask over the whole sequence does not
    fit a rank's block of queries)."""
    given = dict(zip(("hidden_states", "encoder_hidden_states", "attention_mask"), args))
    given.update(kwargs)
    for key in ("encoder_hidden_states", "attention_mask"):
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
    ``WanAttention``) on a sequence split over ``axis``, run as Ulysses: after ``norm_q``,
    ``norm_k`` (which normalize over all heads of a token) and ``to_v``, an all-to-all trades
    this rank's tokens of every head for every token of ``heads / n`` heads; the model's own
    processor then applies the rotary embedding (of the whole sequence: each rank now holds every
    position) and attends; before ``to_out[0]`` the inverse all-to-all gives the rank its tokens
    back. ``attn.heads`` is set to the local head count for the processor's unflatten.

    Use it inside `ContextParallel` (which splits the sequence and sums the parameters'
    gradients over the axis); alone it is refused by nothing but computes on unsplit data.

    Refused: heads the axis size does not divide, fused projections (``fuse_projections()``),
    cross-attention modules, a processor other than those in `KNOWN_PROCESSORS`, and at call
    time encoder states or an attention mask.

    Args:
        axis: the mesh axis the sequence is split over.
        mode: ``"ulysses"`` (the only one built; ring and USP on real models are later steps).
    """

    axis: str = "sp"
    mode: Literal["ulysses"] = "ulysses"

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        n = mesh.axis_size(self.axis)
        kind = type(module).__name__
        if self.mode != "ulysses":
            raise ParallelizeError(
                f"parallelize: {name!r}: SequenceParallelAttention(mode={self.mode!r}) is not "
                "built; only 'ulysses'. Fix: mode='ulysses'"
            )
        for child in ("to_q", "to_k", "to_v", "to_out", "norm_q", "norm_k"):
            get_child(module, child, name)
        processor = type(getattr(module, "processor", None)).__name__
        if processor not in KNOWN_PROCESSORS:
            raise ParallelizeError(
                f"parallelize: {name!r} ({kind}) runs the processor {processor}, whose forward "
                f"SequenceParallelAttention does not know (known: {sorted(KNOWN_PROCESSORS)}); "
                "splitting around an unknown forward could compute something else. Fix: "
                "module.set_processor(<a known processor>) or a plan for this attention"
            )
        if getattr(module, "fused_projections", False):
            raise ParallelizeError(
                f"parallelize: {name!r} ({kind}) has fused projections (to_qkv). Fix: call "
                "unfuse_projections() on the model before parallelize"
            )
        if getattr(module, "is_cross_attention", False) or getattr(module, "add_k_proj", None):
            raise ParallelizeError(
                f"parallelize: {name!r} ({kind}) is a cross-attention; SequenceParallelAttention "
                "splits self-attention. Fix: list it in ContextParallel(cross=...)"
            )
        heads = getattr(module, "heads", None)
        if type(heads) is not int or heads % n:
            raise ParallelizeError(
                f"parallelize: {name!r} ({kind}) has {heads} heads, which the {n} ranks of "
                f"{self.axis!r} do not divide: Ulysses gives each rank heads / {n} whole heads. "
                f"Fix: an {self.axis!r} size that divides {heads}"
            )
        width = get_child(module, "to_q", name)
        out = getattr(width, "out_features", None)
        for norm in ("norm_q", "norm_k"):
            sub = get_child(module, norm, name)
            shape = getattr(sub, "normalized_shape", None)
            if not isinstance(sub, nn.Identity) and (shape is None or tuple(shape) != (out,)):
                raise ParallelizeError(
                    f"parallelize: {name}.{norm} ({type(sub).__name__}, normalized_shape "
                    f"{shape}) is not a norm over the whole projection ({out} features, all "
                    "heads), which is where the Ulysses exchange is placed. Fix: a plan for this "
                    "attention"
                )

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        self.check(module, name, ctx.mesh)
        mesh, axis = ctx.mesh, self.axis
        heads = int(module.heads)  # type: ignore[arg-type]
        local = heads // mesh.axis_size(axis)
        to_heads = functools.partial(_output_to_heads, mesh, axis, heads)
        for child in ("norm_q", "norm_k", "to_v"):
            get_child(module, child, name).register_forward_hook(to_heads)
        out = get_child(module, "to_out", name)
        first = out[0] if isinstance(out, (nn.ModuleList, nn.Sequential)) else out
        first.register_forward_pre_hook(functools.partial(_input_to_tokens, mesh, axis, local))
        module.register_forward_pre_hook(
            functools.partial(_self_attention_only, name), with_kwargs=True
        )
        # the processor unflattens by attn.heads: this rank's heads
        object.__setattr__(module, "heads", local)
        return module


# ============================================================================ the region
def _shard_tokens(
    mesh: Mesh, axis: str, where: str, module: nn.Module, args: tuple[Any, ...], kwargs: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of the first block: its hidden states cut to this rank's tokens."""
    key = "hidden_states" if not args else None
    x = kwargs[key] if key is not None else args[0]
    n = mesh.axis_size(axis)
    if not isinstance(x, Tensor) or x.dim() != 3:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ParallelizeError(
            f"context parallelism over {axis!r}: {where} gets hidden states {got}, not "
            "(batch, tokens, dim). Fix: ContextParallel(blocks=...) naming the list of "
            "transformer blocks"
        )
    if x.shape[1] % n:
        raise ParallelizeError(
            f"context parallelism over {axis!r}: {where} gets {x.shape[1]} tokens (hidden "
            f"states {tuple(x.shape)}), which the {n} ranks do not divide (uneven token counts "
            f"are not built yet). Fix: a frame count / resolution whose number of patches "
            f"divides by {n}, or another {axis!r} size"
        )
    mine = local_chunk(x, mesh, axis, dim=1)  # (B, S/n, D)
    if key is not None:
        return args, {**kwargs, key: mine}
    return (mine, *args[1:]), kwargs


def _vary_outputs(
    mesh: Mesh, axis: str, where: str, module: nn.Module, args: Any, kwargs: Any, out: Any
) -> Any:
    """Forward hook of a ``whole`` module feeding the blocks: every tensor output ``pvary``'d."""
    if kwargs.get("timestep_seq_len") is not None:
        raise ParallelizeError(
            f"context parallelism over {axis!r}: {where} got per-token timesteps (a 2-d "
            "timestep, Wan 2.2 TI2V): splitting them with the tokens is not built yet. Fix: a "
            "1-d timestep (one per sample), or run without context parallelism"
        )
    if isinstance(out, Tensor):
        return pvary(out, mesh, axis)
    if isinstance(out, tuple):
        return tuple(pvary(t, mesh, axis) if isinstance(t, Tensor) else t for t in out)
    raise ParallelizeError(
        f"context parallelism over {axis!r}: {where} returned {type(out).__name__}, not a tensor "
        "or a tuple of them. Fix: a plan naming the modules whose outputs feed the blocks"
    )


def _gather_tokens(mesh: Mesh, axis: str, module: nn.Module, args: Any, out: Tensor) -> Tensor:
    """Forward hook of the output module: the whole sequence, replicated on every rank."""
    return all_gather_invariant(out, mesh, axis, dim=1).contiguous()  # (B, S, F)


@dataclass(frozen=True)
class ContextParallel(Style):
    """A whole transformer with its token sequence split over ``axis`` (context parallelism),
    applied to the model itself (plan pattern ``""``).

    Args:
        axis: the mesh axis the tokens are split over.
        blocks: the ``nn.ModuleList`` of transformer blocks; the first one's ``hidden_states``
            (``(batch, tokens, dim)``) are cut to this rank's ``tokens / n``.
        attention: in every block, the self-attentions run as Ulysses
            (`SequenceParallelAttention`).
        cross: in every block, the cross-attentions to replicated encoder states: they run on the
            rank's queries as they are.
        whole: modules that run on the whole, replicated input before the split (patch
            embedding, rotary embedding, condition embedder); their parameters get whole
            gradients and are not ``pvary``'d.
        feeds: those of ``whole`` whose outputs every block uses next to its tokens (a DiT's
            timestep and text embeddings): ``pvary``'d.
        output: the module whose output (``(batch, tokens, features)``) is gathered along the
            tokens; every module after it must run on the whole sequence.

    Every other parameter of the model is in the split region and is ``pvary``'d over ``axis``.
    ``check`` refuses a block attention listed in neither ``attention`` nor ``cross`` (it would
    silently attend only within a rank's tokens).
    """

    axis: str = "sp"
    blocks: str = "blocks"
    attention: tuple[str, ...] = ("attn1",)
    cross: tuple[str, ...] = ("attn2",)
    whole: tuple[str, ...] = ("rope", "patch_embedding", "condition_embedder")
    feeds: tuple[str, ...] = ("condition_embedder",)
    output: str = "proj_out"

    def _blocks(self, model: nn.Module, name: str) -> nn.ModuleList:
        try:
            blocks = model.get_submodule(self.blocks)
        except AttributeError:
            blocks = None
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise ParallelizeError(
                f"parallelize: ContextParallel(blocks={self.blocks!r}): {type(model).__name__} "
                f"has no non-empty ModuleList {self.blocks!r}. Fix: name the list of "
                "transformer blocks"
            )
        return blocks

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        mesh.axis_indices(self.axis, "ContextParallel")
        kind = type(module).__name__
        if name:
            raise ParallelizeError(
                f"parallelize: ContextParallel applies to the whole model (plan pattern ''), not "
                f"{name!r}. Fix: plan={{'': ContextParallel(...)}}"
            )
        for child in (*self.whole, *self.feeds, self.output):
            try:
                module.get_submodule(child)
            except AttributeError:
                raise ParallelizeError(
                    f"parallelize: ContextParallel: {kind} has no module {child!r}. Fix: name "
                    f"its modules ({[n for n, _ in module.named_children()]})"
                ) from None
        attention = SequenceParallelAttention(self.axis)
        for i, block in enumerate(self._blocks(module, name)):
            where = f"{self.blocks}.{i}"
            for rel in self.attention:
                attention.check(get_child(block, rel, where), f"{where}.{rel}", mesh)
            for rel in self.cross:
                get_child(block, rel, where)
            listed = {*self.attention, *self.cross}
            for rel, sub in block.named_modules():
                if rel and rel.split(".")[0] not in listed and hasattr(sub, "to_q"):
                    raise ParallelizeError(
                        f"parallelize: {where}.{rel} ({type(sub).__name__}) is an attention "
                        "ContextParallel was not told about: on a rank's tokens alone it would "
                        "attend within them and compute something else. Fix: "
                        f"ContextParallel(attention=(..., {rel!r})) for a self-attention, "
                        f"cross=(..., {rel!r}) for one to replicated encoder states"
                    )

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        self.check(module, name, ctx.mesh)
        mesh, axis = ctx.mesh, self.axis
        blocks = self._blocks(module, name)
        first = f"{self.blocks}.0"
        blocks[0].register_forward_pre_hook(
            functools.partial(_shard_tokens, mesh, axis, first), with_kwargs=True
        )
        for feed in self.feeds:
            module.get_submodule(feed).register_forward_hook(
                functools.partial(_vary_outputs, mesh, axis, feed), with_kwargs=True
            )
        module.get_submodule(self.output).register_forward_hook(
            functools.partial(_gather_tokens, mesh, axis)
        )
        attention = SequenceParallelAttention(axis)
        for i, block in enumerate(blocks):
            for rel in self.attention:
                where = f"{self.blocks}.{i}.{rel}"
                attention.apply(get_child(block, rel, where), where, ctx)
        # every parameter of the split region meets this rank's tokens: its gradient is summed
        whole = tuple(self.whole)
        for mod_name, sub in module.named_modules():
            if any(mod_name == w or mod_name.startswith(f"{w}.") for w in whole):
                continue
            ctx.pvary.extend((sub, p, axis) for p, _ in sub.named_parameters(recurse=False))
        return module
