"""The shared helpers of the op blocks: argument checks that name the op, the axis and the fix,
entering a collective (the rank binding on simulated ranks, the communicator on real ones), and
running a primitive under a replication check. Public to the ``fastdist.ops`` modules and the
layers above that declare ops of their own (``fastdist.nn.loss``, ``fastdist.serving``)."""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import Tensor

from fastdist.core.binding import promote, rank_binding
from fastdist.core.carriers import CARRIED, bits_dtype
from fastdist.core.context import check_of, simulation_of
from fastdist.core.dtype_rule import REDUCTION_DTYPES, check_reduction_dtype
from fastdist.core.mesh import AxisName, Mesh
from fastdist.core.primitive import GroupSpec, Primitive
from fastdist.core.transforms import (
    TRANSFORM_PROBLEMS,
    forward_mode_active,
    needs_grad,
    transform_error,
    unsupported_transform,
)
from fastdist.errors import CollectiveError, FastdistError, MeshError, NoBackendError

if TYPE_CHECKING:
    from fastdist.core.comm import Comm

__all__ = [
    "out_rows",
    "capacity_or_uniform",
    "check_sizes",
    "row_count",
    "check_capacity",
    "local_rows",
    "names_this_rank",
    "check_mesh",
    "enter",
    "plain_spec",
    "apply_primitive",
    "flag",
    "norm_dim",
    "need_divisible",
    "need_reducible",
    "real_view",
    "like",
    "same_shape",
    "check_index",
    "as_index",
    "where_member",
    "moves_bits",
    "bits_carrier",
]


# ====================================================================== shared helpers
_F = TypeVar("_F", bound=Callable[..., Any])


def names_this_rank(fn: _F) -> _F:
    """Argument checks run on each rank with that rank's own inputs. On simulated ranks one
    program checks them all (``on every rank``); on a real mesh the error a check raises names
    the rank it ran on instead, as the rank's inputs may differ from its peers'.

    On a real mesh, torch's own error for a ``torch.func`` transform the op cannot run under
    (``vmap(grad(...))``: a vmap over the op's autograd.Function) becomes the
    :func:`~fastdist.core.transforms.transform_error` of
    :func:`~fastdist.core.transforms.unsupported_transform` (nothing is checked on success)."""
    names = list(inspect.signature(fn).parameters)
    at = names.index("mesh")
    axis_at = names.index("axis") if "axis" in names else None

    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CollectiveError as e:
            if e.problem.startswith(TRANSFORM_PROBLEMS):  # from an op inside: name this one
                e.readdress(op=fn.__name__)
                raise
            mesh = args[at] if len(args) > at else kwargs.get("mesh")
            if (
                e.rank == "every rank"
                and isinstance(mesh, Mesh)
                and mesh.comm is not None
                and simulation_of(mesh) is None
            ):
                e.readdress(rank=f"rank {cast('Comm', mesh.comm).global_rank}")
            raise
        except RuntimeError as e:
            if isinstance(e, FastdistError):
                raise
            mesh = args[at] if len(args) > at else kwargs.get("mesh")
            x = args[0] if args else kwargs.get(names[0])
            axis = None
            if axis_at is not None:
                axis = args[axis_at] if len(args) > axis_at else kwargs.get("axis")
            refused = _refused_transform(fn.__name__, x, mesh, axis)
            if refused is None:
                raise
            raise refused from e

    return cast(_F, op)


def _refused_transform(op: str, x: Any, mesh: Any, axis: Any) -> CollectiveError | None:
    """The :func:`~fastdist.core.transforms.transform_error` for ``op`` on real ranks when ``x``
    is under a transform :func:`~fastdist.core.transforms.unsupported_transform` names; else
    None."""
    if not (
        isinstance(x, Tensor)
        and isinstance(mesh, Mesh)
        and mesh.comm is not None
        and simulation_of(mesh) is None
    ):
        return None
    transform = unsupported_transform(x)
    if transform is None:
        return None
    return transform_error(op, axis, f"rank {cast('Comm', mesh.comm).global_rank}", transform)


