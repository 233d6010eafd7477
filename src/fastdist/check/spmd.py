"""``spmd``: fastdist's ``shard_map``. Split global inputs by spec, run per-rank code, join the
outputs.

On simulated meshes the per-rank function runs under :func:`fastdist.simulate`; on real ranks
each process runs its own shard. The replication states of the outputs are checked against the
out specs (``fastdist.check.replication``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import Tensor
from torch.autograd import forward_ad

from fastdist.check.replication import CheckMode, Rep, RepTracker, tracking
from fastdist.core.sharding import PartitionSpec, blocks, check_spec
from fastdist.core.transforms import apply_function, jvp_active
from fastdist.errors import MeshError, ReplicationError
from fastdist.sim.simulate import simulate

if TYPE_CHECKING:
    from fastdist.core.mesh import Mesh

__all__ = ["spmd", "checked_call"]

R = TypeVar("R")
#: torch.autograd.forward_ad.unpack_dual (untyped in torch): its tangent is None on a plain tensor.
_UNPACK_DUAL = cast(Callable[[Tensor], Any], forward_ad.unpack_dual)


def _groups(spec: PartitionSpec, mesh: Mesh) -> list[list[int]]:
    """The ranks holding each block of ``spec``: one ascending list per block, the blocks in
    row-major order of their index along each split dim (the order :func:`_assemble` takes)."""
    split = [a for d in range(len(spec.dims)) for a in spec.axes_of(d)]  # row-major, dim by dim
    sizes = mesh.shape
    out: dict[int, list[int]] = {}
    for r in range(mesh.size):
        key, c = 0, mesh.coords(r)
        for a in split:
            key = key * sizes[a] + c[a]
        out.setdefault(key, []).append(r)
    return [out[k] for k in sorted(out)]


def _assemble(b: Tensor, spec: PartitionSpec, mesh: Mesh) -> Tensor:
    """``[blocks, *local]`` (in :func:`_groups`' order) -> the global tensor: reshape and permute
    only (no in-place writes, so torch.func's vmap can batch it)."""
    local = list(b.shape[1:])
    ns = [
        mesh.axis_size(spec.axes_of(d)) if d < len(spec.dims) and spec.axes_of(d) else 1
        for d in range(len(local))
    ]
    k = len(local)
    y = b.reshape([*ns, *local]).permute([i for d in range(k) for i in (d, k + d)])
    return y.reshape([n * m for n, m in zip(ns, local)])


def _mean_holders(g: Tensor, spec: PartitionSpec, mesh: Mesh) -> Tensor:
    """``[world, *local]`` -> global: each block the mean of its holders' blocks (summed in rank
    order, then divided: the same bits as before the double-backward fix)."""
    if not spec.sharded_axes:
        return g.mean(0)
    groups = _groups(spec, mesh)
    acc = g[[grp[0] for grp in groups]]
    for j in range(1, len(groups[0])):
        acc = acc + g[[grp[j] for grp in groups]]
    return _assemble(acc / len(groups[0]), spec, mesh)


def _first_holders(y: Tensor, spec: PartitionSpec, mesh: Mesh) -> Tensor:
    """``[world, *local]`` -> global: each block taken from the lowest rank holding it."""
    return _assemble(y[[grp[0] for grp in _groups(spec, mesh)]], spec, mesh)


# The three linear maps between a global tensor and its stacked per-rank blocks. Under fastdist's
# convention every replica of a replicated value carries the whole cotangent, so the adjoint of
# "copy to every holder" (_ShardStacked) is the MEAN over holders (_MeanHolders), and the adjoint
# of that mean is the copy again (not the copy divided by the number of holders, which is what
# autograd would derive from a mean written in differentiable ops: second-order gradients, such
# as Hessian-vector products or gradient penalties, would be divided by the replica count). Each
# backward is therefore the other Function, so every order of derivative follows the convention.
# generate_vmap_rule lets torch.vmap batch them (vmap, vmap(grad), jacrev). Forward mode is
# refused before they run (_refuse_forward_mode): the maps themselves are linear, but the
# Functions have no ``jvp`` (dynamo refuses a Function with one, and compiled spmd steps trace
# them), so torch would fail inside them with its own error.


def _refuse_forward_mode(args: Sequence[Any], mesh: Mesh) -> None:
    """Raise when forward-mode AD would run through a simulated ``spmd`` (see the comment above):
    a ``torch.func.jvp`` layer active (``jvp``, ``jacfwd``, ``hessian``) or a dual tensor of
    ``torch.autograd.forward_ad`` among the arguments."""
    if not jvp_active() and not any(
        isinstance(a, Tensor) and _UNPACK_DUAL(a).tangent is not None for a in args
    ):
        return
    raise MeshError(
        f"spmd over {mesh}: forward-mode AD (torch.func.jvp, jacfwd, hessian, "
        "torch.autograd.forward_ad) is not supported on a simulated mesh: spmd's own "
        "shard and unshard steps have no forward-mode rule. Fix: use "
        "reverse mode: torch.func.grad, jacrev or vmap(grad); for a Hessian, "
        "jacrev(jacrev(f)); for a Hessian-vector product or a gradient penalty, "
        "torch.autograd.grad(..., create_graph=True) twice"
    )


class _ShardStacked(torch.autograd.Function):
    """Global ``x`` -> ``[world, *local]``: every simulated rank's block under ``spec``.

    Backward: each block's gradient is the mean over the ranks that hold it (:class:`_MeanHolders`,
    differentiable to any order). This is what a global input replicated to every rank and then
    ``local_chunk``-ed computes (under correct replication types those ranks' gradients agree, so
    the mean is exact; a sum would count the block once per replica), without ``world`` full
    copies each way.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, spec: PartitionSpec, mesh: Mesh) -> Tensor:
        return blocks(x, spec, mesh)  # [world, *local]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.spec, ctx.mesh = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        return apply_function(_MeanHolders, g, ctx.spec, ctx.mesh), None, None


class _MeanHolders(torch.autograd.Function):
    """``[world, *local]`` -> global: each block the mean over the ranks holding it.

    :class:`_ShardStacked`'s backward. Its own backward hands every holder the whole cotangent
    (:class:`_ShardStacked`), the adjoint of the mean under the replicated-cotangent convention.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(g: Tensor, spec: PartitionSpec, mesh: Mesh) -> Tensor:
        return _mean_holders(g, spec, mesh)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.spec, ctx.mesh = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, gg: Tensor) -> tuple[Tensor, None, None]:
        return apply_function(_ShardStacked, gg, ctx.spec, ctx.mesh), None, None


class _UnshardStacked(torch.autograd.Function):
    """``[world, *local]`` -> global: the blocks assembled, each from the lowest rank holding it.

    The transpose of :class:`_ShardStacked`'s forward: backward gives every rank its block of
    the cotangent (an output replicated over an axis hands each replica the same cotangent), as
    :class:`_ShardStacked`, whose own backward (the mean over holders) keeps second-order
    gradients under the same convention.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(y: Tensor, spec: PartitionSpec, mesh: Mesh) -> Tensor:
        return _first_holders(y, spec, mesh)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.spec, ctx.mesh = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        return apply_function(_ShardStacked, g, ctx.spec, ctx.mesh), None, None


def _refuse_checked_compile(mode: str) -> None:
    """Raise, while dynamo traces, the error that says how to compile an spmd step.

    The checked mode decides the ``pvary`` insertions with Python bookkeeping on every op, which
    dynamo cannot trace; compiling it unchecked would silently drop the inserted ``pvary``s
    (wrong gradients), so it is refused instead.
    """
    raise MeshError(
        f"spmd: check={mode!r} runs eagerly only (its replication bookkeeping cannot be traced by "
        "torch.compile, and compiling the step unchecked would drop the pvary it inserts: "
        "wrong gradients). Fix: run the step once eagerly with check='error', write the pvary "
        "calls it names, and compile fd.spmd(..., check=False)"
    )


def spmd(
    fn: Callable[..., R],
    mesh: Mesh,
    in_specs: Sequence[PartitionSpec | None],
    out_specs: PartitionSpec | Sequence[PartitionSpec],
    *,
    check: CheckMode | bool | None = None,
) -> Callable[..., R]:
    """Call per-rank ``fn`` on global tensors: split the inputs by ``in_specs``, join the outputs
    by ``out_specs``.

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
    ``fastdist.connect`` each process passes the same global tensors and gets the global
    result.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 2})
    >>> in_specs = (fd.P(None, "tp"), fd.P("tp", None))
    >>> matmul = lambda x, w: fd.psum(x @ w, mesh, "tp")
    >>> f = fd.spmd(matmul, mesh, in_specs=in_specs, out_specs=fd.P())
    >>> x, w = torch.ones(3, 4), torch.ones(4, 5)
    >>> bool(torch.equal(f(x, w), x @ w))
    True
    """
    simulated = mesh.comm is None
    mode = _check_mode(check, simulated)
    single_out = isinstance(out_specs, PartitionSpec)
    outs: list[PartitionSpec] = (
        [out_specs] if isinstance(out_specs, PartitionSpec) else list(out_specs)
    )
    for i, s in enumerate(outs):
        check_spec(f"out_specs[{i}]", mesh, s, None)

    def per_rank(*args: Any) -> Any:
        if mode is not None and torch.compiler.is_compiling():
            _refuse_checked_compile(mode)
        local, states = _local_args(args, in_specs, mesh, simulated)
        result = checked_call(fn, mesh, mode, local, states, outs, single_out, simulated=simulated)
        return _join(result, outs, single_out, mesh, simulated)

    def run(*args: Any) -> R:
        _check_args(args, in_specs, mesh)
        if not simulated:
            return cast(R, per_rank(*args))
        if not torch.compiler.is_compiling():
            _refuse_forward_mode(args, mesh)
        stacked = [
            apply_function(_ShardStacked, a, s, mesh) if isinstance(a, Tensor) else a
            for a, s in zip(args, in_specs)
        ]
        out = simulate(per_rank, mesh)(*stacked)
        full = tuple(
            apply_function(_UnshardStacked, o, s, mesh)
            for o, s in zip([out] if single_out else out, outs)
        )
        return cast(R, full[0] if single_out else full)

    return run


def _check_mode(check: CheckMode | bool | None, simulated: bool) -> CheckMode | None:
    """The replication check mode ``spmd``'s ``check`` asks for (``None``: no tracking)."""
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
        raise MeshError(
            f"spmd: check must be 'insert', 'error', True or False, got {check!r}. Fix: "
            "check='insert' (add the pvary a replicated value needs), check='error' (name it), "
            "or check=False (no bookkeeping; needed under torch.compile)"
        )
    return mode


