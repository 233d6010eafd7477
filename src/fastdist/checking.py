"""Replication types and checked mode, and the ``spmd`` entry point (fastdist's ``shard_map``).

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

import os
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ._context import check_of, pop_check, push_check
from ._primitive import apply_function, needs_grad
from .errors import FastdistError, MeshError
from .mesh import AxisName, Mesh

__all__ = ["Rep", "RepTracker", "ReplicationError", "PartitionSpec", "P", "spmd", "as_partial", "block_of", "CheckMode"]

CheckMode = Literal["insert", "error"]
R = TypeVar("R")

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _user_line() -> str:
    """``file:line: code`` of the innermost frame outside fastdist and torch."""
    for fs in reversed(traceback.extract_stack()):
        path = os.path.abspath(fs.filename)
        if not path.startswith((_HERE, _TORCH)) and "contextlib" not in path:
            return f"{fs.filename}:{fs.lineno}: {(fs.line or '').strip()}"
    return "<unknown>"


class ReplicationError(FastdistError, ValueError):
    """A value's replication state does not fit how it is used (checked mode).

    Attributes: ``op``, ``axis``, ``where`` (the user's source line), ``fix``.
    """

    def __init__(self, op: str, axis: object, problem: str, fix: str, where: str | None = None) -> None:
        self.op, self.axis, self.fix = op, axis, fix
        self.where = where if where is not None else _user_line()
        super().__init__(f"fastdist check: {op} over axis {axis!r} on every rank, at {self.where}: {problem}. Fix: {fix}")


@dataclass(frozen=True)
class Rep:
    """Per-axis replication state: the axes a value varies over, and those it is a partial sum over."""

    varying: frozenset[str] = frozenset()
    partial: frozenset[str] = frozenset()

    def state(self, axis: str) -> str:
        return "V" if axis in self.varying else "P" if axis in self.partial else "I"


# ----------------------------------------------------------------------------- op classes for partial values
_LINEAR_UNARY = {
    "neg", "__neg__", "clone", "contiguous", "to", "float", "double", "half", "bfloat16", "reshape", "view", "view_as", "flatten",
    "unflatten", "transpose", "permute", "t", "squeeze", "unsqueeze", "expand", "expand_as", "movedim", "narrow", "select",
    "__getitem__", "chunk", "split", "unbind", "sum", "mean", "cumsum", "detach", "real", "imag", "conj",
}
_ADDITIVE = {"add", "sub", "__add__", "__radd__", "__sub__", "__rsub__", "__iadd__", "__isub__", "add_", "sub_"}
_SCALING = {"mul", "__mul__", "__rmul__", "div", "__truediv__", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "einsum", "mul_", "div_", "__imul__", "__itruediv__", "outer", "tensordot"}
_JOIN = {"cat", "stack", "concat", "concatenate"}
_INTROSPECTION = {"__get__", "size", "dim", "numel", "__len__", "__repr__", "__format__", "is_floating_point", "is_complex", "is_contiguous", "data_ptr", "stride"}


class RepTracker:
    """Replication states of the tensors of one running ``spmd`` call (see module docstring)."""

    def __init__(self, mesh: Mesh, mode: CheckMode, *, simulated: bool) -> None:
        if mode not in ("insert", "error"):
            raise MeshError(f"spmd: check must be 'insert', 'error' or False, got {mode!r}")
        self.mesh, self.mode, self.simulated = mesh, mode, simulated
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
        """Run fastdist's own code unobserved (the mode passes ops through; collectives skip the tracker)."""
        self._suspended += 1
        push_check(self.mesh, None)  # collectives on the mesh see no check while suspended
        try:
            yield
        finally:
            pop_check()
            self._suspended -= 1

    def _pvary(self, t: Tensor, axes: Sequence[str]) -> Tensor:
        from .collectives import pvary

        with self.suspended():
            out = pvary(t, self.mesh, tuple(axes))
        rep = self.get(t)
        self.set(out, Rep(rep.varying | set(axes), rep.partial))
        return out

    def _outside_tensor(self, op: str, t: Tensor, axes: Sequence[str]) -> None:
        if self.simulated and needs_grad(t) and not self.known(t):
            raise ReplicationError(
                op, tuple(axes), "a tensor that requires grad comes from outside the spmd function (a closure?); on simulated ranks its gradient would be summed over ranks",
                "pass it as an argument with an in_spec (P() for a replicated parameter)",
            )

    # --------------------------------------------------------------- collectives
    def collective(self, prim: Any, mesh: Mesh, x: Tensor, spec: Any, params: dict[str, Any], extra: Sequence[Tensor] = ()) -> Tensor:
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
                        prim.name, label, f"its input is invariant over {a!r} but {prim.name} needs a value that varies over it",
                        f"call fastdist.pvary(x, mesh, {a!r}) first (or run with check='insert')",
                    )
                self._outside_tensor(prim.name, x, [a])
                to_vary.append(a)
                continue
            raise ReplicationError(prim.name, label, _explain(prim.name, st, a, accepted), _fix(prim.name, st, a))
        if to_vary:
            x = self._pvary(x, to_vary)
            rep = self.get(x)
        with self.suspended():
            out = cast(Tensor, prim.bind(x, *extra, spec=spec, **params))
        axes = set(names)
        self.set(out, Rep((rep.varying - axes) | (axes if produced == "V" else set()), (rep.partial - axes) | (axes if produced == "P" else set())))
        return out

    # --------------------------------------------------------------- ordinary torch ops
    def torch_op(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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
                    f"operand {i} in fastdist.pvary(t, mesh, {_label(needs[id(t)])!r})" for i, t in enumerate(tensors) if id(t) in needs
                )
                raise ReplicationError(
                    f"torch {name}", label, "an invariant value that requires grad meets a value that varies over the axis; without a pvary its gradient misses the other ranks' contributions",
                    f"wrap {wraps}" + ("" if inplace else " (or run with check='insert')"),
                )
            for t in tensors:
                if id(t) in needs:
                    self._outside_tensor(f"torch {name}", t, needs[id(t)])
            swap = {id(t): self._pvary(t, needs[id(t)]) for t in tensors if id(t) in needs}
            args, kwargs = pytree.tree_map(lambda v: swap.get(id(v), v) if isinstance(v, Tensor) else v, (args, kwargs))
        out = func(*args, **kwargs)
        rep = Rep(varying, out_partial)
        for o in pytree.tree_leaves(out):
            if isinstance(o, Tensor):
                self.set(o, rep)
        return out