def check_mesh(op: str, mesh: Any, axis: AxisName) -> None:
    """Refuse a ``mesh`` that is not a :class:`~fastdist.core.mesh.Mesh` (``op`` the public name
    of the caller, ``axis`` the axis the error names)."""
    if not isinstance(mesh, Mesh):
        raise CollectiveError(
            op,
            axis,
            f"mesh must be a fastdist.Mesh, got {type(mesh).__name__}",
            "pass the Mesh the code runs on",
        )


def enter(op: str, x: Any, mesh: Mesh, axis: AxisName) -> tuple[Tensor, GroupSpec]:
    """Check ``x``/``mesh``/``axis`` and return ``x`` with the rank dimension, plus the group
    spec."""
    if not isinstance(x, Tensor):
        raise CollectiveError(
            op, axis, f"x must be a torch.Tensor, got {type(x).__name__}", "pass a tensor"
        )
    if not isinstance(mesh, Mesh):
        check_mesh(op, mesh, axis)  # raises
    binding = simulation_of(mesh)
    # real ranks (a simulation over the mesh takes precedence): the spec the communicator
    # validated and cached for this axis
    if binding is None:
        comm: Comm | None = mesh.comm  # type: ignore[assignment]
        if comm is not None:
            return x, comm.spec(axis, op)
    spec = plain_spec(op, mesh, axis)
    if binding is None:
        binding = rank_binding(op, mesh)  # raises unless the mesh has one rank
    tracker = check_of(mesh)
    if tracker is None:
        return promote(op, x, binding), spec
    # fastdist's own plumbing is not user code: keep the state, unobserved
    with tracker.suspended():
        y = promote(op, x, binding)
    tracker.set(y, tracker.get(x))
    return y, spec


@functools.lru_cache(maxsize=4096)
def _cached_plain_spec(mesh: Mesh, axis: str | tuple[str, ...]) -> GroupSpec:
    return GroupSpec(mesh.sizes, mesh.axis_indices(axis, "fastdist"))


def plain_spec(op: str, mesh: Mesh, axis: AxisName) -> GroupSpec:
    """The group spec of ``axis`` on a simulated mesh: a pure function of the axes, memoised.

    The memo is a cache of a pure function (outside dynamo tracing); an invalid axis is not
    cached and raises naming ``op``.
    """
    if isinstance(axis, (str, tuple)) and not torch.compiler.is_compiling():
        try:
            return _cached_plain_spec(mesh, axis)
        except (MeshError, TypeError):
            # re-raised below naming the op (TypeError: unhashable parts)
            pass
    return GroupSpec(mesh.sizes, mesh.axis_indices(axis, f"fastdist.{op}"))


def apply_primitive(
    prim: Primitive, mesh: Mesh, x: Tensor, spec: GroupSpec, *extra: Tensor, **params: Any
) -> Tensor:
    """Run the primitive on ``x`` (and extra tensor inputs such as sizes).

    Under a replication check (``fastdist.spmd``) the tracker checks ``x``'s state first.

    The result never shares memory with ``x``: on real ranks a group of one member runs the
    one-rank simulation, whose gathers, all-to-alls and broadcasts are views of their input; that
    view is copied here, so that changing the input in place afterwards (an optimizer step on a
    shard) cannot change the result, nor the other way round, as on a group of two or more.
    """
    tracker = check_of(mesh)
    if tracker is not None:
        out = cast(Tensor, tracker.collective(prim, mesh, x, spec, params, extra))
    else:
        out = prim.bind_args((x, *extra) if extra else (x,), spec, params)
    if spec.n == 1 and spec.comm is not None and _shares_memory(out, x):
        return out.clone()
    return out


def _shares_memory(out: Tensor, x: Tensor) -> bool:
    """Whether ``out`` is a view of ``x``'s storage (not asked while dynamo traces: a traced op's
    outputs are fresh)."""
    if torch.compiler.is_compiling():
        return False
    return bool(out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr())


