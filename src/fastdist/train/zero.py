"""ZeRO-1: the optimizer state sharded over a data axis, built from fastdist's own collectives.

Every data rank holds the same parameters and (after `DataParallel`) the same gradients, so
each can update a disjoint slice and share the result. `ZeroOptimizer` flattens the
parameters (per dtype and device) into one vector per rank, padded to a multiple of the axis
size; rank ``i`` along the axis keeps chunk ``i`` (`fastdist.local_chunk`), runs the wrapped
torch optimizer on that chunk alone (so its state, e.g. AdamW's two moments, is ``1/n`` of
the replicated one), and the updated chunks are all-gathered back into every parameter
(`fastdist.all_gather_invariant`). Elementwise optimizers (SGD, Adam, AdamW, ...) give the
very values of the replicated optimizer; ones that look across a tensor (LAMB, Adafactor,
Shampoo) do not, and are refused.

The same code runs on a simulated mesh (every rank's chunk stacked) and on real ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from fastdist.core.mesh import AxisName, Mesh
from fastdist.errors import MeshError
from fastdist.nn.clip import refuse_unreduced
from fastdist.nn.state import Layout, module_and_mesh, param_layouts
from fastdist.train.data_parallel import data_axes, reduce_axes, refuse_meta

if TYPE_CHECKING:
    from fastdist.nn.parallelize import ParallelModel

__all__ = ["ZeroOptimizer"]

#: torch optimizers whose update of an element reads only that element (and scalars)
_ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad")


class ZeroOptimizer(torch.optim.Optimizer):
    """Wrap a torch optimizer so that its state is sharded over the data axis ``axis`` (ZeRO-1).

    Args:
        model: a `fastdist.nn.ParallelModel` (or an ``nn.Module`` with ``mesh=``) whose
            gradients are already reduced over ``axis`` (`DataParallel`, DDP).
        optimizer_class: an elementwise torch optimizer (``torch.optim.AdamW``, ``Adam``,
            ``SGD``, ...).
        axis: the data axis (or tuple) the state is sharded over; no parameter may be split
            over it.
        mesh: the mesh, when ``model`` is a plain module.
        **defaults: the optimizer's keywords (``lr=``, ``weight_decay=``, ...).

    ``step()`` updates every parameter exactly as ``optimizer_class(model.parameters())``
    would. With dynamic loss scaling use `fastdist.train.GradScaler`
    (``scaler.step(opt)`` skips the step, on every rank together, when a gradient overflows):
    torch's ``GradScaler`` looks for the gradients in the flat chunks, finds none, and is
    refused with `MeshError` at its first ``step``. ``param_groups`` are the wrapped
    optimizer's (one group), so LR schedulers work.
    Parameters that got no gradient while others did raise (a flat update cannot skip them,
    and updating them with a zero gradient would differ from torch); so does a parameter with a
    gradient that did not require grad when the optimizer was built (unfrozen later: it would
    never be updated).

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"dp": 2})
    >>> pm = fd.nn.parallelize(torch.nn.Linear(3, 2), mesh, {})
    >>> dp = fd.train.DataParallel(pm)
    >>> opt = fd.train.ZeroOptimizer(pm, torch.optim.AdamW, lr=0.1)
    >>> pm(torch.randn(2, 4, 3)).sum().backward()
    >>> opt.step()
    >>> opt.state_numel(), sum(p[0].numel() for p in pm.parameters())  # 2 moments x 4: half of 8
    (8, 8)
    """

    #: ``GradScaler.step`` hands the scale and the inf flag to ``step`` (``grad_scale``,
    #: ``found_inf``): the gradients it must unscale and check are the model's, not the chunks'
    _step_supports_amp_scaling = True

    def __init__(
        self,
        model: ParallelModel | nn.Module,
        optimizer_class: Callable[..., torch.optim.Optimizer],
        axis: AxisName = "dp",
        *,
        mesh: Mesh | None = None,
        **defaults: Any,
    ) -> None:
        op = "fastdist.train.ZeroOptimizer"
        module, mesh = module_and_mesh(model, mesh, op)
        refuse_meta(module, op)
        name = getattr(optimizer_class, "__name__", repr(optimizer_class))
        if name not in _ELEMENTWISE:
            raise MeshError(
                f"{op}: {name} is not known to update each element from that element alone; "
                f"sharding it would change its result. Fix: one of {', '.join(_ELEMENTWISE)}"
            )
        self.mesh, self.module, self._model = mesh, module, model
        self.axes = data_axes(axis, mesh, op)
        layouts = param_layouts(module)
        names = {id(p): n for n, p in module.named_parameters()}
        params = [p for p in module.parameters() if p.requires_grad]
        split = [
            names[id(p)]
            for p in params
            if reduce_axes(layouts.get(names[id(p)], Layout()), self.axes) != self.axes
        ]
        if split:
            raise MeshError(
                f"{op}: parameters {split[:3]} are split over {self.axes}, so their ranks hold "
                "different values; ZeRO shards only what the data ranks hold alike. Fix: "
                "shard over the axes every parameter is replicated over"
            )
        dtensors = [names[id(p)] for p in params if hasattr(p, "placements")]
        if dtensors:
            raise MeshError(
                f"{op}: {dtensors[:3]} are DTensors (FSDP2 already shards them, and their "
                "optimizer state, over the data axis). Fix: a plain torch optimizer over "
                "pm.parameters()"
            )
        reduced = getattr(module, "_fastdist_data_parallel", None) or ()
        if not set(self.axes) <= set(reduced):
            raise MeshError(
                f"{op}: the model's gradients are not reduced over {self.axes} (no data-parallel "
                "engine over it); each rank would update its chunk with its own gradient and the "
                "all-gather would make the wrong weights look consistent. Fix: "
                f"fastdist.train.DataParallel(pm, {self.axes[0]!r}) first"
            )
        self._stacked = mesh.backend is None
        self._n = mesh.axis_size(self.axes)
        groups: dict[tuple[Any, ...], list[nn.Parameter]] = {}
        for p in params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        self._groups: list[tuple[list[nn.Parameter], nn.Parameter, int]] = []
        for plist in groups.values():
            numel = sum(self._local_numel(p) for p in plist)
            padded = -(-numel // self._n) * self._n
            shard = self._chunk(self._flat([p.detach() for p in plist], padded))
            self._groups.append((plist, nn.Parameter(shard), padded))
        self.inner = optimizer_class([g[1] for g in self._groups], **defaults)
        super().__init__([g[1] for g in self._groups], self.inner.defaults)  # hooks, profiling
        # what torch.optim.Optimizer users (LR schedulers) read: the wrapped optimizer's own
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._built = True

    @property
    def flat_groups(self) -> list[tuple[list[nn.Parameter], nn.Parameter]]:
        """(the parameters, their flat shard) of each flat group, in ``inner``'s order: what
        `fastdist.checkpoint` reads and writes per parameter name."""
        return [(plist, shard) for plist, shard, _ in self._groups]

    def _local_numel(self, p: Tensor) -> int:
        return p[0].numel() if self._stacked else p.numel()

    def _flat(self, tensors: list[Tensor], padded: int) -> Tensor:
        """One rank's tensors as one vector of ``padded`` elements ([world, padded] stacked)."""
        lead = (self.mesh.size,) if self._stacked else ()
        # each [*lead, *local] -> [*lead, numel], side by side, zero padding at the end
        flat = torch.cat([t.reshape(*lead, -1) for t in tensors], dim=-1)
        return torch.nn.functional.pad(flat, (0, padded - flat.shape[-1]))

    def _per_rank(self, fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        if self._stacked:
            from fastdist.sim.simulate import simulate

            return simulate(fn, self.mesh)(x)
        return fn(x)

    def _chunk(self, flat: Tensor) -> Tensor:
        from fastdist.ops import local_chunk

        return self._per_rank(lambda v: local_chunk(v, self.mesh, self.axes, dim=0), flat)

    def state_numel(self) -> int:
        """Elements of optimizer state tensors this rank holds (per rank on a simulated mesh)."""
        total = 0
        for state in self.inner.state.values():
            for v in state.values():
                if isinstance(v, Tensor) and v.dim() > 0:
                    total += v[0].numel() if self._stacked else v.numel()
        return total

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update this rank's chunk with the wrapped optimizer, then all-gather every chunk into
        the parameters (a collective on real ranks)."""
        from fastdist.ops import all_gather_invariant

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refuse_unknown_grads()
        refuse_unreduced(self._model, "fastdist.train.ZeroOptimizer.step")
        if self._amp_skips():
            return loss
        live = []
        for plist, shard, padded in self._groups:
            have = [p.grad is not None for p in plist]
            if not any(have):
                shard.grad = None
                continue
            if not all(have):
                ids = {id(p) for p in plist}
                missing = [
                    n for n, p in self.module.named_parameters() if id(p) in ids and p.grad is None
                ]
                raise MeshError(
                    f"fastdist.train.ZeroOptimizer.step: {missing[:3]} have no gradient while "
                    "others do; a sharded flat update cannot skip them as torch's optimizers "
                    "do (AdamW's momentum and weight decay would still move them). Fix: a torch "
                    "optimizer over pm.parameters(), which skips them, or requires_grad=False for "
                    "parameters that do not train, set before the ZeroOptimizer is built (a zero "
                    "gradient is a different update: AdamW moves a parameter whose gradient is "
                    "zero)"
                )
            shard.copy_(self._chunk(self._flat([p.detach() for p in plist], padded)))
            shard.grad = self._chunk(self._flat([p.grad for p in plist], padded))  # type: ignore[misc]
            live.append((plist, shard))
        self.inner.step()
        for plist, shard in live:
            full = self._per_rank(
                lambda v: all_gather_invariant(v, self.mesh, self.axes, dim=0), shard.detach()
            )
            offset = 0
            for p in plist:
                k = self._local_numel(p)
                p.copy_(full[..., offset : offset + k].reshape(p.shape))
                offset += k
            shard.grad = None
        return loss

    def _amp_skips(self) -> bool:
        """Under ``GradScaler.step`` (which sets ``found_inf`` and ``grad_scale`` on this
        optimizer): True when the scaler found an inf/nan (skip the step); otherwise unscale the
        model's gradients if the scaler has not (``grad_scale`` set), as its ``unscale_`` would.
        torch's own scaler checked the flat chunks (no gradient there): refused."""
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None and grad_scale is None:
            return False  # a plain step
        if not isinstance(found_inf, Tensor):
            raise MeshError(
                "fastdist.train.ZeroOptimizer.step: stepped by a torch GradScaler, which looks for "
                "the gradients in the optimizer's flat chunks (they get theirs inside step) and "
                "so checked no gradient for inf/nan: an overflow would be stepped. Fix: "
                "scaler = fastdist.train.GradScaler(pm, device) (torch's scaler, "
                "checking the model's gradients, with one decision for every rank of the mesh)"
            )
        if bool(found_inf.item()):
            return True
        if grad_scale is not None:  # not unscaled yet: as GradScaler.unscale_ would
            inv = grad_scale.double().reciprocal().float()
            grads = [p.grad for plist, _, _ in self._groups for p in plist if p.grad is not None]
            torch._foreach_mul_(grads, inv)
        return False

    def _refuse_unknown_grads(self) -> None:
        """A parameter with a gradient that is in no flat group (it did not require grad when this
        optimizer was built: unfrozen later) would never be updated, where a torch optimizer
        over ``pm.parameters()`` updates it; refused."""
        known = {id(p) for plist, _, _ in self._groups for p in plist}
        stray = [
            n
            for n, p in self.module.named_parameters()
            if p.grad is not None and id(p) not in known
        ]
        if stray:
            raise MeshError(
                f"fastdist.train.ZeroOptimizer.step: {stray[:3]} have gradients but did not "
                "require grad when the optimizer was built, so it holds no chunk of them and "
                "would never update them. Fix: build the ZeroOptimizer after choosing which "
                "parameters train (fastdist.checkpoint.save / load carry its state over)"
            )

    def state_dict(self) -> dict[str, Any]:
        """Refused: the wrapped optimizer's state is this rank's flat chunk, which no other layout
        could load. Use `fastdist.checkpoint.save`, which writes it per parameter."""
        raise MeshError(
            "fastdist.train.ZeroOptimizer.state_dict: the state is this rank's flat chunk of the "
            "parameters. Fix: fastdist.checkpoint.save(path, pm, optimizer) / "
            "fastdist.checkpoint.load, "
            "which write and read it per parameter name, for any layout"
        )

    def load_state_dict(self, state_dict: Any) -> None:
        """Refused: see `state_dict`; use `fastdist.checkpoint.load`."""
        self.state_dict()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only while the wrapper is built (its flat chunks); afterwards refused."""
        if getattr(self, "_built", False):  # set at the end of __init__
            raise MeshError(
                "fastdist.train.ZeroOptimizer.add_param_group: the parameters are flattened into "
                "chunks when the optimizer is built. Fix: build a new ZeroOptimizer"
            )
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (as ``torch.optim.Optimizer.zero_grad``)."""
        for plist, _, _ in self._groups:
            for p in plist:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()

    def __repr__(self) -> str:
        return f"ZeroOptimizer({type(self.inner).__name__}, axes={self.axes}, {self.mesh!r})"