def _check_args(args: Sequence[Any], in_specs: Sequence[PartitionSpec | None], mesh: Mesh) -> None:
    """One spec per argument, each valid for its tensor and not partial."""
    if len(args) != len(in_specs):
        raise MeshError(
            f"spmd: got {len(args)} arguments but {len(in_specs)} in_specs. Fix: one spec per "
            "argument (None for non-tensors)"
        )
    for i, (a, s) in enumerate(zip(args, in_specs)):
        if isinstance(a, Tensor):
            if check_spec(f"in_specs[{i}]", mesh, s, a).partial:
                raise MeshError(
                    f"spmd: in_specs[{i}] {s!r} is partial; partial= is for out_specs. Fix: "
                    "pass the summed global value"
                )


def _local_args(
    args: Sequence[Any], in_specs: Sequence[PartitionSpec | None], mesh: Mesh, simulated: bool
) -> tuple[list[Any], list[Rep | None]]:
    """Each rank's arguments and their replication states.

    Real ranks: each process takes its blocks (and ``_join`` joins the outputs with
    collectives). Simulated ranks get their blocks already cut (``_ShardStacked``) and return
    them as they are, to be assembled once outside (``_UnshardStacked``): the same values and
    gradients as local_chunk / all_gather_invariant per rank, without world-sized copies.
    """
    from fastdist.ops import local_chunk

    local = []
    states: list[Rep | None] = []
    for a, s in zip(args, in_specs):
        if isinstance(a, Tensor):
            s = cast(PartitionSpec, s)
            for d in range(len(s.dims) if not simulated else 0):
                axes = s.axes_of(d)
                if axes:
                    a = local_chunk(a, mesh, axes if len(axes) > 1 else axes[0], d)
            states.append(Rep(frozenset(s.sharded_axes)))
        else:
            states.append(None)
        local.append(a)
    return local, states


