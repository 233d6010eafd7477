"""Exceptions raised by fastdist.

Every error names the operation, the mesh axis (where there is one), the rank it
happened on and what to do about it. Validation errors subclass ``ValueError`` so
``except ValueError`` keeps working for callers that do not know fastdist: a bad argument
to a collective or to a helper on real ranks (``send``/``recv``, the object and tensor-dict
helpers) is a :class:`CollectiveError`; a mesh built or addressed wrongly a
:class:`MeshError`. Failures of the communication itself are :class:`CommError`
(``RuntimeError``).
"""

from __future__ import annotations

import os
import queue
import sys
import traceback
from collections.abc import Sequence

__all__ = [
    "FastdistError",
    "MeshError",
    "CollectiveError",
    "ReductionDtypeError",
    "NoBackendError",
    "CommError",
    "CommArgumentError",
    "CollectiveTimeout",
    "ConsistencyError",
    "LibraryError",
    "LibraryNotFoundError",
    "TargetError",
    "GlooRunError",
    "PipelineError",
    "ParallelizeError",
    "MoEError",
    "InitError",
    "PeerLostError",
    "QueueClosedError",
    "QueueEmpty",
    "QueueFull",
    "CheckpointError",
    "ReplicaMismatchError",
    "ProfileError",
]


_KEEP: object = object()  # readdress: leave this field as it is


class FastdistError(Exception):
    """Base class of every exception fastdist raises on purpose."""


class MeshError(FastdistError, ValueError):
    """A mesh was built or addressed wrongly: bad sizes, unknown axis, bad rank."""


class CollectiveError(FastdistError, ValueError):
    """A collective was called with arguments that cannot work on this mesh.

    Attributes:
        op: the public name of the collective, e.g. ``"all_gather"``.
        axis: the mesh axis (or tuple of axes) it was called over.
        rank: where it was detected: ``"every rank"`` for an argument check on simulated
            ranks (one program checks them all); ``"rank N"`` on a real mesh (each rank checks
            its own inputs, which may differ from its peers'), or for per-rank data found wrong
            on rank N; ``"rank index i"`` for an input too short on the axis's rank ``i``.
        fix: one sentence on how to make the call valid.
    """

    def __init__(
        self, op: str, axis: object, problem: str, fix: str, rank: str = "every rank"
    ) -> None:
        self.op, self.axis, self.rank, self.fix, self.problem = op, axis, rank, fix, problem
        super().__init__(self._text())

    def _text(self) -> str:
        return (
            f"fastdist.{self.op}(axis={self.axis!r}) on {self.rank}: {self.problem}. "
            f"Fix: {self.fix}"
        )

    def readdress(
        self,
        *,
        op: str | None = None,
        axis: object = _KEEP,
        rank: str | None = None,
        problem: str | None = None,
    ) -> CollectiveError:
        """This error, in place, naming what the caller sees: the public ``op`` that was called
        (when a helper op raised it), the ``axis`` (None included), the ``rank`` it was detected
        on, the ``problem`` in the caller's terms. Returns ``self``; the type and traceback stay."""
        self.op = self.op if op is None else op
        self.axis = self.axis if axis is _KEEP else axis
        self.rank = self.rank if rank is None else rank
        self.problem = self.problem if problem is None else problem
        self.args = (self._text(),)
        return self


class ReductionDtypeError(CollectiveError, TypeError):
    """A reduction (``psum``, ``pmean``, ``pmax``, ``pmin``, ``psum_scatter``, ``reduce_scatter_v``)
    got a dtype it does not take.

    One rule decides, for every reduction and every backend (simulated, torch.distributed,
    ctypes NCCL/HCCL): see "Dtypes of reductions" in the API reference. Also a ``ValueError``
    (as every :class:`CollectiveError`) and a ``TypeError``.

    Attributes:
        op, axis, rank, fix: as :class:`CollectiveError`.
        dtype: the refused ``torch.dtype``.
        reduction: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"prod"``.
    """

    def __init__(
        self,
        op: str,
        axis: object,
        dtype: object,
        reduction: str,
        problem: str,
        fix: str,
        rank: str = "every rank",
    ) -> None:
        self.dtype, self.reduction = dtype, reduction
        super().__init__(op, axis, problem, fix, rank=rank)


