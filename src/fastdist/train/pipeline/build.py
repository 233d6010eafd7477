"""The `pipeline` entry point: split a model into stages, parallelize each over the mesh's other
axes, and choose the schedule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from fastdist.core.mesh import Mesh
from fastdist.errors import PipelineError
from fastdist.nn.styles.context import ContextParallel
from fastdist.train.pipeline.dit import DitSplit, build_dit, dit_split
from fastdist.train.pipeline.hf import install as install_save_pretrained
from fastdist.train.pipeline.runtime import Pipeline
from fastdist.train.pipeline.split import (
    StageHooks,
    StageSplit,
    decoder_layers,
    family_split,
    refuse_router_aux_loss,
    retire,
    split_model,
    stage_plan,
    tied_across_stages,
)
from fastdist.train.schedules import Schedule, schedule, stage_layers

__all__ = ["pipeline"]


def pipeline(
    model: nn.Module,
    mesh: Mesh,
    *,
    axis: str = "pp",
    schedule: str | Schedule = "1f1b",
    microbatches: int | None = None,
    virtual: int = 1,
    plan: Mapping[str, Any] | None = None,
    sequence_parallel: bool = False,
    layers_per_stage: Sequence[int] | None = None,
    split: StageSplit | DitSplit | None = None,
) -> Pipeline:
    """Split ``model`` into pipeline stages over ``axis`` and parallelize each stage over the
    mesh's other axes.

    Args:
        model: a transformers causal LM (a family of :data:`SPLITS`), or a diffusers DiT (a
            class of :data:`DIT_SPLITS`: Wan, LTX-Video, CogVideoX, SD3, Flux, HunyuanVideo;
            see `fastdist.train.pipeline.dit`: its step
            takes the model's inputs and ``target``, the loss is the mean squared error), with
            weights or built on the meta device. It is taken apart: use the returned pipeline,
            not ``model`` (its calls raise), and build the optimizer afterwards from
            ``pipe.parameters()``: one
            built before holds the model's old parameters, which receive no gradient, and
            torch's optimizers skip those without a word.
        mesh: a plain mesh (simulated ranks: every stage here) or a ``fastdist.connect`` mesh
            (this process builds and holds only its own stages).
        axis: the pipeline axis of ``mesh``.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` or a built `Schedule`.
        microbatches: micro-batches per step (default: the axis size).
        virtual: stages per rank (``"interleaved_1f1b"``; default 2 there).
        plan: the plan for the whole model (default: the ready plan of its family over the
            other axes when they hold ``tp``, or an MoE family's ``ep``, as
            `fastdist.nn.parallelize`'s default; else none); each stage applies the entries
            that match its modules. An MoE model on simulated ranks needs its experts in the
            plan (transformers' own cannot run under the simulation's vmap): refused
            otherwise. Context
            parallelism of a decoder LLM composes with the stages
            (``fastdist.nn.plans.plan(model, mesh.without(axis), context_parallel="cp")``):
            the tokens are split where the first stage's embedding output enters its first
            layer, travel split between the stages (each ``cp`` rank to the same ``cp`` rank
            of the next stage), and are gathered after the last stage's final norm, so the
            head and the loss see the whole sequence, as without a pipeline; with
            ``CausalContextParallel("cp", logits="split")`` they stay split, the last stage's
            head and loss run on each rank's tokens and the loss is summed over ``cp``.
            A DiT's context-parallel plan (``ContextParallel``, the default over an ``sp`` axis)
            applies inside every stage the same way: the first stage splits the tokens at
            its first block, they travel split, the last stage gathers them at the output
            projection (Wan's ``blocks.0`` and ``proj_out``).
        sequence_parallel: for the default plan: Megatron sequence parallelism over ``tp``
            (stages hand on sequence shards); refused without a ``tp`` axis (an MoE family's:
            or ``ep``) or with ``plan=`` (which it would not change).
        layers_per_stage: layers of each stage (default: even); ``pp * virtual`` ints.
        split: where the decoder layers and the ends are (default: ``SPLITS[model_type]``; a
            DiT: a `DitSplit`, default ``DIT_SPLITS[class name]``).

    Returns:
        the :class:`Pipeline`.

    >>> import torch, fastdist as fd
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    >>> model = LlamaForCausalLM(cfg).double()
    >>> ids = torch.randint(0, 64, (4, 8))
    >>> logits = model(input_ids=ids).logits                  # one device, float64
    >>> one_device = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64),
    ...                                                 ids[:, 1:].reshape(-1))
    >>> mesh = fd.Mesh({"pp": 2, "tp": 2})
    >>> pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    >>> loss = pipe.step(input_ids=ids.expand(4, 4, 8), labels=ids.expand(4, 4, 8))
    >>> loss.dtype, bool(torch.allclose(loss, one_device.detach(), rtol=1e-12, atol=0))
    (torch.float64, True)
    """
    if not isinstance(mesh, Mesh):
        raise PipelineError(f"pipeline: mesh={mesh!r} is not a fastdist.Mesh. Fix: pass one")
    if axis not in mesh.axis_names:
        raise PipelineError(
            f"pipeline: {mesh!r} has no axis {axis!r}. Fix: add it (e.g. Mesh({{'{axis}': 2, "
            f"'tp': 2}})) or pass axis= one of {mesh.axis_names}"
        )
    from fastdist.nn.plans.dit import is_diffusers_dit

    dit = is_diffusers_dit(model)
    if dit and split is None:
        dit_split(model)  # refuses an unbuilt family first
    if not dit:
        refuse_router_aux_loss(model)
        _refuse_context_parallel(plan)
    pp = mesh.shape[axis]
    if isinstance(schedule, Schedule):
        sched = schedule
        if sched.pp != pp:
            raise PipelineError(
                f"pipeline: the schedule is for pp={sched.pp}, the mesh's {axis!r} has {pp} "
                "ranks. Fix: build the schedule for the mesh's axis size"
            )
        given = {"microbatches": microbatches, "virtual": virtual if virtual != 1 else None}
        differ = {k: v for k, v in given.items() if v is not None and v != getattr(sched, k)}
        if differ:  # the built schedule's counts run: the arguments would be dropped
            raise PipelineError(
                f"pipeline: {', '.join(f'{k}={v}' for k, v in differ.items())} with a built "
                f"schedule of {sched.microbatches} micro-batches and {sched.virtual} stages per "
                "rank: the schedule's counts are the ones that run. Fix: leave them out, or "
                "build the schedule with them"
            )
    else:
        sched = _schedule_for(schedule, pp, pp if microbatches is None else microbatches, virtual)
    if dit:
        if split is not None and not isinstance(split, DitSplit):
            raise PipelineError(
                f"pipeline: split={split!r} for the diffusers DiT {type(model).__name__}. Fix: "
                "a fastdist.train.pipeline.DitSplit (blocks, first, shared, last)"
            )
        return build_dit(model, mesh, axis, sched, plan, layers_per_stage, split)
    assert not isinstance(split, DitSplit)
    _, fam = family_split(model) if split is None else ("", split)
    layer_list = decoder_layers(model, fam)
    ranges = stage_layers(len(layer_list), sched.stages, layers_per_stage)
    stage_mesh = mesh.without(axis)  # real ranks: over this process's slice
    if mesh.backend is None:
        keep = list(range(sched.stages))
    else:
        keep = list(sched.stages_of(mesh.index(mesh.rank, axis)))
    from fastdist.nn.parallelize import parallelize

    if plan is None:
        plan = _default_plan(model, stage_mesh, sequence_parallel)
    elif sequence_parallel:
        raise PipelineError(
            "pipeline: sequence_parallel=True with plan= given: it applies to the default plan "
            "only, so it would be dropped. Fix: leave it out and build the plan with it "
            "(fastdist.nn.plans.plan(model, mesh.without(axis), sequence_parallel=True))"
        )
    _refuse_unmatched(plan, model)
    if mesh.backend is None:
        _refuse_plain_experts(model, plan, stage_mesh)
    tied = tied_across_stages(model, fam, len(ranges))
    modules = split_model(model, fam, ranges, keep)
    retire(model)
    stages: dict[int, Any] = {}
    for j, module in modules.items():
        pm = parallelize(module, stage_mesh, stage_plan(plan, module))
        own = decoder_layers(module, fam)
        first = None if j == 0 else own[ranges[j][0]]
        last = None if j == sched.stages - 1 else own[ranges[j][-1]]
        if last is None and hasattr(type(module), "loss_function"):
            from fastdist.nn.loss import HFCausalLMLoss

            if not isinstance(getattr(module, "loss_function", None), HFCausalLMLoss):
                # no vocabulary-parallel head (no tp): fastdist's loss all the same, so that the
                # step's loss and gradients keep the model's dtype (transformers' own loss
                # computes in float32), as with a tp plan
                axis_name = stage_mesh.axis_names[-1] if stage_mesh.ndim else "tp"
                module.loss_function = HFCausalLMLoss(stage_mesh, axis_name, gathered=True)  # type: ignore[assignment]
        StageHooks(module, first, last)  # held by the hooks it registers on the module
        stages[j] = pm
    if 0 in stages and sched.stages - 1 in stages:
        _check_tied_layouts(stages[0], stages[sched.stages - 1], tied)
    pipe = Pipeline(mesh, axis, sched, stage_mesh, stages, ranges, tied)
    install_save_pretrained(pipe, model)  # the model's and the stages' write the whole model
    return pipe


def _default_plan(model: nn.Module, stage_mesh: Mesh, sequence_parallel: bool) -> Mapping[str, Any]:
    """The plan of ``pipeline(plan=None)``: the family's ready plan over every axis of the stage
    mesh it uses, as `fastdist.nn.parallelize`'s default (``tp``; an MoE family's experts over
    ``ep``, and over ``ep`` alone its attention too); without either, none (every stage
    replicated over the other axes). Raises for ``sequence_parallel`` without a ``tp`` axis."""
    from fastdist.nn.plans import plan as family_plan

    names = stage_mesh.axis_names
    if "tp" in names or ("ep" in names and _moe_family(model) is not None):
        return family_plan(model, stage_mesh, sequence_parallel=sequence_parallel)
    if sequence_parallel:
        raise PipelineError(
            f"pipeline: sequence_parallel=True splits the sequence over 'tp', and the stage mesh "
            f"{stage_mesh!r} has no 'tp' axis: it would be dropped. Fix: add a 'tp' axis to the "
            "mesh, or leave sequence_parallel out"
        )
    return {}


def _moe_family(model: nn.Module) -> Any:
    """The ready-plan row (`fastdist.nn.plans.Family`) of ``model``'s family if it has experts,
    else ``None``."""
    from fastdist.nn.plans import TABLE

    row = TABLE.get(getattr(getattr(model, "config", None), "model_type", None) or "")
    return row if row is not None and row.moe else None


def _refuse_plain_experts(model: nn.Module, plan: Mapping[str, Any], stage_mesh: Mesh) -> None:
    """On simulated ranks, refuse an MoE model whose plan leaves its experts transformers' own:
    they pick each expert's tokens with data-dependent shapes (``torch.nonzero``), which the
    simulation's ``torch.vmap`` over the ranks cannot run (torch would raise its own error at the
    first step). fastdist's `ExpertParallel` experts run there (masked, every expert on every
    token); on real ranks the model's own experts run."""
    from fastdist.nn.parallelize import pattern_matches

    row = _moe_family(model)
    if row is None:
        return
    where = [".".join(p for p in (row.prefix, row.layers, "*", e) if p) for e in row.experts]
    plain = [
        n
        for n, _ in model.named_modules()
        if any(pattern_matches(w, n) for w in where)
        and not any(pattern_matches(p, n) for p in plan)
    ]
    if plain:
        kind = type(model.get_submodule(plain[0])).__name__
        raise PipelineError(
            f"pipeline: {type(model).__name__}'s experts ({plain[0]}, ...: transformers' "
            f"{kind}) are in no plan entry over the stage mesh {stage_mesh!r}, and on simulated "
            "ranks they cannot run: they pick each expert's tokens with data-dependent shapes "
            "(torch.nonzero), which the simulation's torch.vmap over the ranks does not support. "
            "The default plan splits them over an 'ep' (or 'tp') axis. Fix: add one to the mesh "
            "(e.g. Mesh({'pp': 2, 'ep': 2}); 'ep': 1 keeps every expert whole), give plan= an "
            "ExpertParallel entry for them, or run on real ranks (fastdist.connect), where "
            "the model's own experts run"
        )


def _refuse_unmatched(plan: Mapping[str, Any], model: nn.Module) -> None:
    """Refuse plan patterns that match no module of the whole model (each stage applies the
    entries that match its own modules, so a typo would be dropped by every stage)."""
    from fastdist.nn.parallelize import pattern_matches

    names = [n for n, _ in model.named_modules()]
    unmatched = [p for p in plan if not any(pattern_matches(p, n) for n in names)]
    if unmatched:
        raise PipelineError(
            f"pipeline: plan patterns {unmatched} match no module of {type(model).__name__}. "
            f"Fix: check the names in model.named_modules(), e.g. {names[1:5]}"
        )


def _refuse_context_parallel(plan: Mapping[str, Any] | None) -> None:
    """Refuse `ContextParallel` (the diffusion transformers' token split): it splits the tokens
    where they enter the first block and gathers them at the model's output module, which a
    stage of a causal LM does not run in one piece, so the stages would compute a wrong loss.
    `CausalContextParallel` (a decoder LLM's) composes with the stages: every stage's base model
    takes this rank's positions and masks, the first stage cuts the embedding output, the
    activations travel split, the last stage gathers the final norm's output for the head."""
    for pattern, styles in (plan or {}).items():
        for style in styles if isinstance(styles, (list, tuple)) else (styles,):
            if isinstance(style, ContextParallel):
                raise PipelineError(
                    f"pipeline: the plan's {pattern!r} entry is ContextParallel (the diffusion "
                    "transformers' token split, at the first block's input and the output "
                    "module, which pipeline stages do not run in one piece): the stages would "
                    "compute a wrong loss. Fix: for a decoder LLM, CausalContextParallel "
                    "(fastdist.nn.plans.plan(model, mesh.without('pp'), "
                    "context_parallel='cp')), which composes with a pipeline; a DiT: context "
                    "parallelism without a pipeline"
                )


def _check_tied_layouts(first: Any, last: Any, tied: Mapping[str, str]) -> None:
    """The two copies of a tied weight must be split alike (their gradients are summed block by
    block): the same boxes of the single-device weight on every rank."""
    mesh = first.mesh
    for alias, name in tied.items():
        a, b = first.layouts[name], last.layouts[alias]
        shape = tuple(first.module.get_parameter(name).shape[1 if mesh.backend is None else 0 :])
        full = a.full_shape(shape, mesh)
        if any(a.boxes(full, mesh, r) != b.boxes(full, mesh, r) for r in range(mesh.size)):
            raise PipelineError(
                f"pipeline: the tied weights {name} ({a.spec}) and {alias} ({b.spec}) are split "
                "differently on the first and the last stage; their gradients are summed block "
                "by block. Fix: a plan that splits the input and output embeddings alike (the "
                "family's ready plan does), or untie them"
            )


def _schedule_for(name: Any, pp: int, microbatches: int, virtual: int) -> Schedule:
    if not isinstance(name, str):
        raise PipelineError(
            f"pipeline: schedule={name!r}. Fix: a name ('gpipe', '1f1b', 'interleaved_1f1b') or "
            "a fastdist.train.schedules.Schedule"
        )
    return schedule(name, pp, microbatches, virtual)
