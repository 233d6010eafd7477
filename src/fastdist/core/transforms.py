"""Which torch transforms a collective's call runs under, and the fast path past torch's
per-call plumbing (`fastdist.core.primitive` dispatches on both).

* Transforms: whether a tensor is differentiable through functorch's wrappers
  (`needs_grad`, `any_needs_grad`), whether forward-mode AD may be active (a
  ``torch.autograd.forward_ad`` dual level open, a ``torch.func`` jvp layer:
  `forward_mode_active`), whether every active transform is a vmap (`only_vmap`).
* The fast path (`FAST_PATH`, one switch): `apply_function` (an autograd Function's C entry
  point without the per-call signature binding), `plain_call` (a stacked op's Python rule
  called directly when nothing could see the op), and the functorch internals
  `fastdist.core.primitive` uses for simulate's own vmap (`FUNCTORCH`, `C_APPLY`).
* `without_values`: a meta or fake tensor (tracing, shape propagation).
* Refused on real ranks: `unsupported_transform` (vmap or forward mode wrapping an input) and
  `transform_error`, the one error for both (the transport's check and a dual tensor in
  `fastdist.core.primitive`).
* `ParamValues`: an op's parameters as one pytree leaf for its simulated-rank Function.

Private torch APIs are read here once, at import; a torch without them turns `FAST_PATH` off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.autograd import forward_ad

from fastdist.errors import CollectiveError

__all__ = [
    "FAST_PATH",
    "FUNCTORCH",
    "FWAD",
    "UNPACK_DUAL",
    "C_APPLY",
    "ParamValues",
    "any_needs_grad",
    "apply_function",
    "dual_level_open",
    "forward_mode_active",
    "jvp_active",
    "needs_grad",
    "only_vmap",
    "plain_call",
]


def any_needs_grad(tensors: Sequence[Tensor]) -> bool:
    """Whether any of ``tensors`` is differentiable (:func:`needs_grad`); a plain tensor (functorch
    level -1: no wrapper to look through) is answered with one C call, and no Python one."""
    for t in tensors:
        if t.requires_grad or (FUNCTORCH.maybe_get_level(t) != -1 and needs_grad(t)):
            return True
    return False


def needs_grad(t: Tensor) -> bool:
    """Whether ``t`` is differentiable; looks through functorch wrappers (a vmapped tensor reports
    False)."""
    functorch = torch._C._functorch
    while not t.requires_grad:
        if functorch.is_batchedtensor(t) or functorch.is_gradtrackingtensor(t):
            t = functorch.get_unwrapped(t)
        else:
            return False
    return True


FUNCTORCH: Any = torch._C._functorch
_VMAP = FUNCTORCH.TransformType.Vmap
_JVP = getattr(FUNCTORCH.TransformType, "Jvp", None)
#: torch.autograd.forward_ad, whose ``_current_level`` is -1 unless a dual level is open (dual
#: tensors exist only inside one): one attribute read per call says forward mode cannot be active.
FWAD: Any = forward_ad
UNPACK_DUAL: Any = forward_ad.unpack_dual


def dual_level_open() -> bool:
    """Whether a ``torch.autograd.forward_ad`` dual level is open on this process (an attribute
    read; torch keeps the level there). False on a torch without it (then nothing is checked)."""
    return cast(int, getattr(FWAD, "_current_level", -1)) >= 0


def jvp_active() -> bool:
    """Whether a ``torch.func`` jvp layer (``jvp``, ``jacfwd``, ``hessian``) is on the
    interpreter stack."""
    stack = FUNCTORCH.get_interpreter_stack()
    return _JVP is not None and stack is not None and any(i.key() == _JVP for i in stack)


def forward_mode_active() -> bool:
    """Whether forward-mode AD may be active: a dual level open, or a torch.func jvp layer."""
    return dual_level_open() or jvp_active()


def without_values(t: Tensor) -> bool:
    """Whether ``t`` holds no values: a meta tensor, or a ``FakeTensor`` (``torch.compile``'s
    tracing, ``fastdist.profile``'s), told without importing torch's fake-tensor module (it
    pulls sympy into ``import fastdist``): no FakeTensor exists unless that module is loaded."""
    if t.device.type == "meta":
        return True
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and isinstance(t, fake.FakeTensor)


# ---------------------------------------------------------------------- refused on real ranks
#: how a :func:`transform_error`'s problem starts (vmap, forward mode): an op that called the
#: refused one takes the error over (``fastdist.ops.prelude.names_this_rank``)
TRANSFORM_PROBLEMS = (
    "the input is batched by torch.vmap",
    "the input carries a forward-mode tangent",
)


def unsupported_transform(x: Tensor) -> str | None:
    """The ``torch.func`` transform that a collective on real ranks cannot run under, if ``x``
    is wrapped by one: ``"vmap"`` (a BatchedTensor at any level: vmap, jacrev's vmap over the
    backward, vmap(grad(...))), ``"jvp"`` (a forward-mode level: jvp, jacfwd, hessian, whose
    tangent a collective would not exchange); ``None`` otherwise (a plain tensor: one C call;
    ``torch.func.grad`` and ``vjp``, whose reverse-mode levels the collectives' Functions serve).
    """
    if FUNCTORCH.maybe_get_level(x) == -1:
        return None
    levels = set()
    while FUNCTORCH.is_functorch_wrapped_tensor(x):
        if FUNCTORCH.is_batchedtensor(x):
            return "vmap"
        levels.add(FUNCTORCH.maybe_get_level(x))
        x = FUNCTORCH.get_unwrapped(x)
    stack = FUNCTORCH.get_interpreter_stack() or ()
    return "jvp" if any(i.key() == _JVP and i.level() in levels for i in stack) else None


def transform_error(
    op: str, axis: Any, rank: str, transform: str, via: str | None = None
) -> CollectiveError:
    """The error for a collective on real ranks under a transform it cannot run under
    (``transform``: ``"vmap"`` or ``"jvp"``, as :func:`unsupported_transform` names it; ``via``:
    the API that brought it, e.g. ``"torch.autograd.forward_ad"`` for a dual tensor): raised
    before anything is sent, so the mesh's groups stay usable. (On simulated ranks vmap and
    forward mode compose with collectives: ``fastdist.simulate`` is itself a vmap over the
    ranks, and each op declares its tangent rule.)"""
    if transform == "vmap":
        problem = (
            f"{TRANSFORM_PROBLEMS[0]} ({via or 'torch.func.jacrev and vmap(grad(...)) use it too'}"
            "), and a collective on real ranks has no batching rule: one call cannot exchange "
            "each entry of the batch"
        )
        fix = (
            "call the collective on the whole batch outside the vmap (e.g. fastdist.psum(xs, "
            "mesh, axis) rather than torch.vmap(lambda x: fastdist.psum(x, mesh, axis))(xs)), "
            "keep torch.vmap inside a per-rank function without collectives, or run rank-batched "
            "code under fastdist.simulate (simulated ranks)"
        )
    else:
        problem = (
            f"{TRANSFORM_PROBLEMS[1]} ({via or 'torch.func.jvp, jacfwd, hessian'}), and a "
            "collective on real ranks has no forward-mode rule: the tangent would not be exchanged"
        )
        fix = (
            "differentiate in reverse mode (torch.func.grad or vjp, or loss.backward(); on real "
            "ranks jacrev's vmap is refused too), whose gradients the collectives exchange, or "
            "check the forward-mode code under fastdist.simulate, where every collective but "
            "ragged_all_to_all carries tangents"
        )
    return CollectiveError(
        op, axis, f"{problem} (nothing was sent; the mesh stays usable)", fix, rank=rank
    )


# ---------------------------------------------------------------------- the fast path: one switch
# Three shortcuts skip torch's per-call Python plumbing. All use private torch internals, so
# all sit behind FAST_PATH; with it off, every call takes the public route, with the same
# values and gradients (the test suite runs both ways: tests/test_public_path.py).
#
# 1. apply_function: torch.autograd.Function.apply binds the forward's signature with
#    `inspect` on every call of a Function that defines setup_context (about 20 us, two
#    thirds of a small collective's CPU time with autograd). Our forwards have no defaults,
#    so with no torch.func transform active (and outside dynamo) the C entry point
#    `_FunctionBase.apply` is called directly. Public route: `Function.apply`.
# 2. Primitive._bind_at_level: inside simulate's own vmap (every active transform a vmap),
#    unwrap the rank dim, call the stacked op (or, with a gradient, its old-style
#    <Op>StackedFunction at the C entry point, which needs functorch's thread-local
#    "single-level autograd.Function allowed" switch for the call), re-wrap. Public route:
#    the per-rank op's registered vmap rule, and the <Op>Function (torch.autograd.Function
#    with generate_vmap_rule) whenever grad mode is on.
# 3. Primitive.bind_stacked with gradients off (a collective's backward on stacked tensors):
#    the stacked rule called directly (what the op's kernel runs) when nothing could see the op
#    itself (plain_call). Public route: the stacked op.
#
# Internals used: _FunctionBase.apply, FUNCTORCH.unwrap_if_dead, maybe_current_level,
# maybe_get_level, _unwrap_batched, _add_batch_dim, get_interpreter_stack,
# {get,set}_single_level_autograd_function_allowed, _are_functorch_transforms_active,
# _len_torch_function_stack, _len_torch_dispatch_stack, _is_any_autocast_enabled.
# FAST_PATH is False on a torch that lacks any of them, and with FASTDIST_FAST_PATH=0
# (read once, here: an implementation choice for the process, not configuration).
C_APPLY: Any = torch._C._FunctionBase.__dict__.get("apply")
_UNWRAP_IF_DEAD: Any = getattr(FUNCTORCH, "unwrap_if_dead", None)
_INTERNALS = (
    "maybe_current_level",
    "maybe_get_level",
    "_unwrap_batched",
    "_add_batch_dim",
    "get_interpreter_stack",
    "get_single_level_autograd_function_allowed",
    "set_single_level_autograd_function_allowed",
)
#: Whether the private-API fast path is on (see the comment above and docs/design.md, "Dispatch").
FAST_PATH: bool = (
    os.environ.get("FASTDIST_FAST_PATH", "1") != "0"
    and C_APPLY is not None
    and _UNWRAP_IF_DEAD is not None
    and all(
        hasattr(torch._C, n)
        for n in (
            "_are_functorch_transforms_active",
            "_len_torch_function_stack",
            "_len_torch_dispatch_stack",
            "_is_any_autocast_enabled",
        )
    )
    and all(hasattr(FUNCTORCH, n) for n in _INTERNALS)
)


def apply_function(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)`` for a Function whose ``forward`` has no default arguments, without the
    per-call signature binding.

    Same result and graph: with the fast path off, where a torch.func transform is active,
    or under dynamo, it is ``fn.apply(*args)`` itself.
    """
    if (
        not FAST_PATH
        or torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
    ):
        return fn.apply(*args)  # type: ignore[no-untyped-call]
    # What Function.apply does next: unwrap tensors of finished torch.func transforms, then the C
    # entry (a list, not a generator: this runs on every differentiable collective).
    return C_APPLY.__get__(None, fn)(
        *[_UNWRAP_IF_DEAD(a) if isinstance(a, Tensor) else a for a in args]
    )


def plain_call(tensors: Sequence[Tensor], comm: object | None) -> bool:
    """Whether a stacked op's call can be its kernel's Python rule, called directly: with the
    fast path on, gradients off (a collective's backward), on plain tensors, on simulated ranks,
    with no transform, mode, autocast or compiler that would see the op itself. torch.library's
    per-call plumbing (its autograd wrapper redispatching below autograd) is then all the op
    adds, about 30 us a call."""
    return (
        FAST_PATH
        and not torch.is_grad_enabled()
        and comm is None
        and not torch.compiler.is_compiling()
        and not torch._C._are_functorch_transforms_active()
        and torch._C._len_torch_function_stack() == 0
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._is_any_autocast_enabled()
        and all(type(t) is Tensor for t in tensors)
    )


def only_vmap() -> bool:
    """Whether every active torch.func transform is a vmap (no grad/jvp/functionalize layer)."""
    stack = torch._C._functorch.get_interpreter_stack()
    return stack is None or all(i.key() == _VMAP for i in stack)


class ParamValues(tuple):  # type: ignore[type-arg]
    """An op's parameter values as its simulated-rank Function takes them: a tuple that pytree
    takes as one leaf (not a container), so that torch's generated vmap rule for the Function's
    ``jvp`` lines the tangents (one ``None`` per non-tensor input) up with the inputs."""

    __slots__ = ()
