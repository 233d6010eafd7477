"""See the communication before paying for it: a per-axis profile of a step, dry runs at scale, a
layout planner.

Three pieces, all arithmetic on what fastdist already knows about each collective (its
group, shape and dtype):

* :func:`trace` runs a per-rank step once on fake tensors (``torch._subclasses.FakeTensorMode``:
  shapes and dtypes, no data, no memory) and records every collective it issues, forward
  and backward, as a :class:`Record`: the op, the mesh axes, the group size, the bytes in
  the `nccl-tests <https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md>`_
  definitions, the phase and the ``nn.Module`` it ran in. The result is a :class:`Profile`.
  Because nothing is allocated per rank, the same call is the **dry run at scale**: a
  4096-rank mesh costs what one rank's shapes cost. It always runs on fake tensors, whatever
  the mesh: on a ``Mesh.from_torch`` mesh nothing is sent and the profile is the plain mesh's.
* :func:`record` collects the same records from a step while it really runs, on real ranks
  or under :func:`fastdist.simulate`.
* :class:`Network` describes the links (bandwidth and latency inside a node and across
  nodes, GPUs per node); :data:`NETWORKS` holds documented defaults.
* :func:`plan` profiles a step for every candidate layout of a world size (axis sizes and
  their order onto node boundaries) and ranks the layouts by an alpha-beta prediction of the
  communication time (:func:`predict`). No overlap with compute, no congestion: see
  docs/profile.md.

How the trace sees the collectives (no hook in the op machinery): for the duration of the
call it pushes a rank binding onto the meshes (as :func:`fastdist.simulate` does, with a fake
rank id), so every collective takes its per-rank path and calls its ``torch.ops.fastdist.<op>``
custom op; under ``FakeTensorMode`` that op answers with its shape rule, and its registered
autograd records the per-rank backward rule, whose collectives are per-rank ops again. A
``TorchDispatchMode`` sees each op with its ``mesh_shape``, ``axes`` and parameters. A
``TorchFunctionMode`` tags each forward op's autograd node with the module it ran in, so a
backward collective is attributed to the module whose forward recorded it.

>>> import torch, fastdist as fd
>>> from fastdist.profile import trace
>>> mesh = fd.Mesh({"dp": 2, "tp": 4})
>>> def step(x, w1, w2):
...     h = torch.tanh(fd.pvary(x, mesh, "tp") @ w1)
...     fd.psum(h @ w2, mesh, "tp").sum().backward()
>>> x = torch.ones(8, 16, requires_grad=True)
>>> w1, w2 = torch.ones(16, 32, requires_grad=True), torch.ones(32, 16, requires_grad=True)
>>> prof = trace(step, mesh, x, w1, w2)
>>> # pvary's backward is the all-reduce of dx
>>> [(r.op, r.axis, r.phase, r.size) for r in prof.records]
[('psum', 'tp', 'forward', 512), ('psum', 'tp', 'backward', 512)]
>>> prof.bus_bytes(axis="tp")  # 2 all-reduces of 512 bytes, factor 2(n-1)/n = 1.5
1536.0
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ._context import pop_simulation, push_simulation, simulation_of
from ._primitive import PRIMITIVES, Primitive
from .errors import FastdistError
from .mesh import Mesh
from .simulate import _Binding

__all__ = [
    "NETWORKS",
    "Layout",
    "Link",
    "Network",
    "Plan",
    "Prediction",
    "Profile",
    "ProfileError",
    "Record",
    "Recording",
    "bus_factor",
    "layouts",
    "plan",
    "predict",
    "record",
    "trace",
    "trace_model",
]

_META_KEY = (
    "fastdist.profile.module"  # autograd node metadata: the module whose forward recorded the node
)


class ProfileError(FastdistError, ValueError):
    """A profile, dry run or plan was asked for something it cannot compute.

    Attributes:
        op: what was being profiled or planned (e.g. ``"trace"``, ``"plan"``).
        fix: one sentence on how to make the call valid.
    """

    def __init__(self, op: str, problem: str, fix: str) -> None:
        self.op, self.fix = op, fix
        super().__init__(f"fastdist.profile.{op}: {problem}. Fix: {fix}")


# ====================================================================== bytes: the nccl-tests
# definitions
def bus_factor(kind: str, n: int) -> float:
    """The nccl-tests bus-bandwidth factor of a collective ``kind`` over ``n`` ranks.

    ``bus bytes = size * factor``: what each rank sends over its link in the ring (or
    pairwise) algorithm, so ``bus bytes / time`` compares with the link bandwidth.

    ===============  ==================  ====================================
    kind             factor              size S (bytes)
    ===============  ==================  ====================================
    ``allreduce``    ``2(n-1)/n``        the buffer (input = output)
    ``allgather``    ``(n-1)/n``         the gathered output (n x input)
    ``reducescatter`` ``(n-1)/n``        the input (n x output)
    ``alltoall``     ``(n-1)/n``         one rank's whole send buffer
    ``gather`` / ``scatter`` ``(n-1)/n`` the whole gathered (scattered) buffer
    ``broadcast``    ``1``               the buffer
    ``sendrecv``     ``1``               one rank's send buffer
    ===============  ==================  ====================================

    >>> bus_factor("allreduce", 4), bus_factor("allgather", 4), bus_factor("broadcast", 4)
    (1.5, 0.75, 1.0)
    """
    if n <= 1:
        return 0.0
    if kind == "allreduce":
        return 2 * (n - 1) / n
    if kind in ("allgather", "reducescatter", "alltoall", "gather", "scatter"):
        return (n - 1) / n
    if kind in ("broadcast", "sendrecv"):
        return 1.0
    raise ProfileError(
        "bus_factor",
        f"unknown collective kind {kind!r}",
        "use one of allreduce, allgather, reducescatter, alltoall, gather, scatter, broadcast, "
        "sendrecv",
    )


def _steps(kind: str, n: int) -> int:
    """Latency terms of the ring (pairwise) algorithm: sequential messages per rank."""
    if n <= 1:
        return 0
    if kind == "allreduce":
        return 2 * (n - 1)
    if kind == "sendrecv":
        return 1
    return n - 1


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _traffic(
    op: str, n: int, tensors: Sequence[Any], params: Mapping[str, Any], out: Any
) -> tuple[str, int, float, bool] | None:
    """``(kind, size S, fraction of ranks that send, size is an upper bound)`` of one per-rank op;
    ``None``: moves no data."""
    x = tensors[0]
    row = _nbytes(tuple(x.shape[1:]), x.dtype)
    if op in ("psum", "pmean", "pmax", "pmin"):
        return "allreduce", _nbytes(tuple(x.shape), x.dtype), 1.0, False
    # pmax/pmin backward: all-reduce (min) of an int64 winner index per element
    if op == "select_extreme":
        return "allreduce", _nbytes(tuple(x.shape), torch.int64), 1.0, False
    if op in ("all_gather", "all_gather_invariant"):
        return "allgather", _nbytes(tuple(out.shape), out.dtype), 1.0, False
    if op == "psum_scatter":
        return "reducescatter", _nbytes(tuple(x.shape), x.dtype), 1.0, False
    if op == "all_to_all":
        return "alltoall", _nbytes(tuple(x.shape), x.dtype), 1.0, False
    if op == "ppermute":
        perm = list(params["perm"])
        movers = sum(1 for s, d in zip(perm[0::2], perm[1::2]) if s != d)
        return "sendrecv", _nbytes(tuple(x.shape), x.dtype), movers / n, False
    if op == "broadcast":
        return "broadcast", _nbytes(tuple(x.shape), x.dtype), 1.0, False
    if op == "all_gather_v":
        return "allgather", sum(params["sizes"]) * row, 1.0, False
    if op == "reduce_scatter_v":
        return "reducescatter", sum(params["sizes"]) * row, 1.0, False
    if op == "gather_v":
        return "gather", sum(params["sizes"]) * row, 1.0, False
    if op == "scatter_v":
        return "scatter", sum(params["sizes"]) * row, 1.0, False
    # the split sizes are data: the whole send buffer bounds what is sent
    if op == "ragged_all_to_all":
        return "alltoall", _nbytes(tuple(x.shape), x.dtype), 1.0, True
    return None  # pvary, local_chunk, keep_src: local


# ====================================================================== records and profiles
@dataclass(frozen=True)
class Record:
    """One collective one rank issues.

    Attributes:
        op: the fastdist op (``"psum"``, ``"all_gather_v"``, ...; backward rules show as the ops
            they call).
        axis: the mesh axis name, or ``"dp+tp"`` for a tuple of axes.
        n: ranks in the group.
        kind: the nccl-tests collective (see :func:`bus_factor`).
        size: S in bytes (nccl-tests' definition for ``kind``).
        bus_bytes: what this rank sends: ``size * bus_factor(kind, n)`` (times the fraction of
            members that send, for a partial ``ppermute``).
        steps: latency terms of the ring algorithm (``2(n-1)`` for all-reduce, ``n-1`` for
            all-gather / reduce-scatter / all-to-all / gather / scatter / broadcast, ``1`` for
            send/recv).
        phase: ``"forward"`` or ``"backward"``.
        module: dotted path of the innermost ``nn.Module`` whose forward issued it (or recorded
            the backward node that issued it); ``""`` outside any traced module.
        dtype: element type.
        shape: the per-rank input shape.
        bound: ``size`` is an upper bound (``ragged_all_to_all``: the split sizes are data).
    """

    op: str
    axis: str
    n: int
    kind: str
    size: int
    bus_bytes: float
    steps: int
    phase: str
    module: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    bound: bool = False


_KEYS = ("op", "axis", "phase", "module", "kind", "n", "dtype")


@dataclass(frozen=True)
class Profile:
    """The collectives of one traced step on one rank (see :func:`trace`).

    Attributes:
        mesh: the mesh the step ran on.
        records: every collective in issue order (forward, then backward).

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"dp": 4})
    >>> prof = trace(lambda x: fd.all_gather(x, mesh, "dp"), mesh, torch.ones(2, 3))
    >>> print(prof.table())
    axis   op          phase    count  size (B)  bus bytes
    dp     all_gather  forward  1      96        72
    total                       1      96        72
    """

    mesh: Mesh
    records: tuple[Record, ...]

    def filter(self, **where: Any) -> Profile:
        """The records whose fields equal the given values, e.g. ``filter(axis="tp",
        phase="backward")``."""
        bad = [k for k in where if k not in Record.__dataclass_fields__]
        if bad:
            raise ProfileError(
                "Profile.filter",
                f"Record has no field {bad[0]!r}",
                f"filter by {', '.join(Record.__dataclass_fields__)}",
            )
        return replace(
            self,
            records=tuple(
                r for r in self.records if all(getattr(r, k) == v for k, v in where.items())
            ),
        )

    def count(self, **where: Any) -> int:
        """Number of collectives (matching ``where``, as :meth:`filter`)."""
        return len(self.filter(**where).records)

    def size(self, **where: Any) -> int:
        """Sum of the nccl-tests sizes S in bytes (matching ``where``)."""
        return sum(r.size for r in self.filter(**where).records)

    def bus_bytes(self, **where: Any) -> float:
        """Bytes this rank sends (bus bytes, matching ``where``)."""
        return sum(r.bus_bytes for r in self.filter(**where).records)

    def summary(self, by: Sequence[str] = ("axis", "op", "phase")) -> list[dict[str, Any]]:
        """Rows grouped by the given Record fields, in first-seen order: the fields, ``count``,
        ``size``, ``bus_bytes``."""
        bad = [k for k in by if k not in Record.__dataclass_fields__]
        if bad:
            raise ProfileError(
                "Profile.summary",
                f"Record has no field {bad[0]!r}",
                f"group by any of {', '.join(_KEYS)}",
            )
        rows: dict[tuple[Any, ...], dict[str, Any]] = {}
        for r in self.records:
            key = tuple(getattr(r, k) for k in by)
            row = rows.setdefault(
                key, {**dict(zip(by, key)), "count": 0, "size": 0, "bus_bytes": 0.0}
            )
            row["count"] += 1
            row["size"] += r.size
            row["bus_bytes"] += r.bus_bytes
        return list(rows.values())

    def table(self, by: Sequence[str] = ("axis", "op", "phase")) -> str:
        """:meth:`summary` as an aligned text table with a total row."""
        rows = self.summary(by)
        head = [*by, "count", "size (B)", "bus bytes"]
        body = [
            [str(r[k]) for k in by] + [str(r["count"]), str(r["size"]), f"{r['bus_bytes']:.0f}"]
            for r in rows
        ]
        body.append(
            [
                "total",
                *([""] * (len(by) - 1)),
                str(len(self.records)),
                str(self.size()),
                f"{self.bus_bytes():.0f}",
            ]
        )
        widths = [max(len(c[i]) for c in [head, *body]) for i in range(len(head))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]
        )

    def __str__(self) -> str:
        return self.table()


# ====================================================================== tracing
class _ModuleStack:
    """Forward hooks on a module tree keeping the path of the module running now (per trace, not
    global)."""

    def __init__(self) -> None:
        self.stack: list[str] = []

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    @contextmanager
    def hooks(self, modules: Sequence[nn.Module]) -> Iterator[None]:
        handles = []
        for root in modules:
            for name, m in root.named_modules():

                def pre(_m: nn.Module, _a: Any, name: str = name) -> None:
                    self.stack.append(name)

                def post(_m: nn.Module, _a: Any, _o: Any) -> None:
                    if self.stack:
                        self.stack.pop()

                handles.append(m.register_forward_pre_hook(pre))
                handles.append(m.register_forward_hook(post, always_call=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()


class _Tagger(TorchFunctionMode):
    """Tags the autograd node of each forward fastdist op with the module it ran in."""

    def __init__(self, modules: _ModuleStack) -> None:
        super().__init__()
        self.modules = modules

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if (
            isinstance(func, torch._ops.OpOverload)
            and func.namespace == "fastdist"
            and isinstance(out, Tensor)
            and out.grad_fn is not None
        ):
            node: Any = out.grad_fn
            node.metadata[_META_KEY] = self.modules.current
        return out


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Sees every ``fastdist::<op>`` per-rank op (forward and backward) and appends its Record."""

    def __init__(
        self, names: Mapping[tuple[int, ...], tuple[str, ...]], modules: _ModuleStack
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names, self.modules = names, modules
        self.records: list[Record] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace == "fastdist":
            self._record(func, args, out)
        return out

    def _record(self, func: Any, args: Sequence[Any], out: Any) -> None:
        name = func._opname
        prim = PRIMITIVES.get(name.removesuffix("_stacked"))
        if prim is None:
            return
        k = len(prim.inputs)
        tensors, mesh_shape, axes = args[:k], tuple(args[k]), tuple(args[k + 1])
        params = dict(zip(prim.param_names, args[k + 2 :]))
        # a stacked op called directly on [world, ...] tensors: one rank's share
        if name.endswith("_stacked"):
            tensors, out = tuple(_RankShare(t) for t in tensors), _RankShare(out)
        node: Any = torch._C._current_autograd_node()
        module = self.modules.current if node is None else str(node.metadata.get(_META_KEY, ""))
        rec = _make_record(
            prim.name, tensors, out, mesh_shape, axes, params, self.names, node is not None, module
        )
        if rec is not None:
            self.records.append(rec)


class _RankShare:
    """Shape and dtype of one rank's share of a stacked ``[world, ...]`` tensor (nothing is
    indexed)."""

    def __init__(self, t: Tensor) -> None:
        self.shape, self.dtype = tuple(t.shape[1:]), t.dtype


def _make_record(
    op: str,
    tensors: Sequence[Any],
    out: Any,
    mesh_shape: tuple[int, ...],
    axes: tuple[int, ...],
    params: Mapping[str, Any],
    names: Mapping[tuple[int, ...], tuple[str, ...]],
    backward: bool,
    module: str,
) -> Record | None:
    """The Record of one per-rank collective (``tensors``/``out``: anything with ``shape`` and
    ``dtype``); None: moves no data."""
    n = math.prod(mesh_shape[a] for a in axes)
    traffic = _traffic(op, n, tensors, params, out)
    if traffic is None or n <= 1:
        return None
    kind, size, senders, bound = traffic
    axis_names = names.get(mesh_shape)
    axis = (
        "+".join(axis_names[a] for a in axes) if axis_names else "+".join(f"axis{a}" for a in axes)
    )
    return Record(
        op=op,
        axis=axis,
        n=n,
        kind=kind,
        size=size,
        bus_bytes=size * bus_factor(kind, n) * senders,
        steps=_steps(kind, n),
        phase="backward" if backward else "forward",
        module=module,
        dtype=tensors[0].dtype,
        shape=tuple(tensors[0].shape),
        bound=bound,
    )


# small tensors built from Python values stay real under the trace (their values are known)
_CONSTANT_NUMEL = 4096


def _fake_mode() -> Any:
    """A ``FakeTensorMode`` that keeps the values of small tensors made from Python constants.

    torch keeps a fake tensor's value only up to one element; per-rank code often builds small
    index tensors from Python lists (``torch.tensor(seq_sizes)``, Ulysses' per-rank sizes) and
    reads them back (``int(sizes.max())``), which a plain fake tensor cannot answer. Values
    derived from the step's inputs stay unknown (fake), whatever their size.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    class _Mode(FakeTensorMode):  # type: ignore[no-untyped-call]
        def may_turn_const(self, t: Tensor) -> bool:
            return bool(
                t.numel() <= _CONSTANT_NUMEL
                and t.layout == torch.strided
                and not self.is_our_fake(t)
                and t.device.type != "meta"
            )

    return _Mode(allow_non_fake_inputs=True)


def _fake(mode: Any, t: Tensor, stacked: bool, device: torch.device) -> Tensor:
    if stacked:
        if t.dim() == 0:
            raise ProfileError(
                "trace",
                f"a tensor argument of shape {tuple(t.shape)} has no leading rank dim",
                "pass stacked=False for per-rank tensors",
            )
        t = t[0]
    if t.is_meta:  # a meta tensor: a fake one of the same shape on `device`, nothing allocated
        with mode:
            f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        return (
            f.requires_grad_(t.requires_grad)
            if t.requires_grad and (t.is_floating_point() or t.is_complex())
            else f
        )
    g: Tensor = mode.from_tensor(t.detach())
    return g.requires_grad_(t.requires_grad) if t.requires_grad else g


def trace(
    fn: Callable[..., Any],
    mesh: Mesh,
    *args: Any,
    meshes: Sequence[Mesh] = (),
    modules: Sequence[nn.Module] = (),
    stacked: bool = False,
    device: str | torch.device = "cpu",
    **kwargs: Any,
) -> Profile:
    """Run per-rank step ``fn`` once on fake tensors and return its collectives.

    Args:
        fn: per-rank code, as given to :func:`fastdist.simulate`; it calls ``backward()``
            itself if the backward collectives are wanted.
        mesh: the mesh ``fn``'s collectives use; any size (4096 ranks cost what one does).
        *args: ``fn``'s arguments. Tensors (at any depth) become fake tensors of the
            same shape, dtype and ``requires_grad`` (no data is copied; ``meta`` tensors are
            accepted, so models built on the meta device trace too). Other values pass unchanged.
        meshes: further meshes ``fn`` uses.
        modules: modules whose parameters and buffers become fake for the trace (gradients
            land on the fake copies, the real module is untouched) and whose submodules name
            the ``module`` field of each record. ``fn`` may call them directly.
        stacked: the tensors carry a leading rank dim (as for ``simulate``); rank 0's shape is used.
        device: device of the fake tensors made from meta tensors.
        **kwargs: ``fn``'s keyword arguments, faked as ``args``.

    Returns:
        A :class:`Profile` of one rank. Shapes are rank 0's; per-rank code whose shapes do not
        depend on the rank (everything but data-dependent ragged splits) issues the same
        collectives on every rank.

    Raises:
        ProfileError: a mesh is already being simulated, or an argument cannot be faked.

    The step always runs on fake tensors, whatever ``mesh`` is: on a mesh from
    ``Mesh.from_torch`` (a job on real ranks) the trace takes precedence over the process
    groups, nothing is sent, and the profile equals that of a plain ``Mesh`` with the same
    axes. To profile a step while it really runs (real ranks, or ``fastdist.simulate``), use
    :func:`record`. Small tensors made from Python values (``torch.tensor(seq_sizes)``) keep
    their values, so per-rank code may read them back; values computed from the inputs are
    unknown and must not decide shapes.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"dp": 64, "tp": 64})   # 4096 ranks: nothing per rank is allocated
    >>> x = torch.empty(1 << 20, device="meta")
    >>> prof = trace(lambda x: fd.psum_scatter(x, mesh, "dp"), mesh, x)
    >>> prof.records[0].size, prof.records[0].n
    (4194304, 64)
    """
    all_meshes = [mesh, *meshes]
    for m in all_meshes:
        if not isinstance(m, Mesh):
            raise ProfileError(
                "trace",
                f"expected a fastdist.Mesh, got {type(m).__name__}",
                "pass the Mesh the step runs on",
            )
        if simulation_of(m) is not None:
            raise ProfileError(
                "trace",
                f"{m!r} is being simulated right now",
                "call trace outside fastdist.simulate (it runs the per-rank code itself)",
            )
    dev = torch.device(device)
    mode = _fake_mode()
    conv = lambda a: _fake(mode, a, stacked, dev) if isinstance(a, Tensor) else a
    fargs, fkwargs = pytree.tree_map(conv, (args, kwargs))
    names = {tuple(m.shape.values()): m.axis_names for m in reversed(all_meshes)}
    stack = _ModuleStack()
    recorder = _Recorder(names, stack)
    with ExitStack() as es:
        for module in modules:
            state = {
                **dict(module.named_parameters(remove_duplicate=False)),
                **dict(module.named_buffers(remove_duplicate=False)),
            }
            fake_state = {k: _fake_param(mode, v, dev) for k, v in state.items()}
            es.enter_context(
                torch.nn.utils.stateless._reparametrize_module(module, fake_state, tie_weights=True)
            )
        es.enter_context(stack.hooks(modules))
        with mode:
            rank = torch.zeros((), dtype=torch.long, device=dev)
        push_simulation(all_meshes, _Binding(rank, mesh.size))  # the trace stands in for simulate
        es.callback(pop_simulation, len(all_meshes))
        es.enter_context(mode)
        es.enter_context(recorder)
        es.enter_context(_Tagger(stack))
        es.enter_context(_quiet())  # an open record() does not see the trace's collectives
        fn(*fargs, **fkwargs)
    return Profile(mesh, tuple(recorder.records))


def _fake_param(mode: Any, t: Tensor, device: torch.device) -> Tensor:
    f = _fake(mode, t, False, device)
    return nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f


# ====================================================================== recording a step as it runs
class _Running(threading.local):
    """Per thread: inside a recorded collective (its inner calls are not recorded again), or inside
    :func:`trace`."""

    depth = 0


_RUNNING = _Running()
_ACTIVE: list[
    Recording
] = []  # recordings in progress, innermost last (a collective on any thread goes to each)
_INSTALL = threading.Lock()


@contextmanager
def _quiet() -> Iterator[None]:
    """Collectives run here are not recorded by :func:`record` (the trace records its own)."""
    _RUNNING.depth += 1
    try:
        yield
    finally:
        _RUNNING.depth -= 1


def _unwrapped(t: Tensor) -> Tensor:
    """The tensor under simulate's vmap (and any torch.func wrapper): the one that carries the
    autograd node."""
    ft: Any = torch._C._functorch
    while ft.is_functorch_wrapped_tensor(t):
        t = ft.get_unwrapped(t)
    return t


def _recording_bind(prim: Primitive, stacked: bool) -> Callable[..., Tensor]:
    """``prim.bind`` (or ``bind_stacked``), recording each call into the active recordings."""
    bind = Primitive.bind_stacked if stacked else Primitive.bind

    def recorded(*tensors: Tensor, spec: Any, **params: Any) -> Tensor:
        if _RUNNING.depth or not _ACTIVE:
            return bind(prim, *tensors, spec=spec, **params)
        _RUNNING.depth += 1
        try:
            out = bind(prim, *tensors, spec=spec, **params)
        finally:
            _RUNNING.depth -= 1
        node: Any = torch._C._current_autograd_node()
        for rec in list(_ACTIVE):
            rec._add(prim.name, tensors, out, spec, params, stacked, node)
        return out

    return recorded


def _install() -> None:
    for prim in PRIMITIVES.values():
        prim.bind = _recording_bind(prim, False)  # type: ignore[method-assign]
        prim.bind_stacked = _recording_bind(prim, True)  # type: ignore[method-assign]


def _uninstall() -> None:
    for prim in PRIMITIVES.values():
        prim.__dict__.pop("bind", None)
        prim.__dict__.pop("bind_stacked", None)


class Recording:
    """The collectives of a step as it runs: the context manager :func:`record` returns.

    Attributes:
        mesh: the mesh of the records (as for :func:`trace`).
        profile: the :class:`Profile` of what ran so far (complete once the ``with`` block ends).
    """

    def __init__(self, mesh: Mesh, meshes: Sequence[Mesh], modules: Sequence[nn.Module]) -> None:
        self.mesh = mesh
        self._names = {tuple(m.shape.values()): m.axis_names for m in reversed([mesh, *meshes])}
        self._stack = _ModuleStack()
        self._modules = tuple(modules)
        self._hooks: ExitStack | None = None
        self._key = (_META_KEY, id(self))
        self._records: list[Record] = []

    def __enter__(self) -> Recording:
        if self._hooks is not None:
            raise ProfileError(
                "record", "this recording is already open", "open a new record(...) for each block"
            )
        self._hooks = ExitStack()
        self._hooks.enter_context(self._stack.hooks(self._modules))
        with _INSTALL:
            if not _ACTIVE:
                _install()
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _INSTALL:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                _uninstall()
        assert self._hooks is not None
        self._hooks.close()

    @property
    def profile(self) -> Profile:
        return Profile(self.mesh, tuple(self._records))

    def _add(
        self,
        op: str,
        tensors: Sequence[Any],
        out: Any,
        spec: Any,
        params: Mapping[str, Any],
        stacked: bool,
        node: Any,
    ) -> None:
        if node is None:
            module = self._stack.current
            fn: Any = _unwrapped(out).grad_fn
            # the backward collective this node will issue is attributed to the module running now
            if fn is not None:
                fn.metadata[self._key] = module
        else:
            module = str(node.metadata.get(self._key, ""))
        if stacked:  # [world, ...] tensors (simulate's backward): one rank's share
            tensors, out = tuple(_RankShare(t) for t in tensors), _RankShare(out)
        rec = _make_record(
            op,
            tensors,
            out,
            tuple(spec.mesh_shape),
            tuple(spec.axes),
            params,
            self._names,
            node is not None,
            module,
        )
        if rec is not None:
            self._records.append(rec)


def record(
    mesh: Mesh, *, meshes: Sequence[Mesh] = (), modules: Sequence[nn.Module] = ()
) -> Recording:
    """Record the collectives of a step while it really runs: on real ranks, or under
    :func:`fastdist.simulate`.

    A context manager (``with record(mesh) as rec:``); ``rec.profile`` is the :class:`Profile`.

    The same records (:class:`Record`) as :func:`trace` (one rank's: this process's on real
    ranks, rank 0's shapes under ``simulate``), forward and backward, with the module that
    issued each. Unlike
    :func:`trace` the step runs for real (data, memory, and on real ranks the communication);
    use it to profile the very step you train with, :func:`trace` to profile without running.

    Args:
        mesh: the mesh the step's collectives use (it names the axes of the records).
        meshes: further meshes the step uses.
        modules: modules whose submodules name the ``module`` field of each record.

    Every fastdist collective this process runs while the block is open is recorded, on any
    thread (the backward may run on autograd's threads), eager code only: a compiled step is
    recorded once, when dynamo traces it. Data-dependent sizes are charged as :func:`trace`
    charges them (``ragged_all_to_all``: the send buffer, ``bound=True``).

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 4})
    >>> with record(mesh) as rec:
    ...     out = fd.simulate(lambda x: fd.all_gather(x, mesh, "tp"), mesh)(torch.ones(4, 2, 3))
    >>> rec.profile == trace(lambda x: fd.all_gather(x, mesh, "tp"), mesh, torch.ones(2, 3))
    True
    """
    for m in [mesh, *meshes]:
        if not isinstance(m, Mesh):
            raise ProfileError(
                "record",
                f"expected a fastdist.Mesh, got {type(m).__name__}",
                "pass the Mesh the step runs on",
            )
    return Recording(mesh, meshes, modules)


# ====================================================================== the network and the
# alpha-beta model
@dataclass(frozen=True)
class Link:
    """One level of the network, seen from one GPU.

    Attributes:
        bandwidth: bytes per second one GPU can send (one direction).
        latency: seconds per message (alpha).
    """

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Network:
    """Two levels: GPUs within a node (``intra``) and across nodes (``inter``).

    Attributes:
        name: for tables.
        gpus_per_node: consecutive ranks ``[k*g, (k+1)*g)`` share node ``k``.
        intra: the link between GPUs of one node.
        inter: one GPU's share of the links between nodes.
    """

    name: str
    gpus_per_node: int
    intra: Link
    inter: Link

    def link(self, mesh_sizes: Sequence[int], axes: Sequence[int]) -> Link:
        """The link a group along ``axes`` of a row-major mesh runs over: ``intra`` if the
        group of rank 0 lies in one node, else ``inter`` (the slowest link bounds a ring)."""
        strides = [math.prod(mesh_sizes[i + 1 :]) for i in range(len(mesh_sizes))]
        # rank 0's group: ranks 0 .. span
        span = sum((mesh_sizes[a] - 1) * strides[a] for a in axes)
        return self.intra if span < self.gpus_per_node else self.inter


#: Documented defaults (see docs/profile.md for the sources). Bandwidths are per GPU and per
#: direction; latencies are per message and are rough assumptions, not measurements.
NETWORKS: dict[str, Network] = {
    # DGX H100: NVLink 4, 900 GB/s bidirectional per GPU (450 GB/s each way); 8x ConnectX-7 NDR 400
    # Gb/s (50 GB/s) per GPU.
    "dgx-h100": Network("dgx-h100", 8, Link(450e9, 3e-6), Link(50e9, 10e-6)),
    # DGX A100: NVLink 3, 600 GB/s bidirectional per GPU (300 GB/s each way); 8x ConnectX-6 HDR 200
    # Gb/s (25 GB/s) per GPU.
    "dgx-a100": Network("dgx-a100", 8, Link(300e9, 3e-6), Link(25e9, 10e-6)),
    # 8 PCIe GPUs per node without NVLink (PCIe 4 x16, ~25 GB/s each way in practice) and 100 Gb/s
    # Ethernet per node shared by 8 GPUs.
    "pcie-ethernet": Network("pcie-ethernet", 8, Link(25e9, 5e-6), Link(12.5e9 / 8, 30e-6)),
}


def _record_time(r: Record, link: Link) -> float:
    return r.steps * link.latency + r.bus_bytes / link.bandwidth


@dataclass(frozen=True)
class Layout:
    """Axis sizes in mesh order (outer to inner: the last axis varies fastest, so it is the one
    kept inside a node).

    Attributes:
        axes: ``(name, size)`` pairs of the axes of size > 1, outer to inner.
        unit: names of further axes of size 1 (:func:`layouts` leaves them out of ``axes``); the
            :attr:`mesh` has them too, innermost, so a step may use every axis whatever the layout
            (a collective over a size-1 axis moves nothing and is not recorded). Not compared.

    >>> dict(Layout((("dp", 4),), unit=("tp",)).mesh.shape)
    {'dp': 4, 'tp': 1}
    """

    axes: tuple[tuple[str, int], ...]
    unit: tuple[str, ...] = field(default=(), compare=False)

    @property
    def mesh(self) -> Mesh:
        return Mesh((*self.axes, *((name, 1) for name in self.unit if name not in dict(self.axes))))

    def __str__(self) -> str:
        return " x ".join(f"{a}{s}" for a, s in self.axes)


@dataclass(frozen=True)
class Prediction:
    """The predicted communication time of one layout (seconds), in total and per axis and phase."""

    layout: Layout
    time: float
    by_axis: dict[str, float] = field(default_factory=dict)
    by_phase: dict[str, float] = field(default_factory=dict)
    profile: Profile | None = None


def predict(profile: Profile, network: Network) -> Prediction:
    """Alpha-beta time of every collective of ``profile``, one after the other (no overlap, no
    congestion).

    Each record costs ``steps * latency + bus_bytes / bandwidth`` on the link its group runs
    over (:meth:`Network.link`).

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 4})
    >>> prof = trace(lambda x: fd.psum(x, mesh, "tp"), mesh, torch.empty(1000, device="meta"))
    >>> net = Network("toy", 4, Link(1e9, 1e-6), Link(1e8, 1e-5))
    >>> round(predict(prof, net).time * 1e6, 3)   # 6 steps * 1 us + 4000 * 1.5 B / 1 GB/s
    12.0
    """
    sizes = tuple(profile.mesh.shape.values())
    names = profile.mesh.axis_names
    by_axis: dict[str, float] = {}
    by_phase: dict[str, float] = {}
    total = 0.0
    for r in profile.records:
        idx = (
            [names.index(a) for a in r.axis.split("+")]
            if all(a in names for a in r.axis.split("+"))
            else []
        )
        t = _record_time(r, network.link(sizes, idx))
        total += t
        by_axis[r.axis] = by_axis.get(r.axis, 0.0) + t
        by_phase[r.phase] = by_phase.get(r.phase, 0.0) + t
    axes = tuple((a, n) for a, n in zip(names, sizes) if n > 1) or tuple(zip(names, sizes))[:1]
    return Prediction(
        Layout(axes, tuple(a for a in names if a not in dict(axes))),
        total,
        by_axis,
        by_phase,
        profile,
    )


def _factorizations(world: int, k: int) -> Iterator[tuple[int, ...]]:
    if k == 1:
        yield (world,)
        return
    for d in range(1, world + 1):
        if world % d == 0:
            for rest in _factorizations(world // d, k - 1):
                yield (d, *rest)


def layouts(
    world: int,
    axes: Sequence[str],
    *,
    max_size: Mapping[str, int] | None = None,
    orders: bool = True,
) -> list[Layout]:
    """Every layout of ``world`` ranks over ``axes``: sizes multiplying to ``world`` (each at most
    ``max_size[axis]``), and with ``orders`` every order of the axes of size > 1 onto the ranks
    (which axes stay inside a node); otherwise the order given. Axes of size 1 are left out of
    the name and the order (they are the layout's ``unit`` axes: its mesh has them, with size 1).

    >>> [str(l) for l in layouts(4, ("dp", "tp"), orders=False)]
    ['tp4', 'dp2 x tp2', 'dp4']
    >>> len(layouts(8, ("dp", "tp")))   # tp8, dp8, and dp2 x tp4, dp4 x tp2 in both orders
    6
    """
    if world < 1 or not axes or len(set(axes)) != len(axes):
        raise ProfileError(
            "layouts",
            f"world={world!r}, axes={tuple(axes)!r}",
            "pass a positive world size and distinct axis names",
        )
    limit = dict(max_size or {})
    out: list[Layout] = []
    seen: set[tuple[tuple[str, int], ...]] = set()
    for sizes in _factorizations(world, len(axes)):
        if any(s > limit.get(a, world) for a, s in zip(axes, sizes)):
            continue
        kept = [(a, s) for a, s in zip(axes, sizes) if s > 1] or [(axes[0], 1)]
        unit = tuple(a for a in axes if a not in dict(kept))
        for perm in itertools.permutations(kept) if orders else [tuple(kept)]:
            if perm not in seen:
                seen.add(perm)
                out.append(Layout(tuple(perm), unit))
    return out


@dataclass(frozen=True)
class Plan:
    """Layouts ranked by predicted communication time (fastest first)."""

    network: Network
    predictions: tuple[Prediction, ...]

    @property
    def best(self) -> Prediction:
        return self.predictions[0]

    def table(self) -> str:
        """One line per layout: predicted time, and its share per axis."""
        axes = sorted({a for p in self.predictions for a in p.by_axis})
        head = ["rank", "layout", "time (ms)", *(f"{a} (ms)" for a in axes)]
        body = [
            [
                str(i + 1),
                str(p.layout),
                f"{p.time * 1e3:.3f}",
                *(f"{p.by_axis.get(a, 0.0) * 1e3:.3f}" for a in axes),
            ]
            for i, p in enumerate(self.predictions)
        ]
        widths = [max(len(c[i]) for c in [head, *body]) for i in range(len(head))]
        return f"network: {self.network.name}\n" + "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]
        )

    def plot(self, ax: Any = None) -> Any:
        """A horizontal stacked bar per layout (time per axis); returns the matplotlib Axes."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(7, 0.35 * len(self.predictions) + 1))
        labels = [str(p.layout) for p in self.predictions]
        left = [0.0] * len(labels)
        for a in sorted({a for p in self.predictions for a in p.by_axis}):
            w = [p.by_axis.get(a, 0.0) * 1e3 for p in self.predictions]
            ax.barh(labels, w, left=left, label=a)
            left = [x + y for x, y in zip(left, w)]
        ax.invert_yaxis()
        ax.set_xlabel(f"predicted communication time (ms), {self.network.name}")
        ax.legend()
        return ax

    def __str__(self) -> str:
        return self.table()


def plan(
    build: Callable[[Mesh], Profile],
    candidates: Iterable[Layout] | int,
    network: Network | str,
    *,
    axes: Sequence[str] = ("dp", "tp"),
    max_size: Mapping[str, int] | None = None,
    orders: bool = True,
) -> Plan:
    """Profile ``build(layout.mesh)`` for every candidate layout and rank them by :func:`predict`.

    Args:
        build: makes the step for a mesh and traces it (usually ``lambda mesh:
            trace(step_for(mesh), mesh, ...)``): the per-rank shapes depend on the layout (a batch
            split over ``dp``, weights over ``tp``), which only the step's author knows. The mesh
            has every axis of ``axes``, those of size 1 included, so the step may call its
            collectives whatever the layout.
        candidates: a list of :class:`Layout` (e.g. from :func:`layouts`), or a world size: then
            ``layouts(candidates, axes, max_size=max_size, orders=orders)``.
        network: a :class:`Network`, or the name of one in :data:`NETWORKS`.
        axes: the axis names, for a world size given as ``candidates`` (see :func:`layouts`).
        max_size: the largest size of each axis, for a world size given as ``candidates``.
        orders: every order of the axes onto the ranks, for a world size given as ``candidates``.

    >>> import torch, fastdist as fd
    >>> def build(mesh):   # a TP MLP (tokens 512, hidden 1024) with its dp gradient all-reduce
    ...     dp, tp = mesh.shape["dp"], mesh.shape["tp"]
    ...     def step(x, w):
    ...         fd.psum(fd.pvary(x, mesh, "tp") @ w @ w.T, mesh, "tp").sum().backward()
    ...         fd.psum(w.grad, mesh, "dp")
    ...     x = torch.empty(512 // dp, 1024, device="meta")
    ...     w = torch.empty(1024, 4096 // tp, device="meta", requires_grad=True)
    ...     return trace(step, mesh, x, w)
    >>> p = plan(build, 16, "dgx-h100", axes=("dp", "tp"), max_size={"tp": 8})
    >>> str(p.best.layout)   # the 16 MiB/tp gradient all-reduce over dp stays inside a node
    'tp2 x dp8'
    """
    if isinstance(network, str):
        if network not in NETWORKS:
            raise ProfileError(
                "plan",
                f"no network named {network!r}",
                f"use one of {', '.join(NETWORKS)}, or pass a Network",
            )
        network = NETWORKS[network]
    cands = (
        layouts(candidates, axes, max_size=max_size, orders=orders)
        if isinstance(candidates, int)
        else list(candidates)
    )
    if not cands:
        raise ProfileError(
            "plan",
            "no candidate layout",
            "pass a world size, layouts(world, axes) or a non-empty list of Layout",
        )
    preds = []
    for layout in cands:
        prof = build(layout.mesh)
        if not isinstance(prof, Profile):
            raise ProfileError(
                "plan",
                f"build returned {type(prof).__name__} for {layout}, not a Profile",
                "return trace(step, mesh, ...) from build",
            )
        preds.append(replace(predict(prof, network), layout=layout))
    return Plan(network, tuple(sorted(preds, key=lambda p: p.time)))


def trace_model(model: Any, *args: Any, backward: bool = True, **kwargs: Any) -> Profile:
    """:func:`trace` of one forward (and backward) of a :func:`fastdist.nn.parallelize` model.

    Args:
        model: a ``fastdist.nn.ParallelModel`` (simulated or on real ranks); its parameters
            become fake tensors of one rank's shard (nothing is copied).
        *args: one rank's positional inputs (no rank dim).
        backward: also run ``backward()`` of the output's ``loss`` (or of its sum when the
            output is a tensor).
        **kwargs: one rank's keyword inputs (no rank dim), e.g. ``input_ids=``, ``labels=``.

    Records carry the model's module paths (``model.layers.0.mlp.down_proj``).
    """
    params = {n: p[0] if model.simulated else p for n, p in model.module.named_parameters()}

    def step(params: dict[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        out = model._run(params, args, {**model._no_cache, **kwargs})
        if backward:
            loss = out if isinstance(out, Tensor) else out.loss
            if loss is None:
                raise ProfileError(
                    "trace_model",
                    "the model's output has no loss to differentiate",
                    "pass labels=..., or backward=False",
                )
            loss.sum().backward()

    return trace(step, model.mesh, params, args, kwargs, modules=[model.module])
