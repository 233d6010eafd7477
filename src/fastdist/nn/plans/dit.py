"""Ready plans for diffusers' diffusion transformers (DiTs): context parallelism of an unmodified
``WanTransformer3DModel`` (Wan 2.1 / 2.2 text-to-video and image-to-video),
``LTXVideoTransformer3DModel`` (LTX-Video) and the joint text-image attention (MM-DiT)
``SD3Transformer2DModel`` (SD3 / SD3.5) and ``FluxTransformer2DModel`` (FLUX.1), and the
recognition of diffusers' attention (``to_q``/``to_k``/``to_v``/``to_out``) that ``plan="auto"``
uses.

Where Wan's tokens are split (diffusers' own ``_cp_plan`` for Wan splits at the same places):
after the patch embedding, at the input of ``blocks.0``; they stay split through every block
(``norm1``..``norm3``, the FFN and the modulation are token-local); ``attn1`` runs as Ulysses,
ring or USP, with the rotary embedding cut to each rank's positions; ``attn2``
(cross-attention to the replicated text states) runs locally; ``proj_out``'s output is gathered
before the unpatchify. See `fastdist.nn.styles.context` and docs/context_parallel.md.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.plans.family import Plan
from fastdist.nn.styles.context import JOINT_PROCESSORS, ContextParallel, Mode

__all__ = [
    "DIT_PLANS",
    "JOINT_ATTENTION",
    "dit_plan",
    "flux",
    "is_diffusers_dit",
    "ltx_video",
    "sd3",
    "wan",
]


def wan(
    model: Any = None,
    mesh: Mesh | None = None,
    *,
    axis: str = "sp",
    mode: Mode = "ulysses",
    ring_axis: str | None = None,
) -> Plan:
    """The context-parallel plan of a diffusers ``WanTransformer3DModel``: its tokens split over
    ``axis`` (and ``ring_axis``), self-attention as Ulysses, ring or USP, the rotary embedding
    cut to each rank's positions, gathered after ``proj_out``.

    Args:
        model: the model (or ``None``): only read to refuse one this plan does not fit.
        mesh: the mesh it will run on (``None``: not checked); must have ``axis``.
        axis: the sequence-parallel axis (for ``"usp"``, the Ulysses one).
        mode: ``"ulysses"``, ``"ring"`` or ``"usp"`` (`fastdist.nn.SequenceParallelAttention`).
        ring_axis: for ``"usp"``: the ring's axis.

    >>> import fastdist as fd
    >>> fd.nn.plans.wan(axis="sp")
    {'': ContextParallel(axis='sp', blocks='blocks', attention=('attn1',), cross=('attn2',), \
whole=('rope', 'patch_embedding', 'condition_embedder'), feeds=('condition_embedder',), \
output='proj_out', mode='ulysses', ring_axis=None, rotary='rope', per_token=(0, 1), joint=(), \
single_blocks=None, joined=(), text=None, rotary_dim=1)}
    """
    _check(model, mesh, axis, ring_axis, "WanTransformer3DModel", "wan")
    return {"": ContextParallel(axis=axis, mode=mode, ring_axis=ring_axis)}


def ltx_video(
    model: Any = None,
    mesh: Mesh | None = None,
    *,
    axis: str = "sp",
    mode: Mode = "ulysses",
    ring_axis: str | None = None,
) -> Plan:
    """The context-parallel plan of a diffusers ``LTXVideoTransformer3DModel`` (LTX-Video): its
    tokens (it takes them patchified, ``(batch, tokens, channels)``) split over ``axis`` (and
    ``ring_axis``) at the first of its ``transformer_blocks``; ``attn1`` as Ulysses, ring or USP
    with the rotary embedding cut to each rank's positions, ``attn2`` (cross-attention to the
    replicated, masked text states) local; ``proj_out``'s output gathered.

    Args:
        model: the model (or ``None``): only read to refuse one this plan does not fit.
        mesh: the mesh it will run on (``None``: not checked); must have ``axis``.
        axis: the sequence-parallel axis (for ``"usp"``, the Ulysses one).
        mode: ``"ulysses"``, ``"ring"`` or ``"usp"``.
        ring_axis: for ``"usp"``: the ring's axis.

    >>> import fastdist as fd
    >>> fd.nn.plans.ltx_video(mode="ring")[""].blocks
    'transformer_blocks'
    """
    _check(model, mesh, axis, ring_axis, "LTXVideoTransformer3DModel", "ltx_video")
    return {
        "": ContextParallel(
            axis=axis,
            blocks="transformer_blocks",
            whole=("rope", "proj_in", "time_embed", "caption_projection"),
            feeds=("time_embed", "caption_projection"),
            mode=mode,
            ring_axis=ring_axis,
        )
    }


def sd3(
    model: Any = None,
    mesh: Mesh | None = None,
    *,
    axis: str = "sp",
    mode: Mode = "ulysses",
    ring_axis: str | None = None,
) -> Plan:
    """The context-parallel plan of a diffusers ``SD3Transformer2DModel`` (Stable Diffusion 3 /
    3.5, an MM-DiT): its image tokens split over ``axis`` (and ``ring_axis``) at the first of
    its ``transformer_blocks``; the text tokens (``context_embedder``'s output) replicated on
    every rank. Each block's joint attention ``attn`` joins the text tokens to the rank's image
    tokens: Ulysses, ring or USP over the image tokens with the text keys counted once, the text
    output the same on every rank (`fastdist.nn.styles.ring_split.joint_attention`); SD3.5's
    image-only ``attn2`` (dual-attention layers) is a split self-attention; ``proj_out``'s output
    is gathered before the unpatchify.

    Every parameter of the blocks (the text stream's ``add_*_proj``, ``norm1_context``,
    ``ff_context`` too) and of ``norm_out``/``proj_out`` is ``pvary``'d, and so are the outputs
    of ``time_text_embed`` and ``context_embedder``: each rank's gradient of the text stream is
    its part (through its image tokens and, with Ulysses, its heads), summed over the ranks.

    Args:
        model: the model (or ``None``): only read to refuse one this plan does not fit.
        mesh: the mesh it will run on (``None``: not checked); must have ``axis``.
        axis: the sequence-parallel axis (for ``"usp"``, the Ulysses one).
        mode: ``"ulysses"``, ``"ring"`` or ``"usp"``.
        ring_axis: for ``"usp"``: the ring's axis.

    >>> import fastdist as fd
    >>> fd.nn.plans.sd3(mode="ring")[""].joint
    ('attn',)
    """
    _check(model, mesh, axis, ring_axis, "SD3Transformer2DModel", "sd3")
    return {
        "": ContextParallel(
            axis=axis,
            blocks="transformer_blocks",
            attention=("attn2",),
            cross=(),
            joint=("attn",),
            whole=("pos_embed", "time_text_embed", "context_embedder"),
            feeds=("time_text_embed", "context_embedder"),
            output="proj_out",
            mode=mode,
            ring_axis=ring_axis,
            rotary=None,
        )
    }


def flux(
    model: Any = None,
    mesh: Mesh | None = None,
    *,
    axis: str = "sp",
    mode: Mode = "ulysses",
    ring_axis: str | None = None,
) -> Plan:
    """The context-parallel plan of a diffusers ``FluxTransformer2DModel`` (FLUX.1, an MM-DiT
    with double- and single-stream blocks): its image tokens (it takes them packed,
    ``(batch, tokens, channels)``) split over ``axis`` (and ``ring_axis``) at the first of its
    ``transformer_blocks``; the text tokens (``context_embedder``'s output) replicated. The
    double-stream blocks' ``attn`` is a joint attention (text as encoder states), the
    single-stream blocks' ``attn`` gets ``[text; the rank's image rows]`` (``joined``); the
    rotary embedding of ``[text; image]`` positions (``pos_embed``'s ``(tokens, dim)`` tables)
    keeps the text rows and is cut to the rank's image rows; ``proj_out``'s output is gathered.
    Gradients as in `sd3`: the text stream is ``pvary``'d with the image stream.

    Args:
        model: the model (or ``None``): only read to refuse one this plan does not fit.
        mesh: the mesh it will run on (``None``: not checked); must have ``axis``.
        axis: the sequence-parallel axis (for ``"usp"``, the Ulysses one).
        mode: ``"ulysses"``, ``"ring"`` or ``"usp"``.
        ring_axis: for ``"usp"``: the ring's axis.

    >>> import fastdist as fd
    >>> fd.nn.plans.flux()[""].joined
    ('attn',)
    """
    _check(model, mesh, axis, ring_axis, "FluxTransformer2DModel", "flux")
    return {
        "": ContextParallel(
            axis=axis,
            blocks="transformer_blocks",
            attention=(),
            cross=(),
            joint=("attn",),
            single_blocks="single_transformer_blocks",
            joined=("attn",),
            whole=("pos_embed", "x_embedder", "time_text_embed", "context_embedder"),
            feeds=("time_text_embed", "context_embedder"),
            output="proj_out",
            mode=mode,
            ring_axis=ring_axis,
            rotary="pos_embed",
            rotary_dim=0,
            text="context_embedder",
        )
    }


def _check(
    model: Any, mesh: Mesh | None, axis: str, ring_axis: str | None, kind: str, plan: str
) -> None:
    """Refuse a mesh without the plan's axes and a model of another class."""
    if mesh is not None:
        mesh.axis_indices(axis, f"plans.{plan}")
        if ring_axis is not None:
            mesh.axis_indices(ring_axis, f"plans.{plan}")
    if isinstance(model, nn.Module) and type(model).__name__ != kind:
        raise ParallelizeError(
            f"plans.{plan}: {type(model).__name__} is not a diffusers {kind}. Fix: a plan for "
            f"it (ready DiT plans: {sorted(DIT_PLANS)})"
        )


#: diffusers model class name -> its ready plan function
DIT_PLANS = {
    "WanTransformer3DModel": wan,
    "LTXVideoTransformer3DModel": ltx_video,
    "SD3Transformer2DModel": sd3,
    "FluxTransformer2DModel": flux,
}

#: diffusers DiTs whose attention joins the text tokens to the image tokens (MM-DiT) and that
#: have no ready plan yet (SD3's is `sd3`, Flux's `flux`)
JOINT_ATTENTION = frozenset(
    {
        "Flux2Transformer2DModel",
        "CogVideoXTransformer3DModel",
        "HunyuanVideoTransformer3DModel",
        "QwenImageTransformer2DModel",
    }
)

#: diffusers' attention projections
_DIFFUSERS_ATTENTION = ("to_q", "to_k", "to_v", "to_out")


def is_diffusers_dit(model: nn.Module) -> bool:
    """Whether ``model`` is a diffusers model (a ``diffusers`` class) holding diffusers-style
    attention (``to_q``/``to_k``/``to_v``/``to_out``, or a fused ``to_qkv``)."""
    if not type(model).__module__.startswith("diffusers."):
        return False
    return any(
        all(hasattr(m, p) for p in _DIFFUSERS_ATTENTION) or hasattr(m, "to_qkv")
        for m in model.modules()
    )


def dit_plan(model: nn.Module, mesh: Mesh | None, axis: str = "sp") -> Plan:
    """``plan="auto"`` (and the default plan) of a diffusers DiT: its ready plan (context
    parallelism over ``axis``); refuses one without a ready plan, naming those that exist, and a
    mesh without ``axis``."""
    kind = type(model).__name__
    joint = kind in JOINT_ATTENTION or any(
        getattr(m, "add_q_proj", None) is not None for m in model.modules()
    )
    if kind not in DIT_PLANS and joint:
        raise ParallelizeError(
            f"plans.auto: {kind} is a diffusers transformer with joint text-image attention "
            "(the text tokens join the image tokens inside each attention, MM-DiT) without a "
            "ready context-parallel plan: joint attention is split for the processors "
            f"{sorted(JOINT_PROCESSORS)} only (SD3's, Flux's), and {kind}'s attention processor "
            "(its text order, rotary embedding, single-stream blocks) is not built. "
            f"Context-parallel plans exist for {sorted(DIT_PLANS)}. Fix: run {kind} without "
            "context parallelism (e.g. data parallelism, or fastdist.nn.GuidedModel over a "
            "'cfg' axis with plan={})"
        )
    if kind not in DIT_PLANS:
        raise ParallelizeError(
            f"plans.auto: {kind} is a diffusers transformer (attention with to_q/to_k/to_v/"
            f"to_out) without a ready plan; context-parallel plans exist for {sorted(DIT_PLANS)}. "
            "Fix: a plan of fastdist.nn.ContextParallel(...) naming its blocks, self- and "
            "cross-attentions, the modules before the split and the output (see "
            "docs/context_parallel.md)"
        )
    if mesh is not None and axis not in mesh.axis_names:
        raise ParallelizeError(
            f"plans.auto: {kind} is a diffusers transformer; its ready plan splits the tokens "
            f"over an {axis!r} axis (context parallelism), which {mesh!r} lacks (tensor "
            "parallelism of DiTs is not built). Fix: a mesh with an 'sp' axis, e.g. "
            f"Mesh({{'sp': 2}}), or plan=fastdist.nn.plans.{DIT_PLANS[kind].__name__}(model, "
            "mesh, axis=<the sequence axis>)"
        )
    return DIT_PLANS[kind](model, mesh, axis=axis)
