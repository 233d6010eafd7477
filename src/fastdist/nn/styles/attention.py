"""Attention styles: `HeadParallelAttention` (the model's own attention forward on this rank's
heads, its per-rank attributes and config patched and checked) and `HeadParams` (a module's own
per-head parameters, split with the heads)."""

from __future__ import annotations

import copy
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.core.sharding import P
from fastdist.errors import ParallelizeError
from fastdist.nn.state import Layout
from fastdist.nn.styles.base import Style, StyleContext, get_child, swap_child
from fastdist.nn.styles.heads import (
    FullWidthRMSNorm,
    FusedRows,
    HeadNormList,
    QkvLayout,
    ReplicatedHeads,
    check_full_width_norm,
    check_head_norm_list,
    qkv_rows,
    rms_eps,
)
from fastdist.nn.styles.linear import ColwiseParallel, RowwiseParallel, linear_parts
from fastdist.nn.styles.regions import PrepareInput, PvaryParams

__all__ = ["HeadParallelAttention", "HeadParams"]


# ---------------------------------------------------------------------------- per-rank attributes
#: attribute / config names holding the query head count, patched to the local count
_Q_HEAD_NAMES = ("num_heads", "num_attention_heads", "n_head", "n_heads")
#: ... the kv head count
_KV_HEAD_NAMES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv")
#: ... query heads per kv head
_GROUP_NAMES = ("num_key_value_groups", "num_kv_groups")
#: integers an attention reads that are never head counts or split widths, even when their value
#: equals one (a layer index, the head dim)
_NOT_COUNTS = frozenset(
    {
        "layer_idx",
        "head_dim",
        "head_size",
        "rotary_ndims",
        "max_position_embeddings",
        "sliding_window",
    }
)


def _reads(cls: type) -> tuple[set[str], set[str]]:
    """(``self.X`` attributes, ``self.config.X`` fields) that ``cls``'s methods other than
    ``__init__`` read, plus ``module.X`` reads of functions in its source file (transformers'
    ``eager_attention_forward(module, ...)``); empty where the source cannot be read."""
    attrs: set[str] = set()
    fields: set[str] = set()
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            break
        for key, fn in vars(klass).items():
            if key == "__init__" or not callable(fn):
                continue
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            fields |= set(re.findall(r"\bself\.config\.(\w+)", src))
            attrs |= set(re.findall(r"\bself\.(\w+)", src))
        try:
            text = inspect.getsource(sys.modules[klass.__module__])
        except (OSError, TypeError, KeyError):
            continue
        attrs |= set(re.findall(r"\bmodule\.(\w+)", text))
        fields |= set(re.findall(r"\bmodule\.config\.(\w+)", text))
    return attrs, fields


@dataclass(frozen=True)
class _PerRank:
    """What an attention module must see on each rank: attribute values and config fields."""

    attrs: dict[str, Any]
    config: dict[str, Any]


