"""``parallelize(..., verify=True)``: check a plan against the single-device model before using it.

The plan is first applied to a float64 copy of the model (the *trial*), and a second float64
copy (the *reference*) runs unparallelized, both in eval mode on the same small batch. Forward
hooks record every module's output in both; the trial's outputs are compared, in the order the
trial computes them, with the matching block of the reference's:

* an output of the same shape as the single-device one must equal it on every rank (replicated);
* a column-parallel layer's output is compared with its block of the single-device output (fused
  parts and vocabulary padding as the layer's own `Layout`);
* any other output that is smaller along one dim by the size of an axis the plan splits over is
  that axis' block (a head shard, a sequence shard); outputs that are neither (the kv head a rank
  holds whole, an expert's tokens) are not compared, but what they feed is.

The first module whose output differs (by more than ``1e-6`` of the output's largest value),
and any exception raised inside the trial's forward, becomes a `ParallelizeError` naming the
module, the difference and the likely fix (an attribute the attention reads that the plan does
not patch, a config it reads head counts from, a norm over the whole width of a split
projection). The user's model is never touched by the check: the plan is applied to it only
after the trial passed, so a refused plan leaves it exactly as it was.

A model on the meta device has no values to compare: a small model of the same class is built
from its config (two layers, small vocabulary and intermediate sizes, the same head counts and
head dim), given random values, and checked with the same plan; a model without a config, or a
plan that does not fit the small model, is refused with the reason.

On real ranks (a mesh from ``fastdist.connect``) every rank holds the whole model before the
plan is applied: each rank compares its own blocks and the ranks agree on the verdict (an
all-gather of objects), so every rank raises the same error or none does.
"""

from __future__ import annotations

import copy
import inspect
import math
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.core.sharding import P
from fastdist.errors import ParallelizeError
from fastdist.nn.replicas import check_replicas
from fastdist.nn.state import Layout
from fastdist.nn.styles import HeadParallelAttention, ParallelLinear
from fastdist.sim.simulate import simulate

__all__ = ["example_inputs", "small_config", "verify_plan"]

#: what ``parallelize(verify=...)`` accepts: ``True``, a dict of example keyword inputs
#: (single-device tensors), or a callable taking the single-device model and returning one
VerifyInputs = bool | Mapping[str, Any] | Callable[[nn.Module], Mapping[str, Any]]

RTOL = 1e-6

_TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


# ============================================================================ inputs
def example_inputs(
    model: nn.Module, mesh: Mesh, verify: VerifyInputs = True, *, seed: int = 0
) -> dict[str, Any]:
    """The keyword inputs ``verify`` runs ``model`` on (single-device tensors).

    ``verify=True``: ``input_ids`` of shape ``(2, S)`` drawn from ``config.vocab_size`` with a
    generator seeded by ``seed`` (``S``: a multiple of the mesh size, at least 8, so a sequence
    shard divides). A dict: those inputs. A callable: ``verify(model)``.

    >>> import fastdist as fd
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> m = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, num_attention_heads=2,
    ...                                  num_hidden_layers=1, intermediate_size=32))
    >>> tuple(example_inputs(m, fd.Mesh({"tp": 4}))["input_ids"].shape)
    (2, 8)
    """
    if callable(verify):
        got = verify(model)
        if not isinstance(got, Mapping):
            raise ParallelizeError(
                f"parallelize(verify=callable): the callable returned {type(got).__name__}, not a "
                "dict of keyword inputs. Fix: return e.g. {'input_ids': ids}"
            )
        return dict(got)
    if isinstance(verify, Mapping):
        return dict(verify)
    accepts = inspect.signature(model.forward).parameters
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if "input_ids" not in accepts or not isinstance(vocab, int):
        raise ParallelizeError(
            f"parallelize(verify=True): {type(model).__name__} takes no input_ids from a "
            "config.vocab_size, so verify cannot draw a batch for it. Fix: pass the example "
            "inputs, verify={'x': torch.randn(...)} (single-device tensors, keyword arguments "
            "of its forward), or a callable model -> that dict"
        )
    seq = mesh.size * math.ceil(8 / mesh.size)
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, vocab, (2, seq), generator=g)}  # (batch, seq)


