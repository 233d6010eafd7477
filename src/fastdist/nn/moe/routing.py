"""The functional side of expert parallelism: the router (`route`), `dispatch` / `combine`, `moe`
(all of it in one call, with token dropping) and the auxiliary losses. See `fastdist.nn.moe`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from fastdist.core.binding import rank_binding
from fastdist.core.context import routing_policy
from fastdist.core.mesh import Mesh
from fastdist.errors import CollectiveError, MoEError, NoBackendError
from fastdist.ops import (
    all_gather,
    all_to_all,
    axis_index,
    indexed_all_to_all_v,
    psum,
    psum_scatter,
    pvary,
    ragged_all_to_all,
)

__all__ = [
    "Dispatched",
    "MoEOutput",
    "Routing",
    "RoutingPolicy",
    "Strategy",
    "Gating",
    "ExpertFn",
    "combine",
    "dispatch",
    "expert_capacity",
    "load_balancing_loss",
    "moe",
    "route",
    "router_z_loss",
    "check_expert_split",
    "check_capacity_factor",
    "capacity_keep_mask",
]

Strategy = Literal["allgather", "all_to_all"]
Gating = Literal["softmax", "sigmoid"]
ExpertFn = Callable[[Tensor, int], Tensor]


class RoutingPolicy(Protocol):
    """How simulated MoE layers charge a routing whose row counts are data: the declared hook of
    `dispatch` and of the experts' run, installed per thread with
    ``fastdist.core.context.push_routing`` (``fastdist.profile.trace(routing="balanced")`` does).
    With none installed the layers run as written.
    """

    def dispatch(
        self,
        n: int,
        local_experts: int,
        tokens: int,
        k: int,
        num_experts: int,
        capacity: int | None,
        strategy: str,
    ) -> int | None:
        """The ``capacity`` `dispatch` uses over ``n`` ranks (``local_experts`` each) for
        ``tokens`` tokens of ``k`` experts each, given the caller's ``capacity``."""
        ...

    def run_experts(
        self, x: Tensor, assign: Tensor, scale: Tensor | None, expert_fn: ExpertFn
    ) -> Tensor:
        """The local experts' summed output ``(R, H)`` on simulated ranks (see `moe`)."""
        ...


class Routing(NamedTuple):
    """The router's choice for each token: ``weights`` (T, k) gates, ``experts`` (T, k) global
    expert ids, ``probs`` (T, E)."""

    weights: Tensor
    experts: Tensor
    probs: Tensor


class MoEOutput(NamedTuple):
    """`moe`'s result: ``out`` (T, H), and ``dropped``: the number of (token, expert) assignments
    this rank dropped (0-d int64)."""

    out: Tensor
    dropped: Tensor