class PipelineError(FastdistError, ValueError):
    """A pipeline was built or run with arguments that cannot work: a schedule that does not
    suit the micro-batch count, stages that do not divide the layers, a model family the
    stage split does not know. The message names the stage (or rank), the problem and the fix."""


class NoBackendError(FastdistError, RuntimeError):
    """A collective ran on a mesh that has no way to communicate here.

    A plain :class:`~fastdist.Mesh` only describes ranks. Collectives on it run
    inside :func:`fastdist.simulate` (all ranks in this process).
    """


class CommError(FastdistError, RuntimeError):
    """Communication with other processes failed: a peer left, a group could not be formed.

    Attributes:
        op: the operation, e.g. ``"psum"`` or ``"broadcast_object"``.
        axis: the mesh axis (or tuple) it ran over.
        ranks: the global ranks of the group, in axis order.
        rank: this process's global rank.
    """

    def __init__(
        self, op: str, axis: object, ranks: Sequence[int], rank: int, problem: str, fix: str
    ) -> None:
        self.op, self.axis, self.ranks, self.rank = op, axis, tuple(ranks), rank
        super().__init__(
            f"fastdist.{op}(axis={axis!r}) on rank {rank} (group ranks {list(ranks)}): {problem}. "
            f"Fix: {fix}"
        )


class CommArgumentError(CollectiveError, CommError):  # type: ignore[misc]  # rank: "rank N"
    """A helper on real ranks (``send``/``recv``, ``send_object``/``recv_object``,
    ``broadcast_object``, the tensor-dict helpers, the messages of
    :class:`~fastdist.comm.StatelessGroup`) got an argument that cannot work: ``dst`` or ``src`` not
    an index along the axis (a member), or this rank's own index.

    Raised before any communication, so the mesh stays usable. A :class:`CollectiveError` (and so
    a ``ValueError``), like the same mistake in a collective (``broadcast(src=...)``); also a
    :class:`CommError`, which these helpers raised for it before.

    Attributes:
        op, axis, problem, fix: as :class:`CollectiveError`.
        rank: ``"rank N"``, this process's global rank (as :class:`CollectiveError` on a real mesh).
        ranks: the global ranks of the group, in axis order.
    """

    def __init__(
        self, op: str, axis: object, ranks: Sequence[int], rank: int, problem: str, fix: str
    ) -> None:
        self.op, self.axis, self.rank, self.fix, self.problem = (
            op,
            axis,
            f"rank {rank}",
            fix,
            problem,
        )
        self.ranks = tuple(ranks)
        Exception.__init__(self, self._text())  # both bases' __init__ take other arguments

    def _text(self) -> str:
        return (
            f"fastdist.{self.op}(axis={self.axis!r}) on {self.rank} (group ranks "
            f"{list(self.ranks)}): {self.problem}. Fix: {self.fix}"
        )


class CollectiveTimeout(CommError, TimeoutError):
    """A peer did not arrive within the timeout."""


class ConsistencyError(CommError):
    """Check mode: the ranks of a group called a collective with different arguments."""


class LibraryError(NoBackendError):
    """A native collective library (NCCL/HCCL through ctypes) is unusable: it does not load,
    lacks a function fastdist needs, or a call in it failed outside any collective."""


class LibraryNotFoundError(LibraryError):
    """No NCCL/HCCL library was found. The message lists every place fastdist looked.

    Attributes:
        kind: ``"nccl"`` or ``"hccl"``.
        tried: one line per place looked, with what was found there.
        fix: how to point fastdist at a library.
    """

    def __init__(self, kind: str, tried: Sequence[str], fix: str) -> None:
        self.kind, self.tried, self.fix = kind, list(tried), fix
        looked = "".join(f"\n  {i}. {t}" for i, t in enumerate(self.tried, 1))
        super().__init__(
            f"fastdist: no {kind.upper()} library found. Looked, in order:{looked}\nFix: {fix}"
        )