def _join(
    result: Any, specs: list[PartitionSpec], single: bool, mesh: Mesh, simulated: bool
) -> Any:
    """Per-rank outputs made global by their out specs: partial sums summed; on real ranks, the
    split dims gathered (simulated ranks are joined outside, by ``_UnshardStacked``)."""
    from fastdist.ops import all_gather_invariant, psum

    items = [result] if single else list(result)
    if len(items) != len(specs):
        raise MeshError(
            f"spmd: fn returned {len(items)} outputs but out_specs has {len(specs)}. Fix: "
            "give one out spec per output (a single P(...), not a tuple, for one tensor)"
        )
    joined = []
    for i, (y, s) in enumerate(zip(items, specs)):
        split = [d for d in range(len(s.dims)) if s.axes_of(d)]
        if split and isinstance(y, Tensor) and split[-1] >= y.dim():
            raise MeshError(
                f"spmd: output {i} has {y.dim()} dims on each rank but out_specs[{i}] {s!r} "
                f"splits dim {split[-1]}. Fix: give output {i} a spec that splits only its dims "
                "(P() for a replicated scalar, with the reduction psum-ed inside fn)"
            )
        if s.partial:
            y = psum(y, mesh, s.partial if len(s.partial) > 1 else s.partial[0])
        for d in range(len(s.dims) if not simulated else 0):
            if s.axes_of(d):
                axes = s.axes_of(d)
                y = all_gather_invariant(y, mesh, axes if len(axes) > 1 else axes[0], d)
        joined.append(y)
    return joined[0] if single else tuple(joined)


