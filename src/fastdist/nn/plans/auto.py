"""An automatic plan: the `Family` record of a model nobody wrote a row for, read off its module
tree.

`infer` finds, from the modules and their shapes (not from class names it knows):

* the decoder blocks: the largest ``nn.ModuleList`` of modules of one class, grouped by their
  structure (submodule names, classes and parameter shapes): blocks that differ (dense MLPs in
  the first layers and experts in the rest, a convolution or a recurrence in place of the
  attention) get a plan each, by layer index; a block without an attention keeps its mixer
  whole on every rank. With sequence parallelism every block must hold the same modules as the
  first (anything else would mix a rank's tokens only), and no block may hold experts;
* in a block, the attention: a module with ``q``/``k``/``v``/``o`` projections (names
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
or per kv group), `infer` returns every layout; the plan (`AutoPlan`) holds one plan per layout
as ``candidates``, and ``parallelize`` with ``verify`` tries them in turn and applies the first
that matches one device. ``parallelize(model, mesh, "auto")`` is ``parallelize(model, mesh,
fastdist.nn.plans.plan(model, mesh, family="auto"), verify=True)``. A model `infer` cannot
read, or whose every candidate fails verification, is refused with a `ParallelizeError` naming
the module.
"""

from __future__ import annotations

import inspect
import itertools
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor, nn

from fastdist.errors import ParallelizeError
from fastdist.nn.plans.family import Family, Mlp, Plan, build_plan

__all__ = ["AutoPlan", "BlockGroup", "auto_plan", "infer", "infer_groups"]

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
            "(print fastdist.nn.plans.plan(model, mesh) of a known family for the shape of one)"
        )
    return best[1], best[2]


def _forward_reads(module: nn.Module) -> set[str]:
    try:
        src = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return set()
    return set(re.findall(r"\bself\.(\w+)", src))


def _config_reads(module: nn.Module) -> set[str]:
    """The config fields ``module``'s classes read (``self.config.X``), and the functions of
    their source files (``module.config.X``: transformers' attention helpers)."""
    out: set[str] = set()
    for klass in type(module).__mro__:
        if klass in (nn.Module, object):
            break
        try:
            out |= set(re.findall(r"\bself\.config\.(\w+)", inspect.getsource(klass)))
            text = inspect.getsource(sys.modules[klass.__module__])
        except (OSError, TypeError, KeyError):
            continue
        out |= set(re.findall(r"\bmodule\.config\.(\w+)", text))
    return out


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


def _heads(
    where: str, module: nn.Module, roles: dict[str, str], config: Any
) -> tuple[int, int, int, list[str], dict[str, Any]]:
    """(query heads, kv heads, head dim, the fused q|k|v layouts to try, the projections'
    names) of one attention module."""
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
    return hq, hkv, d, layouts, names


def _inner_norms(
    where: str, module: nn.Module, roles: dict[str, str], hq: int, hkv: int, d: int
) -> dict[str, Any]:
    """The attention's norms as `Family` fields: over one head (``head_norms``), over a whole
    projection (``full_width_norms``), lists of per-head norms (``head_norm_lists``)."""
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
                f"plans.auto: attention {where!r} ({type(module).__name__}) has a child "
                f"{child!r} ({type(sub).__name__}) with parameters that is neither a projection "
                f"nor a norm over one head ({d}), a whole projection ({hq * d} or {hkv * d}) or "
                "a list of per-head norms. Fix: write a HeadParallelAttention for it"
            )
    return {
        "head_norms": tuple(norms),
        "full_width_norms": tuple(full),
        "head_norm_lists": tuple(lists),
    }


def _attention_fields(
    where: str, rel: str, module: nn.Module, roles: dict[str, str], config: Any
) -> tuple[dict[str, Any], list[str]]:
    """The `Family` fields of one attention module, and the fused q|k|v layouts to try (several
    where the shapes do not tell)."""
    hq, hkv, d, layouts, names = _heads(where, module, roles, config)
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
    # Other integers the module holds are left as they are (the style would refuse those whose
    # value equals a head count or width, e.g. GPT-J's rotary_dim = 4 = its head count): the
    # candidate is verified, which finds the ones that had to change.
    patched = {a for a, _ in attrs}
    keep = tuple(
        a
        for a, v in sorted(vars(module).items())
        if type(v) is int and a not in patched and not re.search(r"head|group", a)
    )
    # and so are the config's integers its methods read (GPT-Neo's window_size = 4 = its head
    # count); those named as head counts are the style's to set per rank
    cfg = getattr(module, "config", None)
    keep += tuple(
        f
        for f in sorted(_config_reads(module))
        if type(getattr(cfg, f, None)) is int
        and f not in keep
        and not re.search(r"head|group|kv", f)
    )
    # the module's own parameters with one entry per query head (GPT-OSS's attention sinks)
    per_head = tuple(
        n for n, p in module.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == hq
    )
    out = {
        "attention": rel,
        "heads": hq,
        "kv_heads": hkv,
        "head_dim": d,
        **names,
        **_inner_norms(where, module, roles, hq, hkv, d),
        "attrs": attrs,
        "keep": keep,
        "head_params": per_head,
    }
    return out, layouts


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