#: ``TargetError.ignore_index`` when no value is skipped (token ids of an embedding)
NO_IGNORE_INDEX = -(2**63)


class TargetError(FastdistError, ValueError):
    """A loss got class ids (targets, labels) outside the vocabulary that are not ``ignore_index``.

    Raised when the data is seen: eagerly, or when a compiled step runs (then possibly
    wrapped by torch.compile's own exception, whose message contains this one).

    Attributes:
        op: the loss, e.g. ``"cross_entropy"``.
        axis: the mesh axis the vocabulary is split over.
        rank: the (lowest) global rank holding a bad target.
        simulated: whether that rank is simulated (:func:`fastdist.simulate`) or this process.
        bad: the distinct bad values on that rank, sorted (the message shows the first five).
        count: how many targets are bad on that rank.
        total: how many targets that rank holds.
        vocab_size: valid class ids are ``[0, vocab_size)``.
        ignore_index: the value that marks a target to skip.
        other_ranks: further simulated ranks holding bad targets.
    """

    def __init__(
        self,
        op: str,
        axis: object,
        rank: int,
        simulated: bool,
        bad: Sequence[int],
        count: int,
        total: int,
        vocab_size: int,
        ignore_index: int,
        other_ranks: Sequence[int] = (),
    ) -> None:
        self.op, self.axis, self.rank, self.simulated = op, axis, rank, simulated
        self.bad, self.count, self.total = list(bad), count, total
        self.vocab_size, self.ignore_index, self.other_ranks = (
            vocab_size,
            ignore_index,
            list(other_ranks),
        )
        where = "simulated rank" if simulated else "rank"
        shown = ", ".join(map(str, self.bad[:5])) + (", ..." if len(self.bad) > 5 else "")
        also = f" (also on {where}s {self.other_ranks})" if self.other_ranks else ""
        if ignore_index == NO_IGNORE_INDEX:  # token ids of an embedding: nothing to skip
            super().__init__(
                f"fastdist.{op}(axis={axis!r}) on {where} {rank}: {count} of {total} token ids "
                f"are out of range, bad values [{shown}]{also}; valid ids are [0, {vocab_size}). "
                "Fix: check the input ids against the vocabulary (a single-device nn.Embedding "
                "raises IndexError here)"
            )
            return
        super().__init__(
            f"fastdist.{op}(axis={axis!r}) on {where} {rank}: {count} of {total} targets are out "
            f"of range, bad values [{shown}]{also}; valid targets are class ids in [0, "
            f"{vocab_size}) or ignore_index={ignore_index} (a token to skip). Fix: check the "
            f"labels against the vocabulary (vocab_size={vocab_size}: pass vocab_size= when the "
            "logits' vocabulary is padded), or mark the tokens to skip with ignore_index"
        )


class GlooRunError(FastdistError, AssertionError):
    """:func:`fastdist.testing.run_on_gloo` failed: what happened to each rank that gave no result.

    An ``AssertionError``, so a test that calls ``run_on_gloo`` fails (not errors) under pytest.

    Attributes:
        fn: the name of the function the ranks ran.
        world_size: how many ranks ran it.
        failures: rank -> what happened, in the order it was seen (the first is usually the
            cause): ``"raised ValueError: ..."`` with the rank's traceback, ``"exited with code
            3 ..."``, ``"killed by SIGKILL ..."``, ``"still running after the ... s timeout"``.
        exitcodes: rank -> its process's exit code (negative: the signal that ended it).
        timed_out: whether the run hit ``timeout`` with no other failure to explain it.
    """

    def __init__(
        self,
        fn: str,
        world_size: int,
        failures: dict[int, str],
        exitcodes: dict[int, int | None],
        timed_out: bool,
    ) -> None:
        self.fn, self.world_size, self.failures, self.exitcodes, self.timed_out = (
            fn,
            world_size,
            dict(failures),
            dict(exitcodes),
            timed_out,
        )
        what = "timed out" if timed_out else "failed"
        body = "\n".join(f"--- rank {r}: {text}" for r, text in failures.items())
        super().__init__(f"run_on_gloo({fn}, {world_size}) {what}:\n{body}")