def _check_k(layer: str, top_k: int, num_experts: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise MoEError(
            f"fastdist MoE layer {layer!r}: top_k={top_k!r} but there are {num_experts} experts; "
            f"each token picks top_k distinct experts. Fix: 1 <= top_k <= {num_experts}"
        )


def check_expert_split(layer: str, num_experts: int, mesh: Mesh, axis: str) -> int:
    """The experts per rank of ``axis``; raises `MoEError` naming ``layer`` when they do not
    split."""
    n = mesh.axis_size(axis)
    if num_experts % n:
        raise MoEError(
            f"fastdist MoE layer {layer!r}: {num_experts} experts do not divide over the {n} "
            f"ranks of {axis!r}. Fix: an {axis!r} "
            f"size that divides {num_experts} (e.g. {math.gcd(num_experts, n)}), or more experts"
        )
    return num_experts // n


# ============================================================================ router
def route(
    logits: Tensor,
    top_k: int,
    *,
    gating: Gating = "softmax",
    normalize: bool = True,
    layer: str = "moe",
) -> Routing:
    """Top-k routing from router logits ``(T, E)``.

    ``gating="softmax"``: probabilities ``softmax(logits)``; ``"sigmoid"``: independent scores
    ``sigmoid(logits)`` (DeepSeek-V3). The ``top_k`` largest are the token's experts; with
    ``normalize`` their gates are divided by their sum (Mixtral; Qwen2-MoE's
    ``norm_topk_prob``), else they are the probabilities themselves. bf16/fp16 logits are
    computed in float32 (as transformers does); float32/float64 stay as they are. Gradient:
    through the selected gates (the selection itself is piecewise constant). No communication:
    call it on each rank's own tokens with a router weight that is ``pvary``'d over the axes
    the tokens are split over.

    Args:
        logits: the router logits ``(T, E)``.
        top_k: the experts per token.
        gating: ``"softmax"`` (probabilities) or ``"sigmoid"`` (independent scores, DeepSeek-V3).
        normalize: divide the top-k gates by their sum.
        layer: the MoE layer's name, for error messages.

    Returns:
        a `Routing`: the ``experts`` ``(T, k)``, their ``weights`` (gates) and the ``probs``.

    >>> import torch, fastdist as fd
    >>> r = fd.nn.moe.route(torch.tensor([[2.0, 0.0, 1.0]]), 2)
    >>> r.experts.tolist(), [round(w, 4) for w in r.weights[0].tolist()]
    ([[0, 2]], [0.7311, 0.2689])
    """
    _check_k(layer, top_k, logits.shape[-1])
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = x.softmax(-1) if gating == "softmax" else torch.sigmoid(x)  # (T, E)
    top, experts = torch.topk(probs, top_k, dim=-1)  # (T, k)
    if normalize:
        top = top / top.sum(-1, keepdim=True)
    return Routing(top, experts, probs)


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments one rank keeps per expert when dropping: ``ceil(capacity_factor * tokens * top_k
    / num_experts)``.

    Args:
        tokens: the tokens on one rank.
        top_k: the experts per token.
        num_experts: the number of experts.
        capacity_factor: the slack over a perfectly balanced load (1.0: exactly balanced).

    Returns:
        ``ceil(capacity_factor * tokens * top_k / num_experts)``.

    >>> expert_capacity(10, 2, 4, 1.0)
    5
    """
    check_capacity_factor("moe", capacity_factor)
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def check_capacity_factor(layer: str, capacity_factor: float | None) -> None:
    """Raise `MoEError` naming ``layer`` unless ``capacity_factor`` is ``None`` (dropless) or a
    finite number > 0. A factor of 0 or below would keep one assignment per expert and drop the
    rest, silently (``None``, not 0, is dropless)."""
    if capacity_factor is None:
        return
    ok = isinstance(capacity_factor, (int, float)) and not isinstance(capacity_factor, bool)
    if not (ok and math.isfinite(capacity_factor) and capacity_factor > 0):
        raise MoEError(
            f"fastdist MoE layer {layer!r}: capacity_factor={capacity_factor!r}; each rank keeps "
            "ceil(capacity_factor * tokens * top_k / experts) assignments per expert, so a factor "
            "of 0 or below would keep 1 per expert and drop the rest. Fix: capacity_factor=None "
            "for a dropless layer, or a finite number > 0 (1.0: an exactly balanced load)"
        )


def capacity_keep_mask(experts: Tensor, num_experts: int, per_expert: int) -> Tensor:
    """(..., T, k) bool: an assignment is kept if fewer than ``per_expert`` earlier ones
    (token-major order, within its own leading index) chose its expert."""
    flat = experts.reshape(*experts.shape[:-2], -1)  # (..., T*k)
    oh = F.one_hot(flat, num_experts + 1)[..., :num_experts]  # (..., T*k, E); id E = nowhere
    pos = (oh.cumsum(-2) * oh).sum(-1) - 1  # (..., T*k) place in its expert's queue (-1: nowhere)
    return (pos < per_expert).reshape(experts.shape)


# ============================================================================ dispatch / combine
@dataclass(frozen=True)
class Dispatched:
    """What `combine` needs to bring expert outputs back (made by `dispatch`; treat as opaque).

    ``row_expert``: (R,) the local expert of every row `dispatch` returned (``E_local`` for an
    empty row). ``tokens``: this rank's token count ``T``.
    """

    strategy: Strategy
    mesh: Mesh
    axis: str
    num_experts: int
    tokens: int
    row_expert: Tensor
    order: Tensor | None = None  # all_to_all: (T*k,) assignment ids sorted by expert
    recv_sizes: Tensor | None = None  # all_to_all: (ep,) rows that came from each source
    experts: Tensor | None = None  # allgather: (ep*T, k) gathered expert ids (E = nowhere)


def _simulated(mesh: Mesh) -> bool:
    """Whether per-rank code on ``mesh`` runs on simulated ranks: a plain mesh, or a real one under
    ``fastdist.simulate`` or ``fastdist.profile.trace`` (they take precedence over the
    communicator; sizes are then static, not read back)."""
    if mesh.backend is None:
        return True
    try:
        return rank_binding("moe", mesh) is not None
    except NoBackendError:
        return False


def _nowhere(experts: Tensor, keep: Tensor | None, num_experts: int) -> Tensor:
    """Expert ids with dropped assignments sent nowhere (id ``num_experts``)."""
    return experts if keep is None else torch.where(keep, experts, num_experts)


def dispatch(
    x: Tensor,
    experts: Tensor,
    mesh: Mesh,
    axis: str,
    num_experts: int,
    *,
    strategy: Strategy = "all_to_all",
    capacity: int | None = None,
    keep: Tensor | None = None,
    layer: str = "moe",
) -> tuple[Tensor, Dispatched]:
    """Send every token to the ranks that own its experts.

    Args:
        x: (T, H) this rank's tokens. experts: (T, k) global expert ids (``route(...).experts``).
        strategy: ``"all_to_all"``: returns the (R, H) rows that arrived for this rank's
            experts, packed by source rank then by expert (R: exactly what arrived on real
            ranks; ``capacity`` on simulated ranks, default ``ep * T * k``; rows past what
            arrived are zeros). ``"allgather"``: returns every rank's tokens (ep*T, H).
        keep: (T, k) bool, optional: assignments to send (the others are dropped).
    Returns ``(rows, handle)``; ``handle.row_expert`` gives the local expert of each row
    (``allgather``: use `moe`'s per-expert masks instead). Gradient: the reverse exchange
    (``all_to_all``) or a reduce-scatter (``allgather``) back into ``x``.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"ep": 2})                         # experts 0, 1 on rank 0; 2, 3 on rank 1
    >>> x = torch.arange(4.0).reshape(2, 2, 1)            # 2 ranks x 2 tokens
    >>> experts = torch.tensor([[[3], [0]], [[2], [2]]])  # top-1
    >>> def send(x, e):
    ...     rows, handle = fd.nn.moe.dispatch(x, e, mesh, "ep", 4, capacity=4)
    ...     return rows, handle.row_expert
    >>> rows, local_expert = fd.simulate(send, mesh)(x, experts)
    >>> # rank 1 receives token 0 of rank 0 and tokens 0, 1 of rank 1
    >>> rows[1, :, 0].tolist(), local_expert[1].tolist()
    ([0.0, 2.0, 3.0, 0.0], [1, 0, 0, 2])
    """
    n = mesh.axis_size(axis)
    el = check_expert_split(layer, num_experts, mesh, axis)
    T, k = experts.shape
    _check_k(layer, k, num_experts)
    policy: RoutingPolicy | None = routing_policy()
    if policy is not None:  # a declared routing policy prices this layer (a profile's trace)
        capacity = policy.dispatch(n, el, T, k, num_experts, capacity, strategy)
    ids = _nowhere(experts, keep, num_experts)  # (T, k)
    if strategy == "allgather":
        xs = all_gather(x, mesh, axis, dim=0)  # (ep*T, H)
        es = all_gather(ids, mesh, axis, dim=0)  # (ep*T, k)
        local = es - axis_index(mesh, axis) * el  # (ep*T, k): my local expert id, or out of [0, el)
        row = torch.where((local >= 0) & (local < el), local, el)
        return xs, Dispatched(strategy, mesh, axis, num_experts, T, row, experts=es)
    if strategy != "all_to_all":
        raise MoEError(
            f"fastdist MoE layer {layer!r}: strategy={strategy!r}. Fix: 'allgather' or 'all_to_all'"
        )
    flat = ids.reshape(-1)  # (T*k,) token-major
    # assignments by expert, hence by destination rank; nowhere last
    order = torch.argsort(flat, stable=True)
    counts = F.one_hot(flat, num_experts + 1)[:, :num_experts].sum(0)  # (E,)
    # (ep, E_local): what I send to each rank, per its local expert
    per_rank = counts.reshape(n, el)
    # (ep, E_local): what each source sends me
    recv_counts = all_to_all(per_rank, mesh, axis, split_dim=0, concat_dim=0)
    simulated = _simulated(mesh)
    if capacity is None:
        # worst case / exact (one host read)
        capacity = n * T * k if simulated else int(recv_counts.sum())
    try:
        rows, recv = indexed_all_to_all_v(
            x, mesh, axis, order // k, per_rank.sum(-1), capacity=capacity
        )  # (C, H), (ep,)
    except CollectiveError as e:
        if "capacity" not in str(e):
            raise
        raise MoEError(
            f"fastdist MoE layer {layer!r}: {e.rank} receives more token assignments than "
            f"capacity={capacity} over {axis!r} "
            f"({'simulated ranks share one static buffer' if simulated else 'real ranks'}). Fix: "
            f"capacity >= {n * T * k} (every assignment to one rank: dropless), leave "
            "capacity=None (the worst case on simulated ranks, exact sizes on real ranks), or "
            "drop tokens with capacity_factor"
        ) from None
    # (ep*E_local,): end of each (source, expert) block in the buffer
    bounds = recv_counts.reshape(-1).cumsum(0)
    t = torch.arange(capacity, device=x.device)  # (C,)
    # (C,): the (source, expert) block of row t
    block = (bounds.unsqueeze(0) <= t.unsqueeze(1)).sum(-1)
    row = torch.where(block < n * el, block % el, el)  # (C,)
    return rows, Dispatched(strategy, mesh, axis, num_experts, T, row, order=order, recv_sizes=recv)


def combine(y: Tensor, handle: Dispatched, weights: Tensor) -> Tensor:
    """Bring expert outputs back to their tokens, in the original order, weighted by the gates.

    ``y``: (R, H) the experts' outputs for `dispatch`'s rows (``all_to_all``; rows of no
    expert are ignored), or (ep*T, H) each gathered token's sum of this rank's experts'
    outputs, already weighted (``allgather``: see `moe`). ``weights``: (T, k) gates
    (dropped assignments contribute nothing). Returns (T, H): ``sum_j w[t, j] * f_{e[t, j]}(x_t)``.
    Gradient: the reverse exchange; the gates get ``<f_e(x_t), g_t>``.

    Args:
        y: the experts' outputs for `dispatch`'s rows, ``(R, H)`` (``all_to_all``), or ``(ep*T, H)``
            each gathered token's weighted sum of this rank's experts (``allgather``).
        handle: what `dispatch` returned with the rows.
        weights: the gates ``(T, k)``; dropped assignments contribute nothing.

    Returns:
        ``(T, H)``: ``sum_j w[t, j] * f_{e[t, j]}(x_t)`` for each token.
    """
    d = handle
    if d.strategy == "allgather":
        # (T, H): my tokens, summed over the ranks' experts
        return psum_scatter(y, d.mesh, d.axis, dim=0)
    assert d.order is not None and d.recv_sizes is not None
    T, k = weights.shape
    # (T*k, H) in sorted-assignment order, 0 past the sent rows
    back, _ = ragged_all_to_all(y, d.mesh, d.axis, d.recv_sizes, capacity=T * k)
    w = weights.reshape(-1).index_select(0, d.order).to(back.dtype)  # (T*k,)
    out = back.new_zeros(T, back.shape[-1])  # (T, H)
    return out.index_add(0, d.order // k, back * w.unsqueeze(-1))


def _run_experts(
    x: Tensor, assign: Tensor, scale: Tensor | None, expert_fn: ExpertFn, simulated: bool
) -> Tensor:
    """``sum_e assign[:, e] * scale[:, e] * expert_fn(x, e)`` over the local experts: (R, H).

    Real ranks run each expert on its own rows only; simulated ranks (one shape for all) run
    every expert on every row and mask (the result is the same). An expert with no rows still
    runs (on zero rows): the result stays connected to the rows and to every expert's weights,
    so every rank's backward reaches the same collectives (the reverse exchange of `dispatch`,
    the ``psum`` of weights replicated over ``dp``) even when no token came its way. On
    simulated ranks, a :class:`RoutingPolicy` installed on this thread runs the experts instead.
    """
    policy: RoutingPolicy | None = routing_policy()
    if policy is not None and simulated:
        return policy.run_experts(x, assign, scale, expert_fn)
    y = x.new_zeros(x.shape[0], x.shape[-1])  # (R, H)
    for e in range(assign.shape[-1]):
        if simulated:
            ye = expert_fn(x, e)  # (R, H)
            s = (
                assign[:, e].unsqueeze(-1)
                if scale is None
                else torch.where(assign[:, e], scale[:, e], 0).unsqueeze(-1)
            )
            y = y + torch.where(assign[:, e].unsqueeze(-1), ye * s.to(ye.dtype), 0)
        else:
            idx = assign[:, e].nonzero().squeeze(-1)  # (R_e,), maybe empty
            ye = expert_fn(x.index_select(0, idx), e)  # (R_e, H)
            if scale is not None:
                ye = ye * scale[:, e].index_select(0, idx).unsqueeze(-1).to(ye.dtype)
            y = y.index_add(0, idx, ye)
    return y


def moe(
    x: Tensor,
    weights: Tensor,
    experts: Tensor,
    expert_fn: ExpertFn,
    mesh: Mesh,
    axis: str,
    num_experts: int,
    *,
    strategy: Strategy = "all_to_all",
    capacity_factor: float | None = None,
    capacity: int | None = None,
    tp_axis: str | None = None,
    layer: str = "moe",
) -> MoEOutput:
    """An expert-parallel MoE layer's expert part: ``out[t] = sum_j weights[t, j] * f_{experts[t,
    j]}(x[t])``.

    Args:
        x: (T, H) this rank's tokens; weights, experts: (T, k) from the router (`route`).
        expert_fn: ``expert_fn(rows, e) -> (rows, H)``: local expert ``e`` (``0 <= e < E/ep``)
            on some rows, with this rank's expert weights.
        capacity_factor: drop assignments past ``expert_capacity(T, k, E, capacity_factor)``
            per expert on each rank (token order); ``None``: dropless.
        capacity: ``all_to_all`` receive buffer rows (see `dispatch`).
        tp_axis: the experts' weights are tensor-parallel over this axis (``expert_fn``'s
            outputs are partial sums): the rows are ``pvary``'d in and ``psum``'d out.
    Returns `MoEOutput` ``(out (T, H), dropped)``. Gradient: to ``x``, ``weights`` and the
    expert weights, equal to the single-device layer's (summed over the ranks whose tokens
    reach an expert).

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"ep": 2})
    >>> w = torch.tensor([1.0, 10.0, 100.0, 1000.0])  # expert e multiplies by w[e]; 2 per rank
    >>> def layer(x, logits, w):
    ...     r = fd.nn.moe.route(logits, 1)
    ...     expert = lambda rows, e: rows * w[e]
    ...     return fd.nn.moe.moe(x, r.weights, r.experts, expert, mesh, "ep", 4).out
    >>> x = torch.ones(2, 3, 1)
    >>> logits = torch.eye(4)[torch.tensor([[0, 3, 2], [1, 1, 3]])] # (2 ranks, 3 tokens, 4 experts)
    >>> fd.simulate(layer, mesh)(x, logits, torch.stack([w[:2], w[2:]]))[..., 0].tolist()
    [[1.0, 1000.0, 100.0], [10.0, 10.0, 1000.0]]
    """
    el = check_expert_split(layer, num_experts, mesh, axis)
    T, k = experts.shape
    _check_k(layer, k, num_experts)
    check_capacity_factor(layer, capacity_factor)
    # float32 gates (transformers) on float64 tokens: one rounding
    weights = weights.to(torch.promote_types(weights.dtype, x.dtype))
    keep = None
    if capacity_factor is not None:
        keep = capacity_keep_mask(
            experts, num_experts, expert_capacity(T, k, num_experts, capacity_factor)
        )
        if capacity is None and strategy == "all_to_all":
            capacity = (
                mesh.axis_size(axis) * el * expert_capacity(T, k, num_experts, capacity_factor)
            )  # what can arrive
    dropped = (
        (~keep).sum() if keep is not None else torch.zeros((), dtype=torch.long, device=x.device)
    )
    rows, d = dispatch(
        x,
        experts,
        mesh,
        axis,
        num_experts,
        strategy=strategy,
        capacity=capacity,
        keep=keep,
        layer=layer,
    )
    if tp_axis is not None:
        rows = pvary(rows, mesh, tp_axis)
    simulated = _simulated(mesh)
    if strategy == "allgather":
        assert d.experts is not None
        ws = all_gather(
            weights if keep is None else torch.where(keep, weights, 0), mesh, axis, dim=0
        )  # (ep*T, k)
        if tp_axis is not None:
            # the gates scale tp-partial outputs: their gradient is summed over tp
            ws = pvary(ws, mesh, tp_axis)
        hit = F.one_hot(d.row_expert, el + 1)[..., :el]  # (ep*T, k, E_local)
        assign = hit.sum(1) > 0  # (ep*T, E_local)
        # (ep*T, E_local): the gate of each local expert
        scale = (ws.unsqueeze(-1) * hit.to(ws.dtype)).sum(1)
        y = _run_experts(rows, assign, scale, expert_fn, simulated)
    else:
        assign = F.one_hot(d.row_expert, el + 1)[:, :el] > 0  # (R, E_local)
        y = _run_experts(rows, assign, None, expert_fn, simulated)
    if tp_axis is not None:
        y = psum(y, mesh, tp_axis)
    return MoEOutput(combine(y, d, weights), dropped)


# ============================================================================ auxiliary losses
def _global(t: Tensor, mesh: Mesh | None, axes: Sequence[str]) -> Tensor:
    for a in axes:
        assert mesh is not None
        t = psum(t, mesh, a)
    return t


def load_balancing_loss(
    router_logits: Tensor | Sequence[Tensor],
    top_k: int,
    *,
    mesh: Mesh | None = None,
    axes: Sequence[str] = (),
    attention_mask: Tensor | None = None,
    gating: Gating = "softmax",
    layer: str = "moe",
) -> Tensor:
    """Switch Transformer's auxiliary load-balancing loss, as transformers'
    ``load_balancing_loss_func`` computes it.

    ``router_logits``: (T, E), or one per layer (their statistics pooled, as transformers
    does). ``loss = E * sum_e f_e * P_e`` with ``f_e`` the fraction of tokens choosing
    expert ``e`` among their top ``k`` and ``P_e`` the mean router probability of ``e``.
    ``attention_mask`` (T,) weights the tokens (0: padding). With ``axes`` (the mesh axes
    the tokens are split over, e.g. ``("dp", "ep")``) the counts, probability sums and token
    counts are summed over those axes first: every rank gets the loss of the **global**
    batch, and its gradient is that loss's gradient (through ``P_e``; ``f_e`` is a count).
    With ``axes=()`` every rank computes transformers' formula on its own tokens (the
    per-replica convention; equal to the global one when all replicas see the same batch).
    Computed in float32 for bf16/fp16 logits, else in their dtype (transformers always uses
    float32). Gradient: through the probabilities only, as in transformers.

    Args:
        router_logits: ``(T, E)``, or one per layer (their statistics pooled).
        top_k: the experts per token.
        mesh: the mesh, with ``axes``.
        axes: the mesh axes the tokens are split over (``("dp", "ep")``): the loss of the global
            batch; ``()``: each rank's own tokens.
        attention_mask: ``(T,)`` token weights (0: padding).
        gating: ``"softmax"`` or ``"sigmoid"``, as in `route`.
        layer: the MoE layer's name, for error messages.

    Returns:
        a 0-d tensor: the loss.

    >>> import torch, fastdist as fd
    >>> round(fd.nn.moe.load_balancing_loss(torch.zeros(4, 4), 1).item(), 4)  # uniform: 1
    1.0
    """
    layers = [router_logits] if isinstance(router_logits, Tensor) else list(router_logits)
    E = layers[0].shape[-1]
    _check_k(layer, top_k, E)
    counts = probs = total = None
    for logits in layers:
        x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        bad_mask = attention_mask is not None and attention_mask.numel() != x.shape[0]
        if x.dim() != 2 or x.shape[-1] != E or bad_mask:
            raise MoEError(
                f"fastdist MoE layer {layer!r}: load_balancing_loss takes (T, E) router logits "
                f"per layer and a (T,) attention_mask, got {tuple(x.shape)} and "
                f"{None if attention_mask is None else tuple(attention_mask.shape)}. Fix: "
                f"flatten the tokens (logits.reshape(-1, "
                f"{x.shape[-1]})) for the statistics pooled over all of them (transformers' "
                "Mixtral); Switch Transformers' loss is per sequence: the mean over sequences "
                "of this loss on each one's (S, E)"
            )
        p = x.softmax(-1) if gating == "softmax" else torch.sigmoid(x)  # (T, E)
        chosen = F.one_hot(torch.topk(p, top_k, dim=-1).indices, E).sum(1).to(p.dtype)  # (T, E)
        m = (
            torch.ones(p.shape[0], dtype=p.dtype, device=p.device)
            if attention_mask is None
            else attention_mask.reshape(-1).to(p.dtype)
        )
        c, s, n = (chosen * m.unsqueeze(-1)).sum(0), (p * m.unsqueeze(-1)).sum(0), m.sum()
        counts, probs, total = (c, s, n) if counts is None else (counts + c, probs + s, total + n)  # type: ignore[operator]
    assert counts is not None and probs is not None and total is not None
    stats = _global(torch.cat([counts, total.reshape(1)]), mesh, axes)  # (E + 1,): no gradient
    probs = _global(probs, mesh, axes)  # (E,)
    return E * (stats[:E] / stats[E] * probs / stats[E]).sum()


def router_z_loss(
    router_logits: Tensor | Sequence[Tensor], *, mesh: Mesh | None = None, axes: Sequence[str] = ()
) -> Tensor:
    """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits)**2`` (as transformers'
    Switch Transformers).

    Several layers' logits: the mean over all their tokens. ``axes``: the mean over the global
    batch (sums over those axes), as `load_balancing_loss`. Gradient: that mean's.

    Args:
        router_logits: ``(T, E)``, or one per layer (the mean over all their tokens).
        mesh: the mesh, with ``axes``.
        axes: the mesh axes the tokens are split over (``("dp", "ep")``): the loss of the global
            batch; ``()``: each rank's own tokens.

    Returns:
        a 0-d tensor: the loss.

    >>> import torch, fastdist as fd
    >>> round(fd.nn.moe.router_z_loss(torch.zeros(3, 4)).item(), 4)   # log(4)**2
    1.9218
    """
    layers = [router_logits] if isinstance(router_logits, Tensor) else list(router_logits)
    z = torch.cat(
        [
            torch.logsumexp(
                lg.float() if lg.dtype in (torch.float16, torch.bfloat16) else lg, dim=-1
            ).reshape(-1)
            for lg in layers
        ]
    )
    total = _global(torch.tensor(float(z.numel()), dtype=z.dtype, device=z.device), mesh, axes)
    return _global((z**2).sum(), mesh, axes) / total
