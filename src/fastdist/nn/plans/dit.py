"""Ready plans for diffusers' diffusion transformers (DiTs), with the families as data: one
`DitFamily` record per diffusers class (the `ContextParallel` fields that place its modules),
one table (`DIT_FAMILIES`), one builder (`family_plan`), and a thin public function per family
that `plan="auto"` picks by the model's class.

The families: ``WanTransformer3DModel`` (`wan`: Wan 2.1 / 2.2 text-to-video and
image-to-video) and ``LTXVideoTransformer3DModel`` (`ltx_video`), whose text is a
cross-attention; and the joint text-image attention DiTs (MM-DiT, the text tokens replicated on
every rank and joined to its image tokens inside each attention): ``SD3Transformer2DModel``
(`sd3`: SD3 / SD3.5), ``FluxTransformer2DModel`` (`flux`: FLUX.1), ``Flux2Transformer2DModel``
(`flux2`), ``QwenImageTransformer2DModel`` (`qwen_image`), ``CogVideoXTransformer3DModel``
(`cogvideox`) and ``HunyuanVideoTransformer3DModel`` (`hunyuan_video`).

Where Wan's tokens are split (diffusers' own ``_cp_plan`` for Wan splits at the same places):
after the patch embedding, at the input of ``blocks.0`` (where a rank's tokens are whole latent
frames, before it: each rank patch-embeds its own frames, `ContextParallel`'s ``frames``); they
stay split through every block
(``norm1``..``norm3``, the FFN and the modulation are token-local); ``attn1`` runs as Ulysses,
ring or USP, with the rotary embedding cut to each rank's positions; ``attn2``
(cross-attention to the replicated text states) runs locally; ``proj_out``'s output is gathered
before the unpatchify. See `fastdist.nn.styles.context` and docs/context_parallel.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

from torch import nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.plans.family import Plan
from fastdist.nn.styles.context import JOINT_PROCESSORS, ContextParallel, Mode

__all__ = [
    "DIT_FAMILIES",
    "DIT_PLANS",
    "DitFamily",
    "TpSplit",
    "cogvideox",
    "dit_family",
    "dit_plan",
    "family_plan",
    "flux",
    "flux2",
    "is_diffusers_dit",
    "hunyuan_video",
    "ltx_video",
    "qwen_image",
    "sd3",
    "wan",
]


@dataclass(frozen=True)
class TpSplit:
    """Where the blocks of one list of a DiT are split over a tensor-parallel axis (every path
    relative to a block; a path a block lacks, e.g. SD3's ``attn2`` outside its dual-attention
    layers, is skipped in that block).

    Args:
        blocks: the blocks' ``nn.ModuleList`` (``"transformer_blocks"``).
        attentions: the diffusers attentions whose heads are split: their head counts become
            the rank's, their norms over one head stay, norms over all heads are refused or
            (a ``torch.nn.RMSNorm``) computed over the split width; every ``nn.Linear`` inside
            them must be in ``column`` or ``row``.
        column: column-parallel linear layers (q/k/v, the text stream's ``add_*_proj``, fused
            projections, the MLPs' up / gate).
        row: row-parallel linear layers (the output projections, the MLPs' down).
        parts: fused layers of ``column`` or ``row`` and the sizes of the parts they hold side
            by side, each a dotted attribute path from the block read before the split (Flux's
            single-stream ``proj_out`` over ``[attention; MLP]``: ``("attn.inner_dim",
            "proj_mlp.out_features")``); each part is split on its own.
    """

    blocks: str
    attentions: tuple[str, ...]
    column: tuple[str, ...]
    row: tuple[str, ...]
    parts: tuple[tuple[str, tuple[str, ...]], ...] = ()


def _under(attention: str, *projections: str) -> tuple[str, ...]:
    """``attention.projection`` for each projection."""
    return tuple(f"{attention}.{p}" for p in projections)


_QKV = ("to_q", "to_k", "to_v")
_ADDED = ("add_q_proj", "add_k_proj", "add_v_proj")


def _mmdit(
    mlps: tuple[str, str] = ("ff", "ff_context"),
    up: str = "net.0.proj",
    down: str = "net.2",
    extra: tuple[str, ...] = (),
    gated: bool = False,
) -> TpSplit:
    """The double-stream blocks of an MM-DiT (``transformer_blocks``): ``attn``'s image and text
    projections and outputs (``to_out.0``, ``to_add_out``), the image and text MLPs; ``extra``:
    more image-only attentions (SD3.5's ``attn2``); ``gated``: the MLPs' up layer holds the
    gate and the up projection side by side (SwiGLU)."""
    halves = tuple((f"{m}.{up}", (f"{m}.{down}.in_features",) * 2) for m in mlps)
    return TpSplit(
        "transformer_blocks",
        ("attn", *extra),
        (*_under("attn", *_QKV, *_ADDED), *(p for a in extra for p in _under(a, *_QKV)))
        + tuple(f"{m}.{up}" for m in mlps),
        ("attn.to_out.0", "attn.to_add_out", *(f"{a}.to_out.0" for a in extra))
        + tuple(f"{m}.{down}" for m in mlps),
        halves if gated else (),
    )


#: single-stream blocks of Flux and HunyuanVideo: q/k/v of ``[text; image]`` and the MLP's up
#: layer column-parallel, ``proj_out`` over ``[attention output; MLP hidden]`` row-parallel
_SINGLE = TpSplit(
    "single_transformer_blocks",
    ("attn",),
    (*_under("attn", *_QKV), "proj_mlp"),
    ("proj_out",),
    (("proj_out", ("attn.inner_dim", "proj_mlp.out_features")),),
)


def _mmdit_fields(joint: str = "attn", **fields: Any) -> dict[str, Any]:
    """The `ContextParallel` fields of a joint text-image attention DiT (MM-DiT): its
    ``transformer_blocks`` hold the joint attention ``joint`` and no self- or cross-attention of
    their own; ``fields`` add the rest (the modules before the split, the rotary tables...)."""
    return dict(blocks="transformer_blocks", attention=(), cross=(), joint=(joint,), **fields)


@dataclass(frozen=True)
class DitFamily:
    """One diffusers DiT class and where its modules are, as `ContextParallel` fields.

    Args:
        name: the plan's name (its public function in `fastdist.nn.plans`).
        kind: the diffusers model class name it fits.
        fields: the `ContextParallel` fields besides ``axis``, ``mode`` and ``ring_axis``
            (blocks, attentions, the modules before the split, the output...).
        refuse: reads the model (``None``: no check); a reason to refuse a configuration of the
            class the plan does not fit, or ``None``.
        tp: where its blocks' heads and MLPs are split over a tensor-parallel axis
            (`fastdist.nn.plans.dit_tp.dit_tp`); empty: not built, ``no_tp`` says why.
        tp_rotary: the module whose rotary tables span the width of all heads (LTX-Video's
            ``rope``), cut to the rank's columns with the heads (``None``: tables per head).
        no_tp: why the family has no tensor-parallel split.
    """

    name: str
    kind: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    refuse: Callable[[nn.Module], str | None] | None = None
    tp: tuple[TpSplit, ...] = ()
    tp_rotary: str | None = None
    no_tp: str = ""


#: every ready family, by plan name
DIT_FAMILIES: dict[str, DitFamily] = {
    f.name: f
    for f in (
        # Wan: ContextParallel's defaults (blocks, attn1 / attn2, rope, condition_embedder);
        # image-to-video: attn2's image projections add_k_proj / add_v_proj; each rank
        # patch-embeds its own frames where its tokens are whole frames
        DitFamily(
            "wan",
            "WanTransformer3DModel",
            dict(frames="patch_embedding"),
            tp=(
                TpSplit(
                    "blocks",
                    ("attn1", "attn2"),
                    (*_under("attn1", *_QKV), *_under("attn2", *_QKV, *_ADDED[1:]))
                    + ("ffn.net.0.proj",),
                    ("attn1.to_out.0", "attn2.to_out.0", "ffn.net.2"),
                ),
            ),
        ),
        DitFamily(
            "ltx_video",
            "LTXVideoTransformer3DModel",
            dict(
                blocks="transformer_blocks",
                whole=("rope", "proj_in", "time_embed", "caption_projection"),
                feeds=("time_embed", "caption_projection"),
            ),
            # its q/k norms and rotary tables span all heads: WidthRMSNorm, tables cut by columns
            tp=(
                TpSplit(
                    "transformer_blocks",
                    ("attn1", "attn2"),
                    (*_under("attn1", *_QKV), *_under("attn2", *_QKV), "ff.net.0.proj"),
                    ("attn1.to_out.0", "attn2.to_out.0", "ff.net.2"),
                ),
            ),
            tp_rotary="rope",
        ),
        DitFamily(
            "sd3",
            "SD3Transformer2DModel",
            dict(
                blocks="transformer_blocks",
                attention=("attn2",),
                cross=(),
                joint=("attn",),
                whole=("pos_embed", "time_text_embed", "context_embedder"),
                feeds=("time_text_embed", "context_embedder"),
                rotary=None,
            ),
            tp=(_mmdit(extra=("attn2",)),),  # SD3.5's image-only attn2 in its dual layers
        ),
        DitFamily(
            "flux",
            "FluxTransformer2DModel",
            _mmdit_fields(
                single_blocks="single_transformer_blocks",
                joined=("attn",),
                whole=("pos_embed", "x_embedder", "time_text_embed", "context_embedder"),
                feeds=("time_text_embed", "context_embedder"),
                rotary="pos_embed",
                rotary_dim=0,
                text="context_embedder",
            ),
            tp=(_mmdit(), _SINGLE),
        ),
        # CogVideoX joins the text before to_q; its rotary tables are a model input
        DitFamily(
            "cogvideox",
            "CogVideoXTransformer3DModel",
            _mmdit_fields(
                joint="attn1",
                whole=("patch_embed", "time_embedding"),
                feeds=("time_embedding",),
                rotary=None,
                rotary_arg="image_rotary_emb",
                rotary_dim=0,
                text_input="encoder_hidden_states",
            ),
            tp=(
                TpSplit(
                    "transformer_blocks",
                    ("attn1",),
                    (*_under("attn1", *_QKV), "ff.net.0.proj"),
                    ("attn1.to_out.0", "ff.net.2"),
                ),
            ),
        ),
        DitFamily(
            "qwen_image",
            "QwenImageTransformer2DModel",
            _mmdit_fields(
                whole=("pos_embed", "time_text_embed", "txt_norm", "img_in", "txt_in"),
                feeds=("time_text_embed", "txt_in"),
                rotary="pos_embed",
                rotary_dim=0,
                rotary_outputs=(0,),  # (image tables, text tables)
            ),
            tp=(_mmdit(mlps=("img_mlp", "txt_mlp")),),
            refuse=lambda m: _config_refusal(
                m,
                "zero_cond_t",
                "its per-image-token modulation index (modulate_index, the edit models' "
                "zero_cond_t) is not cut with the tokens",
            ),
        ),
        DitFamily(
            "flux2",
            "Flux2Transformer2DModel",
            _mmdit_fields(
                single_blocks="single_transformer_blocks",
                joined=("attn",),
                # the modulations run on the pvary'd timestep embedding (norm_out uses it too):
                # in the split region, their parameters' gradients summed over the ranks
                whole=("pos_embed", "time_guidance_embed", "x_embedder", "context_embedder"),
                feeds=("time_guidance_embed", "context_embedder"),
                rotary=None,
                rotary_arg="image_rotary_emb",  # [text; image] tables joined in the forward
                rotary_dim=0,
                text="context_embedder",
            ),
            tp=(
                _mmdit(up="linear_in", down="linear_out", gated=True),
                # one fused projection of [q, k, v, MLP gate, MLP up]; to_out over [attn; MLP]
                TpSplit(
                    "single_transformer_blocks",
                    ("attn",),
                    ("attn.to_qkv_mlp_proj",),
                    ("attn.to_out",),
                    (
                        (
                            "attn.to_qkv_mlp_proj",
                            ("attn.inner_dim",) * 3 + ("attn.mlp_hidden_dim",) * 2,
                        ),
                        ("attn.to_out", ("attn.inner_dim", "attn.mlp_hidden_dim")),
                    ),
                ),
            ),
        ),
        DitFamily(
            "hunyuan_video",
            "HunyuanVideoTransformer3DModel",
            _mmdit_fields(
                single_blocks="single_transformer_blocks",
                single_joint=("attn",),
                # context_embedder: the token refiner (self-attention over the text, masked)
                whole=("x_embedder", "context_embedder", "time_text_embed", "rope"),
                feeds=("context_embedder", "time_text_embed"),
                rotary="rope",
                rotary_dim=0,
                key_mask="attention_mask",  # (B, 1, 1, image + text): text padding
            ),
            tp=(_mmdit(), _SINGLE),  # the token refiner (context_embedder) replicated
            refuse=lambda m: (
                None
                if getattr(m.config, "image_condition_type", None) != "token_replace"
                else "HunyuanVideoTransformer3DModel with image_condition_type='token_replace' "
                "(image-to-video): its blocks modulate the first frame's tokens apart "
                "(first_frame_num_tokens), which is not cut with the tokens. Fix: run it "
                "without context parallelism"
            ),
        ),
    )
}


def _config_refusal(model: nn.Module, key: str, why: str) -> str | None:
    """A reason to refuse ``model`` if its config sets ``key``."""
    if not getattr(getattr(model, "config", None), key, False):
        return None
    return (
        f"{type(model).__name__} with {key}=True: {why}. Fix: {key}=False, or run it without "
        "context parallelism"
    )


class PlanOptions(TypedDict, total=False):
    """The keyword options of every ready DiT plan (`family_plan`'s; each has its default)."""

    axis: str
    mode: Mode
    ring_axis: str | None


def family_plan(
    family: str | DitFamily,
    model: Any = None,
    mesh: Mesh | None = None,
    *,
    axis: str = "sp",
    mode: Mode = "ulysses",
    ring_axis: str | None = None,
) -> Plan:
    """The context-parallel plan of a DiT family: ``{"": ContextParallel(...)}`` with the
    family's fields.

    Args:
        family: the family's name in `DIT_FAMILIES` (``"wan"``...) or its record.
        model: the model (or ``None``): only read to refuse one this plan does not fit (another
            class, or a configuration the family refuses).
        mesh: the mesh it will run on (``None``: not checked); must have ``axis``.
        axis: the sequence-parallel axis (for ``"usp"``, the Ulysses one).
        mode: ``"ulysses"``, ``"ring"`` or ``"usp"`` (`fastdist.nn.SequenceParallelAttention`).
        ring_axis: for ``"usp"``: the ring's axis.

    >>> family_plan("ltx_video", mode="ring")[""].blocks
    'transformer_blocks'
    """
    fam = DIT_FAMILIES[family] if isinstance(family, str) else family
    where = f"plans.{fam.name}"
    if mesh is not None:
        mesh.axis_indices(axis, where)
        if ring_axis is not None:
            mesh.axis_indices(ring_axis, where)
    if isinstance(model, nn.Module):
        if type(model).__name__ != fam.kind:
            raise ParallelizeError(
                f"{where}: {type(model).__name__} is not a diffusers {fam.kind}. Fix: a plan for "
                f"it (ready DiT plans: {sorted(DIT_PLANS)})"
            )
        reason = fam.refuse(model) if fam.refuse is not None else None
        if reason is not None:
            raise ParallelizeError(f"{where}: {reason}")
    return {"": ContextParallel(axis=axis, mode=mode, ring_axis=ring_axis, **fam.fields)}


def wan(model: Any = None, mesh: Mesh | None = None, **options: Unpack[PlanOptions]) -> Plan:
    """The context-parallel plan of a diffusers ``WanTransformer3DModel``: its tokens split over
    ``axis`` (and ``ring_axis``; where a rank's tokens are whole latent frames, its
    ``patch_embedding`` runs on those frames only, its parameters' gradients summed over the
    ranks), self-attention as Ulysses, ring or USP, the rotary embedding
    cut to each rank's positions, cross-attention to the replicated text states local, gathered
    after ``proj_out``. Arguments as in `family_plan`.

    >>> import fastdist as fd
    >>> fd.nn.plans.wan(axis="sp")
    {'': ContextParallel(axis='sp', blocks='blocks', attention=('attn1',), cross=('attn2',), \
whole=('rope', 'patch_embedding', 'condition_embedder'), feeds=('condition_embedder',), \
output='proj_out', mode='ulysses', ring_axis=None, rotary='rope', per_token=(0, 1), joint=(), \
single_blocks=None, joined=(), text=None, rotary_dim=1, rotary_outputs=None, rotary_arg=None, \
text_input=None, key_mask=None, single_joint=(), frames='patch_embedding')}
    """
    return family_plan("wan", model, mesh, **options)


def ltx_video(model: Any = None, mesh: Mesh | None = None, **options: Unpack[PlanOptions]) -> Plan:
    """The context-parallel plan of a diffusers ``LTXVideoTransformer3DModel`` (LTX-Video): its
    tokens (it takes them patchified, ``(batch, tokens, channels)``) split at the first of its
    ``transformer_blocks``; ``attn1`` as Ulysses, ring or USP with the rotary embedding cut to
    each rank's positions, ``attn2`` (cross-attention to the replicated, masked text states)
    local; ``proj_out``'s output gathered. Arguments as in `family_plan`.

    >>> import fastdist as fd
    >>> fd.nn.plans.ltx_video(mode="ring")[""].blocks
    'transformer_blocks'
    """
    return family_plan("ltx_video", model, mesh, **options)


def sd3(model: Any = None, mesh: Mesh | None = None, **options: Unpack[PlanOptions]) -> Plan:
    """The context-parallel plan of a diffusers ``SD3Transformer2DModel`` (Stable Diffusion 3 /
    3.5, an MM-DiT): its image tokens split at the first of its ``transformer_blocks``; the text
    tokens (``context_embedder``'s output) replicated on every rank. Each block's joint
    attention ``attn`` joins the text tokens to the rank's image tokens: Ulysses, ring or USP
    over the image tokens with the text keys counted once, the text output the same on every
    rank (`fastdist.nn.styles.ring_split.joint_attention`); SD3.5's image-only ``attn2``
    (dual-attention layers) is a split self-attention; ``proj_out``'s output is gathered.

    Every parameter of the blocks (the text stream's ``add_*_proj``, ``norm1_context``,
    ``ff_context`` too) and of ``norm_out``/``proj_out`` is ``pvary``'d, and so are the outputs
    of ``time_text_embed`` and ``context_embedder``: each rank's gradient of the text stream is
    its part (through its image tokens and, with Ulysses, its heads), summed over the ranks.
    Arguments as in `family_plan`.

    >>> import fastdist as fd
    >>> fd.nn.plans.sd3(mode="ring")[""].joint
    ('attn',)
    """
    return family_plan("sd3", model, mesh, **options)


def flux(model: Any = None, mesh: Mesh | None = None, **options: Unpack[PlanOptions]) -> Plan:
    """The context-parallel plan of a diffusers ``FluxTransformer2DModel`` (FLUX.1, an MM-DiT
    with double- and single-stream blocks): its image tokens (packed, ``(batch, tokens,
    channels)``) split at the first of its ``transformer_blocks``; the text tokens replicated.
    The double-stream blocks' ``attn`` is a joint attention (text as encoder states), the
    single-stream blocks' ``attn`` gets ``[text; the rank's image rows]`` (``joined``); the
    rotary embedding of ``[text; image]`` positions (``pos_embed``'s ``(tokens, dim)`` tables)
    keeps the text rows and is cut to the rank's image rows; ``proj_out``'s output is gathered.
    Gradients as in `sd3`. Arguments as in `family_plan`.

    >>> import fastdist as fd
    >>> fd.nn.plans.flux()[""].joined
    ('attn',)
    """
    return family_plan("flux", model, mesh, **options)


def cogvideox(model: Any = None, mesh: Mesh | None = None, **options: Unpack[PlanOptions]) -> Plan:
    """The context-parallel plan of a diffusers ``CogVideoXTransformer3DModel`` (CogVideoX 1.0 /
    1.5): its video tokens split at the first of its ``transformer_blocks``; the text tokens
    (the first rows of ``patch_embed``'s output) replicated on every rank, ``pvary``'d where
    they enter the first block. Each block's ``attn1`` joins ``[text; the rank's video rows]``
    before its projections (text first) and runs as a joint attention (the text keys counted
    once); the rotary tables (``image_rotary_emb``, a model input of every video position) are
    cut to the rank's positions before every block; ``proj_out``'s output is gathered.

    Why the text is replicated, not split with the video: CogVideoX's text is at most 226
    tokens against thousands of video tokens, its stream is token-local in every block, and a
    split text would tie its count to the ranks; each rank redoes the small text stream.
    Arguments as in `family_plan`.

    >>> import fastdist as fd
    >>> fd.nn.plans.cogvideox()[""].rotary_arg
    'image_rotary_emb'
    """
    return family_plan("cogvideox", model, mesh, **options)


def qwen_image(model: Any = None, mesh: Mesh | None = None, **options: Unpack[PlanOptions]) -> Plan:
    """The context-parallel plan of a diffusers ``QwenImageTransformer2DModel`` (Qwen-Image, an
    MM-DiT of double-stream blocks): its image tokens (packed, ``(batch, tokens, channels)``)
    split at the first of its ``transformer_blocks``; the text tokens (``txt_in``'s output)
    replicated. Each block's ``attn`` joins ``[text; the rank's image rows]`` (text first); of
    ``pos_embed``'s ``(image tables, text tables)`` only the image ones are cut to the rank's
    positions. Refused with ``zero_cond_t=True`` (the edit models' per-token modulation
    index). Gradients as in `sd3`. Arguments as in `family_plan`.

    >>> import fastdist as fd
    >>> fd.nn.plans.qwen_image()[""].rotary_outputs
    (0,)
    """
    return family_plan("qwen_image", model, mesh, **options)


def flux2(model: Any = None, mesh: Mesh | None = None, **options: Unpack[PlanOptions]) -> Plan:
    """The context-parallel plan of a diffusers ``Flux2Transformer2DModel`` (FLUX.2): as `flux`
    (double-stream joint attentions, single-stream blocks on ``[text; the rank's image rows]``,
    text replicated), with Flux 2's module names; its rotary tables of ``[text; image]`` are
    joined in the model's forward, so they are cut where they enter every block
    (``rotary_arg``), the text rows kept; its single-stream attention projects q, k, v and the
    MLP in one ``to_qkv_mlp_proj``. The timestep embedding is ``pvary``'d and the modulations
    run in the split region. The reference-image KV cache (``kv_cache_mode``) is not supported.
    Arguments as in `family_plan`.

    >>> import fastdist as fd
    >>> fd.nn.plans.flux2()[""].single_blocks
    'single_transformer_blocks'
    """
    return family_plan("flux2", model, mesh, **options)


def hunyuan_video(
    model: Any = None, mesh: Mesh | None = None, **options: Unpack[PlanOptions]
) -> Plan:
    """The context-parallel plan of a diffusers ``HunyuanVideoTransformer3DModel``
    (HunyuanVideo text-to-video): its video tokens split at the first of its
    ``transformer_blocks``; the text tokens (the token refiner ``context_embedder``'s output,
    computed whole) replicated. The double-stream blocks' ``attn`` projects the text with
    ``add_*_proj``, the single-stream blocks' ``attn`` with ``to_q``... after joining it; both
    put the text last (``[the rank's video rows; text]``). The model's attention mask over
    ``[video; text]`` (text padding from ``encoder_attention_mask``) is cut before every block
    to the rank's ``[video rows; text]`` keys and masks them in the joint attention; ``rope``'s
    tables are cut to the rank's positions; ``proj_out``'s output is gathered. Refused with
    ``image_condition_type="token_replace"`` (image-to-video). Gradients as in `sd3`.
    Arguments as in `family_plan`.

    >>> import fastdist as fd
    >>> fd.nn.plans.hunyuan_video()[""].key_mask
    'attention_mask'
    """
    return family_plan("hunyuan_video", model, mesh, **options)


#: diffusers model class name -> its ready plan function
DIT_PLANS: dict[str, Callable[..., Plan]] = {
    DIT_FAMILIES[f.__name__].kind: f
    for f in (wan, ltx_video, sd3, flux, cogvideox, qwen_image, flux2, hunyuan_video)
}

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
    parallelism over ``axis``; `fastdist.nn.plans.registry.plan` picks its tensor x context
    plan, `fastdist.nn.plans.dit_tp.dit_tp`, on a mesh with a ``tp`` axis); refuses what
    `dit_family` refuses."""
    dit_family(model, mesh, axis)
    return DIT_PLANS[type(model).__name__](model, mesh, axis=axis)


def dit_family(model: nn.Module, mesh: Mesh | None, axis: str = "sp") -> str:
    """The name of a diffusers DiT's ready plan (and `DIT_FAMILIES` row), e.g. ``"wan"``;
    refuses one without a ready plan, naming those that exist, and a mesh without ``axis``."""
    kind = type(model).__name__
    joint = any(getattr(m, "add_q_proj", None) is not None for m in model.modules())
    if kind not in DIT_PLANS and joint:
        raise ParallelizeError(
            f"plans.auto: {kind} is a diffusers transformer with joint text-image attention "
            "(the text tokens join the image tokens inside each attention, MM-DiT) without a "
            "ready context-parallel plan: joint attention is split for the processors "
            f"{sorted(JOINT_PROCESSORS)} only, and a plan for {kind} (its text order, rotary "
            "embedding, single-stream blocks, masks) is not written. "
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
            "parallelism of a DiT runs with it: heads over 'tp', tokens over 'sp'). Fix: a "
            "mesh with an 'sp' axis, e.g. "
            f"Mesh({{'sp': 2}}), or plan=fastdist.nn.plans.{DIT_PLANS[kind].__name__}(model, "
            "mesh, axis=<the sequence axis>)"
        )
    return DIT_PLANS[kind].__name__
