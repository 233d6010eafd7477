"""Running a pipeline schedule: `Pipeline` (the stages held here, one step of a schedule on
simulated or real ranks). The transfers between ranks along ``pp`` are
`fastdist.train.pipeline.transfers`."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from fastdist.comm.connect import reset as reset_mesh
from fastdist.core.mesh import Mesh
from fastdist.errors import PipelineError
from fastdist.nn.moe.experts import ExpertParallelExperts
from fastdist.train.pipeline.split import STAGE_INPUT, refuse_router_aux_loss
from fastdist.train.pipeline.transfers import Transfers, digest_bits, flat_inputs, schedule_id
from fastdist.train.schedules import Schedule

if TYPE_CHECKING:
    from fastdist.comm.torch_comm import TorchComm

__all__ = ["Pipeline", "Event"]


@dataclass(frozen=True)
class Event:
    """One action as it ran: on ``rank`` (along ``pp``), from ``start`` to ``end`` seconds after
    the step began (the wall clock of the process that ran it)."""

    rank: int
    kind: str
    microbatch: int
    stage: int
    start: float
    end: float


# ====================================================================== the pipeline
class Pipeline:
    """A model split into pipeline stages over ``axis``, each stage parallelized over the mesh's
    other axes, and the schedule that runs a training step over micro-batches.

    Build it with :func:`pipeline`. On a simulated mesh it holds every stage; on real ranks only
    the stages of this process's index along ``axis``.

    Attributes:
        mesh: the whole mesh (with the pipeline axis).
        axis: the pipeline axis.
        schedule: the `fastdist.train.schedules.Schedule` a step runs.
        stage_mesh: the mesh each stage is parallelized over (the other axes).
        stages: ``{stage index: ParallelModel}`` held here.
        layers: ``layers[j]`` are the decoder layer indices of stage ``j``.
        tied: weights the first and the last stage share (tied embeddings), ``{name in the
            last stage: name in the first}``: each stage holds a copy, and a step sums their
            gradients (Megatron's embedding group), so the copies stay equal; the norm counts
            the weight once, a checkpoint holds it once (under the first name).
        shared: parameters every stage holds a copy of under the same name (a DiT's condition
            embedder, whose outputs every block uses): a step sums the copies' gradients over
            the stages (on real ranks an all-reduce over ``axis``), the norm counts them once
            (the first stage's).
        batches: splits a step's batch into micro-batches (``None``: a causal LM's
            ``input_ids`` / ``labels`` batch; a DiT pipeline sets its own).
        last_only: the micro-batch keys only the last stage gets (its loss's).
        events: what the last step ran, where and when (:class:`Event`; per rank on a simulated
            mesh, this process's actions on real ranks, timing the compute without the wait
            for the input).
        span: the last step's wall time on this rank (real ranks), in seconds.
    """

    def __init__(
        self,
        mesh: Mesh,
        axis: str,
        sched: Schedule,
        stage_mesh: Mesh,
        stages: dict[int, Any],
        layers: list[range],
        tied: Mapping[str, str] | None = None,
        shared: Sequence[str] = (),
    ) -> None:
        self.mesh, self.axis, self.schedule, self.stage_mesh = mesh, axis, sched, stage_mesh
        self.stages, self.layers = stages, layers
        self.tied = dict(tied or {})
        self.shared = tuple(shared)
        self.batches: Callable[[Mapping[str, Any]], list[dict[str, Any]]] | None = None
        self.last_only: tuple[str, ...] = ("labels", "shift_labels", "num_items_in_batch")
        self.events: list[Event] = []
        self.span = 0.0  # the last step's wall time on this rank (real ranks), seconds
        # MoE layers' drop counts, summed over a step's micro-batches: {id: (layer, sum)}
        self._drops: dict[int, tuple[Any, Tensor]] = {}
        self._ranks = (
            Transfers(mesh, axis, schedule_id(sched, layers)) if mesh.backend is not None else None
        )
        self.rank = self._ranks.index if self._ranks is not None else None

    @property
    def simulated(self) -> bool:
        """True on a plain mesh: every stage is here, each over the simulated stage mesh."""
        return self._ranks is None

    # ------------------------------------------------------------------ parameters
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters of the stages held here, by the model's own names."""
        for j in sorted(self.stages):
            yield from self.stages[j].named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters of the stages held here (give them to the optimizer)."""
        for _, p in self.named_parameters():
            yield p

    def save_pretrained(self, save_directory: str | os.PathLike[str], **kwargs: Any) -> Any:
        """transformers' ``save_pretrained`` of the whole model, every stage's weights (on real
        ranks a collective; see `fastdist.train.pipeline.hf.PipelineSavePretrained`)."""
        from fastdist.train.pipeline.hf import PipelineSavePretrained

        return PipelineSavePretrained(self)(save_directory, **kwargs)

    def grads(self, *, check: bool = True) -> dict[str, Tensor]:
        """The single-device gradients of the stages held here, by name (on real ranks a
        collective over each stage's mesh)."""
        out: dict[str, Tensor] = {}
        for j in sorted(self.stages):
            out.update(self.stages[j].grads(check=check))
        return out

    def state_dict(self) -> dict[str, Tensor]:
        """The single-device weights of the stages held here, by name."""
        out: dict[str, Tensor] = {}
        for j in sorted(self.stages):
            out.update(self.stages[j].state_dict())
        return out

    def grad_norm(self, norm_type: float = 2.0) -> Tensor:
        """The single-device total norm of every stage's gradients (a collective over the mesh
        on real ranks): ``[mesh.size]`` simulated, 0-d on real ranks."""
        return self._norm(norm_type)[0]

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip every stage's gradients by the whole model's single-device total norm, and
        return that norm (``fastdist.nn.clip_grad_norm_`` on one stage would see only that
        stage's norm and clip the stages by different factors).

        The norm combines each stage's (`fastdist.nn.grad_norm` rules: shards summed,
        replicas once) over the stages: ``(sum of p-th powers) ** (1/p)``, the largest for
        the inf-norm; on real ranks a collective over the whole mesh. Call it after the
        data-parallel reduction (after `step`)."""
        from fastdist.nn.clip import clip_coefficient, scale_grads

        total, grads = self._norm(norm_type)
        op = "Pipeline.clip_grad_norm_"
        coef = clip_coefficient(op, total, max_norm, norm_type, error_if_nonfinite)
        for j, gs in grads.items():
            # simulated: the factors of the ranks of stage j's rank along the axis
            scale_grads(
                gs,
                coef.index_select(0, self._stage_rows(j)) if self.simulated else coef,
                self.stage_mesh,
            )
        return total

    def _norm(self, norm_type: float) -> tuple[Tensor, dict[int, list[Tensor]]]:
        from fastdist.nn.clip import check_norm_type, total_norm

        op = "Pipeline.clip_grad_norm_"
        p = check_norm_type(norm_type, op)
        grads: dict[int, list[Tensor]] = {}
        per_stage: list[Tensor] = []
        copies = [b for _, _, b in self._tied_params() if b is not None and b.grad is not None]
        hidden = [(b, b.grad) for b in copies if b.grad is not None]  # counted once: as the first
        for b in copies:
            b.grad = None
        # shared copies: counted once, as the first stage's
        extra = {j: [c for c in self._shared_copies(j) if c.grad is not None] for j in self.stages}
        hidden_shared = {j: [(c, c.grad) for c in cs] for j, cs in extra.items()}
        for cs in extra.values():
            for c in cs:
                c.grad = None
        try:
            norms = {j: total_norm(self.stages[j], p, None, op) for j in sorted(self.stages)}
        finally:
            for b, g in [*hidden, *(x for xs in hidden_shared.values() for x in xs)]:
                b.grad = g
        for j, (total, gs, _) in norms.items():
            grads[j] = gs + [g for _, g in hidden] if j == self.schedule.stages - 1 else gs
            grads[j] = grads[j] + [cast(Tensor, g) for _, g in hidden_shared[j]]
            t = total.to(torch.float64)
            if self.simulated:  # [stage mesh size] -> [mesh size]: rows of this stage's rank
                t = torch.zeros(self.mesh.size, dtype=torch.float64).index_copy(
                    0, self._stage_rows(j), t
                )
            per_stage.append(t if p == math.inf else t**p)
        if self.simulated:
            stacked = torch.stack(per_stage)  # [stages, mesh size]: zeros off the stage's rows
            # every rank: its stage-mesh index's value summed over the stages
            per_rank = stacked.amax(0) if p == math.inf else stacked.sum(0)
            by_index = per_rank.index_select(0, self._peers()).view(-1, self.mesh.size)
            combined = by_index.amax(0) if p == math.inf else by_index.sum(0)
        else:
            from fastdist.ops import pmax, psum

            mine = torch.stack(per_stage)
            local = mine.amax(0) if p == math.inf else mine.sum(0)
            combined = (pmax if p == math.inf else psum)(local, self.mesh, self.axis)
        total = combined if p == math.inf else combined ** (1.0 / p)
        dtype = next(self.parameters()).dtype
        return total.to(dtype), grads

    def _stage_rows(self, stage: int) -> Tensor:
        """The mesh ranks of ``stage``'s rank along the axis, in stage-mesh order."""
        r = self.schedule.rank_of(stage)
        return torch.tensor(
            [
                self.mesh.rank_of({**self.stage_mesh.coords(i), self.axis: r})
                for i in range(self.stage_mesh.size)
            ]
        )

    def _peers(self) -> Tensor:
        """For each pipeline-axis index r (outer) and mesh rank (inner): the mesh rank with r
        along the axis and the same other coordinates."""
        return torch.tensor(
            [
                self.mesh.rank_of({**self.mesh.coords(q), self.axis: r})
                for r in range(self.schedule.pp)
                for q in range(self.mesh.size)
            ]
        )

    def train(self, mode: bool = True) -> Pipeline:
        """Put every stage held here in training mode (``mode=False``: eval), as
        ``nn.Module.train`` does; returns the pipeline. (The model given to `pipeline` is not
        the stages: its ``train()`` / ``eval()`` do not reach their copies of its skeleton.)"""
        for pm in self.stages.values():
            pm.module.train(mode)
        return self

    def eval(self) -> Pipeline:
        """``train(False)``: every stage held here in eval mode (dropout off)."""
        return self.train(False)

    def zero_grad(self) -> None:
        """Drop every gradient of the stages held here (``grad = None``)."""
        for p in self.parameters():
            p.grad = None

    def reset(self) -> None:
        """Recover on real ranks after a failed step (a `CommError`, a `CollectiveTimeout`, or
        any error one rank raised mid-step, which drops the mesh's and the stage mesh's groups
        so that its peers fail at once): ``fastdist.comm.reset`` of the mesh and of the stage
        mesh, then drop the gradients. Call it on **every** rank, then redo the step.

        Resetting the mesh alone is not enough: a failure can leave the ranks of one stage at
        different points (one got its gradient and went on into the backward's collectives
        over the stage mesh, its peer in the stage waited for one that never came), which
        breaks the stage mesh's groups too. The gradients of the failed step are partial.
        """
        if self.simulated:
            raise PipelineError(
                "Pipeline.reset: a simulated pipeline has no process groups to reset. Fix: "
                "call it on real ranks (fastdist.connect) after a failed step"
            )
        reset_mesh(self.mesh)
        if self.stage_mesh.ndim:  # the mesh of no axes has no groups
            reset_mesh(self.stage_mesh)
        assert self._ranks is not None
        self._ranks.forget()  # the next step's transfers carry their headers again
        self.zero_grad()

    # ------------------------------------------------------------------ a step
    def step(self, **batch: Any) -> Tensor:
        """Forward and backward of one batch through the schedule; gradients accumulate into the
        parameters' ``.grad`` as one device's ``loss.backward()`` on the whole batch would.
        Under ``torch.no_grad()`` / ``torch.inference_mode()`` (an evaluation): the forwards
        only, in the schedule's order, no gradient touched; the same loss.

        Args:
            batch: the model's keyword inputs for the whole batch: ``input_ids`` and ``labels``
                (required; or ``shift_labels``, labels already aligned with the positions as
                transformers' loss takes them), optionally ``attention_mask``,
                ``position_ids``. Every rank along
                the pipeline axis gets the same batch (stages after the first read only its
                shape and masks, the last stage its labels). On a simulated mesh each carries
                the leading rank dim ``[mesh.size, batch, ...]``. A DiT pipeline's:
                ``hidden_states``, ``timestep``, ``encoder_hidden_states``, ``target``,
                optionally ``weighting`` and the model's other keyword inputs
                (``encoder_hidden_states_image``, ``pooled_projections``, ``img_ids`` /
                ``txt_ids``, ``encoder_attention_mask``, ...:
                `fastdist.train.pipeline.dit.dit_batches`).

        Returns:
            the loss of the whole batch (the mean over its predicted tokens; a DiT's: the mean
            of ``weighting * (output - target) ** 2``), detached: on a
            simulated mesh ``[mesh.size]`` (every rank's), on real ranks a 0-d tensor on every
            rank of the pipeline axis.
        """
        for pm in self.stages.values():  # they share the model's config: switched on since?
            refuse_router_aux_loss(pm.module, "Pipeline.step")
        micro = self._micro_batches(batch) if self.batches is None else self.batches(batch)
        self._check_tied_copies()
        self._check_same_batch(batch)  # real ranks: started here, checked before any transfer
        if self._ranks is not None:
            # the first step with these input shapes sends every transfer's header (shape,
            # dtype, the sender's pipeline); later ones only the tensors
            self._ranks.signature = tuple(
                sorted(
                    (k, tuple(v.shape), v.dtype) for k, v in batch.items() if isinstance(v, Tensor)
                )
            )
        self.events = []
        # the copies' gradients of earlier steps (equal: summed then) are set aside, so that the
        # sums below add this step's contributions only, then added back once
        # (an evaluation under no_grad makes none: nothing set aside, nothing summed)
        earlier = self._set_aside_copies() if torch.is_grad_enabled() else []
        self._drops = {}
        loss = self._run_simulated(micro) if self.simulated else self._run_ranks(micro)
        _add_back(earlier)
        for layer, total in self._drops.values():  # the step's drops, not the last forward's
            layer.dropped = total
        return loss

    def _check_same_batch(self, batch: Mapping[str, Any]) -> None:
        """Every rank along the pipeline axis must be given the same batch: each stage reads its
        own copy (the first its ids, every stage the masks and positions, the last the labels),
        so copies that differ would mix two batches into one loss. Simulated: the rows are
        compared; real ranks: a digest of each input, all-gathered over the axis (one small
        collective per step, started here and waited for by the step's first transfer:
        `Transfers.gate`, so that it runs while the first forward computes). The tensors inside
        a tuple or list input (a DiT's rotary tables) are compared too, and on real ranks the
        plain numbers (a DiT's ``num_frames``)."""
        batch = flat_inputs(batch, numbers=not self.simulated)
        keys = sorted(batch)
        if self.simulated:
            pp, size = self.schedule.pp, self.mesh.size
            for k in keys:
                v = batch[k]
                # [pp, mesh size, ...]: row r holds every rank's copy as the rank with pp=r has it
                rows = v.index_select(0, self._peers()).view(pp, size, *v.shape[1:])
                if not bool((rows == rows[:1]).all()):
                    self._differs(k)
            return
        assert self._ranks is not None
        ranks = self._ranks
        # an all-gather as a sum: every rank fills its own row of zeros (exact in int64)
        device = next((t.device for t in batch.values() if t.dim() > 0), batch[keys[0]].device)
        every = torch.zeros(ranks.ac.n, 2 * len(keys), dtype=torch.int64, device=device)
        for i, k in enumerate(keys):  # every: [pp, 2 * len(keys)]
            v = digest_bits(batch[k]).to(device)  # [n]
            weights = torch.arange(v.numel(), device=device) % 1000003 + 1  # [n]
            every[ranks.index, 2 * i : 2 * i + 2] = torch.stack([v.sum(), (v * weights).sum()])
        pending = ranks.ac.all_reduce_async(
            "Pipeline.step", every, what="the digest of the batch (every rank's must be equal)"
        )

        def check() -> None:
            pending.wait()
            for i, k in enumerate(keys):
                if not bool((every[:, 2 * i : 2 * i + 2] == every[:1, 2 * i : 2 * i + 2]).all()):
                    self._differs(k)

        ranks.gate = check

    def _differs(self, key: str) -> None:
        raise PipelineError(
            f"Pipeline.step: the ranks along {self.axis!r} were given different {key} (every "
            "stage reads its own copy of the batch: the first its inputs, every stage the "
            "masks, positions or conditions, the last the labels or target, so different copies "
            "would mix two batches into one loss). Fix: give every rank with the same "
            "coordinates on the "
            f"other axes the same batch (e.g. seed the data loader by the data-parallel index, "
            f"not by the global rank)"
        )

    def _micro_batches(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        m, sim = self.schedule.microbatches, self.simulated
        batch = dict(batch)
        if "labels" not in batch and isinstance(batch.get("shift_labels"), Tensor):
            batch["labels"] = batch["shift_labels"]  # the model computes a loss only with labels
        for key in ("input_ids", "labels"):
            if not isinstance(batch.get(key), Tensor):
                raise PipelineError(
                    f"Pipeline.step: {key}= is required (a tensor). Fix: pass input_ids= and "
                    "labels= (the loss is computed on the last stage)"
                )
        known = {"input_ids", "labels", "shift_labels", "attention_mask", "position_ids"}
        unknown = sorted(set(batch) - known)
        if unknown:
            raise PipelineError(
                f"Pipeline.step: inputs {unknown} are not supported. Fix: pass input_ids, labels "
                "(or shift_labels) and optionally attention_mask, position_ids"
            )
        ids = batch["input_ids"]
        bdim = 1 if sim else 0  # [rank, batch, seq] simulated, [batch, seq] on a rank
        if sim and (ids.dim() < 2 or ids.shape[0] != self.mesh.size):
            raise PipelineError(
                f"Pipeline.step: input_ids of shape {tuple(ids.shape)} on a simulated "
                f"{self.mesh!r}: every input carries the leading rank dim. Fix: pass "
                f"[{self.mesh.size}, batch, seq] (e.g. ids.expand({self.mesh.size}, *ids.shape))"
            )
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dim() != bdim + 2:
            raise PipelineError(
                f"Pipeline.step: input_ids of dtype {ids.dtype} and shape {tuple(ids.shape)}. "
                "Fix: integer token ids [batch, seq] (simulated: [rank, batch, seq])"
            )
        for key in ("attention_mask", "position_ids"):
            v = batch.get(key)
            if v is None:
                continue
            # the same [batch, seq] as input_ids (position_ids: or a batch of 1, broadcast)
            ok = isinstance(v, Tensor) and v.dim() == ids.dim() and v.shape[-1] == ids.shape[-1]
            ok = ok and v.shape[:bdim] == ids.shape[:bdim]
            ok = ok and v.shape[bdim] in (
                (ids.shape[bdim], 1) if key == "position_ids" else (ids.shape[bdim],)
            )
            if not ok:
                raise PipelineError(
                    f"Pipeline.step: {key} of shape {tuple(getattr(v, 'shape', ()))} for input_ids "
                    f"of shape {tuple(ids.shape)}. Fix: a tensor of input_ids' shape"
                    + (" (simulated: with the leading rank dim)" if sim else "")
                )
        b = ids.shape[bdim]
        if b % m:
            divisors = [d for d in range(1, b + 1) if b % d == 0]
            raise PipelineError(
                f"Pipeline.step: a batch of {b} sequences does not split into {m} micro-batches "
                f"(schedule {self.schedule.name!r}). Fix: a batch size that is a multiple of {m}, "
                f"or microbatches= one of {divisors}"
            )
        aligned = isinstance(batch.get("shift_labels"), Tensor)
        labels = batch["shift_labels" if aligned else "labels"]
        if labels.dim() != bdim + 2 or labels.shape[: bdim + 1] != ids.shape[: bdim + 1]:
            raise PipelineError(
                f"Pipeline.step: {'shift_labels' if aligned else 'labels'} of shape "
                f"{tuple(labels.shape)} for input_ids of shape {tuple(ids.shape)}. Fix: "
                "[batch, seq] (simulated: [rank, batch, seq]), as input_ids"
            )
        # predicted tokens of the whole batch (-100 ignored; labels shift by one), per rank
        dims = tuple(range(1, labels.dim())) if sim else tuple(range(labels.dim()))
        count = ((labels if aligned else labels[..., 1:]) != -100).sum(dims)
        out = []
        for k in range(m):
            mb: dict[str, Any] = {}
            for key, v in batch.items():
                if isinstance(v, Tensor) and v.dim() > bdim and v.shape[bdim] == b:
                    mb[key] = v.narrow(bdim, k * (b // m), b // m)
                else:
                    mb[key] = v
            mb["num_items_in_batch"] = count
            out.append(mb)
        return out

    def _rows(self, stage: int, mb: Mapping[str, Any]) -> dict[str, Any]:
        """A simulated stage's inputs: the rows of the ranks at its index along the axis."""
        rows = self._stage_rows(stage)

        def pick(v: Any) -> Any:  # a tensor, or a tuple of them (rotary tables)
            if isinstance(v, (tuple, list)):
                return type(v)(pick(t) for t in v)
            return v.index_select(0, rows) if isinstance(v, Tensor) else v

        return {k: pick(v) for k, v in mb.items()}

    def _forward(self, j: int, mb: Mapping[str, Any], x: Tensor | None) -> Tensor:
        pm = self.stages[j]
        kwargs = dict(mb)
        if self.batches is None:  # a causal LM: no KV cache in training (its copies are waste)
            kwargs["use_cache"] = False
        if j != self.schedule.stages - 1:
            for key in self.last_only:
                kwargs.pop(key, None)
        per_rank = {STAGE_INPUT: x} if x is not None else {}
        out = pm.call_with(per_rank, **kwargs)
        for layer in pm.module.modules():  # MoE layers record each forward's drops: add them up
            if isinstance(layer, ExpertParallelExperts) and layer.dropped is not None:
                held = self._drops.get(id(layer))
                total = layer.dropped if held is None else held[1] + layer.dropped
                self._drops[id(layer)] = (layer, total)
        if j == self.schedule.stages - 1:
            out = out.loss if hasattr(out, "loss") else out["loss"]
        assert isinstance(out, Tensor)  # the loss, or the last own layer's output (StageHooks)
        return out

    def _backward(self, j: int, y: Tensor, g: Tensor | None, last_of_stage: bool) -> None:
        pm = self.stages[j]
        ctx = pm.engine.no_sync() if pm.engine is not None and not last_of_stage else nullcontext()
        if not y.requires_grad:  # the first stage with every parameter frozen: nothing to do
            return
        with ctx:
            # the last stage: every rank's own loss (simulated: their sum); else the output's
            torch.autograd.backward(y.sum() if g is None else y, g)

    def _run_simulated(self, micro: list[dict[str, Any]]) -> Tensor:
        s = self.schedule
        last = s.stages - 1
        acts: dict[tuple[int, int], Tensor] = {}  # (stage, micro) -> activation into the stage
        grads: dict[tuple[int, int], Tensor] = {}  # (stage, micro) -> gradient of its output
        inputs: dict[tuple[int, int], Tensor] = {}
        outputs: dict[tuple[int, int], Tensor] = {}
        left_b = {j: s.microbatches for j in range(s.stages)}
        loss: Tensor | None = None
        t0 = time.perf_counter()
        train = torch.is_grad_enabled()  # else forward only (`step` under torch.no_grad)
        for a in s.order() if train else (a for a in s.order() if a.kind == "F"):
            j, m = a.stage, a.microbatch
            start = time.perf_counter() - t0
            if a.kind == "F":
                x = acts.pop((j, m), None)
                if x is not None and train:
                    x = x.detach().requires_grad_(True)
                    inputs[(j, m)] = x
                y = self._forward(j, self._rows(j, micro[m]), x)
                if train:
                    outputs[(j, m)] = y
                if j == last:
                    loss = y.detach() if loss is None else loss + y.detach()
                else:
                    acts[(j + 1, m)] = y
            else:
                left_b[j] -= 1
                self._backward(j, outputs.pop((j, m)), grads.pop((j, m), None), not left_b[j])
                x = inputs.pop((j, m), None)
                if x is not None:
                    grads[(j - 1, m)] = _grad_of(x, j, m)
            self.events.append(Event(s.rank_of(j), a.kind, m, j, start, time.perf_counter() - t0))
        assert loss is not None
        if train:
            self._sum_tied()
            self._sum_shared()
        # every rank's loss: rank r holds its stage-mesh index's loss of the last stage
        idx = torch.tensor(
            [
                self.stage_mesh.rank_of(
                    {a: c for a, c in self.mesh.coords(r).items() if a != self.axis}
                )
                for r in range(self.mesh.size)
            ]
        )
        return loss.index_select(0, idx)

    def _run_ranks(self, micro: list[dict[str, Any]]) -> Tensor:
        assert self._ranks is not None and self.rank is not None
        s, me, ranks = self.schedule, self.rank, self._ranks
        last = s.stages - 1
        device = next(self.parameters()).device
        left_b = {j: s.microbatches for j in s.stages_of(me)}
        st = _Step(micro, device, left_b, loss=torch.zeros((), dtype=torch.float64, device=device))
        train = torch.is_grad_enabled()  # else forward only (`step` under torch.no_grad)
        acts = s.actions[me] if train else tuple(a for a in s.actions[me] if a.kind == "F")
        early = ranks.ac.backend("Pipeline.step", device.type) == "gloo"
        reduce_at = _last_forward(acts, last) if early else None  # the loss: `_last_forward`
        what = "the step's loss (the last stage's, zeros elsewhere)"
        pending = None
        t0 = time.perf_counter()
        try:
            if reduce_at == -1:  # no last stage here: its zeros go in now
                pending = ranks.ac.all_reduce_async("Pipeline.step", st.loss, what=what)
            self._post_next(acts, -1, device)  # the first action's input
            for i, a in enumerate(acts):
                run = self._forward_action if a.kind == "F" else self._backward_action
                start, end = run(st, acts, i, t0)
                self.events.append(Event(me, a.kind, a.microbatch, a.stage, start, end))
                if i == reduce_at:  # the last stage's loss is complete
                    pending = ranks.ac.all_reduce_async("Pipeline.step", st.loss, what=what)
            ranks.open_gate()  # no transfer on this rank: the batch check still holds
            ranks.finish()
            if train:
                self._sum_tied()
                self._sum_shared()
            if pending is not None:
                pending.wait()
            self.span = time.perf_counter() - t0
        except Exception as e:
            # peers wait on this rank's transfers and its stage's collectives: drop the groups of
            # both meshes so that they fail now, not at their timeout (a fastdist error dropped
            # only the groups of the mesh it happened on)
            why = f"the pipeline step failed on this rank ({type(e).__name__}: {e})"
            for held in (self.mesh, self.stage_mesh):
                comm = cast("TorchComm | None", held.comm)
                if comm is not None and comm.broken is None:
                    comm.abandon(why)
            raise
        finally:
            ranks.pending.clear()
            ranks.posted.clear()
            ranks.gate = None
        dtype = next(self.parameters()).dtype
        if pending is not None:  # st.loss: the last stage's loss plus zeros, on every rank
            return st.loss.to(dtype)
        from fastdist.ops import broadcast

        # the last stage's loss on every rank of the pipeline axis
        return broadcast(st.loss, self.mesh, self.axis, src=s.rank_of(last)).to(dtype)

    def _forward_action(
        self, st: _Step, acts: Sequence[Any], i: int, t0: float
    ) -> tuple[float, float]:
        """Action ``acts[i]``, a forward: receive (or take) its input, post the next action's
        receive, run the stage, hand its output on (the last stage: add its loss). Returns the
        compute's (start, end) from ``t0``: the wait is idle time."""
        assert self._ranks is not None
        s, me, ranks, a = self.schedule, self.rank, self._ranks, acts[i]
        j, m = a.stage, a.microbatch
        x = None
        if j > 0:
            src = s.rank_of(j - 1)
            x = st.local.pop(("F", m, j)) if src == me else ranks.recv(src, "F", m, j, st.device)
            if torch.is_grad_enabled():
                x = x.detach().requires_grad_(True)
                st.inputs[(j, m)] = x
        self._post_next(acts, i, st.device)
        start = time.perf_counter() - t0
        y = self._forward(j, st.micro[m], x)
        end = time.perf_counter() - t0
        if torch.is_grad_enabled():
            st.outputs[(j, m)] = y
        if j == s.stages - 1:
            st.loss += y.detach().to(torch.float64)
        elif s.rank_of(j + 1) == me:
            st.local[("F", m, j + 1)] = y
        else:
            ranks.send(y, s.rank_of(j + 1), "F", m, j + 1)
        return start, end

    def _backward_action(
        self, st: _Step, acts: Sequence[Any], i: int, t0: float
    ) -> tuple[float, float]:
        """Action ``acts[i]``, a backward: receive (or take) its output's gradient, post the
        next action's receive, run the stage's backward, hand its input's gradient back.
        Returns the compute's (start, end) from ``t0``."""
        assert self._ranks is not None
        s, me, ranks, a = self.schedule, self.rank, self._ranks, acts[i]
        j, m = a.stage, a.microbatch
        g = None
        if j < s.stages - 1:
            src = s.rank_of(j + 1)
            g = st.local.pop(("B", m, j)) if src == me else ranks.recv(src, "B", m, j, st.device)
        st.left_b[j] -= 1
        self._post_next(acts, i, st.device)
        start = time.perf_counter() - t0
        self._backward(j, st.outputs.pop((j, m)), g, not st.left_b[j])
        end = time.perf_counter() - t0
        x = st.inputs.pop((j, m), None)
        if x is not None:
            gx = _grad_of(x, j, m)
            if s.rank_of(j - 1) == me:
                st.local[("B", m, j - 1)] = gx
            else:
                ranks.send(gx, s.rank_of(j - 1), "B", m, j - 1)
        return start, end

    def _post_next(self, acts: Sequence[Any], i: int, device: torch.device) -> None:
        """Post the receive of the input of this rank's action after ``acts[i]`` (if it comes
        from another rank), so that its bytes move while ``acts[i]`` computes."""
        if i + 1 == len(acts) or self._ranks is None:
            return
        s, a = self.schedule, acts[i + 1]
        j = a.stage + (-1 if a.kind == "F" else 1)  # the stage that sends it
        if 0 <= j < s.stages and s.rank_of(j) != self.rank:
            self._ranks.post(s.rank_of(j), a.kind, a.microbatch, a.stage, device)

    def _tied_params(self) -> list[tuple[str, nn.Parameter | None, nn.Parameter | None]]:
        """(alias, the first stage's copy, the last stage's copy) of each tied weight, None
        where this process does not hold that stage."""
        first, last = self.stages.get(0), self.stages.get(self.schedule.stages - 1)
        return [
            (
                alias,
                first.module.get_parameter(name) if first is not None else None,
                last.module.get_parameter(alias) if last is not None else None,
            )
            for alias, name in self.tied.items()
        ]

    def _sum_tied(self) -> None:
        """Both copies of each tied weight get the sum of their gradients (first + last, the
        same order everywhere: bitwise equal copies); on real ranks one exchange between the
        first and the last stage's ranks."""
        for alias, a, b in self._tied_params():
            if a is not None and b is not None:
                if a.grad is not None and b.grad is not None:
                    a.grad = a.grad + b.grad
                    b.grad = a.grad.clone()
                continue
            mine = a if a is not None else b
            if mine is None or mine.grad is None or self._ranks is None:
                continue
            peer = self.schedule.rank_of(self.schedule.stages - 1 if a is not None else 0)
            what = f"the gradient of the tied weight {self.tied[alias]} / {alias}"
            theirs = self._ranks.swap(mine.grad, peer, what)
            mine.grad = mine.grad + theirs if a is not None else theirs + mine.grad

    def _check_tied_copies(self) -> None:
        """Both copies of each tied weight must be equal when a step starts (a step gives them
        the same gradient; an optimizer that treats them alike keeps them equal). Copies that
        drifted apart, e.g. under param groups by name that exclude ``embed`` from weight decay
        (one device has the one weight, under the first name), would train two weights and
        checkpoint the first: refused. Simulated: compared bitwise; real ranks: a float64 digest
        of each copy swapped between the first and the last stage's ranks."""
        for alias, a, b in self._tied_params():
            if a is not None and b is not None:
                same = torch.equal(_bits(a), _bits(b))
            else:
                mine = a if a is not None else b
                if mine is None or self._ranks is None:
                    continue
                w = mine.detach()
                digest = torch.stack([w.sum(dtype=torch.float64), w.abs().sum(dtype=torch.float64)])
                peer = self.schedule.rank_of(self.schedule.stages - 1 if a is not None else 0)
                what = f"the digest of the tied weight {self.tied[alias]} / {alias}"
                same = torch.equal(_bits(self._ranks.swap(digest, peer, what)), _bits(digest))
            if not same:
                raise PipelineError(
                    f"Pipeline.step: the two copies of the tied weight {self.tied[alias]} (first "
                    f"stage) and {alias} (last stage) differ: the optimizer updated them "
                    "differently (param groups by name, e.g. no weight decay for 'embed', put one "
                    "copy in each), so the model no longer ties them. Fix: give both names the "
                    f"same optimizer settings (pipe.tied maps {alias!r} to {self.tied[alias]!r})"
                )

    def _set_aside_copies(self) -> list[tuple[list[nn.Parameter], Tensor]]:
        """Each weight held in several copies here (tied, shared) with a gradient: its copies
        and that gradient (the copies' are equal after a step's sum), the copies' set to
        ``None``. Without this, a second step without ``zero_grad`` would sum every copy's
        accumulated gradient: the earlier steps' counted once per copy."""
        groups = [[c for c in (a, b) if c is not None] for _, a, b in self._tied_params()]
        groups += [
            [self.stages[j].module.get_parameter(n) for j in sorted(self.stages)]
            for n in self.shared
        ]
        out = []
        for copies in groups:
            g = next((c.grad for c in copies if c.grad is not None), None)
            if g is not None:
                out.append((copies, g))
            for c in copies:
                c.grad = None
        return out

    def _shared_copies(self, stage: int) -> list[nn.Parameter]:
        """The copies of the shared parameters that the norm does not count (every stage's but
        the first's)."""
        if stage == 0:
            return []
        return [self.stages[stage].module.get_parameter(n) for n in self.shared]

    def _sum_shared(self) -> None:
        """Every copy of each shared parameter gets the sum of all the stages' gradients (in
        stage order here; on real ranks then one all-reduce over the axis of every shared
        gradient and a flag per parameter, so that one no stage's graph reached keeps
        ``grad=None``, as on one device)."""
        if not self.shared:
            return
        held = sorted(self.stages)
        copies = {n: [self.stages[j].module.get_parameter(n) for j in held] for n in self.shared}
        from torch.distributed.tensor import DTensor

        if any(isinstance(c.grad, DTensor) for cs in copies.values() for c in cs):
            raise PipelineError(
                f"Pipeline.step: the parameters every stage holds ({self.shared[0]}, ...) are "
                "FSDP2 shards (DTensor gradients); summing their copies over the stages is built "
                "for whole tensors only. Fix: fastdist.train.DataParallel(pipe, 'dp') with "
                "engine='fastdist'"
            )
        sums: dict[str, Tensor | None] = {}
        for n, ps in copies.items():
            total = None
            for p in ps:
                if p.grad is not None:
                    total = p.grad if total is None else total + p.grad
            sums[n] = total
        if self._ranks is not None:
            what = f"the gradients of the parameters every stage holds ({self.shared[0]}, ...)"
            like = [copies[n][0] for n in sums]
            sums = dict(zip(sums, self._ranks.sum_grads(list(sums.values()), like, what)))
        for n, total in sums.items():
            if total is not None:
                for p in copies[n]:
                    p.grad = total.clone()

    # ------------------------------------------------------------------ inspection
    def show(self) -> str:
        """The schedule's timeline (see `Schedule.show`)."""
        return self.schedule.show()

    def measured_bubble(self) -> dict[int, float]:
        """This rank's idle share of the last step: ``1 - (time computing its actions) / (the
        step's wall time)``, from :attr:`events` (each action's compute, not the wait for its
        input) and :attr:`span`; ``{rank along the axis: share}``."""
        if self.simulated:
            raise PipelineError(
                "Pipeline.measured_bubble: on a simulated mesh the stages run one after another in "
                "one process, so there is no idle time to measure. Fix: pipe.schedule.bubble() "
                "for the schedule's own, or measure on real ranks"
            )
        if not self.events:
            raise PipelineError("Pipeline.measured_bubble: no step has run. Fix: call step first")
        span = self.span
        out: dict[int, float] = {}
        for r in sorted({e.rank for e in self.events}):
            busy = sum(e.end - e.start for e in self.events if e.rank == r)
            out[r] = 1.0 - busy / span if span > 0 else 0.0
        return out


@dataclass
class _Step:
    """One real-rank step's working state: the micro-batches, the device, each stage's
    backwards still to run, the inputs and outputs kept for the backward, the transfers between
    stages on this rank, and the last stage's summed loss."""

    micro: list[dict[str, Any]]
    device: torch.device
    left_b: dict[int, int]
    loss: Tensor  # float64, on the device
    inputs: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    local: dict[tuple[str, int, int], Tensor] = field(default_factory=dict)


def _last_forward(acts: Sequence[Any], last: int) -> int:
    """The index in ``acts`` of the last stage's last forward (the loss is complete after it),
    -1 if this rank holds no last stage. Over gloo the loss reaches every rank as an all-reduce
    of it and the other ranks' zeros (``x + 0`` is exact: bitwise a broadcast), started then
    (-1: at once), so no round trip follows the step's last backward. Not over NCCL, which
    orders a communicator's operations: the sends would queue behind it (a deadlock)."""
    return max((i for i, a in enumerate(acts) if a.kind == "F" and a.stage == last), default=-1)


def _bits(t: Tensor) -> Tensor:
    """``t``'s bits as integers of its element size (NaNs compare equal to themselves)."""
    t = t.detach()
    if not t.dtype.is_floating_point:
        return t
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _add_back(earlier: list[tuple[list[nn.Parameter], Tensor]]) -> None:
    """The gradients set aside before a step, added to every copy's (once per weight)."""
    for copies, g in earlier:
        for c in copies:
            c.grad = g.clone() if c.grad is None else g + c.grad


def _grad_of(x: Tensor, stage: int, micro: int) -> Tensor:
    if x.grad is None:
        raise PipelineError(
            f"pipeline: stage {stage}'s input got no gradient in the backward of micro-batch "
            f"{micro} (its output does not depend on it). Fix: report this as a fastdist bug"
        )
    return x.grad
