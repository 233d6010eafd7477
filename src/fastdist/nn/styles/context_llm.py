"""Context parallelism of a Hugging Face decoder LLM: `CausalContextParallel` splits the token
sequence over one mesh axis (``"cp"``) from the embedding output through every decoder layer and
runs each attention over the whole sequence as a causal ring or as Ulysses.

What is split where (``n`` ranks of ``axis``, a sequence of ``S`` tokens cut into ``2n`` chunks of
``c = S / 2n``):

* **zig-zag layout** (load balance for the causal mask): rank ``r`` holds chunks ``r`` and
  ``2n - 1 - r`` (rank 0 of 2: chunks 0 and 3; rank 1: chunks 1 and 2), so every rank has as
  many early as late tokens and the same number of visible (query, key) pairs;
* the base model's forward pre-hook computes the rank's ``position_ids`` (its tokens' own
  positions: the rotary embedding of each rank is its own; one whose tables depend on the
  largest position, ``"dynamic"`` or ``"longrope"``, is given the whole sequence's positions
  and its tables are cut to the rank's tokens) and the token index and padding flags
  the attention masks with; the first decoder layer's pre-hook cuts the embedding output
  ``(B, S, D)`` to ``(B, 2c, D)`` (``local_chunk``: backward gathers the gradient);
* every attention runs through transformers' attention registry (``ALL_ATTENTION_FUNCTIONS``:
  one function, `context_attention`, registered as ``"fastdist_context"`` and named by the
  model's ``config._attn_implementation``; it finds the model's state on the attention module
  it is given; nothing of transformers is patched): ``"ring"`` rotates k, v and their token
  indices around the axis (``ring_shift``) and merges the blocks with an online softmax,
  masking by token index (causal, sliding window, padding keys); ``"ulysses"`` trades tokens
  for heads (``all_to_all_4d``), attends over the whole sequence, and trades back;
* the base model's output (after the final norm) is gathered and put back in token order
  (``all_gather_invariant``), so the LM head, the logits and the loss see the whole sequence,
  replicated over the axis, exactly as on one device; with ``logits="split"`` it stays split
  and each rank's head and loss see its own tokens (`ShardedLoss`, the last section);
* every parameter of the split region (decoder layers, final norm) meets this rank's tokens: the
  plan ``pvary``'s it over the axis (`PvaryTree`), so its gradient is summed over the ranks; a
  mixture-of-experts layer's router too, and each layer's ``router_logits`` are gathered into
  the whole batch with the output (the load-balancing loss is a product of means over every
  token).

The zig-zag ring computes only the half-blocks the causal mask leaves visible
(`fastdist.nn.styles.causal_ring.zigzag_ring`: ``(2n + 1) c^2`` query-key products per rank
instead of ``4 n c^2``); the contiguous layout's ring computes every block, masked. Ulysses with
grouped-query attention needs the query heads (on the rank, after tensor parallelism) to divide
by ``n`` and the kv heads to divide by ``n`` or ``n`` by them (kv heads repeated); other head
counts are refused (use ring).

Generation (``ParallelModel.generate``): a prompt whose length divides by ``2n`` is prefilled
split; the KV cache stays split (``cache="split"``, the default: each rank keeps its tokens'
keys and values), each decoding step's new token runs on every rank, its keys and values are
appended on every rank (counted on rank 0 only) and its attention over every rank's shard is
merged with a log-sum-exp (`fastdist.nn.styles.causal_ring.merge`; the split cache's marks,
guards and attention are `fastdist.nn.styles.context_cache`'s); a sliding-window layer
(Mistral, Gemma 2) keeps the rank's newest ``window - 1`` keys. With ``cache="gathered"`` the
cache is gathered after the prefill instead (every rank holds the whole cache of its heads) and
each decoding step runs whole. The model's
`fastdist.nn.styles.SequenceSwitch` (``decoding``, set by ``generate``) allows calls that
cannot split.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from fastdist.core.context import check_of, is_real
from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.styles.base import SequenceSwitch, Style, StyleContext
from fastdist.nn.styles.causal_ring import (
    attend,
    ring_blocks,
    zigzag_ring,
)
from fastdist.nn.styles.configs import own_config, position_dependent_rope
from fastdist.nn.styles.context_cache import (
    cache_length,
    record_length,
    refuse_fixed_cache,
    settle_prefill_cache,
    split_cache_attention,
    split_prefill,
    unmark,
)
from fastdist.nn.styles.context_recompute import in_backward
from fastdist.ops import all_gather_invariant, all_to_all_4d, local_chunk, pvary

__all__ = [
    "CausalContextParallel",
    "PvaryTree",
    "zigzag_gather",
    "zigzag_shard",
]

Mode = Literal["ring", "ulysses"]
Split = Literal["zigzag", "contiguous"]
CacheLayout = Literal["split", "gathered"]
#: where the base model's output goes: gathered into the whole sequence (every rank's LM head
#: and loss see every token) or left split (each rank's head and loss see its own tokens)
Logits = Literal["gathered", "split"]
#: the attribute of the base model, and of every module of its decoder layers, holding the
#: model's `ContextState` (the attention function finds it on the attention module it is given,
#: so a copy of the model, ``copy.deepcopy``, uses its own)
STATE_ATTR = "fastdist_context_state"
#: the name of the attention function in transformers' registry (``config._attn_implementation``)
ATTENTION = "fastdist_context"
#: generation refused with ``logits="split"`` (the next token is read off the last logits)
SPLIT_GENERATE = (
    "context parallelism over {axis!r}: generation (a prefill or decoding step) with "
    "CausalContextParallel(logits='split'): the head would give this rank's tokens only, and "
    "the next token is read off the last one. Fix: generate with a model parallelized with "
    "logits='gathered' (the default; load the trained weights into it)"
)


#: the transformers ``config.layer_types`` the split attention computes exactly
_SPLIT_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


# ============================================================================ zig-zag layout
def zigzag_shard(x: Tensor, mesh: Mesh, axis: str, dim: int) -> Tensor:
    """This rank's two chunks of ``x`` along ``dim`` (``S`` divisible by ``2n``): chunks ``r`` and
    ``2n - 1 - r`` of ``2n``, concatenated. Backward gathers the gradient.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"cp": 2})
    >>> x = torch.arange(8.0).expand(2, 8)  # every rank: tokens 0..7
    >>> fd.simulate(lambda t: zigzag_shard(t, mesh, "cp", 0), mesh)(x).tolist()
    [[0.0, 1.0, 6.0, 7.0], [2.0, 3.0, 4.0, 5.0]]
    """
    n = mesh.axis_size(axis)
    dim = dim % x.dim()
    y = x.reshape(*x.shape[:dim], 2, n, -1, *x.shape[dim + 1 :])  # (.., 2, n, c, ..)
    first, last = y.select(dim, 0), y.select(dim, 1).flip(dim)  # (.., n, c, ..) each
    z = torch.stack([first, last], dim=dim + 1)  # (.., n, 2, c, ..): rank j's chunks at j
    return local_chunk(z, mesh, axis, dim=dim).flatten(dim, dim + 2)  # (.., 2c, ..)


def zigzag_gather(x: Tensor, mesh: Mesh, axis: str, dim: int) -> Tensor:
    """The whole sequence, in token order, from every rank's `zigzag_shard` (replicated over
    ``axis``; backward: this rank's chunks of the gradient)."""
    dim = dim % x.dim()
    y = x.reshape(*x.shape[:dim], 1, 2, -1, *x.shape[dim + 1 :])  # (.., 1, 2, c, ..)
    every = all_gather_invariant(y, mesh, axis, dim=dim)  # (.., n, 2, c, ..)
    first, last = every.select(dim + 1, 0), every.select(dim + 1, 1).flip(dim)  # (.., n, c, ..)
    return torch.cat([first, last], dim=dim).flatten(dim, dim + 1).contiguous()  # (.., S, ..)