def _vocab_fields(model: nn.Module) -> dict[str, Any]:
    """The embedding (with its scale) and the LM head as `Family` fields (``None``: left
    replicated)."""
    emb = _call(model, "get_input_embeddings")
    emb_name = _name_of(model, emb)
    head = _call(model, "get_output_embeddings")
    head_name = _name_of(model, head)
    out: dict[str, Any] = {"embed": None, "head": None}
    if emb_name and isinstance(emb, nn.Embedding):
        scaled = hasattr(emb, "embed_scale") and type(emb).forward is not nn.Embedding.forward
        if scaled:
            out.update(embed=emb_name, embed_scale="embed_scale")
        elif type(emb).forward is nn.Embedding.forward:
            out["embed"] = emb_name
    tied = (
        head is not None
        and emb is not None
        and getattr(head, "weight", None) is getattr(emb, "weight", 0)
    )
    if head_name and head is not None and _dims(head) is not None:
        if out["embed"] is not None or not tied:
            out["head"] = head_name
    return out


def _hidden(model: nn.Module, config: Any) -> int:
    emb_weight = getattr(_call(model, "get_input_embeddings"), "weight", None)
    hidden = (
        int(emb_weight.shape[1])
        if isinstance(emb_weight, Tensor) and emb_weight.dim() == 2
        else _cfg_int(config, "hidden_size", "n_embd", "d_model")
    )
    if hidden is None:
        raise ParallelizeError(
            f"plans.auto: {type(model).__name__}: the hidden size is neither the input "
            "embedding's width nor config.hidden_size. Fix: write a plan for it"
        )
    return hidden


def _norm_fields(model: nn.Module, layers: str, block: nn.Module) -> dict[str, Any]:
    """The norm after the decoder blocks and the blocks' own norms (for sequence parallelism)."""
    parent = layers.rpartition(".")[0]
    owner = model.get_submodule(parent) if parent else model
    final = [n for n, c in owner.named_children() if "norm" in (n + type(c).__name__).lower()]
    if len(final) != 1:
        raise ParallelizeError(
            f"plans.auto: {type(model).__name__}: sequence parallelism needs the one norm after "
            f"{layers} (found {final} among the children of {parent or 'the model'!r}). Fix: "
            "sequence_parallel=False, or write a plan"
        )
    norms = tuple(
        n
        for n, c in block.named_children()
        if "norm" in (n + type(c).__name__).lower() and list(c.parameters())
    )
    return {"final_norm": f"{parent}.{final[0]}".lstrip("."), "norms": norms}


#: an attention in a block: (relative name, module, role -> child name)
_Found = tuple[str, nn.Module, dict[str, str]]
#: a block's structure: its submodules' (name, class) and its parameters' (name, shape)
Signature = tuple[tuple[tuple[str, str], ...], tuple[tuple[str, tuple[int, ...]], ...]]


def _signature(block: nn.Module) -> Signature:
    mods = tuple((n, type(m).__name__) for n, m in block.named_modules())
    return mods, tuple((n, tuple(p.shape)) for n, p in block.named_parameters())


def _groups(blocks: nn.ModuleList) -> list[tuple[int, ...]]:
    """The blocks' indices grouped by structure (`_signature`), in order of first appearance."""
    out: dict[Signature, list[int]] = {}
    for i, block in enumerate(blocks):
        out.setdefault(_signature(block), []).append(i)
    return [tuple(v) for v in out.values()]


