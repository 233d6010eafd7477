"""Failures on real ranks: what a failed call says (which peers did not arrive), run-while-tracing
markers for dynamo, and :class:`comm_guard` for compiled steps.

Every blocking call on a real mesh that fails raises :class:`~fastdist.CollectiveTimeout` (a
peer did not arrive in time) or :class:`~fastdist.CommError` naming the op, axis, group, rank
and which peers did not reach the call; the helpers here build those errors.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch.distributed as dist

from fastdist.errors import CollectiveTimeout, CommError, FastdistError, MeshError

if TYPE_CHECKING:
    from fastdist.comm.axes import TorchAxisComm
    from fastdist.comm.torch_comm import TorchComm
    from fastdist.core.mesh import Mesh

__all__ = [
    "comm_guard",
    "clean_error",
    "comm_error",
    "in_slice",
    "member_label",
    "wait_for_keys",
    "run_while_tracing",
    "raise_while_tracing",
]

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def in_slice(comm: Any) -> str:
    """`` (slice pp=1: global ranks [4, 5, 6, 7])`` for a slice's messages; ``""`` for a mesh over
    the whole job (or a stand-in comm without slices)."""
    where = getattr(comm, "where", "")
    return f" (slice {where}: global ranks {list(comm.ranks)})" if where else ""


def member_label(ranks: Sequence[int]) -> str:
    """The ranks of a group, in order, as part of a name: ``0-1-2-3``, or a digest when that gets
    long."""
    text = "-".join(map(str, ranks))
    return (
        text
        if len(text) <= 64
        else f"{len(ranks)}r{hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:16]}"
    )


def wait_for_keys(
    store: Any, prefix: str, ranks: Sequence[int], seconds: float, keep_last: bool = False
) -> list[int]:
    """Poll ``store`` until ``prefix + str(r)`` exists for every ``r`` in ``ranks``, at most
    ``seconds``; the ranks still missing.

    With ``keep_last``, a store that fails after the first poll (its host exited meanwhile) ends
    the wait with what that poll found.
    """
    deadline = time.monotonic() + seconds
    missing: list[int] | None = None
    while True:
        try:
            missing = [r for r in ranks if not store.check([prefix + str(r)])]
        except Exception:
            if keep_last and missing is not None:
                return missing
            raise
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.02)


def run_while_tracing(fn: _Fn) -> _Fn:
    """Mark ``fn`` for dynamo: called (not traced) while it traces, its result a constant of the
    graph.

    This is what ``torch._dynamo.assume_constant_result`` does (it sets this one attribute), done
    here so that importing fastdist does not import dynamo (a second of import time);
    tests/test_import_time.py checks that torch's marker is still this attribute.
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@run_while_tracing
def raise_while_tracing(
    op: str, axis: Any, ranks: tuple[int, ...], rank: int, problem: str, fix: str
) -> None:
    """Raise :class:`~fastdist.CommError` from inside dynamo's tracing (it cannot construct
    fastdist's exceptions in a graph)."""
    raise CommError(op, axis, ranks, rank, problem, fix)


# "[/pytorch/third_party/gloo/.../pair.cc:553] "
_SOURCE_PATH = re.compile(r"\[[^\[\]\s]*\.(?:cc|cpp|cu|h|hpp|c|py):\d+\]\s*")
_NOISE = re.compile(r"\s*This is typically caused by .*$", re.DOTALL)