# ============================================================================ per-call state
@dataclass
class ContextState:
    """What the hooks of one model share during a forward: whether the tokens are split, the
    token index (for causal masks) and padding flags of this rank's keys."""

    mesh: Mesh
    axis: str
    mode: Mode
    layout: Split = "zigzag"
    #: this forward's tokens are split over the axis (else every rank runs them whole)
    split: bool = False
    #: (1 or B, tokens on this rank): each token's index in the whole sequence
    index: Tensor | None = None
    #: (B, tokens on this rank) True for a real token, or None (no padding mask)
    valid: Tensor | None = None
    #: the model's switch: ``decoding`` lets a forward that cannot split (a decoding step, a
    #: length 2n does not divide) run whole (or against a split KV cache)
    switch: SequenceSwitch = field(default_factory=SequenceSwitch)
    #: (B, all keys) padding flags of a forward run whole
    whole_valid: Tensor | None = None
    #: after a split prefill: leave the KV cache split (``"split"``) or gather it
    cache: CacheLayout = "split"
    #: a decoding forward against a KV cache a split prefill of this many tokens left split
    decode: int | None = None
    #: in such a forward: the tokens so far on all ranks, the forward's own included
    decode_total: int = 0
    #: the base model's output gathered (``"gathered"``) or left split (``"split"``)
    logits: Logits = "gathered"
    #: (1 or B, S) a split forward's whole position ids, for a rotary embedding whose tables
    #: depend on the largest position (`_whole_rope_positions`)
    positions: Tensor | None = None
    #: the split attention's calls in the running decoder layer (`_check_layer_attended`)
    attended: int = 0
    #: real ranks: the inputs of a first call were found the same on every rank of the axis
    same_inputs: bool = False

    @property
    def chunks(self) -> int:
        """How many chunks the sequence is cut into: ``2n`` (zig-zag) or ``n``."""
        n = self.mesh.axis_size(self.axis)
        return 2 * n if self.layout == "zigzag" else n

    def shard(self, x: Tensor, dim: int) -> Tensor:
        """This rank's tokens of ``x`` along ``dim``."""
        if self.layout == "zigzag":
            return zigzag_shard(x, self.mesh, self.axis, dim)
        return local_chunk(x, self.mesh, self.axis, dim=dim)

    def gather(self, x: Tensor, dim: int) -> Tensor:
        """The whole sequence in token order, replicated."""
        if self.layout == "zigzag":
            return zigzag_gather(x, self.mesh, self.axis, dim)
        return all_gather_invariant(x, self.mesh, self.axis, dim=dim).contiguous()


