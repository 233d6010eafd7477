"""Data parallelism over a mesh's data axes: fastdist's own gradient reduction, and the way a
`fastdist.nn.ParallelModel` composes with torch's DDP and FSDP2.

**The rule.** Every data rank (each index along the data axes, e.g. ``dp``) runs its own batch
and its own loss ``L_r``. The single-device model trained on the concatenated batch with the
mean loss ``(1/D) sum_r L_r`` (``D`` = the product of the data axes' sizes) has gradient
``(1/D) sum_r dL_r/dw``. So a parameter's gradient is **summed over the data axes it is not
split over, then divided by D**:

* a parameter replicated over the data axes (attention, norms, the embedding): the mean over
  data ranks, as DDP computes it;
* a parameter split over a data axis (MoE experts over ``ep`` when tokens differ across
  ``ep``): its owner already holds the sum over that axis' tokens (the all-to-all's backward
  summed them), so it is summed over the *other* data axes only, and still divided by D.

A loss that weights ranks unequally (a token mean with different numbers of ``-100`` labels
per rank) is not the mean of the per-rank losses: scale each rank's loss to
``sum_of_its_token_losses * D / global_token_count`` (transformers' ``num_items_in_batch``
with the global count, times D) so that the mean is right.

`DataParallel` reduces as each gradient becomes ready during backward
(post-accumulate-grad hooks): on a simulated mesh each stacked gradient is reduced in place at
once; on real ranks gradients are packed into buckets that are all-reduced asynchronously,
in the same order on every rank, while backward goes on, and the end of backward waits for
them. ``no_sync()`` skips the reduction for gradient accumulation (the next synced backward
reduces the accumulated sum: the reduction is linear).

Buffers (``broadcast_buffers=True``, as torch's DDP): a buffer a forward updates from its own
batch (BatchNorm's running statistics) would differ on every data rank, and the ranks' models
would give different outputs in eval mode. Like DDP, at the start of a forward that follows a
forward run with grad enabled outside ``no_sync`` (and at the first forward), the persistent
floating-point buffers of the data group's first rank (index 0 along the data axes) are
broadcast to the others, in one coalesced broadcast (`state_buffers` says which; a model
without any, such as a transformers LLM, whose rotary ``inv_freq`` is non-persistent, costs no
collective).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from fastdist.comm.connect import to_device_mesh
from fastdist.core.mesh import AxisName, Mesh
from fastdist.errors import MeshError, PipelineError
from fastdist.nn.optim_guard import refuse_replaced_in_optimizers
from fastdist.nn.parallelize import ParallelModel
from fastdist.nn.state import Layout, module_and_mesh, param_layouts
from fastdist.train.pipeline import Pipeline
from fastdist.train.pipeline.split import hand_on_last

__all__ = ["DataParallel", "reduce_axes", "data_axes", "state_buffers", "ENGINES"]

#: the engines `DataParallel` attaches: fastdist's own reduction, torch's DDP, FSDP2
ENGINES = ("fastdist", "ddp", "fsdp")

#: the op name errors on real ranks give (fastdist.<op>)
_OP = "train.DataParallel"
_REENTRANT = (
    "fastdist.train.DataParallel: a backward ran inside another one (reentrant activation "
    "checkpointing?); the reduction would end with the inner one. Fix: non-reentrant "
    "checkpointing (use_reentrant=False; in transformers gradient_checkpointing_enable("
    'gradient_checkpointing_kwargs={"use_reentrant": False}))'
)


def data_axes(axis: AxisName, mesh: Mesh, op: str) -> tuple[str, ...]:
    """``axis`` (an axis name or a sequence of them) as a tuple in the mesh's axis order; raises
    naming ``op`` for an axis the mesh lacks."""
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    mesh.axis_indices(names, op)  # raises naming the axis and the mesh's axes
    order = {a: i for i, a in enumerate(mesh.axis_names)}
    return tuple(sorted(names, key=order.__getitem__))


def reduce_axes(layout: Layout, data_axes: Sequence[str]) -> tuple[str, ...]:
    """The data axes a parameter with ``layout`` is summed over: those it is not split over.

    Args:
        layout: the parameter's ``Layout``.
        data_axes: the data-parallel axes of the mesh.

    Returns:
        the data axes the parameter is not split over, which its gradient is summed over.
    """
    return tuple(a for a in data_axes if a not in layout.split_axes)


@dataclass
class _Bucket:
    """Parameters whose gradients are all-reduced together (real ranks): same axes, dtype,
    device."""

    axes: tuple[str, ...]
    params: list[nn.Parameter]
    ready: set[int] = field(default_factory=set)
    work: Any = None
    flat: Tensor | None = None


class DataParallel:
    """Reduce a parallel model's gradients over the data axes during backward.

    Args:
        model: a `fastdist.nn.ParallelModel` (or an ``nn.Module`` with ``mesh=``), on a
            simulated mesh or on real ranks, with real (not meta) parameters. Its parameters'
            `Layout` tells which data axes each one is split over (the module docstring's rule).
        axis: the data axis or axes (default ``"dp"``): each index along them runs its own batch.
        mesh: the mesh, when ``model`` is a plain module.
        bucket_mb: on real ranks, the size of a bucket of gradients all-reduced at once (MiB).
        engine: ``"fastdist"`` (this reducer, simulated and real ranks; a `Pipeline`: one per
            stage held here, reduced in the backward of each stage's last micro-batch);
            ``"ddp"``: torch's ``DistributedDataParallel`` over the mesh's data group (real
            ranks); ``"fsdp"``: FSDP2 ``fully_shard`` over the data axis, each block (the
            model's ``_no_split_modules`` classes, or ``blocks=[class names]``) then the root,
            as torchtitan builds a 2-D TP x FSDP model (real ranks; a `Pipeline`: each stage held
            here, over the data axis of the whole job's DeviceMesh, synced in the backward of
            the stage's last micro-batch; not with tied embeddings across stages). With torch's
            engines, calls of the `fastdist.nn.ParallelModel` go through their wrapper
            (`wrapped`). DDP is refused under a pipeline.
        broadcast_buffers: as DDP's (default ``True``): at the start of a forward that follows a
            forward run with grad enabled outside `no_sync` (and at the first), the data group's
            first rank's persistent floating-point buffers (BatchNorm's running statistics;
            `state_buffers`) are broadcast to the other data ranks (`sync_buffers`), so every
            rank's model is rank 0's, in eval mode too. ``False``: each rank keeps the buffers
            its own batches gave (they differ).
            With ``engine="ddp"``: DDP's own (``forward_sync_buffers``); with ``"fsdp"`` (which
            leaves buffers alone) this reducer's broadcast. Simulated ranks hold one copy of each
            buffer for every rank: nothing to broadcast.
        **engine_kwargs: torch's engines' keywords (DDP's; ``fully_shard``'s and ``blocks=``).

    Every engine gives each rank the single-device gradient of the mean of the data ranks'
    losses; ``pm.grads()``, ``pm.state_dict()`` and `fastdist.nn.clip_grad_norm_` understand
    their parameters (FSDP2's DTensors too).

    After each ``backward`` (outside `no_sync`) every rank's ``.grad`` holds the gradient the
    single-device model would have for the mean of every data rank's loss, added to what
    ``.grad`` held before (gradients accumulate as on one device). What is reduced is what
    each parameter received since its last reduction, including inside `no_sync`. A parameter
    that got a gradient on no rank keeps ``grad=None`` (as on one device); one that got a
    gradient on some ranks only gets the reduced gradient everywhere.

    Not supported, and refused with an error rather than computed wrong: a second reducer or
    engine on the same model, a parameter that starts requiring grad after construction, and a
    backward inside a backward (reentrant activation checkpointing: use
    ``use_reentrant=False``).

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"dp": 2})
    >>> lin = torch.nn.Linear(3, 1, bias=False)
    >>> pm = fd.nn.parallelize(lin, mesh, {})               # replicated over dp: [2, 1, 3]
    >>> dp = fd.train.DataParallel(pm, "dp")
    >>> x = torch.tensor([[[1.0, 0, 0]], [[0, 1.0, 0]]])    # each dp rank its own batch
    >>> pm(x).sum().backward()
    >>> lin.weight.grad                                      # the mean: the same on both ranks
    tensor([[[0.5000, 0.5000, 0.0000]],
    <BLANKLINE>
            [[0.5000, 0.5000, 0.0000]]])
    """

    def __init__(
        self,
        model: ParallelModel | nn.Module | Pipeline,
        axis: AxisName = "dp",
        *,
        mesh: Mesh | None = None,
        bucket_mb: float = 25.0,
        engine: str = "fastdist",
        broadcast_buffers: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        op = f"fastdist.train.DataParallel(engine={engine!r})"
        if engine not in ENGINES:
            raise MeshError(f"{op}: engine must be one of {ENGINES}")
        if not isinstance(broadcast_buffers, bool):
            raise MeshError(f"{op}: broadcast_buffers={broadcast_buffers!r} must be True or False")
        self.broadcast_buffers = broadcast_buffers
        # a buffer broadcast is due at the next forward (DDP's require_forward_param_sync)
        self._buffers_due = True
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise MeshError(f"{op}: bucket_mb={bucket_mb!r} must be a positive number of MiB")
        self.engine = engine
        # torch's DDP / FSDP2 module that calls of the model go through (torch's engines)
        self.wrapped: nn.Module | None = None
        # one reducer per pipeline stage held here (a fastdist.train.Pipeline)
        self.parts: list[DataParallel] = []
        self._handles: list[Any] = []
        self._sync = True
        self._task: int | None = None
        if isinstance(model, Pipeline):
            engine_kwargs["broadcast_buffers"] = broadcast_buffers
            self._attach_stages(model, axis, bucket_mb, engine, engine_kwargs)
            return
        module, mesh = module_and_mesh(model, mesh, op)
        self.module, self.mesh = module, mesh
        if engine != "fastdist":
            if engine == "ddp" and not broadcast_buffers:  # DDP's default broadcasts them
                # (torch 2.13's name for broadcast_buffers; it still syncs at construction)
                engine_kwargs["forward_sync_buffers"] = False
            self._attach_torch(model, axis, engine_kwargs, op)
            if engine == "fsdp":  # FSDP2 leaves buffers alone: broadcast them here
                self._handles.append(module.register_forward_pre_hook(self._on_forward))
            return
        if engine_kwargs:
            raise MeshError(
                f"{op}: {sorted(engine_kwargs)} are keywords of torch's engines; fastdist's "
                "takes bucket_mb=. Fix: drop them, or engine='ddp' / 'fsdp'"
            )
        self._attach_reducer(model, module, mesh, axis, bucket_mb, op)

    def _attach_reducer(
        self,
        model: Any,
        module: nn.Module,
        mesh: Mesh,
        axis: AxisName,
        bucket_mb: float,
        op: str,
    ) -> None:
        """fastdist's own reduction: hooks on every parameter, buckets on real ranks."""
        refuse_second_engine(model, module, op)
        refuse_meta(module, op)
        self.axes = data_axes(axis, mesh, op)
        self.size = math.prod(mesh.axis_size(a) for a in self.axes)
        layouts = param_layouts(module)
        self._axes_of = {
            id(p): reduce_axes(layouts.get(n, Layout()), self.axes)
            for n, p in module.named_parameters()
        }
        self._names = {id(p): n for n, p in module.named_parameters()}
        #: parameters that received gradient since their last reduction; for those not summed
        #: over every data axis, what they received (their .grad may hold more: see _partial)
        self._pending: dict[int, Tensor | None] = {}
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        self._next = 0  # the next bucket to launch (real ranks: buckets go out in order)
        params = [p for p in module.parameters() if p.requires_grad]
        self._params = {id(p): p for p in params}
        if mesh.backend is not None:
            self._make_buckets(params, bucket_mb)
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook)  # type: ignore[no-untyped-call]
            for p in params
        ]
        receivers = [p for p in params if self._partial(p)]
        self._handles += [p.register_hook(self._receiver(p)) for p in receivers]  # type: ignore[no-untyped-call]
        self._handles.append(module.register_forward_pre_hook(self._on_forward))
        self._owner = model
        module._fastdist_data_parallel = self.axes  # type: ignore[assignment]
        if hasattr(model, "engine"):
            model.engine = self

    def _attach_stages(
        self,
        pipe: Pipeline,
        axis: AxisName,
        bucket_mb: float,
        engine: str,
        engine_kwargs: dict[str, Any],
    ) -> None:
        """A pipeline: one reducer per stage held here. A step reduces once per stage, in the
        backward of the stage's last micro-batch (the earlier ones run under the stage's
        ``no_sync``)."""
        op = f"fastdist.train.DataParallel(engine={engine!r})"
        if engine == "ddp":
            engine_kwargs.pop("broadcast_buffers")
            raise PipelineError(
                f"{op}: not supported under a pipeline (DDP prepares each forward's reduction "
                "for the next backward, and 1F1B runs several forwards before their backwards). "
                "Fix: engine='fastdist', or engine='fsdp'"
            )
        self.mesh, self.axes = pipe.mesh, data_axes(axis, pipe.mesh, "fastdist.train.DataParallel")
        if engine == "fsdp":
            self.parts = self._fsdp_stages(pipe, axis, engine_kwargs, op)
            return
        self.parts = [
            DataParallel(pipe.stages[j], axis, bucket_mb=bucket_mb, **engine_kwargs)
            for j in sorted(pipe.stages)
        ]

    def _fsdp_stages(
        self, pipe: Pipeline, axis: AxisName, engine_kwargs: dict[str, Any], op: str
    ) -> list[DataParallel]:
        """FSDP2 on every stage held here (real ranks), over the data axis of the whole job's
        DeviceMesh (a stage's mesh is a slice of it); each stage's hand-on hook then moved
        behind FSDP2's post-forward hooks."""
        if pipe.simulated:
            raise MeshError(
                f"{op}: torch's FSDP2 needs real ranks (a process group); this mesh is "
                "simulated. Fix: engine='fastdist' (the same gradients), or build the mesh with "
                "fastdist.connect"
            )
        if pipe.tied:
            raise PipelineError(
                f"{op}: the tied weights {sorted(pipe.tied.values())} would be FSDP2 shards on "
                "two stages, and the pipeline sums the two copies' gradients as whole tensors; "
                "this is not built. Fix: engine='fastdist'"
            )
        device = next(pipe.parameters()).device
        job = to_device_mesh(pipe.mesh, device.type)
        parts = [
            DataParallel(pipe.stages[j], axis, engine="fsdp", device_mesh=job, **engine_kwargs)
            for j in sorted(pipe.stages)
        ]
        for j in sorted(pipe.stages):
            hand_on_last(pipe.stages[j].module)
        return parts

    def _attach_torch(
        self, model: Any, axis: AxisName, engine_kwargs: dict[str, Any], op: str
    ) -> None:
        """torch's DDP or FSDP2 over the data axis: calls of the model go through its wrapper."""
        if not isinstance(model, ParallelModel):
            raise MeshError(f"{op}: torch's engines wrap a fastdist.nn.ParallelModel")
        refuse_second_engine(model, model.module, op)
        if model.simulated:
            raise MeshError(
                f"{op}: torch's {self.engine.upper()} needs real ranks (a process group); this "
                "mesh is simulated. Fix: engine='fastdist' (the same gradients, on simulated and "
                "real ranks), or build the mesh with fastdist.connect"
            )
        self.axes = data_axes(axis, model.mesh, op)
        attach = ddp if self.engine == "ddp" else fsdp
        self.wrapped = attach(model, axis, **engine_kwargs)
        self._owner = model
        model.engine, model.wrapped = self, self.wrapped

    # ------------------------------------------------------------------ user API
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the reduction inside (gradient accumulation): gradients accumulate per rank; the
        first backward after the block reduces everything received since the last reduction.
        With torch's engines: DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``."""
        if self.parts:
            with contextlib.ExitStack() as stack:
                for part in self.parts:
                    stack.enter_context(part.no_sync())
                yield
            return
        if self.engine == "ddp":
            with self.wrapped.no_sync():  # type: ignore[union-attr, operator]
                yield
            return
        if self.engine == "fsdp":
            self.wrapped.set_requires_gradient_sync(False)  # type: ignore[union-attr, operator]
            before, self._sync = self._sync, False
            try:
                yield
            finally:
                self._sync = before
                self.wrapped.set_requires_gradient_sync(True)  # type: ignore[union-attr, operator]
            return
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def remove(self) -> None:
        """Stop reducing: remove the hooks (waits for reductions in flight first) and detach from
        the model (another engine may be attached afterwards). Torch's engines cannot be
        removed (their wrappers own the model)."""
        if self.engine != "fastdist":
            raise MeshError(
                f"fastdist.train.DataParallel(engine={self.engine!r}).remove: torch's wrapper owns "
                "the model's parameters. Fix: build a fresh model"
            )
        for part in self.parts:
            part.remove()
        if self.parts:
            return
        self.finish()
        for h in self._handles:
            h.remove()
        self._handles = []
        self.module._fastdist_data_parallel = None  # type: ignore[assignment]
        if getattr(self._owner, "engine", None) is self:
            self._owner.engine = None

    def unreduced(self) -> list[str]:
        """Names of the parameters whose gradients were received under `no_sync` and not reduced
        yet (the last backward ran inside ``no_sync``): stepping or clipping now would use each
        rank's own gradient. Empty after every synced backward; always empty with torch's
        engines (their state is not visible here)."""
        if self.parts:
            return [n for part in self.parts for n in part.unreduced()]
        if self.engine != "fastdist" or self._task is not None:  # torch's, or inside backward
            return []
        return [self._names[i] for i in self._pending]

    def finish(self) -> None:
        """Reduce everything received since the last reduction and write the gradients (called
        at the end of every synced backward; safe to call again)."""
        if self._task is None:
            return  # no synced backward since the last finish
        if torch._C._current_autograd_node() is not None:  # inside another backward's node
            self._reset()
            raise MeshError(_REENTRANT)
        try:
            stray = [
                n
                for n, p in self.module.named_parameters()
                if p.grad is not None and id(p) not in self._params
            ]
            if stray:
                raise MeshError(
                    f"fastdist.train.DataParallel: {stray[:3]} got gradients but did not require "
                    "grad when the reducer was built, so nothing reduces them. Fix: build "
                    "DataParallel after choosing which parameters train (or .remove() and build "
                    "it again)"
                )
            if self.mesh.backend is None:
                for i in list(self._pending):
                    self._reduce_simulated(self._params[i])
            else:
                for i in range(self._next, len(self._buckets)):
                    self._launch(i)  # every rank launches every bucket, in order
                for b in self._buckets:
                    if b.work is not None:
                        self._wait(b)
        finally:
            self._next = 0
            self._task = None

    def __repr__(self) -> str:
        if self.parts:
            return f"DataParallel(axes={self.axes}, {len(self.parts)} pipeline stages)"
        if self.engine != "fastdist":
            return f"DataParallel(engine={self.engine!r}, axes={self.axes}, {self.mesh!r})"
        kind = "simulated" if self.mesh.backend is None else f"{len(self._buckets)} buckets"
        return f"DataParallel(axes={self.axes}, {self.mesh!r}, {kind})"

    # ------------------------------------------------------------------ the hooks
    def _partial(self, p: Tensor) -> bool:
        """Summed over fewer than all data axes: its .grad may already hold a reduced part that
        must not be summed again, so what it receives is kept apart until reduced."""
        return len(self._axes_of[id(p)]) < len(self.axes)

    def _receiver(self, p: Tensor) -> Any:
        def receive(g: Tensor) -> None:
            got = self._pending.get(id(p))
            self._pending[id(p)] = g.detach().clone() if got is None else got.add_(g)

        return receive

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        """A new step (outside any backward): a backward that raised half-way (and was caught) left
        buckets in flight; wait for them and start clean (what it received stays unreduced).
        Then the buffers, as DDP: broadcast when the last forward ran with grad enabled outside
        `no_sync` (or this is the first)."""
        if getattr(self, "_task", None) is not None and torch._C._current_graph_task_id() == -1:
            self._reset()
        if self.broadcast_buffers and self._buffers_due:
            self.sync_buffers()
        self._buffers_due = torch.is_grad_enabled() and self._sync

    def sync_buffers(self) -> None:
        """Copy the model's `state_buffers` (persistent floating-point buffers) of the data
        group's first rank (index 0 along the data axes) to every rank of the group: one
        broadcast of their bytes per device (usually one), none when the model has no such
        buffer or the group is one rank. A simulated mesh holds one copy of each buffer for
        every rank: nothing to do.
        Called at the start of a forward when due (``broadcast_buffers=True``); call it yourself
        to make the buffers agree now (before `fastdist.checkpoint.save`, or with
        ``broadcast_buffers=False``). On real ranks a **collective** over the data axes."""
        if self.parts:
            for part in self.parts:
                part.sync_buffers()
            return
        if self.mesh.backend is None:
            return
        buffers = state_buffers(self.module)
        if not buffers or math.prod(self.mesh.axis_size(a) for a in self.axes) == 1:
            return
        from fastdist.comm.axes import axis_comm

        ac = axis_comm(self.mesh, self.axes, _OP)
        by_device: dict[torch.device, list[Tensor]] = {}
        for b in buffers:
            by_device.setdefault(b.device, []).append(b)
        keep = torch.autograd.grad_mode._unsafe_preserve_version_counter  # as DDP's sync
        with torch.no_grad(), keep(tuple(buffers)):
            for group in by_device.values():
                # widest dtype first: each buffer's bytes start at a multiple of its item size
                group.sort(key=lambda b: -b.element_size())
                flat = torch.cat(
                    [b.detach().contiguous().view(-1).view(torch.uint8) for b in group]
                )
                got = ac.broadcast(_OP, flat, 0)  # the group's first rank's bytes
                offset = 0
                for b in group:
                    n = b.numel() * b.element_size()
                    b.copy_(got[offset : offset + n].view(b.dtype).view(b.shape))
                    offset += n

    def _reset(self) -> None:
        """Drop a reduction that cannot finish: wait for buckets in flight (every rank launched
        them), forget what was received."""
        for b in self._buckets:
            if b.work is not None:
                self._wait(b, write=False)
            b.ready.clear()
        self._next, self._task = 0, None
        self._pending.clear()

    def _hook(self, p: Tensor) -> None:
        if p.grad is None:
            return
        self._pending.setdefault(id(p), None)
        if not self._sync:
            return
        task = torch._C._current_graph_task_id()
        if self._task is None:
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        elif task != self._task:
            raise MeshError(_REENTRANT)
        if self.mesh.backend is None:
            self._reduce_simulated(p)
            return
        b = self._buckets[self._bucket_of[id(p)]]
        b.ready.add(id(p))
        while self._next < len(self._buckets) and len(self._buckets[self._next].ready) == len(
            self._buckets[self._next].params
        ):
            self._launch(self._next)

    def _reduce_simulated(self, p: Tensor) -> None:
        """A stacked gradient ``[world, *local]``: what it received since its last reduction,
        summed over its axes (every rank of a group gets the group's sum) and divided by D."""
        received = self._pending.pop(id(p))
        g = p.grad
        assert g is not None
        with torch.no_grad():
            part = g if received is None else received
            axes = self._axes_of[id(p)]
            dims = [self.mesh.axis_names.index(a) for a in axes]
            # [world, *local] -> [*mesh sizes, *local]: one dim per mesh axis
            grid = part.reshape(*self.mesh.shape.values(), *g.shape[1:])
            summed = grid.sum(dim=dims, keepdim=True) if dims else grid
            reduced = summed.div(self.size).expand_as(grid).reshape(g.shape)
            if received is None:
                g.copy_(reduced)
            else:  # .grad = what it held before + the reduced part
                g.sub_(received).add_(reduced)

    # ------------------------------------------------------------------ real ranks
    def _make_buckets(self, params: list[nn.Parameter], bucket_mb: float) -> None:
        """Buckets in reverse registration order (roughly the order backward produces them)."""
        cap = int(bucket_mb * 2**20)
        current: dict[tuple[Any, ...], int] = {}  # key -> index of its open bucket
        used: dict[int, int] = {}  # bucket index -> bytes
        for p in reversed(params):
            key = (self._axes_of[id(p)], p.dtype, p.device)
            nbytes = p.numel() * p.element_size()
            i = current.get(key)
            if i is None or used[i] + nbytes > cap:
                i = current[key] = len(self._buckets)
                self._buckets.append(_Bucket(key[0], []))
                used[i] = 0
            self._buckets[i].params.append(p)
            used[i] += nbytes
            self._bucket_of[id(p)] = i

    def _launch(self, i: int) -> None:
        """Pack bucket ``i`` (what each parameter received since its last reduction: its grad, or
        the part kept apart; zeros and a 0 flag where nothing) and start its all-reduce."""
        from fastdist.comm.axes import axis_comm

        b = self._buckets[i]
        b.ready.clear()
        self._next = max(self._next, i + 1)
        pieces, flags = [], []
        for p in b.params:
            # summed over every data axis: the whole .grad (a part reduced before is the same on
            # every rank and stays itself in the mean); otherwise only what it received
            part = self._pending.get(id(p)) if self._partial(p) else p.grad
            pieces.append(part.detach().reshape(-1) if part is not None else p.new_zeros(p.numel()))
            flags.append(id(p) in self._pending)
        flag = torch.tensor(flags, dtype=b.params[0].dtype, device=pieces[0].device)
        b.flat = torch.cat([*pieces, flag])
        if not b.axes:  # split over every data axis: nothing to sum, only the 1/D
            self._write(b)
            return
        flat = b.flat
        ac = axis_comm(self.mesh, b.axes, _OP)
        b.work = ac.all_reduce_async(_OP, flat, what="the gradient all-reduce")

    def _wait(self, b: _Bucket, write: bool = True) -> None:
        b.work.wait()
        b.work = None
        if write:
            self._write(b)
        b.flat = None

    def _write(self, b: _Bucket) -> None:
        """Unpack a reduced bucket into the gradients (divided by D)."""
        flat = b.flat
        assert flat is not None
        n = len(b.params)
        flat[:-n].div_(self.size)
        got = (flat[-n:] != 0).tolist()  # some rank received a gradient
        offset = 0
        for p, any_rank in zip(b.params, got):
            piece = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            received = self._pending.pop(id(p), None)
            if not any_rank:
                continue  # nothing new anywhere: .grad stays as it is
            if p.grad is None:
                p.grad = piece.clone()
            elif not self._partial(p):
                p.grad.copy_(piece)
            else:  # .grad = what it held before + the reduced part of what it received
                (p.grad.sub_(received) if received is not None else p.grad).add_(piece)
        b.flat = None