def flag(op: str, axis: AxisName, name: str, value: Any) -> bool:
    """``value`` if it is a bool (``tiled="no"`` would read as true)."""
    if value is not True and value is not False:  # not a bool (bool has no subclasses)
        raise CollectiveError(
            op,
            axis,
            f"{name}={value!r} is not a bool",
            f"pass {name}=True or {name}=False",
        )
    return value


def as_index(value: Any) -> int | None:
    """``value`` as a Python int when it is an integer ``operator.index`` takes (an int, a NumPy
    integer), else None: never a bool (Python or NumPy), a float (even ``2.0``) or a tensor
    (reading a tensor's value would synchronise with its device)."""
    if type(value) is int:  # the usual case, first (and plain for dynamo)
        return value
    if isinstance(value, (bool, Tensor)) or not hasattr(type(value), "__index__"):
        return None
    if (
        not torch.compiler.is_compiling()
        and getattr(getattr(value, "dtype", None), "kind", "") == "b"
    ):
        return None  # numpy 1.x's np.bool_ passes operator.index
    try:
        return operator.index(value)
    except TypeError:
        return None


def norm_dim(op: str, axis: AxisName, name: str, dim: Any, ndim: int) -> int:
    """Normalise a (possibly negative) dim in ``[-ndim, ndim)`` (any integer :func:`as_index`
    takes: a NumPy integer too) to a Python int in ``[0, ndim)``."""
    if type(dim) is int and -ndim <= dim < ndim:  # the usual case, first
        return dim % ndim
    d = as_index(dim)
    if d is None or not -ndim <= d < ndim:
        rng = f"[{-ndim}, {ndim - 1}]" if ndim else "none: the tensor is 0-d"
        what = "is out of range" if d is not None else "is not an int"
        raise CollectiveError(
            op,
            axis,
            f"{name}={dim!r} {what} for a {ndim}-d tensor",
            f"use a {name} in {rng}",
        )
    return d % ndim


def need_divisible(op: str, axis: AxisName, x: Tensor, dim: int, n: int, alt: str) -> None:
    if x.shape[dim] % n:
        raise CollectiveError(
            op,
            axis,
            f"dim {dim} has size {x.shape[dim]}, not divisible by the axis size {n}",
            f"pad dim {dim} to a multiple of {n}, or {alt}",
        )


def need_reducible(prim: Primitive, axis: AxisName, x: Tensor) -> None:
    """The one dtype rule of reductions (``fastdist.core.dtype_rule``), for ``prim``'s kind of
    reduction (an accepted dtype is one set lookup; the rule itself words the error)."""
    dtype = x.dtype
    allowed = REDUCTION_DTYPES.get(prim.reduces or "")
    if allowed is None or dtype not in allowed:
        check_reduction_dtype(prim.name, axis, dtype, cast(str, prim.reduces))


def real_view(x: Tensor) -> Tensor:
    """A complex tensor as its ``[..., 2]`` float view, for sums on real ranks (torch's c10d
    reduce-scatter and functional all-reduce, and NCCL, take no complex dtype); other tensors as
    they are."""
    return torch.view_as_real(x.resolve_conj()) if x.is_complex() else x


def like(y: Tensor, x: Tensor) -> Tensor:
    """Undo :func:`real_view` on a result ``y`` of the same kind as ``x``."""
    return torch.view_as_complex(y.contiguous()) if x.is_complex() else y


def same_shape(n: int, s: tuple[Any, ...], *rest: Any, **params: Any) -> tuple[Any, ...]:
    return s


def check_index(op: str, axis: AxisName, name: str, value: Any, n: int) -> int:
    """``value`` (the argument ``name``) as a Python int if it is an index along ``axis`` of ``n``
    ranks (any integer :func:`as_index` takes: a NumPy integer too); else raise naming ``op``."""
    i = as_index(value)
    if i is None or not 0 <= i < n:
        raise CollectiveError(
            op,
            axis,
            f"{name}={value!r} is not an index along the axis (size {n})",
            f"use {name} in 0..{n - 1}",
        )
    return i


