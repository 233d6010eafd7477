"""The KV cache of a context-parallel LLM's generation (`CausalContextParallel`): what a split
prefill leaves, and a decoding step's attention over it.

After a prefill whose tokens were split over the axis, each rank's cache holds its own tokens'
keys and values. With ``cache="split"`` it stays so: the cache is marked (`SplitMark` under
`SPLIT_CACHE`), its ``get_seq_length`` reports the tokens on all ranks (what ``generate``
counts), its ``crop`` is refused unless it keeps or empties everything, a change made outside
the model between calls is refused at the next, and each decoding step attends over every
rank's shard (`split_cache_attention`: partial softmaxes merged with a log-sum-exp, exactly the
softmax over every key). With ``cache="gathered"`` every rank gathers the whole cache of its
heads after the prefill (`settle_prefill_cache`). Only dynamic cache layers can be filled split;
the others are refused before the prefill runs (`refuse_fixed_cache`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from fastdist.errors import ParallelizeError
from fastdist.nn.styles.causal_ring import Partial, finish, merge, partial, update
from fastdist.ops import all_gather_invariant, axis_index

if TYPE_CHECKING:  # the state is context_llm's, which imports this module
    from fastdist.nn.styles.context_llm import ContextState

__all__ = [
    "SPLIT_CACHE",
    "SplitMark",
    "cache_length",
    "record_length",
    "refuse_fixed_cache",
    "settle_prefill_cache",
    "split_cache_attention",
    "split_prefill",
    "unmark",
]

#: the attribute of a KV cache a split prefill left split: its `SplitMark`
SPLIT_CACHE = "_fastdist_split_prefill"


@dataclass
class SplitMark:
    """What a KV cache left split by a split prefill carries (as `SPLIT_CACHE`): the prefill's
    token count on all ranks, and the rank-local length the cache held when this model's last
    forward with it ended (a length that differs at the next call: the cache was changed
    outside the model, and its split can no longer be read)."""

    prefill: int
    local: int


def cache_length(cache: Any) -> int:
    """The token count a KV cache holds on this rank (0: none): its class's ``get_seq_length``
    (a split cache's own reports the count on all ranks, `_global_length`)."""
    if cache is None:
        return 0
    return int(type(cache).get_seq_length(cache))


def _global_length(cache: Any, n: int, layer_idx: int = 0) -> int:
    """``get_seq_length`` of a split cache: the tokens it holds on all ``n`` ranks (the prefill's
    and every decoded one), which transformers' ``generate`` counts as the tokens seen (a
    ``generate`` continuing from the cache feeds the tokens after them)."""
    local = int(type(cache).get_seq_length(cache, layer_idx))
    mark = cache.__dict__.get(SPLIT_CACHE)
    return local if mark is None or not local else local + mark.prefill - mark.prefill // n


def _mark_split(cache: Any, prefill: int, local: int, axis: str, n: int) -> None:
    """Mark ``cache`` as left split by a prefill of ``prefill`` tokens over ``n`` ranks: its
    ``get_seq_length`` reports the tokens on all ranks, its ``crop`` is guarded."""
    cache.__dict__[SPLIT_CACHE] = SplitMark(prefill, local)
    cache.__dict__["crop"] = functools.partial(_split_crop, cache, axis)
    cache.__dict__["get_seq_length"] = functools.partial(_global_length, cache, n)


def unmark(cache: Any) -> None:
    """Drop a split mark (and the crop guard): the cache is empty, the next prefill starts anew."""
    d = getattr(cache, "__dict__", {})
    d.pop(SPLIT_CACHE, None)
    for name, func in (("crop", _split_crop), ("get_seq_length", _global_length)):
        if isinstance(d.get(name), functools.partial) and d[name].func is func:
            del d[name]


def _split_crop(cache: Any, axis: str, tokens_to_remove: int) -> None:
    """``crop`` of a cache a split prefill left split: only ``crop(0)`` (nothing removed) and a
    crop that empties the cache pass; any other is refused (the cache holds this rank's share of
    the prompt; transformers' crop of the last tokens would cut different tokens on each rank's
    books than the split's)."""
    mark: SplitMark | None = cache.__dict__.get(SPLIT_CACHE)
    local = cache_length(cache)
    if mark is not None and tokens_to_remove != 0 and -tokens_to_remove < local:
        raise ParallelizeError(
            f"context parallelism over {axis!r}: crop({tokens_to_remove}) of a KV cache a split "
            f"prefill of {mark.prefill} tokens left split (each rank holds its own share of the "
            "prompt), as assisted generation (assistant_model=, prompt_lookup_num_tokens=) "
            "rolls back rejected tokens: cropping a split cache is not built. Fix: "
            'CausalContextParallel(cache="gathered") (every rank holds the whole cache after the '
            "prefill), or generate without assistance"
        )
    type(cache).crop(cache, tokens_to_remove)
    if cache_length(cache) == 0:
        unmark(cache)


def split_prefill(state: ContextState, cache: Any, past: int, S: int, mask: Any) -> int | None:
    """The split prefill's token count of a decoding forward's ``cache`` (None: the cache is
    whole); raises where the cache was changed outside the model since its last forward, or where
    the call re-feeds tokens the cache holds (transformers' ``generate`` continuing from a split
    cache counts the cache's rank-local length as the tokens seen)."""
    mark = getattr(cache, "__dict__", {}).get(SPLIT_CACHE)
    if not isinstance(mark, SplitMark) or not past:
        return None
    axis, n = state.axis, state.mesh.axis_size(state.axis)
    if past != mark.local:
        raise ParallelizeError(
            f"context parallelism over {axis!r}: the KV cache a split prefill of {mark.prefill} "
            f"tokens left split holds {past} tokens on this rank, not the {mark.local} it held "
            "after the model's last forward: it was changed outside the model (a crop, a reset "
            "of some layers), and its split over the ranks can no longer be read. Fix: "
            'CausalContextParallel(cache="gathered") to edit the cache, or a fresh cache '
            "(cache.reset() empties it for a new prompt)"
        )
    total = mark.prefill + past - mark.prefill // n + S  # this call's included, all ranks
    if isinstance(mask, Tensor) and mask.shape[1] != total:
        raise ParallelizeError(
            f"context parallelism over {axis!r}: a call of {S} tokens with an attention_mask of "
            f"{mask.shape[1]} against a KV cache a split prefill of {mark.prefill} tokens left "
            f"split, which with them holds {total} tokens on all ranks ({past} on this rank): "
            "the mask must cover every cached token and the call's. Fix: pass the whole "
            f"sequence's mask ({total} columns), or, to feed tokens again or edit the cache, "
            'CausalContextParallel(cache="gathered")'
        )
    return mark.prefill


#: the KV cache layers a split prefill can fill (each rank its tokens, gathered or kept split)
_DYNAMIC = ("DynamicLayer", "DynamicSlidingWindowLayer")


def refuse_fixed_cache(axis: str, cache: Any) -> None:
    """Refuse, before a split prefill runs, a KV cache with a layer of fixed length (a static
    cache: its update returns every slot, not the rank's tokens) or of another kind (an
    offloaded or quantized one), which the prefill cannot fill split nor gather after."""
    for layer in getattr(cache, "layers", ()):
        kind = type(layer).__name__
        if getattr(cache, "offloading", False):
            kind = f"{kind} of an offloading {type(cache).__name__}"
        if kind not in _DYNAMIC:
            raise ParallelizeError(
                f"context parallelism over {axis!r}: the KV cache layer {kind} (a static, "
                "offloaded or quantized cache) cannot be filled by a split prefill (each rank "
                "holds its tokens only). Fix: generate with the default dynamic cache (no "
                "cache_implementation), or use_cache=False"
            )


def settle_prefill_cache(state: ContextState, cache: Any, total: int) -> None:
    """After a split prefill of ``total`` tokens: leave ``cache`` split and mark it
    (``state.cache == "split"``, every layer dynamic), or gather every layer into the whole
    sequence of this rank's heads; a sliding-window layer keeps its last ``window - 1`` keys
    either way. Raises for a layer that cannot be gathered (a static or offloaded cache)."""
    axis, n = state.axis, state.mesh.axis_size(state.axis)
    layers = getattr(cache, "layers", ())
    if state.cache == "split" and layers and all(type(x).__name__ in _DYNAMIC for x in layers):
        # each rank keeps its tokens' keys and values; decoding steps attend over every shard
        _mark_split(cache, total, cache_length(cache), axis, n)
        for layer in layers:
            if type(layer).__name__ == "DynamicSlidingWindowLayer":
                # the rank's newest tokens: the keys a later query can see are every rank's newest
                _keep_window(layer, layer.keys, layer.values)
        return
    for layer in layers:
        kind = type(layer).__name__
        if kind not in _DYNAMIC:
            raise ParallelizeError(
                f"context parallelism over {axis!r}: the KV cache layer {kind} (a static or "
                "offloaded cache) cannot be gathered after a split prefill. Fix: generate with "
                "the default dynamic cache, or use_cache=False"
            )
        # (B, Hkv, 2c, D) -> (B, Hkv, S, D): every rank holds the whole cache of its heads
        keys, values = state.gather(layer.keys, 2), state.gather(layer.values, 2)
        if kind == "DynamicSlidingWindowLayer":
            layer.cumulative_length = total
            _keep_window(layer, keys, values)
        else:
            layer.keys, layer.values = keys, values


def _keep_window(layer: Any, keys: Tensor, values: Tensor) -> None:
    """Set a sliding-window cache layer to the last ``window - 1`` of ``keys`` and ``values`` (as
    its own update keeps), recording no more past."""
    keep = layer.sliding_window - 1
    layer.keys, layer.values = keys[:, :, -keep:], values[:, :, -keep:]
    layer.record_past = False


def record_length(cache: Any) -> None:
    """After a forward that ran whole: the rank-local length a split ``cache`` now holds, on its
    mark (the length its next call must find); nothing for another cache or ``None``."""
    mark = getattr(cache, "__dict__", {}).get(SPLIT_CACHE)
    if isinstance(mark, SplitMark):
        mark.local = cache_length(cache)


def split_cache_attention(
    state: ContextState,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> tuple[Tensor, None]:
    """A decoding step against a KV cache a split prefill of ``P`` tokens left split: this rank's
    cache holds its ``P / n`` prefill tokens (its chunks), then every token decoded since (the
    tail, the same on every rank: each rank runs the new tokens whole); a sliding-window layer
    only the newest ``window - 1`` of them (its own update crops: the keys a later query can
    see are among every rank's newest). Each rank attends its
    queries (the step's ``Sq`` new tokens, replicated) over its keys, the tail counted on rank 0
    only; the partial results (row max, sum, weighted values) are gathered over the axis and
    merged (log-sum-exp): the softmax over every key, exactly."""
    mesh, axis, prefill = state.mesh, state.axis, state.decode
    if prefill is None:
        raise ParallelizeError(
            f"context parallelism over {axis!r}: a split-cache attention outside a decoding "
            "forward against a split KV cache. Fix: call the model, not the attention function"
        )
    own = prefill // mesh.axis_size(axis)
    sq, total, dev = query.shape[2], state.decode_total, query.device  # total: this step's too
    tail = total - prefill
    qi = torch.arange(total - sq, total, device=dev)[None]  # (1, Sq)
    mine = state.shard(torch.arange(prefill, device=dev)[None], 1)  # (1, P/n)
    ki = torch.cat([mine, torch.arange(prefill, total, device=dev)[None]], 1)  # (1, own + tail)
    first = (axis_index(mesh, axis) == 0).expand(1, tail)  # (1, tail): the tail on rank 0
    mask = state.whole_valid  # (B, total) or None
    if mask is None:
        valid = torch.cat([torch.ones(1, own, dtype=torch.bool, device=dev), first], 1)
    else:
        valid = torch.cat([state.shard(mask[:, :prefill], 1), mask[:, prefill:total] & first], 1)
    held = key.shape[2]
    if held > ki.shape[1] or (window is None and held != ki.shape[1]):
        raise ParallelizeError(
            f"context parallelism over {axis!r}: attention layer "
            f"{getattr(module, 'layer_idx', '?')}'s KV cache gives {held} keys on this rank; a "
            f"split prefill of {prefill} tokens and {tail} since leave it {ki.shape[1]} "
            f"({own} of the prompt, the {tail} since){' at most' if window else ''}: the cache "
            "was changed outside the model. Fix: a fresh cache, or "
            'CausalContextParallel(cache="gathered") to edit the cache between calls'
        )
    # a sliding-window layer holds (and gives) only the newest of them
    ki, valid = ki[:, -held:], valid[:, -held:]
    part = update(
        partial(query, key.shape[1], value.shape[-1]),
        query,
        (key, value, ki, valid),
        qi,
        scale,
        window,
        softcap,
    )
    # (n, B, Hkv, G, Sq, .) every rank's partial result
    every = [all_gather_invariant(t[None].contiguous(), mesh, axis, dim=0) for t in part]
    parts = [Partial(*(t[r] for t in every)) for r in range(every[0].shape[0])]
    return finish(merge(parts)), None