class ParallelizeError(MeshError):
    """A plan does not fit the model: a pattern that matches nothing, a module of the wrong kind,
    heads that do not split (raised by `fastdist.nn.parallelize` and its styles)."""


class MoEError(FastdistError, ValueError):
    """An expert-parallel layer cannot run as asked: experts that do not split over ``ep``, top-k
    larger than the number of experts, a capacity too small for a dropless run on simulated ranks.
    The message names the layer and the fix."""


class InitError(Exception):
    """A module's init that cannot be reproduced shard by shard (internal to ``fastdist.nn``: the
    public functions raise it as the caller's own error type, `ParallelizeError`)."""


class PeerLostError(CommError):
    """A message queue's peer exited (its process is gone, or its socket closed without the close
    message).

    Attributes (besides :class:`~fastdist.CommError`'s):
        peer: the global rank of the peer that is gone.
    """

    def __init__(
        self,
        op: str,
        axis: object,
        ranks: Sequence[int],
        rank: int,
        peer: int,
        problem: str,
        fix: str,
    ) -> None:
        self.peer = peer
        super().__init__(op, axis, ranks, rank, problem, fix)


class QueueClosedError(CommError):
    """A reader asked for a message after the writer closed the queue and every message was read."""


class QueueEmpty(FastdistError, queue.Empty):
    """``dequeue(block=False)`` found no message (also a ``queue.Empty``)."""


class QueueFull(FastdistError, queue.Full):
    """``enqueue(block=False)`` could not place the message at once (also a ``queue.Full``);
    nothing was sent."""


class CheckpointError(MeshError, KeyError):
    """A checkpoint does not match the model (a missing or unexpected key, a shape that differs),
    cannot be read completely (a missing, truncated or damaged file, named in the message; the
    model and optimizer are then left as they were), or cannot be written (raised by
    `fastdist.checkpoint`, and by `fastdist.nn` state dicts). An ``Exception``, unlike torch's
    ``CheckpointException``, so ``except Exception`` catches it."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class ReplicaMismatchError(FastdistError, ValueError):
    """Ranks that should hold equal copies of a tensor (a replicated parameter, its gradient)
    differ."""


class ProfileError(FastdistError, ValueError):
    """A profile, dry run or plan was asked for something it cannot compute (``fastdist.profile``).

    Attributes:
        op: what was being profiled or planned (e.g. ``"trace"``, ``"plan"``).
        fix: one sentence on how to make the call valid.
    """

    def __init__(self, op: str, problem: str, fix: str) -> None:
        self.op, self.fix = op, fix
        super().__init__(f"fastdist.profile.{op}: {problem}. Fix: {fix}")


def _user_line() -> str:
    """``file:line: code`` of the innermost frame outside fastdist and torch (the user's line)."""
    here = os.path.dirname(os.path.abspath(__file__))  # the fastdist package
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    skip: tuple[str, ...] = (here,)
    if torch_file is not None:
        skip += (os.path.dirname(os.path.abspath(torch_file)),)
    for fs in reversed(traceback.extract_stack()):
        path = os.path.abspath(fs.filename)
        if not path.startswith(skip) and "contextlib" not in path:
            return f"{fs.filename}:{fs.lineno}: {(fs.line or '').strip()}"
    return "<unknown>"


class ReplicationError(FastdistError, ValueError):
    """A value's replication state does not fit how it is used (checked mode: ``fastdist.spmd``).

    Attributes: ``op``, ``axis``, ``where`` (the user's source line), ``fix``.
    """

    def __init__(
        self, op: str, axis: object, problem: str, fix: str, where: str | None = None
    ) -> None:
        self.op, self.axis, self.fix = op, axis, fix
        self.where = where if where is not None else _user_line()
        super().__init__(
            f"fastdist check: {op} over axis {axis!r} on every rank, at {self.where}: {problem}. "
            f"Fix: {fix}"
        )
