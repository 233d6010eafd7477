"""A model family as data (`Family`, `Mlp`) and the one function that turns a family and a model's
config into a plan (`build_plan`).

A row names where the pieces of a decoder-only causal LM are (embedding, decoder layers, attention
and its projections, MLPs, experts, norms, head) and how its attention is laid out (separate or
fused q|k|v, per-head or whole-width norms, per-head parameters). What a row cannot say as data is
a named hook it references: ``variant`` (fields read off the config: Falcon's three layouts, a
refusal), ``attention_style`` (an attention `HeadParallelAttention` does not describe: DeepSeek's
`fastdist.nn.plans.hooks.LatentAttention`) and ``moe_layers`` (which layers hold experts).

The plan `build_plan` returns (a plain dict, module-name pattern -> style): the embedding and the LM
head vocabulary-parallel over ``axis``; the attention by heads over ``axis``; each MLP's up
projections column-parallel and its down projection row-parallel over ``axis``; the experts over
``ep_axis`` (`fastdist.nn.moe.ExpertParallel`, each expert's features over ``axis`` too unless
``axis == ep_axis``; the router replicated), shared experts over ``axis``; with
``sequence_parallel``, Megatron's sequence parallelism from the first decoder layer to the final
norm (norms on sequence shards, the final norm too, its output gathered for the head; each MoE
block on the whole sequence); on the base model,
`fastdist.nn.plans.hooks.RefusePartialOutputs`: ``output_attentions`` (the rank's heads) and, with
sequence parallelism, ``output_hidden_states`` (the rank's shard) refused at the call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import Any, Literal

from fastdist.errors import ParallelizeError
from fastdist.nn.moe import ExpertParallel
from fastdist.nn.moe.routing import Strategy
from fastdist.nn.plans.hooks import RefusePartialOutputs, SequenceGather
from fastdist.nn.styles.attention import HeadParallelAttention
from fastdist.nn.styles.base import Style
from fastdist.nn.styles.configs import OwnConfig
from fastdist.nn.styles.context_llm import CausalContextParallel, PvaryTree
from fastdist.nn.styles.context_logits import ShardedLoss
from fastdist.nn.styles.heads import QkvLayout
from fastdist.nn.styles.linear import ColwiseParallel, RowwiseParallel, VocabParallel
from fastdist.nn.styles.regions import GatherSequence, PrepareInput, PvaryParams, SequenceShard

__all__ = [
    "NO_CONTEXT_PARALLEL",
    "Family",
    "Mlp",
    "Plan",
    "Seq",
    "add_context_parallel",
    "build_plan",
    "context_experts",
    "refuse_context_parallel",
]

#: A plan: module-name patterns (``fnmatch``, e.g. ``"model.layers.*.mlp.down_proj"``) mapped to
#: the `Style` that makes each matching module parallel; what `fastdist.nn.parallelize` takes.
Plan = dict[str, Any]
Seq = Literal["replicated", "sequence"]
#: (attribute, width from (query heads, kv heads, head dim)): an attention attribute set per rank
Attr = tuple[str, Callable[[int, int, int], Any]]
#: a norm inside the attention, with the projection it normalises
QKNorm = tuple[str, Literal["q", "k"]]


@dataclass(frozen=True)
class Mlp:
    """A dense MLP: its ``up`` children column-parallel, ``down`` row-parallel.

    ``name`` is relative to a decoder layer (``""``: the layer itself); ``fused`` names the ``up``
    children that hold two projections side by side (gate|up), with each half's width or the
    config key holding it.
    """

    name: str = "mlp"
    up: tuple[str, ...] = ("gate_proj", "up_proj")
    down: str = "down_proj"
    fused: tuple[tuple[str, int | str], ...] = ()


@dataclass(frozen=True)
class Family:
    """One family of decoder-only causal LMs, as data: where its modules are and how its attention
    is laid out. Names are relative to ``prefix`` (``""``: the model itself), attention, MLP and
    norm names relative to a decoder layer. Head counts are config keys (or numbers); ``None``:
    as many kv heads as query heads, ``hidden_size / heads`` for the head dim.
    """

    model_types: tuple[str, ...]
    prefix: str = "model"
    layers: str = "layers"
    embed: str | None = "embed_tokens"
    embed_scale: str | None = None
    head: str | None = "lm_head"
    final_norm: str = "norm"
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    # attention
    attention: str = "self_attn"
    heads: str | int = "num_attention_heads"
    kv_heads: str | int | None = "num_key_value_heads"
    head_dim: str | int | None = "head_dim"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    qkv: str | None = None
    qkv_layout: QkvLayout = "concat"
    head_norms: tuple[str, ...] = ()
    full_width_norms: tuple[QKNorm, ...] = ()
    head_norm_lists: tuple[QKNorm, ...] = ()
    head_params: tuple[str, ...] = ()
    attrs: tuple[Attr, ...] = ()
    keep: tuple[str, ...] = ()
    # MLPs and experts
    mlps: tuple[Mlp, ...] = (Mlp(),)
    experts: tuple[str, ...] = ()
    shared: tuple[Mlp, ...] = ()
    moe_block: str = "mlp"
    # hooks: the code a row needs where data cannot say it
    variant: Callable[[Any], Mapping[str, Any]] | None = field(default=None, compare=False)
    attention_style: Callable[[Any, str, Seq], Style] | None = field(default=None, compare=False)
    moe_layers: Callable[[Any], list[int]] | None = field(default=None, compare=False)

    @property
    def moe(self) -> bool:
        """Whether the family has experts."""
        return bool(self.experts)


#: the families `add_context_parallel` refuses (their model types, why, what to do instead):
#: `CausalContextParallel` gives each rank its tokens' positions at the base model and runs the
#: split attention as transformers' registered attention function
NO_CONTEXT_PARALLEL: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("gpt2",),
        "GPT-2 adds learned absolute position embeddings (transformer.wpe(position_ids)) to the "
        "whole sequence's token embeddings inside its base model, before the first decoder "
        "layer, where CausalContextParallel has given each rank only its own tokens' positions "
        "(built for rotary embeddings, applied inside the attention): the two do not line up "
        "(a shape error, or another rank's positions)",
    ),
    (
        ("falcon",),
        "Falcon's attention (FalconAttention) computes its scores itself (its own softmax or "
        "torch's scaled_dot_product_attention, ALiBi) instead of calling transformers' "
        "attention registry, which is where CausalContextParallel runs the split ring / Ulysses "
        "attention: each rank's layers would attend over its own tokens only",
    ),
)


def refuse_context_parallel(fam: Family, config: Any) -> None:
    """Raise `ParallelizeError` for a family context parallelism cannot split
    (`NO_CONTEXT_PARALLEL`), naming the reason and what to run instead."""
    model_type = getattr(config, "model_type", None)
    for types, why in NO_CONTEXT_PARALLEL:
        if model_type in types or set(types) & set(fam.model_types):
            raise ParallelizeError(
                f"plans.plan: context_parallel cannot split a {model_type!r} model: {why}. "
                "Fix: run it without context_parallel (tensor parallelism and data "
                "parallelism: plans.plan(model, mesh) on a mesh without 'cp'), or use a family "
                "with rotary positions whose attention goes through the registry (Llama, "
                "Qwen3, Mistral, GPT-NeoX, ...: docs/context_parallel.md)"
            )


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _count(config: Any, key: str | int | None, default: int) -> int:
    if isinstance(key, int):
        return key
    value = getattr(config, key, None) if key else None
    return int(value) if value else default


def _attention(fam: Family, config: Any, axis: str, seq: Seq) -> Style:
    if fam.attention_style is not None:
        return fam.attention_style(config, axis, seq)
    heads = _count(config, fam.heads, 0)
    kv = _count(config, fam.kv_heads, heads)
    d = _count(config, fam.head_dim, int(getattr(config, "hidden_size", 0)) // max(heads, 1))
    names = {"q": fam.q, "k": fam.k, "v": fam.v, "o": fam.o, "qkv": fam.qkv}
    return HeadParallelAttention(
        heads,
        kv,
        d,
        axis,
        input=seq,
        output=seq,
        **names,  # type: ignore[arg-type]
        qkv_layout=fam.qkv_layout,
        norms=fam.head_norms,
        full_width_norms=fam.full_width_norms,
        head_norm_lists=fam.head_norm_lists,
        head_params=fam.head_params,
        attrs=fam.attrs,
        keep=fam.keep,
    )


def _mlp(plan: Plan, where: str, mlp: Mlp, config: Any, axis: str, seq: Seq) -> None:
    base = _join(where, mlp.name)
    fused = dict(mlp.fused)
    plan[base] = PrepareInput(axis, seq)
    for up in mlp.up:
        half = _count(config, fused[up], 0) if up in fused else 0
        plan[f"{base}.{up}"] = ColwiseParallel(axis, parts=(half, half) if half else ())
    plan[f"{base}.{mlp.down}"] = RowwiseParallel(axis, seq)


def _layer_patterns(layers: str, which: list[int], count: int) -> list[str]:
    """The patterns naming decoder layers ``which``: ``layers.*`` when that is all of them."""
    if len(which) == count:
        return [f"{layers}.*"]
    return [f"{layers}.{i}" for i in which]


def build_plan(
    family: Family,
    config: Any,
    *,
    axis: str,
    ep_axis: str | None,
    strategy: Strategy,
    capacity_factor: float | None,
    sequence_parallel: bool,
    gather_logits: bool,
    context_parallel: CausalContextParallel | None = None,
    tensor_parallel: bool = True,
) -> Plan:
    """The plan for a model of ``family`` with ``config`` (the options as `fastdist.nn.plans.plan`
    resolved them): tensor parallelism over ``axis``, the experts over ``ep_axis`` (``None``:
    ``axis``) with ``strategy`` and ``capacity_factor`` (see
    `fastdist.nn.moe.moe`), Megatron sequence parallelism over ``axis`` when
    ``sequence_parallel``, the whole vocabulary's logits when ``gather_logits``; context
    parallelism when ``context_parallel`` (`add_context_parallel`); ``tensor_parallel=False``:
    only that (a mesh without ``axis``).

    Raises `ParallelizeError` where the family's ``variant`` refuses the config, and for
    ``context_parallel`` on a family it cannot split (`NO_CONTEXT_PARALLEL`: GPT-2, Falcon).
    """
    fam = replace(family, **family.variant(config)) if family.variant else family
    if context_parallel is not None:
        refuse_context_parallel(fam, config)
    if not tensor_parallel:
        if context_parallel is None:
            raise ParallelizeError("build_plan: tensor_parallel=False needs context_parallel")
        return add_context_parallel(
            context_experts(fam, config, context_parallel), fam, context_parallel
        )
    seq: Seq = "sequence" if sequence_parallel else "replicated"
    layers = _join(fam.prefix, fam.layers)
    plan: Plan = {}
    if fam.embed:
        plan[_join(fam.prefix, fam.embed)] = VocabParallel(axis, scale=fam.embed_scale)
    plan[f"{layers}.*.{fam.attention}"] = _attention(fam, config, axis, seq)
    moe: list[str] = [f"{layers}.*"] if fam.moe else []
    dense = [] if fam.moe else [f"{layers}.*"]
    if fam.moe_layers is not None:
        count = int(config.num_hidden_layers)
        sparse = fam.moe_layers(config)
        rest = [i for i in range(count) if i not in sparse]
        moe = _layer_patterns(layers, sparse, count) if sparse else []
        dense = _layer_patterns(layers, rest, count) if rest else []
    for layer in moe:
        tp = None if axis == (ep_axis or axis) else axis
        for experts in fam.experts:
            plan[f"{layer}.{experts}"] = ExpertParallel(
                ep_axis or axis, strategy, tp, capacity_factor=capacity_factor
            )
        for mlp in fam.shared:
            _mlp(plan, _join(layer, fam.moe_block), mlp, config, axis, "replicated")
    for layer in dense:
        for mlp in fam.mlps:
            _mlp(plan, layer, mlp, config, axis, seq)
    if fam.head:
        plan[fam.head] = VocabParallel(axis, input="replicated", gather_output=gather_logits)
    if sequence_parallel:
        plan[f"{layers}.0"] = SequenceShard(axis)
        # the final norm on the shards (per token), its output gathered for the head
        plan[_join(fam.prefix, fam.final_norm)] = GatherSequence(axis, after=True)
        plan.update({f"{layers}.*.{norm}": PvaryParams(axis) for norm in fam.norms})
        plan.update({_join(layer, fam.moe_block): SequenceGather(axis) for layer in moe})
    if context_parallel is not None:  # its own style refuses both outputs (the rank's tokens)
        return add_context_parallel(plan, fam, context_parallel)
    kind = "sequence-parallel" if sequence_parallel else "tensor-parallel"
    plan[fam.prefix] = RefusePartialOutputs(axis, kind, sequence=sequence_parallel)
    return plan


def add_context_parallel(plan: Plan, fam: Family, cp: CausalContextParallel) -> Plan:
    """``plan`` with the tokens split over ``cp.axis``: ``cp`` on the base model, and `PvaryTree`
    after the last style of every decoder-layer entry whose module no other entry reaches into
    (so it sees the children the other styles swapped in), on the norms and the final norm; with
    no tensor-parallel entries, on each whole decoder layer. Refuses Megatron sequence
    parallelism (both split the sequence).

    A mixture-of-experts layer meets the rank's tokens in its router too: `PvaryTree` on the
    whole layer, the children other entries style excluded (they get their own after their
    styles), covers the router and everything else no entry styles; experts split over ``cp``
    itself (`context_experts`: ``cp`` alone) need none."""
    if any(isinstance(s, SequenceShard) for s in plan.values()):
        raise ParallelizeError(
            "plans.plan: context_parallel and sequence_parallel=True both split the sequence. "
            "Fix: one of them (context parallelism also splits the attention)"
        )
    layers = _join(fam.prefix, fam.layers)
    tree = PvaryTree(cp.axis)
    # the whole model's own config first: cp sets its attention function there
    out: Plan = {"": OwnConfig()} if fam.prefix else {}
    out.update({fam.prefix: cp} if fam.prefix not in plan else {})
    for pattern, styles in plan.items():
        inner = any(p.startswith(f"{pattern}.") for p in plan)
        if pattern.startswith(f"{layers}.") and not inner and not _over(styles, cp.axis):
            styles = (*(styles if isinstance(styles, (tuple, list)) else (styles,)), tree)
        out[pattern] = styles
    if fam.moe:  # every layer: the router and what no entry styles
        every = f"{layers}.*"
        styled = tuple(dict.fromkeys(r for p in plan if (r := _relative(p, every))))
        mine = PvaryTree(cp.axis, exclude=styled)
        out[every] = (*_tuple(out[every]), mine) if every in out else mine
    if not plan:
        out[f"{layers}.*"] = tree
    for norm in (*(f"{layers}.*.{n}" for n in fam.norms), _join(fam.prefix, fam.final_norm)):
        old = out.get(norm)
        out[norm] = tree if old is None else (*(old if isinstance(old, tuple) else (old,)), tree)
    if cp.logits == "split":  # the head meets the rank's tokens; the loss sums over the axis
        if not fam.head or not fam.prefix or "" in plan:
            raise ParallelizeError(
                "plans.plan: CausalContextParallel(logits='split') needs a causal LM with an LM "
                f"head and a base model (this family: head {fam.head!r}, base {fam.prefix!r}). "
                "Fix: logits='gathered'"
            )
        out[""] = (OwnConfig(), ShardedLoss(cp.axis, base=fam.prefix))
        out[fam.head] = (*_tuple(out[fam.head]), tree) if fam.head in out else tree
    return out


def context_experts(fam: Family, config: Any, cp: CausalContextParallel) -> Plan:
    """The experts of a mixture-of-experts family split over the context-parallel axis itself
    (a mesh with ``cp`` alone): `ExpertParallel` with ``tokens="sharded"`` (each rank's tokens
    go to their experts' ranks and back), as torchtitan's expert parallelism borrows the
    context-parallel ranks; ``{}`` for a dense family."""
    if not fam.moe:
        return {}
    layers = _join(fam.prefix, fam.layers)
    count = int(config.num_hidden_layers)
    sparse = fam.moe_layers(config) if fam.moe_layers is not None else list(range(count))
    style = ExpertParallel(cp.axis, tokens="sharded")
    return {
        f"{layer}.{experts}": style
        for layer in (_layer_patterns(layers, sparse, count) if sparse else [])
        for experts in fam.experts
    }


def _tuple(styles: Any) -> tuple[Any, ...]:
    return tuple(styles) if isinstance(styles, (tuple, list)) else (styles,)


def _over(styles: Any, axis: str) -> bool:
    """Whether an entry splits its module's parameters over ``axis`` (experts over ``cp``)."""
    return any(isinstance(s, ExpertParallel) and s.axis == axis for s in _tuple(styles))


def _segments_match(a: list[str], b: list[str]) -> bool:
    return all(fnmatchcase(x, y) or fnmatchcase(y, x) for x, y in zip(a, b, strict=True))


def _relative(pattern: str, layer: str) -> str:
    """``pattern``'s part below ``layer`` when it names a module inside the layers ``layer``
    matches (segment by segment, ``*`` either way), else ``""``."""
    p, lay = pattern.split("."), layer.split(".")
    if len(p) <= len(lay) or not _segments_match(p[: len(lay)], lay):
        return ""
    return ".".join(p[len(lay) :])
