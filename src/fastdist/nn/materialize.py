"""Models that never sit whole on one rank: the model's own initialisation, one module at a time.

A model built under ``with torch.device("meta"):`` has shapes but no values. After
`fastdist.nn.parallelize` each of its parameters is a meta shard; ``fastdist.checkpoint.load`` reads
values from a checkpoint, and `init_weights` (here, for a parallel model as for a
single-device one) computes them with the model's own init:

* every module of the original (single-device) model gets its init run once, children before
  parents (the order of transformers' ``initialize_weights``): transformers' ``_init_weights``
  of the nearest ``PreTrainedModel`` (the module itself or an ancestor), or, in a model that is
  not a transformers model, the module's own ``reset_parameters`` (torch's init);
* each run draws from the random generator of the tensors' device seeded with a seed of its own,
  `module_seed` ``(seed, module name)``: the values depend on neither the order in which
  modules run nor on the global generator (which is left as it was);
* which tensors a module's init writes (and reads) is found first by running it on a meta copy of
  the model (a dispatch mode records each op's arguments). Each written tensor then exists whole
  only from the first init that writes it to the last that touches it, and is handed on
  (sharded, or copied into a single-device model) and freed. The peak is the tensors of the
  modules in flight: one module's in transformers' models (GPT-2's attention re-initialises its
  ``c_proj`` child: that weight waits for it).

The same code fills a single-device model and a parallel one, so the parallel model's shards are
slices of exactly the tensors the single-device model gets.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from fastdist.core.mesh import Mesh
from fastdist.errors import InitError, ParallelizeError
from fastdist.nn.state import Layout, listed, materialize_, meta_names

__all__ = ["init_weights", "module_seed"]


def module_seed(seed: int, name: str) -> int:
    """The seed of module ``name``'s init (``""``: the model itself): the first 8 bytes of
    ``sha256(f"{seed}/{name}")``, big-endian, shifted right by one (a 63-bit int).

    Args:
        seed: the model's seed.
        name: the module's dotted name (``""``: the model itself).

    Returns:
        a 63-bit int, the same for the same ``(seed, name)`` on every rank.

    >>> module_seed(0, "model.layers.0.mlp.up_proj") == module_seed(0, "model.layers.0.mlp.up_proj")
    True
    """
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


# ============================================================================ the meta copy
@dataclass
class Original:
    """A meta copy of a single-device model (the structure ``parallelize`` changes in place):
    every parameter and buffer a meta tensor of the original's shape, dtype and strides, tied
    tensors still tied.

    Attributes:
        model: the copy.
        tensors: canonical name (the first, as ``named_parameters`` / ``named_buffers`` give it)
            -> its meta tensor.
        params: the names in ``tensors`` that are parameters.
        persistent: the names of buffers in the state dict.
        owners: name -> every (module, attribute, is a parameter) that holds it.
    """

    model: nn.Module
    tensors: dict[str, Tensor] = field(default_factory=dict)
    params: set[str] = field(default_factory=set)
    persistent: set[str] = field(default_factory=set)
    owners: dict[str, list[tuple[nn.Module, str, bool]]] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module) -> Original:
        """The meta copy of ``model`` (no tensor data is copied)."""
        memo: dict[int, Any] = {}
        for p in model.parameters():
            memo[id(p)] = nn.Parameter(
                torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
            )
        for b in model.buffers():
            memo[id(b)] = torch.empty_like(b, device="meta")
        out = cls(copy.deepcopy(model, memo))
        canon: dict[int, str] = {}
        for n, p in out.model.named_parameters():
            canon[id(p)], out.tensors[n] = n, p
            out.params.add(n)
        for n, b in out.model.named_buffers():
            canon.setdefault(id(b), n)
            out.tensors.setdefault(canon[id(b)], b)
        keys = set(out.model.state_dict(keep_vars=True))
        out.persistent = {n for n in out.tensors if n in keys and n not in out.params}
        for _, mod in out.model.named_modules(remove_duplicate=False):
            for attr, p in mod._parameters.items():
                if p is not None:
                    out.owners.setdefault(canon[id(p)], []).append((mod, attr, True))
            for attr, b in mod._buffers.items():
                if b is not None:
                    out.owners.setdefault(canon[id(b)], []).append((mod, attr, False))
        return out

    def storages(self, tensors: dict[str, Tensor]) -> dict[int, str]:
        """storage id -> name, for views of ``tensors`` (by name) found in op arguments."""
        return {i: n for n, t in tensors.items() if (i := _storage_id(t)) is not None}

    @contextmanager
    def holding(self, live: dict[str, Tensor]) -> Iterator[None]:
        """Every owner of each name in ``live`` holds the live tensor instead of its meta one."""
        try:
            for n, t in live.items():
                for mod, attr, is_param in self.owners.get(n, []):
                    _slots(mod, is_param)[attr] = t
            yield
        finally:
            for n in live:
                for mod, attr, is_param in self.owners.get(n, []):
                    _slots(mod, is_param)[attr] = self.tensors[n]


def _slots(module: nn.Module, is_param: bool) -> dict[str, Any]:
    """The module's own parameters or buffers, by attribute name."""
    return module._parameters if is_param else module._buffers


