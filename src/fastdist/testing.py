"""Testing toolkit for code written with fastdist.

* Hypothesis strategies: :func:`meshes`, :func:`axes`, :func:`shard_sizes`, :func:`sharded`
  (they need ``hypothesis``: ``pip install "torch-fastdist[testing]"``; the rest of this
  module does not).
* :func:`assert_matches_single_device`: run per-rank code on every simulated rank and check
  every rank's outputs *and* gradients against the single-device function, as written (no
  ``pvary`` inserted for it unless asked with ``check="insert"``).
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

import contextlib
import datetime
import inspect
import io
import math
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch
from torch import Tensor

from fastdist.check.replication import CheckMode, Rep
from fastdist.check.spmd import checked_call
from fastdist.core.mesh import AxisName, Mesh
from fastdist.core.sharding import PartitionSpec, block_of
from fastdist.errors import GlooRunError, MeshError
from fastdist.sim.simulate import simulate

if TYPE_CHECKING:
    from hypothesis.strategies import DrawFn, SearchStrategy

__all__ = [
    "meshes",
    "axes",
    "shard_sizes",
    "sharded",
    "Sharded",
    "assert_matches_single_device",
    "run_on_gloo",
    "shard_for_rank",
]


# ============================================================================ strategies
def _hypothesis(name: str) -> Any:
    """``hypothesis.strategies``, imported when a strategy is built (the only part of this module
    that needs it)."""
    try:
        from hypothesis import strategies as st
    except ImportError as e:
        raise ImportError(
            f"fastdist.testing.{name} is a hypothesis strategy and hypothesis is not installed. "
            'Fix: pip install "torch-fastdist[testing]" (or pip install hypothesis)',
            name="hypothesis",
        ) from e
    return st


def meshes(
    *,
    max_size: int = 16,
    max_axes: int = 3,
    names: Sequence[str] = ("dp", "sp", "tp"),
) -> SearchStrategy[Mesh]:
    """Meshes of 1..``max_axes`` axes (named from ``names``) with at most ``max_size`` ranks.

    Args:
        max_size: the most ranks a mesh has.
        max_axes: the most axes a mesh has.
        names: the axis names to draw from (in this order).
    """
    st = _hypothesis("meshes")

    @st.composite  # type: ignore[untyped-decorator]
    def draw_mesh(draw: DrawFn) -> Mesh:
        k = draw(st.integers(1, min(max_axes, len(names))))
        sizes: list[int] = []
        for _ in range(k):
            budget = max_size // math.prod(sizes) if sizes else max_size
            sizes.append(draw(st.integers(1, max(1, min(4, budget)))))
        return Mesh(list(zip(names[:k], sizes)))

    return draw_mesh()  # type: ignore[no-any-return]


def axes(mesh: Mesh) -> SearchStrategy[AxisName]:
    """One axis name, or a tuple of distinct names in any order.

    Args:
        mesh: the mesh whose axes to draw from.
    """
    st = _hypothesis("axes")

    @st.composite  # type: ignore[untyped-decorator]
    def draw_axis(draw: DrawFn) -> AxisName:
        chosen = draw(
            st.lists(
                st.sampled_from(list(mesh.axis_names)),
                min_size=1,
                max_size=mesh.ndim,
                unique=True,
            )
        )
        return chosen[0] if len(chosen) == 1 and draw(st.booleans()) else tuple(chosen)

    return draw_axis()  # type: ignore[no-any-return]


def shard_sizes(
    n: int, *, total: int | None = None, even: bool = False, max_rows: int = 4
) -> SearchStrategy[list[int]]:
    """Row counts of ``n`` shards: equal if ``even``, else uneven with zeros allowed (summing to
    ``total`` if given).

    Args:
        n: the number of shards.
        total: the sum of the row counts, if fixed.
        even: equal row counts.
        max_rows: the most rows a shard has.
    """
    st = _hypothesis("shard_sizes")

    @st.composite  # type: ignore[untyped-decorator]
    def draw_sizes(draw: DrawFn) -> list[int]:
        if even:
            per = (total // n) if total is not None else draw(st.integers(1, max_rows))
            if total is not None and per * n != total:
                raise MeshError(f"shard_sizes: total {total} does not split evenly into {n}")
            return [per] * n
        if total is None:
            return list(draw(st.lists(st.integers(0, max_rows), min_size=n, max_size=n)))
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=n - 1, max_size=n - 1)))
        bounds = [0, *cuts, total]
        return [bounds[i + 1] - bounds[i] for i in range(n)]

    return draw_sizes()  # type: ignore[no-any-return]


class Sharded(NamedTuple):
    """A global tensor and its shards along ``dim`` over an axis (shard ``i`` for axis index
    ``i``)."""

    global_tensor: Tensor
    sizes: list[int]
    shards: list[Tensor]
    dim: int


def sharded(
    n: int,
    *,
    even: bool = True,
    trailing: Sequence[int] = (3,),
    dim: int = 0,
    dtype: torch.dtype = torch.float64,
) -> SearchStrategy[Sharded]:
    """A random global tensor split along ``dim`` into ``n`` shards (even, or uneven including
    empty ones).

    Args:
        n: the number of shards.
        even: equal shards; ``False``: uneven, empty ones included.
        trailing: the sizes of the other dims.
        dim: the dim the tensor is split along.
        dtype: the tensor's dtype.
    """
    st = _hypothesis("sharded")

    @st.composite  # type: ignore[untyped-decorator]
    def draw_sharded(draw: DrawFn) -> Sharded:
        sizes = draw(shard_sizes(n, even=even))
        shape = list(trailing)
        shape.insert(dim, sum(sizes))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        x = torch.randn(shape, generator=gen).to(dtype)
        return Sharded(x, sizes, list(torch.split(x, sizes, dim=dim)), dim)

    return draw_sharded()  # type: ignore[no-any-return]


# ============================================================================ single-device oracle
def shard_for_rank(x: Tensor, spec: PartitionSpec, mesh: Mesh, rank: int) -> Tensor:
    """The block of global ``x`` that ``rank`` holds under ``spec`` (replicated axes: the whole
    dim).

    Args:
        x: the global tensor.
        spec: how it splits over the mesh's axes.
        mesh: the mesh.
        rank: the rank whose block to take.

    Returns:
        ``rank``'s block of ``x`` (a view).
    """
    return block_of(x, spec, mesh, rank)


def assert_matches_single_device(
    parallel_fn: Callable[..., Tensor],
    reference_fn: Callable[..., Tensor],
    mesh: Mesh,
    inputs: Sequence[Tensor],
    *,
    in_specs: Sequence[PartitionSpec],
    out_specs: PartitionSpec,
    check: CheckMode | bool = False,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
) -> None:
    """Check per-rank ``parallel_fn`` against ``reference_fn`` on every rank.

    Each rank gets its block of every global input (by ``in_specs``); its output must equal
    its block of the reference output (by ``out_specs``), and, with a random cotangent, its
    gradient for every floating-point input must equal its block of the reference gradient.

    ``check`` is the replication checked mode of :func:`fastdist.spmd`, off by default: the
    code is tested as written. ``check="insert"`` inserts the ``pvary`` a replicated input
    needs before it meets a rank-specific one, as ``fd.spmd`` does by default: a test then
    passes code that is right only when it runs under ``fd.spmd`` (leave it off for layers,
    hand-written ``torch.autograd.Function`` s and anything called outside ``spmd``).
    ``check="error"`` raises :class:`~fastdist.ReplicationError` where a ``pvary`` is missing
    instead of inserting it (``True`` means ``"insert"``).

    On a simulated mesh every rank is checked at once. On a mesh from
    ``fastdist.connect`` each process checks its own rank, so the same test body runs on
    gloo processes through :func:`run_on_gloo`.

    Args:
        parallel_fn: the per-rank code under test, called with each rank's blocks of ``inputs``.
        reference_fn: the single-device function, called with the global ``inputs``.
        mesh: a plain mesh (simulated ranks) or one from ``fastdist.connect``.
        inputs: the global inputs.
        in_specs: how each input splits over the mesh (one ``PartitionSpec`` per input).
        out_specs: how the reference output splits over the mesh (what each rank's output must
            equal).
        check: the replication checked mode: ``False`` (the code as written), ``"insert"``
            (``True``) or ``"error"``.
        rtol: relative tolerance; default: ``torch.testing.assert_close``'s for the dtype.
        atol: absolute tolerance; default: ``torch.testing.assert_close``'s for the dtype.
        seed: the seed of the random cotangent.

    Raises:
        AssertionError: on the first mismatch, naming the rank, its coordinates, the input by
            position and parameter name (``gradient of input 0 (x) on rank 1 {'tp': 1}``) and
            the norms of the reference block and of what the rank got, followed by
            ``torch.testing.assert_close``'s report.
        MeshError: ``in_specs`` and ``inputs`` differ in length.
    """
    if len(in_specs) != len(inputs):
        raise MeshError(
            f"assert_matches_single_device: {len(inputs)} inputs but {len(in_specs)} in_specs"
        )
    names = _input_names(parallel_fn, reference_fn, len(inputs))
    ref_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    ref_out = reference_fn(*ref_in)
    c = torch.randn(
        ref_out.shape, generator=torch.Generator().manual_seed(seed), dtype=ref_out.dtype
    )
    (ref_out * c).sum().backward()  # type: ignore[no-untyped-call]

    states = [Rep(frozenset(s.sharded_axes)) for s in in_specs]
    mode: CheckMode | None = "insert" if check is True else None if check is False else check
    if mesh.comm is not None:  # real ranks: this process checks its own rank
        ranks = [mesh.rank]
        local = [
            shard_for_rank(t.detach(), s, mesh, mesh.rank)
            .clone()
            .requires_grad_(t.is_floating_point())
            for t, s in zip(inputs, in_specs)
        ]
        out = checked_call(
            parallel_fn, mesh, mode, local, states, [out_specs], True, simulated=False
        )
        (out * shard_for_rank(c, out_specs, mesh, mesh.rank)).sum().backward()
        outs, grads = [out.detach()], [[t.grad] for t in local]
    else:  # simulated: every rank at once
        ranks = list(range(mesh.size))
        local = [
            torch.stack([shard_for_rank(t.detach(), s, mesh, r) for r in ranks]).requires_grad_(
                t.is_floating_point()
            )
            for t, s in zip(inputs, in_specs)
        ]
        local_c = torch.stack([shard_for_rank(c, out_specs, mesh, r) for r in ranks])
        stacked = simulate(
            lambda *a: checked_call(
                parallel_fn, mesh, mode, a, states, [out_specs], True, simulated=True
            ),
            mesh,
        )(*local)
        (stacked * local_c).sum().backward()  # every rank's backward of its own loss
        outs = list(stacked.detach())
        grads = [list(t.grad) if t.grad is not None else [None] * len(ranks) for t in local]
    for j, r in enumerate(ranks):
        where = f"rank {r} {mesh.coords(r)}"
        expected = shard_for_rank(ref_out.detach(), out_specs, mesh, r)
        torch.testing.assert_close(
            outs[j],
            expected,
            rtol=rtol,
            atol=atol,
            msg=_prefixed(f"output on {where}", expected, outs[j]),
        )
        for i, rt in enumerate(ref_in):
            if rt.grad is not None:
                got = grads[i][j]
                what = f"gradient of input {i}{names[i]} on {where}"
                expected = shard_for_rank(rt.grad, in_specs[i], mesh, r)
                assert got is not None, (
                    f"{what}: no gradient reached it (reference norm {_norm(expected)})"
                )
                torch.testing.assert_close(
                    got,
                    expected,
                    rtol=rtol,
                    atol=atol,
                    msg=_prefixed(what, expected, got),
                )


def _input_names(parallel_fn: Any, reference_fn: Any, n: int) -> list[str]:
    """``" (x)"`` for each input whose positional parameter name ``parallel_fn`` (else
    ``reference_fn``) declares, else ``""`` (an input taken by ``*args``)."""
    names = [""] * n
    for fn in (reference_fn, parallel_fn):  # parallel_fn's names win
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # a builtin or an object without a signature
            continue
        positional = [
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        for i, name in enumerate(positional[:n]):
            names[i] = f" ({name})"
    return names


def _norm(t: Tensor) -> str:
    """The 2-norm of ``t`` for a failure message."""
    return f"{torch.linalg.vector_norm(t.detach().double()).item():.6g}"


def _prefixed(prefix: str, expected: Tensor, got: Tensor) -> Callable[[str], str]:
    """An ``assert_close`` message callback that says where the mismatch is and how large both
    sides are."""

    def message(report: str) -> str:
        sizes = (
            f"reference norm {_norm(expected)}, got norm {_norm(got)}"
            if got.shape == expected.shape
            else f"reference shape {tuple(expected.shape)}, got shape {tuple(got.shape)}"
        )
        return f"{prefix} ({sizes}): {report}"

    return message


# ============================================================================ real gloo processes
def _free_port() -> int:
    """A port that was free a moment ago (racy: another process may take it before it is used;
    run_on_gloo does not use it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _save(path: str, payload: tuple[Any, ...]) -> None:
    """Write ``payload`` with ``torch.save`` to ``path`` atomically (the parent reads only whole
    files)."""
    buf = io.BytesIO()
    try:
        torch.save(payload, buf)
    except Exception:  # noqa: BLE001 - an unsaveable result is reported as this rank's failure
        buf = io.BytesIO()
        torch.save(("raised", "an error saving its result", traceback.format_exc().rstrip()), buf)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(buf.getbuffer())
    os.replace(tmp, path)


def _gloo_entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    args: tuple[Any, ...],
    out_dir: str,
    timeout: float,
) -> None:
    """One rank: join the gloo group through the parent's store, run ``fn``, save what happened to
    ``out_dir/rank<r>.pt``."""
    import torch.distributed as dist

    path = os.path.join(out_dir, f"rank{rank}.pt")
    limit = datetime.timedelta(seconds=timeout)
    try:
        # ranks share the machine's cores (the parent's environment is left as it is)
        torch.set_num_threads(1)
        # refused once inter-op work has started (e.g. while importing fn's module)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=limit)  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=limit)
        value = fn(*args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        tb = (
            e.__traceback__.tb_next
            if e.__traceback__ is not None and e.__traceback__.tb_next is not None
            else e.__traceback__
        )  # from fn down
        _save(
            path,
            (
                "raised",
                f"{type(e).__name__}: {e}",
                "".join(traceback.format_exception(type(e), e, tb)).rstrip(),
            ),
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no teardown: a process group with a peer stuck in a collective can block it
    _save(path, ("ok", value))
    dist.destroy_process_group()  # a crash here is reported ("while tearing down")
    sys.stdout.flush()
    sys.stderr.flush()
    # skip the interpreter's teardown: torch's native threads (gloo, DCP's writers) can abort in
    # their static destructors after the result is saved and the group destroyed ("terminate
    # called without an active exception"), which says nothing about fn
    os._exit(0)


def _outcome(rank: int, exitcode: int | None, out_dir: str) -> tuple[bool, Any]:
    """``(True, result)``, or ``(False, what happened)`` for a rank whose process has ended."""
    path = os.path.join(out_dir, f"rank{rank}.pt")
    if not os.path.exists(path):
        if exitcode is not None and exitcode < 0:
            try:
                name = signal.Signals(-exitcode).name
            except ValueError:
                name = f"signal {-exitcode}"
            return (
                False,
                f"killed by {name} before it saved a result (out of memory? a crash in native "
                "code?)",
            )
        return (
            False,
            f"exited with code {exitcode} before it saved a result (os._exit, or a crash in "
            "native code)",
        )
    try:
        payload = torch.load(path, weights_only=False)
    except Exception as e:  # noqa: BLE001 - reported as this rank's failure
        return (
            False,
            f"saved a result the parent cannot load ({type(e).__name__}: {e}); return types "
            "importable here (tensors, builtins)",
        )
    if payload[0] == "raised":
        return False, f"raised {payload[1]}\n{payload[2]}"
    if exitcode != 0:
        return False, f"returned a result, then exited with code {exitcode} while tearing down"
    return True, payload[1]


def run_on_gloo(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    grace: float = 5.0,
    start_method: Literal["spawn", "forkserver"] = "spawn",
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo processes (after ``init_process_group``); return
    each rank's result.

    ``fn`` must be importable (a module-level function); inside it, build the mesh with
    ``fastdist.connect(...)``. Each rank's result travels back with ``torch.save``
    through a file, so it may hold any number of tensors (and anything else ``torch.save``
    can write and this process can load). The ranks meet through a ``TCPStore`` that this
    process opens on a port the OS picks (port 0), so runs in parallel threads or processes
    never collide.

    Args:
        fn: an importable (module-level) function each rank runs.
        world_size: the number of gloo processes.
        *args: the arguments of ``fn`` (picklable).
        timeout: seconds before the ranks still running are killed.
        grace: seconds the peers of a rank that died get to report before they are killed.
        start_method: how the processes start. ``"spawn"``: each a fresh interpreter, which
            imports torch (seconds of CPU per process). ``"forkserver"``: each forked from
            one server process per parent process, started at the first such call, that has
            imported the modules named by ``multiprocessing.set_forkserver_preload`` (call it
            before the first run, e.g. with ``["torch", "fastdist", "transformers"]``): a
            rank starts in a fraction of a second. The server imports no CUDA, so both are safe
            with GPUs. Environment variables read at import time are the server's.

    Returns:
        each rank's result, by rank.

    Raises:
        GlooRunError: (an ``AssertionError``) saying what happened to each rank that gave no
            result: the exception and traceback of a rank that raised; the exit code or signal
            of a rank that died without one (reported within ``grace`` seconds, the peers still
            waiting for it killed); or, at ``timeout`` seconds, the ranks still running (killed).
            Never hangs: every process is gone when this returns or raises.
    """
    import torch.distributed as dist

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise MeshError(f"run_on_gloo: world_size={world_size!r} is not a positive int")
    if start_method not in ("spawn", "forkserver"):
        raise MeshError(
            f"run_on_gloo: start_method={start_method!r} is not 'spawn' or 'forkserver' ('fork' "
            "would copy this process's threads and torch state)"
        )
    name = getattr(fn, "__name__", repr(fn))
    limit = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, world_size, is_master=True, timeout=limit, wait_for_workers=False
    )
    try:
        return _run_ranks(fn, name, world_size, args, store.port, timeout, grace, start_method)
    finally:
        # the rendezvous closes with the run (a raised error's traceback must not keep it open)
        del store


def _run_ranks(
    fn: Callable[..., Any],
    name: str,
    world_size: int,
    args: tuple[Any, ...],
    port: int,
    timeout: float,
    grace: float,
    start_method: str,
) -> list[Any]:
    """Start the ranks, watch them until each has ended (or the time is up), kill what is left,
    collect the results."""
    ctx: Any = mp.get_context(start_method)  # a spawn or forkserver context: both have Process
    with tempfile.TemporaryDirectory(prefix="fastdist-gloo-") as out_dir:
        procs = {
            r: ctx.Process(
                target=_gloo_entry,
                args=(fn, r, world_size, port, args, out_dir, timeout),
                name=f"run_on_gloo:{name}:rank{r}",
            )
            for r in range(world_size)
        }
        running = dict(procs)
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        first_failure: float | None = None
        try:
            for p in procs.values():
                p.start()
            deadline = time.monotonic() + timeout
            while running:
                left = (
                    deadline if first_failure is None else min(deadline, first_failure + grace)
                ) - time.monotonic()
                if left <= 0:
                    break
                ready = wait([p.sentinel for p in running.values()], timeout=left)
                for r, p in list(running.items()):
                    if p.sentinel in ready:
                        p.join()
                        del running[r]
                        ok, value = _outcome(r, p.exitcode, out_dir)
                        if ok:
                            results[r] = value
                        else:
                            failures[r] = value
                            first_failure = (
                                time.monotonic() if first_failure is None else first_failure
                            )
        finally:
            for p in procs.values():
                if p.is_alive():
                    p.kill()
            for p in procs.values():
                if p.pid is not None:
                    p.join(timeout=10)
        timed_out = bool(running) and not failures
        for r in running:
            failures[r] = (
                f"still running after the {timeout:g} s timeout: killed"
                if timed_out
                else f"still running {grace:g} s after rank {next(iter(failures))} failed: killed "
                "(probably waiting for it in a collective)"
            )
        if failures:
            raise GlooRunError(
                name, world_size, failures, {r: p.exitcode for r, p in procs.items()}, timed_out
            )
    return [results[r] for r in range(world_size)]
