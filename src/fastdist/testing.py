"""Testing toolkit for code written with fastdist (needs ``hypothesis``: ``pip install fastdist[testing]``).

* Hypothesis strategies: :func:`meshes`, :func:`axes`, :func:`shard_sizes`, :func:`sharded`.
* :func:`assert_matches_single_device`: run per-rank code on every simulated rank and check
  every rank's outputs *and* gradients against the single-device function.
* :func:`run_on_gloo`: run a function on real gloo processes on this machine.
* A pytest fixture ``mesh`` (see ``fastdist.pytest_plugin``), configurable with
  ``@pytest.mark.mesh(dp=2, tp=2)``.

>>> import torch, fastdist as fd
>>> from fastdist.testing import assert_matches_single_device
>>> mesh = fd.Mesh({"tp": 2})
>>> assert_matches_single_device(
...     lambda x, w: fd.psum(x @ w, mesh, "tp"), lambda x, w: x @ w, mesh,
...     [torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)],
...     in_specs=(fd.P(None, "tp"), fd.P("tp", None)), out_specs=fd.P())
"""

from __future__ import annotations

import datetime
import math
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from hypothesis import strategies as st
from torch import Tensor

from .checking import CheckMode, PartitionSpec, Rep, block_of, checked_call
from .errors import MeshError
from .mesh import AxisName, Mesh
from .simulate import simulate

__all__ = ["meshes", "axes", "shard_sizes", "sharded", "Sharded", "assert_matches_single_device", "run_on_gloo", "shard_for_rank"]


# ============================================================================ strategies
@st.composite
def meshes(draw: st.DrawFn, *, max_size: int = 16, max_axes: int = 3, names: Sequence[str] = ("dp", "sp", "tp")) -> Mesh:
    """Meshes of 1..``max_axes`` axes (named from ``names``) with at most ``max_size`` ranks."""
    k = draw(st.integers(1, min(max_axes, len(names))))
    sizes: list[int] = []
    for _ in range(k):
        budget = max_size // math.prod(sizes) if sizes else max_size
        sizes.append(draw(st.integers(1, max(1, min(4, budget)))))
    return Mesh(list(zip(names[:k], sizes)))


@st.composite
def axes(draw: st.DrawFn, mesh: Mesh) -> AxisName:
    """One axis name, or a tuple of distinct names in any order."""
    chosen = draw(st.lists(st.sampled_from(list(mesh.axis_names)), min_size=1, max_size=mesh.ndim, unique=True))
    return chosen[0] if len(chosen) == 1 and draw(st.booleans()) else tuple(chosen)


@st.composite
def shard_sizes(draw: st.DrawFn, n: int, *, total: int | None = None, even: bool = False, max_rows: int = 4) -> list[int]:
    """Row counts of ``n`` shards: equal if ``even``, else uneven with zeros allowed (summing to ``total`` if given)."""
    if even:
        per = (total // n) if total is not None else draw(st.integers(1, max_rows))
        if total is not None and per * n != total:
            raise MeshError(f"shard_sizes: total {total} does not split evenly into {n}")
        return [per] * n
    if total is None:
        return draw(st.lists(st.integers(0, max_rows), min_size=n, max_size=n))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=n - 1, max_size=n - 1)))
    bounds = [0, *cuts, total]
    return [bounds[i + 1] - bounds[i] for i in range(n)]


class Sharded(NamedTuple):
    """A global tensor and its shards along ``dim`` over an axis (shard ``i`` for axis index ``i``)."""

    global_tensor: Tensor
    sizes: list[int]
    shards: list[Tensor]
    dim: int


@st.composite
def sharded(draw: st.DrawFn, n: int, *, even: bool = True, trailing: Sequence[int] = (3,), dim: int = 0, dtype: torch.dtype = torch.float64) -> Sharded:
    """A random global tensor split along ``dim`` into ``n`` shards (even, or uneven including empty ones)."""
    sizes = draw(shard_sizes(n, even=even))
    shape = list(trailing)
    shape.insert(dim, sum(sizes))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(shape, generator=gen).to(dtype)
    return Sharded(x, sizes, list(torch.split(x, sizes, dim=dim)), dim)


# ============================================================================ single-device oracle
def shard_for_rank(x: Tensor, spec: PartitionSpec, mesh: Mesh, rank: int) -> Tensor:
    """The block of global ``x`` that ``rank`` holds under ``spec`` (replicated axes: the whole dim)."""
    return block_of(x, spec, mesh, rank)


