"""The per-axis communicator of a real mesh: this rank's group along one axis (or tuple of
axes), the collectives on it (through a transport), check mode, and an async all-reduce.

:func:`axis_comm` gives the communicator of a mesh built by ``fastdist.connect`` for an axis:
what training code uses for its own asynchronous reductions and process groups
(``ac.all_reduce_async(op, flat)``, ``ac.process_group(op, "cuda")``). It implements
:class:`fastdist.core.comm.AxisComm`, the protocol the collectives are written against.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor

from fastdist.comm.failures import (
    clean_error,
    comm_error,
    member_label,
    run_while_tracing,
    wait_for_keys,
)
from fastdist.comm.transports import FunctionalTransport, TorchTransport, select_backend
from fastdist.core.transforms import transform_error, unsupported_transform
from fastdist.errors import (
    CollectiveError,
    CommError,
    ConsistencyError,
    MeshError,
    NoBackendError,
)

if TYPE_CHECKING:
    from fastdist.comm.torch_comm import TorchComm
    from fastdist.core.comm import Transport
    from fastdist.core.mesh import AxisName, Mesh

__all__ = ["TorchAxisComm", "PendingAllReduce", "axis_comm"]

T = TypeVar("T")
#: whether a torch.func transform is active on this thread (a C call that reads thread-local
#: state, a third of maybe_get_level's cost); without it, every call asks the tensor
_TRANSFORMS_ACTIVE: Callable[[], bool] = getattr(
    torch._C, "_are_functorch_transforms_active", lambda: True
)


@run_while_tracing
def group_name_while_tracing(
    comm: TorchComm, idx: tuple[int, ...], backend: str, op: str, tag: str
) -> str:
    """Run (not traced) while dynamo traces a collective: the group's name, creating the group now
    if needed.

    ``tag`` names the comm's current groups; passing it makes dynamo guard on it, so a step
    compiled before :meth:`TorchComm.reset` is traced again (with the new groups) after it.
    """
    return comm.group_name_for(idx, backend, op)


class TorchAxisComm:
    """This rank's group along one axis (or tuple of axes): ranks in axis order, own index,
    groups. Get it with :func:`axis_comm`.

    Args:
        comm: the mesh's communicator.
        idx: the positions of the group's axes in the mesh.
        label: the axis name (or tuple of names), for messages.
        ranks: the members' global ranks, in axis order.
    """

    def __init__(
        self, comm: TorchComm, idx: tuple[int, ...], label: Any, ranks: tuple[int, ...]
    ) -> None:
        self.comm, self.idx, self.label, self.ranks = comm, idx, label, ranks
        self.n = len(ranks)
        self.index = ranks.index(comm.global_rank)
        self.rank = comm.global_rank  # global, as the ranks
        self._transports: dict[str, TorchTransport] = {}
        # blocking calls made on this group (eagerly): names the call a failure report is about
        self.calls = 0

    def drop_transports(self) -> None:
        """Forget the transports made so far (their groups are gone: `TorchComm.abandon`)."""
        self._transports.clear()

    def cpu_group(self, op: str) -> Any:
        """A gloo group for objects and metadata (the device group when tensors live on CPU)."""
        return self.comm.group(self, "gloo", op)

    def process_group(self, op: str, device_type: str) -> Any:
        """This group's ``torch.distributed`` process group for tensors on ``device_type`` (created
        on first use, eagerly; ``op`` names the call in errors).

        Args:
            op: the calling op, for error messages.
            device_type: ``"cpu"``, ``"cuda"`` or ``"npu"``.

        Returns:
            the process group (e.g. for ``DistributedDataParallel(process_group=...)``).
        """
        return self.comm.group(self, self.backend(op, device_type), op)

    @property
    def timeout(self) -> datetime.timedelta:
        """The mesh's timeout: how long each blocking call on this group waits for its peers."""
        return self.comm.timeout

    def abandon(self, why: str) -> None:
        """Drop the mesh's groups after a failure (see :meth:`TorchComm.abandon`)."""
        self.comm.abandon(why)

    def run(self, op: str, fn: Callable[..., T], *args: Any, what: str = "the collective") -> T:
        """``fn(*args)``, a blocking call, with timeouts and lost peers turned into errors that
        name op, axis and ranks."""
        if torch.compiler.is_compiling():
            return fn(*args)
        self.comm.check_usable(op, self)
        entered = self.comm.enter(op, self)
        self.calls += 1
        try:
            return fn(*args)
        except (CommError, MeshError, NoBackendError):
            raise
        except Exception as e:  # c10d raises RuntimeError/DistError for everything
            traceback.clear_frames(e.__traceback__)  # let go of the group (see _collective)
            raise self.failed(op, e, what) from e
        finally:
            if entered:
                self.comm.in_call = None

    def failed(self, op: str, e: BaseException, what: str) -> CommError:
        """The error for a failed blocking call: its cause without source paths, and which peers
        did not reach the call.

        Each member whose call fails leaves a note in the job's store under this call's number
        on this group; this rank then waits briefly for its peers' notes. A peer without a note
        did not reach the call (it raised before it, skipped it, is stuck elsewhere or exited).
        Before that the mesh's groups are destroyed (:meth:`TorchComm.abandon`), so that peers
        blocked in this call, or in another call on the mesh that waits for this rank, fail at
        once and report too.
        """
        self.comm.abandon(
            f"fastdist.{op}(axis={self.label!r}) failed on this rank: {clean_error(e)}"
        )
        return comm_error(op, self, self.rank, e, what, peers=self._peer_report(what))

    def _peer_report(self, what: str) -> str:
        others = [r for r in self.ranks if r != self.rank]
        if not others:
            return ""
        grace = min(2.0, max(0.25, 0.25 * self.comm.timeout.total_seconds()))
        prefix = f"fastdist/{self.comm.tag}/{member_label(self.ranks)}/call{self.calls}/"
        try:
            self.comm.store.set(prefix + str(self.rank), what)
            missing = wait_for_keys(self.comm.store, prefix, others, grace, keep_last=True)
        except Exception:  # noqa: BLE001 - the store is gone too: report the failure without the roll call
            return ""
        if not missing:
            return (
                f"every rank of the group reached this call (call {self.calls} on this group) and "
                "it failed on each, so they probably disagree "
                "on it (different ops, shapes or sizes: fastdist.connect(check=True) compares them)"
            )
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        return (
            f"{who} did not reach this call (call {self.calls} on this group) within {grace:g} s "
            f"of this failure: {'they' if len(missing) > 1 else 'it'} may have raised an error "
            f"before it (see {'their logs' if len(missing) > 1 else 'its log'}), skipped it, be "
            "stuck elsewhere, or have exited"
        )

    # --------------------------------------------------------------- collectives
    # Each method picks the transport for x's device -- torch.distributed (TorchTransport) or,
    # on a ctypes mesh, NCCL/HCCL (fastdist.comm.native.NativeCommunicator): same methods and
    # results.
    def transport(self, op: str, x: Tensor) -> Transport:
        """The transport of this axis group for ``x``'s device (memoised per device type;
        functional under compile)."""
        if self.comm.native_lib is not None:
            nc = self.comm.native(self, op, x)  # None when the backend does not serve x's device
            if nc is not None:
                return nc
        kind = x.device.type
        backend = self.backend(op, kind)
        if torch.compiler.is_compiling():
            return FunctionalTransport(
                group_name_while_tracing(self.comm, self.idx, backend, op, self.comm.tag), self.n
            )
        t = self._transports.get(kind)
        if t is None:
            t = self._transports[kind] = TorchTransport(self.comm.group(self, backend, op), self.n)
        return t

    def backend(self, op: str, device_type: str) -> str:
        """The c10d backend for tensors on ``device_type``; for none, an error naming the op, the
        axis and the fix."""
        try:
            return select_backend(device_type)
        except NoBackendError as e:
            if device_type == "meta":
                problem = "'meta' tensors hold no data to communicate"
                fix = (
                    "pass cpu, cuda or npu tensors; to work out shapes only, run the per-rank code "
                    "under fastdist.simulate (simulated ranks take meta tensors) or let "
                    "torch.compile trace it with fake tensors"
                )
            else:
                problem, fix = (
                    str(e).removeprefix("fastdist: ").split(". Fix: ", 1)
                    if ". Fix: " in str(e)
                    else (str(e), "move tensors to cpu, cuda or npu")
                )
            raise NoBackendError(
                f"fastdist.{op}(axis={self.label!r}) on rank {self.rank} (group ranks "
                f"{list(self.ranks)}): {problem}. Fix: {fix}"
            ) from None

    def _collective(self, op: str, x: Tensor, method: str, *args: Any) -> Tensor:
        """``transport.method(op, x, *args)``; failures become errors naming op, axis and ranks (as
        :meth:`run`)."""
        if torch.compiler.is_compiling():
            try:
                return cast(Tensor, getattr(self.transport(op, x), method)(op, x, *args))
            except CollectiveError as e:  # a dtype no backend carries: raised before sending
                raise e.readdress(axis=self.label, rank=f"rank {self.rank}") from None
        # under a torch.func transform (none, the usual case: one C call), vmap or jvp (e.g. a
        # collective's backward under jacrev) refused before anything is sent
        if _TRANSFORMS_ACTIVE():
            transform = unsupported_transform(x)
            if transform is not None:
                raise transform_error(op, self.label, f"rank {self.rank}", transform)
        comm = self.comm
        if comm.broken is not None:
            comm.check_usable(op, self)
        # TorchComm.enter's usual case inline: no call on the mesh in progress, so this thread
        # takes the mark (an outer call on this thread, or another thread's: enter decides)
        if comm.in_call is None:
            comm.in_call, entered = threading.get_ident(), True
        else:
            entered = comm.enter(op, self)
        self.calls += 1
        t: Transport | None = None
        try:
            if comm.native_lib is None:
                # x.is_cpu first: reading x.device.type builds a device and a string
                t = self._transports.get("cpu" if x.is_cpu else x.device.type)
            if t is None:
                t = self.transport(op, x)
            out: Tensor = getattr(t, method)(op, x, *args)
            return out
        except (CommError, MeshError, NoBackendError):
            raise
        except CollectiveError as e:  # a dtype no backend carries: raised before sending
            raise e.readdress(axis=self.label, rank=f"rank {self.rank}") from None
        except Exception as e:  # c10d raises RuntimeError/DistError for everything
            # let go of the group, so that abandoning it frees it and its connections close
            t = None
            # the same for the finished frames of the failed call
            traceback.clear_frames(e.__traceback__)
            raise self.failed(op, e, "the collective") from e
        finally:
            if entered:
                comm.in_call = None

    def all_reduce(self, op: str, x: Tensor, reduce_op: str) -> Tensor:
        """Elementwise ``reduce_op`` (``"sum" | "max" | "min"``) over members; same shape."""
        return self._collective(op, x, "all_reduce", reduce_op)

    def all_gather_rows(self, op: str, x: Tensor) -> Tensor:
        """Concatenate every member's ``x`` along dim 0, in axis order."""
        return self._collective(op, x, "all_gather_rows")

    def reduce_scatter_rows(self, op: str, x: Tensor) -> Tensor:
        """Sum over members, member ``i`` keeps chunk ``i`` of dim 0."""
        return self._collective(op, x, "reduce_scatter_rows")

    def all_to_all_rows(
        self, op: str, x: Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None
    ) -> Tensor:
        """Rows ``in_splits[j]`` of dim 0 go to member ``j``; received rows are stacked by sender
        (``None``: equal splits)."""
        return self._collective(op, x, "all_to_all_rows", out_splits, in_splits)

    def broadcast(self, op: str, x: Tensor, src: int) -> Tensor:
        """Every member gets member ``src``'s ``x``."""
        return self._collective(op, x, "broadcast", src)

    def all_gather_v_rows(self, op: str, x: Tensor, sizes: Sequence[int]) -> Tensor:
        """Member ``i`` contributes ``x[:sizes[i]]``; all get them concatenated on dim 0
        (``[sum(sizes), ...]``)."""
        return self._collective(op, x, "all_gather_v_rows", sizes, self.index)

    def reduce_scatter_v_rows(self, op: str, x: Tensor, sizes: Sequence[int]) -> Tensor:
        """Sum ``x`` (``[sum(sizes), ...]``) over members; member ``i`` keeps its ``sizes[i]``
        rows."""
        return self._collective(op, x, "reduce_scatter_v_rows", sizes, self.index)

    def all_reduce_async(
        self, op: str, x: Tensor, *, what: str = "the all-reduce"
    ) -> PendingAllReduce:
        """Start summing ``x`` over the group in place; the handle's ``wait()`` finishes it.

        Eager only (the c10d group of ``x``'s device). A failure to start, or in ``wait()``,
        raises as :meth:`run` does, naming ``what``.

        Args:
            op: the calling op, for error messages.
            x: a contiguous tensor, summed in place.
            what: what the reduction carries, for error messages.

        Returns:
            the pending reduction: ``wait()`` blocks until ``x`` holds the sum.
        """
        group = self.process_group(op, x.device.type)
        work = self.run(op, lambda: dist.all_reduce(x, group=group, async_op=True), what=what)
        return PendingAllReduce(self, op, work, what)

    # --------------------------------------------------------------- check mode
    def check(self, op: str, tensors: Sequence[Tensor], params: Mapping[str, Any]) -> None:
        """Check mode: every member must call ``op`` with the same shapes, dtypes and parameters."""
        if not self.comm.check or torch.compiler.is_compiling():
            return
        mine = (
            op,
            [tuple(t.shape) for t in tensors],
            [str(t.dtype) for t in tensors],
            dict(params),
            _call_site(),
        )
        every: list[Any] = [None] * self.n
        group = self.cpu_group(op)
        self.run(
            op,
            lambda: dist.all_gather_object(every, mine, group=group),
            what="the consistency check",
        )
        if any(e != every[0] for e in every):
            table = "; ".join(
                f"rank {r}: {e[0]}(shapes={e[1]}, dtypes={e[2]}, params={e[3]}) at "
                f"{e[4][0]}:{e[4][1]}"
                for r, e in zip(self.ranks, every)
            )
            where = (
                " (the same call from different lines: a rank skipped or added a call before "
                "this one, so its calls pair with its peers' other calls)"
                if all(e[:4] == every[0][:4] for e in every)
                else ""
            )
            raise ConsistencyError(
                op,
                self.label,
                self.ranks,
                self.rank,
                f"the ranks disagree{where}: {table}",
                "make every rank of the group make the same calls in the same order, each from "
                "the same line of code",
            )