def _label(axes: Sequence[str]) -> Any:
    return axes[0] if len(axes) == 1 else tuple(axes)


def _partial_ok(name: str, args: tuple[Any, ...], tensors: list[Tensor], reps: list[Rep], axis: str) -> bool:
    """True if ``name`` keeps a partial sum over ``axis`` partial; raise where it would break it."""
    states = [r.state(axis) for r in reps]
    scalars = [a for a in pytree.tree_leaves(args) if isinstance(a, (int, float, complex)) and not isinstance(a, bool)]
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
        f"torch {name}", axis, f"a partial sum over {axis!r} (each rank holds an addend) enters {name}, which does not keep it a sum of the ranks' values",
        f"psum it over {axis!r} first, or keep it in linear ops (P + P, P * invariant, P @ invariant, views, sums)",
    )


def _explain(op: str, state: str, axis: str, accepted: str) -> str:
    words = {"V": "varying", "I": "invariant", "P": "partial"}
    return f"its input is {words[state]} over {axis!r}; {op} accepts {' or '.join(words[s] for s in accepted)} values"


def _fix(op: str, state: str, axis: str) -> str:
    if op == "pvary" and state == "V":
        return f"remove the pvary: the value already varies over {axis!r} (pvary's backward would all-reduce a per-rank gradient)"
    if op == "local_chunk" and state == "V":
        return f"slice the value directly; local_chunk takes a replicated value and its backward gathers over {axis!r}"
    if state == "P":
        return f"psum (or psum_scatter) the partial value over {axis!r} first"
    return "see docs/gradients.md for the state table"