def checked_call(
    fn: Callable[..., Any],
    mesh: Mesh,
    mode: CheckMode | None,
    args: Sequence[Any],
    states: Sequence[Rep | None],
    out_specs: list[PartitionSpec],
    single_out: bool,
    *,
    simulated: bool,
) -> Any:
    """Run per-rank ``fn`` on local ``args`` whose replication ``states`` are known; check its
    outputs.

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


def _check_outputs(
    tracker: RepTracker, result: Any, specs: list[PartitionSpec], single: bool
) -> None:
    items = [result] if single else list(result) if isinstance(result, (tuple, list)) else [result]
    for i, (y, s) in enumerate(zip(items, specs)):
        if not isinstance(y, Tensor):
            raise MeshError(
                f"spmd: output {i} is a {type(y).__name__}, not a tensor. Fix: return tensors "
                "only (one per out spec)"
            )
        rep = tracker.get(y)
        sharded = set(s.sharded_axes)
        for a in tracker.mesh.axis_names:
            st = rep.state(a)
            if a in sharded:
                continue
            if a in s.partial:
                if st == "I":
                    raise ReplicationError(
                        "spmd out_specs",
                        a,
                        f"output {i} is invariant over {a!r} but {s!r} declares it partial (its "
                        "copies would be summed)",
                        f"drop partial={a!r} from the spec",
                        where="spmd output",
                    )
                continue
            if st == "V":
                raise ReplicationError(
                    "spmd out_specs",
                    a,
                    f"output {i} varies over {a!r} but {s!r} does not name {a!r}, which declares "
                    "it replicated",
                    f"psum/pmean/all_gather_invariant it over {a!r} inside fn, or split a dim "
                    f"over {a!r} in the out spec",
                    where="spmd output",
                )
            if st == "P":
                raise ReplicationError(
                    "spmd out_specs",
                    a,
                    f"output {i} is a partial sum over {a!r} but {s!r} declares it replicated",
                    f"psum it over {a!r} inside fn, or declare P(..., partial={a!r})",
                    where="spmd output",
                )
