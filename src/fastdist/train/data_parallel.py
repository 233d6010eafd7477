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
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..errors import MeshError
from ..mesh import AxisName, Mesh
from ..nn.state import Layout, param_layouts

if TYPE_CHECKING:
    from ..nn.parallelize import ParallelModel

__all__ = ["DataParallel", "reduce_axes"]

#: the op name errors on real ranks give (fastdist.<op>)
_OP = "train.DataParallel"


def _axes(axis: AxisName, mesh: Mesh, op: str) -> tuple[str, ...]:
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    mesh.axis_indices(names, op)  # raises naming the axis and the mesh's axes
    order = {a: i for i, a in enumerate(mesh.axis_names)}
    return tuple(sorted(names, key=order.__getitem__))


def reduce_axes(layout: Layout, data_axes: Sequence[str]) -> tuple[str, ...]:
    """The data axes a parameter with ``layout`` is summed over: those it is not split over."""
    split = {a for d in range(len(layout.spec.dims)) for a in layout.spec.axes_of(d)}
    return tuple(a for a in data_axes if a not in split)


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
            simulated mesh or on real ranks. Its parameters' `Layout` tells which data axes
            each one is split over (see the module docstring's rule).
        axis: the data axis or axes (default ``"dp"``): each index along them runs its own batch.
        mesh: the mesh, when ``model`` is a plain module.
        bucket_mb: on real ranks, the size of a bucket of gradients all-reduced at once (MiB).

    After each ``backward`` (outside `no_sync`) every rank's ``.grad`` holds the gradient the
    single-device model would have for the mean of every data rank's loss. A parameter that
    got a gradient on no rank keeps ``grad=None`` (as on one device); one that got a gradient
    on some ranks only gets the reduced gradient everywhere.

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
        model: ParallelModel | nn.Module,
        axis: AxisName = "dp",
        *,
        mesh: Mesh | None = None,
        bucket_mb: float = 25.0,
    ) -> None:
        op = "fastdist.train.DataParallel"
        module = getattr(model, "module", model)
        mesh = mesh if mesh is not None else getattr(model, "mesh", None)
        if not isinstance(module, nn.Module) or mesh is None:
            raise MeshError(
                f"{op}: expected a fastdist.nn.ParallelModel (or an nn.Module with mesh=), got "
                f"{type(model).__name__}. Fix: pass the model parallelize returned"
            )
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise MeshError(f"{op}: bucket_mb={bucket_mb!r} must be a positive number of MiB")
        if getattr(module, "_fastdist_data_parallel", None) is not None:
            raise MeshError(
                f"{op}: {type(module).__name__} already reduces its gradients over "
                f"{module._fastdist_data_parallel!r}; a second reducer would reduce twice. Fix: "
                "call .remove() on the first one"
            )
        self.module, self.mesh = module, mesh
        self.axes = _axes(axis, mesh, op)
        self.size = math.prod(mesh.axis_size(a) for a in self.axes)
        layouts = param_layouts(module)
        self._axes_of = {
            id(p): reduce_axes(layouts.get(n, Layout()), self.axes)
            for n, p in module.named_parameters()
        }
        self._sync = True
        self._queued = False
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        self._next = 0  # the next bucket to launch (real ranks: buckets go out in order)
        params = [p for p in module.parameters() if p.requires_grad]
        if mesh.backend is not None:
            self._make_buckets(params, bucket_mb)
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook)  # type: ignore[no-untyped-call]
            for p in params
        ]
        module._fastdist_data_parallel = self.axes  # type: ignore[assignment]

    # ------------------------------------------------------------------ user API
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the reduction inside (gradient accumulation): gradients accumulate per rank; the
        first backward after the block reduces the accumulated sum."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def remove(self) -> None:
        """Stop reducing: remove the hooks (waits for reductions in flight first)."""
        self.finish()
        for h in self._handles:
            h.remove()
        self._handles = []
        self.module._fastdist_data_parallel = None  # type: ignore[assignment]

    def finish(self) -> None:
        """Wait for every bucket of the current backward and write the reduced gradients
        (called at the end of every backward; safe to call again)."""
        if not self._buckets:
            return
        if not self._queued:
            return  # no synced backward since the last finish
        for i in range(self._next, len(self._buckets)):
            self._launch(i)  # every rank launches every bucket, in order (zeros where no grad)
        self._next = 0
        for b in self._buckets:
            if b.work is not None:
                self._wait(b)
        self._queued = False

    def __repr__(self) -> str:
        kind = "simulated" if self.mesh.backend is None else f"{len(self._buckets)} buckets"
        return f"DataParallel(axes={self.axes}, {self.mesh!r}, {kind})"

    # ------------------------------------------------------------------ the hooks
    def _hook(self, p: Tensor) -> None:
        if not self._sync or p.grad is None:
            return
        axes = self._axes_of[id(p)]
        if self.mesh.backend is None:
            _reduce_stacked(p.grad, self.mesh, axes, self.size)
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        i = self._bucket_of[id(p)]
        b = self._buckets[i]
        b.ready.add(id(p))
        while self._next < len(self._buckets) and len(self._buckets[self._next].ready) == len(
            self._buckets[self._next].params
        ):
            self._launch(self._next)

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
        """Pack bucket ``i`` (a zero block and a 0 flag for a missing grad) and start its
        all-reduce."""
        import torch.distributed as dist

        from ..distributed import _axis_comm

        b = self._buckets[i]
        b.ready.clear()
        self._next = max(self._next, i + 1)
        if not b.axes:  # split over every data axis: nothing to sum, only the 1/D
            for p in b.params:
                if p.grad is not None:
                    p.grad.div_(self.size)
            return
        pieces = [
            (p.grad.detach().reshape(-1) if p.grad is not None else p.new_zeros(p.numel()))
            for p in b.params
        ]
        flags = torch.tensor(
            [p.grad is not None for p in b.params], dtype=b.params[0].dtype, device=pieces[0].device
        )
        b.flat = torch.cat([*pieces, flags])
        ac = _axis_comm(_OP, self.mesh, b.axes)
        group = ac.comm.group(ac, ac._backend(_OP, b.flat.device.type), _OP)
        flat = b.flat
        b.work = ac.run(
            _OP,
            lambda: dist.all_reduce(flat, group=group, async_op=True),
            what="the gradient all-reduce",
        )

    def _wait(self, b: _Bucket) -> None:
        from ..distributed import _axis_comm

        ac = _axis_comm(_OP, self.mesh, b.axes)
        ac.run(_OP, b.work.wait, what="the gradient all-reduce")
        b.work = None
        flat = b.flat
        assert flat is not None
        flat.div_(self.size)
        n = len(b.params)
        got = flat[-n:] != 0  # some rank had a gradient
        offset = 0
        for p, had in zip(b.params, got.tolist()):
            piece = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is not None:
                p.grad.copy_(piece)
            elif had:
                p.grad = piece.clone()
        b.flat = None


