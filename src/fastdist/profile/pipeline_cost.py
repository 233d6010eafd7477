"""The cost of a pipelined step: :class:`PipelineSpec` (how a step is pipelined over an axis),
the per-stage costs of one micro-batch, the schedule's timeline, each rank's overlapped
data-parallel reduction, and :class:`PipelineCost` (what was charged). See docs/profile.md,
"Pipelines"."""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from fastdist.errors import PipelineError, ProfileError
from fastdist.profile._common import axis_positions, bucket_record, buckets
from fastdist.profile.bytes import ring_steps
from fastdist.profile.cost_model import CostModel
from fastdist.profile.network import Network
from fastdist.profile.records import Memory, Param, Profile, Record, Work

if TYPE_CHECKING:
    from fastdist.train.schedules import Schedule, Slot

__all__ = ["PipelineCost", "PipelineSpec", "PipelineStep", "pipeline_step"]


@dataclass(frozen=True)
class PipelineSpec:
    """How a step is pipelined over a mesh axis: :func:`predict` and :func:`rank_layouts` price it.

    The profile given to :func:`predict` is then **one micro-batch's** step through the whole
    model (forward and backward, on the other axes: tp, sp, ep; nothing over ``axis``), and
    ``microbatches`` of them make a step. The model is cut into ``pp x virtual`` stages (``pp``:
    the size of ``axis`` on the profile's mesh; stage ``j`` on rank ``j % pp``, as
    :mod:`fastdist.train.schedules` places them).

    Attributes:
        microbatches: micro-batches per step.
        schedule: a name in :data:`fastdist.train.schedules.NAMES` (``"gpipe"``, ``"1f1b"``,
            ``"interleaved_1f1b"``).
        virtual: stages per rank: ``1``, or 2 and more for ``"interleaved_1f1b"``.
        axis: the mesh axis the stages lie along.
        boundary_bytes: bytes one rank sends across a stage boundary per micro-batch (the hidden
            states, and as many back for their gradient); ``None``: the output of a traced layer
            module (``model.layers.N``: :attr:`Profile.outputs`, so trace with ``modules=``).

    >>> str(PipelineSpec(8))
    '1f1b, 8 micro-batches'
    """

    microbatches: int
    schedule: str = "1f1b"
    virtual: int = 1
    axis: str = "pp"
    boundary_bytes: int | None = None

    def __post_init__(self) -> None:
        from fastdist.train.schedules import NAMES

        def count(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        if not count(self.microbatches) or not count(self.virtual):
            raise ProfileError(
                "PipelineSpec",
                f"microbatches={self.microbatches!r}, virtual={self.virtual!r}",
                "pass positive ints",
            )
        if self.schedule not in NAMES:
            raise ProfileError(
                "PipelineSpec",
                f"schedule {self.schedule!r} is not known",
                f"use one of {', '.join(NAMES)}",
            )
        interleaved = self.schedule == "interleaved_1f1b"
        if interleaved != (self.virtual > 1):
            raise ProfileError(
                "PipelineSpec",
                f"schedule {self.schedule!r} with virtual={self.virtual}",
                "use virtual >= 2 with 'interleaved_1f1b' and virtual=1 with the others",
            )
        if self.boundary_bytes is not None and not count(self.boundary_bytes):
            raise ProfileError(
                "PipelineSpec",
                f"boundary_bytes={self.boundary_bytes!r}",
                "pass the positive bytes of one micro-batch's hidden states on one rank, or None "
                "to take them from the trace",
            )

    def __str__(self) -> str:
        v = f", {self.virtual} stages per rank" if self.virtual > 1 else ""
        return f"{self.schedule}, {self.microbatches} micro-batches{v}"


@dataclass(frozen=True)
class PipelineCost:
    """What :func:`predict` charged for a :class:`PipelineSpec` (seconds, bytes), as
    ``Prediction.pipeline``.

    Attributes:
        schedule: the schedule (``pp x virtual`` stages, stage ``j`` on rank ``j % pp``).
        boundary_bytes: bytes one rank sends across a boundary per micro-batch and direction.
        transfer: seconds of one such send on the link of the pipeline axis: the time a stage's
            output (or input gradient) takes to reach the next (previous) stage on another
            rank, charged on that dependency, not to either rank.
        forward: per stage, one micro-batch's forward through it: its compute and its
            collectives over the other axes (tp, sp, ep), in series; the sends excluded.
        backward: the same for the backward.
        makespan: the schedule's timeline with those costs and ``transfer`` (:meth:`timeline`):
            first action to last.
        bubble: the share of ``pp x makespan`` that ranks sit idle in that timeline (fill and
            drain, waits for slower stages, waits for transfers).
        finish: per pipeline rank, when its step ends: its last backward, then the data-parallel
            reduction of its stages' gradients not hidden behind that backward.
        memory: per pipeline rank, its memory (its stages' parameters, gradients, optimizer
            state, and activations of ``peak_in_flight(rank)`` micro-batch-stages).
    """

    schedule: Schedule = field(repr=False)
    boundary_bytes: int
    transfer: float
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    makespan: float
    bubble: float
    finish: tuple[float, ...]
    memory: tuple[Memory, ...]

    def timeline(self) -> list[Slot]:
        """The predicted timeline: every action of the step placed in time
        (:meth:`fastdist.train.schedules.Schedule.timeline` with :attr:`forward`,
        :attr:`backward` and :attr:`transfer`)."""
        return self.schedule.timeline(self.forward, self.backward, transfer=self.transfer)


_NUMBERED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")  # the first numbered part: model.layers, 3
_NUMBERED_MODULE = re.compile(r"^(.*)\.(\d+)$")  # a numbered module: model.layers.3


def _pipeline_schedule(pipe: PipelineSpec, pp: int) -> Schedule:
    """``pipe``'s schedule over ``pp`` ranks; the schedule's own refusal as a ProfileError."""
    from fastdist.train.schedules import schedule

    try:
        return schedule(pipe.schedule, pp, pipe.microbatches, pipe.virtual)
    except PipelineError as e:
        problem, _, fix = str(e).partition(". Fix: ")
        raise ProfileError("predict", f"pipeline over {pipe.axis}={pp}: {problem}", fix) from None


def _stage_params(params: Sequence[Param], stages: int) -> list[list[Param]]:
    """The parameters each stage holds, in registration order.

    Parameters of numbered layers (the first ``prefix.N.`` in their names, ``model.layers.3.``)
    go to stage ``N // (layers / stages)``; the others before the first layer (embeddings) to
    the first stage, those after it (final norm, head) to the last. Without numbered layers,
    every parameter is split evenly (``bytes // stages`` on each stage).
    """
    found = [_NUMBERED.match(p.name) for p in params]
    prefix = _layer_prefix(found)
    if prefix is None:
        return [[replace(p, bytes=p.bytes // stages) for p in params] for _ in range(stages)]
    index = [int(m.group(2)) if m and m.group(1) == prefix else None for m in found]
    layers = _layer_count(index, stages, prefix)
    first = next(k for k, i in enumerate(index) if i is not None)
    out: list[list[Param]] = [[] for _ in range(stages)]
    for k, (p, i) in enumerate(zip(params, index)):
        stage = i // (layers // stages) if i is not None else (0 if k < first else stages - 1)
        out[stage].append(p)
    return out


def _layer_prefix(found: Sequence[re.Match[str] | None]) -> str | None:
    """The prefix most numbered names share (``model.layers``), or None."""
    counts = collections.Counter(m.group(1) for m in found if m)
    return counts.most_common(1)[0][0] if counts else None


def _layer_count(index: Sequence[int | None], stages: int, prefix: str) -> int:
    """The layers ``prefix.N`` numbers (the largest N + 1); they must split evenly into
    ``stages``."""
    layers = max(i for i in index if i is not None) + 1
    if layers % stages:
        fits = [d for d in range(1, layers + 1) if layers % d == 0]
        raise ProfileError(
            "predict",
            f"the traced model has {layers} layers ({prefix}.N), which do not split evenly into "
            f"{stages} pipeline stages",
            f"use pp x virtual among {', '.join(map(str, fits))}",
        )
    return layers


def _stage_costs(
    profile: Profile, network: Network | CostModel, stages: int
) -> list[dict[tuple[str, str], float]]:
    """Seconds of one micro-batch's work on each stage, keyed ``(phase, axis)`` (axis ``""``:
    compute).

    Compute runs and collectives of a numbered module (the first ``prefix.N`` of its path, the
    prefix most of them share: ``model.layers.3.mlp``) go to the stage holding layer ``N``
    (``layers / stages`` consecutive layers a stage); the others to the stage of the numbered
    work before them in the same phase, or, before any, to the first stage in the forward (the
    embedding) and the last in the backward (the loss and the head). Without numbered modules
    every stage gets ``1 / stages`` of everything.
    """
    sizes, names = tuple(profile.mesh.shape.values()), profile.mesh.axis_names
    events = [e for e in profile.events or profile.records if isinstance(e, (Work, Record))]

    def cost(e: Work | Record) -> tuple[tuple[str, str], float]:
        if isinstance(e, Work):
            return (e.phase, ""), network.compute_time(e)
        return (e.phase, e.axis), network.collective_time(e, sizes, axis_positions(names, e.axis))

    out: list[dict[tuple[str, str], float]] = [{} for _ in range(stages)]
    found = [_NUMBERED.match(e.module) for e in events]
    prefix = _layer_prefix(found)
    index = [int(m.group(2)) if m and m.group(1) == prefix else None for m in found]
    per = _layer_count(index, stages, prefix) // stages if prefix is not None else 0
    at = {"forward": 0, "backward": stages - 1}
    for e, i in zip(events, index):
        key, dt = cost(e)
        if prefix is None:  # no layers to go by: evenly
            for st in out:
                st[key] = st.get(key, 0.0) + dt / stages
            continue
        if i is not None:
            at[e.phase] = i // per
        st = out[at[e.phase]]
        st[key] = st.get(key, 0.0) + dt
    return out


def _boundary_bytes(profile: Profile, pipe: PipelineSpec) -> int:
    """Bytes one rank sends across a stage boundary per micro-batch: given, or the largest
    output of the outermost numbered modules the trace saw (``model.layers.N``)."""
    if pipe.boundary_bytes is not None:
        return pipe.boundary_bytes
    numbered = [
        (m.group(1), b) for name, b in profile.outputs if (m := _NUMBERED_MODULE.match(name))
    ]
    if not numbered:
        raise ProfileError(
            "predict",
            "the profile has no numbered layer module (e.g. model.layers.0) whose output would "
            "cross a stage boundary",
            "pass PipelineSpec(boundary_bytes=...) (one micro-batch's hidden states on one "
            "rank), or "
            "trace the model with modules=[model] (trace_model does)",
        )
    outer = min((prefix for prefix, _ in numbered), key=len)
    return max(b for prefix, b in numbered if prefix == outer)


@dataclass(frozen=True)
class PipelineStep:
    """One pipelined step as :func:`pipeline_step` priced it (what
    :class:`~fastdist.profile.Prediction` reports of it).

    Attributes:
        cost: the schedule's costs (:class:`PipelineCost`).
        time: when the rank that finishes last finishes.
        by_axis: that rank's collectives per axis over the whole step (the pipeline axis: the
            sends it issues; the data axes: its reduction).
        by_phase: the same per phase.
        compute: that rank's compute over the whole step, packing included.
        memory: the memory of the rank with the most.
        sends: the ``send`` records of one micro-batch between consecutive stages.
    """

    cost: PipelineCost
    time: float
    by_axis: dict[str, float]
    by_phase: dict[str, float]
    compute: float
    memory: Memory
    sends: tuple[Record, ...]


def pipeline_step(
    profile: Profile,
    network: Network | CostModel,
    pipe: PipelineSpec,
    dp: tuple[str, ...],
    bucket_mb: float,
    optimizer: str | float,
) -> PipelineStep:
    """The pipelined step of ``profile`` (one micro-batch through the whole model) on ``network``
    (:func:`~fastdist.profile.predict` with ``pipeline=``; see docs/profile.md, "Pipelines")."""
    sizes = tuple(profile.mesh.shape.values())
    names = profile.mesh.axis_names
    _check_pipeline(profile, pipe, dp)
    pp = profile.mesh.shape[pipe.axis]
    sched = _pipeline_schedule(pipe, pp)
    stages = sched.stages
    # one micro-batch's work on each stage: compute, and collectives per axis
    costs = _stage_costs(profile, network, stages)
    nbytes = _boundary_bytes(profile, pipe) if pp > 1 else 0
    sends = _sends(pipe.axis, pp, stages, nbytes)
    transfer = network.collective_time(sends[0], sizes, [names.index(pipe.axis)]) if sends else 0.0
    # each stage at its own cost; the sends on the timeline's edges between ranks
    fwd = tuple(_on_stage(st, "forward") for st in costs)
    bwd = tuple(_on_stage(st, "backward") for st in costs)
    _check_stage_times(fwd, bwd, sched, pipe)
    slots = sched.timeline(fwd, bwd, transfer=transfer)
    makespan = max(s.end for s in slots)
    bubble = 1.0 - sum(s.end - s.start for s in slots) / (pp * makespan)
    finish, reduce, pack, mems = _ranks_finish(
        profile, network, sched, slots, dp, bucket_mb, optimizer
    )
    c = max(range(pp), key=lambda r: finish[r])  # the rank that finishes last
    by_axis, by_phase = _rank_comm(costs, sched, c, pipe, dp, transfer, reduce[c], bool(sends))
    phases = ("forward", "backward")
    busy = pipe.microbatches * sum(
        _on_stage(costs[j], ph, "") for j in sched.stages_of(c) for ph in phases
    )
    cost = PipelineCost(
        sched, nbytes, transfer, fwd, bwd, makespan, bubble, tuple(finish), tuple(mems)
    )
    return PipelineStep(
        cost,
        finish[c],
        {a: t for a, t in by_axis.items() if t > 0 or a == pipe.axis},
        by_phase,
        busy + pack[c],
        max(mems, key=lambda mem: mem.total),
        sends,
    )


def _check_pipeline(profile: Profile, pipe: PipelineSpec, dp: tuple[str, ...]) -> None:
    """Refuse a pipeline axis the profile's mesh lacks (or a data axis), and a traced step that
    already communicates over it."""
    names = profile.mesh.axis_names
    if pipe.axis not in names or pipe.axis in dp:
        raise ProfileError(
            "predict",
            f"pipeline axis {pipe.axis!r} is not a non-data axis of the profile's mesh {names} "
            f"(data_parallel={dp})",
            "trace on a mesh with the pipeline axis (e.g. MeshLayout((('pp', 2), ...)).mesh) and "
            "name it in PipelineSpec(axis=...), apart from the data axes",
        )
    on_pp = [r for r in profile.records if pipe.axis in r.axis.split("+")]
    if on_pp:
        raise ProfileError(
            "predict",
            f"the traced step issues {on_pp[0].op} over the pipeline axis {on_pp[0].axis!r} "
            f"({on_pp[0].module or 'outside any module'})",
            "trace one micro-batch through the whole model with collectives over the other axes "
            "only: predict adds the pipeline's sends",
        )


def _sends(axis: str, pp: int, stages: int, nbytes: int) -> tuple[Record, ...]:
    """The sends between consecutive stages of one micro-batch: activations forward (sent by
    stage j), their gradients backward (sent by stage j + 1); none when ``pp`` is 1 (stages on
    one rank pass them in memory)."""
    return tuple(
        Record(
            op="send",
            axis=axis,
            n=pp,
            kind="sendrecv",
            size=nbytes,
            bus_bytes=float(nbytes),
            steps=ring_steps("sendrecv", pp),
            phase=phase,
            module=f"pipeline.stage{j if phase == 'forward' else j + 1}",
            dtype=torch.uint8,
            shape=(nbytes,),
        )
        for phase in ("forward", "backward")
        for j in range(stages - 1 if pp > 1 else 0)
    )


def _on_stage(st: dict[tuple[str, str], float], phase: str, axis: str | None = None) -> float:
    """Seconds of one stage's ``phase`` (of one ``axis`` only; ``""``: its compute)."""
    return sum(t for (ph, ax), t in st.items() if ph == phase and axis in (None, ax))


def _check_stage_times(
    fwd: Sequence[float], bwd: Sequence[float], sched: Schedule, pipe: PipelineSpec
) -> None:
    """Refuse a stage whose forward or backward costs nothing (nothing to schedule)."""
    for j in range(len(fwd)):
        if fwd[j] <= 0 or bwd[j] <= 0:
            raise ProfileError(
                "predict",
                f"pipeline stage {j} (rank {sched.rank_of(j)} of {pipe.axis}): its forward "
                f"({fwd[j]:g} s) or backward ({bwd[j]:g} s) of a micro-batch costs nothing on "
                "this network",
                "trace the backward too (call backward() in the step) and charge compute "
                "(Network(..., flops=...) or a CostModel from calibrate)",
            )


def _ranks_finish(
    profile: Profile,
    network: Network | CostModel,
    sched: Schedule,
    slots: Sequence[Slot],
    dp: tuple[str, ...],
    bucket_mb: float,
    optimizer: str | float,
) -> tuple[list[float], list[float], list[float], list[Memory]]:
    """Per pipeline rank: when it finishes (its stages' gradients reduced over ``dp``,
    overlapped with its last backward), its seconds of all-reduce and of packing, its memory."""
    sizes = tuple(profile.mesh.shape.values())
    names = profile.mesh.axis_names
    held = _stage_params(profile.params, sched.stages)
    n_dp = math.prod(profile.mesh.shape[a] for a in dp)
    finish, reduce, pack, mems = [], [], [], []
    for r in range(sched.pp):
        mine = [p for j in sched.stages_of(r) for p in held[j]]
        last = max((s for s in slots if s.rank == r), key=lambda s: s.end)
        end, busy_dp, busy_pack = _reduce_overlapped(
            mine, last.start, last.end, network, sizes, names, dp, n_dp, bucket_mb
        )
        finish.append(end)
        reduce.append(busy_dp)
        pack.append(busy_pack)
        act = profile.activations * sched.peak_in_flight(r) // sched.stages
        mems.append(replace(profile, params=tuple(mine), activations=act).memory(optimizer))
    return finish, reduce, pack, mems


def _rank_comm(
    costs: Sequence[dict[tuple[str, str], float]],
    sched: Schedule,
    c: int,
    pipe: PipelineSpec,
    dp: tuple[str, ...],
    transfer: float,
    reduced: float,
    sends: bool,
) -> tuple[dict[str, float], dict[str, float]]:
    """Rank ``c``'s collectives over the whole step, per axis and per phase: its stages' (times
    the micro-batches), the sends it issues on the pipeline axis, its data-parallel reduction."""
    m, stages = pipe.microbatches, sched.stages
    by_axis: dict[str, float] = {}
    by_phase = {"forward": 0.0, "backward": 0.0}
    for (phase, ax), t in ((k, t) for j in sched.stages_of(c) for k, t in costs[j].items()):
        if ax:
            by_axis[ax] = by_axis.get(ax, 0.0) + m * t
            by_phase[phase] += m * t
    if sends:  # forward out of all but the last stage, backward out of all but the first
        out_f = sum(1 for j in sched.stages_of(c) if j < stages - 1)
        out_b = sum(1 for j in sched.stages_of(c) if j > 0)
        by_axis[pipe.axis] = m * (out_f + out_b) * transfer
        by_phase["forward"] += m * out_f * transfer
        by_phase["backward"] += m * out_b * transfer
    if reduced > 0:
        dp_name = "+".join(dp)
        by_axis[dp_name] = by_axis.get(dp_name, 0.0) + reduced
        by_phase["backward"] += reduced
    return by_axis, by_phase


def _reduce_overlapped(
    params: Sequence[Param],
    start: float,
    end: float,
    network: Network | CostModel,
    sizes: tuple[int, ...],
    names: Sequence[str],
    dp: tuple[str, ...],
    n_dp: int,
    bucket_mb: float,
) -> tuple[float, float, float]:
    """One pipeline rank's data-parallel reduction: ``(when its step ends, seconds of
    all-reduce, seconds of packing)``.

    DataParallel's buckets of ``params`` (reverse registration order); the backward that ends at
    ``end`` (the rank's last, from ``start``) makes their gradients final in proportion to
    their bytes, so bucket ``b`` is ready at ``start + (end - start) x (bytes of buckets 0..b) /
    (all bytes)``; the all-reduces run one after another from then; packing and unpacking
    (4 x the bytes of memory traffic per bucket) comes after the last one.
    """
    if n_dp <= 1 or not params:
        return end, 0.0, 0.0
    total = sum(p.bytes for p in params)
    done = 0
    channel = reduced = packed = 0.0
    for bucket in buckets(params, int(bucket_mb * 2**20)):
        nbytes = sum(params[i].bytes for i in bucket)
        dtype = params[bucket[0]].dtype
        done += nbytes
        r = bucket_record(nbytes, dtype, dp, n_dp)
        dt = network.collective_time(r, sizes, [names.index(a) for a in dp])
        channel = max(channel, start + (end - start) * done / max(total, 1)) + dt
        reduced += dt
        packed += network.compute_time(Work("backward", 0.0, 2, 4.0 * nbytes))
    return max(end, channel) + packed, reduced, packed
