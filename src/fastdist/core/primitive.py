"""The machinery that turns one collective's rules into ``torch.library`` ops.

A collective is declared once, in ``collectives.py`` (or ``uneven.py``), as a
:class:`Primitive` with these rules:

* ``shape``: the per-rank output shape (the fake/meta rule).
* ``stacked``: the forward over all ranks at once, on a tensor whose leading
  dimension is the rank (``[world, *per_rank_shape]``). This is the simulated
  implementation and the vmap rule's body.
* ``distributed``: the forward on one real rank, with torch's functional
  collectives on the rank's process group.
* ``backward``: the per-rank gradient rule, written with other primitives
  (``ops.psum_scatter(g, ...)``), so forward/backward pairs read like a table.
* ``replication``: accepted input states and the output state (varying,
  invariant, partial), for the checked mode of ``fastdist.spmd``.

From those, :class:`Primitive` registers two ops in the ``fastdist`` namespace
and one ``torch.autograd.Function``. The split follows what torch 2.13 allows
(see docs/design.md, "Why two ops"):

``fastdist::<name>`` (per-rank op)
    What user code calls, on one rank's tensor. Fake rule from ``shape``. Its
    vmap rule treats the vmapped dimension as the rank dimension of
    :func:`fastdist.simulate` and calls the stacked op. Its eager kernel runs
    only on a one-rank mesh.
``fastdist::<name>_stacked`` (stacked op)
    The collective over ``[world, ...]``. Its autograd formula is the *per-rank*
    backward rule written over the stacked dimension (each rank's slice of the
    gradient is what that rank's own ``backward()`` would produce: not the
    mathematical transpose of the stacked function). A vmap rule treats an
    outer vmap dimension as data.
``<Name>Function`` (autograd.Function, ``setup_context`` + ``generate_vmap_rule``)
    Used only while a ``torch.func`` grad/jvp transform is active or a
    ``torch.autograd.forward_ad`` dual level is open (its ``jvp`` runs the primitive's ``jvp``
    rule: the ops carry no tangent), so ``torch.func.grad`` / ``vmap(grad)`` / ``jvp`` work
    (``register_autograd`` on a custom op does not compose with ``torch.func`` in 2.13).
    Otherwise (outer
    ``backward()``, no transform but simulate's vmap, and under ``torch.compile``,
    where dynamo ignores an autograd.Function's vmap rule and would record wrong
    gradients) the per-rank op is called directly and the stacked op's
    registered autograd records the per-rank rule: the backward then runs on
    stacked tensors, with no vmap and no functorch wrapping of the Function.
``<Name>StackedFunction`` (old-style autograd.Function)
    The stacked forward with the same per-rank backward rule, for the usual eager
    case: inside simulate's own vmap, ``bind`` unwraps the rank dimension itself
    (what the per-rank op's vmap rule would do, without torch.library's per-call
    Python plumbing) and, when a gradient can flow, calls this Function at its C
    entry point instead of the stacked op, whose registered autograd would add
    torch.library's Python wrapper. Same graph semantics, a fraction of the cost.
``<Name>DistributedFunction``
    On real ranks (``spec.comm`` set): the ``distributed`` forward with the same
    per-rank backward rule; dynamo traces it in compiled steps.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from fastdist.core.context import COLLECTIVE_OBSERVERS
from fastdist.core.transforms import (
    C_APPLY,
    FAST_PATH,
    FUNCTORCH,
    FWAD,
    TRANSFORM_PROBLEMS,
    UNPACK_DUAL,
    ParamValues,
    any_needs_grad,
    apply_function,
    forward_mode_active,
    needs_grad,
    only_vmap,
    plain_call,
    transform_error,
)
from fastdist.errors import CollectiveError, NoBackendError

if TYPE_CHECKING:
    from fastdist.core.comm import AxisComm

__all__ = [
    "GroupSpec",
    "Primitive",
    "ops",
    "stacked_ops",
    "PRIMITIVES",
]

# The op namespace. Declaring ops in it is the one thing importing fastdist does.
_LIB = torch.library.Library("fastdist", "DEF")  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class GroupSpec:
    """Which ranks talk: the mesh shape and the positions of the axes reduced over.

    Pure data (two tuples of ints), so it is hashable, passes through
    ``torch.library`` schemas as ``int[]`` and is a constant under dynamo.
    """

    mesh_shape: tuple[int, ...]
    axes: tuple[int, ...]
    #: total number of ranks
    world: int = field(init=False, compare=False)
    #: group size: ranks that take part in one collective
    n: int = field(init=False, compare=False)
    _others: tuple[int, ...] = field(init=False, compare=False, repr=False)
    #: the group's axes are consecutive mesh axes in mesh order (axis_view is then a view)
    _consecutive: bool = field(init=False, compare=False, repr=False)
    #: on real ranks: this rank's group along the axes (a :class:`fastdist.core.comm.AxisComm`)
    comm: AxisComm | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Plain ints, so dynamo sees constants when tracing. A custom op's kernel (``_split``)
        # that dynamo compiles as a frame of its own (the op run eagerly at a graph break) gets
        # the int lists as inputs, which automatic dynamic shapes make symbolic once they differ
        # between calls; ``operator.index`` specializes them (with a guard), where ``int()``
        # keeps them symbolic and dynamo then evaluates ``i not in self.axes`` wrongly (torch
        # 2.13: a 2 x 2 mesh's axes=(1,) gave _others=(0, 1), a 7-long permutation in to_groups).
        object.__setattr__(self, "mesh_shape", tuple(operator.index(s) for s in self.mesh_shape))
        object.__setattr__(self, "axes", tuple(operator.index(a) for a in self.axes))
        # Computed once here (plain ints), so dynamo sees constants when tracing.
        object.__setattr__(self, "world", math.prod(self.mesh_shape))
        object.__setattr__(self, "n", math.prod([self.mesh_shape[a] for a in self.axes]))
        object.__setattr__(
            self, "_others", tuple(i for i in range(len(self.mesh_shape)) if i not in self.axes)
        )
        object.__setattr__(
            self,
            "_consecutive",
            self.axes == tuple(range(self.axes[0], self.axes[0] + len(self.axes)))
            if self.axes
            else True,
        )

    def axis_view(self, xs: Tensor) -> tuple[Tensor, int]:
        """``[world, *s] -> [*before, n, *after, *s]`` and the position of ``n`` (the member dim).

        A view when the group's axes are consecutive mesh axes in mesh order (a single axis
        always is), so a rule can work in the mesh layout with no permute copies; otherwise
        the ``[G, n, *s]`` layout of :meth:`to_groups` (a copy) with the member dim at 1.
        Either way, reshaping a result of the same layout to ``[world, ...]`` undoes it when
        it is contiguous: see :meth:`from_axis_view`.
        """
        if not self._consecutive:
            return self.to_groups(xs), 1
        a0, k = self.axes[0], len(self.axes)
        # the group's axes merged into one dim
        shape = (
            *self.mesh_shape[:a0],
            self.n,
            *self.mesh_shape[a0 + k :],
        )
        return xs.reshape(*shape, *xs.shape[1:]), a0  # [*before, n, *after, *s]

    def from_axis_view(self, y: Tensor, s: Sequence[int]) -> Tensor:
        """Inverse of :meth:`axis_view` for a result ``y`` of per-rank shape ``s``: contiguous,
        copied only if it must be."""
        if not self._consecutive:
            # [G, n, *s] -> [world, *s]
            return self.from_groups(y.reshape(self.world // self.n, self.n, *s))
        if y.shape == (self.world, *s):
            # already [world, *s] (a one-axis mesh): no reshape, so a fresh result stays a fresh
            # tensor, not a view of one (a view made inside a collective's autograd.Function
            # cannot be modified in place)
            return y.contiguous()
        return y.reshape(
            self.world, *s
        ).contiguous()  # mesh layout -> [world, *s] (contiguous, as the fake rule says)

    def to_groups(self, xs: Tensor) -> Tensor:
        """``[world, *s] -> [G, n, *s]``: dim 1 indexes the member within its group (axis order)."""
        s = xs.shape[1:]
        m = len(self.mesh_shape)
        y = xs.reshape(*self.mesh_shape, *s)  # [*mesh_shape, *s]
        # [*other axes, *group axes, *s]
        y = y.permute(*self._others, *self.axes, *range(m, m + len(s)))
        # [G, n, *s] (explicit G: -1 is ambiguous for empty tensors)
        return y.reshape(self.world // self.n, self.n, *s)

    def from_groups(self, y: Tensor) -> Tensor:
        """Inverse of :meth:`to_groups`: ``[G, n, *s] -> [world, *s]`` (contiguous)."""
        s = y.shape[2:]
        m = len(self.mesh_shape)
        order = (*self._others, *self.axes)
        y = y.reshape(*(self.mesh_shape[i] for i in order), *s)  # [*other axes, *group axes, *s]
        inverse = sorted(range(m), key=order.__getitem__)
        y = y.permute(*inverse, *range(m, m + len(s)))  # [*mesh_shape, *s]
        return y.reshape(self.world, *s).contiguous()  # [world, *s]

    def member_index(self, device: torch.device | None = None) -> Tensor:
        """``[G, n]`` index of each member within its group (0..n-1), for masks."""
        return torch.arange(self.n, device=device).expand(self.world // self.n, self.n)


def _refuse_forward_mode_while_tracing(name: str, mesh_shape: Any, axes: Any) -> bool:
    """Called (not traced) while dynamo traces a simulated collective: raise the op's
    forward-mode error when forward mode is active, since the compiled graph records the ops,
    which carry no tangent (a tangent through torch.compile would come out dropped or wrong).
    Raised at trace time, the error stops the compilation (a raise in traced code would be a
    graph break). Returns False."""
    if forward_mode_active():
        spec = GroupSpec(tuple(mesh_shape), tuple(axes))
        raise PRIMITIVES[name].forward_mode_error(
            spec, "torch.func.jvp or forward_ad", "under torch.compile records ops without one"
        )
    return False


# dynamo calls it while tracing, its result a constant (torch._dynamo.assume_constant_result's
# marker, set without importing dynamo; tests/test_import_time.py checks the marker's name)
_refuse_forward_mode_while_tracing._dynamo_marked_constant = True  # type: ignore[attr-defined]


ShapeRule = Callable[..., Sequence[Any]]
StackedRule = Callable[..., Tensor]
DistributedRule = Callable[..., Tensor]
BackwardRule = Callable[..., tuple[Any, ...]]
JvpRule = Callable[..., Tensor | None]

PRIMITIVES: dict[str, Primitive] = {}  # filled once, declaratively, by collectives.py


class Primitive:
    """One collective: its rules, and the ops and autograd.Function built from them.

    Args:
        name: op name in the ``fastdist`` namespace.
        params: ``(name, schema type)`` of the non-tensor parameters, e.g.
            ``(("dim", "int"), ("tiled", "bool"))``.
        shape: ``shape(n, *per_rank_input_shapes, **params) -> output shape``.
        stacked: ``stacked(spec, *stacked_inputs, **params) -> [world, ...] tensor``.
        distributed: ``distributed(comm, *inputs, **params)``: the forward on one real rank,
            with ``comm`` the rank's :class:`~fastdist.core.comm.AxisComm` (functional
            collectives, traceable by dynamo). Only called for groups of 2+ ranks.
        backward: ``backward(ops, spec, g, saved, **params) -> grads per tensor input``,
            where ``ops`` calls other primitives (per-rank or stacked, whichever
            side is differentiating) and ``saved`` holds ``inputs + (output,)``
            when ``saves=True``.
        inputs: names of the tensor inputs.
        dim_params: parameters that are per-rank tensor dims (documentation: an outer vmap's
            data dimension goes after every per-rank dim, so none is shifted).
        replication: ``(accepted, output)`` replication states over the op's axes,
            from ``V`` (varying), ``I`` (invariant), ``P`` (partial sum), e.g.
            ``("VP", "I")`` for psum; ``None`` for internal ops. Read by the checked
            mode of :func:`fastdist.spmd` (``fastdist.check.replication``).
        jvp: the forward-mode rule, ``jvp(ops, spec, tangents, saved, **params) -> tangent``
            of the output (per rank, written with ``ops`` as ``backward``; ``tangents`` holds one
            entry per tensor input, ``None`` where it has none), or ``"linear"``: the op is
            linear in its one tensor input, so the tangent is the op itself applied to the
            tangent with the same parameters. ``None``: forward mode is refused with a
            :class:`~fastdist.errors.CollectiveError` at the first call (never a dropped tangent).
        reduces: the kind of reduction the op performs across ranks (``"sum"``, ``"mean"``,
            ``"max"``, ``"min"``), or ``None`` for ops that only move data. Its public
            function checks the input dtype against the one rule of ``fastdist.core.dtype_rule``.
    """

    def __init__(
        self,
        name: str,
        *,
        params: Sequence[tuple[str, str]] = (),
        shape: ShapeRule,
        stacked: StackedRule,
        distributed: DistributedRule,
        backward: BackwardRule,
        inputs: Sequence[str] = ("x",),
        dim_params: Sequence[str] = (),
        saves: bool = False,
        replication: tuple[str, str] | None = None,
        reduces: str | None = None,
        jvp: JvpRule | str | None = None,
    ) -> None:
        self.name = name
        if jvp == "linear":
            jvp = self._linear_jvp
        elif isinstance(jvp, str):
            raise ValueError(f"Primitive {name}: jvp must be a rule, 'linear' or None, not {jvp!r}")
        self.jvp: JvpRule | None = jvp
        self.param_names = tuple(p for p, _ in params)
        self.inputs = tuple(inputs)
        self.shape, self.stacked, self.distributed, self.backward = (
            shape,
            stacked,
            distributed,
            backward,
        )
        self.dim_params, self.saves, self.replication = tuple(dim_params), saves, replication
        self.reduces = reduces
        args = ", ".join(
            [
                *(f"Tensor {t}" for t in inputs),
                "int[] mesh_shape",
                "int[] axes",
                *(f"{ty} {p}" for p, ty in params),
            ]
        )
        for opname in (name, f"{name}_stacked"):
            _LIB.define(f"{opname}({args}) -> Tensor")  # type: ignore[no-untyped-call]
        self.per_rank_op = getattr(torch.ops.fastdist, name).default
        self.stacked_op = getattr(torch.ops.fastdist, f"{name}_stacked").default
        self._register()
        self.function = self._make_function()
        self.dist_function = self._make_function(distributed=True)
        self.stacked_function = self._make_stacked_function()
        PRIMITIVES[name] = self

    # ------------------------------------------------------------------ argument plumbing
    def _split(self, args: Sequence[Any]) -> tuple[tuple[Tensor, ...], GroupSpec, dict[str, Any]]:
        k = len(self.inputs)
        spec = GroupSpec(tuple(args[k]), tuple(args[k + 1]))
        return tuple(args[:k]), spec, dict(zip(self.param_names, args[k + 2 :]))

    def _op_args(self, spec: GroupSpec, params: dict[str, Any]) -> list[Any]:
        vals = [params[p] for p in self.param_names]
        return [
            list(spec.mesh_shape),
            list(spec.axes),
            *(list(v) if isinstance(v, tuple) else v for v in vals),
        ]

    # ------------------------------------------------------------------ forward mode
    def _linear_jvp(
        self,
        ops: Any,
        spec: GroupSpec,
        tangents: Sequence[Tensor | None],
        saved: Any,
        **params: Any,
    ) -> Tensor | None:
        """``jvp="linear"``: the op applied to the tangent (None stays None: a zero tangent)."""
        (t,) = tangents
        return None if t is None else cast(Tensor, getattr(ops, self.name)(t, spec=spec, **params))

    def forward_mode_error(self, spec: GroupSpec, transform: str, why: str) -> CollectiveError:
        """The error for forward-mode AD (``transform``) through this op where its tangent cannot
        be carried (``why``): raised at the first call, never a dropped or wrong tangent. On real
        ranks it is :func:`~fastdist.core.transforms.transform_error`'s, the transport's own."""
        comm = spec.comm
        if comm is not None:
            return transform_error(self.name, comm.label, f"rank {comm.rank}", "jvp", transform)
        return CollectiveError(
            self.name,
            f"mesh axes at positions {spec.axes}",
            f"{TRANSFORM_PROBLEMS[1]} ({transform}), and fastdist.{self.name} {why}: the "
            "tangent would come out dropped or wrong",
            "differentiate in reverse mode (torch.func.grad, vjp or jacrev, or loss.backward(); "
            "a Hessian as jacrev(jacrev(f))), or run forward mode eagerly under "
            "fastdist.simulate, where every collective but ragged_all_to_all carries tangents",
            rank="every rank",
        )

    def _jvp_or_raise(
        self, ops: Any, spec: GroupSpec, tangents: Sequence[Any], saved: Any, params: dict[str, Any]
    ) -> Tensor | None:
        """The output tangent by the ``jvp`` rule (what the Functions' ``jvp`` returns)."""
        if self.jvp is None:
            raise self.forward_mode_error(
                spec, "torch.func.jvp, jacfwd, hessian or forward_ad", "has no forward-mode rule"
            )
        return self.jvp(ops, spec, tuple(tangents), saved, **params)

    # ------------------------------------------------------------------ binding
    def bind(self, *tensors: Tensor, spec: GroupSpec, **params: Any) -> Tensor:
        """Apply on one rank's tensors: on real ranks, inside :func:`fastdist.simulate`, or on a
        one-rank mesh; through the installed collective observers, if any
        (``fastdist.core.context.COLLECTIVE_OBSERVERS``: one attribute read when there are none).
        """
        if COLLECTIVE_OBSERVERS.active:
            return COLLECTIVE_OBSERVERS.call(
                self, False, tensors, spec, params, lambda: self._bind(tensors, spec, params)
            )
        return self._bind(tensors, spec, params)

    def bind_args(
        self, tensors: tuple[Tensor, ...], spec: GroupSpec, params: dict[str, Any]
    ) -> Tensor:
        """:meth:`bind` with its arguments already collected (``bind(*tensors, spec=spec,
        **params)``), for the ops' own entry (``fastdist.ops.prelude.apply_primitive``): the same
        call without unpacking and re-packing the parameters. ``params`` is the caller's own
        dict: observers and the op's Function may keep it."""
        if COLLECTIVE_OBSERVERS.active:
            return COLLECTIVE_OBSERVERS.call(
                self, False, tensors, spec, params, lambda: self._bind(tensors, spec, params)
            )
        return self._bind(tensors, spec, params)

    def _bind(self, tensors: Sequence[Tensor], spec: GroupSpec, params: dict[str, Any]) -> Tensor:
        """:meth:`bind` itself: where the collective runs, and how its gradient is recorded.

        The autograd.Functions are used only where they are needed: on real ranks when a
        gradient can flow, and in simulation when a ``torch.func`` grad/jvp transform is
        active (under vmap they cost about 4x the op itself, forward and backward). Inside
        simulate's own vmap with no other transform, :meth:`_bind_at_level` calls the
        stacked op (or, with a gradient, its Function) directly.
        """
        comm = spec.comm
        if comm is not None:  # real ranks: the Function when a gradient can flow
            # (always under dynamo, which traces the Function: asked first, so that dynamo does
            # not trace the functorch checks)
            x = tensors[0]
            if FWAD._current_level >= 0 and any(
                UNPACK_DUAL(t).tangent is not None for t in tensors
            ):  # a dual tensor (torch.func.jvp's layer is refused in the comm's _collective)
                raise self.forward_mode_error(
                    spec, "torch.autograd.forward_ad", "on real ranks has no forward-mode rule"
                )
            if torch.compiler.is_compiling() or (
                torch.is_grad_enabled()
                # one plain tensor that does not require grad (the usual case): no call
                and (x.requires_grad or len(tensors) > 1 or FUNCTORCH.maybe_get_level(x) != -1)
                and any_needs_grad(tensors)
            ):
                vals = tuple([params[p] for p in self.param_names])
                out: Tensor = apply_function(self.dist_function, spec, vals, *tensors)
                return out
            if comm.n > 1 and not comm.comm.check:  # _run_distributed's usual case, inline
                return self.distributed(comm, *tensors, **params)
            return self._run_distributed(spec, tensors, params)
        # dynamo: keep the traced paths, skip the functorch checks
        compiling = torch.compiler.is_compiling()
        vals = ParamValues([params[p] for p in self.param_names])
        # dynamo records the op; the stacked op's registered autograd has the per-rank rule
        if compiling:
            _refuse_forward_mode_while_tracing(self.name, spec.mesh_shape, spec.axes)
            return cast(Tensor, self.per_rank_op(*tensors, *self._op_args(spec, params)))
        # the public route: the Function composes with every transform and outer backward()
        if not FAST_PATH:
            if torch.is_grad_enabled() or forward_mode_active():
                return cast(Tensor, self.function.apply(spec, vals, *tensors))  # type: ignore[no-untyped-call]
            return cast(Tensor, self.per_rank_op(*tensors, *self._op_args(spec, params)))
        if only_vmap():
            if FWAD._current_level >= 0:
                # dual tensors of torch.autograd.forward_ad: the Function's jvp rule carries their
                # tangents (the ops, and the stacked Function at its C entry, have none)
                return cast(Tensor, self.function.apply(spec, vals, *tensors))  # type: ignore[no-untyped-call]
            # Outer backward(): the per-rank rule is recorded on stacked tensors (no Function under
            # vmap).
            level = FUNCTORCH.maybe_current_level()
            if level is not None and FUNCTORCH.maybe_get_level(tensors[0]) == level:
                # simulate's vmap is innermost: the usual case
                return self._bind_at_level(level, tensors, spec, params)
            return cast(Tensor, self.per_rank_op(*tensors, *self._op_args(spec, params)))
        if not (
            (torch.is_grad_enabled() and any(needs_grad(t) for t in tensors))
            or forward_mode_active()
        ):
            return cast(Tensor, self.per_rank_op(*tensors, *self._op_args(spec, params)))
        # A torch.func grad/jvp transform is active: only the autograd.Function composes (fact 1);
        # its jvp rule carries forward-mode tangents, which the ops drop.
        return cast(Tensor, self.function.apply(spec, vals, *tensors))  # type: ignore[no-untyped-call]

    def _bind_at_level(
        self, level: int, tensors: Sequence[Tensor], spec: GroupSpec, params: dict[str, Any]
    ) -> Tensor:
        """What the per-rank op's vmap rule does, called directly: unwrap vmap ``level``, the
        stacked op, wrap.

        For the innermost vmap when every active transform is a vmap: the registered rule
        reaches the same stacked op through torch.library's Python vmap plumbing (pytree
        flattening and output wrapping on every call: about 100 us, ten times the op on a
        small tensor). Autograd records the same stacked op on the same physical tensors.
        """
        stacked = []
        for t in tensors:
            # the physical tensor, and its rank dim (None: not batched here)
            v, d = FUNCTORCH._unwrap_batched(t, level)
            stacked.append(
                v
                if d == 0
                else v.movedim(d, 0)
                if d is not None
                else v.expand(spec.world, *v.shape)
            )  # [world, *s]
        # not a vmap over the ranks: the registered rule raises the error
        if stacked[0].shape[0] != spec.world:
            return cast(Tensor, self.per_rank_op(*tensors, *self._op_args(spec, params)))
        if (
            torch.is_grad_enabled()
            and any(v.requires_grad for v in stacked)
            and all(FUNCTORCH.maybe_get_level(v) == -1 for v in stacked)
        ):
            # Plain tensors under autograd: the same per-rank rule through a Function called at its
            # C entry
            # (the stacked op's registered autograd runs torch.library's Python wrapper every call).
            # The switch is functorch's thread-local state: other threads are not affected.
            prev = FUNCTORCH.get_single_level_autograd_function_allowed()
            FUNCTORCH.set_single_level_autograd_function_allowed(True)
            try:
                out = C_APPLY.__get__(None, self.stacked_function)(
                    spec, tuple(params[p] for p in self.param_names), *stacked
                )
            finally:
                FUNCTORCH.set_single_level_autograd_function_allowed(prev)
        else:
            out = self.stacked_op(*stacked, *self._op_args(spec, params))
        return cast(Tensor, FUNCTORCH._add_batch_dim(out, 0, level))

    def bind_stacked(self, *tensors: Tensor, spec: GroupSpec, **params: Any) -> Tensor:
        """Apply on stacked ``[world, ...]`` tensors (all ranks at once), through the collective
        observers as :meth:`bind`."""
        if COLLECTIVE_OBSERVERS.active:
            return COLLECTIVE_OBSERVERS.call(
                self,
                True,
                tensors,
                spec,
                params,
                lambda: cast(Tensor, self.stacked_op(*tensors, *self._op_args(spec, params))),
            )
        if plain_call(tensors, spec.comm):
            # what the op's kernel runs, with the op's own (list) parameter values
            args = {p: list(v) if isinstance(v, tuple) else v for p, v in params.items()}
            return self._forward_stacked(spec, tensors, args)
        return cast(Tensor, self.stacked_op(*tensors, *self._op_args(spec, params)))

    # ------------------------------------------------------------------ registrations
    def _out_shape(
        self, spec: GroupSpec, tensors: Sequence[Tensor], params: dict[str, Any], stacked: bool
    ) -> list[Any]:
        shapes = [tuple(t.shape[1:] if stacked else t.shape) for t in tensors]
        out = list(self.shape(spec.n, *shapes, **params))
        return [spec.world, *out] if stacked else out

    def _run_stacked(self, *args: Any) -> Tensor:
        tensors, spec, params = self._split(args)
        return self._forward_stacked(spec, tensors, params)

    def _forward_stacked(
        self, spec: GroupSpec, tensors: Sequence[Tensor], params: dict[str, Any]
    ) -> Tensor:
        """The ``stacked`` rule's output, copied where it is (a view of) an input: a custom op (and
        a Function's output) must not alias one."""
        out = self.stacked(spec, *tensors, **params)
        if any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in tensors):
            out = out.clone()
        return out

    def _run_per_rank(self, *args: Any) -> Tensor:
        tensors, spec, params = self._split(args)
        if spec.world != 1:
            raise NoBackendError(
                f"fastdist.{self.name}: called on a plain tensor over a mesh of {spec.world} "
                "ranks. Fix: run the per-rank code under fastdist.simulate(fn, mesh)"
            )
        return self._run_stacked(*(t.unsqueeze(0) for t in tensors), *args[len(tensors) :]).squeeze(
            0
        )

    def _register(self) -> None:
        k = len(self.inputs)
        qual, squal = f"fastdist::{self.name}", f"fastdist::{self.name}_stacked"
        _LIB.impl(self.name, self._run_per_rank, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
        _LIB.impl(f"{self.name}_stacked", self._run_stacked, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]

        def fake(*args: Any, stacked: bool) -> Tensor:
            tensors, spec, params = self._split(args)
            return tensors[0].new_empty(self._out_shape(spec, tensors, params, stacked))

        torch.library.register_fake(qual, lambda *a: fake(*a, stacked=False), lib=_LIB)
        torch.library.register_fake(squal, lambda *a: fake(*a, stacked=True), lib=_LIB)

        def rank_rule(info: Any, in_dims: Sequence[int | None], *args: Any) -> tuple[Tensor, int]:
            # The vmapped dimension is the simulated rank dimension: stack and call the stacked op.
            tensors, spec, _ = self._split(args)
            if info.batch_size != spec.world:
                raise NoBackendError(
                    f"fastdist.{self.name}: vmapped over {info.batch_size} entries, but the mesh "
                    f"has {spec.world} ranks. A torch.vmap inside fastdist.simulate must not batch "
                    "a collective's input. Fix: move the vmap outside simulate, or loop instead"
                )
            stacked = [
                t.movedim(d, 0) if d is not None else t.expand(spec.world, *t.shape)
                for t, d in zip(tensors, in_dims[:k])
            ]
            return self.stacked_op(*stacked, *args[k:]), 0

        def data_rule(info: Any, in_dims: Sequence[int | None], *args: Any) -> tuple[Tensor, int]:
            # An outer vmap (e.g. over independent simulations) is one more data dim, placed last:
            # every stacked rule treats trailing dims as features, while a rule that reads its
            # per-rank dim 0 as rows (all_gather_v and the other uneven ops, whose public functions
            # move the dim there) would take a batch dim placed in front for its rows.
            tensors, spec, params = self._split(args)
            moved = [
                t.movedim(d, -1)
                if d is not None
                else t.unsqueeze(-1).expand(*t.shape, info.batch_size)
                for t, d in zip(tensors, in_dims[:k])
            ]
            out = self.bind_stacked(*moved, spec=spec, **params)
            return out, out.dim() - 1

        torch.library.register_vmap(qual, rank_rule, lib=_LIB)
        torch.library.register_vmap(squal, data_rule, lib=_LIB)

        def setup_context(ctx: Any, inputs: Sequence[Any], output: Tensor) -> None:
            tensors, ctx.spec, ctx.params = self._split(inputs)
            if self.saves:
                ctx.save_for_backward(*tensors, output)

        def make_backward(ops: Any) -> Callable[..., tuple[Any, ...]]:
            def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
                saved = ctx.saved_tensors if self.saves else ()
                grads = self.backward(ops, ctx.spec, g, saved, **ctx.params)
                return (*grads, None, None, *(None for _ in self.param_names))

            return backward

        torch.library.register_autograd(
            squal, make_backward(stacked_ops), setup_context=setup_context, lib=_LIB
        )
        # Used on a one-rank mesh under torch.compile (eager code goes through self.function).
        torch.library.register_autograd(
            qual, make_backward(ops), setup_context=setup_context, lib=_LIB
        )

    def _run_distributed(
        self, spec: GroupSpec, tensors: Sequence[Tensor], params: dict[str, Any]
    ) -> Tensor:
        comm = spec.comm
        assert comm is not None  # real ranks only
        if comm.n == 1:  # nothing to exchange: the one-rank simulation is exact
            one = GroupSpec((1,), (0,))
            return self.stacked(one, *(t.unsqueeze(0) for t in tensors), **params).squeeze(0)
        if comm.comm.check:
            comm.check(self.name, tensors, params)
        return self.distributed(comm, *tensors, **params)

    def _make_stacked_function(self) -> type[torch.autograd.Function]:
        """The stacked forward with the per-rank backward rule, as the stacked op's registered
        autograd has them.

        Used by :meth:`_bind_at_level` on plain tensors, through the C entry point of
        ``apply`` (a torch.func vmap is active there, which ``apply`` itself would route to
        functorch). Old-style ``forward(ctx, ...)``: nothing for functorch to compose with.
        """
        name = self.name

        def forward(ctx: Any, spec: GroupSpec, vals: tuple[Any, ...], *tensors: Tensor) -> Tensor:
            prim = PRIMITIVES[name]
            ctx.spec, ctx.params = spec, dict(zip(prim.param_names, vals))
            out = prim._forward_stacked(spec, tensors, ctx.params)
            if prim.saves:
                ctx.save_for_backward(*tensors, out)
            return out

        def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
            prim = PRIMITIVES[name]
            saved = ctx.saved_tensors if prim.saves else ()
            return (None, None, *prim.backward(stacked_ops, ctx.spec, g, saved, **ctx.params))

        camel = "".join(part.capitalize() for part in self.name.split("_"))
        attrs = {
            "forward": staticmethod(forward),
            "backward": staticmethod(backward),
            "__doc__": f"Stacked fastdist.{self.name} with its per-rank backward rule (see "
            "Primitive._make_stacked_function).",
        }
        return type(f"{camel}StackedFunction", (torch.autograd.Function,), attrs)

    def _make_function(self, distributed: bool = False) -> type[torch.autograd.Function]:
        """The eager autograd.Function: per-rank forward (simulated or real ranks), per-rank
        backward rule.

        The methods find the primitive by name in ``PRIMITIVES`` (not through a closure),
        so dynamo can trace them when it compiles a step on real ranks.
        """
        name = self.name

        def forward(spec: GroupSpec, vals: tuple[Any, ...], *tensors: Tensor) -> Tensor:
            prim = PRIMITIVES[name]
            params = dict(zip(prim.param_names, vals))
            if distributed:
                return prim._run_distributed(spec, tensors, params)
            return cast(Tensor, prim.per_rank_op(*tensors, *prim._op_args(spec, params)))

        def setup_context(ctx: Any, inputs: Sequence[Any], output: Tensor) -> None:
            # the parameter values as passed (a tuple): named in backward, which may never run
            ctx.spec, ctx.vals = inputs[0], inputs[1]
            if PRIMITIVES[name].saves:
                ctx.save_for_backward(*inputs[2:], output)
                if not distributed:  # the same for jvp (torch's generated vmap rule keeps one set
                    # of saved-tensor batch dims for both)
                    ctx.save_for_forward(*inputs[2:], output)

        def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
            prim = PRIMITIVES[name]
            saved = ctx.saved_tensors if prim.saves else ()
            params = dict(zip(prim.param_names, ctx.vals))
            return (None, None, *prim.backward(ops, ctx.spec, g, saved, **params))

        def jvp(ctx: Any, _spec: Any, _vals: Any, *tangents: Tensor | None) -> Tensor | None:
            prim = PRIMITIVES[name]
            saved = ctx.saved_tensors if prim.saves else ()
            params = dict(zip(prim.param_names, ctx.vals))
            return prim._jvp_or_raise(ops, ctx.spec, tangents, saved, params)

        camel = "".join(part.capitalize() for part in self.name.split("_"))
        attrs: dict[str, Any] = {
            "forward": staticmethod(forward),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
            "__doc__": f"Eager autograd for fastdist.{self.name} on "
            f"{'real' if distributed else 'simulated'} ranks (see fastdist.core.primitive).",
        }
        if not distributed:
            # (not on real ranks: dynamo refuses a Function with a jvp, and traces that one)
            attrs["generate_vmap_rule"] = True
            attrs["jvp"] = staticmethod(jvp)
        return type(
            f"{camel}{'Distributed' if distributed else ''}Function",
            (torch.autograd.Function,),
            attrs,
        )


class _Ops:
    """``ops.<primitive>(*tensors, spec=..., **params)``: the namespace backward rules are written
    in."""

    def __init__(self, stacked: bool) -> None:
        self._stacked = stacked

    def local_shape(self, t: Tensor) -> tuple[int, ...]:
        """One rank's shape of ``t`` (stacked tensors carry the rank dim first)."""
        return tuple(t.shape[1:] if self._stacked else t.shape)

    def __getattr__(self, name: str) -> Callable[..., Tensor]:
        prim = PRIMITIVES.get(name)
        if prim is None:
            raise AttributeError(name)
        return prim.bind_stacked if self._stacked else prim.bind


ops = _Ops(stacked=False)  # per-rank: what a rank's own backward() calls
stacked_ops = _Ops(stacked=True)  # the same rules over [world, ...] tensors
