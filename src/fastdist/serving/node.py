"""Node locality: which ranks of a mesh axis share a host, the local rank, this rank's device.

FastVideo's ``in_the_same_node_as`` / ``get_local_torch_device`` as functions of a
:class:`~fastdist.Mesh` built with ``fastdist.connect``: :func:`node_info` exchanges hostnames
once per call; :func:`local_device` picks ``cuda:<local_rank>``, ``npu:<local_rank>`` or ``cpu``.
The process checks (:func:`pid_start_time`, :func:`pid_alive`) tell the message queue whether a
peer on this host still runs.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from fastdist.comm.p2p import all_gather_object
from fastdist.errors import MeshError, NoBackendError

__all__ = ["NodeInfo", "axis_group", "local_device", "node_info", "pid_alive", "pid_start_time"]


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def pid_start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (Linux ``/proc``), which tells a reused pid apart; None
    elsewhere.

    Args:
        pid: a process id on this host.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` (started at ``start``) still runs on this host (a zombie counts as
    gone).

    Args:
        pid: a process id on this host.
        start: its start time from :func:`pid_start_time` (None: any process with that pid).
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if fields[0] in ("Z", "X"):
        return False
    return start is None or int(fields[19]) == start


@dataclass(frozen=True)
class NodeInfo:
    """Where the ranks of a mesh axis run: which share a host with which.

    Built by :func:`node_info` (one all-gather of hostnames). Hosts are compared by hostname
    *and* boot id, so two machines that report the same hostname are still told apart.

    Attributes:
        axis: the axis (``None``: the whole mesh).
        ranks: the group's global ranks, in axis order.
        index: this rank's index along the axis.
        hosts: each index's hostname.
        host_keys: what hosts are compared by (hostname and boot id).
        pids: each index's process id and start time (for liveness checks on one host).
        whole_mesh: whether ``ranks`` are every rank of the mesh (:func:`node_info` over every
            axis of size > 1); :func:`local_device` needs such a one (a part's local ranks are
            not the host's).

    What rank 9 of ``torchrun --nnodes 2 --nproc-per-node 8`` sees (written out by hand here;
    :func:`node_info` fills it in a job):

    >>> from fastdist.serving import NodeInfo, local_device
    >>> hosts = ("node-a",) * 8 + ("node-b",) * 8
    >>> ids = tuple((100 + r, None) for r in range(16))
    >>> info = NodeInfo(None, tuple(range(16)), 9, hosts, hosts, ids)
    >>> info.local_rank, info.local_size, info.single_host
    (1, 8, False)
    >>> info.nodes
    [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
    >>> info.same_host(8), info.same_host(7)
    (True, False)
    >>> local_device(info, "cpu")
    device(type='cpu')
    """

    axis: Any
    ranks: tuple[int, ...]
    index: int
    hosts: tuple[str, ...]
    host_keys: tuple[str, ...]
    pids: tuple[tuple[int, int | None], ...]
    whole_mesh: bool = True

    def same_host(self, i: int, j: int | None = None) -> bool:
        """Whether axis indices ``i`` and ``j`` (default: this rank) run on one host.

        Args:
            i: an index along the axis.
            j: another index; default: this rank's.
        """
        return self.host_keys[i] == self.host_keys[self.index if j is None else j]

    def same_host_as(self, i: int) -> list[bool]:
        """For every index, whether it shares a host with index ``i`` (FastVideo's
        ``in_the_same_node_as``).

        Args:
            i: an index along the axis.
        """
        return [k == self.host_keys[i] for k in self.host_keys]

    @property
    def local_indices(self) -> tuple[int, ...]:
        """The axis indices on this rank's host, in axis order."""
        return tuple(i for i in range(len(self.ranks)) if self.same_host(i))

    @property
    def local_rank(self) -> int:
        """This rank's position among the ranks of the axis on its host (torchrun's ``LOCAL_RANK``
        for the whole mesh)."""
        return self.local_indices.index(self.index)

    @property
    def local_size(self) -> int:
        """How many ranks of the axis run on this rank's host."""
        return len(self.local_indices)

    @property
    def nodes(self) -> list[list[int]]:
        """The axis indices grouped by host, hosts in order of first appearance."""
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(self.host_keys):
            groups.setdefault(k, []).append(i)
        return list(groups.values())

    @property
    def single_host(self) -> bool:
        """Whether every rank of the axis runs on one host."""
        return len(set(self.host_keys)) == 1


def axis_group(op: str, mesh: Any, axis: Any) -> tuple[tuple[int, ...], int, Any]:
    """The global ranks of this rank's ``axis`` group (default: the whole mesh), this rank's index
    in it, and the axis label errors name.

    Args:
        op: the public name of the calling function (for the error).
        mesh: a mesh from ``fastdist.connect``.
        axis: an axis name, a tuple of them, or ``None`` for the whole mesh.

    Raises:
        NoBackendError: ``mesh`` is not backed by torch.distributed.
    """
    if getattr(mesh, "backend", None) is None:
        raise NoBackendError(
            f"fastdist.{op}: {mesh!r} is not backed by torch.distributed. Fix: build it with "
            "fastdist.connect(...) inside a torch.distributed job"
        )
    names = mesh.axis_names if axis is None else axis
    ranks = tuple(mesh.group(mesh.rank, names))
    label = axis if axis is not None else (names[0] if len(names) == 1 else tuple(names))
    return ranks, ranks.index(mesh.rank), label


def node_info(mesh: Any, axis: Any = None, *, hostname: str | None = None) -> NodeInfo:
    """Which ranks of ``axis`` (default: the whole mesh) share a host. Collective: every rank of
    the group calls it.

    One ``all_gather_object`` of (hostname, boot id, pid) over the axis; keep the result, it
    does not change. ``hostname`` overrides ``socket.gethostname()`` (tests use it to pretend
    ranks run on another host; hosts are then compared by the given names alone).

    Under ``torchrun --nnodes=N --nproc-per-node=P`` the global ranks of a node are
    consecutive, so on the whole mesh :attr:`NodeInfo.local_rank` equals ``LOCAL_RANK``.

    Args:
        mesh: a mesh from ``fastdist.connect``.
        axis: the axis whose ranks to locate; default: the whole mesh.
        hostname: a name to report instead of ``socket.gethostname()`` (hosts are then compared by
            these names alone).

    Returns:
        where the ranks of ``axis`` run, which share a host with which.

    >>> info = fastdist.serving.node_info(mesh)        # doctest: +SKIP
    >>> info.local_rank, info.local_size, info.nodes   # doctest: +SKIP
    (1, 4, [[0, 1, 2, 3], [4, 5, 6, 7]])
    """
    ranks, index, label = axis_group("node_info", mesh, axis)
    host = socket.gethostname() if hostname is None else hostname
    key = f"{host}/{_boot_id()}" if hostname is None else f"{host}/given"
    mine = (host, key, os.getpid(), pid_start_time(os.getpid()))
    every = all_gather_object(mine, mesh, axis)
    return NodeInfo(
        label,
        ranks,
        index,
        tuple(e[0] for e in every),
        tuple(e[1] for e in every),
        tuple((e[2], e[3]) for e in every),
        whole_mesh=len(ranks) == mesh.size,
    )


def _default_device_type() -> str:
    if torch.cuda.is_available():
        return "cuda"
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return "npu"
    return "cpu"


def local_device(where: Any, device_type: str | None = None) -> torch.device:
    """This rank's device: ``cuda:<local_rank>``, ``npu:<local_rank>`` or ``cpu``.

    ``where`` is a :class:`NodeInfo` of the whole mesh, or a mesh (then :func:`node_info` runs
    over the whole mesh: a collective). ``device_type`` defaults to ``cuda`` if available, else
    ``npu`` (``torch_npu``), else ``cpu``. Raises :class:`~fastdist.MeshError` when the host
    has fewer devices than ranks, or when ``where`` is a ``NodeInfo`` of one axis of a larger
    mesh (its local ranks repeat across the axis's groups: two ranks would share a device).

    Args:
        where: a ``NodeInfo`` of the whole mesh, or a mesh (then ``node_info`` runs over it: a
            collective).
        device_type: ``"cuda"``, ``"npu"`` or ``"cpu"``; default: ``cuda`` if available, else
            ``npu``, else ``cpu``.

    Returns:
        this rank's device: ``cuda:<local_rank>``, ``npu:<local_rank>`` or ``cpu``.

    >>> dev = fastdist.serving.local_device(mesh)   # doctest: +SKIP
    >>> torch.cuda.set_device(dev)             # doctest: +SKIP
    """
    info = where if isinstance(where, NodeInfo) else node_info(where)
    if not info.whole_mesh:
        raise MeshError(
            f"fastdist.local_device: the NodeInfo given covers axis {info.axis!r} only (ranks "
            f"{list(info.ranks)}): its local rank {info.local_rank} counts only that group's "
            "ranks on the host, so other groups' ranks would get the same device. Fix: pass "
            "node_info(mesh) (every axis), or the mesh itself"
        )
    kind = _default_device_type() if device_type is None else device_type
    if kind == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, kind, None)
    count = int(mod.device_count()) if mod is not None and hasattr(mod, "device_count") else 0
    if info.local_rank >= count:
        raise MeshError(
            f"fastdist.local_device: rank {info.ranks[info.index]} is local rank {info.local_rank} "
            f"of {info.local_size} on host {info.hosts[info.index]!r}, which has {count} {kind} "
            f"device(s). Fix: start at most {count} processes per host (torchrun "
            f"--nproc-per-node={count}), or check CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES"
        )
    return torch.device(kind, info.local_rank)