def state_buffers(module: nn.Module) -> list[Tensor]:
    """The buffers `DataParallel` broadcasts: persistent (in the state dict) and floating-point,
    not on the meta device, each once. A forward may update them from its own batch (BatchNorm's
    running statistics, an EMA). Left alone, unlike DDP: integer buffers (BatchNorm's
    ``num_batches_tracked``: every rank counts the same steps), and non-persistent ones, which
    are not the model's state but constants the model computes (rotary ``inv_freq``, masks:
    the same on every rank) or a rank's own (a cache of its batch, which rank 0's must not
    overwrite).

    >>> bn = torch.nn.BatchNorm1d(2)
    >>> bn.register_buffer("inv_freq", torch.ones(2), persistent=False)
    >>> [b is bn.running_mean or b is bn.running_var for b in state_buffers(bn)]
    [True, True]
    """
    seen: set[int] = set()
    out = []
    for m in module.modules():
        for name, b in m.named_buffers(recurse=False):
            keep = name not in m._non_persistent_buffers_set and b.is_floating_point()
            if keep and not b.is_meta and id(b) not in seen:
                seen.add(id(b))
                out.append(b)
    return out


def refuse_second_engine(model: Any, module: nn.Module, op: str) -> None:
    """A model reduces its gradients through one engine only (two would reduce twice)."""
    engine = getattr(model, "engine", None)
    axes = getattr(module, "_fastdist_data_parallel", None)
    if engine is not None or axes is not None:
        raise MeshError(
            f"{op}: {type(module).__name__} already runs data-parallel "
            f"({engine if engine is not None else axes!r}); a second engine would reduce its "
            "gradients twice. Fix: one engine per model (.remove() a DataParallel first)"
        )


