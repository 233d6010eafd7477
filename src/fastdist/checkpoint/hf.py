"""Storage naming for transformers' ``save_pretrained`` checkpoints: the names transformers
renames when it loads a model, and the experts it stores one tensor per expert.

* `hf_checkpoint_renames`: model name -> checkpoint name for transformers' renamings
  (``save_pretrained`` writes GPT-NeoX's ``lm_head`` as ``embed_out``);
* `fused_experts`: a checkpoint with one tensor per expert seen under the model's fused 3-D
  expert names (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek), each rank still reading only its slices.

`fastdist.checkpoint.load` applies both to a ``save_pretrained`` directory (or a
``.safetensors`` file) unless given ``rename=``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from fastdist.checkpoint.safetensors_io import open_source

__all__ = ["fused_experts", "hf_checkpoint_renames", "has_fused_experts"]


def _checkpoint_keys(source: Any) -> list[str]:
    """The tensor names of a safetensors file, a ``save_pretrained`` directory, or a state dict (a
    file that cannot be read raises `fastdist.errors.CheckpointError` naming it)."""
    if not isinstance(source, (str, os.PathLike, Mapping)):
        return []
    with open_source(source) as (shapes, _):
        return [str(k) for k in shapes]


def hf_checkpoint_renames(model: nn.Module, source: Any) -> dict[str, str] | None:
    """Model name -> checkpoint name for the renamings transformers applies when it loads this
    model's checkpoints (``save_pretrained`` writes GPT-NeoX's ``lm_head`` as ``embed_out``, as
    Pythia's checkpoints have it): only names the checkpoint holds and the model lacks. None
    when nothing is renamed (or transformers has no such table)."""
    if getattr(getattr(model, "config", None), "model_type", None) is None:
        return None  # not a transformers model: transformers (and DTensor, sympy) not imported
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return None
    rules: list[tuple[str, str]] = []
    kind = getattr(getattr(model, "config", None), "model_type", None)
    for key in dict.fromkeys((type(model).__name__, kind)):
        table = get_checkpoint_conversion_mapping(key) if key else None  # type: ignore[no-untyped-call]
        for rule in table or []:
            if type(rule) is WeightRenaming and len(rule.source_patterns) == 1:
                rules.append((rule.source_patterns[0], rule.target_patterns[0]))
    if not rules:
        return None
    own = set(model.state_dict(keep_vars=True))
    out: dict[str, str] = {}
    for key in _checkpoint_keys(source):
        if key in own:
            continue
        new = key
        for src, tgt in rules:
            new = re.sub(src, tgt, new)
        if new != key and new in own:
            out[new] = key
    return out or None


class _Slices:
    """A checkpoint tensor read by slices: ``shape`` and ``[slices]`` (what
    `fastdist.checkpoint.safetensors_io.read` asks of a state dict's values)."""

    def __init__(self, shape: tuple[int, ...], get: Callable[[tuple[slice, ...]], Tensor]):
        self.shape, self._get = shape, get

    def __getitem__(self, s: Any) -> Tensor:
        return self._get(s if isinstance(s, tuple) else (s,))


def _span(s: slice, size: int) -> tuple[int, int]:
    start, stop, step = s.indices(size)
    if step != 1:
        raise ValueError(f"fused_experts: a strided read ({s}) of a fused expert tensor")
    return start, max(start, stop)


def _merged(parts: list[list[_Slices]]) -> _Slices:
    """Experts merged on a new dim 0, the parts concatenated on dim 1: ``parts[k][e]`` is part
    ``k`` (e.g. gate, up) of expert ``e``, each (n_k, ...)."""
    E, sizes = len(parts[0]), [p[0].shape[0] for p in parts]
    rest = parts[0][0].shape[1:]

    def get(s: tuple[slice, ...]) -> Tensor:
        s = s + (slice(None),) * (2 + len(rest) - len(s))
        e0, e1 = _span(s[0], E)
        f0, f1 = _span(s[1], sum(sizes))
        experts = []
        for e in range(e0, e1):
            pieces, offset = [], 0
            for part, n in zip(parts, sizes, strict=True):
                lo, hi = max(f0, offset), min(f1, offset + n)
                if hi > lo:  # only the rows of this part the slice asks for
                    pieces.append(part[e][(slice(lo - offset, hi - offset), *s[2:])])
                offset += n
            experts.append(torch.cat(pieces, 0))  # (f1 - f0, ...)
        return torch.stack(experts)  # (e1 - e0, f1 - f0, ...)

    return _Slices((E, sum(sizes), *rest), get)


def _converters(model: nn.Module) -> list[tuple[list[str], str, bool]]:
    """transformers' rules that fuse per-expert checkpoint tensors into a model's 3-D expert
    parameters: (source patterns, target pattern, concatenated), for the two layouts it uses
    (experts merged on dim 0, then gate and up concatenated on dim 1, or not)."""
    if getattr(getattr(model, "config", None), "model_type", None) is None:
        return []  # not a transformers model: nothing to ask transformers about
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # pragma: no cover - a transformers without conversion rules
        return []
    mapping: Callable[[str], Any] = get_checkpoint_conversion_mapping
    kind = getattr(getattr(model, "config", None), "model_type", None)
    out = []
    for key in dict.fromkeys((type(model).__name__, kind)):
        for rule in (mapping(key) if key else None) or []:
            ops = [
                (type(o).__name__, getattr(o, "dim", None)) for o in getattr(rule, "operations", [])
            ]
            targets = getattr(rule, "target_patterns", [])
            if len(targets) != 1:
                continue
            if ops == [("MergeModulelist", 0), ("Concatenate", 1)]:
                out.append((list(rule.source_patterns), targets[0], True))
            elif ops == [("MergeModulelist", 0)] and len(rule.source_patterns) == 1:
                out.append((list(rule.source_patterns), targets[0], False))
    return out


def _renamings(model: nn.Module) -> list[tuple[str, str]]:
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # pragma: no cover
        return []
    mapping: Callable[[str], Any] = get_checkpoint_conversion_mapping
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return [
        (rule.source_patterns[0], rule.target_patterns[0])
        for key in dict.fromkeys((type(model).__name__, kind))
        for rule in (mapping(key) if key else None) or []
        if type(rule) is WeightRenaming and len(rule.source_patterns) == 1
    ]


@contextlib.contextmanager
def fused_experts(model: nn.Module, source: Any) -> Iterator[Mapping[str, Any]]:
    """A checkpoint whose experts are stored one tensor per expert (what transformers'
    ``save_pretrained`` writes for Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3:
    ``...experts.0.gate_proj.weight``, ``...experts.0.up_proj.weight``, ...), seen with the
    model's fused 3-D names (``...experts.gate_up_proj`` (E, 2I, H), ``...experts.down_proj``),
    for `fastdist.checkpoint.load`: each rank still reads only its own slices (its experts' rows
    of its tp shard), as transformers' own conversion rules say (experts merged on dim 0, gate
    and up concatenated on dim 1; renamings such as Mixtral's ``block_sparse_moe`` applied). Other
    tensors pass through. ``model``: the (parallelized) model; ``source``: a ``save_pretrained``
    directory or ``.safetensors`` file.

    >>> import tempfile, torch, fastdist as fd
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_attention_heads=4,
    ...     num_key_value_heads=2, num_experts=4, num_hidden_layers=1, moe_intermediate_size=8)
    >>> saved = tempfile.mkdtemp()
    >>> Qwen3MoeForCausalLM(cfg).save_pretrained(saved)
    >>> pm = fd.nn.parallelize(Qwen3MoeForCausalLM(cfg), fd.Mesh({"ep": 2}))
    >>> with fd.checkpoint.hf.fused_experts(pm.module, saved) as checkpoint:
    ...     extra = fd.checkpoint.load(checkpoint, pm)
    """
    rules, renames = _converters(model), _renamings(model)
    with open_source(source) as (shapes, reader):
        named: dict[str, _Slices] = {}
        for key, shape in shapes.items():
            new = key
            for src, tgt in renames:
                new = re.sub(src, tgt, new)
            named[new] = _Slices(tuple(shape), reader(key))
        out = dict(named)
        for key in model.state_dict(keep_vars=True):
            for sources, target, concatenated in rules if key not in named else []:
                if not key.endswith(target.lstrip(".")):
                    continue
                prefix = key[: len(key) - len(target.lstrip("."))]
                parts: list[list[_Slices]] = []
                for pattern in sources:
                    each, e = [], 0
                    while (name := prefix + pattern.lstrip(".").replace("*", str(e))) in named:
                        each.append(named.pop(name))
                        out.pop(name, None)
                        e += 1
                    parts.append(each)
                if parts and all(parts) and len({len(p) for p in parts}) == 1:
                    out[key] = _merged(parts if concatenated else parts[:1])
                    break
        yield out


def has_fused_experts(model: nn.Module) -> bool:
    """True when transformers fuses per-expert checkpoint tensors into ``model``'s 3-D expert
    parameters (then `fused_experts` reads its ``save_pretrained`` output)."""
    return bool(_converters(model))