def where_member(spec: GroupSpec, y: Tensor, mask: Tensor) -> Tensor:
    """``y`` where the ``[G, n]`` member mask holds, zero elsewhere."""
    return torch.where(
        mask.reshape(*mask.shape, *(1,) * (y.dim() - 2)),
        y,
        torch.zeros((), dtype=y.dtype, device=y.device),
    )


# ====================================================================== dtypes without kernels
_Rule = TypeVar("_Rule", bound=Callable[..., Tensor])


def moves_bits(rule: _Rule) -> _Rule:
    """A movement-only stacked rule ``rule(spec, x, *rest, **params)`` run on ``x``'s bitwise view
    as its same-size carrier (``fastdist.core.carriers``, the table the c10d transports use) when
    ``x``'s dtype is not carried as it is, its result viewed back: torch has no CPU gather,
    index, index_fill or cat kernel for uint16/32/64, complex32, the float8 kinds, float4 and the
    bits dtypes. The rule only moves bits, so the values are the same, bit for bit. A stacked
    rule runs below autograd (the primitive's backward rule is its gradient), so the view cuts
    no gradient."""

    @functools.wraps(rule)
    def run(spec: GroupSpec, x: Tensor, *rest: Any, **params: Any) -> Tensor:
        dtype = x.dtype
        carrier = None if dtype in CARRIED else bits_dtype(dtype)
        if carrier is None:
            return rule(spec, x, *rest, **params)
        return rule(spec, x.view(carrier), *rest, **params).view(dtype)

    return cast(_Rule, run)


#: carried dtypes whose bits torch's CPU gather rewrites (NaN payloads)
_GATHER_REWRITES = frozenset({torch.float16, torch.bfloat16})


def bits_carrier(x: Tensor, simulated: bool) -> torch.dtype | None:
    """The plain integer dtype an op's own row picking (``index_select``, ``torch.where``,
    ``cat`` around its primitive) runs ``x`` as (``fastdist.core.carriers.bits_dtype``), or None
    to run it as it is.

    A dtype outside ``CARRIED`` (uint16, float8, ...: torch has no CPU kernels for many), and,
    on simulated ranks, float16 and bfloat16: ``index_select`` under the rank vmap is torch's
    CPU gather, which rewrites their NaNs (a float16 signalling NaN comes back quiet, every
    bfloat16 NaN as 0xffff) where a real rank's ``index_select`` keeps them. Never an ``x`` that
    carries a gradient or a tangent (a view would cut it)."""
    dtype = x.dtype
    if dtype in CARRIED and not (simulated and dtype in _GATHER_REWRITES):
        return None
    carrier = bits_dtype(dtype)
    if carrier is None:
        return None
    if torch.compiler.is_compiling():  # dynamo skips the functorch queries of needs_grad
        return None if x.requires_grad else carrier
    return None if needs_grad(x) or forward_mode_active() else carrier


# ====================================================================== uneven sizes and capacities
def out_rows(capacity: int, exact: int) -> int:
    return capacity if capacity >= 0 else exact


def capacity_or_uniform(capacity: int, sizes: Sequence[int]) -> int:
    """Rows of a ragged output shared by all ranks: ``capacity``, or the common size when sizes are
    equal."""
    if capacity >= 0:
        return capacity
    if len(set(sizes)) != 1:
        raise NoBackendError(
            "fastdist: a ragged output without capacity has a rank-dependent shape; pass "
            "capacity=max(sizes)"
        )
    return int(sizes[0])