def _refuse_mixed_blocks(kind: str, layers: str, blocks: nn.ModuleList) -> None:
    """Sequence parallelism runs every block on this rank's tokens, gathering them only for the
    planned attention: a block holding other modules than the first (a convolution, a
    recurrence, another attention) would mix a rank's tokens only. Verification cannot stand in:
    a meta model is checked on a two-layer copy, which may not hold such a block."""
    first = [(n, type(m).__name__) for n, m in blocks[0].named_modules()]
    for i, block in enumerate(blocks):
        mods = [(n, type(m).__name__) for n, m in block.named_modules()]
        if mods == first:
            continue
        extra = [f"{n} ({c})" for n, c in mods if (n, c) not in first]
        missing = [f"{n} ({c})" for n, c in first if (n, c) not in mods]
        raise ParallelizeError(
            f"plans.auto: {kind}: sequence parallelism runs every block of {layers} on this "
            f"rank's tokens and gathers them only for the attention planned from {layers}.0, "
            f"but {layers}.{i} ({type(block).__name__}) holds other modules (here: {extra[:3]}; "
            f"not here: {missing[:3]}): a module that mixes tokens there (a convolution, a "
            "recurrence, another attention) would see only this rank's. Fix: "
            "sequence_parallel=False (blocks without the planned attention run it whole on "
            "every rank), or write a plan"
        )


@dataclass(frozen=True)
class BlockGroup:
    """Decoder blocks of one structure: their ``layers`` (indices), their `Family` record, the
    fused q|k|v ``layouts`` to try (the record's first) and whether they hold an ``attention``
    the record describes (without: the record's attention fields are another group's and the
    blocks' mixer stays whole on every rank)."""

    layers: tuple[int, ...]
    family: Family
    layouts: tuple[str, ...]
    attention: bool


def infer_groups(model: nn.Module, *, sequence_parallel: bool = False) -> list[BlockGroup]:
    """`BlockGroup` records of ``model``'s decoder blocks, one per structure (see the module
    docstring), read off its module tree. Raises `ParallelizeError` naming the module it
    cannot read: no block with an attention, a block without an MLP or experts, experts or
    blocks of differing structure with ``sequence_parallel``."""
    config = getattr(model, "config", None)
    kind = type(model).__name__
    layers, blocks = _blocks(model)
    if sequence_parallel:
        _refuse_mixed_blocks(kind, layers, blocks)
    groups = _groups(blocks)
    found = [_find_attention(blocks[g[0]]) for g in groups]
    first = next((i for i, f in enumerate(found) if f is not None), None)
    if first is None:
        block = blocks[0]
        others = " (nor in any other block)" if len(groups) > 1 else ""
        raise ParallelizeError(
            f"plans.auto: {kind}: no attention found in {layers}.0 ({type(block).__name__})"
            f"{others}: no module with q/k/v/o projections ({'/'.join(_Q[:3])}, ...; "
            f"{'/'.join(_O[:3])}, ...) or a fused one ({'/'.join(_QKV[:3])}, ...) among "
            f"{[n for n, _ in block.named_modules()][1:8]}. Fix: write a plan for it"
        )
    read = _Read(
        kind,
        layers,
        blocks,
        _hidden(model, config),
        {
            **_vocab_fields(model),
            **(_norm_fields(model, layers, blocks[0]) if sequence_parallel else {}),
        },
        sequence_parallel,
        config,
    )
    main = _group_attention(layers, groups[first], found[first], config)
    out = []
    for g, f in zip(groups, found, strict=True):
        attn, layouts = main if f is None else _group_attention(layers, g, f, config)
        family = _group_family(read, g, attn, layouts, f)
        out.append(BlockGroup(g, family, tuple(layouts), f is not None))
    return out


@dataclass(frozen=True)
class _Read:
    """What `infer_groups` read off the whole model, for each group's record."""

    kind: str
    layers: str
    blocks: nn.ModuleList
    hidden: int
    shared: dict[str, Any]  # the embedding, head and (sequence parallelism) norm fields
    sequence_parallel: bool
    config: Any


def _group_attention(
    layers: str, group: tuple[int, ...], found: _Found | None, config: Any
) -> tuple[dict[str, Any], list[str]]:
    """`_attention_fields` of the attention ``found`` in the first block of ``group``."""
    assert found is not None
    rel, attention, roles = found
    return _attention_fields(f"{layers}.{group[0]}.{rel}", rel, attention, roles, config)


