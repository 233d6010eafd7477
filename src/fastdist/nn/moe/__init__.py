"""Expert parallelism: route tokens to experts sharded over an ``ep`` axis, and back.

Pure functions of (tensor, mesh, axis), composable with ``tp`` inside each expert and
``dp``/``sp`` outside (any other axis is independent: every ``ep`` group runs on its own).

* `route`: the router's top-k (softmax or sigmoid gating, renormalised top-k as Mixtral,
  Qwen2-MoE with ``norm_topk_prob`` or DeepSeek-V3 do).
* `dispatch` / `combine`: send every (token, expert) assignment to the rank owning the
  expert, and bring the expert outputs back, in the original order, weighted by the gates.
  Two strategies (``strategy=``):

  - ``"allgather"``: all-gather the tokens over ``ep``, every rank runs its own experts on
    every token routed to them, reduce-scatter the outputs (vLLM's naive dispatcher; simple,
    good for small batches; no data-dependent sizes, so it also compiles);
  - ``"all_to_all"``: `fastdist.indexed_all_to_all_v` (ragged): only the assigned rows
    move. Dropless. On real ranks the receive buffer has exactly the rows that arrive. On
    simulated ranks every rank shares one shape, so the buffer has a static ``capacity``,
    by default the worst case ``ep * tokens * top_k`` rows (no token can be dropped); a
    smaller ``capacity`` that cannot hold what arrives raises `MoEError`.

* `moe`: router output -> dispatch -> experts -> combine in one call, with optional token
  dropping (``capacity_factor``: each rank keeps at most ``ceil(capacity_factor * T * k / E)``
  assignments per expert, in token order, as GShard/Switch/Megatron do); the number of
  dropped assignments is in the result.
* `load_balancing_loss` (Switch/Mixtral's auxiliary loss) and `router_z_loss` (ST-MoE):
  over the **global** batch when ``axes`` names the axes the tokens are split over (the
  statistics are summed over them before the product, so every rank gets the loss of the
  whole batch and the gradient of that one loss); with ``axes=()`` each rank computes
  Hugging Face's formula on its own tokens (the per-replica convention).

Tokens are rows: ``x`` is ``(T, H)`` on each rank (flatten ``(batch, seq)`` first), ``experts``
and ``weights`` are ``(T, k)``. Global expert ``e`` lives on the rank with index
``e // (E / ep)`` along ``axis`` as its local expert ``e % (E / ep)``.
"""

from fastdist.nn.moe.experts import ExpertParallel, ExpertParallelExperts, dropped_counts
from fastdist.nn.moe.routing import (
    Dispatched,
    MoEOutput,
    Routing,
    RoutingPolicy,
    combine,
    dispatch,
    expert_capacity,
    load_balancing_loss,
    moe,
    route,
    router_z_loss,
)

__all__ = [
    "Dispatched",
    "ExpertParallel",
    "ExpertParallelExperts",
    "MoEOutput",
    "Routing",
    "RoutingPolicy",
    "combine",
    "dispatch",
    "dropped_counts",
    "expert_capacity",
    "load_balancing_loss",
    "moe",
    "route",
    "router_z_loss",
]