def check_sizes(op: str, axis: AxisName, sizes: Any, n: int) -> list[int]:
    """``sizes`` as ``n`` Python ints >= 0; raises naming the op, the axis and the first bad entry.

    Each entry may be a Python int, a numpy integer or a 0-d integer tensor (a 1-D integer
    tensor counts as its entries). A bool, a float (even ``2.0``), a complex or a negative
    number is refused: rows are never rounded or truncated silently.
    """
    if isinstance(sizes, Tensor) and (
        sizes.dim() != 1 or torch._C._functorch.is_batchedtensor(sizes)
    ):
        raise CollectiveError(
            op,
            axis,
            "sizes must be the same list of ints on every rank",
            "use exchange_sizes(...).tolist() on real ranks, or ragged_all_to_all for "
            "data-dependent sizes",
        )
    if isinstance(sizes, (str, bytes)):
        raise CollectiveError(
            op,
            axis,
            f"sizes={sizes!r} is not a list of ints",
            f"pass {n} row counts, one per rank along the axis",
        )
    try:
        entries = list(sizes)
    except TypeError:
        raise CollectiveError(
            op,
            axis,
            f"sizes={sizes!r} is not a list of ints",
            f"pass {n} row counts, one per rank along the axis",
        ) from None
    out = [row_count(op, axis, f"sizes[{i}]", s) for i, s in enumerate(entries)]
    if len(out) != n:
        raise CollectiveError(
            op,
            axis,
            f"sizes has {len(out)} entries but the axis has {n} ranks",
            f"pass {n} row counts, one per rank along the axis",
        )
    return out


def row_count(op: str, axis: AxisName, what: str, value: Any) -> int:
    """One row count: a Python int, a numpy integer or a 0-d integer tensor, >= 0 (never a bool or
    a float, even a whole one)."""
    count: int | None = None
    if type(value) is int:  # the usual case, first (and plain for dynamo)
        count, kind = value, "int"
    elif isinstance(value, Tensor):
        if torch._C._functorch.is_batchedtensor(value):
            raise CollectiveError(
                op,
                axis,
                f"{what} differs per rank (a per-rank tensor)",
                "pass the same Python ints on every rank, or use ragged_all_to_all for "
                "data-dependent sizes",
            )
        if value.dim() == 0 and not (
            value.is_floating_point() or value.is_complex() or value.dtype == torch.bool
        ):
            count = int(value.item())
        kind = f"a {value.dim()}-d {value.dtype} tensor"
    elif isinstance(value, torch.SymInt):
        count = int(value)
        kind = "SymInt"
    elif isinstance(value, bool) or (
        not torch.compiler.is_compiling()
        and getattr(getattr(value, "dtype", None), "kind", "") == "b"
    ):
        # Python or numpy (numpy 1.x lets np.bool_ pass operator.index); dynamo cannot read a numpy
        # dtype
        kind = "bool"
    else:
        try:
            # int, numpy integers: yes; float (even 2.0), complex, str: TypeError
            count = operator.index(value)
        except TypeError:
            pass
        kind = type(value).__name__
    if count is None:
        raise CollectiveError(
            op,
            axis,
            f"{what} = {value!r} is {kind if kind.startswith('a ') else 'a ' + kind}, not an "
            "integer row count",
            "pass Python ints (numpy ints and 0-d integer tensors also do); round explicitly "
            "(int(round(s))) if you computed them as floats",
        )
    if count < 0:
        raise CollectiveError(op, axis, f"{what} = {count} is negative", "row counts are >= 0")
    return count


def check_capacity(op: str, axis: AxisName, capacity: int | None, need: int, what: str) -> int:
    if capacity is None:
        return -1
    capacity = row_count(op, axis, "capacity", capacity)  # an int (numpy and 0-d ones too)
    if capacity < need:
        raise CollectiveError(
            op,
            axis,
            f"capacity={capacity!r} cannot hold {what} ({need} rows)",
            f"use capacity >= {need}",
        )
    return capacity


def local_rows(
    op: str, axis: AxisName, x: Tensor, sizes: Sequence[int], simulated: bool, index: int | None
) -> None:
    """Every rank's input must hold at least its own rows (more are padding)."""
    need, who = (
        (max(sizes), "max(sizes) (simulated ranks share one shape)")
        if simulated
        else (sizes[cast(int, index)], f"sizes[{index}]")
    )
    if x.shape[0] < need:
        raise CollectiveError(
            op,
            axis,
            f"the local shard has {x.shape[0]} rows along the ragged dim but {who} = {need}",
            f"pass at least {need} rows (rows past the size are ignored)",
            rank="every rank" if simulated else f"rank index {index}",
        )
