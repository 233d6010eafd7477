"""Trace a per-rank step once on fake tensors: :func:`trace` (and :func:`trace_model` for a
parallelized model) records its collectives, compute, parameters and saved activations into a
:class:`Profile`; ``routing=`` prices routed MoE layers through the declared hook of
``fastdist.nn.moe`` (:class:`BalancedRouting`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fastdist.core.binding import RankBinding
from fastdist.core.context import (
    pop_routing,
    pop_simulation,
    push_routing,
    push_simulation,
    simulation_of,
)
from fastdist.core.mesh import Mesh
from fastdist.core.primitive import PRIMITIVES
from fastdist.errors import ProfileError
from fastdist.profile._common import META_KEY, ModuleStack, RankShare, make_record, quiet
from fastdist.profile._kernels import NOT_KERNELS, Kernel, kernel_flops, kernel_key, spec_of
from fastdist.profile.records import GradReady, Param, Profile, Record, Work

__all__ = ["ROUTINGS", "BalancedRouting", "trace", "trace_model"]


class _Tagger(TorchFunctionMode):
    """Tags the autograd node of each forward op's output with the module it ran in (a node
    tagged before keeps its module: an op that returns its input unchanged does not move it)."""

    def __init__(self, modules: ModuleStack) -> None:
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
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor) and t.grad_fn is not None:
                _tag(t.grad_fn, self.modules.current)
        return out


def _tag(node: Any, module: str) -> None:
    """Tag ``node`` and the untagged nodes it reaches (the ones the same call made: ``linear``
    of a 3-d input is a view, a matmul and a view) with ``module``; tagged nodes stop the walk."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n is None or META_KEY in n.metadata:
            continue
        n.metadata[META_KEY] = module
        todo.extend(f for f, _ in n.next_functions)


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Sees every ``fastdist::<op>`` per-rank op (forward and backward) and appends its Record."""

    def __init__(
        self, names: Mapping[tuple[int, ...], tuple[str, ...]], modules: ModuleStack
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names, self.modules = names, modules
        self.records: list[Record] = []
        # the step in issue order: compute between collectives, collectives, gradients ready
        self.events: list[Work | Record | GradReady] = []
        # (phase, module) -> [flops, kernels, bytes] not yet flushed
        self._work: dict[tuple[str, str], list[float]] = {}
        # (phase, module) -> kernel key -> [calls, flops, bytes of one call] not yet flushed
        self._calls: dict[tuple[str, str], dict[str, list[Any]]] = {}
        # kernel key -> how to replay it (calibrate_kernels)
        self.kernels: dict[str, Kernel] = {}

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
        elif func.namespace == "aten" and not func.is_view and func not in NOT_KERNELS:
            self._count(func, args, kwargs or {}, out)
        return out

    def _count(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> None:
        """Charge one aten kernel: its matmul / attention FLOPs, or the bytes it reads and
        writes."""
        node: Any = torch._C._current_autograd_node()
        phase = "forward" if node is None else "backward"
        module = self.modules.current if node is None else str(node.metadata.get(META_KEY, ""))
        if self._work and (phase, module) not in self._work:
            self.flush()
        acc = self._work.setdefault((phase, module), [0.0, 0.0, 0.0])
        flops = kernel_flops(func, args)
        nbytes = 0.0
        acc[1] += 1
        if flops:
            acc[0] += flops
        else:
            leaves = [*pytree.tree_leaves((args, kwargs)), *pytree.tree_leaves(out)]
            nbytes = float(
                sum(t.numel() * t.dtype.itemsize for t in leaves if isinstance(t, Tensor))
            )
            acc[2] += nbytes
        key = kernel_key(func, args, kwargs)
        if key not in self.kernels:
            self.kernels[key] = Kernel(func, *pytree.tree_map(spec_of, (tuple(args), kwargs)))
        calls = self._calls.setdefault((phase, module), {})
        one = calls.setdefault(key, [0, flops, nbytes])
        one[0] += 1

    def flush(self) -> None:
        """Close the compute run so far (before a collective or a gradient event)."""
        for (phase, module), (flops, kernels, nbytes) in self._work.items():
            calls = tuple(
                (k, int(c), f, b) for k, (c, f, b) in self._calls.get((phase, module), {}).items()
            )
            self.events.append(Work(phase, flops, int(kernels), nbytes, module, calls))
        self._work = {}
        self._calls = {}

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
            tensors, out = tuple(RankShare(t) for t in tensors), RankShare(out)
        node: Any = torch._C._current_autograd_node()
        module = self.modules.current if node is None else str(node.metadata.get(META_KEY, ""))
        rec = make_record(
            prim.name, tensors, out, mesh_shape, axes, params, self.names, node is not None, module
        )
        if rec is not None:
            self.flush()
            self.records.append(rec)
            self.events.append(rec)


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
    routing: str = "bound",
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
        routing: how a routed MoE layer (``fastdist.nn.moe``: which expert a token goes to is
            data) is charged. ``"bound"``: what its per-rank code issues on simulated ranks,
            the worst case: every local expert runs on every row of the ``ep x T x k``-row
            receive buffer, and the combine sends that buffer back (records ``bound=True``).
            ``"balanced"``: the expected load of a balanced router: each of the ``E`` experts
            runs on ``ceil(ep x T x k / E)`` rows, gathered and scattered back as real ranks
            do, and ``all_to_all`` dispatch receives (and the combine sends back) its local
            experts' share of that; the ragged records stay marked ``bound=True`` (their sizes
            are then expectations). Other layers are unaffected.
        **kwargs: ``fn``'s keyword arguments, faked as ``args``.

    Returns:
        A :class:`Profile` of one rank. Shapes are rank 0's; per-rank code whose shapes do not
        depend on the rank (everything but data-dependent ragged splits) issues the same
        collectives on every rank.

    Raises:
        ProfileError: a mesh is already being simulated, or an argument cannot be faked.

    The step always runs on fake tensors, whatever ``mesh`` is: on a mesh from
    ``fastdist.connect`` (a job on real ranks) the trace takes precedence over the process
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
    _check_meshes(all_meshes)
    dev = torch.device(device)
    mode = _fake_mode()
    conv = lambda a: _fake(mode, a, stacked, dev) if isinstance(a, Tensor) else a
    fargs, fkwargs = pytree.tree_map(conv, (args, kwargs))
    names = {tuple(m.shape.values()): m.axis_names for m in reversed(all_meshes)}
    stack = ModuleStack()
    recorder = _Recorder(names, stack)
    leaves = _argument_leaves(fargs, fkwargs)
    with ExitStack() as es:
        for module in modules:
            _fake_module(module, mode, dev, leaves, es)
        got = _watch_grads(recorder, list(leaves.values()), es)
        saved = _SavedBytes([t for _, t in leaves.values()])
        es.enter_context(torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t))
        es.enter_context(stack.hooks(modules))
        with mode:
            rank = torch.zeros((), dtype=torch.long, device=dev)
        # the trace stands in for simulate
        push_simulation(all_meshes, RankBinding(rank, mesh.size))
        es.callback(pop_simulation, len(all_meshes))
        es.enter_context(mode)
        es.enter_context(recorder)
        es.enter_context(_Tagger(stack))
        es.enter_context(quiet())  # an open record() does not see the trace's collectives
        es.enter_context(_routing(routing))
        fn(*fargs, **fkwargs)
        recorder.flush()
    return _profile(mesh, recorder, stack, list(leaves.values()), got, saved.bytes)


def _check_meshes(meshes: Sequence[Mesh]) -> None:
    """Refuse a mesh that is not a Mesh, or one being simulated right now."""
    for m in meshes:
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


def _argument_leaves(fargs: Any, fkwargs: Any) -> dict[int, tuple[str, Tensor]]:
    """The faked arguments' leaves that may receive a gradient, by id: ``(name, tensor)`` with
    the name ``args[1]`` / ``kwargs['w']``."""
    leaves: dict[int, tuple[str, Tensor]] = {}
    for path, leaf in pytree.tree_flatten_with_path((fargs, fkwargs))[0]:
        if isinstance(leaf, Tensor) and leaf.requires_grad and leaf.is_leaf:
            where = "args" if path[0] == pytree.SequenceKey(0) else "kwargs"
            leaves.setdefault(id(leaf), (where + pytree.keystr(path[1:]), leaf))
    return leaves


def _fake_module(
    module: nn.Module,
    mode: Any,
    dev: torch.device,
    leaves: dict[int, tuple[str, Tensor]],
    es: ExitStack,
) -> None:
    """Reparametrize ``module`` with fake copies of its parameters and buffers for the trace
    (tied weights stay one tensor); its trainable parameters join ``leaves``."""
    state = {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }
    made: dict[int, Tensor] = {}  # tied weights (a meta model's too) stay one tensor
    for v in state.values():
        if id(v) not in made:
            made[id(v)] = _fake_param(mode, v, dev)
    fake_state = {k: made[id(v)] for k, v in state.items()}
    for k, v in fake_state.items():
        if isinstance(v, nn.Parameter) and v.requires_grad:
            leaves.setdefault(id(v), (k, v))
    es.enter_context(
        torch.nn.utils.stateless._reparametrize_module(module, fake_state, tie_weights=True)
    )


def _profile(
    mesh: Mesh,
    recorder: _Recorder,
    stack: ModuleStack,
    named: Sequence[tuple[str, Tensor]],
    got: set[int],
    activations: int,
) -> Profile:
    """The :class:`Profile` of a finished trace; its parameters: the leaves that received a
    gradient, in argument / registration order (the :class:`GradReady` events renumbered)."""
    order = [i for i in range(len(named)) if i in got]
    index = {i: k for k, i in enumerate(order)}
    params = tuple(
        Param(named[i][0], named[i][1].numel() * named[i][1].dtype.itemsize, named[i][1].dtype)
        for i in order
    )
    events = tuple(
        GradReady(index[e.param]) if isinstance(e, GradReady) else e for e in recorder.events
    )
    outputs = tuple(stack.outputs.items())
    return Profile(
        mesh, tuple(recorder.records), events, params, activations, outputs, recorder.kernels
    )


def _watch_grads(
    recorder: _Recorder, leaves: Sequence[tuple[str, Tensor]], es: ExitStack
) -> set[int]:
    """Post-accumulate-grad hooks on the traced leaves: each accumulation is a :class:`GradReady`
    event (its index in ``leaves``, renumbered by :func:`trace`); returns the indices that got
    one (filled during the trace)."""
    got: set[int] = set()
    for i, (_, leaf) in enumerate(leaves):

        def hook(_t: Tensor, i: int = i) -> None:
            recorder.flush()
            recorder.events.append(GradReady(i))
            got.add(i)

        handle = leaf.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
        es.callback(handle.remove)
    return got


class _SavedBytes:
    """Bytes of the unique storages autograd saves for backward (parameters excluded)."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.skip = {t.untyped_storage()._cdata for t in params}
        self.seen: dict[int, Any] = {}  # keeps the (fake) storages alive: no address reused
        self.bytes = 0

    def pack(self, t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.skip and key not in self.seen:
            self.seen[key] = storage
            self.bytes += storage.nbytes()
        return t


def _fake_param(mode: Any, t: Tensor, device: torch.device) -> Tensor:
    f = _fake(mode, t, False, device)
    return nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f


# ---------------------------------------------------------------- MoE routing under a trace
#: how :func:`trace` charges a routed MoE layer (``fastdist.nn.moe``), whose row counts are data
ROUTINGS = ("balanced", "bound")


class BalancedRouting:
    """The MoE routing policy of a ``routing="balanced"`` trace (``fastdist.nn.moe.RoutingPolicy``,
    installed on the tracing thread through ``fastdist.core.context.push_routing``).

    `dispatch` receives the rows of a balanced routing: each of the ``E`` experts gets
    ``ceil(ep T k / E)`` rows (``T`` tokens with ``k`` experts each, on each of ``ep`` ranks),
    so ``all_to_all`` receives ``E_local x`` that (at most ``capacity``) instead of the worst
    case ``ep T k``; the experts then run as real ranks do (gather their rows, the expert,
    scatter-add back) on that count of rows, instead of every expert on every row.
    """

    def __init__(self) -> None:
        self.expert_rows = 0  # set by the dispatch, read by the experts that follow it

    def dispatch(
        self,
        n: int,
        local_experts: int,
        tokens: int,
        k: int,
        num_experts: int,
        capacity: int | None,
        strategy: str,
    ) -> int | None:
        rows = math.ceil(n * tokens * k / num_experts)  # one expert's expected rows
        if capacity is not None:
            rows = min(rows, capacity // local_experts)
        self.expert_rows = rows
        return local_experts * rows if strategy == "all_to_all" else capacity

    def run_experts(
        self,
        x: Tensor,
        assign: Tensor,
        scale: Tensor | None,
        expert_fn: Callable[[Tensor, int], Tensor],
    ) -> Tensor:
        rows = min(self.expert_rows or x.shape[0], x.shape[0])
        idx = torch.arange(rows, device=x.device)  # (rows,): which rows does not change the cost
        y = x.new_zeros(x.shape[0], x.shape[-1])  # (R, H)
        for e in range(assign.shape[-1]):
            ye = expert_fn(x.index_select(0, idx), e)  # (rows, H)
            if scale is not None:
                ye = ye * scale[:, e].index_select(0, idx).unsqueeze(-1).to(ye.dtype)
            y = y.index_add(0, idx, ye)
        return y


@contextmanager
def _routing(routing: str) -> Iterator[None]:
    """Charge MoE layers by ``routing`` on this thread for the duration (see :func:`trace`)."""
    if routing not in ROUTINGS:
        raise ProfileError(
            "trace", f"routing={routing!r}", f"choose routing among {', '.join(ROUTINGS)}"
        )
    if routing == "bound":  # the layers as written (an outer balanced trace's policy stays)
        yield
        return
    push_routing(BalancedRouting())
    try:
        yield
    finally:
        pop_routing()


def trace_model(
    model: Any, *args: Any, backward: bool = True, routing: str = "balanced", **kwargs: Any
) -> Profile:
    """:func:`trace` of one forward (and backward) of a :func:`fastdist.nn.parallelize` model.

    Args:
        model: a ``fastdist.nn.ParallelModel`` (simulated or on real ranks); its parameters
            become fake tensors of one rank's shard (nothing is copied).
        *args: one rank's positional inputs (no rank dim).
        backward: also run ``backward()`` of the output's ``loss`` (or of its sum when the
            output is a tensor).
        routing: MoE layers charged at a balanced router's expected load (``"balanced"``, the
            default here: what a planner should price) or at the worst case (``"bound"``);
            see :func:`trace`.
        **kwargs: one rank's keyword inputs (no rank dim), e.g. ``input_ids=``, ``labels=``.

    Records carry the model's module paths (``model.layers.0.mlp.down_proj``).
    """
    params = {n: p[0] if model.simulated else p for n, p in model.module.named_parameters()}

    def step(params: dict[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        out = model.forward_rank(params, args, kwargs)
        if backward:
            loss = out if isinstance(out, Tensor) else out.loss
            if loss is None:
                raise ProfileError(
                    "trace_model",
                    "the model's output has no loss to differentiate",
                    "pass labels=..., or backward=False",
                )
            loss.sum().backward()

    return trace(step, model.mesh, params, args, kwargs, modules=[model.module], routing=routing)
