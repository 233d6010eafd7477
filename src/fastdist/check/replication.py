"""Replication types: the per-axis state of every value in a checked ``spmd`` call, and the tracker.

Every tensor inside a checked :func:`spmd` call has, per mesh axis, a **replication state**:

* ``V`` varying: may differ between the ranks of the axis;
* ``I`` invariant: the same on every rank of the axis;
* ``P`` partial: a pending sum, each rank holds an addend (only where declared).

Representation: a :class:`RepTracker` that lives for one ``spmd`` call. It records the state
of every tensor the per-rank function produces (a side table keyed by tensor identity) through
a ``TorchFunctionMode`` that sees every torch op, and each collective checks its input states
against its declared rule (``Primitive.replication`` in ``collectives.py``). A tensor the
tracker has not seen (a constant built inside the function) is invariant.

Rules for ordinary torch ops, per axis:

* all inputs invariant -> invariant;
* a varying input meets an invariant one that requires grad: the invariant one is passed
  through ``pvary`` first (``check="insert"``, the default on simulated meshes), so its
  backward gets the all-reduce it needs, or :class:`ReplicationError` points at the line
  (``check="error"``); the result is varying;
* partial inputs flow only through linear ops (``P + P``, ``P * I``, ``P @ I``, views,
  sums, ...); anything else raises: psum first.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from fastdist.core.context import check_of, pop_check, push_check
from fastdist.core.transforms import needs_grad
from fastdist.errors import MeshError, ReplicationError

if TYPE_CHECKING:
    from fastdist.core.mesh import AxisName, Mesh

__all__ = ["Rep", "RepTracker", "ReplicationError", "as_partial", "tracking", "CheckMode"]

CheckMode = Literal["insert", "error"]


@dataclass(frozen=True)
class Rep:
    """Per-axis replication state: the axes a value varies over, and those it is a partial sum
    over."""

    varying: frozenset[str] = frozenset()
    partial: frozenset[str] = frozenset()

    def state(self, axis: str) -> str:
        return "V" if axis in self.varying else "P" if axis in self.partial else "I"


# ----------------------------------------------------------------------------- op classes for
# partial values
_LINEAR_UNARY = {
    "neg",
    "__neg__",
    "clone",
    "contiguous",
    "to",
    "float",
    "double",
    "half",
    "bfloat16",
    "reshape",
    "view",
    "view_as",
    "flatten",
    "unflatten",
    "transpose",
    "permute",
    "t",
    "squeeze",
    "unsqueeze",
    "expand",
    "expand_as",
    "movedim",
    "narrow",
    "select",
    "__getitem__",
    "chunk",
    "split",
    "unbind",
    "sum",
    "mean",
    "cumsum",
    "detach",
    "real",
    "imag",
    "conj",
}
_ADDITIVE = {
    "add",
    "sub",
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__iadd__",
    "__isub__",
    "add_",
    "sub_",
}
_SCALING = {
    "mul",
    "__mul__",
    "__rmul__",
    "div",
    "__truediv__",
    "matmul",
    "__matmul__",
    "__rmatmul__",
    "mm",
    "bmm",
    "einsum",
    "mul_",
    "div_",
    "__imul__",
    "__itruediv__",
    "outer",
    "tensordot",
}
_JOIN = {"cat", "stack", "concat", "concatenate"}
_INTROSPECTION = {
    "__get__",
    "size",
    "dim",
    "numel",
    "__len__",
    "__repr__",
    "__format__",
    "is_floating_point",
    "is_complex",
    "is_contiguous",
    "data_ptr",
    "stride",
}


class RepTracker:
    """Replication states of the tensors of one running ``spmd`` call (see module docstring)."""

    def __init__(
        self,
        mesh: Mesh,
        mode: CheckMode,
        *,
        simulated: bool,
        on_insert: Callable[[Tensor, tuple[str, ...]], None] | None = None,
    ) -> None:
        """``on_insert(t, axes)``: called for every ``pvary`` the tracker inserts (``t`` the
        invariant value, ``axes`` those it is pvary'd over); `fastdist.nn.parallelize` uses it to
        find replicated parameters that meet rank-varying values."""
        if mode not in ("insert", "error"):
            raise MeshError(f"spmd: check must be 'insert', 'error' or False, got {mode!r}")
        self.mesh, self.mode, self.simulated = mesh, mode, simulated
        self.on_insert = on_insert
        self._states: dict[int, tuple[weakref.ref[Tensor], Rep]] = {}
        self._suspended = 0

    # --------------------------------------------------------------- the side table
    def get(self, t: Tensor) -> Rep:
        entry = self._states.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else Rep()

    def known(self, t: Tensor) -> bool:
        entry = self._states.get(id(t))
        return entry is not None and entry[0]() is t

    def set(self, t: Tensor, rep: Rep) -> None:
        key = id(t)

        def forget(_: weakref.ref[Tensor]) -> None:  # runs when t dies, before its id can be reused
            self._states.pop(key, None)

        self._states[key] = (weakref.ref(t, forget), rep)

    def mark_varying(self, t: Tensor, axes: Sequence[str]) -> None:
        rep = self.get(t)
        self.set(t, Rep(rep.varying | set(axes), rep.partial - set(axes)))

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Run fastdist's own code unobserved (the mode passes ops through; collectives skip the
        tracker)."""
        self._suspended += 1
        push_check(self.mesh, None)  # collectives on the mesh see no check while suspended
        try:
            yield
        finally:
            pop_check()
            self._suspended -= 1

    def _pvary(self, t: Tensor, axes: Sequence[str]) -> Tensor:
        from fastdist.ops import pvary

        if self.on_insert is not None:
            self.on_insert(t, tuple(axes))
        with self.suspended():
            out = pvary(t, self.mesh, tuple(axes))
        rep = self.get(t)
        self.set(out, Rep(rep.varying | set(axes), rep.partial))
        return out

    def _outside_tensor(self, op: str, t: Tensor, axes: Sequence[str]) -> None:
        if self.simulated and needs_grad(t) and not self.known(t):
            raise ReplicationError(
                op,
                tuple(axes),
                "a tensor that requires grad comes from outside the spmd function (a closure?); "
                "on simulated ranks its gradient would be summed over ranks",
                "pass it as an argument with an in_spec (P() for a replicated parameter)",
            )

    # --------------------------------------------------------------- collectives
    def collective(
        self,
        prim: Any,
        mesh: Mesh,
        x: Tensor,
        spec: Any,
        params: dict[str, Any],
        extra: Sequence[Tensor] = (),
    ) -> Tensor:
        names = [mesh.axis_names[i] for i in spec.axes]
        if prim.replication is None:
            with self.suspended():
                return cast(Tensor, prim.bind(x, *extra, spec=spec, **params))
        accepted, produced = prim.replication
        rep = self.get(x)
        label = _label(names)
        to_vary = []
        for a in names:
            st = rep.state(a)
            if st in accepted:
                continue
            if st == "I" and "V" in accepted:
                if self.mode == "error" and needs_grad(x):
                    raise ReplicationError(
                        prim.name,
                        label,
                        f"its input is invariant over {a!r} but {prim.name} needs a value that "
                        "varies over it",
                        f"call fastdist.pvary(x, mesh, {a!r}) first (or run with check='insert')",
                    )
                self._outside_tensor(prim.name, x, [a])
                to_vary.append(a)
                continue
            raise ReplicationError(
                prim.name, label, _explain(prim.name, st, a, accepted), _fix(prim.name, st, a)
            )
        if to_vary:
            x = self._pvary(x, to_vary)
            rep = self.get(x)
        with self.suspended():
            out = cast(Tensor, prim.bind(x, *extra, spec=spec, **params))
        axes = set(names)
        self.set(
            out,
            Rep(
                (rep.varying - axes) | (axes if produced == "V" else set()),
                (rep.partial - axes) | (axes if produced == "P" else set()),
            ),
        )
        return out

    # --------------------------------------------------------------- ordinary torch ops
    def torch_op(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        name = getattr(func, "__name__", str(func))
        leaves = pytree.tree_leaves((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, Tensor)]
        if not tensors:
            return func(*args, **kwargs)
        if name in _INTROSPECTION:  # shape queries, and property reads such as x.T, x.mT, x.real
            out = func(*args, **kwargs)
            if isinstance(out, Tensor) and len(tensors) == 1:
                self.set(out, self.get(tensors[0]))
            return out
        reps = [self.get(t) for t in tensors]
        varying = frozenset().union(*(r.varying for r in reps))
        partial = frozenset().union(*(r.partial for r in reps))
        out_partial = frozenset(a for a in partial if _partial_ok(name, args, tensors, reps, a))
        # invariant inputs that need grads, meeting varying ones
        needs: dict[int, list[str]] = {}
        for t, r in zip(tensors, reps):
            if needs_grad(t):
                missing = [a for a in sorted(varying) if a not in r.varying]
                if missing:
                    needs[id(t)] = missing
        if needs:
            label = _label(sorted({a for v in needs.values() for a in v}))
            inplace = name.endswith("_") and not name.endswith("__") or name.startswith("__i")
            if self.mode == "error" or inplace:
                wraps = " and ".join(
                    f"operand {i} in fastdist.pvary(t, mesh, {_label(needs[id(t)])!r})"
                    for i, t in enumerate(tensors)
                    if id(t) in needs
                )
                raise ReplicationError(
                    f"torch {name}",
                    label,
                    "an invariant value that requires grad meets a value that varies over the "
                    "axis; without a pvary its gradient misses the other ranks' contributions",
                    f"wrap {wraps}" + ("" if inplace else " (or run with check='insert')"),
                )
            for t in tensors:
                if id(t) in needs:
                    self._outside_tensor(f"torch {name}", t, needs[id(t)])
            swap = {id(t): self._pvary(t, needs[id(t)]) for t in tensors if id(t) in needs}
            args, kwargs = pytree.tree_map(
                lambda v: swap.get(id(v), v) if isinstance(v, Tensor) else v, (args, kwargs)
            )
        out = func(*args, **kwargs)
        rep = Rep(varying, out_partial)
        for o in pytree.tree_leaves(out):
            if isinstance(o, Tensor):
                self.set(o, rep)
        return out


def _label(axes: Sequence[str]) -> Any:
    return axes[0] if len(axes) == 1 else tuple(axes)


def _partial_ok(
    name: str, args: tuple[Any, ...], tensors: list[Tensor], reps: list[Rep], axis: str
) -> bool:
    """True if ``name`` keeps a partial sum over ``axis`` partial; raise where it would break it."""
    states = [r.state(axis) for r in reps]
    scalars = [
        a
        for a in pytree.tree_leaves(args)
        if isinstance(a, (int, float, complex)) and not isinstance(a, bool)
    ]
    if name in _LINEAR_UNARY and len(tensors) == 1:
        return True
    if name in _ADDITIVE and all(s == "P" for s in states) and not scalars:
        return True
    if name in _SCALING and states.count("P") == 1 and all(s in ("P", "I") for s in states):
        if name not in ("div", "__truediv__", "div_", "__itruediv__") or states[0] == "P":
            return True
    if name in _JOIN and all(s == "P" for s in states):
        return True
    raise ReplicationError(
        f"torch {name}",
        axis,
        f"a partial sum over {axis!r} (each rank holds an addend) enters {name}, which does not "
        "keep it a sum of the ranks' values",
        f"psum it over {axis!r} first, or keep it in linear ops (P + P, P * invariant, P @ "
        "invariant, views, sums)",
    )


def _explain(op: str, state: str, axis: str, accepted: str) -> str:
    words = {"V": "varying", "I": "invariant", "P": "partial"}
    return (
        f"its input is {words[state]} over {axis!r}; {op} accepts "
        f"{' or '.join(words[s] for s in accepted)} values"
    )


def _fix(op: str, state: str, axis: str) -> str:
    if op == "pvary" and state == "V":
        return (
            f"remove the pvary: the value already varies over {axis!r} (pvary's backward would "
            "all-reduce a per-rank gradient)"
        )
    if op == "local_chunk" and state == "V":
        return (
            "slice the value directly; local_chunk takes a replicated value and its backward "
            f"gathers over {axis!r}"
        )
    if state == "P":
        return f"psum (or psum_scatter) the partial value over {axis!r} first"
    return "see docs/gradients.md for the state table"


class _RepMode(TorchFunctionMode):
    def __init__(self, tracker: RepTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.tracker._suspended:
            return func(*args, **kwargs)
        return self.tracker.torch_op(func, args, kwargs)


@contextmanager
def tracking(tracker: RepTracker) -> Iterator[None]:
    """Make ``tracker`` observe collectives on its mesh and every torch op, for the block."""
    push_check(tracker.mesh, tracker)
    try:
        with _RepMode(tracker):
            yield
    finally:
        pop_check()


def as_partial(x: Tensor, mesh: Mesh, axis: AxisName) -> Tensor:
    """Declare that ``x`` is this rank's addend of a sum over ``axis`` (replication state partial).

    Forward and backward are the identity; only the checked mode of :func:`spmd` sees
    it, and then keeps the value out of anything but linear ops until a ``psum``:

    Args:
        x: this rank's addend.
        mesh: the mesh the code runs on.
        axis: the axis (or tuple of axes) the global value is the sum over.

    Returns:
        ``x`` itself, marked partial over ``axis`` for the checked mode of ``spmd``.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 2})
    >>> def row_parallel(x, w, b):
    ...     y = fd.as_partial(x @ w, mesh, "tp")   # each rank: a partial product
    ...     return fd.psum(y, mesh, "tp") + b      # bias after the sum (y + b would raise)
    >>> in_specs = (fd.P(None, "tp"), fd.P("tp", None), fd.P())
    >>> f = fd.spmd(row_parallel, mesh, in_specs=in_specs, out_specs=fd.P())
    >>> x, w, b = torch.ones(2, 4), torch.ones(4, 3), torch.ones(3)
    >>> bool(torch.equal(f(x, w, b), x @ w + b))
    True
    """
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    mesh.axis_indices(names, "fastdist.as_partial")
    tracker = check_of(mesh)
    if tracker is None:
        return x
    rep = tracker.get(x)
    for a in names:
        if rep.state(a) == "I":
            raise ReplicationError(
                "as_partial",
                _label(names),
                f"the value is invariant over {a!r}; "
                "as a partial sum every rank's copy would be added",
                "declare partial only what each rank computed from its own shard",
            )
    with tracker.suspended():
        out = x.view_as(x)
    tracker.set(out, Rep(rep.varying - set(names), rep.partial | set(names)))
    return out
