"""A model split into pipeline stages: each stage a copy of the model's skeleton holding only its
own decoder layers (placeholders for the rest, so parameter names stay the model's own), with
the hooks that hand activations in and out (see `fastdist.train.pipeline`)."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from fastdist.errors import PipelineError
from fastdist.nn.styles.context_recompute import in_backward

__all__ = [
    "SPLITS",
    "StageSplit",
    "StageHooks",
    "hand_on_last",
    "split_model",
    "tied_across_stages",
    "stage_plan",
    "retire",
    "decoder_layers",
    "family_split",
    "STAGE_INPUT",
    "recomputed_input",
    "refuse_router_aux_loss",
]


@dataclass(frozen=True)
class StageSplit:
    """Where a family keeps its decoder layers and what belongs to the first and last stages.

    Attributes:
        layers: the name of the ``nn.ModuleList`` of decoder layers.
        first: modules only the first stage holds (embeddings).
        last: modules only the last stage holds (final norm, LM head).
    """

    layers: str
    first: tuple[str, ...]
    last: tuple[str, ...]


_DECODER = StageSplit("model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"))

#: model_type -> how its decoder splits into stages
SPLITS: dict[str, StageSplit] = {
    **dict.fromkeys(
        (
            "llama",
            "mistral",
            "qwen2",
            "qwen3",
            "gemma",
            "gemma2",
            "gemma3_text",
            "phi3",
            "stablelm",
            "olmo",
            "olmo2",
            "mixtral",
            "qwen2_moe",
            "qwen3_moe",
            "olmoe",
            "deepseek_v2",
            "deepseek_v3",
            "gpt_oss",
        ),
        _DECODER,
    ),
    "gpt2": StageSplit(
        "transformer.h", ("transformer.wte", "transformer.wpe"), ("transformer.ln_f", "lm_head")
    ),
    "gpt_neox": StageSplit(
        "gpt_neox.layers", ("gpt_neox.embed_in",), ("gpt_neox.final_layer_norm", "lm_head")
    ),
    "falcon": StageSplit(
        "transformer.h", ("transformer.word_embeddings",), ("transformer.ln_f", "lm_head")
    ),
}


# ====================================================================== stage modules
class _Skip(nn.Module):
    """A layer another stage holds: passes its hidden-states input through (never with
    parameters; what it passes is replaced at this stage's first own layer)."""

    def forward(self, hidden_states: Any = None, *args: Any, **kwargs: Any) -> Any:
        return hidden_states


class _Zeros(nn.Module):
    """An embedding another stage holds: zeros of the hidden size (replaced before they are
    used)."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, ids: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        # one zero, expanded: no activation-sized buffer to allocate and fill per micro-batch
        zero = torch.zeros((), dtype=self.dtype, device=ids.device)
        return zero.expand(*ids.shape, self.dim)


class _Absent(nn.Module):
    """A module only the last stage holds; reaching it on another stage is a bug."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.what = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(
            f"pipeline: {self.what} ran on a stage that does not hold it (the stage's last layer "
            "should have ended its forward). Fix: report this as a fastdist bug"
        )


_PLACEHOLDERS = (_Skip, _Zeros, _Absent)


class _Handoff(Exception):  # noqa: N818 - control flow, not an error
    """Ends a non-last stage's forward at its last layer, carrying that layer's output."""

    def __init__(self, hidden: Tensor) -> None:
        super().__init__()
        self.hidden = hidden


#: the keyword under which a stage module receives its input activation
STAGE_INPUT = "fastdist_stage_input"