def refuse_meta(module: nn.Module, op: str) -> None:
    """Hooks on meta parameters would be lost when they get storage (`fastdist.checkpoint.load`,
    `fastdist.nn.init_weights`)."""
    meta = [n for n, p in module.named_parameters() if p.is_meta]
    if meta:
        raise MeshError(
            f"{op}: {meta[:3]} are on the meta device; their storage (fastdist.checkpoint.load or "
            "fastdist.nn.init_weights) replaces the tensors this would hook. Fix: materialize the "
            "model first, then attach data parallelism"
        )


# ============================================================================ torch's engines
def ddp(pm: ParallelModel, axis: AxisName = "dp", **kwargs: Any) -> nn.Module:
    """Wrap ``pm.module`` in ``torch.nn.parallel.DistributedDataParallel`` over the mesh's data
    group (real ranks). See `DataParallel`."""
    from torch.nn.parallel import DistributedDataParallel

    from fastdist.comm.axes import axis_comm

    op = "fastdist.train.DataParallel(engine='ddp')"
    refuse_meta(pm.module, op)
    axes = data_axes(axis, pm.mesh, op)
    _refuse_split_over(pm, axes, op)
    ac = axis_comm(pm.mesh, axes, op)
    device = next(pm.module.parameters()).device
    group = ac.process_group(op, device.type)
    wrapped = DistributedDataParallel(pm.module, process_group=group, **kwargs)
    pm.module._fastdist_data_parallel = axes  # type: ignore[assignment]
    return wrapped