# ============================================================================ hooks


def _enter_model(
    state: ContextState, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of the base model: decide split or whole; give this rank's position ids."""
    if args:  # positional arguments by the forward's own parameter names
        names = list(inspect.signature(module.forward).parameters)
        kwargs = {**dict(zip(names, args)), **kwargs}
    kw = dict(kwargs)
    tokens = kw.get("input_ids")
    tokens = tokens if tokens is not None else kw.get("inputs_embeds")
    if not isinstance(tokens, Tensor):
        raise ParallelizeError(
            f"context parallelism over {state.axis!r}: {type(module).__name__} was called without "
            "input_ids or inputs_embeds. Fix: pass the token ids"
        )
    config = getattr(module, "config", None)
    asked = [
        a
        for a in ("output_hidden_states", "output_attentions")
        if (kw.get(a) if kw.get(a) is not None else getattr(config, a, False))
    ]
    if asked:  # the call's argument, else the config's default (as transformers reads them)
        raise ParallelizeError(
            f"context parallelism over {state.axis!r}: {' / '.join(asked)} would return this "
            "rank's tokens only. Fix: leave them unset (and False in the model config)"
        )
    if (
        module.training
        and torch.is_grad_enabled()
        and getattr(module, "gradient_checkpointing", False)
    ):
        raise ParallelizeError(_RECOMPUTE.format(axis=state.axis, where=type(module).__name__))
    if not getattr(config, "is_causal", True):
        raise ParallelizeError(
            f"context parallelism over {state.axis!r}: {type(module).__name__}'s config has "
            "is_causal=False (transformers then builds a bidirectional mask), but the split "
            "attention is causal: every query would miss the keys after it. Fix: "
            "config.is_causal=True, or run this model without context_parallel"
        )
    mask = kw.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() != 2:
        raise ParallelizeError(
            f"context parallelism over {state.axis!r}: a {mask.dim()}-d attention_mask (a "
            "prepared or custom mask) is not supported; only the (batch, tokens) padding mask. "
            "Fix: pass the 2-d padding mask (or none)"
        )
    if state.logits == "split" and state.switch.decoding:
        raise ParallelizeError(SPLIT_GENERATE.format(axis=state.axis))
    if not state.same_inputs and is_real(state.mesh) and check_of(state.mesh) is None:
        _check_same_inputs(state, module, kw)  # (not in parallelize's replication probe)
    S = tokens.shape[1]
    past = cache_length(kw.get("past_key_values"))
    if past == 0:  # an empty (new, reset) cache: a mark of an earlier prefill is stale
        unmark(kw.get("past_key_values"))
    state.split = past == 0 and S % state.chunks == 0
    if not state.split:
        return (), _enter_whole(state, module, kw, tokens, past)
    refuse_fixed_cache(state.axis, kw.get("past_key_values"))
    for layer in getattr(kw.get("past_key_values"), "layers", ()):
        if getattr(layer, "is_sliding", False):  # keep the rank's every token until gathered
            layer.record_past = True
    positions = kw.get("position_ids")
    whole_index = torch.arange(S, device=tokens.device).unsqueeze(0)  # (1, S)
    if positions is None:
        positions = whole_index
    elif mask is None and kw.get("past_key_values") is None and _packed(positions):
        raise ParallelizeError(
            f"context parallelism over {state.axis!r}: the position_ids restart inside a row "
            "(packed sequences, as DataCollatorWithFlattening gives), which transformers masks "
            "apart; the split attention masks by token index only, so the documents would "
            "attend to each other. Fix: one document per row, padded and masked with "
            "attention_mask (labels=-100 on the padding)"
        )
    state.index = state.shard(whole_index, 1)  # (1, S/n)
    state.positions = positions  # (1 or B, S): a position-dependent rotary's tables
    state.valid = state.shard(mask.bool(), 1) if isinstance(mask, Tensor) else None
    kw["position_ids"] = state.shard(positions, 1)  # (1 or B, S/n)
    return (), kw


#: the base model's inputs every rank of the axis must be given alike (its whole batch)
_SAME_INPUTS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids")


def _check_same_inputs(state: ContextState, module: nn.Module, kw: dict[str, Any]) -> None:
    """Real ranks, the model's first call: refuse inputs that differ across the axis (a data
    loader sharded over the context-parallel ranks too). Each rank cuts its tokens out of the
    batch it is given, so ranks given different batches would stitch a sequence out of
    several, with no error. One small gather of a fingerprint per input (its shape, sum and a
    position-weighted sum), once per model."""
    parts = []
    for key in _SAME_INPUTS:
        v = kw.get(key)
        if not isinstance(v, Tensor):
            parts.append(torch.zeros(4, dtype=torch.float64))
            continue
        flat = v.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64).sin()
        shape = [float(v.dim()), float(flat.numel())]
        parts.append(torch.tensor([*shape, flat.sum().item(), (flat * weights).sum().item()]))
    mine = torch.cat(parts)  # (4 * len(_SAME_INPUTS),)
    device = next((v.device for v in kw.values() if isinstance(v, Tensor)), mine.device)
    # each rank's own fingerprint (pvary: it may differ, which is what is checked)
    mine = pvary(mine.to(device)[None], state.mesh, state.axis)
    every = all_gather_invariant(mine, state.mesh, state.axis).cpu()  # (n, k)
    differ = [i for i in range(every.shape[0]) if not torch.equal(every[i], every[0])]
    if differ:
        raise ParallelizeError(
            f"context parallelism over {state.axis!r}: {type(module).__name__} was given other "
            f"inputs on index {differ[0]} of the {state.axis!r} group than on index 0 (rank "
            f"{state.mesh.rank}). Every rank of the group must get the same whole batch: each "
            "cuts its own tokens out of it. Fix: shard the data over the data-parallel axes "
            f"only, not over {state.axis!r}"
        )
    state.same_inputs = True


