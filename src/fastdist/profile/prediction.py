"""Predict one step of a profile on a network: :func:`predict`, its :class:`Prediction` and the
:class:`MeshLayout` it was made for."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from fastdist.core.mesh import Mesh
from fastdist.errors import ProfileError
from fastdist.profile._common import axis_positions, bucket_record, buckets, data_parallel_axes
from fastdist.profile.cost_model import CostModel
from fastdist.profile.network import Network
from fastdist.profile.pipeline_cost import PipelineCost, PipelineSpec, pipeline_step
from fastdist.profile.records import GradReady, Memory, Profile, Record, Work

__all__ = ["MeshLayout", "Prediction", "predict"]


@dataclass(frozen=True)
class MeshLayout:
    """Axis sizes in mesh order (outer to inner: the last axis varies fastest, so it is the one
    kept inside a node).

    Attributes:
        axes: ``(name, size)`` pairs of the axes of size > 1, outer to inner.
        unit: names of further axes of size 1 (:func:`layouts` leaves them out of ``axes``); the
            :attr:`mesh` has them too, innermost, so a step may use every axis whatever the layout
            (a collective over a size-1 axis moves nothing and is not recorded). Not compared.
        pipeline: how the step is pipelined over ``pipeline.axis`` (:class:`PipelineSpec`), or None.

    >>> dict(MeshLayout((("dp", 4),), unit=("tp",)).mesh.shape)
    {'dp': 4, 'tp': 1}
    >>> str(MeshLayout((("pp", 2), ("tp", 4)), pipeline=PipelineSpec(8)))
    'pp2 x tp4 (1f1b, 8 micro-batches)'
    """

    axes: tuple[tuple[str, int], ...]
    unit: tuple[str, ...] = field(default=(), compare=False)
    pipeline: PipelineSpec | None = None

    @property
    def mesh(self) -> Mesh:
        return Mesh((*self.axes, *((name, 1) for name in self.unit if name not in dict(self.axes))))

    def __str__(self) -> str:
        name = " x ".join(f"{a}{s}" for a, s in self.axes)
        return f"{name} ({self.pipeline})" if self.pipeline is not None else name


@dataclass(frozen=True)
class Prediction:
    """The predicted step of one layout (seconds): in total, and its parts.

    Attributes:
        layout: the layout.
        time: the predicted step: compute and the collectives on the critical path, and the
            part of the overlapped gradient reduction that backward does not hide. With a
            network that charges no compute and no ``data_parallel``, the sum of the
            collectives' times.
        by_axis: time of the collectives per axis (all of it, overlapped or not).
        by_phase: time of the collectives per phase.
        profile: the profile it was predicted from.
        compute: time of the compute (:class:`Work`), including packing the gradient buckets.
        comm: time of every collective (overlapped or not).
        exposed: the part of ``time`` spent waiting for collectives (``time - compute``).
        memory: one rank's memory (:meth:`Profile.memory`), or None when not asked for; with a
            pipeline, the rank with the most.
        fits: ``memory.total`` is within the memory budget (True when no budget is given).
        pipeline: with a :class:`PipelineSpec`, what it charged (:class:`PipelineCost`); then
            ``by_axis``, ``by_phase``, ``compute`` and ``comm`` are one rank's over the whole
            step (the rank that finishes last; on the pipeline axis, the sends it issues), and
            ``exposed`` includes the bubble.
    """

    layout: MeshLayout
    time: float
    by_axis: dict[str, float] = field(default_factory=dict)
    by_phase: dict[str, float] = field(default_factory=dict)
    profile: Profile | None = None
    compute: float = 0.0
    comm: float = 0.0
    exposed: float = 0.0
    memory: Memory | None = None
    fits: bool = True
    pipeline: PipelineCost | None = None


def predict(
    profile: Profile,
    network: Network | CostModel,
    *,
    data_parallel: str | Sequence[str] | None = None,
    bucket_mb: float = 25.0,
    optimizer: str | float = "adamw",
    memory: float | None = None,
    pipeline: PipelineSpec | None = None,
) -> Prediction:
    """Predict one step of ``profile`` on ``network``: its compute, its collectives, and what
    overlaps.

    The traced step is walked in issue order (:attr:`Profile.events`): each compute run costs
    ``network.compute_time`` and each collective ``network.collective_time`` (the ring's
    alpha-beta on the link of its group for a :class:`Network`, the fitted cost of its kind
    and group size for a :class:`CostModel`), one after the other: tensor-parallel
    collectives are on the critical path. With ``data_parallel`` the gradient reduction of
    :class:`fastdist.train.DataParallel` is added and overlapped: the gradients (``Param``)
    are packed into its buckets (reverse registration order, ``bucket_mb`` MiB), a bucket's
    all-reduce over the data axes starts when its last gradient is ready (:class:`GradReady`)
    and the previous bucket has started, the all-reduces run one after another beside the
    backward, and the end of backward waits for the last one. Packing and unpacking a bucket
    (4 x its bytes of memory traffic) is compute on the critical path. Trace the step
    *without* a data-parallel engine attached when you pass ``data_parallel``; an all-reduce
    your step calls itself after backward is charged where it is issued, not overlapped.

    A profile from :func:`record` (no events) is charged collective by collective.

    With ``pipeline`` (:class:`PipelineSpec`) the profile is one micro-batch through the whole
    model, and the step is the pipeline's: each stage runs the traced forward and backward
    (compute and collectives, in series as above) of its layers (by the module that ran
    them: ``model.layers.N``; the embedding on the first stage, the head and loss on the last),
    at its own cost; the hidden states reach the next stage, and their gradient the previous
    one, ``transfer`` seconds after they are made (a ``send`` record on the pipeline axis, per
    boundary and direction; stages on one rank pass them for free), while the sending rank
    goes on computing. The schedule's timeline
    (:meth:`fastdist.train.schedules.Schedule.timeline` with the per-stage costs and the
    transfer on its edges) gives the step and its bubble; each rank then reduces its stages'
    gradients over ``data_parallel``. Memory per rank: its stages' parameters and
    ``peak_in_flight`` micro-batch-stages of activations.
    See docs/profile.md, "Pipelines", for every assumption.

    Args:
        profile: a :func:`trace` of the step (or a :func:`record`).
        network: a :class:`Network` (documented links; compute charged when its ``flops`` etc.
            are set) or a :class:`CostModel` from :func:`calibrate`.
        data_parallel: the data axis (or axes) whose gradient reduction DataParallel overlaps.
        bucket_mb: DataParallel's bucket size (MiB).
        optimizer: for the memory: a name in :data:`OPTIMIZER_STATE` or bytes of state per
            parameter byte.
        memory: a budget in bytes per rank: ``fits`` says whether :meth:`Profile.memory`'s
            total is within it.
        pipeline: how the step is pipelined over one of the mesh's axes (:class:`PipelineSpec`).

    >>> import torch, fastdist as fd
    >>> from fastdist.profile import Link, Network, trace
    >>> mesh = fd.Mesh({"tp": 4})
    >>> prof = trace(lambda x: fd.psum(x, mesh, "tp"), mesh, torch.empty(1000, device="meta"))
    >>> net = Network("toy", 4, Link(1e9, 1e-6), Link(1e8, 1e-5))
    >>> round(predict(prof, net).time * 1e6, 3)   # 6 steps * 1 us + 4000 * 1.5 B / 1 GB/s
    12.0
    """
    names = profile.mesh.axis_names
    dp = data_parallel_axes(data_parallel)
    missing = [a for a in dp if a not in names]
    if missing:
        raise ProfileError(
            "predict",
            f"data_parallel axis {missing[0]!r} is not an axis of the profile's mesh {names}",
            "pass the data axis by the name the step's mesh uses (e.g. 'dp')",
        )
    if pipeline is not None:
        return _predict_pipelined(profile, network, pipeline, dp, bucket_mb, optimizer, memory)
    walk = _Walk(profile, network, dp, bucket_mb)
    walk.run()
    mem = profile.memory(optimizer) if memory is not None or profile.params else None
    return Prediction(
        _layout_of(profile.mesh, None),
        walk.t,
        walk.by_axis,
        walk.by_phase,
        profile,
        compute=walk.compute,
        comm=walk.comm,
        exposed=walk.t - walk.compute,
        memory=mem,
        fits=memory is None or (mem is not None and mem.total <= memory),
    )


def _layout_of(mesh: Mesh, pipeline: PipelineSpec | None) -> MeshLayout:
    """The layout of a profile's mesh: its axes of size > 1 (else its first), the others unit."""
    names, sizes = mesh.axis_names, tuple(mesh.shape.values())
    axes = tuple((a, n) for a, n in zip(names, sizes) if n > 1) or tuple(zip(names, sizes))[:1]
    return MeshLayout(axes, tuple(a for a in names if a not in dict(axes)), pipeline)


