"""Parallelize an unmodified model with one call: a plan maps module names to styles.

``parallelize(model, mesh, plan)`` walks the model's modules, and for every module whose
dotted name matches a pattern of the plan applies that pattern's styles: a linear layer
becomes column- or row-parallel, an embedding vocabulary-parallel, an attention module
gets its heads split, a decoder layer's input is cut to a sequence shard. Modules are
swapped in place and keep their parameter names (a checkpoint of the single-device
model loads name for name), and the weights the model already holds are sharded.

The result, a `ParallelModel`, runs the same way on both kinds of mesh:

* a plain (simulated) mesh: every parameter holds every rank's shard stacked on a
  leading rank dim (``[world, *local]``), and calling the model runs all ranks at once
  through `fastdist.simulate` (tensor arguments carry the rank dim too);
* a mesh from ``fastdist.connect``: every parameter holds this rank's shard, and calling
  the model runs this rank's part.

Patterns match dotted module names segment by segment (``fnmatch`` per segment, so
``"model.layers.*.mlp"`` matches ``model.layers.3.mlp`` and nothing deeper). Every
pattern must match at least one module. Ready-made plans: `fastdist.nn.plans`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from fastdist.core.mesh import Mesh
from fastdist.errors import InitError, ParallelizeError
from fastdist.nn.generate import DirectCalls, generate, sequence_sizes
from fastdist.nn.hf_save import install as install_save_pretrained
from fastdist.nn.layers import VocabParallelEmbedding
from fastdist.nn.loss import HFCausalLMLoss
from fastdist.nn.materialize import (
    Original,
    init_steps,
    run_inits,
    unwritten,
)
from fastdist.nn.optim_guard import refuse_replaced_in_optimizers
from fastdist.nn.plans import plan as family_plan
from fastdist.nn.pvary_sites import PvarySites
from fastdist.nn.randomness import (
    RandomSites,
    accelerators,
    drawn,
    generator_states,
    is_vmap_randomness,
)
from fastdist.nn.replicas import check_replicas
from fastdist.nn.state import (
    CheckpointError,
    Layout,
    full_state_dict,
    gather_full,
    listed,
    materialize_,
    meta_names,
    param_layouts,
)
from fastdist.nn.styles import (
    ParallelLinear,
    ReplicatedHeads,
    Style,
    StyleContext,
    install_switch,
    swap_child,
)
from fastdist.nn.verify import VerifyInputs, verify_plan
from fastdist.sim.simulate import simulate

__all__ = ["parallelize", "ParallelModel", "pattern_matches"]


class ParallelModel:
    """A model after `parallelize`: call it like the model; move weights and gradients back.

    Attributes:
        module: the model itself, modified in place (its parameters hold shards).
        mesh: the mesh it runs on.
        layouts: how each parameter (by the model's own name) splits the single-device tensor.
        plan: the plan that was applied (pattern -> styles; with ``plan="auto"``, the candidate
            that verified).
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh,
        pvary_params: Sequence[tuple[nn.Module, str, str]],
        axes: Sequence[str] = (),
        plan: Mapping[str, Any] | None = None,
    ) -> None:
        self.module, self.mesh = module, mesh
        self.layouts = param_layouts(module)
        self.plan: dict[str, Any] = dict(plan or {})
        owner = {id(m): prefix for prefix, m in module.named_modules()}
        _refuse_replaced_sites(module, owner, pvary_params)
        self._pvary = {f"{owner[id(m)]}.{n}".lstrip("."): axis for m, n, axis in pvary_params}
        # (module, parameter name, axis): parameters pvary'd inside their module's forward, by
        # hooks: every call of that module (a checkpoint's recomputation in backward, a call by
        # DDP / FSDP2) pvary's them again (fastdist.nn.pvary_sites)
        self.pvary_sites = list(pvary_params)
        self.pvary_hooks = PvarySites(mesh, self.pvary_sites)
        # the data-parallel engine attached (fastdist.train.DataParallel), or None
        self.engine: Any = None
        # torch's wrapper (DDP / FSDP2) that calls of this model go through on real ranks, set by
        # fastdist.train.DataParallel(engine="ddp" | "fsdp"); None: the model is called itself
        self.wrapped: nn.Module | None = None
        # the axes the plan splits over: inputs are replicated over them
        self.axes: tuple[str, ...] = tuple(dict.fromkeys(axes))
        # calls of the module itself (HF generate): whole logits, inputs checked across ranks
        self.direct_calls = DirectCalls(module, mesh, self.axes, sequence_sizes(self.plan, mesh))
        # where the model draws random numbers in training mode (fastdist.nn.randomness), and
        # the axes over which ranks drawing differently would diverge (an axis of size 1 cannot)
        self._random = RandomSites.of(module)
        self._split = tuple(a for a in self.axes if mesh.axis_size(a) > 1)
        # all ranks at once (used on a plain mesh)
        self._simulated = simulate(self._simulated_rank, mesh)
        accepts = inspect.signature(module.forward).parameters
        self._no_cache = {"use_cache": False} if "use_cache" in accepts else {}

    @property
    def simulated(self) -> bool:
        """True on a plain mesh: parameters hold every rank's shard stacked, calls run all ranks."""
        return self.mesh.backend is None

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def _run(
        self, params: Mapping[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """One rank's call with ``params`` swapped in (none: the module's own); parameters that
        meet rank-varying data are pvary'd inside their module's forward (`pvary_hooks`)."""
        if params:
            return torch.func.functional_call(self.module, dict(params), args, kwargs)
        return self.module(*args, **kwargs)

    def forward_rank(
        self, params: Mapping[str, Tensor], args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> Any:
        """One rank's forward with ``params`` (the model's parameter names -> tensors, e.g. fake
        tensors of one rank's shard) and one rank's inputs (no rank dim), without a KV cache
        (``use_cache=False`` where the model's ``forward`` takes it): what
        `fastdist.profile.trace_model` traces."""
        with self.direct_calls.bypass():
            return self._run(params, args, {**self._no_cache, **kwargs})

    def probe(self, params: Mapping[str, Tensor], kwargs: Mapping[str, Any]) -> Any:
        """`forward_rank` of keyword inputs, as a call of this model (what `parallelize` checks
        the replicas' gradients with: `fastdist.nn.replicas`)."""
        return self.forward_rank(params, (), kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model. On a simulated mesh every tensor argument carries a leading rank dim
        (``[world, ...]``) and so does every result; non-tensor results (a KV cache) are dropped
        there (``use_cache=False`` unless asked). On real ranks the model's output is returned as
        is."""
        return self.call_with({}, *args, **kwargs)

    def call_with(self, per_rank: Mapping[str, Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run the model as calling it does, with the ``per_rank`` keyword arguments handed to
        the module's ``forward`` as they are (on a simulated mesh: one slice per rank, not
        checked against the plan's groups): e.g. a pipeline stage's input activation."""
        if self.module.training and (self._split or self.simulated):
            if self._random.refused:  # dropout, or a config setting the model reads
                raise self._random.refusal(type(self.module).__name__, self._split)
            if not self.simulated and not torch.compiler.is_compiling():
                return self._call_watched(per_rank, args, kwargs)
        with self.direct_calls.bypass():
            return self._call(per_rank, args, kwargs)

    def _call_watched(
        self, per_rank: Mapping[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """`_call` on real ranks in training mode, split over an axis: raises if the forward drew
        random numbers (a generator of its devices advanced; simulated ranks: vmap refuses)."""
        devices = accelerators(self.module, [*args, *kwargs.values(), *per_rank.values()])
        before = generator_states(devices)
        with self.direct_calls.bypass():
            out = self._call(per_rank, args, kwargs)
        advanced = drawn(devices, before, generator_states(devices))
        if advanced:
            name = type(self.module).__name__
            raise self._random.drawn(name, self._split, self.mesh.rank, advanced)
        return out

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's Hugging Face ``generate``, equal to the unmodified model's on one device:
        the whole vocabulary's logits, every rank of a group sampling with its first rank's
        random state, the prompt checked equal across the ranks the plan splits over; on a
        simulated mesh every rank runs each step (no KV cache). See `fastdist.nn.generate`."""
        return generate(self, *args, **kwargs)

    def _call(
        self, per_rank: Mapping[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if self.wrapped is not None:  # DDP / FSDP2: they call the model; pvary by hooks
            return self.wrapped(*args, **kwargs, **per_rank)
        if not self.simulated:
            return self._run({}, args, {**kwargs, **per_rank})
        kwargs = {**self._no_cache, **kwargs}  # a KV cache object cannot leave the simulation
        tensors, rest = _split_kwargs(kwargs)
        if not torch.compiler.is_compiling():
            # An input every rank holds the same (a TP group's attention mask) goes to every rank
            # unbatched: the same values, and model code may branch on it (transformers' mask
            # helpers do), which a tensor batched over simulated ranks cannot. So does a 0-d
            # tensor (transformers' num_items_in_batch), which cannot carry a rank dim. Any other
            # input must at least agree within the groups the plan splits over.
            for k, v in [*enumerate(args), *tensors.items()]:
                if isinstance(v, Tensor) and v.dim() == 0 and k in tensors:
                    rest[k] = tensors.pop(k)
                elif _same_on_every_rank(v, self.mesh.size):
                    if k in tensors:
                        rest[k] = tensors.pop(k)[0]
                else:
                    _check_replicated(k, v, self.mesh, self.axes)
        tensors.update(per_rank)
        try:
            with _no_recomputation(self.module):
                return self._simulated(dict(self.module.named_parameters()), args, tensors, **rest)
        except RuntimeError as e:
            if is_vmap_randomness(e):
                raise self._random.vmap_refusal(type(self.module).__name__) from e
            if "Batch norm got a batched tensor" in str(e):
                raise _batch_norm_refusal(self.module) from e
            if "data-dependent control flow" not in str(e):
                raise
            raise ParallelizeError(
                f"{type(self.module).__name__} on simulated ranks: the model branches on the "
                f"values of an input that differs across ranks ({sorted(tensors)} differ; e.g. "
                "transformers' mask helpers inspect attention_mask), which a simulation running "
                "every rank at once cannot do. Fix: give every rank the same such input (it is "
                "then passed unbatched), pass a 4-D float mask, or run on real ranks"
            ) from e

    def _simulated_rank(
        self, params: dict[str, Tensor], args: tuple[Any, ...], tensors: dict[str, Any], **rest: Any
    ) -> Any:
        return _tensors_only(self._run(params, args, {**rest, **tensors}))

    # ------------------------------------------------------------------ weights and gradients
    def state_dict(self) -> dict[str, Tensor]:
        """The single-device state dict (by the model's names; on real ranks a collective: call it
        on every rank)."""
        return full_state_dict(self.module, self.mesh)

    def grads(self, *, check: bool = True) -> dict[str, Tensor]:
        """Every parameter's gradient as the single-device model would hold it (by name; missing
        grads skipped).

        Ranks holding the same block must agree (``check``): a replicated parameter whose
        gradient differs across ranks (a missing pvary) raises `fastdist.nn.ReplicaMismatchError`.
        On real ranks a collective: call it on every rank.

        Args:
            check: require ranks holding the same block to agree (a missing ``pvary`` raises).

        Returns:
            every parameter's single-device gradient, by name.
        """
        return {
            name: gather_full(
                p.grad, self.layouts[name], self.mesh, check=check, name=f"{name}.grad"
            )
            for name, p in self.module.named_parameters()
            if p.grad is not None
        }

    # ------------------------------------------------------------------ models built on meta
    def recompute_buffers(self, device: torch.device) -> None:
        """Non-persistent buffers on the meta device, recomputed by the model's own init (no
        checkpoint holds them; `fastdist.checkpoint.load` calls it before reading), on
        ``device``."""
        names = [n for n, b in self.module.named_buffers() if b.is_meta]
        if names:
            keys = set(self.module.state_dict(keep_vars=True))
            names = [n for n in names if n not in keys]
        if not names:
            return
        original = self.original_for("fastdist.checkpoint.load", CheckpointError)
        try:
            steps = init_steps(original)
        except InitError as e:
            raise CheckpointError(f"fastdist.checkpoint.load: {e}") from e
        lost = [n for n in names if n not in original.tensors]
        lost += unwritten(steps, [n for n in names if n in original.tensors])
        if lost:
            raise CheckpointError(
                f"fastdist.checkpoint.load: the non-persistent buffers {listed(lost)} are on the "
                "meta device; no checkpoint holds them and no init of the model computes them. "
                "Fix: build the modules that own them outside torch.device('meta') (accelerate's "
                "init_empty_weights keeps buffers real by default), or assign them before loading "
                "(pm.module.get_submodule(...).register_buffer(name, value, persistent=False))"
            )
        live = dict(self.module.named_buffers())

        def alloc(n: str) -> tuple[torch.device, torch.dtype]:
            t = live.get(n)
            if t is None or t.is_meta:
                return device, original.tensors[n].dtype
            return t.device, t.dtype

        def deliver(n: str, whole: Tensor) -> None:
            materialize_(live[n], whole.device, whole.dtype)
            with torch.no_grad():
                live[n].copy_(whole)

        try:
            run_inits(original, steps, set(names), seed=0, alloc=alloc, deliver=deliver)
        except InitError as e:
            raise CheckpointError(f"fastdist.checkpoint.load: {e}") from e

    def _attach_original(self, original: Original | None, why: str) -> None:
        """Keep the meta copy of the single-device model (``why``: why there is none)."""
        self._original, self._original_why = original, why
        self._meta_hook: Any = None
        if meta_names(self.module):
            # (inside a simulated call the parameters are the simulation's wrappers of the
            # module's own: a wrapper of a meta tensor is meta too)
            def refuse_meta(module: nn.Module, args: Any, kwargs: Any) -> None:
                meta = meta_names(module)
                if meta:
                    raise ParallelizeError(
                        f"parallelize: {type(module).__name__} was called with {listed(meta)} "
                        f"on the meta device ({len(meta)} in all: built under "
                        "torch.device('meta'), with shapes but no values). Fix: materialise them "
                        "first, each rank its own shards: fastdist.checkpoint.load(path, pm) or "
                        "fastdist.nn.init_weights(pm, seed=...)"
                    )

            self._meta_hook = self.module.register_forward_pre_hook(
                refuse_meta, prepend=True, with_kwargs=True
            )

    def original_for(self, what: str, error: type[Exception]) -> Original:
        """The meta copy of the single-device model (the modules before `parallelize`), which
        `fastdist.nn.init_weights` and `fastdist.checkpoint.load` run the model's own init on;
        raises ``error`` when no copy could be made.

        Args:
            what: the operation that needs the copy (the start of the error message).
            error: the exception class to raise.

        Returns:
            the meta copy `parallelize` made of the model before changing it.
        """
        original: Original | None = getattr(self, "_original", None)
        if original is None:
            raise error(
                f"{what}: the model's modules before parallelize are not known (a meta copy of "
                f"the model could not be made: {getattr(self, '_original_why', 'not attached')}). "
                "Fix: a model that copy.deepcopy can copy"
            )
        return original

    def settle_meta(self) -> None:
        """Drop the call guard once nothing is left on the meta device (after a load or an
        init has given every tensor storage)."""
        if getattr(self, "_meta_hook", None) is not None and not meta_names(self.module):
            self._meta_hook.remove()
            self._meta_hook = None

    def __repr__(self) -> str:
        return (
            f"ParallelModel({type(self.module).__name__}, {self.mesh!r}, "
            f"{'simulated' if self.simulated else 'real ranks'})"
        )


@contextlib.contextmanager
def _no_recomputation(module: nn.Module) -> Iterator[None]:
    """transformers' gradient checkpointing turned off inside (on simulated ranks: a checkpoint
    would recompute its layer in backward, outside the simulation's vmap over the ranks, which
    torch cannot do). The layers then keep their activations: the same values and gradients."""
    layers = (
        [m for m in module.modules() if getattr(m, "gradient_checkpointing", False) is True]
        if module.training
        else []
    )
    for m in layers:
        setattr(m, "gradient_checkpointing", False)  # noqa: B010 (an attribute of transformers)
    try:
        yield
    finally:
        for m in layers:
            setattr(m, "gradient_checkpointing", True)  # noqa: B010


def _refuse_replaced_sites(
    module: nn.Module, owner: Mapping[int, str], sites: Sequence[tuple[nn.Module, str, str]]
) -> None:
    """Refuse a plan in which a style registered a module's parameters to be ``pvary``'d and a
    later entry replaced that module (``ContextParallel`` at ``""`` next to column-parallel
    entries on its blocks): the replacement's parameters would get no gradient sum."""
    gone = sorted({f"{type(m).__name__}.{n} over {a!r}" for m, n, a in sites if id(m) not in owner})
    if gone:
        raise ParallelizeError(
            f"parallelize: a style of the plan registered the parameters {gone[:3]} of "
            f"{type(module).__name__} for a gradient sum over their axis, and a later plan entry "
            "replaced the modules holding them (the model's own entry is applied first, its "
            "children's after): the new modules' gradients would not be summed. Fix: one style "
            "that swaps the modules first (a DiT over tp x sp: "
            "fastdist.nn.plans.dit_tp.wan_tp, i.e. ContextTensorParallel), or plan entries "
            "that do not replace modules of that region"
        )


def _tensors_only(out: Any) -> Any:
    """A model output without its non-tensor entries (a KV cache object cannot leave a vmap)."""
    if isinstance(out, Mapping):
        kept = {k: v for k, v in out.items() if isinstance(v, (Tensor, tuple, list))}
        try:
            return type(out)(**kept)
        except TypeError:
            return kept
    return out


def _check_replicated(key: Any, v: Any, mesh: Mesh, axes: Sequence[str]) -> None:
    """Raise if an input without gradient differs across the ranks of a group the plan splits over
    (each needs the same batch)."""
    if not isinstance(v, Tensor) or v.requires_grad or v.dim() == 0 or v.shape[0] != mesh.size:
        return
    for axis in axes:
        for group in mesh.groups(axis):
            for r in group[1:]:
                if not torch.equal(v[r], v[group[0]]):
                    raise ParallelizeError(
                        f"parallelize: input {key!r} differs between ranks {group[0]} and {r}, "
                        f"which form one {axis!r} group: the model's layers are split over "
                        f"{axis!r}, so every rank of a group must get the same batch (a data "
                        "loader keyed on the global rank instead of the data-parallel index?). "
                        f"Fix: give the ranks of each {axis!r} group the same input"
                    )


def _same_on_every_rank(v: Any, world: int) -> bool:
    """A tensor without gradient whose ``world`` slices along dim 0 are all equal."""
    return (
        isinstance(v, Tensor)
        and not v.requires_grad
        and v.dim() > 0
        and v.shape[0] == world
        and torch.equal(v, v[:1].expand_as(v))
    )


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(keyword arguments holding tensors: vmapped over ranks, the rest: passed to every rank)."""
    has_tensor = {
        k: any(isinstance(t, Tensor) for t in pytree.tree_leaves(v)) for k, v in kwargs.items()
    }
    return {k: v for k, v in kwargs.items() if has_tensor[k]}, {
        k: v for k, v in kwargs.items() if not has_tensor[k]
    }


# ============================================================================ parallelize
PlanValue = Style | Sequence[Style]
#: ``(dotted name, module, plan pattern)`` for every module a pattern of the plan matches
Matches = list[tuple[str, nn.Module, str]]


def pattern_matches(pattern: str, name: str) -> bool:
    """Whether module ``name`` (dotted) matches plan ``pattern``: the same number of dotted parts,
    each matched by ``fnmatch`` (``"model.layers.*.mlp"`` matches every layer's ``mlp``)."""
    ps, ns = pattern.split("."), name.split(".")
    return len(ps) == len(ns) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(ps, ns))


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    plan: Mapping[str, PlanValue] | str | None = None,
    *,
    verify: VerifyInputs | None = None,
) -> ParallelModel:
    """Make ``model`` parallel over ``mesh`` in place, following ``plan``; returns a
    `ParallelModel`.

    Args:
        model: the single-device model (e.g. a Hugging Face ``LlamaForCausalLM``), holding the
            weights to shard, or built under ``torch.device("meta")`` (no values: each
            parameter becomes a meta shard of its local shape, the whole tensor never made;
            materialise with `fastdist.checkpoint.load` or `fastdist.nn.init_weights`, each rank
            its own shards). Its modules are swapped in place; parameter names do not change.
        mesh: a plain mesh (simulated ranks: parameters become stacked ``[world, *local]``) or a
            mesh from ``fastdist.connect`` (parameters become this rank's shards).
        plan: module-name pattern -> style (or a sequence of styles, applied in order). Default:
            the ready-made plan for the model's ``config.model_type``
            (`fastdist.nn.plans.plan`). A family name (``"llama"``): that family's plan.
            ``"auto"``: ``fastdist.nn.plans.plan(model, mesh, family="auto")``, the plan
            inferred from the module tree, verified unless ``verify=False``. A plan with several
            ``candidates`` (`fastdist.nn.plans.AutoPlan`: a fused q|k|v's layout left open) and
            ``verify``: each is tried in turn, the first that verifies applied.
        verify: check the plan before applying it (`fastdist.nn.verify`): ``True`` runs a copy
            of the model parallelized and one unparallelized, in float64 and eval mode, on a
            small random ``input_ids`` batch, compares every module's output, and raises
            `ParallelizeError` naming the first module that differs and the likely fix, with
            ``model`` left unchanged. A dict of example keyword inputs, or a callable taking the
            model and returning one, replaces the random batch; the copy is then checked as
            below. ``None`` (the default): no comparison, except for ``plan="auto"``; a model
            that takes ``input_ids`` runs once on a small batch under the replication types
            (`fastdist.nn.replicas`), and a replicated parameter or input that would get
            per-rank gradients (a missing ``pvary``) is refused. ``False``: no check.

    Raises `ParallelizeError` for a pattern that matches no module, a style applied to
    a module it cannot handle, or a head/feature count that does not split over the axis.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 2})
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    >>> ref = mlp(x := torch.randn(3, 4))
    >>> plan = {"0": fd.nn.ColwiseParallel(input="replicated"), "2": fd.nn.RowwiseParallel()}
    >>> pm = fd.nn.parallelize(mlp, mesh, plan)
    >>> tuple(mlp[0].weight.shape)                   # stacked: [rank, out/2, in]
    (2, 4, 4)
    >>> out = pm(x.expand(2, 3, 4))                  # every rank's output
    >>> bool(torch.allclose(out[1], ref, atol=1e-6))
    True
    """
    plan, verify = _resolve_plan(model, mesh, plan, verify)
    candidates = getattr(plan, "candidates", None)
    if isinstance(candidates, list) and len(candidates) > 1 and verify not in (None, False):
        return _first_that_verifies(model, mesh, candidates, verify)
    _refuse_parallel(model)
    styles = _styles_of(plan)
    # Phase 1: every match checked, nothing changed yet (a bad plan leaves the model as it was).
    matches = _check(model, mesh, styles)
    if verify is not None and verify is not False:
        _refuse_unverifiable(styles)
        # on copies: the model is changed only after the plan passed
        verify_plan(
            model,
            mesh,
            styles,
            verify,
            lambda m: parallelize(m, mesh, styles, verify=False),
            pattern_matches,
        )
    # The single-device structure, as a meta copy (no data): fastdist.nn.init_weights runs the
    # model's own init on its modules, and load recomputes meta buffers with it.
    try:
        original: Original | None = Original.of(model)
        why = ""
    except Exception as e:  # noqa: BLE001 (reported when the copy is needed)
        original, why = None, f"{type(e).__name__}: {e}"
    # Phase 2: apply.
    before = dict(model.named_parameters())
    ctx = _apply(model, mesh, styles, matches)
    refuse_replaced_in_optimizers(
        before,
        dict(model.named_parameters()),
        "fastdist.nn.parallelize",
        "parallelize replaced them with this rank's parameters",
        "build the optimizer after parallelize, over pm.parameters()",
        ParallelizeError,
    )
    del before
    pm = ParallelModel(model, mesh, ctx.pvary, ctx.axes, plan)
    pm._attach_original(original, why)
    install_save_pretrained(model, mesh)  # model.save_pretrained writes the whole model
    if verify is None:  # a replicated parameter meeting rank-varying values unreduced: refused
        check_replicas(model, mesh, pm.layouts, pm.axes, pm.probe)  # (verify checks a copy)
    return pm


def _batch_norm_refusal(model: nn.Module) -> ParallelizeError:
    """The error for torch.vmap's refusal of a BatchNorm that updates its running statistics
    in place (one buffer for every simulated rank at once)."""
    norms = [
        n or type(m).__name__
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
    ]
    return ParallelizeError(
        f"{type(model).__name__} on simulated ranks: {norms[:3]} ({len(norms)} modules) are "
        "BatchNorms in training mode with running statistics, updated in place from each rank's "
        "batch, which a simulation running every rank at once cannot hold per rank. Fix: "
        "model.eval(), track_running_stats=False, or real ranks (fastdist.connect)"
    )


def _resolve_plan(
    model: nn.Module,
    mesh: Mesh,
    plan: Mapping[str, PlanValue] | str | None,
    verify: VerifyInputs | None,
) -> tuple[Mapping[str, PlanValue], VerifyInputs | None]:
    """The plan ``parallelize`` was given as a dict (``"auto"``: the inferred plan, verified unless
    ``verify=False``; a family name: its plan; ``None``: the ready plan for the model's family),
    and ``verify``."""
    if plan == "auto":
        return family_plan(model, mesh, family="auto"), True if verify is None else verify
    if plan is None or isinstance(plan, str):
        return family_plan(model, mesh, family=plan), verify
    if not isinstance(plan, Mapping):
        whole = f"{{'': {type(plan).__name__}(...)}}" if isinstance(plan, Style) else "a dict"
        raise ParallelizeError(
            f"parallelize: plan must be a dict of module name patterns to styles, 'auto', a "
            f"family name or None; got {type(plan).__name__}. Fix: plan={whole} (the empty "
            "pattern names the whole model)"
        )
    return plan, verify


def _first_that_verifies(
    model: nn.Module, mesh: Mesh, candidates: list[Any], verify: VerifyInputs
) -> ParallelModel:
    """``auto``'s open choices: ``model`` parallelized with the first candidate plan that verifies
    (the model is changed only then)."""
    first: ParallelizeError | None = None
    for candidate in candidates:
        try:
            return parallelize(model, mesh, dict(candidate), verify=verify)
        except ParallelizeError as e:
            first = first or e
    raise ParallelizeError(
        f"parallelize(plan='auto'): none of the {len(candidates)} candidate plans for "
        f"{type(model).__name__} verifies; the first: {first}"
    ) from first


def _refuse_parallel(model: nn.Module) -> None:
    """Refuse a model ``parallelize`` has already made parallel."""
    done_before = [
        n
        for n, m in model.named_modules()
        if isinstance(m, (ParallelLinear, VocabParallelEmbedding, ReplicatedHeads))
    ]
    if done_before:
        raise ParallelizeError(
            f"parallelize: {type(model).__name__} is already parallel ({done_before[:3]} ...). "
            "Fix: parallelize a fresh "
            "single-device model (e.g. copy.deepcopy before the first call)"
        )


def _refuse_unverifiable(styles: Mapping[str, tuple[Style, ...]]) -> None:
    """Raise for a plan with a style ``verify`` cannot check (it would refuse a right plan)."""
    for pattern, group in styles.items():
        for style in group:
            why = style.unverifiable()
            if why is not None:
                raise ParallelizeError(
                    f"parallelize(verify=True): plan[{pattern!r}] = {style!r} cannot be "
                    f"verified: {why}. Fix: verify=False (and a test against one device), or "
                    "the style's verifiable form named there"
                )


def _styles_of(plan: Mapping[str, PlanValue]) -> dict[str, tuple[Style, ...]]:
    """The plan with each value a tuple of styles; raises for a value that is not a style."""
    styles: dict[str, tuple[Style, ...]] = {}
    for pattern, value in plan.items():
        styles[pattern] = cast(
            "tuple[Style, ...]",
            (value,)
            if isinstance(value, Style)
            else tuple(value)
            if isinstance(value, (tuple, list))
            else (value,),
        )
        for style in styles[pattern]:
            if not isinstance(style, Style):
                hint = (
                    f" (the class itself: write {style.__name__}())"
                    if isinstance(style, type)
                    else ""
                )
                raise ParallelizeError(
                    f"parallelize: plan[{pattern!r}] holds {style!r}{hint}, not a fastdist.nn "
                    "style instance"
                )
    return styles


def _check(model: nn.Module, mesh: Mesh, styles: dict[str, tuple[Style, ...]]) -> Matches:
    """Every module the plan matches, each of its styles checked on it (nothing changed); raises
    for a pattern that matches no module."""
    matches = [
        (name, module, pattern)
        for name, module in model.named_modules()
        for pattern in styles
        if pattern_matches(pattern, name)
    ]
    unused = [p for p in styles if p not in {m[2] for m in matches}]
    if unused:
        raise ParallelizeError(
            f"parallelize: plan patterns {unused} match no module of {type(model).__name__}. Fix: "
            "check the names "
            f"in model.named_modules(), e.g. {[n for n, _ in model.named_modules()][1:6]}"
        )
    for name, module, pattern in matches:
        for style in styles[pattern]:
            style.check(module, name, mesh)
    return matches


def _apply(
    model: nn.Module, mesh: Mesh, styles: dict[str, tuple[Style, ...]], matches: Matches
) -> StyleContext:
    """Apply the checked styles in place; set a causal-LM model's loss for vocabulary-parallel
    logits; give the parameters no style touched the rank dim on a simulated mesh."""
    ctx = StyleContext(mesh)
    for name, module, pattern in matches:
        for style in styles[pattern]:
            axis = getattr(style, "axis", None)
            ctx.axes.extend([axis] if isinstance(axis, str) else [])
            module = style.apply(module, name, ctx)
        if name:
            parent, _, child = name.rpartition(".")
            swap_child(model.get_submodule(parent), child, module)
    if hasattr(type(model), "loss_function"):
        # transformers' causal-LM models compute `labels=` losses through this attribute
        if ctx.sharded_logits is not None:
            model.loss_function = HFCausalLMLoss(mesh, ctx.sharded_logits)  # type: ignore[assignment]
        elif ctx.gathered_logits is not None:
            model.loss_function = HFCausalLMLoss(mesh, ctx.gathered_logits, gathered=True)  # type: ignore[assignment]
    hf: Any = model
    if getattr(hf, "_require_grads_hooks", None):
        # transformers' enable_input_require_grads (gradient_checkpointing_enable installs it)
        # hooks the input embeddings' module, which a style may have replaced: hook the new one
        hf.disable_input_require_grads()
        hf.enable_input_require_grads()
    # Parameters no style touched are replicated: on a simulated mesh they too carry the rank dim.
    if mesh.backend is None:
        done = {id(v) for v in ctx.converted.values()}
        for mod_name, mod in model.named_modules():
            for pname, p in list(mod.named_parameters(recurse=False)):
                if id(p) not in done:
                    setattr(mod, pname, ctx.param(p, Layout(), f"{mod_name}.{pname}"))
    # one sequence switch for the model, on every module (generate's decoding steps: no walk)
    install_switch(model, ctx.switch)
    return ctx
