"""Running a pipeline schedule: `Pipeline` (the stages held here, one step of a schedule on
simulated or real ranks) and the transfers between ranks along ``pp`` (headers checked, sends
asynchronous, receives with the mesh's timeout, posted one action ahead once their shapes are
known)."""

from __future__ import annotations

import math
import os
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from fastdist.comm.connect import reset as reset_mesh
from fastdist.core.mesh import Mesh
from fastdist.errors import CommError, PipelineError
from fastdist.train.pipeline.split import STAGE_INPUT
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


# ====================================================================== transfers
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_HEADER = 16  # int64 slots: kind, microbatch, stage, dtype, ndim, schedule (3), shape...
_SHAPE = 8  # where the shape starts: at most _HEADER - _SHAPE = 8 dims
_TIED_TAG = 1 << 28  # the tags of a tied weight's gradient halves (above every transfer's)


def _schedule_id(sched: Schedule, layers: Sequence[range]) -> tuple[int, int, int]:
    """What a transfer's header says about the sender's pipeline: ``(checksum of its schedule's
    actions and layer split, micro-batches, stages)``, equal on every rank that built the same
    pipeline (a checksum, not Python's per-process ``hash``)."""
    text = repr(
        (
            sched.name,
            [[str(a) for a in acts] for acts in sched.actions],
            [(r.start, r.stop) for r in layers],
        )
    )
    return zlib.crc32(text.encode()), sched.microbatches, sched.stages


