"""Dynamic loss scaling over a mesh: one skip decision and one scale for every rank.

``torch.amp.GradScaler`` checks for inf/nan in the gradients one process holds. On real ranks
a parameter split over ``tp`` (or an FSDP2 shard over ``dp``, a pipeline stage over ``pp``) has
its gradient spread over several processes: when it overflows in one rank's block only, that
rank skips the step and halves its scale while the others step and keep theirs. The replicas
diverge silently, and the next step's loss is scaled differently on different ranks, so the
gradient sums across them mix two scales.

`GradScaler` is ``torch.amp.GradScaler`` with the inf/nan flag made the whole model's, as on
one device: after each rank checks (and unscales) its own gradients, the flag is all-reduced
(max) over every axis of the mesh, so every rank skips together, backs off together, and keeps
the same scale, as ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` does over
its process group. It also checks the gradients a `fastdist.train.ZeroOptimizer` steps (the
model's; torch's scaler looks for them in the optimizer's flat chunks and finds none). On a
simulated mesh every rank's gradient is one stacked tensor, whose check already covers every
rank: no collective is needed there.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from fastdist.core.mesh import Mesh
from fastdist.errors import MeshError
from fastdist.train.zero import ZeroOptimizer

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/nan check agrees over every rank of a mesh.

    Args:
        model: the `fastdist.nn.ParallelModel` or `fastdist.train.Pipeline` being trained (its
            ``mesh``), or the `Mesh` itself.
        device: the device type of the gradients (``"cuda"``, ``"cpu"``, ...), as torch's.
        **kwargs: torch's keywords (``init_scale=``, ``growth_factor=``, ``backoff_factor=``,
            ``growth_interval=``, ``enabled=``).

    Used exactly like torch's (``scale``, ``unscale_``, ``step``, ``update``), with a torch
    optimizer over ``pm.parameters()`` or a `fastdist.train.ZeroOptimizer`, under any engine
    of `fastdist.train.DataParallel`. Each ``unscale_`` (explicit, or inside ``step``) checks
    this rank's gradients, then on real ranks all-reduces the flag over every axis of the mesh
    (one scalar collective per optimizer and step: call it on every rank), so the step is
    skipped on every rank or on none, and every rank's scale stays the one a single device
    with the whole gradient would have. On a simulated mesh the stacked gradients are checked
    as one tensor (torch's scaler gives the same there).

    >>> import torch, fastdist as fd
    >>> from fastdist.train.grad_scaler import GradScaler
    >>> pm = fd.nn.parallelize(torch.nn.Linear(3, 2), fd.Mesh({"dp": 2}), {})
    >>> scaler = GradScaler(pm, "cpu", init_scale=4.0)
    >>> opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    >>> scaler.scale(pm(torch.randn(2, 4, 3)).sum()).backward()
    >>> pm.module.weight.grad[1, 0, 0] = float("inf")   # one rank's gradient overflows
    >>> scaler.step(opt)                                  # skipped on every rank
    >>> scaler.update()
    >>> scaler.get_scale()
    2.0
    """

    def __init__(self, model: Any, device: str = "cuda", **kwargs: Any) -> None:
        mesh = model if isinstance(model, Mesh) else getattr(model, "mesh", None)
        if not isinstance(mesh, Mesh):
            raise MeshError(
                f"fastdist.train.GradScaler: {type(model).__name__} is not a Mesh "
                "and has no mesh. Fix: pass the fastdist.nn.ParallelModel (or Pipeline) being "
                "trained, or its mesh"
            )
        super().__init__(device, **kwargs)
        self.mesh = mesh

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: Tensor,
        found_inf: Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, Tensor]:
        """Unscale this rank's gradients of ``optimizer``'s parameters (a ZeroOptimizer's: the
        model's) by ``inv_scale``, check them, and make the flag the whole mesh's; returns the
        flag per device (never empty, so that ``step`` and ``update`` find it on every rank)."""
        by_device: dict[torch.device, dict[torch.dtype, list[Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        with torch.no_grad():
            for g in _local_grads(optimizer):
                if not allow_fp16 and g.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                by_device[g.device][g.dtype].append(g)
            flags: dict[torch.device, Tensor] = {}
            for device, per_dtype in by_device.items():
                flags[device] = found_inf.to(device, copy=True)
                inv = inv_scale.to(device)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, flags[device], inv)
            return self._agree(flags, found_inf)

    def _agree(
        self, flags: dict[torch.device, Tensor], found_inf: Tensor
    ) -> dict[torch.device, Tensor]:
        """Every device's flag set to the max over this rank's devices and every rank of the mesh
        (real ranks); this rank's own flags on a simulated mesh."""
        if not flags:
            flags = {found_inf.device: found_inf.clone()}
        if self.mesh.backend is None or self.mesh.size == 1:
            return flags
        from fastdist.ops import pmax

        here = torch.stack([f.to(found_inf.device) for f in flags.values()]).amax()
        agreed = pmax(here, self.mesh, tuple(self.mesh.axis_names))
        for f in flags.values():
            f.copy_(agreed)
        return flags


def _local_grads(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The gradients ``optimizer`` steps, as this rank's local tensors (an FSDP2 DTensor's
    shard; a sparse gradient's values): the parameters of its groups, or a `ZeroOptimizer`'s
    model parameters (its groups hold flat chunks that get their gradient inside ``step``)."""
    if isinstance(optimizer, ZeroOptimizer):
        params = [p for plist, _ in optimizer.flat_groups for p in plist]
    else:
        params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "to_local"):  # an FSDP2 DTensor: this rank's shard (aliases the grad)
            g = g.to_local()
        if g.is_sparse:
            if g.dtype is torch.float16:  # as torch: duplicate indices summed before the check
                p.grad = g = g.coalesce()
            g = g._values()
        grads.append(g)
    return grads