def _group_family(
    read: _Read,
    group: tuple[int, ...],
    attn: dict[str, Any],
    layouts: list[str],
    found: _Found | None,
) -> Family:
    """The `Family` record of one group of blocks (read off its first)."""
    kind, hidden = read.kind, read.hidden
    block, where = read.blocks[group[0]], f"{read.layers}.{group[0]}"
    mlps = tuple(
        Mlp(mlp, tuple(up for up, _ in ups), down, tuple((u, h) for u, h in ups if h))
        for mlp, ups, down in _dense_mlps(block, hidden, found[0] if found else None)
    )
    experts = tuple(_experts(block))
    if experts and read.sequence_parallel:
        raise ParallelizeError(
            f"plans.auto: {kind} has experts ({where}.{experts[0]}), which take replicated "
            "tokens: no sequence parallelism. Fix: sequence_parallel=False"
        )
    if not mlps and not experts:
        raise ParallelizeError(
            f"plans.auto: {kind}: no MLP found in {where} (a module whose linear layers go "
            f"from {hidden} features to I, or 2I fused, and one back from I) and no experts "
            "with 3-D gate_up_proj/down_proj. Fix: write a plan for it"
        )
    return Family(
        (str(getattr(read.config, "model_type", kind)),),
        prefix="",
        layers=read.layers,
        **attn,
        qkv_layout=layouts[0],  # type: ignore[arg-type]
        # with experts, the block's MLPs (shared experts) sit beside them in every layer
        mlps=() if experts else mlps,
        experts=experts,
        shared=mlps if experts else (),
        moe_block="",
        **read.shared,
    )


def infer(model: nn.Module, *, sequence_parallel: bool = False) -> tuple[Family, list[str]]:
    """The `Family` record of ``model``'s first blocks that hold an attention, read off its
    module tree (see the module docstring), and the fused q|k|v layouts to try (the record's
    first); `infer_groups` gives every group of blocks. Raises `ParallelizeError` naming the
    module it cannot read."""
    group = next(g for g in infer_groups(model, sequence_parallel=sequence_parallel) if g.attention)
    return group.family, list(group.layouts)


def _per_layer(plan: Plan, layers: str, which: tuple[int, ...], count: int) -> Plan:
    """``plan`` with its ``layers.*`` patterns naming the blocks ``which`` (unchanged when that is
    all ``count`` of them)."""
    if len(which) == count:
        return plan
    out: Plan = {}
    star = f"{layers}.*"
    for key, style in plan.items():
        if key == star or key.startswith(star + "."):
            for i in which:
                out[f"{layers}.{i}{key[len(star) :]}"] = style
        else:
            out[key] = style
    return out


class AutoPlan(dict[str, Any]):
    """The plan `auto_plan` returns: a plain dict of styles (its first guess) that also holds the
    ``candidates`` to try where the module tree leaves a choice open (the first guess first)
    and the ``family`` record they were built from. `fastdist.nn.parallelize` with ``verify``
    tries them in order and applies the first that matches one device; ``groups``: the decoder
    blocks by structure (one group when all blocks are alike)."""

    candidates: list[Plan]
    family: Family
    groups: list[BlockGroup]


def auto_plan(model: nn.Module, *, axis: str = "tp", sequence_parallel: bool = False) -> AutoPlan:
    """A tensor-parallel plan over ``axis`` built from `infer`'s record of ``model``, with
    Megatron-style sequence parallelism when ``sequence_parallel``: the first guess, unchecked,
    with one candidate plan per fused q|k|v layout left open (what
    ``fastdist.nn.plans.plan(model, mesh, family="auto")`` returns).

    >>> import torch, fastdist as fd
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2))
    >>> plan = fd.nn.plans.plan(m, fd.Mesh({"tp": 2}), family="auto")
    >>> print(*sorted(plan)[1:4])  # [0] is "" (the whole model: RefusePartialOutputs)
    lm_head model.embed_tokens model.layers.*.mlp
    >>> plan["model.layers.*.self_attn"].num_kv_heads, len(plan.candidates)
    (2, 1)
    """
    groups = infer_groups(model, sequence_parallel=sequence_parallel)
    config = getattr(model, "config", None)
    count = sum(len(g.layers) for g in groups)
    candidates: list[Plan] = []
    # one candidate per choice of layouts (each group's first first); a handful at most
    for choice in itertools.islice(itertools.product(*(g.layouts for g in groups)), 8):
        candidate: Plan = {}
        for g, layout in zip(groups, choice, strict=True):
            fam = replace(g.family, qkv_layout=layout)  # type: ignore[arg-type]
            part = build_plan(
                fam,
                config,
                axis=axis,
                ep_axis=None,
                strategy="all_to_all",
                capacity_factor=None,
                sequence_parallel=sequence_parallel,
                gather_logits=False,
            )
            if not g.attention:  # the blocks' own mixer, whole on every rank
                part.pop(f"{fam.layers}.*.{fam.attention}", None)
            for key, style in _per_layer(part, fam.layers, g.layers, count).items():
                candidate.setdefault(key, style)
        candidates.append(candidate)
    plan = AutoPlan(candidates[0])
    plan.candidates = candidates
    plan.family = next(g.family for g in groups if g.attention)
    plan.groups = groups
    return plan