def fsdp(
    pm: ParallelModel,
    axis: AxisName = "dp",
    blocks: Sequence[str] | None = None,
    device_mesh: Any = None,
    **kwargs: Any,
) -> nn.Module:
    """Shard ``pm.module`` over the mesh's data axis with FSDP2 ``fully_shard``: each block, then
    the root, as torchtitan does (real ranks). ``device_mesh``: the whole job's DeviceMesh
    when ``pm.mesh`` is a slice of it (a pipeline stage's). See `DataParallel`."""
    from torch.distributed.fsdp import fully_shard

    op = "fastdist.train.DataParallel(engine='fsdp')"
    refuse_meta(pm.module, op)
    axes = data_axes(axis, pm.mesh, op)
    if len(axes) != 1:
        raise MeshError(f"{op}: FSDP2 shards over one mesh axis here; got {axes}")
    _refuse_split_over(pm, axes, op)
    device = next(pm.module.parameters()).device
    dm = (device_mesh if device_mesh is not None else to_device_mesh(pm.mesh, device.type))[axes[0]]
    kinds = set(
        blocks if blocks is not None else getattr(pm.module, "_no_split_modules", None) or ()
    )
    wrapped = [m for m in pm.module.modules() if type(m).__name__ in kinds and m is not pm.module]
    if blocks is not None and not wrapped:
        raise MeshError(
            f"{op}: no module of {type(pm.module).__name__} is of a class in blocks={list(kinds)}. "
            "Fix: name the decoder block classes (e.g. ['LlamaDecoderLayer'])"
        )
    before = dict(pm.module.named_parameters())
    for m in wrapped:
        fully_shard(m, mesh=dm, **kwargs)
    fully_shard(pm.module, mesh=dm, **kwargs)
    pm.module._fastdist_data_parallel = axes  # type: ignore[assignment]
    refuse_replaced_in_optimizers(
        before,
        dict(pm.module.named_parameters()),
        op,
        "FSDP2's fully_shard replaced them with DTensor shards",
        "build the optimizer after DataParallel(..., engine='fsdp'), over pm.parameters()",
    )
    return pm.module


def _refuse_split_over(pm: ParallelModel, axes: tuple[str, ...], op: str) -> None:
    """DDP and FSDP2 average every gradient over the data group: a parameter split over a data
    axis (experts over ep as a data axis) needs fastdist's own rule."""
    split = [n for n, lay in pm.layouts.items() if reduce_axes(lay, axes) != axes]
    if split:
        raise MeshError(
            f"{op}: parameters {split[:3]} are split over the data axes {axes}; torch's engines "
            "would average them with other ranks' different shards. Fix: engine='fastdist' "
            "(which sums them over the other data axes only)"
        )