def _packed(positions: Tensor) -> bool:
    """Whether ``positions`` ``(1 or B, S)`` restart inside a row: transformers then attends
    within each run of consecutive positions only (``find_packed_sequence_indices``)."""
    return bool((torch.diff(positions, dim=-1) != 1).any())


#: a decoder layer recomputed in backward would run after the forward's split state is gone,
#: attending over the rank's own tokens as if they were the whole sequence (wrong gradients)
_RECOMPUTE = (
    "context parallelism over {axis!r}: {where} uses gradient checkpointing, whose recomputed "
    "decoder layers are not built for CausalContextParallel (they would attend over this "
    "rank's tokens only: wrong gradients). Fix: model.gradient_checkpointing_disable(); "
    "context parallelism already divides the attention's activations by the axis size"
)


def _enter_whole(
    state: ContextState, module: nn.Module, kw: dict[str, Any], tokens: Tensor, past: int
) -> dict[str, Any]:
    """A forward that cannot split (a decoding step, a length the chunks do not divide): refused
    outside `fastdist.nn.styles.decoding`; else run on every rank, against the split KV cache
    a split prefill left (``state.decode``) or the whole one."""
    n, S = state.mesh.axis_size(state.axis), tokens.shape[1]
    if not state.switch.decoding:
        why = (
            f"a KV cache that already holds tokens ({past} on this rank: a decoding step)"
            if past
            else f"{S} tokens, which the {state.chunks} chunks of the {state.layout} layout "
            f"over {n} ranks do not divide"
        )
        raise ParallelizeError(
            f"context parallelism over {state.axis!r}: {type(module).__name__} got {why}. "
            f"Fix: pad the batch to a multiple of {state.chunks} tokens (padding masked with "
            "attention_mask and labels=-100); generate with ParallelModel.generate, which "
            "runs the decoding steps (a hand-written decoding loop: call the model within "
            "fastdist.nn.styles.decoding(model))"
        )
    mask = kw.get("attention_mask")
    state.whole_valid = mask.bool() if isinstance(mask, Tensor) else None  # (B, keys)
    prefill = split_prefill(state, kw.get("past_key_values"), past, S, mask)
    if prefill is not None:  # attend over every rank's shard of the cache
        # the cache's length here counts this rank's prefill tokens and every decoded one
        start = prefill + past - prefill // n  # tokens before this call, on all ranks
        state.decode, state.decode_total = prefill, start + S
        if kw.get("position_ids") is None:
            kw["position_ids"] = torch.arange(start, start + S, device=tokens.device)[None]
    return kw


