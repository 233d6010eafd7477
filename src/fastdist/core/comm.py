"""What the collectives need from a real-rank communicator: declared protocols, no transport.

The ops (``fastdist.ops``) and the primitive machinery (:mod:`fastdist.core.primitive`) run on
real ranks through ``spec.comm``, this rank's group along the op's axes: an :class:`AxisComm`.
``fastdist.comm`` implements these protocols over ``torch.distributed``
(``fastdist.comm.axes.TorchAxisComm``, ``fastdist.comm.torch_comm.TorchComm``) and the
ctypes NCCL/HCCL bindings (``fastdist.comm.native.NativeCommunicator``, a :class:`Transport`);
nothing below ``fastdist.comm`` imports it.

Every method takes ``op``, the fastdist op it serves, for its error messages. Row methods work
on dim 0: ``all_gather_rows`` concatenates every member's rows in axis order, and so on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from fastdist.core.mesh import MeshComm

if TYPE_CHECKING:
    from torch import Tensor

    from fastdist.core.mesh import AxisName
    from fastdist.core.primitive import GroupSpec

__all__ = ["GroupCollectives", "Transport", "Pending", "AxisComm", "Comm"]


class GroupCollectives(Protocol):
    """The collectives an axis group's :class:`Transport` and :class:`AxisComm` have alike."""

    def all_reduce(self, op: str, x: Tensor, reduce_op: str) -> Tensor:
        """Elementwise ``reduce_op`` (``"sum" | "max" | "min" | "prod"``) over members."""
        ...

    def all_gather_rows(self, op: str, x: Tensor) -> Tensor:
        """Every member's ``x`` concatenated along dim 0, in axis order."""
        ...

    def reduce_scatter_rows(self, op: str, x: Tensor) -> Tensor:
        """Sum over members; member ``i`` keeps chunk ``i`` of dim 0."""
        ...

    def all_to_all_rows(
        self, op: str, x: Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None
    ) -> Tensor:
        """Rows ``in_splits[j]`` go to member ``j``; received rows stacked by sender."""
        ...

    def broadcast(self, op: str, x: Tensor, src: int) -> Tensor:
        """Every member gets member ``src``'s ``x``."""
        ...


class Transport(GroupCollectives, Protocol):
    """The collectives of one axis group on one device type (c10d, functional or ctypes)."""

    def all_gather_v_rows(self, op: str, x: Tensor, sizes: Sequence[int], index: int) -> Tensor:
        """Member ``i`` contributes ``x[:sizes[i]]``; all get them concatenated on dim 0."""
        ...

    def reduce_scatter_v_rows(self, op: str, x: Tensor, sizes: Sequence[int], index: int) -> Tensor:
        """Sum over members; member ``index`` keeps its ``sizes[index]`` rows."""
        ...


class Pending(Protocol):
    """A started asynchronous collective: ``wait()`` blocks until its result is in place."""

    def wait(self) -> None:
        """Block until done; a timeout or a lost peer raises a ``fastdist.CommError``."""
        ...


class Comm(MeshComm, Protocol):
    """The communicator of a mesh on this process (a mesh's ``comm``), as the collectives use it:
    :class:`~fastdist.core.mesh.MeshComm` (what the mesh itself reads) and the axis groups."""

    @property
    def global_rank(self) -> int:
        """This process's rank in the job."""
        ...

    @property
    def check(self) -> bool:
        """Whether check mode is on (every collective compares its arguments across members)."""
        ...

    def axis(self, idx: tuple[int, ...]) -> AxisComm:
        """This rank's group along the mesh axes at positions ``idx``."""
        ...

    def spec(self, axis: AxisName, op: str) -> GroupSpec:
        """The collectives' group spec for ``axis`` (its ``comm`` an :class:`AxisComm`)."""
        ...


class AxisComm(GroupCollectives, Protocol):
    """This rank's group along one axis (or tuple of axes) on real ranks: ``spec.comm``.

    ``n`` members, ranks in axis order, this rank at ``index``; the collectives of
    :class:`Transport` without the ``index`` argument, an async all-reduce, and check mode.
    """

    @property
    def comm(self) -> Comm:
        """The mesh's communicator."""
        ...

    @property
    def n(self) -> int:
        """The group size."""
        ...

    @property
    def index(self) -> int:
        """This rank's index along the axis."""
        ...

    @property
    def rank(self) -> int:
        """This process's global rank."""
        ...

    @property
    def ranks(self) -> tuple[int, ...]:
        """The members' global ranks, in axis order."""
        ...

    @property
    def label(self) -> Any:
        """The axis name (or tuple of names), for messages."""
        ...

    def all_gather_v_rows(self, op: str, x: Tensor, sizes: Sequence[int]) -> Tensor:
        """Member ``i`` contributes ``x[:sizes[i]]``; all get them concatenated on dim 0."""
        ...

    def reduce_scatter_v_rows(self, op: str, x: Tensor, sizes: Sequence[int]) -> Tensor:
        """Sum ``x`` (``[sum(sizes), ...]``) over members; member ``i`` keeps its rows."""
        ...

    def all_reduce_async(self, op: str, x: Tensor, *, what: str = ...) -> Pending:
        """Start summing ``x`` in place over the group; ``wait()`` on the handle finishes it."""
        ...

    def check(self, op: str, tensors: Sequence[Tensor], params: Mapping[str, Any]) -> None:
        """Check mode: every member must call ``op`` with the same shapes, dtypes and params."""
        ...
