"""Random draws in a forward that the ranks of a split model would make differently.

A model in training mode that draws random numbers in its forward (dropout masks, a router's
jitter noise, stochastic depth, layer drop) draws them on each process from that process's own
generator: the ranks of a group the plan splits over would hold different values where they must
hold the same ones, and their replicas diverge silently. (Data-parallel ranks may draw: they hold
different batches anyway.) `fastdist.nn.ParallelModel` refuses it with `ParallelizeError` in
three ways:

* up front (`RandomSites`): ``nn.Dropout`` modules with ``p > 0``, the attention dropout
  transformers' attention functions take from the config, and the config's settings whose name
  says drop / jitter / noise with a value > 0 that a module class of the model reads (the source
  of its ``__init__`` or ``forward`` names the setting; settings no module reads, a
  classification head's dropout, are not refused);
* at the call on real ranks (`generator_states` before and after the forward): the CPU generator's
  state and, for each accelerator device the call's tensors (else the model's first parameter)
  live on, its generator's offset (no device sync; about 6 us of CPU per call), in training mode
  when the plan splits over an axis of size > 1, outside ``torch.compile`` (a step compiled
  around the call gets only the up-front scan; a compiled module called inside it is watched:
  inductor's random ops draw their seeds from the generator);
* on simulated ranks: ``torch.vmap``'s own randomness error (`vmap_refusal`, the original kept as
  ``__cause__``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fastdist.errors import ParallelizeError

__all__ = ["RandomSites", "accelerators", "drawn", "generator_states", "is_vmap_randomness"]

#: a config setting's name that says it draws: dropout, pdrop, layerdrop, drop_path, jitter, noise
_RANDOM_SETTING = re.compile(r"drop|jitter|noise", re.IGNORECASE)
#: settings transformers' attention functions read from the config (no module of their own)
_ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop")
#: device types without a generator of their own
_HOST = ("cpu", "meta")


def _diverge(axes: Sequence[str] = ()) -> str:
    over = f" {tuple(axes)}" if axes else ""
    return (
        f"the ranks of a group the plan splits over{over} would draw different values for "
        "activations they must hold equal, and diverge silently"
    )


_VMAP = (
    "simulated ranks run every rank at once under torch.vmap, which draws no per-rank random "
    "numbers"
)


@dataclass(frozen=True)
class RandomSites:
    """Where a model draws random numbers in training mode, as far as its modules and config say.

    Attributes:
        refused: ``nn.Dropout`` modules (dotted names) with ``p > 0`` and config settings
            (``config.<name>=<value>``) the model reads: refused up front.
        settings: every config setting whose name says drop / jitter / noise with a value > 0
            (read or not): named by the errors raised at the call.
    """

    refused: tuple[str, ...]
    settings: tuple[str, ...]

    @classmethod
    def of(cls, module: nn.Module) -> RandomSites:
        """Scan ``module`` (its modules, the source of their classes' ``__init__`` and
        ``forward``, its ``config``)."""
        dropouts = [
            n
            for n, m in module.named_modules()
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
        ]
        settings = _config_settings(getattr(module, "config", None))
        read = _read_by(module, {n.rsplit(".", 1)[-1] for n in settings})
        refused = [
            f"config.{n}={v}"
            for n, v in settings.items()
            if n.rsplit(".", 1)[-1] in read or n.rsplit(".", 1)[-1] in _ATTENTION_DROPOUT
        ]
        return cls(tuple(dropouts + refused), tuple(f"config.{n}={v}" for n, v in settings.items()))

    def refusal(self, model: str, split: Sequence[str]) -> ParallelizeError:
        """The error for `refused` in training mode (``split``: the axes of size > 1 the plan
        splits over; none: the ranks are simulated)."""
        sites = self.refused
        noise = all(s.startswith("config.") and "drop" not in s for s in sites)
        return ParallelizeError(
            f"{model} is in training mode with {'random noise' if noise else 'dropout'} "
            f"({', '.join(sites[:4])}): {_diverge(split) if split else _VMAP}. "
            "Fix: set "
            f"{'these settings' if noise else 'the dropout probabilities'} to 0 (e.g. in the "
            "config) or call model.eval()"
        )

    def vmap_refusal(self, model: str) -> ParallelizeError:
        """The error for a random draw in a forward on simulated ranks (vmap refused it)."""
        return ParallelizeError(
            f"{model} drew random numbers in its forward on simulated ranks: {_VMAP} (and on "
            f"real ranks {_diverge()}).{self._hint()} Fix: set the model's dropout / noise "
            "probabilities to 0 or call model.eval()"
        )

    def drawn(
        self, model: str, axes: Sequence[str], rank: int, generators: Sequence[str]
    ) -> ParallelizeError:
        """The error for a forward on real ``rank`` in training mode, split over ``axes``, in
        which ``generators`` advanced."""
        return ParallelizeError(
            f"{model} drew random numbers in its forward in training mode on rank {rank} (the "
            f"{' and '.join(generators)} random generator advanced: a dropout mask, a router's "
            f"jitter noise, stochastic depth, ...): {_diverge(axes)}.{self._hint()} Fix: set "
            "the model's dropout / noise probabilities to 0 or call model.eval() (data "
            "parallelism alone, with no split axis, may draw)"
        )

    def _hint(self) -> str:
        if not self.settings:
            return ""
        return f" The config's settings that may draw: {', '.join(self.settings[:6])}."


def _config_settings(config: Any) -> dict[str, float]:
    """``config``'s numeric settings > 0 whose name says drop / jitter / noise, by dotted name
    (nested configs, a multimodal model's ``text_config``, included). A Hugging Face config
    (``to_dict``) or a mapping (diffusers' ``FrozenDict``); anything else: none."""
    to_dict = getattr(config, "to_dict", None)
    found: dict[str, float] = {}

    def walk(prefix: str, items: Mapping[Any, Any]) -> None:
        for key, value in items.items():
            if isinstance(value, Mapping):
                walk(f"{prefix}{key}.", value)
            elif (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and value > 0
                and _RANDOM_SETTING.search(str(key))
            ):
                found[f"{prefix}{key}"] = value

    if callable(to_dict):
        walk("", to_dict())
    elif isinstance(config, Mapping):
        walk("", config)
    return found


def _read_by(module: nn.Module, names: set[str]) -> set[str]:
    """The ``names`` that the source of ``__init__`` or ``forward`` of a class of ``module``'s
    modules (or of a base class outside torch) names as a word: settings the model reads. A
    method without source reads none (the check at the call still catches its draws)."""
    if not names:
        return set()
    classes = {c for m in module.modules() for c in type(m).__mro__}
    methods = {
        f
        for c in classes
        if not c.__module__.startswith(("torch.", "builtins"))
        for f in (c.__dict__.get("__init__"), c.__dict__.get("forward"))
        if inspect.isfunction(f)
    }
    sources = []
    for f in methods:
        try:
            sources.append(inspect.getsource(f))
        except (OSError, TypeError):
            continue
    return {n for n in names if any(re.search(rf"\b{re.escape(n)}\b", s) for s in sources)}


def accelerators(module: nn.Module, values: Iterable[Any]) -> tuple[torch.device, ...]:
    """The devices other than CPU (and meta) whose generators a forward of ``module`` on
    ``values`` (a call's arguments) may draw from: those of the tensors among ``values``; none
    of them on one (a model moving its inputs itself): that of ``module``'s first parameter."""
    found = {v.device for v in values if isinstance(v, torch.Tensor) and v.device.type not in _HOST}
    if found or torch.accelerator.current_accelerator() is None:
        return tuple(found)
    first = next(module.parameters(), None)
    return () if first is None or first.device.type in _HOST else (first.device,)


def generator_states(devices: Sequence[torch.device]) -> tuple[Any, ...]:
    """A value per generator a forward on ``devices`` may draw from, changing with every draw:
    the CPU generator's state (about 5 KB, always first), each accelerator's offset (its Philox
    counter; no sync) or state (``None``: a generator that cannot be read)."""
    cpu = torch.default_generator.get_state().numpy().tobytes()
    if not devices:
        return (cpu,)
    return (cpu, *(_accelerator_state(d) for d in devices))


def _accelerator_state(device: torch.device) -> Any:
    try:
        backend: Any = torch.get_device_module(device.type)
        index = device.index
        if index is None:
            index = backend.current_device() if hasattr(backend, "current_device") else 0
        generators = getattr(backend, "default_generators", ())
        if index < len(generators):
            try:
                return generators[index].get_offset()
            except RuntimeError:
                return generators[index].get_state().numpy().tobytes()
        return backend.get_rng_state(index).numpy().tobytes()
    except Exception:  # a backend without these APIs (or not built in): not watched, never raised
        return None


def drawn(
    devices: Sequence[torch.device], before: Sequence[Any], after: Sequence[Any]
) -> list[str]:
    """The generators (``"CPU"``, a device) whose value changed between two `generator_states`
    of ``devices``."""
    if before == after:
        return []
    names = ["CPU", *map(str, devices)]
    return [n for n, a, b in zip(names, before, after, strict=True) if a != b]


def is_vmap_randomness(error: BaseException) -> bool:
    """``error`` is ``torch.vmap``'s refusal of a random op (``randomness="error"``)."""
    return isinstance(error, RuntimeError) and "randomness error mode" in str(error)
