"""Refusing a plan that would leave a replicated value with per-rank gradients.

A value every rank of an axis holds the same (a parameter no style split, the hidden states
before a column-parallel layer) that meets a value varying over the axis (a rank's heads, its
sequence shard, its experts' tokens) gets, on each rank, the gradient of that rank's share only:
the whole gradient is their sum over the axis, which only a ``pvary`` on the way in (backward:
all-reduce) gives. A plan that forgets it (a family's plan on a model with a norm the family does
not have, a ``ColwiseParallel()`` without a `PrepareInput` before it) runs forward exactly, and
its replicas' gradients silently drift apart.

`check_replicas` runs the parallel model once on a small batch under the replication types of
`fastdist.check.replication` (every parameter invariant over the axes it is not split over, the
collectives typed by their rules), and raises `ParallelizeError` at every place the tracker
would have to insert a ``pvary`` over an axis the plan splits over, naming the parameter (or
the module whose input it is) and the fix. A forward that raises after such places (a module
run whole on every rank behind a ``pvary`` makes its output look per-rank, which breaks a later
collective's rule) is refused with them; a forward that breaks a collective's rule over a plan
axis with none before it (a ``pvary`` of a value that already varies: its backward sums
per-rank gradients) is refused too. Axes the plan does not split over (data-parallel ones) are
not its concern: their gradients are reduced by `fastdist.train.DataParallel`.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fastdist.check.replication import Rep, RepTracker, tracking
from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError, ReplicationError
from fastdist.nn.state import Layout
from fastdist.sim.simulate import simulate

__all__ = ["Unreduced", "check_replicas", "unreduced", "module_stack"]

#: one rank's forward: (parameters by name, keyword inputs) -> the model's output
RankForward = Callable[[Mapping[str, Tensor], Mapping[str, Any]], Any]


@dataclass(frozen=True)
class Unreduced:
    """One place a replicated value meets values varying over ``axes`` without a ``pvary``:
    ``param`` (a parameter's name, or ``""`` for a computed value such as a module's input) in
    module ``module`` (its dotted name; ``""``: the model) of class ``cls``."""

    param: str
    module: str
    cls: str
    axes: tuple[str, ...]


def unreduced(
    module: nn.Module,
    mesh: Mesh,
    layouts: Mapping[str, Layout],
    axes: Sequence[str],
    forward: RankForward,
    inputs: Mapping[str, Any],
) -> list[Unreduced]:
    """Run ``forward`` (one rank's call of the parallel ``module``) on ``inputs`` (the same on
    every rank) under the replication tracker; every place it would insert a ``pvary`` over one
    of ``axes``, in the order met (each parameter or module once).

    Each parameter starts varying over the axes its ``layouts`` entry splits it over and
    invariant over the rest. A forward that raises part-way returns the places met before it
    (a module run whole behind a ``pvary`` is met, and then breaks a later collective's rule).
    On a simulated mesh every rank runs at once; on real ranks this is a collective (every rank
    of the mesh calls it).
    """
    return _track(module, mesh, layouts, axes, forward, inputs)[0]


def _track(
    module: nn.Module,
    mesh: Mesh,
    layouts: Mapping[str, Layout],
    axes: Sequence[str],
    forward: RankForward,
    inputs: Mapping[str, Any],
) -> tuple[list[Unreduced], Exception | None]:
    """`unreduced`'s places, and the exception the tracked forward raised (``None``: none)."""
    names = {id(p): n for n, p in module.named_parameters()}
    found: dict[tuple[str, str], Unreduced] = {}
    stack: list[str] = []
    plan_axes = set(axes)

    def on_insert(t: Tensor, over: tuple[str, ...]) -> None:
        mine = tuple(a for a in over if a in plan_axes)
        if not mine:
            return
        param = names.get(id(t), "")
        where = param.rpartition(".")[0] if param else (stack[-1] if stack else "")
        cls = type(module.get_submodule(where)).__name__
        found.setdefault((param, where), Unreduced(param, where, cls, mine))

    def rank_fn(params: Mapping[str, Tensor]) -> Tensor:
        names.clear()
        names.update({id(p): n for n, p in params.items()})
        tracker = RepTracker(mesh, "insert", simulated=mesh.backend is None, on_insert=on_insert)
        with tracking(tracker):
            for n, p in params.items():
                layout = layouts.get(n)
                tracker.set(p, Rep(frozenset(layout.spec.sharded_axes) if layout else frozenset()))
            forward(params, inputs)
        return torch.zeros(())  # (simulate returns tensors only)

    try:
        with _unchanged(module), module_stack(module, stack), torch.enable_grad():
            module.eval()
            params = dict(module.named_parameters())
            if mesh.backend is None:
                simulate(rank_fn, mesh)(params)
            else:
                rank_fn(params)
    except Exception as e:  # noqa: BLE001 (a plan that breaks the forward: the call says how)
        # what was met before the break is real: dropping it passed a replicated MoE block
        # behind a pvary on real ranks (its output, typed varying, broke lm_head's pvary)
        return list(found.values()), e
    return list(found.values()), None


@contextmanager
def _unchanged(module: nn.Module) -> Iterator[None]:
    """Every submodule's attributes as they were before the block (training mode, what a
    forward records on its module: `fastdist.nn.moe.dropped_counts`), set back after it."""
    saved = [(m, dict(vars(m))) for m in module.modules()]
    try:
        yield
    finally:
        for m, before in saved:
            now = vars(m)
            for k in [k for k in now if k not in before]:
                del now[k]
            now.update({k: v for k, v in before.items() if now.get(k) is not v})


@contextmanager
def module_stack(
    roots: nn.Module | Sequence[nn.Module],
    stack: list[str],
    on_output: Callable[[str, Any], None] | None = None,
) -> Iterator[None]:
    """Keep ``stack`` the dotted names of the modules of ``roots`` running now (innermost last;
    a name is relative to its root, the root itself ``""``) while the block runs, by forward
    hooks removed after it; ``on_output(name, output)`` is called as each forward returns, its
    name still on the stack. `check_replicas` names a module by it, `fastdist.profile` the
    module of each collective it records.

    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    >>> stack, seen = [], []
    >>> with module_stack(model, stack, on_output=lambda name, out: seen.append(list(stack))):
    ...     _ = model(torch.ones(1, 2))
    >>> seen, stack
    ([['', '0'], ['', '1'], ['']], [])
    """
    handles = []
    for root in [roots] if isinstance(roots, nn.Module) else roots:
        for name, m in root.named_modules():

            def pre(_m: nn.Module, _args: Any, name: str = name) -> None:
                stack.append(name)

            def post(_m: nn.Module, _args: Any, out: Any, name: str = name) -> None:
                if on_output is not None:
                    on_output(name, out)
                if stack:
                    stack.pop()

            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def probe_inputs(module: nn.Module, mesh: Mesh) -> dict[str, Any] | None:
    """A small batch to probe ``module`` with: ``input_ids`` of shape ``(2, S)`` (``S`` a
    multiple of the mesh size, at least 8) from ``config.vocab_size``, on the parameters'
    device, ``use_cache=False`` where the forward takes it; ``None`` for a model that takes no
    ``input_ids`` or has no vocabulary size, or whose parameters are on the meta device."""
    accepts = inspect.signature(module.forward).parameters
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    tensors = [*module.parameters(), *module.buffers()]
    if "input_ids" not in accepts or not isinstance(vocab, int) or any(t.is_meta for t in tensors):
        return None
    device = tensors[0].device if tensors else torch.device("cpu")
    seq = mesh.size * -(-8 // mesh.size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, seq), generator=g).to(device)  # (batch, seq)
    return {"input_ids": ids, **({"use_cache": False} if "use_cache" in accepts else {})}


def check_replicas(
    module: nn.Module,
    mesh: Mesh,
    layouts: Mapping[str, Layout],
    axes: Sequence[str],
    forward: RankForward,
    inputs: Mapping[str, Any] | None = None,
    *,
    changed: bool = True,
) -> None:
    """Raise `ParallelizeError` where `unreduced` finds a replicated value meeting rank-varying
    values without a ``pvary`` (see the module docstring); nothing when ``axes`` is empty, when
    there are no ``inputs`` (``None``: `probe_inputs`) to run the model on, or when the forward
    raises (a broken plan: calling the model says how). ``changed``: the message says the model
    was changed (``parallelize`` applied the plan to it) or not (a copy: ``verify``)."""
    if not axes:
        return
    inputs = probe_inputs(module, mesh) if inputs is None else inputs
    if inputs is None:
        return
    bad, error = _track(module, mesh, layouts, axes, forward, inputs)
    if not bad and isinstance(error, ReplicationError):
        _refuse_broken_rule(module, error, axes, changed)
    if not bad:
        return
    first = bad[0]
    axis = first.axes[0]
    if first.param:
        what = (
            f"the replicated parameter {first.param!r} (in {first.module!r}, {first.cls}) meets "
            f"values that vary over {_axes(first.axes)} (a rank's heads, sequence shard or "
            "experts' tokens) without a pvary: each rank's gradient would hold only its own "
            "share and the replicas would drift apart silently"
        )
        every = re.sub(r"(?<=\.)\d+(?=\.)", "*", first.module)  # model.layers.* .q_norm
        fix = (
            f"pvary it over {axis!r}: plan[{every!r}] = fastdist.nn.PvaryParams({axis!r}) (a "
            "per-head norm inside a HeadParallelAttention: norms=(...) names it), or use the "
            "plan of the model's own family (fastdist.nn.plans.plan(model, mesh))"
        )
    else:
        what = (
            f"a replicated input of {first.module or 'the model'!r} ({first.cls}) meets values "
            f"that vary over {_axes(first.axes)} without a pvary: the gradients of everything "
            "before it would be each rank's own share, different on every rank"
        )
        fix = (
            f"prepare the input: plan[<its parent>] = fastdist.nn.PrepareInput({axis!r}) for "
            f"layers that share it, or ColwiseParallel({axis!r}, input='replicated')"
        )
    if error is not None:
        fix = _whole_behind_pvary(error, axis, fix)
    more = f" ({len(bad) - 1} more: {_names(bad[1:])})" if len(bad) > 1 else ""
    tail = (
        "The model has been changed: parallelize a fresh copy with the fixed plan"
        if changed
        else "The model was not changed"
    )
    raise ParallelizeError(f"parallelize: {what}{more}. Fix: {fix}. {tail}.")


def _refuse_broken_rule(
    module: nn.Module, error: ReplicationError, axes: Sequence[str], changed: bool
) -> None:
    """Raise `ParallelizeError` for the tracked forward's ``error`` (a collective whose input's
    replication type breaks its rule: a ``pvary`` of a value that already varies, whose backward
    would sum per-rank gradients) when it names one of the plan's ``axes``; the module it rose
    in, from the traceback. The forward runs the same either way, so nothing else stops it."""
    text = str(error)
    if not any(f"'{a}'" in text for a in axes):
        return
    names = {id(m): n for n, m in module.named_modules()}
    where = ""
    tb = error.__traceback__
    while tb is not None:
        me = tb.tb_frame.f_locals.get("self")
        if isinstance(me, nn.Module) and id(me) in names:
            where = names[id(me)]
        tb = tb.tb_next
    cls = type(module.get_submodule(where)).__name__
    tail = (
        "The model has been changed: parallelize a fresh copy with the fixed plan"
        if changed
        else "The model was not changed"
    )
    what = text.removeprefix("fastdist check: ").split(". Fix:")[0].rstrip(".")
    raise ParallelizeError(
        f"parallelize: in {where or 'the model'!r} ({cls}): {what} (the forward is the same, "
        "the gradients would be wrong: pvary's backward would sum per-rank gradients). Fix: "
        "a PrepareInput or "
        "input='replicated' on a module whose input is already split (after a ColwiseParallel, "
        "or a module run whole behind a pvary) is one pvary too many: drop it, or give that "
        f"module the style that fits its input. {tail}."
    ) from error


def _whole_behind_pvary(error: Exception, axis: str, fix: str) -> str:
    """The fix when the tracked forward went on to raise ``error`` after meeting unreduced
    values: the usual sign of a module run whole on every rank behind a ``pvary`` (its output
    looks per-rank, so a later ``pvary`` of a replicated input breaks its rule, or a
    data-dependent op such as the experts' ``nonzero`` meets a varying value under vmap).
    Pvary'ing its parameters would not help there: every rank holds their whole gradient."""
    line = (str(error).splitlines() or [""])[0].removeprefix("fastdist check: ")
    line = line.split(". Fix:")[0].split(": Fix:")[0][:320].rstrip(". ")
    kind = "a collective's rule" if isinstance(error, ReplicationError) else type(error).__name__
    return (
        f"the forward then raised ({kind}: {line}): often the sign of a module run whole on "
        f"every rank behind a pvary over {axis!r} (a PrepareInput({axis!r}) on a block no "
        "style splits, such as a sparse-MoE block), whose output looks per-rank and whose "
        f"input gradient would be the sum over {axis!r}. Leave that module out of the plan "
        "(it runs replicated), give it its own parallel style (fastdist.nn.moe.ExpertParallel "
        f"on its experts); else: {fix}"
    )


def _axes(axes: Sequence[str]) -> str:
    return " and ".join(repr(a) for a in axes)


def _names(bad: Sequence[Unreduced]) -> str:
    shown = [u.param or f"input of {u.module or 'the model'}" for u in bad[:4]]
    return ", ".join(shown) + (", ..." if len(bad) > 4 else "")
