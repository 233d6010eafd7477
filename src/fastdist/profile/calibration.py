"""Measure a :class:`CostModel` on the running job: :func:`calibrate` (collectives and compute
rates), :func:`calibrate_kernels` (the traced steps' kernels, replayed), :func:`calibrate_step`
(the per-kernel overhead of one real step)."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fastdist.core.mesh import Mesh
from fastdist.errors import ProfileError
from fastdist.profile._common import in_node
from fastdist.profile._kernels import NOT_KERNELS, Kernel, materialize
from fastdist.profile.cost_model import CALIBRATED_KINDS, CostModel, Point, fit_points
from fastdist.profile.prediction import predict
from fastdist.profile.records import Profile, Work
from fastdist.profile.tracing import trace

__all__ = ["calibrate", "calibrate_kernels", "calibrate_step"]


def _measure(
    fn: Callable[[], Any],
    reps: int,
    calls: int = 1,
    least: float = 0.0,
    sync: Callable[[], None] = lambda: None,
) -> float:
    """Seconds per call: the median over ``reps`` repetitions, each started after a barrier of the
    whole job, of ``calls`` back-to-back calls (one warm-up call first). ``least``: a local
    kernel is repeated for at least that many seconds per repetition (sharing a core shows in a
    window longer than a time slice); never for a collective (every rank must call it as
    often). ``sync`` waits for the device (CUDA kernels are asynchronous)."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    fn()
    sync()
    if least > 0:
        calls = max(calls, math.ceil(least / max(time.perf_counter() - t0, 1e-7)))
    times = []
    for _ in range(reps):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _collective_call(
    kind: str, size: int, n: int, dtype: torch.dtype, mesh: Mesh, axis: Any, dev: torch.device
) -> tuple[Callable[[], Any], int]:
    """A call of the fastdist collective of ``kind`` with S about ``size`` bytes over ``n`` ranks,
    and its exact S."""
    from fastdist import ops as C

    elems = max(n, size // dtype.itemsize // n * n)  # a multiple of n
    if kind == "allreduce":
        x = torch.zeros(elems, dtype=dtype, device=dev)
        return (lambda: C.psum(x, mesh, axis)), elems * dtype.itemsize
    if kind == "allgather":  # S: the gathered output
        x = torch.zeros(elems // n, dtype=dtype, device=dev)
        return (lambda: C.all_gather(x, mesh, axis)), elems * dtype.itemsize
    if kind == "reducescatter":  # S: the input
        x = torch.zeros(elems, dtype=dtype, device=dev)
        return (lambda: C.psum_scatter(x, mesh, axis)), elems * dtype.itemsize
    if kind == "alltoall":  # S: one rank's send buffer; [n, elems/n] -> n blocks
        x = torch.zeros(n, elems // n, dtype=dtype, device=dev)
        return (lambda: C.all_to_all(x, mesh, axis, 0, 0)), elems * dtype.itemsize
    if kind == "sendrecv":
        x = torch.zeros(elems, dtype=dtype, device=dev)
        return (lambda: C.ring_shift(x, mesh, axis, 1)), elems * dtype.itemsize
    raise ProfileError(
        "calibrate",
        f"cannot measure collective kind {kind!r}",
        f"choose kinds among {', '.join(CALIBRATED_KINDS)}",
    )


def _burst(size: int) -> int:
    """Calls timed back to back for a point of S = ``size`` bytes: 8 up to 64 KiB, fewer above,
    1 from 1 MiB."""
    return max(1, min(8, (1 << 19) // max(size, 1)))


def _kernel_chain(length: int, dev: torch.device) -> Callable[[], None]:
    """Forward and backward of ``length`` tiny elementwise ops (the per-kernel cost)."""
    x = torch.ones(16, device=dev, requires_grad=True)

    def run() -> None:
        y = x
        for _ in range(length):
            y = y * 1.0001
        y.sum().backward()  # type: ignore[no-untyped-call]

    return run


class _KernelCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts aten kernels as :func:`trace` counts them."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kernels = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if func.namespace == "aten" and not func.is_view and func not in NOT_KERNELS:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def _calibration_device(device: Any) -> torch.device:
    """Where calibration measures: ``device``, else the current CUDA device under NCCL, else
    the CPU."""
    import torch.distributed as dist

    if device is not None:
        return torch.device(device)
    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def calibrate(
    mesh: Mesh,
    *,
    axes: Sequence[str | tuple[str, ...]] | None = None,
    kinds: Sequence[str] = CALIBRATED_KINDS,
    sizes: Sequence[int] = (1 << 12, 1 << 16, 1 << 20, 1 << 22),
    reps: int = 5,
    matmul: int = 512,
    dtype: torch.dtype = torch.float32,
    gpus_per_node: int | None = None,
    device: str | torch.device | None = None,
    name: str = "calibrated",
) -> CostModel:
    """Measure the running job's collectives and compute, and fit a :class:`CostModel`.

    A collective: every rank of ``mesh`` must call it (same arguments). For each axis (or
    tuple of axes) in ``axes``, each collective kind in ``kinds`` and each size in ``sizes``
    (S in bytes, nccl-tests' definition, rounded to a multiple of the group size), the
    fastdist collective is timed ``reps`` times after a warm-up, each time after a barrier of
    the job (below 1 MiB, a burst of up to 8 back-to-back calls, divided by their number); a
    point is the median over the repetitions of the slowest rank. Points of the same
    kind and group size (on any axis) are fitted together by ``latency + size / bandwidth``
    (least squares of the relative error; see :meth:`CostModel.fit` for group sizes that were
    not measured). Compute is measured the same way, every rank at once: a ``matmul`` x
    ``matmul`` x ``matmul`` matmul (FLOP/s), an elementwise add of 4 Mi elements (bytes/s) and
    a chain of tiny ops forward and backward (seconds per kernel), each repeated for at least
    50 ms per repetition (so that ranks sharing a core show it). With the defaults and
    two axes, a few seconds on 4 CPU processes; widen ``sizes`` and ``reps`` for a finer fit.

    Args:
        mesh: a mesh over the running job (``fastdist.connect``).
        axes: what to measure: axis names or tuples of names (default: each axis of size > 1,
            and the tuple of all of them when there are several).
        kinds: collective kinds among :data:`CALIBRATED_KINDS`.
        sizes: S in bytes.
        reps: timed calls per point.
        matmul: the side of the square matmul timed for the FLOP/s.
        dtype: element type of the buffers and the matmul.
        gpus_per_node: ranks per node (default: ``LOCAL_WORLD_SIZE`` from the environment, else
            the whole job).
        device: where the buffers and the compute live (default: this process's CUDA device
            when the job's default process group is NCCL, else the CPU).
        name: the model's name in tables.

    Raises:
        ProfileError: ``mesh`` is a plain mesh (simulated ranks: nothing to measure), or an
            argument is invalid.
    """
    _check_calibrate(mesh, kinds, sizes, reps, matmul)
    import torch.distributed as dist

    groups = _groups(mesh, axes)
    node = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    dev = _calibration_device(device)
    calls = _collective_calls(mesh, groups, kinds, sizes, dtype, node, dev)
    # small buffers: bursts of back-to-back calls (as in a step), not one call after a barrier
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    seconds = [_measure(fn, reps, _burst(exact), sync=sync) for *_, exact, fn in calls]
    compute, kernels = _compute_seconds(matmul, dtype, dev, reps, sync)
    # the slowest rank's medians, on every rank (every rank then fits the same model)
    slowest = torch.tensor([*seconds, *compute], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    times = slowest.tolist()
    points = tuple(
        Point(kind, axis_name, n, intra, exact, t)
        for (kind, axis_name, n, intra, exact, _), t in zip(calls, times)
    )
    t_mm, t_add, t_chain = times[len(calls) :]
    return CostModel(
        name,
        node,
        fit_points(points),
        flops=2.0 * matmul**3 / t_mm,
        memory_bandwidth=3.0 * _ADDED * dtype.itemsize / t_add,
        kernel_latency=t_chain / max(kernels, 1),
        points=points,
    )


def _check_calibrate(
    mesh: Mesh, kinds: Sequence[str], sizes: Sequence[int], reps: int, matmul: int
) -> None:
    """Refuse a plain mesh (nothing to measure) and invalid arguments."""
    if not isinstance(mesh, Mesh):
        raise ProfileError(
            "calibrate",
            f"expected a fastdist.Mesh, got {type(mesh).__name__}",
            "pass fastdist.connect(...) of the running job",
        )
    if mesh.backend is None:
        raise ProfileError(
            "calibrate",
            f"{mesh!r} is a plain mesh: its ranks are simulated in this process, so there are no "
            "links or devices to measure",
            "run calibrate inside the job on fastdist.connect(...) and save() the model (then "
            "CostModel.load(path) anywhere), or rank layouts with a documented Network from "
            "NETWORKS",
        )
    bad = [k for k in kinds if k not in CALIBRATED_KINDS]
    if bad or not kinds or not sizes or any(s < 1 for s in sizes) or reps < 1 or matmul < 1:
        raise ProfileError(
            "calibrate",
            f"kinds={tuple(kinds)}, sizes={tuple(sizes)}, reps={reps}, matmul={matmul}",
            f"kinds among {', '.join(CALIBRATED_KINDS)}, positive sizes, reps >= 1, matmul >= 1",
        )


def _groups(
    mesh: Mesh, axes: Sequence[str | tuple[str, ...]] | None
) -> list[str | tuple[str, ...]]:
    """The groups to measure: ``axes``, or each axis of size > 1 and (several) all of them."""
    names = mesh.axis_names
    if axes is None:
        big = tuple(a for a in names if mesh.shape[a] > 1)
        groups: list[str | tuple[str, ...]] = [*big, *([big] if len(big) > 1 else [])]
    else:
        groups = list(axes)
    for g in groups:
        parts = (g,) if isinstance(g, str) else tuple(g)
        if not parts or any(a not in names for a in parts):
            raise ProfileError(
                "calibrate",
                f"{g!r} is not an axis (or tuple of axes) of {mesh!r}",
                f"name axes among {names}",
            )
    return groups


def _collective_calls(
    mesh: Mesh,
    groups: Sequence[str | tuple[str, ...]],
    kinds: Sequence[str],
    sizes: Sequence[int],
    dtype: torch.dtype,
    node: int,
    dev: torch.device,
) -> list[tuple[str, str, int, bool, int, Callable[[], Any]]]:
    """``(kind, axis name, n, intra, exact S, call)`` of each point to measure."""
    names = mesh.axis_names
    sizes_now = tuple(mesh.shape.values())
    calls: list[tuple[str, str, int, bool, int, Callable[[], Any]]] = []
    for g in groups:
        parts = (g,) if isinstance(g, str) else tuple(g)
        n = math.prod(mesh.shape[a] for a in parts)
        if n < 2:
            continue
        intra = in_node(sizes_now, [names.index(a) for a in parts], node)
        axis: Any = g if isinstance(g, str) else parts
        for kind in kinds:
            for size in sizes:
                fn, exact = _collective_call(kind, size, n, dtype, mesh, axis, dev)
                calls.append((kind, "+".join(parts), n, intra, exact, fn))
    return calls


_ADDED = 1 << 22  # elements of the timed elementwise add


def _compute_seconds(
    matmul: int, dtype: torch.dtype, dev: torch.device, reps: int, sync: Callable[[], None]
) -> tuple[list[float], int]:
    """This rank's seconds of a ``matmul``-sided matmul, an add of ``_ADDED`` elements and a chain
    of tiny ops (each repetition at least 50 ms: every rank computing at once, sharing), and the
    chain's kernels."""
    a = torch.randn(matmul, matmul, dtype=dtype, device=dev)
    b = torch.randn(matmul, matmul, dtype=dtype, device=dev)
    x = torch.randn(_ADDED, dtype=dtype, device=dev)
    y, z = torch.randn_like(x), torch.empty_like(x)
    chain = _kernel_chain(64, dev)
    counter = _KernelCounter()
    with counter:
        chain()
    compute = [
        _measure(lambda: torch.mm(a, b), reps, least=0.05, sync=sync),
        _measure(lambda: torch.add(x, y, out=z), reps, least=0.05, sync=sync),
        _measure(chain, reps, least=0.05, sync=sync),
    ]
    return compute, counter.kernels


def _replay(kernel: Kernel, dev: torch.device, least: float, sync: Callable[[], None]) -> float:
    """Seconds per call of one kernel on real tensors of its shapes: a warm-up call, then back to
    back calls for at least ``least`` seconds; ``inf`` when it cannot be replayed."""
    try:
        args, kwargs = pytree.tree_map(lambda a: materialize(a, dev), (kernel.args, kernel.kwargs))
        with torch.no_grad():
            t0 = time.perf_counter()
            kernel.func(*args, **kwargs)
            sync()
            calls = max(1, min(10_000, math.ceil(least / max(time.perf_counter() - t0, 1e-7))))
            t0 = time.perf_counter()
            for _ in range(calls):
                kernel.func(*args, **kwargs)
            sync()
            return (time.perf_counter() - t0) / calls
    except Exception:  # noqa: BLE001 - a kernel that cannot run on made-up data: not timed
        return math.inf


def _chain_step(x: Tensor) -> None:
    y = x
    for _ in range(64):
        y = y * 1.0001
    y.sum().backward()  # type: ignore[no-untyped-call]


def calibrate_kernels(
    mesh: Mesh,
    profiles: Profile | Sequence[Profile],
    model: CostModel,
    *,
    reps: int = 5,
    least: float = 2e-3,
    device: str | torch.device | None = None,
) -> CostModel:
    """Time the kernels the traced steps issue on this job's devices: ``model`` with
    :attr:`CostModel.kernel_times` (a collective over ``mesh``'s job).

    Every distinct kernel of ``profiles`` (:attr:`Profile.kernels`: the aten op with its shapes,
    strides, dtypes and other arguments: matmuls, attention, elementwise kernels, forward and
    backward) is replayed on real tensors of those shapes (floats drawn from a normal, integers
    0, bools True): a warm-up call, then back-to-back calls for at least ``least`` seconds. The
    kernels are timed in ``reps`` interleaved rounds (each round after a barrier, every rank at
    once, as in a step: ranks sharing a core show it); a kernel's time is its median over the
    rounds, then the slowest rank's. A kernel that cannot be replayed (or on any rank) is left
    out and charged by ``model``'s rates.

    ``kernel_overhead``: a step also spends time around each kernel (autograd, Python,
    dispatch). A chain of 64 tiny multiplications, forward and backward, is timed the same
    way, whole and kernel by kernel: the overhead is ``(whole - sum of its kernels) / kernels``
    (at least 0).

    :meth:`CostModel.compute_time` then charges each timed kernel ``kernel_times[key] +
    kernel_overhead``; a :class:`Work` without calls (DataParallel's packing) and kernels not
    timed keep the rates. Contract: every rank passes profiles with the same kernels (trace the
    same layouts on every rank), else :class:`ProfileError`; every rank returns the same model.

    Args:
        mesh: a mesh over the running job (``fastdist.connect``): every rank calls this.
        profiles: :func:`trace` results (one per layout to price).
        model: the :func:`calibrate` model to extend (collectives and fallback rates).
        reps: interleaved rounds.
        least: seconds of back-to-back calls per kernel per round.
        device: where to replay (default: as :func:`calibrate`).

    Returns:
        ``model`` with ``kernel_times`` and ``kernel_overhead`` set (``name`` unchanged).

    Raises:
        ProfileError: ``mesh`` is a plain mesh, the ranks' profiles differ, or an argument is
            invalid.
    """
    if not isinstance(mesh, Mesh) or mesh.backend is None:
        raise ProfileError(
            "calibrate_kernels",
            f"{mesh!r} is not a mesh over a running job",
            "pass fastdist.connect(...) inside the job (every rank calls calibrate_kernels)",
        )
    if reps < 1 or least <= 0:
        raise ProfileError(
            "calibrate_kernels", f"reps={reps}, least={least}", "reps >= 1 and least > 0"
        )
    import torch.distributed as dist

    profs = [profiles] if isinstance(profiles, Profile) else list(profiles)
    dev = _calibration_device(device)
    sync: Callable[[], None] = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    kernels = _same_kernels(profs)
    keys = sorted(kernels)
    chain = trace(_chain_step, Mesh({"one": 1}), torch.ones(16, requires_grad=True))
    chain_calls = [c for w in chain.events if isinstance(w, Work) for c in w.calls]
    chain_kernels = sum(c[1] for c in chain_calls)
    chain_keys = sorted({c[0] for c in chain_calls} - set(keys))
    todo = [kernels[k] for k in keys] + [chain.kernels[k] for k in chain_keys]
    rounds = _timed_rounds(todo, dev, least, sync, reps)
    # (kernels + 1,): each kernel's median over the rounds
    per = torch.tensor([statistics.median(col) for col in zip(*rounds)], dtype=torch.float64)
    dist.all_reduce(per, op=dist.ReduceOp.MAX)  # the slowest rank; inf: not replayable somewhere
    times = per.tolist()
    timed = dict(zip(keys + chain_keys, times))
    replayed = sum(c * timed.get(k, math.inf) for k, c in ((c[0], c[1]) for c in chain_calls))
    overhead = (
        max(0.0, (times[-1] - replayed) / max(chain_kernels, 1)) if math.isfinite(replayed) else 0.0
    )
    return replace(
        model,
        kernel_times=tuple((k, t) for k, t in zip(keys, times) if math.isfinite(t)),
        kernel_overhead=overhead,
    )


def _same_kernels(profs: Sequence[Profile]) -> dict[str, Kernel]:
    """The distinct kernels of ``profs`` by key; :class:`ProfileError` unless every rank has the
    same keys (a collective)."""
    import torch.distributed as dist

    kernels: dict[str, Kernel] = {}
    for p in profs:
        for k, v in p.kernels.items():
            kernels.setdefault(k, v)
    keys = sorted(kernels)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, keys)
    differ = [r for r, other in enumerate(every) if other != keys]
    if differ:
        raise ProfileError(
            "calibrate_kernels",
            f"rank {dist.get_rank()}'s profiles issue {len(keys)} distinct kernels, rank "
            f"{differ[0]}'s {len(every[differ[0]])} others or more",
            "trace the same steps (the same layouts and one rank's shapes) on every rank",
        )
    return kernels


def _timed_rounds(
    todo: Sequence[Kernel], dev: torch.device, least: float, sync: Callable[[], None], reps: int
) -> list[list[float]]:
    """``reps`` rounds, each after a barrier: every kernel of ``todo`` replayed, then the chain
    of tiny ops run whole (its seconds last in each row)."""
    import torch.distributed as dist

    x = torch.ones(16, device=dev, requires_grad=True)
    rounds: list[list[float]] = []
    for _ in range(reps):
        dist.barrier()
        row = [_replay(k, dev, least, sync) for k in todo]
        t0 = time.perf_counter()
        calls = 0
        while time.perf_counter() - t0 < least * 5 or calls < 2:
            _chain_step(x)
            calls += 1
        sync()
        rounds.append([*row, (time.perf_counter() - t0) / calls])
    return rounds


def calibrate_step(
    mesh: Mesh,
    step: Callable[[], Any],
    profile: Profile,
    model: CostModel,
    *,
    data_parallel: str | Sequence[str] | None = None,
    bucket_mb: float = 25.0,
    reps: int = 5,
) -> CostModel:
    """Fit ``model.kernel_overhead`` to one real step of the running job (a collective over
    ``mesh``'s job).

    ``step()`` runs, on this rank, the step ``profile`` traced: the same model, layout and
    shapes, with the data-parallel engine ``data_parallel`` and ``bucket_mb`` describe to
    :func:`predict`. It is called once (warm-up), then ``reps`` times, each after a barrier of
    the job; the measured step is the slowest rank's median. With ``predicted =
    predict(profile, model, ...).time`` and ``kernels`` the number of the step's kernels
    ``model`` has replayed times for (:func:`calibrate_kernels`), the returned model's overhead
    is ``max(0, model.kernel_overhead + (measured - predicted) / kernels)``: what this model's
    steps spend beyond their replayed kernels and fitted collectives (the Python of the model
    and of fastdist's real-rank paths, autograd, host synchronizations), charged per kernel to
    every layout it then prices. Price other layouts of the same model with it; the layout it
    was fitted on is no longer a prediction.

    Args:
        mesh: a mesh over the running job (every rank calls this).
        step: one step on this rank (forward, backward, the engine's reduction).
        profile: :func:`trace` (or :func:`trace_model`) of that step on one rank.
        model: a :func:`calibrate_kernels` model.
        data_parallel: as for :func:`predict`.
        bucket_mb: as for :func:`predict`.
        reps: timed steps.

    Returns:
        ``model`` with the fitted ``kernel_overhead`` (every rank the same).

    Raises:
        ProfileError: ``mesh`` is a plain mesh, ``model`` has no kernel times for the step, or
            ``reps < 1``.
    """
    if not isinstance(mesh, Mesh) or mesh.backend is None:
        raise ProfileError(
            "calibrate_step",
            f"{mesh!r} is not a mesh over a running job",
            "pass fastdist.connect(...) inside the job (every rank calls calibrate_step)",
        )
    kernels = sum(
        c[1] for e in profile.events if isinstance(e, Work) for c in e.calls if c[0] in model._times
    )
    if kernels == 0 or reps < 1:
        raise ProfileError(
            "calibrate_step",
            f"{model.name!r} has replayed times for {kernels} of the step's kernels (reps={reps})",
            "call calibrate_kernels(mesh, profile, model) on the step's profile first, reps >= 1",
        )
    import torch.distributed as dist

    step()
    seconds: list[float] = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t0)
    measured = torch.tensor([statistics.median(seconds)], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    predicted = predict(profile, model, data_parallel=data_parallel, bucket_mb=bucket_mb).time
    overhead = model.kernel_overhead + (float(measured) - predicted) / kernels
    return replace(model, kernel_overhead=max(0.0, overhead))
