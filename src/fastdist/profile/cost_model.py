"""A cost model measured on the job: :class:`CostModel` of :class:`Fit` per collective kind and
group size, from the :class:`Point` s :func:`fastdist.profile.calibrate` measured, with the
device's compute; saved and loaded as JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fastdist.errors import ProfileError
from fastdist.profile._common import compute_time, in_node
from fastdist.profile.bytes import bus_factor, ring_steps
from fastdist.profile.records import Record, Work

__all__ = ["CALIBRATED_KINDS", "CostModel", "Fit", "Point"]


#: the collective kinds :func:`calibrate` measures, and the fastdist op that measures each
CALIBRATED_KINDS = ("allreduce", "allgather", "reducescatter", "alltoall", "sendrecv")
# kinds priced with another kind's fit (the same bus factor (n-1)/n, or one hop)
_SAME_AS = {"gather": "allgather", "scatter": "allgather", "broadcast": "allgather"}


@dataclass(frozen=True)
class Fit:
    """``time = latency + size / bandwidth`` of one collective kind over a group of ``n`` ranks.

    Attributes:
        kind: the nccl-tests kind (:func:`bus_factor`).
        n: ranks in the group.
        intra: the groups it was measured on lie in one node (``CostModel.gpus_per_node``).
        latency: seconds (the fit's intercept).
        per_byte: seconds per byte of S (nccl-tests' size of ``kind``).
        error: the largest ``|fit / measured - 1|`` over the points it was fitted to.
    """

    kind: str
    n: int
    intra: bool
    latency: float
    per_byte: float
    error: float

    def time(self, size: float) -> float:
        return self.latency + self.per_byte * size


@dataclass(frozen=True)
class Point:
    """One measurement of :func:`calibrate`: the median over repetitions of the slowest rank."""

    kind: str
    axis: str
    n: int
    intra: bool
    size: int
    seconds: float


@dataclass(frozen=True)
class CostModel:
    """A cost model measured on a running job (:func:`calibrate`); the planner takes it where it
    takes a :class:`Network`.

    Collectives: one :class:`Fit` per (kind, group size, in a node or not). A group size that
    was not measured is priced by the rule :meth:`fit` states. Compute: measured matmul FLOP/s,
    memory bandwidth and per-kernel time, as :meth:`Network.compute_time` charges them.

    Attributes:
        name: for tables.
        gpus_per_node: ranks per node of the job it was measured on.
        fits: the fitted collectives.
        flops: matmul FLOP/s of one rank (every rank computing at once).
        memory_bandwidth: bytes/s of an elementwise kernel on one rank (every rank at once).
        kernel_latency: seconds per aten kernel of a chain of tiny ops, forward and backward.
        points: the measurements the fits come from.
        kernel_times: ``(key, seconds)`` of each kernel :func:`calibrate_kernels` replayed (one
            call, the kernel alone); empty: every kernel is charged by the rates above.
        kernel_overhead: seconds added to each replayed kernel's time for what a step spends
            around it (autograd, Python, dispatch beyond the kernel; see
            :func:`calibrate_kernels`).
    """

    name: str
    gpus_per_node: int
    fits: tuple[Fit, ...]
    flops: float
    memory_bandwidth: float
    kernel_latency: float
    points: tuple[Point, ...] = ()
    kernel_times: tuple[tuple[str, float], ...] = ()
    kernel_overhead: float = 0.0
    _times: dict[str, float] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_times", dict(self.kernel_times))

    def fit(self, kind: str, n: int, intra: bool = True) -> Fit:
        """The cost of ``kind`` over ``n`` ranks.

        A measured group size: its fit. Between two measured sizes ``n1 < n < n2``: latency and
        per-byte cost interpolated linearly in ``n``. Outside the measured sizes: the nearest
        measured fit scaled as the ring scales, latency by ``steps(n) / steps(n0)`` (``2(n-1)``
        for all-reduce, ``n-1`` otherwise, 1 for send/recv) and per-byte cost by
        ``bus_factor(n) / bus_factor(n0)``. ``gather``, ``scatter`` and ``broadcast`` are priced
        as ``allgather``.

        Args:
            kind: the nccl-tests kind (`bus_factor`).
            n: the ranks in the group.
            intra: the group lies in one node.

        Returns:
            the `Fit` that prices ``kind`` over ``n`` ranks.
        """
        kind = _SAME_AS.get(kind, kind)
        have = sorted((f.n, f) for f in self.fits if f.kind == kind and f.intra == intra)
        if not have:
            where = "inside a node" if intra else "across nodes"
            raise ProfileError(
                "CostModel",
                f"{self.name!r} has no measurement of {kind} over a group {where}",
                "calibrate on a job whose mesh has such a group (e.g. an axis that crosses "
                "nodes), with that kind in kinds=",
            )
        for m, f in have:
            if m == n:
                return f
        below = [f for m, f in have if m < n]
        above = [f for m, f in have if m > n]
        if below and above:
            lo, hi = below[-1], above[0]
            w = (n - lo.n) / (hi.n - lo.n)
            return Fit(
                kind,
                n,
                intra,
                lo.latency + w * (hi.latency - lo.latency),
                lo.per_byte + w * (hi.per_byte - lo.per_byte),
                max(lo.error, hi.error),
            )
        near = below[-1] if below else above[0]
        alpha = ring_steps(kind, n) / max(ring_steps(kind, near.n), 1)
        beta = bus_factor(kind, n) / max(bus_factor(kind, near.n), 1e-12)
        return Fit(kind, n, intra, near.latency * alpha, near.per_byte * beta, near.error)

    def collective_time(self, r: Record, mesh_sizes: Sequence[int], axes: Sequence[int]) -> float:
        """The fitted time of one collective: ``latency + per_byte x size`` of its kind and
        group size (see :meth:`fit`)."""
        return self.fit(r.kind, r.n, in_node(mesh_sizes, axes, self.gpus_per_node)).time(r.size)

    def compute_time(self, work: Work) -> float:
        """Seconds of ``work``: each of its kernels (:attr:`Work.calls`) that
        :func:`calibrate_kernels` timed costs its replayed time plus ``kernel_overhead``; the
        others (and work without calls) as :meth:`Network.compute_time` charges them, with the
        measured rates."""
        if not self._times or not work.calls:
            return compute_time(work, self.flops, self.memory_bandwidth, self.kernel_latency)
        t = 0.0
        for key, count, flops, nbytes in work.calls:
            known = self._times.get(key)
            if known is not None:
                t += count * (known + self.kernel_overhead)
            else:
                one = Work(work.phase, flops, 1, nbytes)
                t += count * compute_time(
                    one, self.flops, self.memory_bandwidth, self.kernel_latency
                )
        return t

    def to_json(self) -> str:
        """The model as JSON (:meth:`from_json` reads it back)."""
        return json.dumps(
            {
                "format": "fastdist.profile.CostModel/1",
                "name": self.name,
                "gpus_per_node": self.gpus_per_node,
                "flops": self.flops,
                "memory_bandwidth": self.memory_bandwidth,
                "kernel_latency": self.kernel_latency,
                "fits": [asdict(f) for f in self.fits],
                "points": [asdict(p) for p in self.points],
                "kernel_overhead": self.kernel_overhead,
                "kernel_times": dict(self.kernel_times),
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        """Read :meth:`to_json`'s output."""
        try:
            d = json.loads(text)
            if d.get("format") != "fastdist.profile.CostModel/1":
                raise ValueError(f"format {d.get('format')!r}")
            return cls(
                str(d["name"]),
                int(d["gpus_per_node"]),
                tuple(Fit(**f) for f in d["fits"]),
                float(d["flops"]),
                float(d["memory_bandwidth"]),
                float(d["kernel_latency"]),
                tuple(Point(**p) for p in d["points"]),
                tuple((str(k), float(v)) for k, v in d.get("kernel_times", {}).items()),
                float(d.get("kernel_overhead", 0.0)),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ProfileError(
                "CostModel.from_json",
                f"not a saved CostModel ({e})",
                "pass the text CostModel.to_json() (or save()) wrote",
            ) from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_json` to ``path``."""
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModel:
        """Read a model :meth:`save` wrote."""
        return cls.from_json(Path(path).read_text())


def fit_points(points: Sequence[Point]) -> tuple[Fit, ...]:
    """One Fit per (kind, n, intra): least squares of the relative error of ``a + b S`` (in plain
    floats: every rank fits bit-identical models), a and b kept >= 0."""
    groups: dict[tuple[str, int, bool], list[Point]] = {}
    for pt in points:
        groups.setdefault((pt.kind, pt.n, pt.intra), []).append(pt)
    fits = []
    for (kind, n, intra), pts in sorted(groups.items()):
        # rows u = 1/t, v = S/t: minimise sum (a u + b v - 1)^2 (the normal equations)
        u = [1.0 / p.seconds for p in pts]
        v = [p.size / p.seconds for p in pts]
        uu, uv, vv = sum(x * x for x in u), sum(x * y for x, y in zip(u, v)), sum(y * y for y in v)
        su, sv = sum(u), sum(v)
        det = uu * vv - uv * uv
        alpha, beta = (
            ((su * vv - sv * uv) / det, (sv * uu - su * uv) / det) if det > 0 else (-1.0, -1.0)
        )
        if alpha < 0 or beta < 0:  # one term alone: the better of the two
            only = [(su / uu, 0.0), (0.0, sv / vv)]
            alpha, beta = min(
                only, key=lambda ab: max(abs((ab[0] + ab[1] * p.size) / p.seconds - 1) for p in pts)
            )
        err = max(abs((alpha + beta * p.size) / p.seconds - 1) for p in pts)
        fits.append(Fit(kind, n, intra, alpha, beta, err))
    return tuple(fits)