def _reduce_stacked(g: Tensor, mesh: Mesh, axes: tuple[str, ...], size: int) -> None:
    """A simulated mesh's stacked gradient ``[world, *local]``, summed over ``axes`` (every rank
    of a group gets the group's sum) and divided by ``size``, in place."""
    with torch.no_grad():
        if not axes:
            g.div_(size)
            return
        dims = [mesh.axis_names.index(a) for a in axes]
        # [world, *local] -> [*mesh sizes, *local]: one dim per mesh axis
        grid = g.view(*mesh.shape.values(), *g.shape[1:])
        summed = grid.sum(dim=dims, keepdim=True).div_(size)
        grid.copy_(summed.expand_as(grid))


# ============================================================================ torch's engines
class PvaryHooks:
    """On real ranks, ``pvary`` a module's parameters inside its own forward (pre-hook swaps the
    parameter for ``pvary(parameter)``, a forward hook puts it back, also when forward raises).

    `fastdist.nn.ParallelModel` normally swaps these parameters with ``functional_call`` around
    the whole model; DDP and FSDP2 must call the model themselves, and FSDP2 installs its
    unsharded parameters at each block's forward, so the swap happens at the innermost module,
    after them: the gradient reaches the very parameter the engine reduces.
    """

    def __init__(self, mesh: Mesh, sites: Sequence[tuple[nn.Module, str, str]]) -> None:
        from ..collectives import pvary

        self._handles: list[Any] = []
        by_module: dict[int, tuple[nn.Module, list[tuple[str, str]]]] = {}
        for module, name, axis in sites:
            by_module.setdefault(id(module), (module, []))[1].append((name, axis))
        for module, names in by_module.values():

            def pre(m: nn.Module, args: Any, names: list[tuple[str, str]] = names) -> None:
                for name, axis in names:
                    p = m._parameters.pop(name)
                    m.__dict__[name] = pvary(p, mesh, axis)  # type: ignore[arg-type]
                    m.__dict__[f"_fastdist_pvaried_{name}"] = p

            def post(
                m: nn.Module, args: Any, out: Any, names: list[tuple[str, str]] = names
            ) -> None:
                for name, _ in names:
                    if f"_fastdist_pvaried_{name}" in m.__dict__:
                        del m.__dict__[name]
                        m._parameters[name] = m.__dict__.pop(f"_fastdist_pvaried_{name}")

            self._handles.append(module.register_forward_pre_hook(pre))
            self._handles.append(module.register_forward_hook(post, always_call=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def ddp(pm: ParallelModel, axis: AxisName = "dp", **kwargs: Any) -> nn.Module:
    """Wrap ``pm.module`` in ``torch.nn.parallel.DistributedDataParallel`` over the mesh's data
    group (real ranks). See `fastdist.nn.ParallelModel.data_parallel`."""
    from torch.nn.parallel import DistributedDataParallel

    from ..distributed import _axis_comm

    op = "ParallelModel.data_parallel(engine='ddp')"
    axes = _axes(axis, pm.mesh, op)
    _refuse_split_over(pm, axes, op)
    ac = _axis_comm(op, pm.mesh, axes)
    device = next(pm.module.parameters()).device
    group = ac.comm.group(ac, ac._backend(op, device.type), op)
    return DistributedDataParallel(pm.module, process_group=group, **kwargs)


def fsdp(
    pm: ParallelModel, axis: AxisName = "dp", blocks: Sequence[str] | None = None, **kwargs: Any
) -> nn.Module:
    """Shard ``pm.module`` over the mesh's data axis with FSDP2 ``fully_shard``: each block, then
    the root, as torchtitan does (real ranks). See `fastdist.nn.ParallelModel.data_parallel`."""
    from torch.distributed.fsdp import fully_shard

    op = "ParallelModel.data_parallel(engine='fsdp')"
    axes = _axes(axis, pm.mesh, op)
    if len(axes) != 1:
        raise MeshError(f"{op}: FSDP2 shards over one mesh axis here; got {axes}")
    _refuse_split_over(pm, axes, op)
    device = next(pm.module.parameters()).device
    dm = pm.mesh.to_device_mesh(device.type)[axes[0]]
    kinds = set(
        blocks if blocks is not None else getattr(pm.module, "_no_split_modules", None) or ()
    )
    wrapped = [m for m in pm.module.modules() if type(m).__name__ in kinds and m is not pm.module]
    if blocks is not None and not wrapped:
        raise MeshError(
            f"{op}: no module of {type(pm.module).__name__} is of a class in blocks={list(kinds)}. "
            "Fix: name the decoder block classes (e.g. ['LlamaDecoderLayer'])"
        )
    for m in wrapped:
        fully_shard(m, mesh=dm, **kwargs)
    fully_shard(pm.module, mesh=dm, **kwargs)
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