def assert_matches_single_device(
    parallel_fn: Callable[..., Tensor],
    reference_fn: Callable[..., Tensor],
    mesh: Mesh,
    inputs: Sequence[Tensor],
    *,
    in_specs: Sequence[PartitionSpec],
    out_specs: PartitionSpec,
    check: CheckMode | bool = "insert",
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
) -> None:
    """Check per-rank ``parallel_fn`` against ``reference_fn`` on every rank.

    Each rank gets its block of every global input (by ``in_specs``); its output must equal
    its block of the reference output (by ``out_specs``), and, with a random cotangent, its
    gradient for every floating-point input must equal its block of the reference gradient.
    ``check`` is the replication checked mode (as in :func:`fastdist.spmd`).

    On a simulated mesh every rank is checked at once. On a mesh from
    ``Mesh.from_torch`` each process checks its own rank, so the same test body runs on
    gloo processes through :func:`run_on_gloo`.
    Raises ``AssertionError`` naming the rank and the input on a mismatch.
    """
    if len(in_specs) != len(inputs):
        raise MeshError(f"assert_matches_single_device: {len(inputs)} inputs but {len(in_specs)} in_specs")
    ref_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    ref_out = reference_fn(*ref_in)
    c = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(seed), dtype=ref_out.dtype)
    (ref_out * c).sum().backward()  # type: ignore[no-untyped-call]

    states = [Rep(frozenset(s.sharded_axes)) for s in in_specs]
    mode: CheckMode | None = "insert" if check is True else None if check is False else check
    if mesh._comm is not None:  # real ranks: this process checks its own rank
        ranks = [mesh.rank]
        local = [shard_for_rank(t.detach(), s, mesh, mesh.rank).clone().requires_grad_(t.is_floating_point()) for t, s in zip(inputs, in_specs)]
        out = checked_call(parallel_fn, mesh, mode, local, states, [out_specs], True, simulated=False)
        (out * shard_for_rank(c, out_specs, mesh, mesh.rank)).sum().backward()
        outs, grads = [out.detach()], [[t.grad] for t in local]
    else:  # simulated: every rank at once
        ranks = list(range(mesh.size))
        local = [torch.stack([shard_for_rank(t.detach(), s, mesh, r) for r in ranks]).requires_grad_(t.is_floating_point()) for t, s in zip(inputs, in_specs)]
        local_c = torch.stack([shard_for_rank(c, out_specs, mesh, r) for r in ranks])
        stacked = simulate(lambda *a: checked_call(parallel_fn, mesh, mode, a, states, [out_specs], True, simulated=True), mesh)(*local)
        (stacked * local_c).sum().backward()  # every rank's backward of its own loss
        outs = list(stacked.detach())
        grads = [list(t.grad) if t.grad is not None else [None] * len(ranks) for t in local]
    for j, r in enumerate(ranks):
        where = f"rank {r} {mesh.coords(r)}"
        torch.testing.assert_close(outs[j], shard_for_rank(ref_out.detach(), out_specs, mesh, r), rtol=rtol, atol=atol, msg=lambda m: f"output on {where}: {m}")
        for i, rt in enumerate(ref_in):
            if rt.grad is not None:
                got = grads[i][j]
                assert got is not None, f"input {i} on {where}: no gradient reached it"
                torch.testing.assert_close(got, shard_for_rank(rt.grad, in_specs[i], mesh, r), rtol=rtol, atol=atol, msg=lambda m: f"gradient of input {i} on {where}: {m}")


# ============================================================================ real gloo processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gloo_entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...], queue: Any) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        queue.put((rank, True, fn(*args)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_on_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo processes (after ``init_process_group``); return each rank's result.

    ``fn`` must be importable (a module-level function) and its results picklable. Inside,
    build the mesh with ``fastdist.Mesh.from_torch(...)``. A rank that raises fails the call
    with its traceback; processes still running after ``timeout`` seconds are killed.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = [ctx.Process(target=_gloo_entry, args=(fn, r, world_size, port, args, queue)) for r in range(world_size)]
        for p in procs:
            p.start()
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if ok:
                results[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
    except Exception:  # noqa: BLE001 - queue.Empty on timeout
        failures.append(f"timed out after {timeout} s waiting for {world_size - len(results) - len(failures)} rank(s)")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if failures:
        raise AssertionError(f"run_on_gloo({getattr(fn, '__name__', fn)}, {world_size}) failed:\n" + "\n".join(failures))
    return [results[r] for r in range(world_size)]