# ============================================================================ meta models
def small_config(config: Any, mesh: Mesh) -> Any:
    """A copy of ``config`` with small sizes for checking a plan built for a big model: 2 layers,
    a vocabulary of at most 128, intermediate sizes of 8 per rank; head counts, head dim and
    hidden size unchanged (the plan's attention styles name them).

    >>> import fastdist as fd
    >>> from transformers import LlamaConfig
    >>> c = small_config(LlamaConfig(num_hidden_layers=32, vocab_size=32000), fd.Mesh({"tp": 2}))
    >>> c.num_hidden_layers, c.vocab_size, c.intermediate_size, c.hidden_size
    (2, 128, 16, 4096)
    """
    cfg = copy.deepcopy(config)
    layers = getattr(cfg, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > 2:
        cfg.num_hidden_layers = 2
        for key in ("layer_types", "mlp_only_layers"):
            value = getattr(cfg, key, None)
            if isinstance(value, list) and key == "layer_types":
                setattr(cfg, key, value[:2])
    vocab = getattr(cfg, "vocab_size", None)
    if isinstance(vocab, int) and vocab > 128:
        cfg.vocab_size = 128
        for key in _TOKEN_KEYS:
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value >= 128:
                setattr(cfg, key, None)
    width = 8 * mesh.size
    for key in (
        "intermediate_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "n_inner",
        "ffn_dim",
    ):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > width:
            setattr(cfg, key, width)
    return cfg


def _small_model(model: nn.Module, mesh: Mesh) -> nn.Module:
    """A small float64 model of ``model``'s class with random values (see `small_config`)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ParallelizeError(
            f"parallelize(verify=True): {type(model).__name__} is on the meta device (no values "
            "to compare) and has no transformers config to build a small model of the same "
            "family from. Fix: verify the plan on a small model with values, then parallelize "
            "this one with verify=False"
        )
    cfg = small_config(config, mesh)
    try:
        with torch.device("cpu"):
            gen = torch.random.get_rng_state()
            try:
                torch.manual_seed(0)
                small = type(model)(cfg)
            finally:
                torch.random.set_rng_state(gen)
    except Exception as e:  # noqa: BLE001 (reported with the reason)
        raise ParallelizeError(
            f"parallelize(verify=True): {type(model).__name__} is on the meta device and a small "
            f"model of its class could not be built from its config ({type(e).__name__}: {e}). "
            "Fix: verify the plan on a small model with values, then parallelize this one with "
            "verify=False"
        ) from e
    return small


# ============================================================================ recording
def _leaves(out: Any) -> list[Tensor]:
    """The tensors of a module output, in order (dicts by their keys' order; None skipped)."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _leaves(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _leaves(v)]
    return []


@dataclass
class _Recorder:
    """Forward hooks on the named modules of one model: outputs by (name, call index), in the
    order they complete, and the modules entered but not yet left (where an exception rose)."""

    outputs: dict[tuple[str, int], list[Tensor]] = field(default_factory=dict)
    inputs: dict[tuple[str, int], list[Tensor]] = field(default_factory=dict)
    order: list[tuple[str, int]] = field(default_factory=list)
    stack: list[str] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)

    @contextmanager
    def hooks(self, modules: Sequence[tuple[str, nn.Module]]) -> Iterator[None]:
        handles = []
        for name, module in modules:

            def pre(_m: nn.Module, _args: Any, name: str = name) -> None:
                self.stack.append(name)

            def post(_m: nn.Module, _args: Any, out: Any, name: str = name) -> None:
                if self.stack and self.stack[-1] == name:
                    self.stack.pop()
                i = self.calls.get(name, 0)
                self.calls[name] = i + 1
                self.outputs[(name, i)] = _leaves(out)
                if isinstance(_m, (nn.Linear, ParallelLinear)):  # a row layer's input, for hints
                    self.inputs[(name, i)] = _leaves(_args)[:1]
                self.order.append((name, i))

            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def reset(self) -> None:
        self.outputs, self.inputs, self.order, self.stack, self.calls = {}, {}, [], [], {}


def _hooked(model: nn.Module, names: set[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The modules to record: every named module, except what fastdist's own modules hold
    inside (their internals have no single-device counterpart)."""
    out: list[tuple[str, nn.Module]] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if names is not None and name not in names:
            continue
        out.append((name, module))
        if type(module).__module__.startswith("fastdist."):
            inside.append(name)
    return out


# ============================================================================ comparison
@dataclass
class _Diff:
    """The first difference found: where, how much, on which rank."""

    index: int
    name: str
    detail: str
    error: BaseException | None = None
    #: the module's input already differed (the layers feeding it are at fault)
    upstream: bool = False


def _blocks(
    ref: Tensor,
    local: Tensor,
    module: nn.Module | None,
    mesh: Mesh,
    rank: int,
    axes: Sequence[str],
) -> list[tuple[Tensor, Tensor]]:
    """The candidate (rank ``rank``'s block of single-device ``ref``, ``local`` cut to it) pairs:
    one, or one per axis of the size that fits (a dim split over one of two equal axes, say the
    vocabulary over ``tp`` next to ``cp``, could be either); empty when the local output is no
    block of it that verify can name."""
    if isinstance(module, ParallelLinear) and module.kind == "col" and not module.gather_output:
        spec = P(*([None] * (ref.dim() - 1)), module.axis)
        lay = module._layouts["bias"]
        layout = Layout(spec, parts=lay.parts, size=lay.size)
        try:
            block = layout.shard(ref, mesh, rank)
        except Exception:  # noqa: BLE001 (not this layer's own output layout)
            block = None
        if block is not None and block.shape == local.shape:
            return [(block, local)]
        # else the output is also split elsewhere (tokens under context parallelism)
    if ref.shape == local.shape:
        return [(ref, local)]
    if ref.dim() != local.dim():
        return []
    dims = [d for d in range(ref.dim()) if ref.shape[d] != local.shape[d]]
    if len(dims) != 1:
        return []
    d = dims[0]
    full, size = ref.shape[d], local.shape[d]
    cuts = []
    for axis in axes:
        n = mesh.axis_size(axis)
        # an even split, or one padded at the end (a vocabulary: every rank but the last full);
        # not a head several ranks hold whole (kv heads fewer than ranks)
        if n > 1 and (size * n == full or (size == -(-full // n) and full > size * (n - 1))):
            i = mesh.index(rank, axis)
            keep = max(0, min(size, full - i * size))  # vocabulary padding dropped
            cuts.append((ref.narrow(d, i * size, keep), local.narrow(d, 0, keep)))
            if full % n:  # or balanced, padded at each block's end (uneven context tokens)
                q, r = divmod(full, n)
                start, keep = i * q + min(i, r), q + (i < r)
                cuts.append((ref.narrow(d, start, keep), local.narrow(d, 0, keep)))
    return cuts


def _difference(block: Tensor, mine: Tensor) -> tuple[float, float]:
    """(max |mine - block|, the scale it is compared with)."""
    scale = max(1.0, float(block.abs().max()) if block.numel() else 0.0)
    if not mine.isfinite().all() and block.isfinite().all():
        return math.inf, scale
    return (float((mine - block).abs().max()) if block.numel() else 0.0), scale


def _mismatch(
    want: Sequence[Tensor],
    got: Sequence[Tensor],
    module: nn.Module | None,
    mesh: Mesh,
    axes: Sequence[str],
    ranks: Sequence[int],
    stacked: bool,
    strict: bool,
    what: str = "output",
) -> str | None:
    """How the trial's tensors ``got`` differ from their blocks of the reference's ``want``
    (None: they match, or are no block verify can name and ``strict`` is off)."""
    for j, (r_t, l_t) in enumerate(zip(want, got)):
        if not (r_t.is_floating_point() and l_t.is_floating_point()):
            continue
        for k, rank in enumerate(ranks):
            local = l_t[k] if stacked else l_t
            cuts = _blocks(r_t, local, module, mesh, rank, axes)
            if not cuts:
                if strict:
                    return (
                        f"{what} {j} has shape {tuple(local.shape)} on rank {rank}, no block of "
                        f"the single-device {tuple(r_t.shape)}"
                    )
                continue
            # the closest candidate (an output matching the block of one of them is right)
            diff, scale = min(_difference(block, mine) for block, mine in cuts)
            if diff > RTOL * scale:
                return (
                    f"max |difference| {diff:.3g} (largest single-device value {scale:.3g}) "
                    f"in {what} {j} on rank {rank}"
                )
    return None


def _compare(
    ref: Recorded,
    trial: Recorded,
    modules: Mapping[str, nn.Module],
    mesh: Mesh,
    axes: Sequence[str],
    ranks: Sequence[int],
    stacked: bool,
) -> _Diff | None:
    """The first module (in the trial's order) whose output differs from the reference's."""
    for index, key in enumerate(trial.order):
        name = key[0]
        if key not in ref.outputs:
            continue
        args = (modules[name], mesh, axes, ranks, stacked, name == "")
        found = _mismatch(ref.outputs[key], trial.outputs[key], *args)
        if found is None:
            continue
        module = modules[name]
        if (
            isinstance(module, ParallelLinear)
            and module.kind == "row"
            and key in ref.inputs
            and key in trial.inputs
            and _mismatch(
                ref.inputs[key], trial.inputs[key], None, mesh, axes, ranks, stacked, False, "input"
            )
        ):
            found += (
                ". Its input already differs from its block of the single-device input: what "
                "feeds it is at fault"
            )
            return _Diff(index, name, found, upstream=True)
        return _Diff(index, name, found)
    return None


@dataclass
class Recorded:
    """One run's outputs (plain tensors) by (name, call), in completion order, and the first
    positional input of each call."""

    outputs: dict[tuple[str, int], list[Tensor]]
    order: list[tuple[str, int]]
    inputs: dict[tuple[str, int], list[Tensor]] = field(default_factory=dict)


# ============================================================================ hints
_HEAD_KEYS = ("num_attention_heads", "num_key_value_heads", "num_heads", "num_kv_heads", "n_head")


def _forward_reads(module: nn.Module) -> set[str]:
    """The ``self.<name>`` and ``self.config.<name>`` (as ``config.<name>``) a module's forward
    reads (empty when its source is not available)."""
    try:
        src = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return set()
    return set(re.findall(r"self\.(config\.\w+|\w+)", src))


def _attention_hint(
    name: str, module: nn.Module, ref_module: nn.Module, style: HeadParallelAttention, n: int
) -> str | None:
    """What an attention module reads that the plan left at the whole model's value."""
    hq, hkv, d = style.num_heads, style.num_kv_heads, style.head_dim
    patched = {a for a, _ in style.attrs}
    reads = _forward_reads(module)
    whole = {hq: "query heads", hkv: "kv heads", hq * d: "query width", hkv * d: "kv width"}
    stale = [
        f"self.{k}={v} ({whole[v]})"
        for k, v in vars(ref_module).items()
        if type(v) is int
        and v in whole
        and v > 1
        and (v in (hq * d, hkv * d) or re.search(r"head|group", k))
        and k not in patched
        and getattr(module, k, None) == v
        and (not reads or k in reads)
    ]
    config = getattr(module, "config", None)
    heads_from_config = [
        f"self.config.{k}={getattr(config, k)}"
        for k in _HEAD_KEYS
        if f"config.{k}" in reads and getattr(config, k, None) in (hq, hkv)
    ]
    if stale or heads_from_config:
        what = ", ".join(stale + heads_from_config)
        fix = []
        if stale:
            fix.append(
                "patch the attributes per rank: HeadParallelAttention(..., attrs=(("
                + "), (".join(f"{s.split('=')[0][5:]!r}, lambda hq, hkv, d: ...)" for s in stale)
                + ")) computing them from this rank's head counts"
            )
        if heads_from_config:
            fix.append(
                "give the attention a per-rank config (a shallow copy with this rank's head "
                "counts, e.g. attrs=(('config', lambda hq, hkv, d: ...),))"
            )
        return (
            f"{name} ({type(module).__name__}) reads {what}: the whole model's values, but a "
            f"rank holds {hq // n if hq % n == 0 else '?'} query heads. Fix: " + "; ".join(fix)
        )
    for child_name, child in ref_module.named_children():
        w = getattr(child, "weight", None)
        if (
            isinstance(w, Tensor)
            and w.dim() == 1
            and w.shape[-1] in (hq * d, hkv * d)
            and w.shape[-1] != d
            and "norm" in type(child).__name__.lower() + child_name.lower()
        ):
            return (
                f"{name}.{child_name} ({type(child).__name__}) normalises the whole width of a "
                f"split projection ({w.shape[-1]} features): splitting the heads changes its "
                "statistics. Fix: a style that reduces the norm's statistics over the axis, or "
                "leave this attention replicated (no HeadParallelAttention for it)"
            )
    return None


def _hint(
    name: str,
    trial: nn.Module,
    ref: nn.Module,
    styles: Mapping[str, Sequence[Any]],
    mesh: Mesh,
) -> str:
    """The likely fix for a difference or exception first seen in module ``name``."""
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):  # the module itself, then its ancestors
        here = ".".join(parts[:depth])
        for style in styles.get(here, ()):
            if isinstance(style, HeadParallelAttention):
                try:
                    mod, ref_mod = trial.get_submodule(here), ref.get_submodule(here)
                except AttributeError:
                    continue
                hint = _attention_hint(here, mod, ref_mod, style, mesh.axis_size(style.axis))
                if hint:
                    return hint
    owner = next(
        (
            (".".join(parts[:depth]), styles[".".join(parts[:depth])])
            for depth in range(len(parts), -1, -1)
            if styles.get(".".join(parts[:depth]))
        ),
        None,
    )
    if owner is not None:
        where, st = owner
        sets = sorted({a for s in st for a, _ in getattr(s, "attrs", ())})
        note = f"The style sets {', '.join(sets)} per rank: check those values. " if sets else ""
        return (
            f"{note}Fix: check the plan's {', '.join(type(s).__name__ for s in st)} for {where!r} "
            f"(e.g. a ColwiseParallel on a layer whose input is already split, a "
            "RowwiseParallel on one whose input is whole, an attribute of the module the style "
            "does not patch), or leave the module out of the plan (replicated)"
        )
    return (
        "Fix: the module is not in the plan: it receives a split or sharded input from the "
        "module before it, or reads a head count or width it was not told about (a config "
        "value); check the styles of the modules that feed it, or leave them replicated"
    )


# ============================================================================ the check
def _styles_by_name(
    model: nn.Module, plan: Mapping[str, Sequence[Any]], match: Callable[[str, str], bool]
) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for name, _ in model.named_modules():
        for pattern, st in plan.items():
            if match(pattern, name):
                out.setdefault(name, []).extend(st)
    return out


def _run_reference(model: nn.Module, inputs: Mapping[str, Any]) -> Recorded:
    rec = _Recorder()
    with rec.hooks(_hooked(model)), torch.no_grad():
        try:
            model(**inputs)
        except Exception as e:  # noqa: BLE001 (the inputs do not fit the model)
            where = rec.stack[-1] if rec.stack else ""
            raise ParallelizeError(
                f"parallelize(verify=...): the single-device {type(model).__name__} itself "
                f"raised on the example inputs (in {where or 'the model'!r}: "
                f"{type(e).__name__}: {e}). Fix: pass inputs it runs on, "
                "verify={'input_ids': ...} or a callable model -> inputs"
            ) from e
    return Recorded(rec.outputs, rec.order, rec.inputs)


def _to_f64(t: Any) -> Any:
    return t.to(torch.float64) if isinstance(t, Tensor) and t.is_floating_point() else t


def _float64_experts(model: nn.Module) -> None:
    """transformers' default experts kernel (``grouped_mm``) has no float64: the copies run the
    eager one (the same values)."""
    setter = getattr(model, "set_experts_implementation", None)
    current = getattr(getattr(model, "config", None), "_experts_implementation", None)
    if callable(setter) and current not in (None, "eager"):
        try:
            setter("eager")
        except Exception:  # noqa: BLE001 (a model without experts: nothing to switch)
            pass


def verify_plan(
    model: nn.Module,
    mesh: Mesh,
    plan: Mapping[str, Sequence[Any]],
    verify: VerifyInputs,
    apply: Callable[[nn.Module], Any],
    match: Callable[[str, str], bool],
) -> float:
    """Check ``plan`` on copies of ``model``; raise `ParallelizeError` on the first difference.

    ``apply(copy)`` parallelizes a copy with the plan (``parallelize(copy, mesh, plan)``) and
    returns its `ParallelModel`; ``match(pattern, name)``: whether a plan pattern matches a
    module name. ``model`` itself is not changed. Returns the seconds the check took.
    """
    start = time.perf_counter()
    source = model
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        source = _small_model(model, mesh)
    ref = copy.deepcopy(source).to(torch.float64).eval()
    _float64_experts(ref)
    device = next((t.device for t in ref.parameters()), torch.device("cpu"))
    inputs = {
        k: _to_f64(v).to(device) if isinstance(v, Tensor) else v
        for k, v in example_inputs(ref, mesh, verify).items()
    }
    accepts = inspect.signature(ref.forward).parameters
    if "use_cache" in accepts:
        inputs.setdefault("use_cache", False)
    reference = _run_reference(ref, inputs)
    trial = copy.deepcopy(ref)
    styles = _styles_by_name(trial, plan, match)
    try:
        pm = apply(trial)
    except ParallelizeError as e:
        if source is model:
            raise
        raise ParallelizeError(
            f"parallelize(verify=True): the plan does not fit the small "
            f"{type(model).__name__} verify builds for a model on the meta device ({e}). "
            "Fix: verify the plan on a small model with values, then parallelize this one with "
            "verify=False"
        ) from e
    modules = dict(_hooked(trial, {k[0] for k in reference.order}))
    diff = _run_trial(pm, trial, modules, inputs, reference, mesh)
    if mesh.backend is not None:
        diff = _first_on_any_rank(diff, mesh)
    if diff is not None:
        _refuse(diff, modules, styles, trial, ref, mesh)
    # the gradients: no replicated parameter left with per-rank gradients (on the copy)
    check_replicas(trial, mesh, pm.layouts, pm.axes, pm.probe, inputs, changed=False)
    return time.perf_counter() - start


def _run_trial(
    pm: Any,
    trial: nn.Module,
    modules: dict[str, nn.Module],
    inputs: dict[str, Any],
    reference: Recorded,
    mesh: Mesh,
) -> _Diff | None:
    """Run the parallelized ``trial`` (``pm`` its `ParallelModel`) on ``inputs`` with every module
    in ``modules`` recorded; the first difference from ``reference`` on this process's ranks
    (or the exception the run raised, in the module it was in), or ``None``."""
    rec = _Recorder()
    error: BaseException | None = None
    simulated = mesh.backend is None
    out_keys: list[tuple[str, int]] = []

    def rank_fn(params: Mapping[str, Tensor], **kwargs: Any) -> Any:
        rec.reset()
        pm.probe(params, kwargs)
        out_keys[:] = list(rec.order)
        return [rec.outputs[k] for k in rec.order], [rec.inputs.get(k, []) for k in rec.order]

    with rec.hooks(list(modules.items())), torch.no_grad():
        try:
            if simulated:
                outs = simulate(rank_fn, mesh)(dict(trial.named_parameters()), **inputs)
            else:
                outs = rank_fn(dict(trial.named_parameters()), **inputs)
        except Exception as e:  # noqa: BLE001 (reported as the plan's error)
            error = e
    if error is not None:
        where = rec.stack[-1] if rec.stack else ""
        return _Diff(
            -1,
            where,
            f"raised {type(error).__name__} inside it: "
            f"{str(error).splitlines()[0][:300].rstrip('.')}"
            if str(error)
            else f"raised {type(error).__name__} inside it",
            error,
        )
    outputs, ins = outs
    got = Recorded(dict(zip(out_keys, outputs)), out_keys, dict(zip(out_keys, ins)))
    ranks = list(range(mesh.size)) if simulated else [mesh.rank]
    return _compare(reference, got, modules, mesh, pm.axes, ranks, simulated)


def _first_on_any_rank(diff: _Diff | None, mesh: Mesh) -> _Diff | None:
    """On real ranks: the first difference any rank saw, the same on every rank (a collective)."""
    from fastdist.comm.p2p import all_gather_object

    verdicts = all_gather_object(
        None if diff is None else (diff.index, diff.name, diff.detail, diff.upstream), mesh
    )
    found = [v for v in verdicts if v is not None]
    if not found:
        return diff
    index, name, detail, upstream = min(found, key=lambda v: v[0])
    return _Diff(index, name, detail, diff.error if diff is not None else None, upstream)


def _refuse(
    diff: _Diff,
    modules: dict[str, nn.Module],
    styles: Mapping[str, Sequence[Any]],
    trial: nn.Module,
    ref: nn.Module,
    mesh: Mesh,
) -> NoReturn:
    """Raise the `ParallelizeError` for ``diff``: the module, what differs, the likely fix."""
    cls = type(modules[diff.name]).__name__ if diff.name in modules else "?"
    hint = (
        "Fix: check the styles of the layers that feed it (a parts= or pad= on a layer that "
        "is not fused, layers split over different axes, or a ColwiseParallel missing on "
        "one of them)"
        if diff.upstream
        and not any(
            isinstance(st, HeadParallelAttention)
            for st in styles.get(diff.name.rpartition(".")[0], ())
        )
        else _hint(diff.name, trial, ref, styles, mesh)
    )
    raise ParallelizeError(
        f"parallelize(verify=True): {diff.name or 'the model'!r} ({cls}) on {mesh!r} "
        f"{'differs from the single-device model: ' if diff.index >= 0 else ''}"
        f"{diff.detail}. {hint}. The model was not changed."
    ) from diff.error