class _Ranks:
    """Transfers between the ranks of the pipeline axis of a real mesh: asynchronous sends,
    receives with the mesh's timeout, headers checked.

    A transfer's bytes move only once its receive is posted (gloo's rendezvous: the sender's
    data waits for the receiver's notice), so a receive posted when the action needs it waits,
    idle, for two processes' I/O threads to wake (on busy cores, for a time slice). `post`
    starts the receive of the next action's input before this rank computes the current one:
    the bytes arrive meanwhile. Only transfers whose shape an earlier step's header taught
    are posted early (a first step reads the header first)."""

    def __init__(self, mesh: Mesh, axis: str, schedule_id: tuple[int, int, int]) -> None:
        from fastdist.comm.axes import axis_comm

        self.ac = axis_comm(mesh, axis, "pipeline")
        self.axis = axis
        self.schedule_id = schedule_id  # (checksum, micro-batches, stages): `_schedule_id`
        self.index = self.ac.index
        self.pending: list[tuple[Any, Tensor, str]] = []  # (work, payload, what it carries)
        # (step's input signature, kind, micro-batch, stage) -> (shape, dtype) of the transfer,
        # once its header went (sent) / came (known): the same step shapes move without one
        self.sent: dict[tuple[Any, ...], tuple[tuple[int, ...], torch.dtype]] = {}
        self.known: dict[tuple[Any, ...], tuple[tuple[int, ...], torch.dtype]] = {}
        self.signature: Any = None  # the running step's (see Pipeline.step)
        # (kind, micro-batch, stage) -> (work, buffer) of a receive posted ahead (`post`)
        self.posted: dict[tuple[str, int, int], tuple[Any, Tensor]] = {}

    def forget(self) -> None:
        """Drop what the headers taught (after a failure, with `Pipeline.reset` on every rank)."""
        self.sent.clear()
        self.known.clear()
        self.posted.clear()

    def _group(self, device: torch.device) -> Any:
        return self.ac.process_group("pipeline", device.type)

    def send(self, t: Tensor, peer: int, kind: str, micro: int, stage: int) -> None:
        import torch.distributed as dist

        t = t.detach().contiguous()
        if t.dtype not in _DTYPES or t.dim() > _HEADER - _SHAPE:
            raise PipelineError(
                f"pipeline: stage {stage} hands on a {t.dtype} tensor of {t.dim()} dims. Fix: "
                f"stage outputs are floating-point hidden states of at most {_HEADER - _SHAPE} dims"
            )
        head = torch.zeros(_HEADER, dtype=torch.int64)
        head[:_SHAPE] = torch.tensor(
            [0 if kind == "F" else 1, micro, stage, _DTYPES.index(t.dtype), t.dim()]
            + list(self.schedule_id)
        )
        head[_SHAPE : _SHAPE + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        tag = self._tag(kind, micro, stage)
        group = self._group(t.device)
        # `stage` receives: the stage after this one (forward) or before it (backward)
        what = (
            f"the delivery of the {'activation' if kind == 'F' else 'gradient'} of micro-batch "
            f"{micro} from stage {stage - 1 if kind == 'F' else stage + 1} for stage {stage} "
            f"({self.axis}={peer}, rank {self.ac.ranks[peer]})"
        )
        key = (self.signature, kind, micro, stage)
        seen = self.sent.get(key)
        if seen is not None and seen != (tuple(t.shape), t.dtype):
            raise PipelineError(
                f"pipeline: stage {stage - 1 if kind == 'F' else stage + 1} hands on a "
                f"{t.dtype} tensor of shape {tuple(t.shape)} where the same inputs gave "
                f"{seen[1]} {seen[0]} before. Fix: report this as a fastdist bug"
            )
        # the header once per step shapes (tag 2k), then the tensor (tag 2k + 1)
        payloads = [(t, 2 * tag + 1)] if seen else [(head.to(t.device), 2 * tag), (t, 2 * tag + 1)]
        for payload, ptag in payloads:
            work = self.ac.run(
                "pipeline send",
                lambda p=payload, g=ptag: dist.isend(p, group=group, group_dst=peer, tag=g),
                what=what,
            )
            self.pending.append((work, payload, what))
        self.sent[key] = (tuple(t.shape), t.dtype)

    def _what_recv(self, peer: int, kind: str, micro: int, stage: int) -> str:
        # `stage` receives; the sender holds the stage before it (forward) or after it (backward)
        return (
            f"the {'activation' if kind == 'F' else 'gradient'} of micro-batch {micro} from "
            f"stage {stage - 1 if kind == 'F' else stage + 1} ({self.axis}={peer}, rank "
            f"{self.ac.ranks[peer]}) for stage {stage}"
        )

    def post(self, peer: int, kind: str, micro: int, stage: int, device: torch.device) -> None:
        """Start receiving the tensor `recv` will return for this transfer, if an earlier step's
        header taught its shape (else `recv` reads the header first); at most once."""
        import torch.distributed as dist

        seen = self.known.get((self.signature, kind, micro, stage))
        if seen is None or (kind, micro, stage) in self.posted:
            return
        buf = torch.empty(seen[0], dtype=seen[1], device=device)
        group, tag = self._group(device), 2 * self._tag(kind, micro, stage) + 1
        work = self.ac.run(
            "pipeline recv",
            lambda: dist.irecv(buf, group=group, group_src=peer, tag=tag),
            what=self._what_recv(peer, kind, micro, stage),
        )
        self.posted[(kind, micro, stage)] = (work, buf)

    def recv(self, peer: int, kind: str, micro: int, stage: int, device: torch.device) -> Tensor:
        import torch.distributed as dist

        what = self._what_recv(peer, kind, micro, stage)
        timeout = self.ac.comm.timeout
        posted = self.posted.pop((kind, micro, stage), None)
        if posted is not None:
            work, buf = posted
            self.ac.run("pipeline recv", lambda: _work(work).wait(timeout), what=what)
            return buf
        tag = self._tag(kind, micro, stage)
        group = self._group(device)

        def receive(buf: Tensor, t: int) -> None:
            self.ac.run(
                "pipeline recv",
                lambda: _work(dist.irecv(buf, group=group, group_src=peer, tag=t)).wait(timeout),
                what=what,
            )

        key = (self.signature, kind, micro, stage)
        seen = self.known.get(key)
        if seen is None:  # the first step of these input shapes: the header says what comes
            seen = self._read_header(receive, peer, kind, micro, stage, tag, what, device)
        out = torch.empty(seen[0], dtype=seen[1], device=device)
        receive(out, 2 * tag + 1)
        self.known[key] = seen
        return out

    def _read_header(
        self,
        receive: Callable[[Tensor, int], None],
        peer: int,
        kind: str,
        micro: int,
        stage: int,
        tag: int,
        what: str,
        device: torch.device,
    ) -> tuple[tuple[int, ...], torch.dtype]:
        """Receive the header of ``what`` (tag ``2 tag``) and check it; the shape and dtype of
        the tensor that follows."""
        head = torch.empty(_HEADER, dtype=torch.int64, device=device)
        receive(head, 2 * tag)
        k, m, s, code, ndim, *theirs = (int(v) for v in head[:_SHAPE].tolist())
        if (
            (k, m, s) != (0 if kind == "F" else 1, micro, stage)
            or tuple(theirs) != self.schedule_id
            or not 0 <= code < len(_DTYPES)
        ):
            _, mine_m, mine_s = self.schedule_id
            same_counts = tuple(theirs[1:]) == (mine_m, mine_s)
            problem = (
                f"expected {what}, but {self.axis}={peer} (rank {self.ac.ranks[peer]}) sent "
                f"{'FB'[k] if k in (0, 1) else '?'}{m} of stage {s} from a pipeline of "
                f"{theirs[1]} micro-batches over {theirs[2]} stages (this rank: {mine_m} over "
                f"{mine_s}{', but another schedule or layer split' if same_counts else ''}): "
                "the ranks run different schedules"
            )
            # drop the groups so that the peers waiting on this rank fail now, not at the timeout
            self.ac.comm.abandon(f"fastdist.pipeline recv failed on this rank: {problem}")
            raise CommError(
                "pipeline recv",
                self.axis,
                list(self.ac.ranks),
                self.ac.rank,
                problem,
                "build the Pipeline with the same schedule, micro-batches, virtual stages and "
                "layers_per_stage on every rank; then pipe.reset() on every rank",
            )
        return tuple(int(v) for v in head[_SHAPE : _SHAPE + ndim].tolist()), _DTYPES[code]

    def finish(self) -> None:
        """Wait for this step's sends (the peers received them, or the timeout names them)."""
        timeout = self.ac.comm.timeout
        pending, self.pending = self.pending, []
        for work, _, what in pending:
            self.ac.run("pipeline send", lambda w=work: w.wait(timeout), what=what)

    def swap(self, t: Tensor, peer: int, what: str) -> Tensor:
        """Send ``t`` to ``peer`` and receive its tensor of the same shape and dtype (checked
        first), e.g. the two halves of a tied weight's gradient."""
        import torch.distributed as dist

        group, timeout = self._group(t.device), self.ac.comm.timeout
        t = t.detach().contiguous()
        kind = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
        head = torch.tensor([t.dim(), kind, *t.shape, *[0] * (_HEADER - t.dim())])
        theirs = torch.empty_like(head)
        out = torch.empty_like(t)
        for mine, buf, tag in ((head.to(t.device), theirs, _TIED_TAG), (t, out, _TIED_TAG + 1)):
            sent = self.ac.run(
                "pipeline send",
                lambda m=mine, g=tag: dist.isend(m, group=group, group_dst=peer, tag=g),
                what=what,
            )
            self.ac.run(
                "pipeline recv",
                lambda b=buf, g=tag: _work(dist.irecv(b, group=group, group_src=peer, tag=g)).wait(
                    timeout
                ),
                what=what,
            )
            self.ac.run("pipeline send", lambda w=sent: _work(w).wait(timeout), what=what)
            if tag == _TIED_TAG and not torch.equal(theirs.cpu(), head):
                raise PipelineError(
                    f"pipeline: {what}: this rank holds shape {tuple(t.shape)}, {self.axis}="
                    f"{peer} another ({theirs.tolist()}): the tied weights are split differently "
                    "on the first and the last stage. Fix: a plan that splits the input and "
                    "output embeddings alike (the family's ready plan does)"
                )
        return out

    @staticmethod
    def _tag(kind: str, micro: int, stage: int) -> int:
        return (micro * 4096 + stage) * 2 + (0 if kind == "F" else 1)


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
    ) -> None:
        self.mesh, self.axis, self.schedule, self.stage_mesh = mesh, axis, sched, stage_mesh
        self.stages, self.layers = stages, layers
        self.tied = dict(tied or {})
        self.events: list[Event] = []
        self.span = 0.0  # the last step's wall time on this rank (real ranks), seconds
        self._ranks = (
            _Ranks(mesh, axis, _schedule_id(sched, layers)) if mesh.backend is not None else None
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
        try:
            norms = {j: total_norm(self.stages[j], p, None, op) for j in sorted(self.stages)}
        finally:
            for b, g in hidden:
                b.grad = g
        for j, (total, gs, _) in norms.items():
            grads[j] = gs + [g for _, g in hidden] if j == self.schedule.stages - 1 else gs
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

        Args:
            batch: the model's keyword inputs for the whole batch: ``input_ids`` and ``labels``
                (required; or ``shift_labels``, labels already aligned with the positions as
                transformers' loss takes them), optionally ``attention_mask``,
                ``position_ids``. Every rank along
                the pipeline axis gets the same batch (stages after the first read only its
                shape and masks, the last stage its labels). On a simulated mesh each carries
                the leading rank dim ``[mesh.size, batch, ...]``.

        Returns:
            the loss of the whole batch (the mean over its predicted tokens), detached: on a
            simulated mesh ``[mesh.size]`` (every rank's), on real ranks a 0-d tensor on every
            rank of the pipeline axis.
        """
        micro = self._micro_batches(batch)
        self._check_same_batch(batch)
        if self._ranks is not None:
            # the first step with these input shapes sends every transfer's header (shape,
            # dtype, the sender's pipeline); later ones only the tensors
            self._ranks.signature = tuple(
                sorted(
                    (k, tuple(v.shape), v.dtype) for k, v in batch.items() if isinstance(v, Tensor)
                )
            )
        self.events = []
        if self.simulated:
            return self._run_simulated(micro)
        return self._run_ranks(micro)

    def _check_same_batch(self, batch: Mapping[str, Any]) -> None:
        """Every rank along the pipeline axis must be given the same batch: each stage reads its
        own copy (the first its ids, every stage the masks and positions, the last the labels),
        so copies that differ would mix two batches into one loss. Simulated: the rows are
        compared; real ranks: a digest of each input, all-gathered over the axis (one small
        collective per step)."""
        keys = sorted(k for k, v in batch.items() if isinstance(v, Tensor))
        if self.simulated:
            pp, size = self.schedule.pp, self.mesh.size
            for k in keys:
                v = batch[k]
                # [pp, mesh size, ...]: row r holds every rank's copy as the rank with pp=r has it
                rows = v.index_select(0, self._peers()).view(pp, size, *v.shape[1:])
                if not bool((rows == rows[:1]).all()):
                    self._differs(k)
            return
        from fastdist.ops import all_gather_invariant

        digests = []
        for k in keys:
            v = batch[k].detach().reshape(-1).long()  # [n]
            weights = torch.arange(v.numel(), device=v.device) % 1000003 + 1  # [n]
            digests.append(torch.stack([v.sum(), (v * weights).sum()]))
        mine = torch.stack(digests).reshape(1, -1)  # [1, 2 * len(keys)], int64
        every = all_gather_invariant(mine, self.mesh, self.axis, dim=0)  # [pp, 2 * len(keys)]
        for i, k in enumerate(keys):
            if not bool((every[:, 2 * i : 2 * i + 2] == every[:1, 2 * i : 2 * i + 2]).all()):
                self._differs(k)

    def _differs(self, key: str) -> None:
        raise PipelineError(
            f"Pipeline.step: the ranks along {self.axis!r} were given different {key} (every "
            "stage reads its own copy of the batch: the first its input_ids, every stage the "
            "masks and positions, the last the labels, so different copies would mix two "
            "batches into one loss). Fix: give every rank with the same coordinates on the "
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
        return {k: v.index_select(0, rows) if isinstance(v, Tensor) else v for k, v in mb.items()}

    def _forward(self, j: int, mb: Mapping[str, Any], x: Tensor | None) -> Tensor:
        pm = self.stages[j]
        kwargs = dict(mb)
        if j != self.schedule.stages - 1:
            for key in ("labels", "shift_labels", "num_items_in_batch"):
                kwargs.pop(key, None)
        per_rank = {STAGE_INPUT: x} if x is not None else {}
        out = pm.call_with(per_rank, **kwargs)
        if j == self.schedule.stages - 1:
            out = out.loss if hasattr(out, "loss") else out["loss"]
        assert isinstance(out, Tensor)  # the loss, or the last own layer's output (StageHooks)
        return out

    def _backward(self, j: int, y: Tensor, g: Tensor | None, last_of_stage: bool) -> None:
        pm = self.stages[j]
        ctx = pm.engine.no_sync() if pm.engine is not None and not last_of_stage else _nothing()
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
        for a in s.order():
            j, m = a.stage, a.microbatch
            start = time.perf_counter() - t0
            if a.kind == "F":
                x = acts.pop((j, m), None)
                if x is not None:
                    x = x.detach().requires_grad_(True)
                    inputs[(j, m)] = x
                y = self._forward(j, self._rows(j, micro[m]), x)
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
        self._sum_tied()
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
        inputs: dict[tuple[int, int], Tensor] = {}
        outputs: dict[tuple[int, int], Tensor] = {}
        local: dict[tuple[str, int, int], Tensor] = {}  # transfers between stages on this rank
        left_b = {j: s.microbatches for j in s.stages_of(me)}
        loss = torch.zeros((), dtype=torch.float64, device=device)
        acts = s.actions[me]
        t0 = time.perf_counter()
        try:
            self._post_next(acts, -1, device)  # the first action's input
            for i, a in enumerate(acts):
                j, m = a.stage, a.microbatch
                if a.kind == "F":
                    x = None
                    if j > 0:
                        src = s.rank_of(j - 1)
                        x = (
                            local.pop(("F", m, j))
                            if src == me
                            else ranks.recv(src, "F", m, j, device)
                        )
                        x = x.detach().requires_grad_(True)
                        inputs[(j, m)] = x
                    self._post_next(acts, i, device)
                    start = time.perf_counter() - t0  # compute only: the wait is idle time
                    y = self._forward(j, micro[m], x)
                    end = time.perf_counter() - t0
                    outputs[(j, m)] = y
                    if j == last:
                        loss += y.detach().to(torch.float64)
                    elif s.rank_of(j + 1) == me:
                        local[("F", m, j + 1)] = y
                    else:
                        ranks.send(y, s.rank_of(j + 1), "F", m, j + 1)
                else:
                    g = None
                    if j < last:
                        src = s.rank_of(j + 1)
                        g = (
                            local.pop(("B", m, j))
                            if src == me
                            else ranks.recv(src, "B", m, j, device)
                        )
                    left_b[j] -= 1
                    self._post_next(acts, i, device)
                    start = time.perf_counter() - t0
                    self._backward(j, outputs.pop((j, m)), g, not left_b[j])
                    end = time.perf_counter() - t0
                    x = inputs.pop((j, m), None)
                    if x is not None:
                        gx = _grad_of(x, j, m)
                        if s.rank_of(j - 1) == me:
                            local[("B", m, j - 1)] = gx
                        else:
                            ranks.send(gx, s.rank_of(j - 1), "B", m, j - 1)
                self.events.append(Event(me, a.kind, m, j, start, end))
            ranks.finish()
            self._sum_tied()
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
        from fastdist.ops import broadcast

        # the last stage's loss on every rank of the pipeline axis
        dtype = next(self.parameters()).dtype
        return broadcast(loss, self.mesh, self.axis, src=s.rank_of(last)).to(dtype)

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


class _nothing:  # noqa: N801 - a context manager used like contextlib.nullcontext
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _grad_of(x: Tensor, stage: int, micro: int) -> Tensor:
    if x.grad is None:
        raise PipelineError(
            f"pipeline: stage {stage}'s input got no gradient in the backward of micro-batch "
            f"{micro} (its output does not depend on it). Fix: report this as a fastdist bug"
        )
    return x.grad


def _work(work: Any) -> Any:
    """A started transfer's handle (torch types it as optional)."""
    assert work is not None
    return work