class StageHooks:
    """The hooks that make a copy of the model one stage: take the received activation at the
    first own layer, hand the last own layer's output on.

    A layer that gradient checkpointing recomputes in backward (non-reentrant: it is called
    again on the same input objects) runs its hooks again: the first own layer gets the
    activation it got in the forward (``swapped``: by its input tensor, weakly), the last one
    returns its output (the hand-on is the forward's only)."""

    def __init__(self, module: nn.Module, first: nn.Module | None, last: nn.Module | None) -> None:
        self.received: Tensor | None = None
        self.swapped: Any = WeakIdKeyDictionary()  # the layer's input -> the activation used
        self.handles = [module.register_forward_pre_hook(self._take, with_kwargs=True)]
        if first is not None:
            self.handles.append(
                first.register_forward_pre_hook(self.substitute, with_kwargs=True, prepend=True)
            )
        if last is not None:
            self.handles.append(last.register_forward_hook(self._hand_on))
            model_forward = module.forward

            def forward(*args: Any, **kwargs: Any) -> Any:
                # inside the (simulated) rank's call: the handoff's tensor is this rank's output
                try:
                    return model_forward(*args, **kwargs)
                except _Handoff as h:
                    return h.hidden

            module.forward = forward

    def _take(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        self.received = kwargs.pop(STAGE_INPUT, None)
        return args, kwargs

    def substitute(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        """Forward pre-hook of the first own layer: its hidden states replaced by the received
        activation (a subclass may hand in more than the hidden states)."""
        x, self.received = self.received, None
        x = recomputed_input(self.swapped, args[0] if args else kwargs.get("hidden_states"), x)
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    def handed_on(self, out: Any) -> Tensor:
        """The tensor the last own layer's output ``out`` hands on (its hidden states)."""
        return cast(Tensor, out[0] if isinstance(out, (tuple, list)) else out)

    def _hand_on(self, module: nn.Module, args: Any, out: Any) -> Any:
        if in_backward():  # recomputed by a checkpoint: the backward goes on through it
            return None
        raise _Handoff(self.handed_on(out))


def recomputed_input(swapped: Any, given: Any, received: Tensor | None) -> Tensor:
    """The activation a stage's first own layer runs on: ``received`` in a forward (recorded
    under the layer's own input ``given``), or in a checkpoint's recomputation in backward the
    one recorded for ``given``; raises when there is neither."""
    if received is not None:
        if isinstance(given, Tensor):
            swapped[given] = received
        return received
    if in_backward() and isinstance(given, Tensor) and given in swapped:
        return cast(Tensor, swapped[given])
    raise PipelineError(
        "pipeline: a stage after the first ran its first layer without the previous stage's "
        "activation (a reentrant gradient checkpoint, which detaches the layer's inputs, "
        "recomputing it in backward?). Fix: non-reentrant checkpointing (use_reentrant=False, "
        "diffusers' default); else report this as a fastdist bug"
    )


def hand_on_last(module: nn.Module) -> int:
    """Move the hand-on hook of each of ``module``'s layers behind every other forward hook of
    that layer; the number of hooks moved. The hand-on ends the layer's call by raising, so a
    hook registered after it (FSDP2's post-forward, which reshards the layer and hooks its
    output for the backward's unshard) would never run: call this after wrapping a stage."""
    moved = 0
    for m in module.modules():
        for key, hook in list(m._forward_hooks.items()):
            if getattr(hook, "__func__", None) is StageHooks._hand_on:
                hooks = m._forward_hooks  # an OrderedDict: the call order
                assert isinstance(hooks, OrderedDict)
                hooks.move_to_end(key)
                moved += 1
    return moved


def refuse_router_aux_loss(model: nn.Module, op: str = "pipeline") -> None:
    """Raise `PipelineError` if ``model``'s config makes its loss add transformers'
    load-balancing term (``output_router_logits`` with a nonzero ``router_aux_loss_coef``): a
    pipeline's last stage would compute it from its own layers' router logits only, once per
    micro-batch, not the whole model's over the batch (a wrong loss). The stages share the
    model's config, so `fastdist.train.pipeline` checks at the build and `Pipeline.step` at
    every step (``op`` names which): switching it on after the build is refused too. The
    coefficient is the model's attribute (transformers copies the config's in ``__init__`` and
    adds that one), else the config's."""
    config = getattr(model, "config", None)
    coef = getattr(model, "router_aux_loss_coef", None)
    coef = getattr(config, "router_aux_loss_coef", 0) if coef is None else coef
    if getattr(config, "output_router_logits", False) and coef:
        raise PipelineError(
            f"{op}: {type(model).__name__} adds the router load-balancing loss "
            f"(config.output_router_logits=True, its router_aux_loss_coef={coef}) to its loss; a "
            "pipeline's last stage would compute it from its own layers' router logits only, "
            "per micro-batch, not the whole model's over the batch: a wrong loss. Fix: "
            "model.config.output_router_logits = False (the loss without the auxiliary term; "
            "the stages share this config), or train without a pipeline "
            "(fastdist.nn.parallelize with expert parallelism)"
        )


def family_split(model: nn.Module) -> tuple[str, StageSplit]:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    split = SPLITS.get(model_type) if isinstance(model_type, str) else None
    if split is None:
        raise PipelineError(
            f"pipeline: no stage split for {type(model).__name__} (model_type={model_type!r}). "
            f"Fix: use one of {sorted(SPLITS)}, or add a StageSplit(layers=..., first=..., "
            "last=...) for it with split=..."
        )
    return str(model_type), split


def split_model(
    model: nn.Module, split: StageSplit, ranges: Sequence[range], keep: Sequence[int]
) -> dict[int, nn.Module]:
    """Stage modules ``{stage: copy of the model's skeleton holding its layers}`` for the stages
    in ``keep``; every parameter of ``model`` must belong to a layer or an end module. A weight
    tied between the first and the last stage (`tied_across_stages`): the last stage holds a
    copy of it (and the model given is untied)."""
    layers = decoder_layers(model, split)
    try:
        ends = {n: model.get_submodule(n) for n in (*split.first, *split.last)}
    except AttributeError as e:
        raise PipelineError(
            f"pipeline: {type(model).__name__} lacks a module its split names ({e}). Fix: pass "
            f"split= naming its first-stage and last-stage modules"
        ) from None
    n_layers = len(layers)
    if ranges[-1].stop != n_layers:
        raise PipelineError(
            f"pipeline: the stages cover {ranges[-1].stop} layers, {split.layers} holds "
            f"{n_layers}. Fix: layers_per_stage= summing to {n_layers}"
        )
    tied = tied_across_stages(model, split, len(ranges))
    skeleton = _skeleton(model, split, layers, ends)
    own = list(layers)
    stages: dict[int, nn.Module] = {}
    shared = _configs(skeleton)  # the model's own (see `_skeleton`)
    for j in keep:
        st = copy.deepcopy(skeleton, {id(c): c for c in shared})
        lst = st.get_submodule(split.layers)
        assert isinstance(lst, nn.ModuleList)
        for i in ranges[j]:
            lst[i] = own[i]
        if j == 0:
            for n in split.first:
                _put(st, n, ends[n])
        if j == len(ranges) - 1:
            for n in split.last:
                _put(st, n, ends[n])
            for alias in tied:  # the last stage's own copy; `Pipeline` sums the two gradients
                p = st.get_parameter(alias)
                parent, _, leaf = alias.rpartition(".")
                copy_ = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                setattr(st.get_submodule(parent), leaf, copy_)
        stages[j] = st
    return stages


def tied_across_stages(model: nn.Module, split: StageSplit, n_stages: int) -> dict[str, str]:
    """Parameters shared by the first and the last stage (tied input and output embeddings), as
    ``{name in the last stage's module: name in the first stage's}``; empty with one stage.
    Raises unless every parameter belongs to the layers or an end module, and for any other
    sharing across stages."""
    owner: dict[int, tuple[str, str]] = {}
    tied: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        where = next(
            (
                part
                for part in (split.layers, *split.first, *split.last)
                if name.startswith(part + ".")
            ),
            None,
        )
        if where is None:
            raise PipelineError(
                f"pipeline: parameter {name} of {type(model).__name__} belongs to no stage "
                f"(not in {split.layers}, {split.first} or {split.last}). Fix: pass split= "
                "with the module holding it among first= or last="
            )
        ends_of = "first" if where in split.first else "last" if where in split.last else where
        seen, first_name = owner.setdefault(id(p), (ends_of, name))
        if seen == ends_of or n_stages == 1:
            continue
        if (seen, ends_of) != ("first", "last"):
            raise PipelineError(
                f"pipeline: parameter {name} is shared by {first_name} of another stage; only "
                "the first stage's and the last stage's ends may share one (tied embeddings). "
                "Fix: untie them (copy the weight), or run without a pipeline axis"
            )
        tied[name] = first_name
    return tied


def _skeleton(
    model: nn.Module, split: StageSplit, layers: nn.ModuleList, ends: Mapping[str, nn.Module]
) -> nn.Module:
    """A copy of ``model`` without its layers (skipped) and ends (stubs), made cheaply by
    swapping them out of ``model`` for the copy and back."""
    weight = getattr(ends[split.first[0]], "weight", None)
    if weight is None:
        raise PipelineError(
            f"pipeline: {split.first[0]} has no weight to size the hidden states by. Fix: pass "
            "split= whose first module is the token embedding"
        )
    dim, dtype = int(weight.shape[-1]), weight.dtype
    stubs: dict[str, nn.Module] = {
        **{n: _Zeros(dim, dtype) for n in split.first},
        **{n: _Absent(n) for n in split.last},
    }
    _put(model, split.layers, nn.ModuleList([_Skip() for _ in layers]))
    for n, stub in stubs.items():
        _put(model, n, stub)
    # handles of hooks on the modules swapped out (transformers' enable_input_require_grads
    # keeps them for the embedding) cannot be copied without those modules: the copies hold
    # handles of nothing (removing them is a no-op; the hooks themselves stay on the modules
    # the stages take over)
    handles = [
        h
        for m in model.modules()
        for v in vars(m).values()
        for h in (v if isinstance(v, list) else [v])
        if isinstance(h, RemovableHandle)
    ]
    memo: dict[int, Any] = {id(h): RemovableHandle(OrderedDict()) for h in handles}
    # the model's config objects are shared, not copied: the layers a stage takes over read the
    # model's own (an attention reads ``self.config._attn_implementation`` at each call), so a
    # style that sets a field on its stage's config (context parallelism's attention function)
    # must reach them; a copy would leave them on the single-device attention, silently
    memo.update({id(c): c for c in _configs(model)})
    try:
        return copy.deepcopy(model, memo)
    finally:
        _put(model, split.layers, layers)
        for n, m in ends.items():
            _put(model, n, m)


def _configs(model: nn.Module) -> list[Any]:
    """The config objects (transformers' ``PretrainedConfig``, anything under a module's
    ``config`` attribute that is not a module or a tensor) of ``model``'s modules."""
    found = (vars(m).get("config") for m in model.modules())
    return [c for c in found if c is not None and not isinstance(c, (nn.Module, Tensor))]


def _put(root: nn.Module, name: str, module: nn.Module) -> None:
    """Set ``root``'s submodule ``name`` (dotted) to ``module``."""
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def stage_plan(plan: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """The plan's entries that match a module this stage holds (not a placeholder)."""
    from fastdist.nn.parallelize import pattern_matches

    real = [n for n, m in module.named_modules() if not isinstance(m, _PLACEHOLDERS)]
    return {p: v for p, v in plan.items() if any(pattern_matches(p, n) for n in real)}


def retire(model: nn.Module) -> None:
    """The model given to `pipeline` lends its layers and ends to the stages, which parallelize
    them in place: called afterwards it would run a mix of both. Its calls raise instead."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        raise PipelineError(
            f"{type(model).__name__} was taken apart by fastdist.train.pipeline: its layers now "
            "belong to the pipeline's stages (parallelized in place). Fix: call the Pipeline "
            "(pipe.step), and build the optimizer from pipe.parameters(); for a one-device "
            "model, copy.deepcopy it before pipeline()"
        )

    model.forward = forward


def decoder_layers(model: nn.Module, split: StageSplit) -> nn.ModuleList:
    try:
        layers = model.get_submodule(split.layers)
    except AttributeError:
        raise PipelineError(
            f"pipeline: {type(model).__name__} has no module {split.layers!r} (the decoder "
            "layers). Fix: pass split= naming its layer list"
        ) from None
    if not isinstance(layers, nn.ModuleList):
        raise PipelineError(
            f"pipeline: {split.layers} of {type(model).__name__} is a {type(layers).__name__}, "
            "not an nn.ModuleList of decoder layers. Fix: pass split= naming the layer list"
        )
    return layers