class PendingAllReduce:
    """A started :meth:`TorchAxisComm.all_reduce_async`: :meth:`wait` blocks until it is done.

    Args:
        ac: the group it runs on.
        op: the calling op, for error messages.
        work: torch's work handle.
        what: what the reduction carries, for error messages.
    """

    def __init__(self, ac: TorchAxisComm, op: str, work: Any, what: str) -> None:
        self.ac, self.op, self.work, self.what = ac, op, work, what

    def wait(self) -> None:
        """Block until the reduction is done; a timeout or a lost peer raises as
        :meth:`TorchAxisComm.run` does."""
        self.ac.run(self.op, self.work.wait, what=self.what)


# where fastdist's and torch's own frames live: skipped when check mode looks for the caller
_LIBRARY_DIRS = (
    os.path.join(str(Path(__file__).parent.parent), ""),  # src/fastdist/
    os.path.join(str(Path(torch.__file__).parent), ""),
)


def _call_site() -> tuple[str, int]:
    """``(file name, line)`` of the innermost frame outside fastdist and torch: where the user's
    code called the collective (check mode compares it between ranks). The file's name without
    its directory: the script may sit in different directories on different nodes."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_LIBRARY_DIRS):
            return os.path.basename(name), frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>", 0


# =================================================================== helpers on real ranks
def axis_comm(mesh: Mesh, axis: AxisName | None, op: str) -> TorchAxisComm:
    """The communicator of this rank's group along ``axis`` of a mesh built by ``fastdist.connect``.

    Args:
        mesh: a mesh over a ``torch.distributed`` job (real ranks).
        axis: the mesh axis (or tuple of axes); ``None``: the whole mesh.
        op: the calling op, for error messages.

    Returns:
        the group's communicator (cached by the mesh).
    """
    comm = cast("TorchComm | None", mesh.comm)
    if comm is None:
        raise NoBackendError(
            f"fastdist.{op}: {mesh!r} is not backed by torch.distributed. Fix: build it with "
            "fastdist.connect(...) inside a torch.distributed job"
        )
    names = mesh.axis_names if axis is None else axis
    ac: TorchAxisComm = comm.axis(mesh.axis_indices(names, f"fastdist.{op}"))
    return ac
