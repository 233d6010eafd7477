"""Expert parallelism for transformers' models: `ExpertParallelExperts` (a 3-D-parameter experts
module with its experts over an axis), the `ExpertParallel` style that puts it in place, and
`dropped_counts`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdist.core.binding import rank_binding
from fastdist.core.mesh import Mesh
from fastdist.core.sharding import P
from fastdist.errors import ParallelizeError
from fastdist.nn.moe.routing import (
    ExpertFn,
    Strategy,
    capacity_keep_mask,
    check_capacity_factor,
    check_expert_split,
    expert_capacity,
    moe,
)
from fastdist.nn.state import Layout
from fastdist.nn.styles import Style, StyleContext
from fastdist.ops import (
    all_gather_invariant,
    axis_index,
    local_chunk,
    pvary,
)

__all__ = [
    "ExpertParallel",
    "ExpertParallelExperts",
    "dropped_counts",
]


# ============================================================================ a module for
# transformers' experts
class ExpertParallelExperts(nn.Module):
    """transformers' 3-D-parameter experts module (Mixtral, Qwen2-MoE/Qwen3-MoE, OLMoE) with its
    experts over ``axis``.

    Keeps the parameter names ``gate_up_proj`` (E/ep, 2I/tp, H) and ``down_proj`` (E/ep, H, I/tp)
    (this rank's experts; with ``tp_axis`` each expert's intermediate features split too,
    gate and up each on their own) and the call ``forward(hidden_states (T, H), top_k_index
    (T, k), top_k_weights (T, k)) -> (T, H)``. ``tokens="replicated"``: every rank of the
    ``ep`` group holds the same tokens (attention tensor-parallel or replicated): each rank
    dispatches its ``1/ep`` share and the outputs are all-gathered back (every rank's result
    is the whole layer's); ``"sharded"``: each rank's own tokens (data-parallel attention).
    Layouts transformers stores otherwise (see `ExpertParallel`): ``transposed`` (``(E/ep, H,
    2I/tp)`` and ``(E/ep, I/tp, H)``), ``gate_up_proj_bias`` (E/ep, 2I/tp) and ``down_proj_bias``
    (E/ep, H) (added once, on tp rank 0, before the sum over tp), ``gate_fn``: the model's own
    ``_apply_gate(module, h)`` (GPT-OSS's clamped SwiGLU on interleaved gate/up), called with
    this module (which carries the original's plain attributes, e.g. ``alpha``, ``limit``).

    ``dropped``: after each forward (eager mode), the number of (token, expert) assignments
    that forward dropped (``capacity_factor``; 0 when dropless) among the tokens of this
    rank's output: the whole layer's tokens with ``tokens="replicated"`` (every rank the same
    count), this rank's own with ``"sharded"``. An int64 tensor, 0-d on real ranks and
    ``(world,)`` on simulated ranks (entry ``r``: rank ``r``'s), as results of
    `fastdist.nn.parallelize`'d models are. `dropped_counts` collects them from a model.
    """

    def __init__(
        self,
        gate_up_proj: nn.Parameter,
        down_proj: nn.Parameter,
        act_fn: Callable[[Tensor], Tensor],
        mesh: Mesh,
        axis: str,
        num_experts: int,
        *,
        strategy: Strategy = "all_to_all",
        tp_axis: str | None = None,
        tokens: Literal["replicated", "sharded"] = "replicated",
        capacity_factor: float | None = None,
        capacity: int | None = None,
        layer: str = "experts",
        layouts: dict[str, Any] | None = None,
        gate_up_proj_bias: nn.Parameter | None = None,
        down_proj_bias: nn.Parameter | None = None,
        transposed: bool = False,
        gate_fn: Callable[[Any, Tensor], Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn = gate_up_proj, down_proj, act_fn
        self.gate_up_proj_bias, self.down_proj_bias = gate_up_proj_bias, down_proj_bias
        self.transposed, self._gate_fn = transposed, gate_fn
        self.mesh, self.axis, self.num_experts, self.strategy, self.tp_axis = (
            mesh,
            axis,
            num_experts,
            strategy,
            tp_axis,
        )
        self.tokens, self.capacity_factor, self.capacity, self.layer = (
            tokens,
            capacity_factor,
            capacity,
            layer,
        )
        self._layouts = layouts or {}
        self.dropped: Tensor | None = None  # set by each forward (see the class docstring)

    def param_layouts(self) -> dict[str, Any]:
        return dict(self._layouts)

    def _expert(self, rows: Tensor, e: int) -> Tensor:
        gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)  # (R, I/tp) each
        return F.linear(self.act_fn(gate) * up, self.down_proj[e])  # (R, H): a partial sum over tp

    def _expert_fn(self) -> ExpertFn:
        """This forward's expert: `_expert` for the plain layout, else the model's own gate
        (``_apply_gate``) between projections stored transposed and/or with biases."""
        if self._gate_fn is None and not self.transposed and self.gate_up_proj_bias is None:
            return self._expert
        down_bias: Tensor | None = self.down_proj_bias
        if down_bias is not None and self.tp_axis is not None:
            # the output is a partial sum over tp: the bias once, on tp rank 0 (each tp rank's
            # gradient then summed by the pvary)
            first = axis_index(self.mesh, self.tp_axis) == 0
            down_bias = torch.where(first, pvary(down_bias, self.mesh, self.tp_axis), 0)

        def expert(rows: Tensor, e: int) -> Tensor:
            w1, w2 = self.gate_up_proj[e], self.down_proj[e]
            # (R, 2I/tp): (2I/tp, H) stored as nn.Linear does, or (H, 2I/tp) transposed
            h = rows @ w1 if self.transposed else F.linear(rows, w1)
            if self.gate_up_proj_bias is not None:
                h = h + self.gate_up_proj_bias[e]
            if self._gate_fn is not None:
                h = self._gate_fn(self, h)  # (R, I/tp)
            else:
                gate, up = h.chunk(2, dim=-1)
                h = self.act_fn(gate) * up
            y = h @ w2 if self.transposed else F.linear(h, w2)  # (R, H): a partial sum over tp
            return y + down_bias[e] if down_bias is not None else y

        return expert

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        x, idx, w = hidden_states, top_k_index, top_k_weights
        whole, T = idx, x.shape[0]
        n = self.mesh.axis_size(self.axis)
        if self.tokens == "replicated":
            pad = -T % n
            if pad:  # pad to a multiple of ep with tokens routed nowhere
                x = torch.cat([x, x.new_zeros(pad, x.shape[-1])])  # (T + pad, H)
                idx = torch.cat([idx, idx.new_full((pad, idx.shape[-1]), self.num_experts)])
                w = torch.cat([w, w.new_zeros(pad, w.shape[-1])])
            whole = idx  # (T + pad, k): every rank's share, to count the layer's drops
            # ((T + pad) / ep, ...)
            x, idx, w = (local_chunk(t, self.mesh, self.axis, dim=0) for t in (x, idx, w))
        out, dropped = moe(
            x,
            w,
            idx,
            self._expert_fn(),
            self.mesh,
            self.axis,
            self.num_experts,
            strategy=self.strategy,  # id E (padding): nowhere
            capacity_factor=self.capacity_factor,
            capacity=self.capacity,
            tp_axis=self.tp_axis,
            layer=self.layer,
        )
        if self.tokens == "replicated":
            out = all_gather_invariant(out, self.mesh, self.axis, dim=0)[:T]  # (T, H) on every rank
            # each rank drops within its own share: count every share's drops, no communication
            if self.capacity_factor is not None:
                tl = whole.shape[0] // n
                keep = capacity_keep_mask(
                    whole.reshape(n, tl, -1),
                    self.num_experts,
                    expert_capacity(tl, whole.shape[-1], self.num_experts, self.capacity_factor),
                )
                dropped = (~keep).sum()
        if not torch.compiler.is_compiling():
            self.dropped = _outside(dropped, self.mesh)
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.num_experts} experts over {self.axis!r}, strategy={self.strategy!r}, "
            f"tokens={self.tokens!r}, tp_axis={self.tp_axis!r}"
        )


def _outside(t: Tensor, mesh: Mesh) -> Tensor:
    """A value computed in per-rank code, as code outside the ranks sees it: itself on real ranks;
    ``(world, ...)`` on simulated ranks (the simulation's rank dimension taken out of the vmapped
    tensor, so it outlives the call)."""
    t = t.detach()
    if mesh.backend is not None:
        return t.clone()
    binding = rank_binding("moe", mesh)
    if binding is None:  # a one-rank mesh, not simulated
        return t.expand(1, *t.shape).clone()
    ft: Any = torch._C._functorch
    level = ft.maybe_get_level(binding.rank)
    while (
        lv := ft.maybe_get_level(t)
    ) is not None and lv > level:  # a torch.func wrapper inside the simulation
        t = ft.get_unwrapped(t)
    if ft.maybe_get_level(t) == level and ft.is_batchedtensor(t):
        phys: Tensor = ft.get_unwrapped(t)
        return phys.movedim(ft.maybe_get_bdim(t), 0).clone()  # (world, ...)
    return t.expand(mesh.size, *t.shape).clone()  # not rank-varying: the same on every rank


def dropped_counts(model: nn.Module) -> dict[str, Tensor]:
    """Every `ExpertParallelExperts` layer's drop count from its last forward, by module name (see
    its ``dropped``).

    Args:
        model: a model holding `ExpertParallelExperts` layers (any module: ``{}``).

    Returns:
        each layer's drop count from its last forward, by module name.

    >>> import torch
    >>> dropped_counts(torch.nn.Linear(2, 2))
    {}
    """
    return {
        name: m.dropped
        for name, m in model.named_modules()
        if isinstance(m, ExpertParallelExperts) and m.dropped is not None
    }


class _ExpertsLayout(NamedTuple):
    """What `ExpertParallel` reads from a transformers experts module."""

    gate_up: Tensor
    down: Tensor
    gate_up_bias: Tensor | None
    down_bias: Tensor | None
    transposed: bool  # (E, H, 2I) and (E, I, H), as GPT-OSS stores them
    concatenated: bool  # gate | up side by side (else interleaved: gate_up[..., ::2] is the gate)
    num_experts: int
    inter: int
    gate_fn: Callable[[Any, Tensor], Tensor] | None


@dataclass(frozen=True)
class ExpertParallel(Style):
    """A `fastdist.nn.parallelize` style for transformers' 3-D-parameter experts module
    (``MixtralExperts`` and its kin): the experts over ``axis``, each expert's intermediate
    features over ``tp_axis`` (gate and up each split).

    The module becomes an `ExpertParallelExperts` (same parameter names, same call); the
    router stays the model's own (replicated), so routing, ``router_logits`` and the model's
    auxiliary loss are what one device computes. ``strategy``, ``capacity_factor``,
    ``capacity``: see `moe`; ``tokens``: see `ExpertParallelExperts`.

    Layouts (transformers' flags on the experts class): gate and up concatenated
    (``gate_up_proj`` (E, 2I, H): Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3) or interleaved,
    stored transposed (``(E, H, 2I)`` / ``(E, I, H)``) and with biases
    (``gate_up_proj_bias`` (E, 2I), ``down_proj_bias`` (E, H)): GPT-OSS. The gating between
    the projections is the class's own ``_apply_gate`` where it has one (it must act feature
    by feature, as transformers' default and GPT-OSS's clamped SwiGLU do), else
    ``act_fn(gate) * up``. Over ``tp_axis`` an interleaved ``gate_up_proj`` splits into
    contiguous column blocks (each holds whole (gate, up) pairs) and ``down_proj_bias`` is
    added once, on tp rank 0, before the sum over tp.

    Args:
        axis: the mesh axis the experts are split over.
        strategy: ``"all_to_all"`` (tokens travel to their experts' ranks) or ``"allgather"`` (every
            rank gets every token), as in `dispatch`.
        tp_axis: an axis each expert's intermediate features are split over (gate and up each
            split); ``None``: whole experts.
        tokens: ``"replicated"`` (every rank of the ep group holds the same tokens) or ``"sharded"``
            (each rank its own), as in `ExpertParallelExperts`.
        capacity_factor: drop assignments past ``expert_capacity(T, k, E, capacity_factor)`` per
            expert on each rank; ``None``: dropless.
        capacity: the ``all_to_all`` receive buffer rows (see `dispatch`).
    """

    axis: str = "ep"
    strategy: Strategy = "all_to_all"
    tp_axis: str | None = None
    tokens: Literal["replicated", "sharded"] = "replicated"
    capacity_factor: float | None = None
    capacity: int | None = None

    def _layout(self, module: nn.Module, name: str, mesh: Mesh) -> _ExpertsLayout:
        gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        kind = type(module).__name__
        if not (isinstance(gu, Tensor) and isinstance(dn, Tensor) and gu.dim() == dn.dim() == 3):
            raise ParallelizeError(
                f"parallelize: {name!r} ({kind}) is not a 3-D-parameter experts "
                "module (gate_up_proj (E, 2I, H), down_proj (E, H, I)). Fix: "
                "apply ExpertParallel to the experts module (e.g. 'model.layers.*.mlp.experts')"
            )
        if not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False):
            raise ParallelizeError(
                f"parallelize: {name!r} ({kind}) has experts without a gate (up_proj and an "
                "activation) or with a norm after each expert; ExpertParallel implements gated "
                "experts (gate_up_proj) only. Fix: keep this module replicated (no plan entry) "
                "or write a style for this layout"
            )
        transposed = bool(getattr(module, "is_transposed", False))
        concatenated = bool(getattr(module, "is_concatenated", True))
        gb, db = getattr(module, "gate_up_proj_bias", None), getattr(module, "down_proj_bias", None)
        has_bias = getattr(module, "has_bias", None)
        if has_bias is None:
            has_bias = isinstance(gb, Tensor) or isinstance(db, Tensor)
        if has_bias and not (isinstance(gb, Tensor) and isinstance(db, Tensor)):
            raise ParallelizeError(
                f"parallelize: {name!r} ({kind}) says it has biases but lacks gate_up_proj_bias "
                "or down_proj_bias. Fix: write a style for this layout"
            )
        E = int(gu.shape[0])
        # (E, H, 2I) transposed, else (E, 2I, H)
        H, I2 = (
            (int(gu.shape[1]), int(gu.shape[2]))
            if transposed
            else (
                int(gu.shape[2]),
                int(gu.shape[1]),
            )
        )
        want_dn = (E, I2 // 2, H) if transposed else (E, H, I2 // 2)
        want_bias = ((E, I2), (E, H))
        if (
            I2 % 2
            or tuple(dn.shape) != want_dn
            or (has_bias and (tuple(gb.shape), tuple(db.shape)) != want_bias)  # type: ignore[union-attr]
        ):
            raise ParallelizeError(
                f"parallelize: {name!r} ({kind}): gate_up_proj {tuple(gu.shape)} and down_proj "
                f"{tuple(dn.shape)} (transposed={transposed}, biases={bool(has_bias)}) are not "
                "the shapes of gated experts (down_proj should be "
                f"{want_dn}). Fix: write a style for this layout"
            )
        gate_fn = getattr(type(module), "_apply_gate", None)
        if gate_fn is None and not callable(getattr(module, "act_fn", None)):
            raise ParallelizeError(
                f"parallelize: {name!r} ({kind}) has neither an _apply_gate method nor an act_fn, "
                "so the gating between its projections is unknown. Fix: write a style for this "
                "layout"
            )
        check_expert_split(name, E, mesh, self.axis)
        check_capacity_factor(name, self.capacity_factor)
        inter = I2 // 2
        n_tp = mesh.axis_size(self.tp_axis) if self.tp_axis else 1
        if inter % n_tp:
            raise ParallelizeError(
                f"parallelize: {name!r} has experts of {inter} intermediate features, not "
                f"divisible by the {n_tp} ranks "
                f"of {self.tp_axis!r}. Fix: another tp size, or tp_axis=None"
            )
        return _ExpertsLayout(
            gu,
            dn,
            gb if has_bias else None,
            db if has_bias else None,
            transposed,
            concatenated,
            E,
            inter,
            gate_fn,  # the class's own, even on the plain layout (it may not be act(gate) * up)
        )

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        self._layout(module, name, mesh)

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        lay = self._layout(module, name, ctx.mesh)
        tp, inter = self.tp_axis, lay.inter
        parts: tuple[int, ...] = (inter, inter) if lay.concatenated and tp else ()
        feat = 2 if lay.transposed else 1  # the dim of gate_up_proj holding the 2I features
        gu_spec: list[str | None] = [self.axis, None, None]
        gu_spec[feat] = tp
        dn_spec: list[str | None] = [self.axis, None, None]
        dn_spec[1 if lay.transposed else 2] = tp
        layouts: dict[str, Any] = {
            "gate_up_proj": Layout(P(*gu_spec), parts=parts, at=feat if parts else None),
            "down_proj": Layout(P(*dn_spec)),
        }
        if lay.gate_up_bias is not None:
            layouts["gate_up_proj_bias"] = Layout(
                P(self.axis, tp), parts=parts, at=1 if parts else None
            )
            layouts["down_proj_bias"] = Layout(P(self.axis))
        new = ExpertParallelExperts(
            ctx.param(lay.gate_up, layouts["gate_up_proj"], f"{name}.gate_up_proj"),  # type: ignore[arg-type]
            ctx.param(lay.down, layouts["down_proj"], f"{name}.down_proj"),  # type: ignore[arg-type]
            getattr(module, "act_fn", None),  # type: ignore[arg-type]
            ctx.mesh,
            self.axis,
            lay.num_experts,
            strategy=self.strategy,
            tp_axis=tp,
            tokens=self.tokens,
            capacity_factor=self.capacity_factor,
            capacity=self.capacity,
            layer=name,
            layouts=layouts,
            gate_up_proj_bias=ctx.param(
                lay.gate_up_bias,
                layouts.get("gate_up_proj_bias", Layout()),
                f"{name}.gate_up_proj_bias",
            ),
            down_proj_bias=ctx.param(
                lay.down_bias, layouts.get("down_proj_bias", Layout()), f"{name}.down_proj_bias"
            ),
            transposed=lay.transposed,
            gate_fn=lay.gate_fn,
        )
        # the model's own gate may read plain attributes of its module (GPT-OSS: alpha, limit)
        for key, value in vars(module).items():
            if (
                not key.startswith("_")
                and key != "training"
                and key not in vars(new)
                and not isinstance(value, (Tensor, nn.Module))
            ):
                setattr(new, key, value)
        return new
