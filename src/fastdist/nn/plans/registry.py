"""The table of family rows by ``config.model_type`` (`TABLE`, built by `table`, which refuses a
model type two rows claim), its lookup, and the one plan entry point `plan`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from torch import nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.moe.routing import Strategy
from fastdist.nn.plans.auto import auto_plan
from fastdist.nn.plans.dense import DENSE
from fastdist.nn.plans.dit import dit_family, dit_plan, is_diffusers_dit
from fastdist.nn.plans.dit_tp import dit_tp
from fastdist.nn.plans.family import Family, Plan, build_plan
from fastdist.nn.plans.moe import MOE
from fastdist.nn.styles.context_llm import CausalContextParallel

__all__ = ["TABLE", "lookup", "plan", "table"]


def table(*rows: Family) -> Mapping[str, Family]:
    """model_type -> row; raises `ValueError` for a model type two rows claim."""
    out: dict[str, Family] = {}
    for row in rows:
        for kind in row.model_types:
            if kind in out:
                raise ValueError(
                    f"fastdist.nn.plans: two family rows for model_type {kind!r}: "
                    f"{out[kind].model_types} and {row.model_types}"
                )
            out[kind] = row
    return MappingProxyType(out)


#: the ready-made rows by ``config.model_type``: the dense families and the MoE ones
TABLE: Mapping[str, Family] = table(*DENSE, *MOE)


def lookup(name: str | None, what: str = "this model") -> Family:
    """The row for model type ``name``; raises `ParallelizeError` listing the known ones."""
    if name is None or name not in TABLE:
        raise ParallelizeError(
            f"parallelize: no ready-made plan for {what} (model_type {name!r}); plans exist for "
            f"{sorted(TABLE)}. Fix: plan='auto' (read off the module tree), a family name, or "
            "a dict of styles (print fastdist.nn.plans.plan(model, mesh) of a known family for "
            "the shape of one)"
        )
    return TABLE[name]


def plan(
    model_or_config: Any,
    mesh: Mesh | None = None,
    *,
    family: str | Family | None = None,
    axis: str = "tp",
    ep_axis: str | None = None,
    strategy: Strategy = "all_to_all",
    capacity_factor: float | None = None,
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    prefix: str | None = None,
    context_parallel: str | CausalContextParallel | None = None,
) -> Plan:
    """The plan (a plain dict: module-name pattern -> styles; print it, edit it) for a model of a
    Hugging Face family on ``mesh``.

    Args:
        model_or_config: the model, or its ``config`` (not for ``family="auto"``).
        mesh: the mesh it will run on (``None``: the axes as given). ``axis`` must be one of its
            axes; for a mixture-of-experts family the experts go over ``"ep"`` when the mesh
            has it, else over ``axis`` (whole experts per rank), and the attention over ``"ep"``
            on a mesh without ``axis``.
        family: ``None``: the row of ``config.model_type`` (`TABLE`); a model type (``"llama"``)
            or a `Family` record; ``"auto"``: the record read off the model's module tree
            (`fastdist.nn.plans.auto.infer`): an `AutoPlan` whose ``candidates`` verify
            tries in turn.
        axis: the mesh axis of tensor parallelism.
        ep_axis: the mesh axis the experts are split over (default: ``"ep"`` when the mesh has
            it or no mesh is given, else ``axis``).
        strategy: ``"all_to_all"`` or ``"allgather"``, as in `fastdist.nn.moe.dispatch`.
        capacity_factor: drop expert assignments past the capacity; ``None``: dropless.
        sequence_parallel: also split the sequence over ``axis`` between the attention and MLP
            blocks (Megatron's sequence parallelism).
        gather_logits: the LM head gives the whole vocabulary's logits ``(..., V)``; else each
            rank's vocabulary shard.
        prefix: the name of the base model inside the causal LM (the row's: ``model`` in
            ``model.layers.*``).
        context_parallel: split the tokens over this mesh axis (``"cp"``) from the embedding
            output to the final norm, each attention a causal ring over it (zig-zag layout);
            a `fastdist.nn.CausalContextParallel` chooses ``mode="ulysses"``. With ``axis``
            on the mesh too, tensor parallelism over it as well (heads over ``tp``, tokens over
            ``cp``); a mesh without ``axis``: context parallelism alone. See
            ``docs/context_parallel.md``.

    >>> import fastdist as fd
    >>> from transformers import LlamaConfig
    >>> config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    >>> p = fd.nn.plans.plan(config, fd.Mesh({"tp": 2}), sequence_parallel=True)
    >>> print(*sorted(p)[:4])
    lm_head model model.embed_tokens model.layers.*.input_layernorm
    >>> p["model"]  # the partial outputs (a rank's heads or tokens) refused at the call
    RefusePartialOutputs(axis='tp', plan='sequence-parallel', heads=True, sequence=True)
    """
    names = mesh.axis_names if mesh is not None else ()
    if family in (None, "auto") and isinstance(model_or_config, nn.Module):
        if is_diffusers_dit(model_or_config):  # context parallelism over "sp"
            if "tp" in names:  # heads over "tp" too
                return dit_tp(dit_family(model_or_config, mesh), model_or_config, mesh)
            return dit_plan(model_or_config, mesh)
    if family == "auto":
        if not isinstance(model_or_config, nn.Module):
            raise ParallelizeError(
                "plans.plan(family='auto') reads a model's module tree: pass the model, not "
                f"a {type(model_or_config).__name__}"
            )
        if mesh is not None:
            mesh.axis_indices(axis, "parallelize")
        return auto_plan(model_or_config, axis=axis, sequence_parallel=sequence_parallel)
    config = getattr(model_or_config, "config", model_or_config)
    what = type(model_or_config).__name__
    row = (
        family
        if isinstance(family, Family)
        else lookup(family or getattr(config, "model_type", None), what)
    )
    if prefix is not None:
        row = replace(row, prefix=prefix)
    if row.moe and ep_axis is None:
        ep_axis = "ep" if "ep" in names or mesh is None else axis
    if row.moe and axis not in names and "ep" in names:
        axis = "ep"
    cp = (
        CausalContextParallel(context_parallel)
        if isinstance(context_parallel, str)
        else context_parallel
    )
    if mesh is not None:
        if cp is not None:
            mesh.axis_indices(cp.axis, "parallelize")
        if cp is None or axis in names:
            mesh.axis_indices(axis, "parallelize")
    return build_plan(
        row,
        config,
        axis=axis,
        ep_axis=ep_axis,
        strategy=strategy,
        capacity_factor=capacity_factor,
        sequence_parallel=sequence_parallel,
        gather_logits=gather_logits,
        context_parallel=cp,
        tensor_parallel=cp is None or mesh is None or axis in names,
    )