def clean_error(e: BaseException) -> str:
    """The first line of ``e``'s message without C++ source locations and torch's boilerplate
    advice."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return _NOISE.sub("", _SOURCE_PATH.sub("", first)).strip().rstrip(".") or type(e).__name__


def comm_error(
    op: str, ac: TorchAxisComm, rank: int, e: BaseException, what: str, peers: str = ""
) -> CommError:
    """The fastdist error for a failed c10d call: :class:`CollectiveTimeout` for a timeout, else
    :class:`CommError`.

    ``peers`` (from :meth:`TorchAxisComm.failed`) says which peers did not reach the call.
    """
    msg = clean_error(e)
    extra = f"; {peers}" if peers else ""
    where = in_slice(ac.comm)
    timed_out = (
        "timed out" in msg.lower() or "timeout" in msg.lower() or isinstance(e, TimeoutError)
    )
    if timed_out:
        secs = ac.comm.timeout.total_seconds()
        order = "check that every rank of the group makes this call in the same order"
        if what == "creating the process group":  # the ranks may be on different meshes
            base, k = ac.comm.uid.rsplit(".", 1)
            which = (
                f"slice {ac.comm.where} number {k} of mesh {base.rsplit('-', 1)[0]}"
                if ac.comm.where
                else f"mesh {k} of shape {base}"
            )
            order = (
                "check that every rank builds its meshes of one shape in the same order "
                "(fastdist.connect, fastdist.comm.from_device_mesh and fastdist.comm.with_timeout "
                f"each count; this is {which} built on this rank, and a group's name carries that "
                "number, so meshes built in different orders never meet), and that every rank of "
                "the group makes this call"
            )
        return CollectiveTimeout(
            op,
            ac.label,
            ac.ranks,
            rank,
            f"a peer did not arrive for {what}{where} within the timeout ({secs:g} s): "
            f"{msg}{extra}",
            f"{order}; to go on after a failure call fastdist.comm.reset(mesh) on every rank; "
            "raise the timeout with fastdist.connect(timeout=...) or "
            "fastdist.comm.with_timeout(mesh, ...)",
        )
    return CommError(
        op,
        ac.label,
        ac.ranks,
        rank,
        f"{what}{where} failed: {msg}{extra}",
        "a peer closed the connection: it failed (see its log) or exited; if every rank is still "
        "alive, call fastdist.comm.reset(mesh) on every rank to go on",
    )


# what torch.distributed's own errors look like (c10d, gloo, NCCL), raised from inside a compiled
# graph where fastdist's eager wrapping (TorchAxisComm.run) is not on the stack
_C10D_ERROR = re.compile(
    r"third_party/gloo|ProcessGroup|c10d|NCCL|Timed out waiting|Connection closed by peer|"
    r"Connection reset by peer|Socket Timeout|process group|DistBackendError"
)


class comm_guard(contextlib.ContextDecorator):  # noqa: N801 - used like a function
    """Turn torch.distributed's own errors inside a block (or a wrapped function) into fastdist's,
    for the meshes given: use it around a compiled step.

    Eagerly every collective on a real mesh raises :class:`~fastdist.CollectiveTimeout` or
    :class:`~fastdist.CommError` and drops the mesh's groups, so that the recovery pattern ``except
    fastdist.FastdistError: fastdist.comm.reset(mesh)`` works. Inside a ``torch.compile``'d step the
    collectives run in the graph, where a timeout or a lost peer surfaces as torch's own
    ``RuntimeError`` (gloo: "Timed out waiting 3000ms for recv operation ..."). Under ``comm_guard``
    such an error (a ``torch.distributed.DistError``, or a ``RuntimeError`` whose message comes from
    c10d, gloo or NCCL) becomes a :class:`~fastdist.CollectiveTimeout` (a timeout) or
    :class:`~fastdist.CommError` naming the block, the mesh's axes and this rank, with torch's error
    as its ``__cause__``; the groups of every mesh given are dropped, as eagerly, so that peers
    still waiting in them fail at once. A fastdist error raised while dynamo traces the step (say
    creating a process group times out), which torch.compile wraps in its own exception, is raised
    as itself. Other exceptions (fastdist's own, a shape error in the model) pass through unchanged.
    Plain (simulated) meshes may be given: they have no groups.

    As a decorator (``step = fastdist.comm.comm_guard(mesh)(torch.compile(step))``) or a block::

        try:
            with fastdist.comm.comm_guard(mesh):
                loss = compiled_step(batch)
        except fastdist.FastdistError:
            fastdist.comm.reset(mesh)  # every rank; the step is traced again on its next call

    Args:
        mesh: a mesh whose torch.distributed errors to translate (and whose groups to drop).
        *meshes: more meshes, likewise.

    >>> import fastdist as fd
    >>> with fd.comm.comm_guard(fd.Mesh({"tp": 2})):
    ...     pass
    """

    def __init__(self, mesh: Mesh, *meshes: Mesh) -> None:
        for m in (mesh, *meshes):
            # a Mesh (checked by its fields: this module does not import fastdist.core.mesh)
            if not all(hasattr(m, f) for f in ("_comm", "axis_names", "size")):
                raise MeshError(
                    f"fastdist.comm.comm_guard: expected fastdist.Mesh values, got "
                    f"{type(m).__name__}. Fix: pass the meshes the guarded step runs on"
                )
        self.meshes = (mesh, *meshes)

    def __enter__(self) -> comm_guard:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        if error is None or not isinstance(error, Exception):
            return
        inner = _wrapped_fastdist_error(error)
        if inner is not None:
            # fastdist's own error, raised while dynamo traced (e.g. creating a group) and wrapped
            # by it: raised as itself, shown with its own cause, not dynamo's wrapper
            inner.__suppress_context__ = True
            raise inner
        if not _is_c10d_error(error):
            return
        raise self.translate(error) from error

    def translate(self, error: BaseException) -> CommError:
        """The fastdist error for ``error`` (torch.distributed's), after dropping the groups of
        the real meshes given.

        Args:
            error: the error torch.distributed raised.

        Returns:
            a ``CollectiveTimeout`` (a timeout) or ``CommError`` naming the block, the mesh's axes
            and this rank.
        """
        real = [m for m in self.meshes if m.comm is not None]
        msg = clean_error(error)
        for m in real:
            dropped = cast("TorchComm", m.comm)
            dropped.abandon(
                f"fastdist.comm_guard: a call on rank {dropped.global_rank} failed: {msg}"
            )
        mesh = real[0] if real else self.meshes[0]
        comm = cast("TorchComm | None", mesh.comm)
        rank = comm.global_rank if comm is not None else -1
        names = mesh.axis_names
        axes = names[0] if len(names) == 1 else names
        ranks = list(comm.ranks) if comm is not None else list(range(mesh.size))
        timed_out = isinstance(error, TimeoutError) or any(
            w in msg.lower() for w in ("timed out", "timeout")
        )
        reset = (
            "call fastdist.comm.reset(mesh) on every rank of the mesh to go on (the step is traced "
            "again)"
        )
        if timed_out:
            secs = comm.timeout.total_seconds() if comm is not None else float("nan")
            return CollectiveTimeout(
                "comm_guard",
                axes,
                ranks,
                rank,
                f"a collective inside the guarded block (a compiled step) timed out: a peer did "
                f"not arrive within the mesh's timeout ({secs:g} s): {msg}",
                "check that every rank makes the same collectives in the same order; "
                + reset
                + "; raise the timeout with fastdist.connect(timeout=...) or "
                "fastdist.comm.with_timeout(mesh, ...)",
            )
        return CommError(
            "comm_guard",
            axes,
            ranks,
            rank,
            f"a collective inside the guarded block (a compiled step) failed: {msg}",
            "a peer closed the connection: it failed (see its log) or exited; if every rank is "
            "still alive, " + reset,
        )


def _wrapped_fastdist_error(error: BaseException) -> BaseException | None:
    """The fastdist error that torch.compile wrapped in ``error`` (one of dynamo's or inductor's
    exceptions, whose cause chain holds it), else None."""
    if not type(error).__module__.startswith(("torch._dynamo", "torch._inductor")):
        return None
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        if isinstance(link, FastdistError):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def _is_c10d_error(error: BaseException) -> bool:
    """Whether ``error`` comes from torch.distributed (not from fastdist, not from the model)."""
    if isinstance(error, FastdistError):
        return False
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and bool(_C10D_ERROR.search(str(error)))