def _storage_id(t: Tensor) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return None


# ============================================================================ what each init does
class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records, for the tensors it knows (by storage), each op that reads or writes them:
    ``(name, "read" | "full" | "partial")`` in order. Views are not reads; ops that read only
    shape and dtype (``empty_like``, ``new_zeros``, ...) neither."""

    def __init__(self, known: dict[int, str], numel: dict[str, int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.known, self.numel = known, numel
        self.events: list[tuple[str, str]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        op = func._schema.name.split("::")[-1]
        if not (op.endswith("_like") or op.startswith("new_")):
            for i, arg in enumerate(func._schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    sid = _storage_id(t) if isinstance(t, Tensor) else None
                    name = self.known.get(sid) if sid is not None else None
                    if name is None:
                        continue
                    if arg.alias_info is not None and arg.alias_info.is_write:
                        kind = "full" if t.numel() == self.numel[name] else "partial"
                        self.events.append((name, kind))
                    elif arg.alias_info is None:
                        self.events.append((name, "read"))
        return func(*args, **kwargs)


@dataclass
class Step:
    """One module's init: what it writes, and what it needs from before it ran (tensors it reads,
    or writes only part of, before writing them whole)."""

    name: str
    module: nn.Module
    run: Callable[[], object]
    what: str
    writes: set[str]
    needs: set[str]
    touched: set[str]


def _init_fn(module: nn.Module) -> Callable[[nn.Module], object] | None:
    """transformers' ``_init_weights`` of a ``PreTrainedModel`` (duck-typed: no import of
    transformers)."""
    fn = getattr(module, "_init_weights", None)
    return fn if callable(fn) and hasattr(module, "config") else None


def _visit(
    module: nn.Module, name: str, init: Callable[[nn.Module], object] | None
) -> Iterator[tuple[str, nn.Module, Callable[[], object], str]]:
    """(name, module, its init, what the init is) in transformers' order: children first, a
    ``PreTrainedModel`` child switching to its own ``_init_weights``."""
    for child_name, child in module.named_children():
        yield from _visit(
            child, f"{name}.{child_name}" if name else child_name, _init_fn(child) or init
        )
    if init is not None:
        owner = type(getattr(init, "__self__", None)).__name__
        yield name, module, (lambda: init(module)), f"{owner}._init_weights"
    elif callable(getattr(module, "reset_parameters", None)):
        reset = cast("Callable[[], object]", module.reset_parameters)
        yield name, module, reset, f"{type(module).__name__}.reset_parameters"


def init_steps(original: Original) -> list[Step]:
    """Every module's init step, found by running each on the meta copy (nothing real is written,
    the global generator is left as it was). Raises `InitError` for an init that cannot run on
    the meta device or replaces tensors instead of writing them."""
    known = original.storages(original.tensors)
    numel = {n: t.numel() for n, t in original.tensors.items()}
    steps = []
    for name, module, run, what in _visit(original.model, "", _init_fn(original.model)):
        recorder = _Recorder(known, numel)
        try:
            with _seeded(0, [torch.device("cpu")]), torch.no_grad(), recorder:
                run()
        except Exception as e:
            raise InitError(
                f"{what} of {name or 'the model'!r} ({type(module).__name__}) cannot run on the "
                f"meta device ({type(e).__name__}: {e}), so what it writes is unknown. Fix: "
                "load the weights from a checkpoint instead (fastdist.checkpoint.load)"
            ) from e
        replaced = [
            n
            for n, t in original.tensors.items()
            for mod, attr, is_param in original.owners.get(n, [])
            if _slots(mod, is_param).get(attr) is not t
        ]
        if replaced:
            raise InitError(
                f"{what} of {name or 'the model'!r} replaces {listed(sorted(set(replaced)))} "
                "with new tensors instead of writing them in place (e.g. module.weight = "
                "nn.Parameter(...), or .data = ...), which cannot be done shard by shard. Fix: "
                "write in place (torch.nn.init.*_, tensor.copy_), or load a checkpoint"
            )
        first: dict[str, str] = {}
        for n, kind in recorder.events:
            first.setdefault(n, kind)
        writes = {n for n, kind in recorder.events if kind != "read"}
        if writes:
            needs = {n for n, kind in first.items() if kind != "full"}
            steps.append(Step(name, module, run, what, writes, needs, set(first)))
    return steps


# ============================================================================ running them
@contextmanager
def _seeded(seed: int, devices: Sequence[torch.device]) -> Iterator[None]:
    """The random generators of ``devices`` (and the CPU's) seeded with ``seed``, restored on
    exit."""
    accel = sorted({d for d in devices if d.type != "cpu"}, key=str)
    kinds = {d.type for d in accel}
    with ExitStack() as stack:
        for kind in kinds:
            indices = [d.index if d.index is not None else 0 for d in accel if d.type == kind]
            stack.enter_context(torch.random.fork_rng(devices=indices, device_type=kind))
        stack.enter_context(torch.random.fork_rng(devices=[]))
        torch.default_generator.manual_seed(seed)
        for d in accel:
            mod: Any = torch.get_device_module(d.type)
            with mod.device(d):
                mod.manual_seed(seed)
        yield


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` with its index (``"cuda"`` -> ``cuda:0`` on device 0); None: cpu."""
    return torch.empty(0, device=device or "cpu").device


Alloc = Callable[[str], tuple[torch.device, torch.dtype]]
Deliver = Callable[[str, Tensor], None]


def unwritten(steps: Sequence[Step], names: Sequence[str]) -> list[str]:
    """The ``names`` no init step writes."""
    written = {n for step in steps for n in step.writes}
    return [n for n in names if n not in written]


def run_inits(
    original: Original,
    steps: Sequence[Step],
    wanted: set[str],
    *,
    seed: int,
    alloc: Alloc,
    deliver: Deliver,
) -> None:
    """Run the init steps that ``wanted`` depends on, one at a time, each seeded with
    `module_seed`; hand each wanted tensor, whole, to ``deliver(name, tensor)`` after the last step
    that touches it, then free it.

    ``alloc(name)``: the (device, dtype) of a tensor's whole value while it is computed. Raises
    `InitError` (before any step runs) for a step that needs a value no earlier step computed
    (one the model had when it was built), and after a step that wrote a tensor its meta run did
    not show.
    """
    needed, chosen = set(wanted), []
    for step in reversed(steps):
        if step.writes & needed:
            chosen.append(step)
            needed |= step.needs
    chosen.reverse()
    seen: set[str] = set()
    for step in chosen:
        before = sorted(step.needs - seen)
        if before:
            raise InitError(
                f"{step.what} of {step.name or 'the model'!r} uses the values {listed(before)} "
                "had before any init wrote them (from when the model was built), which a model "
                "on the meta device never had. Fix: load these from a checkpoint "
                "(fastdist.checkpoint.load)"
            )
        seen |= step.touched
    last = {n: i for i, step in enumerate(chosen) for n in step.touched}
    numel = {n: t.numel() for n, t in original.tensors.items()}
    on_meta = original.storages(original.tensors)
    live: dict[str, Tensor] = {}
    for i, step in enumerate(chosen):
        for n in sorted(step.touched - live.keys()):
            live[n] = _empty_like_meta(original, n, *alloc(n))
        mine = {n: live[n] for n in step.touched}
        known = {**on_meta, **original.storages(mine)}
        recorder = _Recorder(known, numel)
        devices = [t.device for t in mine.values()]
        with original.holding(mine), _seeded(module_seed(seed, step.name), devices):
            with torch.no_grad(), recorder:
                step.run()
        stray = sorted({n for n, kind in recorder.events if n not in mine and kind != "read"})
        if stray:
            raise InitError(
                f"{step.what} of {step.name or 'the model'!r} wrote {listed(stray)} on real "
                "tensors but not on the meta copy (an init that branches on the device?), so "
                "they cannot be computed shard by shard. Fix: load a checkpoint"
            )
        for n in step.touched:
            if last[n] == i:
                whole = live.pop(n)
                if n in wanted:
                    deliver(n, whole.detach())
                del whole  # freed now, not when the next step's tensors already exist
        del mine, known, recorder


def _empty_like_meta(
    original: Original, name: str, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """Uninitialised storage for the whole of tensor ``name`` (its shape and strides), a parameter
    if it is one."""
    meta = original.tensors[name]
    t = torch.empty_strided(tuple(meta.shape), tuple(meta.stride()), dtype=dtype, device=device)
    return nn.Parameter(t, requires_grad=meta.requires_grad) if name in original.params else t


def _parallel_modules(model: nn.Module) -> list[str]:
    return [
        n
        for n, m in model.named_modules()
        if callable(getattr(m, "param_layouts", None)) or callable(getattr(m, "param_specs", None))
    ]


class ShardedModel(Protocol):
    """What `init_weights` needs of a parallel model (`fastdist.nn.ParallelModel`): its module
    (parameters holding shards), mesh, layouts, the meta copy of the single-device model, and the
    call guard to drop once nothing is left on the meta device."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def mesh(self) -> Mesh: ...

    @property
    def layouts(self) -> dict[str, Layout]: ...

    @property
    def simulated(self) -> bool: ...

    def original_for(self, what: str, error: type[Exception]) -> Original: ...

    def settle_meta(self) -> None: ...


_M = TypeVar("_M", bound="nn.Module | ShardedModel")


def init_weights(
    model: _M,
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> _M:
    """Initialise a model in place with its own init; tensors on the meta device get their storage
    here. Returns ``model``.

    Given a `fastdist.nn.ParallelModel`, each rank computes only its own shards' values: the
    single-device model's modules are initialised one at a time, each module's whole tensors exist
    only while its init runs, then each rank keeps its slices and the whole tensors are freed (the
    peak is one module's tensors, not the model's). Given a single-device model, its tensors are
    filled whole.

    Each module's own init runs once, children before parents: transformers' ``_init_weights``
    (of the nearest ``PreTrainedModel``), or ``reset_parameters`` in a model that is not a
    transformers model; each seeded with `module_seed` ``(seed, module name)`` on the generator of
    the tensors' device (the global generator is left as it was). Buffers an init writes are
    recomputed too (a rotary embedding's ``inv_freq``). The result is not the model's
    construction-time init (which draws from the global generator in module order), but depends on
    nothing but ``seed``, the model's structure, dtype and device.

    Args:
        model: a `fastdist.nn.ParallelModel`, or a single-device model (real tensors, on the meta
            device, or both).
        seed: the seed every module's seed derives from (the same on every rank).
        device: where tensors on the meta device get their storage (default cpu); the whole
            tensors are computed there too. Tensors that have storage stay where they are.
        dtype: the dtype of floating-point parameters on the meta device (default: their own).
            Buffers keep theirs.

    Raises `fastdist.nn.ParallelizeError` (before anything changes) for a parameter no init
    writes (it would keep what it had: nothing, on the meta device), a buffer on the meta device
    no init writes, an init that cannot run on the meta device or uses values from before any
    init; for a parallel model also for ``device``/``dtype`` with nothing on the meta device, and
    for the module of a parallel model passed on its own (pass the ``ParallelModel``).

    Exact: a parallel model's shards are bitwise slices of what the same seed gives the
    single-device model, for every init that writes in place with the random functions of the
    tensors' device, as transformers' ``_init_weights`` and torch's ``reset_parameters`` do
    (tested: Llama, GPT-2, Mixtral, ``nn.Linear``). The random streams of CPU and CUDA differ:
    compare on one device type, and in one dtype.

    >>> import torch, fastdist as fd
    >>> with torch.device("meta"):
    ...     net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    >>> fd.nn.init_weights(net, seed=1)[0].weight.device
    device(type='cpu')
    """
    if isinstance(model, nn.Module):
        _init_single(model, seed, device, dtype)
    else:
        _init_shards(model, seed, device, dtype)
    return model


def _init_single(
    model: nn.Module, seed: int, device: torch.device | str | None, dtype: torch.dtype | None
) -> None:
    """`init_weights` of a single-device model."""
    parallel = _parallel_modules(model)
    if parallel:
        raise ParallelizeError(
            f"fastdist.nn.init_weights: {type(model).__name__} holds per-rank parameters "
            f"({parallel[:3]}): it is the module of a parallel model. Fix: pass the "
            "ParallelModel itself, fastdist.nn.init_weights(pm, seed=...)"
        )
    try:
        original = Original.of(model)
        steps = init_steps(original)
    except InitError as e:
        raise ParallelizeError(f"fastdist.nn.init_weights: {e}") from e
    own: dict[str, Tensor] = dict(model.named_parameters())
    own.update((n, b) for n, b in model.named_buffers() if n not in own)
    missing = unwritten(steps, sorted(original.params))
    lost = [
        n
        for n in unwritten(steps, sorted(set(original.tensors) - original.params))
        if own[n].is_meta
    ]
    if missing or lost:
        raise ParallelizeError(
            f"fastdist.nn.init_weights: no init of {type(model).__name__} writes "
            f"{listed(missing + lost)}. Fix: give their modules an init (a branch of "
            "_init_weights, or reset_parameters), or load them from a checkpoint"
        )
    buffers = set(original.tensors) - original.params
    wanted = original.params | (buffers - set(unwritten(steps, sorted(buffers))))

    def alloc(n: str) -> tuple[torch.device, torch.dtype]:
        t = own.get(n)
        if t is None or t.is_meta:
            floating = t is not None and n in original.params and t.is_floating_point()
            meta = original.tensors[n]
            return resolve_device(device), (dtype if floating and dtype else meta.dtype)
        return t.device, t.dtype

    def deliver(n: str, whole: Tensor) -> None:
        t = own[n]
        if t.is_meta:
            materialize_(t, whole.device, whole.dtype)
        with torch.no_grad():
            t.copy_(whole)

    try:
        run_inits(original, steps, wanted, seed=seed, alloc=alloc, deliver=deliver)
    except InitError as e:
        raise ParallelizeError(f"fastdist.nn.init_weights: {e}") from e


def _init_shards(
    pm: ShardedModel, seed: int, device: torch.device | str | None, dtype: torch.dtype | None
) -> None:
    """`init_weights` of a parallel model: each rank computes only its own shards' values."""
    what = "fastdist.nn.init_weights"
    if (device is not None or dtype is not None) and not meta_names(pm.module):
        raise ParallelizeError(
            f"{what}: device={device!r} / dtype={dtype!r} choose where tensors on the meta "
            f"device get their storage, but {type(pm.module).__name__} has none on the meta "
            "device. Fix: drop them (tensors with storage are initialised where they are)"
        )
    original = pm.original_for(what, ParallelizeError)
    try:
        steps = init_steps(original)
    except InitError as e:
        raise ParallelizeError(f"{what}: {e}") from e
    params = dict(pm.module.named_parameters())
    buffers = {n: b for n, b in pm.module.named_buffers() if n not in params}
    known = [n for n in buffers if n in original.tensors]
    written = set(known) - set(unwritten(steps, known))
    missing = [n for n in params if n not in original.params]
    missing += unwritten(steps, [n for n in params if n in original.params])
    missing += [n for n, b in buffers.items() if b.is_meta and n not in written]
    if missing:
        raise ParallelizeError(
            f"{what}: no init of {type(pm.module).__name__} writes "
            f"{listed(missing)}. Fix: give their modules an init (a branch of "
            "_init_weights, or reset_parameters), or load them from a checkpoint "
            "(fastdist.checkpoint.load)"
        )
    dev = resolve_device(device)
    mesh, simulated = pm.mesh, pm.simulated

    def alloc(n: str) -> tuple[torch.device, torch.dtype]:
        t = params.get(n, buffers.get(n))
        meta = original.tensors[n]
        if t is None or t.is_meta:
            floating = n in params and meta.is_floating_point()
            return dev, dtype if dtype is not None and floating else meta.dtype
        return t.device, t.dtype

    def deliver(n: str, whole: Tensor) -> None:
        t = params.get(n, buffers.get(n))
        assert t is not None
        if t.is_meta:
            materialize_(t, whole.device, whole.dtype)
        with torch.no_grad():
            if n not in params:
                t.copy_(whole)
                return
            layout, shape = pm.layouts[n], tuple(whole.shape)
            for r in range(mesh.size) if simulated else (mesh.rank,):
                block = layout.read(lambda s: whole[s], shape, mesh, r, n)
                (t[r] if simulated else t).copy_(block)

    try:
        run_inits(original, steps, set(params) | written, seed=seed, alloc=alloc, deliver=deliver)
    except InitError as e:
        raise ParallelizeError(f"{what}: {e}") from e
    pm.settle_meta()
