"""A parallel model's own transformers config: `own_config` and the `OwnConfig` style.

A style that changes a field of a Hugging Face model's config (context parallelism names its
attention function in ``config._attn_implementation``) must not reach other models built from
the same config object: ``LlamaForCausalLM(cfg)`` twice shares ``cfg``, and the one never
parallelized would then call the parallel attention. `own_config` gives a module and every
submodule holding its config (or one of its sub-configs) a deep copy first.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from torch import nn

from fastdist.nn.styles.base import Style, StyleContext

__all__ = ["OwnConfig", "own_config", "position_dependent_rope"]

#: a module's plain attribute: the config object `own_config` gave it (already its own)
OWN = "_fastdist_own_config"


def own_config(module: nn.Module) -> Any:
    """Give ``module`` and every submodule whose ``config`` is ``module.config`` (or one of its
    sub-configs) a deep copy of it, once (a module `own_config` already gave its config keeps
    it); returns the module's config (None: it has none).

    >>> import torch
    >>> from types import SimpleNamespace
    >>> cfg = SimpleNamespace(x=1)
    >>> a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    >>> a.config = b.config = cfg
    >>> own_config(a) is cfg, b.config is cfg
    (False, True)
    """
    config = getattr(module, "config", None)
    if config is None or module.__dict__.get(OWN) is config:
        return config
    new = copy.deepcopy(config)
    subs = {id(config): new}
    for key in getattr(config, "sub_configs", None) or ():
        sub = getattr(config, key, None)
        if sub is not None:
            subs[id(sub)] = getattr(new, key)
    for m in module.modules():
        held = m.__dict__.get("config")
        if held is not None and id(held) in subs:
            m.config = subs[id(held)]
            m.__dict__[OWN] = m.config  # a plain attribute, not a submodule or buffer
    return new


@dataclass(frozen=True)
class OwnConfig(Style):
    """The whole model (a plan's ``""`` entry, applied before the styles below it): its own deep
    copy of its config on every module holding it (`own_config`), so a style below that sets a
    config field changes this model only."""

    def apply(self, module: nn.Module, name: str, ctx: StyleContext) -> nn.Module:
        own_config(module)
        return module


def position_dependent_rope(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers rotary embedding whose frequencies depend on the
    largest position it is given (``rope_type`` ``"dynamic"`` NTK scaling or ``"longrope"``,
    also per layer type): on a rank's own positions it would build other tables than one
    device's (context parallelism gives it the whole sequence's positions and cuts its tables),
    and with a KV cache it rotates earlier keys with other tables than without one (a
    generation without a cache gives other tokens).

    >>> from transformers import LlamaConfig
    >>> from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    >>> cfg = LlamaConfig(hidden_size=8, num_attention_heads=2, max_position_embeddings=8)
    >>> position_dependent_rope(LlamaRotaryEmbedding(cfg))
    False
    >>> cfg.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    >>> position_dependent_rope(LlamaRotaryEmbedding(cfg))
    True
    """
    kinds = getattr(module, "rope_type", None)
    kinds = kinds.values() if isinstance(kinds, dict) else (kinds,)
    return any(isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds)
