"""An automatic plan: the styles for a family nobody wrote a plan for, read off its module tree.

`auto` finds, from the modules and their shapes (not from class names it knows):

* the decoder blocks: the largest ``nn.ModuleList`` of modules of one class;
* in the first block, the attention: a module with ``q``/``k``/``v``/``o`` projections (names
  such as ``q_proj``, ``query``, ``wq``; ``o_proj``, ``dense``, ``out_proj``, ``c_proj``) or a
  fused ``qkv`` one (``qkv_proj``, ``query_key_value``, ``c_attn``, ``Wqkv``); the head dim from
  the module's ``head_dim``/``head_size`` or the config, the head counts from the projections'
  shapes; norms inside it by their weight's size (one head: shared by the heads; a whole
  projection: its statistics summed over the axis; a list of one norm per head); integer
  attributes its forward reads that hold a split width (GPT-2's ``split_size``) patched per rank;
* dense MLPs (anywhere in the block, shared experts too): a module whose linear children are
  layers from the hidden size to ``I`` (or ``2I``: a fused gate|up) and one back from ``I``
  (gate/up/down, fc1/fc2, c_fc/c_proj, dense_h_to_4h/dense_4h_to_h);
* experts with 3-D ``gate_up_proj``/``down_proj`` parameters: whole experts over the axis
  (`fastdist.nn.moe.ExpertParallel` with the axis as its ``ep``); the router stays replicated;
* the input embedding and the LM head (``get_input_embeddings`` / ``get_output_embeddings``):
  vocabulary-parallel (a scaled embedding with an ``embed_scale`` too), left replicated when
  the embedding cannot be and the head shares its weight.

Where a choice cannot be read off the shapes (a fused q|k|v laid out ``[q | k | v]``, per head,
or per kv group), the plan holds every choice as ``candidates``; ``parallelize`` with ``verify``
tries them in turn and applies the first that matches one device. ``parallelize(model, mesh,
"auto")`` is ``parallelize(model, mesh, auto(model), verify=True)``. A model `auto` cannot read,
or whose every candidate fails verification, is refused with a `ParallelizeError` naming the
module.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any, Literal

from torch import Tensor, nn

from fastdist.nn.moe import ExpertParallel
from fastdist.nn.styles import (
    ColwiseParallel,
    GatherSequence,
    HeadParallelAttention,
    ParallelizeError,
    PrepareInput,
    PvaryParams,
    RowwiseParallel,
    SequenceShard,
    VocabParallel,
)

__all__ = ["AutoPlan", "auto"]

Plan = dict[str, Any]

_Q = ("q_proj", "query", "q", "wq", "q_lin")
_K = ("k_proj", "key", "k", "wk", "k_lin")
_V = ("v_proj", "value", "v", "wv", "v_lin")
_O = ("o_proj", "out_proj", "dense", "o", "wo", "c_proj", "out_lin")
_QKV = ("qkv_proj", "query_key_value", "c_attn", "Wqkv", "qkv", "W_pack")
#: integer attributes that are never head counts or split widths, whatever their value
_NOT_WIDTHS = ("layer_idx", "head_dim", "head_size", "rotary_ndims", "sliding_window")


def _dims(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of an ``nn.Linear`` or transformers' ``Conv1D``, else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    w = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(w, Tensor) and w.dim() == 2:
        return int(w.shape[0]), int(w.shape[1])
    return None


def _cfg_int(config: Any, *keys: str) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if type(value) is int:
            return value
    return None


def _blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder blocks: the ``nn.ModuleList`` of same-class modules holding most parameters."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not len(module):
            continue
        if len({type(m) for m in module}) != 1 or not list(module[0].children()):
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, name, module)
    if best is None:
        raise ParallelizeError(
            f"plans.auto: {type(model).__name__} has no list of repeated blocks (an "
            "nn.ModuleList of modules of one class) to read a plan from. Fix: write a plan "
            "(see fastdist.nn.plans.llama for the shape of one)"
        )
    return best[1], best[2]


def _forward_reads(module: nn.Module) -> set[str]:
    try:
        src = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return set()
    return set(re.findall(r"\bself\.(\w+)", src))


def _find_attention(block: nn.Module) -> tuple[str, nn.Module, dict[str, str]] | None:
    """(relative name, module, role -> child name) of the first attention in ``block``."""
    for rel, module in block.named_modules():
        kids = {n: c for n, c in module.named_children() if _dims(c) is not None}
        pick = {
            role: next((n for n in names if n in kids), None)
            for role, names in (("q", _Q), ("k", _K), ("v", _V), ("o", _O), ("qkv", _QKV))
        }
        if pick["o"] is None:
            continue
        if pick["q"] and pick["k"] and pick["v"]:
            return rel, module, {r: n for r, n in pick.items() if r != "qkv" and n}
        if pick["qkv"]:
            return rel, module, {"qkv": pick["qkv"], "o": pick["o"]}
    return None


def _attention_styles(
    where: str,
    module: nn.Module,
    roles: dict[str, str],
    config: Any,
    axis: str,
    seq: Literal["replicated", "sequence"],
) -> list[HeadParallelAttention]:
    """The candidate styles for one attention module (several for a fused q|k|v whose layout
    the shapes do not tell)."""
    kind = type(module).__name__
    d = _cfg_int(module, "head_dim", "head_size") or _cfg_int(config, "head_dim")
    hq = _cfg_int(module, "num_heads", "num_attention_heads") or _cfg_int(
        config, "num_attention_heads"
    )
    if d is None and hq:
        hidden = _cfg_int(config, "hidden_size")
        d = hidden // hq if hidden and hidden % hq == 0 else None
    o_in = _dims(getattr(module, roles["o"]))[0]  # type: ignore[index]
    if d is None or not hq:
        raise ParallelizeError(
            f"plans.auto: attention {where!r} ({kind}): its head dim or head count is not in "
            "the module (head_dim, num_heads) or the config (head_dim, num_attention_heads). "
            "Fix: write a HeadParallelAttention for it"
        )
    if "qkv" in roles:
        total = _dims(getattr(module, roles["qkv"]))[1]  # type: ignore[index]
        if total % d or (total // d - hq) % 2 or total // d <= hq:
            raise ParallelizeError(
                f"plans.auto: attention {where!r} ({kind}): the fused {roles['qkv']!r} has "
                f"{total} output features, not q|k|v of {hq} query heads of {d} (and as many "
                "k as v heads). Fix: write a HeadParallelAttention for it"
            )
        hkv = (total // d - hq) // 2
        layouts = ["concat", "per_head"] if hkv == hq else ["concat", "grouped"]
        names: dict[str, Any] = {"qkv": roles["qkv"], "o": roles["o"]}
    else:
        q_out = _dims(getattr(module, roles["q"]))[1]  # type: ignore[index]
        k_out = _dims(getattr(module, roles["k"]))[1]  # type: ignore[index]
        if q_out % d or k_out % d:
            raise ParallelizeError(
                f"plans.auto: attention {where!r} ({kind}): q has {q_out} and k {k_out} output "
                f"features, not whole heads of {d}. Fix: write a HeadParallelAttention for it"
            )
        hq, hkv = q_out // d, k_out // d
        layouts = ["concat"]
        names = {r: roles[r] for r in ("q", "k", "v", "o")}
    if o_in != hq * d:
        raise ParallelizeError(
            f"plans.auto: attention {where!r} ({kind}): {roles['o']!r} takes {o_in} features, "
            f"not the {hq} heads x {d} the projections give. Fix: write a plan for it"
        )
    norms: list[str] = []
    full: list[tuple[str, str]] = []
    lists: list[tuple[str, str]] = []
    for child, sub in module.named_children():
        if child in roles.values() or not any(p is not None for p in sub.parameters()):
            continue
        w = getattr(sub, "weight", None)
        inner = getattr(sub, "norms", None)
        which = "k" if child.startswith("k") else "q"
        if isinstance(w, Tensor) and w.dim() == 1 and w.shape[0] == d:
            norms.append(child)
        elif isinstance(w, Tensor) and w.dim() == 1 and w.shape[0] in (hq * d, hkv * d):
            size = int(w.shape[0])
            full.append((child, which if hq == hkv else ("q" if size == hq * d else "k")))
        elif isinstance(inner, nn.ModuleList) and len(inner) in (hq, hkv):
            lists.append((child, which if hq == hkv else ("q" if len(inner) == hq else "k")))
        else:
            raise ParallelizeError(
                f"plans.auto: attention {where!r} ({kind}) has a child {child!r} "
                f"({type(sub).__name__}) with parameters that is neither a projection nor a "
                f"norm over one head ({d}), a whole projection ({hq * d} or {hkv * d}) or a "
                "list of per-head norms. Fix: write a HeadParallelAttention for it"
            )
    widths = {hq * d: "hq*d", hkv * d: "hkv*d", (hq + 2 * hkv) * d: "all*d"}
    funcs: dict[str, Callable[[int, int, int], int]] = {
        "hq*d": lambda a, b, e: a * e,
        "hkv*d": lambda a, b, e: b * e,
        "all*d": lambda a, b, e: (a + 2 * b) * e,
    }
    reads = _forward_reads(module)
    attrs = tuple(
        (attr, funcs[widths[value]])
        for attr, value in sorted(vars(module).items())
        if type(value) is int
        and value in widths
        and value != d
        and attr in reads
        and attr not in _NOT_WIDTHS
    )
    known = {f.name for f in fields(HeadParallelAttention)}
    # Other integers the module holds are left as they are (the style would refuse those whose
    # value equals a head count or width, e.g. GPT-J's rotary_dim = 4 = its head count): the
    # candidate is verified, which finds the ones that had to change.
    patched = {a for a, _ in attrs}
    keep = tuple(
        a
        for a, v in sorted(vars(module).items())
        if type(v) is int and a not in patched and not re.search(r"head|group", a)
    )
    # the module's own parameters with one entry per query head (GPT-OSS's attention sinks)
    per_head = tuple(
        n for n, p in module.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == hq
    )
    out = []
    for layout in layouts:
        extra: dict[str, Any] = {"qkv_layout": layout} if "qkv" in names else {}
        if per_head:
            extra["head_params"] = per_head
        if keep and "keep" in known:
            extra["keep"] = keep
        if full:
            extra["full_width_norms"] = tuple(full)
        if lists:
            extra["head_norm_lists"] = tuple(lists)
        missing = [k for k in extra if k not in known]
        if missing:
            raise ParallelizeError(
                f"plans.auto: attention {where!r} ({kind}) needs HeadParallelAttention({missing[0]}"
                "=...), which this fastdist does not have. Fix: write a plan for it"
            )
        out.append(
            HeadParallelAttention(
                hq,
                hkv,
                d,
                axis,
                input=seq,
                output=seq,
                attrs=attrs,
                norms=tuple(norms),
                **names,
                **extra,
            )
        )
    return out


def _dense_mlps(
    block: nn.Module, hidden: int, skip: str | None
) -> Iterator[tuple[str, list[tuple[str, int | None]], str]]:
    """(relative name, [(up child, fused half or None)], down child) of every dense MLP."""
    for rel, module in block.named_modules():
        if skip is not None and (rel == skip or rel.startswith(skip + ".")):
            continue
        kids = {n: _dims(c) for n, c in module.named_children()}
        lin = {n: d for n, d in kids.items() if d is not None}
        if len(lin) < 2 or len(lin) != len([c for c in module.children()]) - _plain_count(module):
            continue
        downs = [n for n, (i, o) in lin.items() if o == hidden and i != hidden]
        if len(downs) != 1:
            continue
        inter = lin[downs[0]][0]
        ups: list[tuple[str, int | None]] = []
        for n, (i, o) in lin.items():
            if n == downs[0]:
                continue
            if i != hidden or o not in (inter, 2 * inter):
                break
            ups.append((n, inter if o == 2 * inter else None))
        else:
            if ups:
                yield rel, ups, downs[0]


def _plain_count(module: nn.Module) -> int:
    """Children without parameters (activations, dropout): an MLP may hold any number."""
    return sum(1 for c in module.children() if not list(c.parameters()))


def _experts(block: nn.Module) -> list[str]:
    """Relative names of experts modules with 3-D ``gate_up_proj``/``down_proj``."""
    out = []
    for rel, module in block.named_modules():
        gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if isinstance(gu, Tensor) and isinstance(dn, Tensor) and gu.dim() == dn.dim() == 3:
            out.append(rel)
    return out


def _call(model: nn.Module, method: str) -> nn.Module | None:
    """``model.<method>()`` (transformers' embedding getters) where it has one."""
    fn = getattr(type(model), method, None)
    if not callable(fn):
        return None
    try:
        got = fn(model)
    except (NotImplementedError, AttributeError):
        return None
    return got if isinstance(got, nn.Module) else None


def _name_of(model: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    return next((n for n, m in model.named_modules() if m is target), None)


def _candidates(model: nn.Module, axis: str, sequence_parallel: bool) -> list[Plan]:
    config = getattr(model, "config", None)
    kind = type(model).__name__
    layers, blocks = _blocks(model)
    block = blocks[0]
    seq: Literal["replicated", "sequence"] = "sequence" if sequence_parallel else "replicated"
    found = _find_attention(block)
    if found is None:
        raise ParallelizeError(
            f"plans.auto: {kind}: no attention found in {layers}.0 ({type(block).__name__}): "
            f"no module with q/k/v/o projections ({'/'.join(_Q[:3])}, ...; "
            f"{'/'.join(_O[:3])}, ...) or a fused one ({'/'.join(_QKV[:3])}, ...) among "
            f"{[n for n, _ in block.named_modules()][1:8]}. Fix: write a plan for it"
        )
    rel, attention, roles = found
    where = f"{layers}.0.{rel}"
    attn_styles = _attention_styles(where, attention, roles, config, axis, seq)
    emb = _call(model, "get_input_embeddings")
    emb_weight = getattr(emb, "weight", None)
    hidden = (
        int(emb_weight.shape[1])
        if isinstance(emb_weight, Tensor) and emb_weight.dim() == 2
        else _cfg_int(config, "hidden_size", "n_embd", "d_model")
    )
    if hidden is None:
        raise ParallelizeError(
            f"plans.auto: {kind}: the hidden size is neither the input embedding's width nor "
            "config.hidden_size. Fix: write a plan for it"
        )
    common: Plan = {}
    mlps = list(_dense_mlps(block, hidden, rel))
    for mlp, ups, down in mlps:
        base = f"{layers}.*.{mlp}" if mlp else f"{layers}.*"
        common[base] = PrepareInput(axis, seq)
        for up, half in ups:
            common[f"{base}.{up}"] = ColwiseParallel(axis, parts=(half, half) if half else ())
        common[f"{base}.{down}"] = RowwiseParallel(axis, seq)
    experts = _experts(block)
    if experts and sequence_parallel:
        raise ParallelizeError(
            f"plans.auto: {kind} has experts ({layers}.0.{experts[0]}), which take replicated "
            "tokens: no sequence parallelism. Fix: sequence_parallel=False"
        )
    for ex in experts:
        common[f"{layers}.*.{ex}"] = ExpertParallel(axis, "all_to_all", None)
    if not mlps and not experts:
        raise ParallelizeError(
            f"plans.auto: {kind}: no MLP found in {layers}.0 (a module whose linear layers go "
            f"from {hidden} features to I, or 2I fused, and one back from I) and no experts "
            "with 3-D gate_up_proj/down_proj. Fix: write a plan for it"
        )
    emb_name = _name_of(model, emb)
    head = _call(model, "get_output_embeddings")
    head_name = _name_of(model, head)
    emb_style: VocabParallel | None = None
    if emb_name and isinstance(emb, nn.Embedding):
        scaled = hasattr(emb, "embed_scale") and type(emb).forward is not nn.Embedding.forward
        has_scale = "scale" in {f.name for f in fields(VocabParallel)}
        if not scaled:
            emb_style = VocabParallel(axis)
        elif has_scale:
            scale: dict[str, Any] = {"scale": "embed_scale"}
            emb_style = VocabParallel(axis, **scale)
        if type(emb).forward is not nn.Embedding.forward and not scaled:
            emb_style = None
    if emb_style is not None:
        common[emb_name] = emb_style  # type: ignore[index]
    tied = (
        head is not None
        and emb is not None
        and getattr(head, "weight", None) is getattr(emb, "weight", 0)
    )
    if (
        head_name
        and head is not None
        and _dims(head) is not None
        and (emb_style is not None or not tied)
    ):
        common[head_name] = VocabParallel(axis, input="replicated")
    if sequence_parallel:
        parent = layers.rpartition(".")[0]
        owner = model.get_submodule(parent) if parent else model
        final = [n for n, c in owner.named_children() if "norm" in (n + type(c).__name__).lower()]
        if len(final) != 1:
            raise ParallelizeError(
                f"plans.auto: {kind}: sequence parallelism needs the one norm after {layers} "
                f"(found {final} among the children of {parent or 'the model'!r}). Fix: "
                "sequence_parallel=False, or write a plan"
            )
        common[f"{layers}.0"] = SequenceShard(axis)
        common[f"{parent}.{final[0]}".lstrip(".")] = GatherSequence(axis)
        for n, c in block.named_children():
            if "norm" in (n + type(c).__name__).lower() and list(c.parameters()):
                common[f"{layers}.*.{n}"] = PvaryParams(axis)
    return [{**common, f"{layers}.*.{rel}": style} for style in attn_styles]


class AutoPlan(dict[str, Any]):
    """The plan `auto` returns: a plain dict of styles (its first guess) that also holds the
    ``candidates`` to try where the module tree leaves a choice open (the first guess first).
    `fastdist.nn.parallelize` with ``verify`` tries them in order and applies the first that
    matches one device."""

    candidates: list[Plan]


def auto(model: nn.Module, *, axis: str = "tp", sequence_parallel: bool = False) -> AutoPlan:
    """A tensor-parallel plan over ``axis`` inferred from ``model``'s module tree (see the module
    docstring for what it finds), with Megatron-style sequence parallelism when
    ``sequence_parallel``.

    The result is the first guess, unchecked; ``parallelize(model, mesh, auto(model),
    verify=True)`` (or ``parallelize(model, mesh, "auto")``) verifies it and, where the shapes
    left a choice open (a fused q|k|v's layout), tries the other ``candidates`` in turn.

    Raises `ParallelizeError` naming the module auto cannot read: no repeated blocks, no
    attention or MLP it recognises, a child of the attention it cannot place, experts with
    ``sequence_parallel``.

    >>> import torch, fastdist as fd
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2))
    >>> plan = fd.nn.plans.auto(m)
    >>> print(*sorted(plan)[:3])
    lm_head model.embed_tokens model.layers.*.mlp
    >>> plan["model.layers.*.self_attn"].num_kv_heads, len(plan.candidates)
    (2, 1)
    """
    candidates = _candidates(model, axis, sequence_parallel)
    plan = AutoPlan(candidates[0])
    plan.candidates = candidates
    return plan