def _predict_pipelined(
    profile: Profile,
    network: Network | CostModel,
    pipe: PipelineSpec,
    dp: tuple[str, ...],
    bucket_mb: float,
    optimizer: str | float,
    memory: float | None,
) -> Prediction:
    """:func:`predict` of a pipelined step (see docs/profile.md, "Pipelines")."""
    step = pipeline_step(profile, network, pipe, dp, bucket_mb, optimizer)
    return Prediction(
        _layout_of(profile.mesh, pipe),
        step.time,
        step.by_axis,
        step.by_phase,
        replace(
            profile,
            records=profile.records + step.sends,
            events=profile.events + step.sends if profile.events else (),
        ),
        compute=step.compute,
        comm=sum(step.by_axis.values()),
        exposed=step.time - step.compute,
        memory=step.memory,
        fits=memory is None or step.memory.total <= memory,
        pipeline=step.cost,
    )


class _Walk:
    """The traced step walked in issue order (:func:`predict` without a pipeline): compute and
    collectives in series, DataParallel's bucket all-reduces beside the backward."""

    def __init__(
        self,
        profile: Profile,
        network: Network | CostModel,
        dp: tuple[str, ...],
        bucket_mb: float,
    ) -> None:
        self.profile, self.network, self.dp = profile, network, dp
        self.sizes = tuple(profile.mesh.shape.values())
        self.by_axis: dict[str, float] = {}
        self.by_phase: dict[str, float] = {}
        self.t = self.compute = self.comm = 0.0
        self.n_dp = math.prod(profile.mesh.shape[a] for a in dp)
        self.buckets = (
            buckets(profile.params, int(bucket_mb * 2**20))
            if self.n_dp > 1 and profile.params
            else []
        )
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.ready: list[set[int]] = [set() for _ in self.buckets]
        self.launched = 0
        self.channel = 0.0  # when the data-parallel all-reduces in flight are done

    def collective(self, r: Record) -> float:
        dt = self.network.collective_time(
            r, self.sizes, axis_positions(self.profile.mesh.axis_names, r.axis)
        )
        self.comm += dt
        self.by_axis[r.axis] = self.by_axis.get(r.axis, 0.0) + dt
        self.by_phase[r.phase] = self.by_phase.get(r.phase, 0.0) + dt
        return dt

    def work(self, w: Work) -> float:
        dt = self.network.compute_time(w)
        self.compute += dt
        return dt

    def launch(self) -> None:
        """Pack the next bucket and start its all-reduce once the previous one has started."""
        params = self.profile.params
        members = self.buckets[self.launched]
        nbytes = sum(params[i].bytes for i in members)
        dtype = params[members[0]].dtype
        self.t += self.work(Work("backward", 0.0, 1, 2.0 * nbytes))  # pack
        r = bucket_record(nbytes, dtype, self.dp, self.n_dp)
        self.channel = max(self.channel, self.t) + self.collective(r)
        self.launched += 1

    def run(self) -> None:
        events: tuple[Work | Record | GradReady, ...] = self.profile.events or self.profile.records
        last = max(
            [i for i, e in enumerate(events) if isinstance(e, GradReady)]
            + [
                i
                for i, e in enumerate(events)
                if isinstance(e, (Work, Record)) and e.phase == "backward"
            ],
            default=-1,
        )
        n = len(self.buckets)
        for i, e in enumerate(events):
            if isinstance(e, Work):
                self.t += self.work(e)
            elif isinstance(e, Record):
                self.t += self.collective(e)
            elif self.buckets and e.param in self.bucket_of:
                self.ready[self.bucket_of[e.param]].add(e.param)
                while self.launched < n and len(self.ready[self.launched]) == len(
                    self.buckets[self.launched]
                ):
                    self.launch()
            if i == last and self.buckets:  # the end of backward launches the rest and waits
                while self.launched < n:
                    self.launch()
                self.t = max(self.t, self.channel)
                for b in self.buckets:  # unpack
                    nbytes = sum(self.profile.params[j].bytes for j in b)
                    self.t += self.work(Work("backward", 0.0, 1, 2.0 * nbytes))
