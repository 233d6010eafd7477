"""Tensor x context parallelism of a diffusers DiT: the heads (and the MLPs' hidden features)
over ``tp``, the tokens over ``sp`` (`ContextParallel`), in one plan entry, for every family of
`fastdist.nn.plans.dit.DIT_FAMILIES`: `dit_tp` reads the family's `TpSplit` records (which
attentions' heads, which layers column- and row-parallel, the fused layers' parts) and builds
one `ContextTensorParallel`; `wan_tp` is `dit_tp("wan")`.

Why one entry (`ContextTensorParallel`, applied to the whole model) and not a plan of
``ContextParallel`` at ``""`` next to ``ColwiseParallel`` entries on the projections:
`parallelize` applies the entries in module order, the model itself first, and
``ContextParallel`` registers the split region's parameters for ``pvary`` on the modules it
finds then; the column- and row-parallel layers put in afterwards would be left out (their
gradients not summed over ``sp``; `parallelize` refuses that plan). This style swaps the
projections first, then applies ``ContextParallel`` over the result.

On each rank of ``tp x sp``, in every block of each `TpSplit`:

==========================================  ==================================================
module                                      on rank (t, s)
==========================================  ==================================================
q/k/v projections (``to_q``... and the      column-parallel: the heads ``t*H/tp ..``
text stream's ``add_*_proj``; fused ones    (`LOCAL_COUNTS`: ``attn.heads`` set to ``H/tp``,
by parts)                                   ``inner_dim``... to the rank's share)
q/k norms over one head                     as they are; their gradients summed over ``tp``
q/k RMSNorm over all heads (Wan, LTX)       `WidthRMSNorm`: this rank's columns, the sum of
                                            squares summed over ``tp``
rotary tables over all heads (LTX)          cut to this rank's columns (``rotary``)
the attention (self or joint)               Ulysses / ring / USP over ``sp`` on the rank's
                                            ``H/tp`` heads of both streams (Ulysses: ``sp``
                                            must divide ``H/tp``)
``to_out.0``, ``to_add_out``                row-parallel (summed over ``tp``)
MLP up (gate) / down                        column- / row-parallel (fused parts each split)
norms, modulation, embeddings, ``proj_out``  replicated over ``tp``
==========================================  ==================================================
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Unpack, cast

import torch
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.core.sharding import P
from fastdist.errors import ParallelizeError
from fastdist.nn.plans.dit import DIT_FAMILIES, DitFamily, PlanOptions, TpSplit, family_plan
from fastdist.nn.plans.family import Plan
from fastdist.nn.state import Layout
from fastdist.nn.styles.base import Style, StyleContext, swap_child
from fastdist.nn.styles.context import ContextParallel
from fastdist.nn.styles.context_recompute import SplitRotary
from fastdist.nn.styles.linear import ColwiseParallel, ParallelLinear, RowwiseParallel
from fastdist.ops import local_chunk, psum, pvary

__all__ = [
    "LOCAL_COUNTS",
    "TP_PROCESSORS",
    "WIDTH_ROTARY_PROCESSORS",
    "ContextTensorParallel",
    "WidthRMSNorm",
    "dit_tp",
    "wan_tp",
]


class WidthRMSNorm(nn.Module):
    """``torch.nn.RMSNorm`` over a projection's whole width (all heads of a token, Wan's
    ``norm_q``/``norm_k``) on this rank's columns: the sum of squares is summed over ``axis``.
    Computed in the input's dtype (float32 for half types), as torch's does.

    Args:
        weight: this rank's columns of the norm's weight (or ``None``: no affine weight).
        eps: the norm's eps (``None``: the dtype's machine epsilon, as torch's).
        mesh: the mesh.
        axis: the axis the columns are split over.
        width: the whole width (all ranks' columns).
    """

    def __init__(
        self, weight: nn.Parameter | None, eps: float | None, mesh: Mesh, axis: str, width: int
    ) -> None:
        super().__init__()
        self.weight, self.eps, self.mesh, self.axis, self.width = weight, eps, mesh, axis, width

    def param_layouts(self) -> dict[str, Layout]:
        return {"weight": Layout(P(self.axis))} if self.weight is not None else {}

    def forward(self, x: Tensor) -> Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        h = x.to(dtype)  # (..., width / n)
        ss = h.pow(2).sum(-1, keepdim=True)  # (..., 1): my columns' share
        total = pvary(psum(ss, self.mesh, self.axis), self.mesh, self.axis)  # (..., 1)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        y = (h * torch.rsqrt(total / self.width + eps)).to(x.dtype)
        return y * self.weight if self.weight is not None else y

    def extra_repr(self) -> str:
        return f"width={self.width} over {self.axis!r}, eps={self.eps}"


#: attention processors whose forward works on a rank's heads: projections, norms over one head
#: (or over the width: `WidthRMSNorm`), a reshape by the head count or the head width, a rotary
#: embedding per head (``head_dim`` wide: the same on every rank), the attention, the output
#: projection
TP_PROCESSORS = frozenset(
    {
        "WanAttnProcessor",
        "JointAttnProcessor2_0",  # SD3
        "FluxAttnProcessor",
        "Flux2AttnProcessor",
        "Flux2ParallelSelfAttnProcessor",
        "CogVideoXAttnProcessor2_0",
        "QwenDoubleStreamAttnProcessor2_0",
        "HunyuanVideoAttnProcessor2_0",
    }
)

#: processors that rotate q and k with tables over the width of all heads (LTX-Video's), known
#: where `ContextTensorParallel` cuts those tables to the rank's columns (its ``rotary``)
WIDTH_ROTARY_PROCESSORS = frozenset({"LTXVideoAttnProcessor"})

#: a diffusers attention's attributes that count features of all its heads (the processors
#: reshape by them: Qwen-Image's ``inner_dim // heads``, Flux 2's ``inner_dim`` :
#: ``mlp_hidden_dim`` ratio): set to the rank's share. ``head_dim`` stays.
LOCAL_COUNTS = (
    "heads",
    "inner_dim",
    "inner_kv_dim",
    "kv_inner_dim",
    "mlp_hidden_dim",
    "sliceable_head_dim",
)


def _find(block: nn.Module, path: str) -> nn.Module | None:
    """``block``'s submodule at ``path``, or ``None`` where it has none (or holds ``None``)."""
    try:
        return block.get_submodule(path)
    except AttributeError:
        return None


def _norm_width(norm: nn.Module) -> int | None:
    """The features a norm module normalizes over (torch's or diffusers' norms), or ``None``."""
    shape = getattr(norm, "normalized_shape", None) or getattr(norm, "dim", None)
    if isinstance(shape, int):
        return shape
    if isinstance(shape, tuple) and len(shape) == 1 and isinstance(shape[0], int):
        return shape[0]
    return None


def _head_dim(attn: nn.Module, where: str) -> int:
    """One head's width: the attention's ``head_dim``, else ``inner_dim // heads``."""
    width, inner = getattr(attn, "head_dim", None), getattr(attn, "inner_dim", None)
    if type(width) is int:
        return width
    if type(inner) is not int:
        raise ParallelizeError(
            f"parallelize: {where!r} ({type(attn).__name__}) has neither head_dim nor inner_dim "
            "(diffusers' attentions have one): its heads' width is unknown. Fix: a style for "
            "this attention class"
        )
    return inner // cast(int, attn.heads)


def _width_norms(attn: nn.Module, where: str, tp: str) -> list[str]:
    """The names of the attention's norms (its children of a ``*Norm*`` class, whatever their
    names) over all heads' features (``torch.nn.RMSNorm``, Wan's); norms over one head
    (``head_dim`` wide) stay; any other norm is refused."""
    head, heads = _head_dim(attn, where), cast(int, attn.heads)
    wide = []
    for name, sub in attn.named_children():
        if "Norm" not in type(sub).__name__:  # LayerNorm, RMSNorm, FP32LayerNorm, GroupNorm...
            continue
        width = _norm_width(sub)
        if width == head:
            continue  # applied to each head on its own: the same on a rank's heads
        if type(sub) is nn.RMSNorm and width == head * heads:
            wide.append(name)
            continue
        raise ParallelizeError(
            f"parallelize: {where}.{name} ({type(sub).__name__}) normalizes {width} features: "
            f"neither one head ({head}) nor a torch.nn.RMSNorm over all {heads} heads; split "
            f"over {tp!r} by heads it would change. Fix: a mesh without {tp!r} (context "
            "parallelism alone), or a style for this norm"
        )
    return wide


def _inside_split_attention(block: nn.Module, split: TpSplit, path: str, where: str) -> None:
    """A linear layer inside a diffusers attention (a module with a ``processor``) is split only
    with that attention's heads: left at all heads' count, its processor would reshape a rank's
    columns into the wrong heads."""
    parts = path.split(".")
    for i in range(1, len(parts)):
        rel = ".".join(parts[:i])
        if hasattr(_find(block, rel), "processor") and rel not in split.attentions:
            raise ParallelizeError(
                f"parallelize: {where}.{path} is split over tensor parallelism inside the "
                f"attention {where}.{rel}, whose heads the split does not name (TpSplit("
                f"{split.blocks!r}).attentions); its processor would reshape the rank's columns "
                f"by all heads. Fix: add {rel!r} to the attentions, or leave {path!r} out"
            )


def _cut_columns(
    mesh: Mesh, axis: str, widths: set[int], where: str, module: nn.Module, args: Any, out: Any
) -> Any:
    """Forward hook of a rotary module whose tables span the width of all heads: each table
    cut to this rank's columns over ``axis`` (its heads'), the token split it carries kept."""
    tables = out if isinstance(out, tuple) else (out,)
    for t in tables:
        if not isinstance(t, Tensor) or t.shape[-1] not in widths:
            raise ParallelizeError(
                f"ContextTensorParallel(rotary={where!r}): its output "
                f"{getattr(t, 'shape', type(t).__name__)} is not a table over the width of all "
                f"heads ({sorted(widths)}), which the rank's heads' columns are cut from. Fix: "
                "rotary=None for tables per head"
            )
    cut = tuple(local_chunk(t, mesh, axis, dim=-1) for t in tables)
    if isinstance(out, SplitRotary):
        return SplitRotary(cut, out.split)
    return cut if isinstance(out, tuple) else cut[0]


def _parts(block: nn.Module, split: TpSplit, where: str) -> dict[str, tuple[int, ...]]:
    """The fused layers' part sizes, read from the block (before any split)."""
    out = {}
    for path, sizes in split.parts:
        if _find(block, path) is None:
            continue
        values = []
        for attr in sizes:
            obj: Any = block
            for a in attr.split("."):
                obj = getattr(obj, a, None)
            if type(obj) is not int:
                raise ParallelizeError(
                    f"parallelize: {where}: the part size {attr!r} of {path!r} is {obj!r}, not "
                    "an int. Fix: the TpSplit's parts name the block's attributes"
                )
            values.append(obj)
        out[path] = tuple(values)
    return out


@dataclass(frozen=True)
class ContextTensorParallel(Style):
    """A DiT's tokens over ``context.axis`` (`ContextParallel`) and, in every block, its
    attentions' heads and its MLPs' hidden features over ``tp`` (applied to the whole model,
    plan pattern ``""``).

    Args:
        context: the context-parallel style (e.g. ``plans.wan(...)[""]``).
        tp: the tensor-parallel axis.
        split: where each list of blocks is split (`fastdist.nn.plans.dit.TpSplit`: the
            attentions whose heads are split, the column- and row-parallel linear layers, the
            fused ones' parts); default: Wan's.
        rotary: the module whose rotary tables (its tensor outputs) span the width of all heads
            (LTX-Video's ``rope``): after the context's cut to the rank's tokens, cut to the
            rank's columns over ``tp`` (``None``: the tables are per head, as every other
            family's); then `WIDTH_ROTARY_PROCESSORS` are split too.

    Refused at ``parallelize`` (naming the module and the fix): an attention whose processor is
    not in `TP_PROCESSORS`, with fused projections, with an ``nn.Linear`` the split does not
    name, or with a norm neither over one head nor a ``torch.nn.RMSNorm`` over all heads; heads
    ``tp`` does not divide; with Ulysses, local heads (``H / tp``) the sequence axis does not
    divide; linear widths (or fused parts) ``tp`` does not divide; a ``tp`` axis that is one of
    the context's axes.
    """

    context: ContextParallel = field(default_factory=ContextParallel)
    tp: str = "tp"
    split: tuple[TpSplit, ...] = DIT_FAMILIES["wan"].tp
    rotary: str | None = None

    @property
    def axis(self) -> str:
        """The sequence axis (what `parallelize` records as split by the root style)."""
        return self.context.axis

    def _where(self, module: nn.Module) -> list[tuple[TpSplit, str, nn.Module]]:
        """(its split, its name, the block) of every block of every split list."""
        found = []
        for split in self.split:
            blocks = _find(module, split.blocks)
            if not isinstance(blocks, nn.ModuleList):
                raise ParallelizeError(
                    f"parallelize: ContextTensorParallel splits the blocks {split.blocks!r}, "
                    f"which {type(module).__name__} does not hold as an nn.ModuleList. Fix: the "
                    "TpSplit of this model's blocks"
                )
            found += [(split, f"{split.blocks}.{i}", b) for i, b in enumerate(blocks)]
        return found

    def _check_heads(self, attn: nn.Module, rel: str, where: str, mesh: Mesh) -> None:
        kind, n = type(attn).__name__, mesh.axis_size(self.tp)
        heads = getattr(attn, "heads", None)
        if type(heads) is not int or heads % n:
            raise ParallelizeError(
                f"parallelize: {where!r} ({kind}) has {heads} heads, which the {n} ranks of "
                f"{self.tp!r} do not divide. Fix: a {self.tp!r} size that divides {heads}"
            )
        ulysses = self.context.mode != "ring" and rel not in self.context.cross
        u = mesh.axis_size(self.context.axis) if ulysses else 1
        if (heads // n) % u:
            raise ParallelizeError(
                f"parallelize: {where!r} ({kind}) has {heads} heads: {heads // n} per rank of "
                f"{self.tp!r} ({n} ranks), which the {u} ranks of {self.context.axis!r} "
                "(Ulysses) do not divide. Fix: mode='ring' (any head count), or sizes with "
                f"{self.tp!r} x {self.context.axis!r} dividing {heads}"
            )
        for count in LOCAL_COUNTS[1:]:
            value = getattr(attn, count, None)
            if type(value) is int and value % n:
                raise ParallelizeError(
                    f"parallelize: {where!r} ({kind}) has {count}={value}, which the {n} ranks "
                    f"of {self.tp!r} do not divide. Fix: a {self.tp!r} size that divides it"
                )

    def _check_attention(
        self, attn: nn.Module, split: TpSplit, rel: str, where: str, mesh: Mesh
    ) -> None:
        kind = type(attn).__name__
        processor = type(getattr(attn, "processor", None)).__name__
        if processor in WIDTH_ROTARY_PROCESSORS and self.rotary is None:
            raise ParallelizeError(
                f"parallelize: {where!r} ({kind}) runs the processor {processor}, which rotates "
                f"q and k with tables over the width of all heads; split over {self.tp!r}, the "
                "tables must be cut to the rank's columns. Fix: ContextTensorParallel(rotary="
                "<the module making the tables>), as plans.dit_tp.dit_tp('ltx_video') does"
            )
        if processor not in TP_PROCESSORS | WIDTH_ROTARY_PROCESSORS:
            raise ParallelizeError(
                f"parallelize: {where!r} ({kind}) runs the processor {processor}; splitting its "
                f"heads over {self.tp!r} is built for {sorted(TP_PROCESSORS)} (and, with their "
                f"rotary tables cut, {sorted(WIDTH_ROTARY_PROCESSORS)}) only. Fix: a mesh "
                f"without {self.tp!r} (context parallelism alone), or a style for this processor"
            )
        if getattr(attn, "fused_projections", False):
            raise ParallelizeError(
                f"parallelize: {where!r} ({kind}) has fused projections. Fix: call "
                "unfuse_projections() on the model before parallelize"
            )
        self._check_heads(attn, rel, where, mesh)
        named = set(split.column) | set(split.row)
        for name, sub in attn.named_modules():
            if isinstance(sub, nn.Linear) and f"{rel}.{name}" not in named:
                raise ParallelizeError(
                    f"parallelize: {where}.{name} is a linear layer of an attention whose heads "
                    f"are split over {self.tp!r}, but the split names it neither column- nor "
                    f"row-parallel (e.g. Wan image-to-video's add_k_proj); left whole it would "
                    f"meet a rank's heads. Fix: add {rel}.{name} to the TpSplit of "
                    f"{split.blocks!r}"
                )
        _width_norms(attn, where, self.tp)

    def _linears(
        self, block: nn.Module, split: TpSplit, where: str
    ) -> list[tuple[str, nn.Module, Style]]:
        """(path, layer, its style) of the block's column- and row-parallel layers."""
        parts = _parts(block, split, where)
        out: list[tuple[str, nn.Module, Style]] = []
        for paths, row in ((split.column, False), (split.row, True)):
            for path in paths:
                layer = _find(block, path)
                if layer is None:
                    continue
                p = parts.get(path, ())
                style: Style = (
                    RowwiseParallel(self.tp, parts=p)
                    if row
                    else ColwiseParallel(self.tp, input="replicated", parts=p)
                )
                out.append((path, layer, style))
        return out

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        self.context.check(module, name, mesh)
        mesh.axis_indices(self.tp, "ContextTensorParallel")
        ring = self.context.ring_axis
        if self.tp in (self.context.axis, ring):
            raise ParallelizeError(
                f"parallelize: ContextTensorParallel(tp={self.tp!r}) is also an axis of the "
                f"token split ({self.context.axis!r}, ring {ring!r}). Fix: another mesh axis"
            )
        if self.rotary is not None and _find(module, self.rotary) is None:
            raise ParallelizeError(
                f"parallelize: ContextTensorParallel(rotary={self.rotary!r}): "
                f"{type(module).__name__} has no such module. Fix: the module making the "
                "rotary tables"
            )
        for split, where, block in self._where(module):
            for rel in split.attentions:
                attn = _find(block, rel)
                if attn is not None:
                    self._check_attention(attn, split, rel, f"{where}.{rel}", mesh)
            for path, layer, style in self._linears(block, split, where):
                _inside_split_attention(block, split, path, where)
                style.check(layer, f"{where}.{path}", mesh)

    def _split_attention(self, attn: nn.Module, where: str, ctx: StyleContext) -> None:
        """Norms over the width computed over the split width; the head counts the rank's."""
        n = ctx.mesh.axis_size(self.tp)
        for norm in _width_norms(attn, where, self.tp):
            sub = cast(nn.RMSNorm, getattr(attn, norm))
            width = int(sub.normalized_shape[0])
            w = ctx.param(sub.weight, Layout(P(self.tp)), f"{where}.{norm}.weight")
            swap_child(attn, norm, WidthRMSNorm(w, sub.eps, ctx.mesh, self.tp, width))
        for count in LOCAL_COUNTS:
            value = getattr(attn, count, None)
            if type(value) is int:
                setattr(attn, count, value // n)

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        self.check(module, name, ctx.mesh)
        attentions: list[nn.Module] = []
        widths = {
            cast(int, a.heads) * _head_dim(a, f"{w}.{rel}")
            for split, w, b in self._where(module)
            for rel in split.attentions
            if (a := _find(b, rel)) is not None
        }
        for split, where, block in self._where(module):
            linears = self._linears(block, split, where)  # fused parts read before the split
            for rel in split.attentions:
                attn = _find(block, rel)
                if attn is not None:
                    self._split_attention(attn, f"{where}.{rel}", ctx)
                    attentions.append(attn)
            for path, layer, style in linears:
                parent, _, child = path.rpartition(".")
                owner = block.get_submodule(parent) if parent else block
                swap_child(owner, child, style.apply(layer, f"{where}.{path}", ctx))
        ctx.axes.append(self.tp)
        # now the split region holds the parallel layers: their parameters are pvary'd over sp
        out = self.context.apply(module, name, ctx)
        self._pvary_over_tp(attentions, ctx)
        if self.rotary is not None:  # after the context's hook: the tables cut to my tokens
            cut = functools.partial(_cut_columns, ctx.mesh, self.tp, widths, self.rotary)
            module.get_submodule(self.rotary).register_forward_hook(cut)
        return out

    def _pvary_over_tp(self, attentions: list[nn.Module], ctx: StyleContext) -> None:
        """The split attentions' replicated parameters (norms over one head) meet the rank's
        heads: ``pvary`` them over ``tp`` too (with the token split's axes the context gave
        them), so each rank's gradient is summed over its heads' ranks."""
        local = {
            id(m)
            for attn in attentions
            for m in attn.modules()
            if not isinstance(m, (ParallelLinear, WidthRMSNorm))
        }
        done = set()
        for i, (m, p, axis) in enumerate(ctx.pvary):
            if id(m) in local:
                axes = (axis,) if isinstance(axis, str) else tuple(axis)
                ctx.pvary[i] = (m, p, cast(str, (*axes, self.tp)))  # pvary takes a tuple too
                done.add((id(m), p))
        for attn in attentions:  # (the context pvary's every parameter of its blocks)
            for m in attn.modules():
                if id(m) in local:
                    ctx.pvary.extend(
                        (m, p, self.tp)
                        for p, _ in m.named_parameters(recurse=False)
                        if (id(m), p) not in done
                    )

    def unverifiable(self) -> str | None:
        return "it splits the tokens and the heads at once; verify compares one split"


def dit_tp(
    family: str | DitFamily,
    model: Any = None,
    mesh: Mesh | None = None,
    *,
    tp: str = "tp",
    **options: Unpack[PlanOptions],
) -> Plan:
    """The tensor x context plan of a DiT family: its blocks' heads and MLPs over ``tp`` (the
    family's `TpSplit` records), its tokens over ``axis`` (and ``ring_axis``) as its
    context-parallel plan (`fastdist.nn.plans.dit.family_plan`, ``mode``).

    Args:
        family: the family's name in `DIT_FAMILIES` (``"flux"``...) or its record.
        model: the model (or ``None``): only read to refuse one this plan does not fit.
        mesh: the mesh it will run on (``None``: not checked); must have ``axis`` and ``tp``.
        tp: the tensor-parallel axis.
        options: ``axis``, ``mode``, ``ring_axis`` as in `family_plan`.

    >>> style = dit_tp("flux", mode="ring")[""]
    >>> style.tp, style.context.mode, [s.blocks for s in style.split]
    ('tp', 'ring', ['transformer_blocks', 'single_transformer_blocks'])
    """
    fam = DIT_FAMILIES[family] if isinstance(family, str) else family
    where = f"plans.{fam.name}_tp"
    if not fam.tp:
        raise ParallelizeError(
            f"{where}: splitting the heads of a {fam.kind} over {tp!r} is not built: "
            f"{fam.no_tp}. Fix: a mesh without {tp!r}, or plan=fastdist.nn.plans.{fam.name}"
            f"(model, mesh) to run replicated over {tp!r}"
        )
    if mesh is not None:
        mesh.axis_indices(tp, where)
    context = family_plan(fam, model, mesh, **options)[""]
    style = ContextTensorParallel(
        context=cast(ContextParallel, context), tp=tp, split=fam.tp, rotary=fam.tp_rotary
    )
    return {"": style}


def wan_tp(
    model: Any = None, mesh: Mesh | None = None, *, tp: str = "tp", **options: Unpack[PlanOptions]
) -> Plan:
    """`dit_tp` of a diffusers ``WanTransformer3DModel`` (text- and image-to-video): every
    block's attentions' heads and FFN over ``tp``, the tokens over ``axis`` as in
    `fastdist.nn.plans.wan`.

    Args:
        model: the model (or ``None``): only read to refuse one this plan does not fit.
        mesh: the mesh it will run on (``None``: not checked); must have ``axis`` and ``tp``.
        tp: the tensor-parallel axis.
        options: ``axis``, ``mode``, ``ring_axis`` as in `fastdist.nn.plans.dit.family_plan`.

    >>> style = wan_tp(mode="ring")[""]
    >>> style.tp, style.context.axis, style.context.mode
    ('tp', 'sp', 'ring')
    """
    return dit_tp("wan", model, mesh, tp=tp, **options)