def _split_first_layer(
    state: ContextState, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Forward pre-hook of the first decoder layer: the hidden states cut to this rank's chunks."""
    if not state.split:
        return None
    if args:
        return (state.shard(args[0], 1), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": state.shard(kwargs["hidden_states"], 1)}


def _leave_model(state: ContextState, module: nn.Module, args: Any, out: Any) -> Any:
    """Forward hook of the base model (also when its forward raised): the output (and a KV cache
    filled by this forward) gathered into the whole sequence, in token order; the per-call
    tensors dropped (inside a simulation they are the simulation's, which must not outlive it)."""
    state.index = state.valid = state.whole_valid = state.decode = state.positions = None
    if not state.split or out is None:  # the length a decoding step left
        record_length(getattr(out, "get", lambda _: None)("past_key_values"))
        return out
    n = state.mesh.axis_size(state.axis)
    batch, total = out["last_hidden_state"].shape[0], out["last_hidden_state"].shape[1] * n
    if state.logits == "gathered":  # else each rank's head sees its own tokens
        out["last_hidden_state"] = state.gather(out["last_hidden_state"], 1)
    routers = out.get("router_logits")
    if isinstance(routers, (tuple, list)) and routers:
        # mixture of experts: each layer's (B x 2c, E) router logits of this rank's tokens ->
        # (B x S, E) of the whole batch in token order, so the model's load-balancing loss is
        # one device's (a product of means over all tokens, not a sum of per-rank terms)
        out["router_logits"] = tuple(
            state.gather(r.reshape(batch, -1, r.shape[-1]), 1).flatten(0, 1) for r in routers
        )
    settle_prefill_cache(state, out.get("past_key_values"), total)
    state.split = False
    return out


def _enter_layer(state: ContextState, module: nn.Module, args: Any) -> None:
    """Forward pre-hook of every decoder layer: no split attention called in it yet."""
    state.attended = 0


def _check_layer_attended(
    state: ContextState,
    index: int,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: Any,
) -> None:
    """Forward hook of every decoder layer: in a split forward, the layer must have mixed its
    tokens through the split attention (`context_attention`). One that did not (a Mamba,
    convolution or linear-attention layer of a hybrid model, or an attention that does not go
    through transformers' registry) ran over this rank's tokens as if they were the whole
    sequence: refused. A layer that returns its input as it is (a pipeline stage's stand-in
    for a layer another stage holds) mixes nothing."""
    if not state.split or state.attended:
        return
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if not any(first is a for a in (*args, *kwargs.values())):
        raise ParallelizeError(
            f"context parallelism over {state.axis!r}: decoder layer {index} "
            f"({type(module).__name__}) ran on this rank's tokens without calling the split "
            f"attention ({ATTENTION!r} of transformers' attention registry): a layer that mixes "
            "tokens some other way (a Mamba, convolution or linear-attention layer, an "
            "attention that does not use the registry) would see this rank's tokens as the "
            "whole sequence. Fix: run this model without context_parallel"
        )


# ============================================================================ rotary tables
def _whole_rope_positions(
    state: ContextState, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Forward pre-hook of a position-dependent rotary embedding: in a split forward it sees the
    whole sequence's position ids (as on one device), not this rank's."""
    if not state.split or state.positions is None:
        return None
    if len(args) > 1:  # (x, position_ids, ...)
        return (args[0], state.positions, *args[2:]), kwargs
    return args, {**kwargs, "position_ids": state.positions}


def _cut_rope_tables(state: ContextState, module: nn.Module, args: Any, out: Any) -> Any:
    """Forward hook of a position-dependent rotary embedding: its whole-sequence tables
    ``(B or 1, S, D)`` cut to this rank's tokens, in the layout's order."""
    if not state.split or state.positions is None:
        return out
    if isinstance(out, Tensor):
        return state.shard(out, 1)
    return type(out)(state.shard(t, 1) if isinstance(t, Tensor) else t for t in out)


# ============================================================================ attention
def _ulysses_kv_heads(state: ContextState, module: Any, hq: int, hkv: int) -> int:
    """How many times each kv head is repeated before the Ulysses exchange; raises for head
    counts that do not split over the axis."""
    n = state.mesh.axis_size(state.axis)
    if hq % n == 0 and hkv % n == 0:
        return 1
    if hq % n == 0 and n % hkv == 0:
        return n // hkv
    raise ParallelizeError(
        f"context parallelism over {state.axis!r} (Ulysses): attention layer "
        f"{getattr(module, 'layer_idx', '?')} has {hq} query and {hkv} kv heads on this rank, "
        f"which the {n} ranks do not split (query heads must divide by {n}, kv heads divide by "
        f"{n} or {n} by them). Fix: CausalContextParallel(mode='ring'), or a {state.axis!r} "
        "size that fits the heads"
    )


def context_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The attention function registered with transformers (`ATTENTION`) for context-parallel
    models: q ``(B, Hq, Sq, D)``, k/v ``(B, Hkv, Sk, D)`` (HF's layout) -> ``(B, Sq, Hq, Dv)``,
    causal, with the state of the model ``module`` belongs to."""
    state = module.__dict__.get(STATE_ATTR)
    if not isinstance(state, ContextState):
        raise ParallelizeError(
            f"attention implementation {ATTENTION!r}: {type(module).__name__} belongs to no "
            "context-parallel model (CausalContextParallel sets it on its decoder layers). Fix: "
            "parallelize the model with a context_parallel plan, or set another "
            "attn_implementation"
        )
    if dropout:
        raise ParallelizeError(
            f"context parallelism over {state.axis!r}: attention dropout ({dropout}) is not "
            "built. Fix: attention_dropout=0.0 in the config, or model.eval()"
        )
    if not getattr(module, "is_causal", True):
        raise ParallelizeError(
            f"context parallelism over {state.axis!r}: {type(module).__name__} is not causal; "
            "only decoder (causal) self-attention is split. Fix: a plan for this attention"
        )
    if kwargs.get("s_aux") is not None:
        raise ParallelizeError(
            f"context parallelism over {state.axis!r}: {type(module).__name__} passes attention "
            "sinks (s_aux, gpt-oss's per-head logit in every softmax's denominator), which the "
            "split attention does not add (its outputs would be silently off). Fix: tensor or "
            "expert parallelism for this model, without context_parallel"
        )
    if in_backward():  # a layer recomputed by a checkpoint the model's flag does not show
        where = f"decoder layer {getattr(module, 'layer_idx', '?')}"
        raise ParallelizeError(_RECOMPUTE.format(axis=state.axis, where=where))
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    if state.decode is not None:
        return split_cache_attention(
            state, module, query, key, value, scale, sliding_window, softcap
        )
    if not state.split:  # every rank holds every token: one block, indices from the shapes
        sq, sk = query.shape[2], key.shape[2]
        ki = torch.arange(sk, device=query.device).unsqueeze(0)  # (1, Sk)
        qi = ki[:, sk - sq :]  # (1, Sq)
        valid = state.whole_valid
        valid = None if valid is None else valid[:, -sk:]  # a sliding cache holds the last keys
        blocks = iter([(key, value, ki, valid)])
        return attend(query, blocks, qi, scale, sliding_window, softcap), None
    assert state.index is not None
    state.attended += 1
    mine = (key, value, state.index, state.valid)
    if state.mode == "ring" and state.layout == "zigzag":  # only the visible half-blocks
        out = zigzag_ring(
            query, mine, state.index, state.mesh, state.axis, scale, sliding_window, softcap
        )
        return out, None
    if state.mode == "ring":  # contiguous: every block, masked
        blocks = ring_blocks(state.mesh, state.axis, mine)
        return attend(query, blocks, state.index, scale, sliding_window, softcap), None
    mesh, axis = state.mesh, state.axis
    reps = _ulysses_kv_heads(state, module, query.shape[1], key.shape[1])
    # (B, 2c, H, D) tokens of every head -> (B, S', H/n, D) every token (zig-zag order) of H/n
    qh, kh, vh = (
        all_to_all_4d(t.transpose(1, 2), mesh, axis).transpose(1, 2)
        for t in (
            query,
            key.repeat_interleave(reps, dim=1),
            value.repeat_interleave(reps, dim=1),
        )
    )
    index = all_gather_invariant(state.index, mesh, axis, dim=1)  # (1, S')
    valid = None if state.valid is None else all_gather_invariant(state.valid, mesh, axis, dim=1)
    o = attend(qh, iter([(kh, vh, index, valid)]), index, scale, sliding_window, softcap)
    # (B, S', H/n, Dv) -> (B, 2c, H, Dv)
    return all_to_all_4d(o, mesh, axis, scatter_dim=1, gather_dim=2), None


# ============================================================================ styles
def _register_attention(module: nn.Module) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, context_attention)
    # on this model's own copy: another model built from the same config object keeps its own
    own_config(module)._attn_implementation = ATTENTION


@dataclass(frozen=True)
class CausalContextParallel(Style):
    """A Hugging Face decoder's base model (``model.model`` of a ``LlamaForCausalLM``) with its
    token sequence split over ``axis`` in the zig-zag layout; see this module's docstring.

    Pair it with `PvaryTree` on the decoder layers and the final norm (the family plans do:
    ``fastdist.nn.plans.plan(model, mesh, context_parallel="cp")``).

    Args:
        axis: the mesh axis the tokens are split over.
        mode: ``"ring"`` (k/v blocks around the axis, any head counts) or ``"ulysses"`` (heads
            exchanged for tokens).
        layers: the base model's ``ModuleList`` of decoder layers.
        layout: ``"zigzag"`` (rank ``r`` holds chunks ``r`` and ``2n - 1 - r`` of ``2n``: the
            causal work balanced) or ``"contiguous"`` (rank ``r`` holds block ``r`` of ``n``:
            the last rank's queries see the most keys; what ``parallelize(verify=True)``,
            which compares contiguous blocks with the single-device outputs, can check).
        cache: after a split prefill, ``"split"`` (each rank keeps its tokens' keys and values;
            a decoding step attends over every rank's shard, merged with a log-sum-exp) or
            ``"gathered"`` (every rank gathers the whole cache of its heads; decoding steps run
            whole).
        logits: ``"gathered"`` (the base model's output gathered into the whole sequence: every
            rank's LM head and loss see every token, as on one device) or ``"split"`` (left
            split: each rank's head gives the logits of its own ``S / n`` tokens, in the
            layout's order, and a ``labels=`` loss is summed over the rank's tokens, divided by
            the whole batch's count and summed over the axis: one device's mean; the plans add
            `ShardedLoss` on the causal LM and `PvaryTree`
            on the head). ``"split"`` refuses generation and ``logits_to_keep``.
    """

    axis: str = "cp"
    mode: Mode = "ring"
    layers: str = "layers"
    layout: Split = "zigzag"
    cache: CacheLayout = "split"
    logits: Logits = "gathered"

    def unverifiable(self) -> str | None:
        if self.layout == "zigzag":
            return (
                "in the zig-zag layout a rank holds chunks r and 2n-1-r of the sequence, no "
                "contiguous block of the single-device output (layout='contiguous' verifies)"
            )
        return None

    def check(self, module: nn.Module, name: str, mesh: Mesh) -> None:
        mesh.axis_indices(self.axis, "CausalContextParallel")
        if (
            self.mode not in ("ring", "ulysses")
            or self.layout not in ("zigzag", "contiguous")
            or self.cache not in ("split", "gathered")
            or self.logits not in ("split", "gathered")
        ):
            raise ParallelizeError(
                f"parallelize: {name!r}: CausalContextParallel(mode={self.mode!r}, "
                f"layout={self.layout!r}, cache={self.cache!r}, logits={self.logits!r}): the "
                "modes are 'ring' and 'ulysses', the layouts 'zigzag' and 'contiguous', the "
                "caches and the logits 'split' and 'gathered'"
            )
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "_attn_implementation"):
            raise ParallelizeError(
                f"parallelize: {name!r} ({type(module).__name__}) has no transformers config "
                "whose attention implementation can be set. Fix: apply CausalContextParallel "
                "to a transformers base model (e.g. 'model' of a LlamaForCausalLM)"
            )
        layers = getattr(module, self.layers, None)
        if not isinstance(layers, nn.ModuleList) or not len(layers):
            raise ParallelizeError(
                f"parallelize: {name!r} ({type(module).__name__}) has no ModuleList "
                f"{self.layers!r} of decoder layers. Fix: CausalContextParallel(layers=...)"
            )
        other = sorted(set(getattr(config, "layer_types", None) or ()) - _SPLIT_LAYER_TYPES)
        if other:  # chunked (Llama 4), linear attention, Mamba, ... : masks the split lacks
            raise ParallelizeError(
                f"parallelize: {name!r}: the config's layer_types hold {other}; "
                "CausalContextParallel splits causal full and sliding-window attention only "
                "(the split attention masks by token index: causal, the sliding window, "
                "padding; a chunked, linear or state-space layer would come out wrong). Fix: "
                "run this model without context_parallel"
            )
        for sub_name, sub in layers.named_modules():
            if isinstance(sub, nn.Conv1d):  # Mamba, LFM2, gated delta nets: a causal conv
                raise ParallelizeError(
                    f"parallelize: {name!r}: {self.layers}.{sub_name} is a Conv1d over the "
                    "tokens (a Mamba, short-convolution or linear-attention layer), which "
                    "CausalContextParallel does not split: on a rank's tokens it would see "
                    "them as the whole sequence. Fix: run this model without context_parallel"
                )

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        self.check(module, name, ctx.mesh)
        state = ContextState(
            ctx.mesh,
            self.axis,
            self.mode,
            self.layout,
            switch=ctx.switch,
            cache=self.cache,
            logits=self.logits,
        )
        _register_attention(module)
        layers: Any = getattr(module, self.layers)
        module.register_forward_pre_hook(functools.partial(_enter_model, state), with_kwargs=True)
        layers[0].register_forward_pre_hook(
            functools.partial(_split_first_layer, state), with_kwargs=True
        )
        module.register_forward_hook(functools.partial(_leave_model, state), always_call=True)
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(functools.partial(_enter_layer, state))
            layer.register_forward_hook(
                functools.partial(_check_layer_attended, state, i), with_kwargs=True
            )
        for sub in module.modules():
            if position_dependent_rope(sub):  # dynamic / longrope: the whole sequence's tables
                sub.register_forward_pre_hook(
                    functools.partial(_whole_rope_positions, state), with_kwargs=True
                )
                sub.register_forward_hook(functools.partial(_cut_rope_tables, state))
        for sub in (module, *layers.modules()):
            sub.__dict__[STATE_ATTR] = state  # a plain attribute (not a submodule or buffer)
        return module


@dataclass(frozen=True)
class PvaryTree(Style):
    """Every parameter of the module and its submodules meets rank-varying data over ``axis``
    (a sequence shard): ``pvary`` it at every call (its gradient summed over the axis). Put it
    after a style that swaps the module's children (in the same plan entry), so it sees the
    final ones; a parameter already ``pvary``'d over ``axis`` is skipped.

    Args:
        axis: the mesh axis the data the parameters meet varies over.
        exclude: submodules (names relative to the module, ``fnmatch`` patterns) left out with
            everything under them: the ones another plan entry styles (a mixture-of-experts
            block's experts), which get their own `PvaryTree` after their own styles, or none
            when they are split over ``axis`` themselves.
    """

    axis: str = "cp"
    exclude: tuple[str, ...] = ()

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        """Record every parameter of ``module`` (outside ``exclude``) as pvary'd over ``axis``
        in ``ctx.pvary`` (``parallelize`` installs the hooks that pvary it at each call); the
        module itself is returned unchanged.

        >>> import torch, fastdist as fd
        >>> from fastdist.nn.styles import StyleContext
        >>> ctx = StyleContext(fd.Mesh({"cp": 2}))
        >>> block = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
        >>> _ = PvaryTree("cp", exclude=("1",)).apply(block, "block", ctx)
        >>> [(p, axis) for _, p, axis in ctx.pvary]
        [('weight', 'cp'), ('bias', 'cp')]
        """
        # one site per parameter: a parameter another style pvary's over another axis (a
        # per-head norm over tp) gets both axes in that site (one pvary over the two)
        where = {(id(m), p): i for i, (m, p, _) in enumerate(ctx.pvary)}
        for sub_name, sub in module.named_modules():
            if any(_under(sub_name, pattern) for pattern in self.exclude):
                continue
            for p, _ in sub.named_parameters(recurse=False):
                i = where.get((id(sub), p))
                if i is None:
                    where[(id(sub), p)] = len(ctx.pvary)
                    ctx.pvary.append((sub, p, self.axis))
                    continue
                axes = ctx.pvary[i][2]
                axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
                if self.axis not in axes_t:
                    ctx.pvary[i] = (sub, p, cast(str, (*axes_t, self.axis)))
        return module


def _under(name: str, pattern: str) -> bool:
    """Whether the module ``name`` is ``pattern`` (``fnmatch``) or inside a module it matches."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))