class _RepMode(TorchFunctionMode):
    def __init__(self, tracker: RepTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
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

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 2})
    >>> def row_parallel(x, w, b):
    ...     y = fd.as_partial(x @ w, mesh, "tp")   # each rank: a partial product
    ...     return fd.psum(y, mesh, "tp") + b      # bias after the sum (y + b would raise)
    >>> f = fd.spmd(row_parallel, mesh, in_specs=(fd.P(None, "tp"), fd.P("tp", None), fd.P()), out_specs=fd.P())
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
                "as_partial", _label(names), f"the value is invariant over {a!r}; as a partial sum every rank's copy would be added",
                "declare partial only what each rank computed from its own shard",
            )
    with tracker.suspended():
        out = x.view_as(x)
    tracker.set(out, Rep(rep.varying - set(names), rep.partial | set(names)))
    return out


# ============================================================================ specs and spmd
class PartitionSpec:
    """How a global tensor splits over mesh axes: one entry per leading dim.

    ``PartitionSpec("dp", None)``: dim 0 split over ``dp``, dim 1 whole. A tuple entry
    ``("dp", "tp")`` splits one dim over both axes (row-major, ``dp`` major). Axes not
    named are replicated. ``partial=("tp",)`` (out_specs only) says the per-rank values
    are addends: the global value is their sum over ``tp``.

    >>> PartitionSpec(("dp", "tp"), None)
    P(('dp', 'tp'), None)
    """

    def __init__(self, *dims: None | str | tuple[str, ...], partial: str | Sequence[str] = ()) -> None:
        for d in dims:
            if not (d is None or isinstance(d, str) or (isinstance(d, tuple) and d and all(isinstance(a, str) for a in d))):
                raise MeshError(f"PartitionSpec: each entry is None, an axis name or a tuple of names, got {d!r}")
        self.dims = tuple(dims)
        self.partial = (partial,) if isinstance(partial, str) else tuple(partial)

    def axes_of(self, i: int) -> tuple[str, ...]:
        d = self.dims[i] if i < len(self.dims) else None
        return () if d is None else (d,) if isinstance(d, str) else d

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(a for i in range(len(self.dims)) for a in self.axes_of(i))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PartitionSpec) and (self.dims, self.partial) == (other.dims, other.partial)

    def __hash__(self) -> int:
        return hash((self.dims, self.partial))

    def __repr__(self) -> str:
        inner = ", ".join(repr(d) for d in self.dims)
        return f"P({inner}{', ' if inner and self.partial else ''}{f'partial={self.partial!r}' if self.partial else ''})"


P = PartitionSpec


