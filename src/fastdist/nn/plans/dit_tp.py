"""Tensor x context parallelism of a diffusers DiT: the heads (and the FFN's hidden features)
over ``tp``, the tokens over ``sp`` (`ContextParallel`), in one plan entry.

Why one entry (`ContextTensorParallel`, applied to the whole model) and not a plan of
``ContextParallel`` at ``""`` next to ``ColwiseParallel`` entries on the projections:
`parallelize` applies the entries in module order, the model itself first, and
``ContextParallel`` registers the split region's parameters for ``pvary`` on the modules it
finds then; the column- and row-parallel layers put in afterwards would be left out (their
gradients not summed over ``sp``; today that plan fails with a ``KeyError`` inside
`ParallelModel`). This style swaps the projections first, then applies ``ContextParallel``
over the result.

On each rank of ``tp x sp`` (Wan's blocks; `wan_tp`):

==========================================  ==================================================
module                                      on rank (t, s)
==========================================  ==================================================
``attn1``/``attn2`` ``to_q``/``to_k``/      column-parallel: the heads ``t*H/tp ..``
``to_v``                                    (``attn.heads`` set to ``H/tp``)
``norm_q``/``norm_k`` (RMSNorm over all     `WidthRMSNorm`: this rank's columns, the sum of
heads of a token)                           squares summed over ``tp``
``attn1``'s attention                       Ulysses / ring / USP over ``sp`` on the rank's
                                            ``H/tp`` heads (Ulysses: ``sp`` must divide
                                            ``H/tp``)
``to_out.0``                                row-parallel (summed over ``tp``)
``ffn.net.0.proj`` / ``ffn.net.2``          column- / row-parallel
norms, modulation, embeddings, ``proj_out``  replicated over ``tp``
==========================================  ==================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.core.sharding import P
from fastdist.errors import ParallelizeError
from fastdist.nn.plans.family import Plan
from fastdist.nn.state import Layout
from fastdist.nn.styles.base import Style, StyleContext, get_child, swap_child
from fastdist.nn.styles.context import ContextParallel, Mode
from fastdist.nn.styles.linear import ColwiseParallel, RowwiseParallel
from fastdist.ops import psum, pvary

__all__ = ["TP_PROCESSORS", "ContextTensorParallel", "WidthRMSNorm", "wan_tp"]


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


#: attention processors whose forward works on a rank's heads: projections, norms over the width
#: (`WidthRMSNorm`), ``unflatten(2, (attn.heads, -1))``, a rotary embedding per head
#: (``head_dim`` wide: the same on every rank), SDPA, ``to_out``. Not LTX-Video's: it rotates q
#: and k over the whole width (its table would need cutting by ``tp`` columns too)
TP_PROCESSORS = frozenset({"WanAttnProcessor"})


def _is_rms_norm(module: nn.Module | None, width: int) -> bool:
    """A plain ``torch.nn.RMSNorm`` over the last dim of ``width`` features."""
    return type(module) is nn.RMSNorm and tuple(module.normalized_shape) == (width,)


@dataclass(frozen=True)
class ContextTensorParallel(Style):
    """A DiT's tokens over ``context.axis`` (`ContextParallel`) and, in every block, its
    attentions' heads and its FFN's hidden features over ``tp`` (applied to the whole model,
    plan pattern ``""``).

    Args:
        context: the context-parallel style (e.g. ``plans.wan(...)[""]``).
        tp: the tensor-parallel axis.
        attentions: in every block, the diffusers attentions (``to_q``/``to_k``/``to_v``,
            ``to_out.0``, optional ``norm_q``/``norm_k`` RMSNorms over all heads) whose heads are
            split: self- and cross-attentions alike.
        ffn: in every block, ``(column, row)`` linear layers of each FFN (diffusers'
            ``FeedForward``: ``ffn.net.0.proj``, ``ffn.net.2``).

    Refused at ``parallelize`` (naming the module and the fix): heads ``tp`` does not divide;
    with Ulysses, local heads (``H / tp``) ``sp`` does not divide; an attention with image
    projections (``add_k_proj``, Wan image-to-video), fused projections, q/k norms other than
    a plain ``RMSNorm`` over the width; FFN widths ``tp`` does not divide; a ``tp`` axis that is
    one of the context's axes.
    """

    context: ContextParallel = field(default_factory=ContextParallel)
    tp: str = "tp"
    attentions: tuple[str, ...] = ("attn1", "attn2")
    ffn: tuple[tuple[str, str], ...] = (("ffn.net.0.proj", "ffn.net.2"),)

    @property
    def axis(self) -> str:
        """The sequence axis (what `parallelize` records as split by the root style)."""
        return self.context.axis

    def _where(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        blocks = module.get_submodule(self.context.blocks)
        return [
            (f"{self.context.blocks}.{i}", b) for i, b in enumerate(cast(nn.ModuleList, blocks))
        ]

    def _check_attention(self, attn: nn.Module, where: str, mesh: Mesh) -> None:
        kind, n = type(attn).__name__, mesh.axis_size(self.tp)
        processor = type(getattr(attn, "processor", None)).__name__
        if processor not in TP_PROCESSORS:
            raise ParallelizeError(
                f"parallelize: {where!r} ({kind}) runs the processor {processor}; splitting its "
                f"heads over {self.tp!r} is built for {sorted(TP_PROCESSORS)} only (e.g. "
                "LTX-Video's rotates q and k over the width of all heads). Fix: a mesh without "
                f"{self.tp!r} (context parallelism alone), or a style for this processor"
            )
        if getattr(attn, "fused_projections", False):
            raise ParallelizeError(
                f"parallelize: {where!r} ({kind}) has fused projections. Fix: call "
                "unfuse_projections() on the model before parallelize"
            )
        if getattr(attn, "add_k_proj", None) is not None:
            raise ParallelizeError(
                f"parallelize: {where!r} ({kind}) has image projections (add_k_proj: Wan "
                f"image-to-video); splitting them over {self.tp!r} is not built. Fix: a mesh "
                f"without {self.tp!r} (context parallelism alone: plans.wan)"
            )
        heads = getattr(attn, "heads", None)
        if type(heads) is not int or heads % n:
            raise ParallelizeError(
                f"parallelize: {where!r} ({kind}) has {heads} heads, which the {n} ranks of "
                f"{self.tp!r} do not divide. Fix: a {self.tp!r} size that divides {heads}"
            )
        ulysses = self.context.mode != "ring" and where.rpartition(".")[2] in self.context.attention
        u = mesh.axis_size(self.context.axis) if ulysses else 1
        if (heads // n) % u:
            raise ParallelizeError(
                f"parallelize: {where!r} ({kind}) has {heads} heads: {heads // n} per rank of "
                f"{self.tp!r} ({n} ranks), which the {u} ranks of {self.context.axis!r} "
                "(Ulysses) do not divide. Fix: mode='ring' (any head count), or sizes with "
                f"{self.tp!r} x {self.context.axis!r} dividing {heads}"
            )
        for child in ("to_q", "to_k", "to_v"):
            if not isinstance(get_child(attn, child, where), nn.Linear):
                raise ParallelizeError(
                    f"parallelize: {where}.{child} is not an nn.Linear. Fix: a plan for {kind}"
                )
        out = getattr(attn, "to_out", None)
        if not isinstance(out, nn.ModuleList) or not isinstance(out[0], nn.Linear):
            raise ParallelizeError(
                f"parallelize: {where!r} ({kind}) has no to_out[0] nn.Linear (diffusers' output "
                f"projection). Fix: a plan for {kind}"
            )
        for norm, proj in (("norm_q", "to_q"), ("norm_k", "to_k")):
            sub = getattr(attn, norm, None)
            width = cast(nn.Linear, getattr(attn, proj)).out_features
            if sub is not None and not _is_rms_norm(sub, width):
                raise ParallelizeError(
                    f"parallelize: {where}.{norm} ({type(sub).__name__}) is not a torch.nn.RMSNorm "
                    f"over the {width} features of {proj}; splitting its heads over {self.tp!r} "
                    "would change it. Fix: a style for this norm"
                )
        for child in ("to_q", "to_k"):
            ColwiseParallel(self.tp).check(get_child(attn, child, where), f"{where}.{child}", mesh)
        RowwiseParallel(self.tp).check(out[0], f"{where}.to_out.0", mesh)

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        self.context.check(module, name, mesh)
        mesh.axis_indices(self.tp, "ContextTensorParallel")
        ring = self.context.ring_axis
        if self.tp in (self.context.axis, ring):
            raise ParallelizeError(
                f"parallelize: ContextTensorParallel(tp={self.tp!r}) is also an axis of the "
                f"token split ({self.context.axis!r}, ring {ring!r}). Fix: another mesh axis"
            )
        for where, block in self._where(module):
            for rel in self.attentions:
                attn = getattr(block, rel, None)
                if attn is not None:
                    self._check_attention(attn, f"{where}.{rel}", mesh)
            for col, row in self.ffn:
                ColwiseParallel(self.tp).check(block.get_submodule(col), f"{where}.{col}", mesh)
                RowwiseParallel(self.tp).check(block.get_submodule(row), f"{where}.{row}", mesh)

    def _split_attention(self, attn: nn.Module, where: str, ctx: StyleContext) -> None:
        """q/k/v column-parallel by heads, their norms over the split width, ``to_out.0``
        row-parallel, ``heads`` the local count."""
        col = ColwiseParallel(self.tp, input="replicated")
        for child in ("to_q", "to_k", "to_v"):
            swap_child(attn, child, col.apply(getattr(attn, child), f"{where}.{child}", ctx))
        for norm in ("norm_q", "norm_k"):
            sub = getattr(attn, norm, None)
            if sub is None:
                continue
            width = int(sub.normalized_shape[0])
            w = ctx.param(sub.weight, Layout(P(self.tp)), f"{where}.{norm}.weight")
            swap_child(attn, norm, WidthRMSNorm(w, sub.eps, ctx.mesh, self.tp, width))
        out = cast(nn.ModuleList, attn.to_out)
        swap_child(out, "0", RowwiseParallel(self.tp).apply(out[0], f"{where}.to_out.0", ctx))
        attn.heads = cast(int, attn.heads) // ctx.mesh.axis_size(self.tp)  # type: ignore[assignment]

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        self.check(module, name, ctx.mesh)
        for where, block in self._where(module):
            for rel in self.attentions:
                attn = getattr(block, rel, None)
                if attn is not None:
                    self._split_attention(attn, f"{where}.{rel}", ctx)
            for col, row in self.ffn:
                for rel, style in (
                    (col, ColwiseParallel(self.tp, input="replicated")),
                    (row, RowwiseParallel(self.tp)),
                ):
                    parent, _, child = rel.rpartition(".")
                    owner = block.get_submodule(parent) if parent else block
                    new = style.apply(block.get_submodule(rel), f"{where}.{rel}", ctx)
                    swap_child(owner, child, new)
        ctx.axes.append(self.tp)
        # now the split region holds the parallel layers: their parameters are pvary'd over sp
        return self.context.apply(module, name, ctx)

    def unverifiable(self) -> str | None:
        return "it splits the tokens and the heads at once; verify compares one split"


def wan_tp(
    model: Any = None,
    mesh: Mesh | None = None,
    *,
    axis: str = "sp",
    tp: str = "tp",
    mode: Mode = "ulysses",
    ring_axis: str | None = None,
) -> Plan:
    """The plan of a diffusers ``WanTransformer3DModel`` over ``tp`` x ``axis``: every block's
    attentions' heads and FFN over ``tp``, the tokens over ``axis`` (and ``ring_axis``) as in
    `fastdist.nn.plans.wan` (``mode``).

    Args:
        model: the model (or ``None``): only read to refuse one this plan does not fit.
        mesh: the mesh it will run on (``None``: not checked); must have ``axis`` and ``tp``.
        axis: the sequence-parallel axis (for ``"usp"``, the Ulysses one).
        tp: the tensor-parallel axis.
        mode: ``"ulysses"``, ``"ring"`` or ``"usp"``.
        ring_axis: for ``"usp"``: the ring's axis.

    >>> from fastdist.nn.plans.dit_tp import wan_tp
    >>> style = wan_tp(mode="ring")[""]
    >>> style.tp, style.context.axis, style.context.mode
    ('tp', 'sp', 'ring')
    """
    if isinstance(model, nn.Module) and type(model).__name__ != "WanTransformer3DModel":
        raise ParallelizeError(
            f"plans.wan_tp: {type(model).__name__} is not a diffusers WanTransformer3DModel. "
            "Fix: ContextTensorParallel(context=<its ContextParallel>, attentions=..., ffn=...)"
        )
    if mesh is not None:
        for a in (axis, tp, *((ring_axis,) if ring_axis else ())):
            mesh.axis_indices(a, "plans.wan_tp")
    context = ContextParallel(axis=axis, mode=mode, ring_axis=ring_axis)
    return {"": ContextTensorParallel(context=context, tp=tp)}