@dataclass(frozen=True)
class HeadParallelAttention(Style):
    """An attention module with its heads split over ``axis`` (Megatron/vLLM tensor parallelism).

    The module's own forward runs unchanged on this rank's heads: its input is prepared once
    (``input``), ``q``/``k``/``v`` are column-parallel by heads (or one fused ``qkv`` laid out
    as ``qkv_layout``), ``o`` is row-parallel (``output``). Grouped-query attention: with kv
    heads ``>= n`` both head counts must divide by ``n``; with fewer kv heads than ranks
    (``n % kv == 0``) every rank holds the kv projections whole and uses the head its query
    heads share, as Megatron and vLLM replicate kv heads (a fused ``qkv`` is then held whole
    and each rank projects its heads' rows).

    ``qkv_layout``: ``"concat"`` (``[q | k | v]``: GPT-2's ``c_attn``, Phi-3's ``qkv_proj``),
    ``"per_head"`` (``(heads, 3, head_dim)``: GPT-NeoX's ``query_key_value``) or ``"grouped"``
    (``(kv heads, q per kv + 2, head_dim)``: Falcon's new decoder architecture).

    Per-rank attributes: the forward must see this rank's head counts. Attributes with a
    head-count name (``num_heads``, ``num_key_value_heads``, ``num_kv_heads``,
    ``num_key_value_groups``, ...) holding the whole model's value are set to the local
    value; a ``config`` whose head-count fields the module's methods read
    (``self.config.num_attention_heads``: Phi-3) is replaced by a shallow copy with the local
    values, for this module only (the user's config object and other modules keep theirs).
    ``attrs`` maps further attribute names to what they must be per rank, computed from
    the local head counts and head dim (e.g. GPT-2's ``split_size``). An integer attribute
    the module's methods read whose value is a whole-model head count or split width, and
    that none of these covers, is refused (``ParallelizeError``: name it in ``attrs``, or in
    ``keep`` if it is not a head count).

    ``norms``: child modules with per-head parameters shared by all heads (Qwen3's
    ``q_norm``/``k_norm``), pvary'd. ``full_width_norms``: ``(child, "q" | "k")`` RMSNorms over
    the projection's whole width (OLMo-2): their statistics are summed over ``axis``.
    ``head_norm_lists``: ``(child, "q" | "k")`` lists of one LayerNorm per head (StableLM's
    ``q_layernorm``/``k_layernorm``): each rank applies its heads' norms.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    axis: str = "tp"
    input: Literal["replicated", "sequence"] = "replicated"
    output: Literal["replicated", "sequence"] = "replicated"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    qkv: str | None = None
    attrs: tuple[tuple[str, Callable[[int, int, int], Any]], ...] = ()
    norms: tuple[str, ...] = ()
    seq_dim: int = 1
    qkv_layout: QkvLayout = "concat"
    full_width_norms: tuple[tuple[str, Literal["q", "k"]], ...] = ()
    head_norm_lists: tuple[tuple[str, Literal["q", "k"]], ...] = ()
    keep: tuple[str, ...] = ()
    head_params: tuple[str, ...] = ()

    def local_heads(self, n: int, name: str) -> tuple[int, int]:
        """(query heads, kv heads) on one rank; raises for a layout that does not split."""
        hq, hkv = self.num_heads, self.num_kv_heads
        if hq % n or hq % hkv:
            raise ParallelizeError(
                f"parallelize: attention {name!r} has {hq} query heads and {hkv} kv heads; with "
                f"{n} ranks on {self.axis!r} the query heads "
                f"must divide by {n} and by the kv heads. Fix: a tp size that divides {hq}"
            )
        if hkv >= n and hkv % n == 0:
            return hq // n, hkv // n
        if hkv < n and n % hkv == 0:
            return hq // n, 1
        raise ParallelizeError(
            f"parallelize: attention {name!r} has {hkv} kv heads, which neither divide by the {n} "
            f"ranks of {self.axis!r} nor divide them. "
            f"Fix: a tp size that divides {hkv} or is a multiple of it"
        )

    def _check_shapes(self, module: nn.Module, name: str) -> None:
        """The projections' sizes must be what the head counts say (a plan built from another
        config would split wrongly)."""
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        want = (
            {self.qkv: ("out", q_out + 2 * kv_out)}
            if self.qkv is not None
            else {self.q: ("out", q_out), self.k: ("out", kv_out), self.v: ("out", kv_out)}
        )
        want[self.o] = ("in", q_out)
        for child, (side, size) in want.items():
            _, _, _, inp, out = linear_parts(get_child(module, child, name), f"{name}.{child}")
            if (out if side == "out" else inp) != size:
                raise ParallelizeError(
                    f"parallelize: attention {name!r}: {child} has {out if side == 'out' else inp} "
                    f"{side}put features, but the style's {self.num_heads} query heads, "
                    f"{self.num_kv_heads} kv heads and head_dim {self.head_dim} say {size}. Fix: "
                    "build the plan from this model's own config"
                )

    def per_rank(self, module: nn.Module, name: str, n: int) -> _PerRank:
        """The attribute values and config fields ``module`` must see on each rank; raises for
        an attribute that holds a whole-model head count or width and that nothing covers."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        hl, kl = self.local_heads(n, name)
        known: dict[str, tuple[int, int]] = {}  # name -> (whole-model value, local value)
        known.update({a: (hq, hl) for a in _Q_HEAD_NAMES})
        known.update({a: (hkv, kl) for a in _KV_HEAD_NAMES})
        known.update({a: (hq // hkv, hl // kl) for a in _GROUP_NAMES})
        # whole-model values that differ on a rank -> what they are
        changed: dict[int, str] = {}
        for v, lv, what in (
            (hq, hl, "query heads"),
            (hkv, kl, "kv heads"),
            (hq // hkv, hl // kl, "query heads per kv head"),
            (hq * d, hl * d, "query width (heads x head_dim)"),
            (hkv * d, kl * d, "kv width"),
            ((hq + 2 * hkv) * d, (hl + 2 * kl) * d, "fused q|k|v width"),
        ):
            if v != lv:
                changed.setdefault(v, what)
        given = {attr: fn(hl, kl, d) for attr, fn in self.attrs}
        attrs: dict[str, Any] = {}
        for attr, (whole, local) in known.items():
            value = getattr(module, attr, None)
            if attr in given or type(value) is not int:
                continue
            if value != whole:
                raise ParallelizeError(
                    f"parallelize: attention {name!r} ({type(module).__name__}) has {attr} = "
                    f"{value}, but the style says {whole}. Fix: build the plan from this model's "
                    "own config"
                )
            attrs[attr] = local
        attrs.update(given)
        reads, fields = _reads(type(module))

        def refuse(where: str, attr: str, value: int) -> None:
            raise ParallelizeError(
                f"parallelize: attention {name!r} ({type(module).__name__}) reads {where}{attr} "
                f"= {value}, the whole model's {changed[value]}, which is not what a rank holds "
                f"once the heads are split over the {n} ranks of {self.axis!r}; left as is, the "
                "model would fail or compute something else. Fix: "
                f"HeadParallelAttention(..., attrs=(({attr!r}, lambda hq, hkv, d: ...),)) with "
                f"its per-rank value, or keep=({attr!r},) if it is not a head count or width"
            )

        self._check_children(module, name, n, changed)
        skip = _NOT_COUNTS | set(self.keep) | set(attrs)
        for attr in sorted(reads - skip):
            value = getattr(module, attr, None)
            if type(value) is int and value in changed:
                refuse("self.", attr, value)
        config: dict[str, Any] = {}
        cfg = getattr(module, "config", None)
        if cfg is not None and not isinstance(cfg, nn.Module) and hasattr(cfg, "__dict__"):
            for field_name in sorted(fields - _NOT_COUNTS - set(self.keep)):
                value = getattr(cfg, field_name, None)
                if type(value) is not int:
                    continue
                if field_name in known and value == known[field_name][0]:
                    config[field_name] = known[field_name][1]
                elif value in changed:
                    refuse("self.config.", field_name, value)
            if config:  # the view's head counts agree with each other
                for field_name, (whole, local) in known.items():
                    if type(getattr(cfg, field_name, None)) is int:
                        if getattr(cfg, field_name) == whole and field_name not in self.keep:
                            config.setdefault(field_name, local)
        return _PerRank(attrs, config)

    def _check_children(
        self, module: nn.Module, name: str, n: int, changed: dict[int, str]
    ) -> None:
        """Refuse a child module the style leaves whole that is sized by the whole model's heads:
        a per-head module list (StableLM's ``q_layernorm``), a norm over the whole projection
        width (OLMo-2's ``q_norm``). Left whole, it would fail on a rank's heads or, worse,
        silently use the first heads' parameters on every rank."""
        handled = {self.q, self.k, self.v, self.o, *self.norms}
        handled |= {self.qkv} if self.qkv is not None else set()
        handled |= {c for c, _ in self.full_width_norms} | {c for c, _ in self.head_norm_lists}
        heads = {self.num_kv_heads: "k", self.num_heads: "q"}
        widths = {self.num_kv_heads * self.head_dim: "k", self.num_heads * self.head_dim: "q"}
        for pname, p in module.named_parameters(recurse=False):
            # the module's own per-head parameter (GPT-OSS's attention sinks), left whole
            if pname in self.head_params or pname in self.keep or p.dim() == 0:
                continue
            if p.shape[0] == self.num_heads and self.num_heads in changed:
                raise ParallelizeError(
                    f"parallelize: attention {name!r} ({type(module).__name__}): its own "
                    f"parameter {pname!r} {tuple(p.shape)} has one entry per query head, but each "
                    f"of the {n} ranks of {self.axis!r} holds only some heads; left whole it "
                    "would fail or apply the wrong heads' values. Fix: "
                    f"HeadParallelAttention(..., head_params=({pname!r},)) to split it with the "
                    f"heads, or keep=({pname!r},) if it is not per head"
                )
        for child, sub in module.named_children():
            if child in handled:
                continue
            lists = [len(m) for m in sub.children() if isinstance(m, nn.ModuleList)]
            sizes = [p.shape[0] for p in sub.parameters(recurse=False) if p.dim() == 1]
            per_head = [k for k in lists if k in heads and k in changed]
            full = [k for k in sizes if k in widths and k in changed]
            if per_head:
                which = heads[per_head[0]]
                fix = f"head_norm_lists=(({child!r}, {which!r}),) for one module per head"
            elif full:
                which = widths[full[0]]
                fix = f"full_width_norms=(({child!r}, {which!r}),) for an RMSNorm over the width"
            else:
                continue
            raise ParallelizeError(
                f"parallelize: attention {name!r} ({type(module).__name__}): its child "
                f"{child!r} ({type(sub).__name__}) is sized by the whole model's "
                f"{'query' if which == 'q' else 'kv'} heads, but each of the {n} ranks of "
                f"{self.axis!r} holds only some of them; left whole it would fail or apply "
                f"the wrong heads' parameters. Fix: HeadParallelAttention(..., {fix})"
            )

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        n = mesh.axis_size(self.axis)
        self.local_heads(n, name)
        self._check_shapes(module, name)
        if (
            self.qkv is not None
            and self.qkv_layout == "per_head"
            and (self.num_heads != self.num_kv_heads)
        ):
            raise ParallelizeError(
                f"parallelize: attention {name!r}: qkv_layout='per_head' needs as many kv heads "
                f"as query heads (got {self.num_heads} and {self.num_kv_heads}). Fix: "
                "qkv_layout='grouped' or 'concat'"
            )
        for norm in self.norms:
            get_child(module, norm, name)
        for norm, which in self.full_width_norms:
            heads = self.num_heads if which == "q" else self.num_kv_heads
            check_full_width_norm(
                get_child(module, norm, name), f"{name}.{norm}", heads * self.head_dim
            )
        for norm, which in self.head_norm_lists:
            heads = self.num_heads if which == "q" else self.num_kv_heads
            check_head_norm_list(get_child(module, norm, name), f"{name}.{norm}", heads)
        self.per_rank(module, name, n)

    def _fused(self, module: nn.Module, name: str, ctx: StyleContext, n: int) -> nn.Module:
        """This rank's part of the fused q|k|v projection."""
        assert self.qkv is not None
        sub = get_child(module, self.qkv, name)
        where = f"{name}.{self.qkv}"
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if hkv >= n:  # every rank's rows are one block of the weight
            if self.qkv_layout == "concat":
                parts = (hq * d, hkv * d, hkv * d)
                return ColwiseParallel(self.axis, parts=parts, seq_dim=self.seq_dim).apply(
                    sub, where, ctx
                )
            return ColwiseParallel(self.axis, seq_dim=self.seq_dim).apply(sub, where, ctx)
        hl, kl = self.local_heads(n, name)
        rows = [qkv_rows(self.qkv_layout, hq, hkv, d, n, r, hl, kl) for r in range(n)]
        weight, bias, transposed, _, _ = linear_parts(sub, where)
        return FusedRows(
            ctx.param(weight, Layout(), f"{where}.weight"),  # type: ignore[arg-type]
            ctx.param(bias, Layout(), f"{where}.bias"),
            ctx.mesh,
            self.axis,
            rows,
            transposed,
        )

    def _projections(self, module: nn.Module, name: str, ctx: StyleContext, n: int) -> None:
        """Swap q/k/v (or the fused qkv) for column-parallel ones by heads (kv heads fewer than
        ranks: replicated), and o for a row-parallel one."""
        col = ColwiseParallel(self.axis, seq_dim=self.seq_dim)
        if self.qkv is not None:
            swap_child(module, self.qkv, self._fused(module, name, ctx, n))
        else:
            q = col.apply(get_child(module, self.q, name), f"{name}.{self.q}", ctx)
            swap_child(module, self.q, q)
            for child in (self.k, self.v):
                sub = get_child(module, child, name)
                if self.num_kv_heads >= n:
                    swap_child(module, child, col.apply(sub, f"{name}.{child}", ctx))
                    continue
                weight, bias, transposed, _, _ = linear_parts(sub, f"{name}.{child}")
                heads = ReplicatedHeads(
                    ctx.param(weight, Layout(), f"{name}.{child}.weight"),  # type: ignore[arg-type]
                    ctx.param(bias, Layout(), f"{name}.{child}.bias"),
                    ctx.mesh,
                    self.axis,
                    self.num_kv_heads,
                    transposed,
                )
                swap_child(module, child, heads)
        o = RowwiseParallel(self.axis, self.output, self.seq_dim).apply(
            get_child(module, self.o, name), f"{name}.{self.o}", ctx
        )
        swap_child(module, self.o, o)

    def _head_norms(self, module: nn.Module, name: str, ctx: StyleContext, n: int) -> None:
        """Make the q/k norms work on this rank's heads: shared per-head norms pvary'd, norms over
        the whole width summed over ``axis``, per-head norm lists applied to this rank's heads."""
        hq, hkv = self.local_heads(n, name)
        for norm in self.norms:
            PvaryParams(self.axis).apply(get_child(module, norm, name), f"{name}.{norm}", ctx)
        for norm, which in self.full_width_norms:
            heads = self.num_heads if which == "q" else self.num_kv_heads
            sub = get_child(module, norm, name)
            layout = Layout(P(self.axis)) if heads >= n else Layout()
            full = FullWidthRMSNorm(
                ctx.param(cast(Tensor, sub.weight), layout, f"{name}.{norm}.weight"),  # type: ignore[arg-type]
                cast(float, rms_eps(sub)),
                ctx.mesh,
                self.axis,
                heads * self.head_dim,
                heads,
                self.head_dim,
                layout,
            )
            swap_child(module, norm, full)
        for norm, which in self.head_norm_lists:
            heads, local = (self.num_heads, hq) if which == "q" else (self.num_kv_heads, hkv)
            sub = get_child(module, norm, name)
            norms = cast(nn.ModuleList, sub.norms)
            swap_child(module, norm, HeadNormList(norms, ctx.mesh, self.axis, heads, local))

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        self.check(module, name, ctx.mesh)
        n = ctx.mesh.axis_size(self.axis)
        per_rank = self.per_rank(module, name, n)
        PrepareInput(self.axis, self.input, self.seq_dim).apply(module, name, ctx)
        self._projections(module, name, ctx, n)
        self._head_norms(module, name, ctx, n)
        if self.head_params:
            HeadParams(self.axis, self.head_params).apply(module, name, ctx)
        for attr, value in per_rank.attrs.items():
            setattr(module, attr, value)
        if per_rank.config:
            # a per-rank view: the user's config and the modules sharing it keep theirs
            view = copy.copy(module.config)
            for field_name, value in per_rank.config.items():
                setattr(view, field_name, value)
            module.config = view
        return module


@dataclass(frozen=True)
class HeadParams(Style):
    """Split the module's own per-head parameters (dim 0: one entry per head) over ``axis``, as
    its heads are split (GPT-OSS's attention ``sinks``). `HeadParallelAttention` applies it to
    its ``head_params``.

    >>> import torch, fastdist as fd
    >>> attn = torch.nn.Module()
    >>> attn.sinks = torch.nn.Parameter(torch.arange(4.0))
    >>> pm = fd.nn.parallelize(attn, fd.Mesh({"tp": 2}), {"": HeadParams("tp", ("sinks",))})
    >>> attn.sinks.tolist()                        # [rank, heads / 2]
    [[0.0, 1.0], [2.0, 3.0]]
    """

    axis: str = "tp"
    names: tuple[str, ...] = ("sinks",)

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        n = mesh.axis_size(self.axis)
        for pname in self.names:
            p = getattr(module, pname, None)
            if not isinstance(p, nn.Parameter) or p.dim() == 0:
                raise ParallelizeError(
                    f"parallelize: {name!r} ({type(module).__name__}) has no per-head parameter "
                    f"{pname!r}. Fix: name the module's own per-head parameters"
                )
            if p.shape[0] % n:
                raise ParallelizeError(
                    f"parallelize: {name}.{pname} has {p.shape[0]} heads, not divisible by the "
                    f"{n} ranks of {self.axis!r}. Fix: a {self.axis!r} size that divides "
                    f"{p.shape[0]}"
                )

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        self.check(module, name, ctx.mesh)
        layout = Layout(P(self.axis))
        for pname in self.names:
            where = f"{name}.{pname}" if name else pname
            setattr(module, pname, ctx.param(getattr(module, pname), layout, where))
        # how they split (fastdist.nn.param_layouts reads a module's param_layouts()): an
        # instance attribute, so the model's own class stays as it is
        before = getattr(module, "param_layouts", None)
        own = dict.fromkeys(self.names, layout)

        def param_layouts() -> dict[str, Any]:
            return {**(before() if callable(before) else {}), **own}

        object.__setattr__(module, "param_layouts", param_layouts)
        return module