def block_of(x: Tensor, spec: PartitionSpec, mesh: Mesh, rank: int) -> Tensor:
    """The block of global ``x`` that ``rank`` holds under ``spec`` (a view; replicated axes: the whole dim)."""
    for d in range(len(spec.dims)):
        names = spec.axes_of(d)
        if names:
            n, i = mesh.axis_size(names), mesh.index(rank, names)
            if x.shape[d] % n:
                raise MeshError(f"PartitionSpec: {spec!r} splits dim {d} (size {x.shape[d]}) over {names} ({n} ranks), which does not divide it. Fix: pad dim {d} to a multiple of {n}")
            x = x.narrow(d, i * (x.shape[d] // n), x.shape[d] // n)
    return x


def _check_spec(where: str, mesh: Mesh, spec: Any, t: Tensor | None) -> PartitionSpec:
    if not isinstance(spec, PartitionSpec):
        raise MeshError(f"spmd: {where} must be a fastdist.P(...), got {spec!r}")
    seen = list(spec.sharded_axes) + list(spec.partial)
    for a in seen:
        mesh.axis_indices(a, f"spmd {where}")
    if len(set(seen)) != len(seen):
        raise MeshError(f"spmd: {where} {spec!r} uses a mesh axis twice. Fix: name each axis at most once per spec")
    if t is not None:
        if len(spec.dims) > t.dim():
            raise MeshError(f"spmd: {where} {spec!r} has {len(spec.dims)} entries but the tensor is {t.dim()}-d {tuple(t.shape)}")
        for i in range(len(spec.dims)):
            n = mesh.axis_size(spec.axes_of(i)) if spec.axes_of(i) else 1
            if t.shape[i] % n:
                raise MeshError(
                    f"spmd: {where} {spec!r} splits dim {i} (size {t.shape[i]}) over {spec.axes_of(i)} ({n} ranks), which does not divide it. "
                    f"Fix: pad dim {i} to a multiple of {n}"
                )
    return spec


def _holders(spec: PartitionSpec, mesh: Mesh) -> list[int]:
    """One rank per block of ``spec``: the ranks at coordinate 0 on every axis the spec does not shard."""
    unsharded = [a for a in mesh.axis_names if a not in spec.sharded_axes]
    return [r for r in range(mesh.size) if all(mesh.index(r, a) == 0 for a in unsharded)]


def _blocks(x: Tensor, spec: PartitionSpec, mesh: Mesh) -> Tensor:
    """``[world, *local]``: every rank's block of global ``x`` under ``spec``, stacked (one copy)."""
    return torch.stack([block_of(x, spec, mesh, r) for r in range(mesh.size)])


class _ShardStacked(torch.autograd.Function):
    """Global ``x`` -> ``[world, *local]``: every simulated rank's block under ``spec``.

    Backward: each block's gradient is the mean over the ranks that hold it. This is what a
    global input replicated to every rank and then ``local_chunk``-ed computes (under correct
    replication types those ranks' gradients agree, so the mean is exact; a sum would count
    the block once per replica), without ``world`` full copies each way.
    """

    @staticmethod
    def forward(x: Tensor, spec: PartitionSpec, mesh: Mesh) -> Tensor:
        return _blocks(x, spec, mesh)  # [world, *local]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.shape, ctx.spec, ctx.mesh = inputs[0].shape, inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        spec, mesh = ctx.spec, ctx.mesh
        if not spec.sharded_axes:
            return g.mean(0), None, None
        full = g.new_zeros(ctx.shape)
        for r in range(mesh.size):
            block_of(full, spec, mesh, r).add_(g[r])  # this rank's block, into its place
        return full / (mesh.size // mesh.axis_size(spec.sharded_axes)), None, None  # the mean over each block's holders


class _UnshardStacked(torch.autograd.Function):
    """``[world, *local]`` -> global: the blocks assembled, each from the lowest rank holding it.

    The transpose of :class:`_ShardStacked`'s forward: backward gives every rank its block of
    the cotangent (an output replicated over an axis hands each replica the same cotangent).
    """

    @staticmethod
    def forward(y: Tensor, spec: PartitionSpec, mesh: Mesh) -> Tensor:
        shape = [n * (mesh.axis_size(spec.axes_of(d)) if d < len(spec.dims) and spec.axes_of(d) else 1) for d, n in enumerate(y.shape[1:])]
        full = y.new_empty(shape)  # the global shape: each sharded dim times its axes' size
        for r in _holders(spec, mesh):
            block_of(full, spec, mesh, r).copy_(y[r])
        return full

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.spec, ctx.mesh = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        return _blocks(g, ctx.spec, ctx.mesh), None, None


def _refuse_checked_compile(mode: str) -> None:
    """Raise, while dynamo traces, the error that says how to compile an spmd step.

    The checked mode decides the ``pvary`` insertions with Python bookkeeping on every op, which
    dynamo cannot trace; compiling it unchecked would silently drop the inserted ``pvary``s
    (wrong gradients), so it is refused instead.
    """
    raise MeshError(
        f"spmd: check={mode!r} runs eagerly only (its replication bookkeeping cannot be traced by torch.compile, and compiling "
        "the step unchecked would drop the pvary it inserts: wrong gradients). Fix: run the step once eagerly with "
        "check='error', write the pvary calls it names, and compile fd.spmd(..., check=False)"
    )


def spmd(
    fn: Callable[..., R],
    mesh: Mesh,
    in_specs: Sequence[PartitionSpec | None],
    out_specs: PartitionSpec | Sequence[PartitionSpec],
    *,
    check: CheckMode | bool | None = None,
) -> Callable[..., R]:
    """Call per-rank ``fn`` on global tensors: split the inputs by ``in_specs``, join the outputs by ``out_specs``.

    Like JAX's ``shard_map``. Every positional argument gets a spec (``None`` for a
    non-tensor); the function sees each rank's shard and returns per-rank values, whose
    replication states are checked against ``out_specs``: an axis an out spec does not
    name must be invariant (or declared ``partial``).

    Args:
        check: ``"insert"`` (default on simulated meshes) inserts the ``pvary`` where an
            invariant value meets a varying one; ``"error"`` raises there instead;
            ``False`` (default on real ranks) tracks nothing. ``True`` means ``"insert"``.
            The checked modes run eagerly only: under ``torch.compile(fullgraph=True)`` they
            raise (compile ``check=False`` after writing the ``pvary``s ``"error"`` names).

    On a simulated mesh (no torch.distributed) the call runs every rank with
    :func:`fastdist.simulate` and returns one global result; gradients with respect to
    the global inputs equal those of the single-device computation. On a mesh from
    ``Mesh.from_torch`` each process passes the same global tensors and gets the global
    result.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 2})
    >>> f = fd.spmd(lambda x, w: fd.psum(x @ w, mesh, "tp"), mesh, in_specs=(fd.P(None, "tp"), fd.P("tp", None)), out_specs=fd.P())
    >>> x, w = torch.ones(3, 4), torch.ones(4, 5)
    >>> bool(torch.equal(f(x, w), x @ w))
    True
    """
    simulated = mesh._comm is None
    mode: CheckMode | None
    if check is None:
        mode = "insert" if simulated else None
    elif check is True:
        mode = "insert"
    elif check is False:
        mode = None
    else:
        mode = check
    if mode is not None and mode not in ("insert", "error"):
        raise MeshError(f"spmd: check must be 'insert', 'error', True or False, got {check!r}")
    single_out = isinstance(out_specs, PartitionSpec)
    outs: list[PartitionSpec] = [out_specs] if isinstance(out_specs, PartitionSpec) else list(out_specs)
    for i, s in enumerate(outs):
        _check_spec(f"out_specs[{i}]", mesh, s, None)

    def per_rank(*args: Any) -> Any:
        if mode is not None and torch.compiler.is_compiling():
            _refuse_checked_compile(mode)
        # Real ranks: each process takes its blocks and joins the outputs with collectives.
        # Simulated ranks get their blocks already cut (_ShardStacked) and return them as they
        # are, to be assembled once outside (_UnshardStacked): the same values and gradients
        # as local_chunk / all_gather_invariant per rank, without world-sized copies.
        local = []
        states: list[Rep | None] = []
        for i, (a, s) in enumerate(zip(args, in_specs)):
            if isinstance(a, Tensor):
                s = cast(PartitionSpec, s)
                for d in range(len(s.dims) if not simulated else 0):
                    if s.axes_of(d):
                        a = _local_chunk(a, s.axes_of(d), d)
                states.append(Rep(frozenset(s.sharded_axes)))
            else:
                states.append(None)
            local.append(a)
        result = checked_call(fn, mesh, mode, local, states, outs, single_out, simulated=simulated)
        return _join(result, outs, single_out)

    def _local_chunk(t: Tensor, axes: tuple[str, ...], dim: int) -> Tensor:
        from .collectives import local_chunk

        return local_chunk(t, mesh, axes if len(axes) > 1 else axes[0], dim)

    def _join(result: Any, specs: list[PartitionSpec], single: bool) -> Any:
        from .collectives import all_gather_invariant, psum

        items = [result] if single else list(result)
        if len(items) != len(specs):
            raise MeshError(f"spmd: fn returned {len(items)} outputs but out_specs has {len(specs)}")
        joined = []
        for y, s in zip(items, specs):
            if s.partial:
                y = psum(y, mesh, s.partial if len(s.partial) > 1 else s.partial[0])
            for d in range(len(s.dims) if not simulated else 0):
                if s.axes_of(d):
                    axes = s.axes_of(d)
                    y = all_gather_invariant(y, mesh, axes if len(axes) > 1 else axes[0], d)
            joined.append(y)
        return joined[0] if single else tuple(joined)

    def run(*args: Any) -> R:
        if len(args) != len(in_specs):
            raise MeshError(f"spmd: got {len(args)} arguments but {len(in_specs)} in_specs. Fix: one spec per argument (None for non-tensors)")
        for i, (a, s) in enumerate(zip(args, in_specs)):
            if isinstance(a, Tensor):
                if _check_spec(f"in_specs[{i}]", mesh, s, a).partial:
                    raise MeshError(f"spmd: in_specs[{i}] {s!r} is partial; partial= is for out_specs. Fix: pass the summed global value")
        if not simulated:
            return cast(R, per_rank(*args))
        from .simulate import simulate

        stacked = [apply_function(_ShardStacked, a, s, mesh) if isinstance(a, Tensor) else a for a, s in zip(args, in_specs)]
        out = simulate(per_rank, mesh)(*stacked)
        full = tuple(apply_function(_UnshardStacked, o, s, mesh) for o, s in zip([out] if single_out else out, outs))
        return cast(R, full[0] if single_out else full)

    return run


def checked_call(
    fn: Callable[..., Any], mesh: Mesh, mode: CheckMode | None, args: Sequence[Any], states: Sequence[Rep | None],
    out_specs: list[PartitionSpec], single_out: bool, *, simulated: bool,
) -> Any:
    """Run per-rank ``fn`` on local ``args`` whose replication ``states`` are known; check its outputs.

    The core of :func:`spmd`, without the sharding and joining (``fastdist.testing`` uses it
    to compare every rank's gradients).
    """
    if mode is None:
        return fn(*args)
    tracker = RepTracker(mesh, mode, simulated=simulated)
    with tracking(tracker):
        for t, st in zip(args, states):
            if st is not None:
                tracker.set(t, st)
        result = fn(*args)
    _check_outputs(tracker, result, out_specs, single_out)
    return result


def _check_outputs(tracker: RepTracker, result: Any, specs: list[PartitionSpec], single: bool) -> None:
    items = [result] if single else list(result) if isinstance(result, (tuple, list)) else [result]
    for i, (y, s) in enumerate(zip(items, specs)):
        if not isinstance(y, Tensor):
            raise MeshError(f"spmd: output {i} is a {type(y).__name__}, not a tensor")
        rep = tracker.get(y)
        sharded = set(s.sharded_axes)
        for a in tracker.mesh.axis_names:
            st = rep.state(a)
            if a in sharded:
                continue
            if a in s.partial:
                if st == "I":
                    raise ReplicationError("spmd out_specs", a, f"output {i} is invariant over {a!r} but {s!r} declares it partial (its copies would be summed)", f"drop partial={a!r} from the spec", where="spmd output")
                continue
            if st == "V":
                raise ReplicationError(
                    "spmd out_specs", a, f"output {i} varies over {a!r} but {s!r} does not name {a!r}, which declares it replicated",
                    f"psum/pmean/all_gather_invariant it over {a!r} inside fn, or split a dim over {a!r} in the out spec", where="spmd output",
                )
            if st == "P":
                raise ReplicationError(
                    "spmd out_specs", a, f"output {i} is a partial sum over {a!r} but {s!r} declares it replicated",
                    f"psum it over {a!r} inside fn, or declare P(..., partial={a!r})", where="spmd output",
                )

