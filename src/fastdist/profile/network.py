"""The network and the alpha-beta model: :class:`Link`, :class:`Network` and the documented
:data:`NETWORKS`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastdist.profile._common import compute_time, in_node
from fastdist.profile.records import Record, Work

__all__ = ["NETWORKS", "Link", "Network"]


@dataclass(frozen=True)
class Link:
    """One level of the network, seen from one GPU.

    Attributes:
        bandwidth: bytes per second one GPU can send (one direction).
        latency: seconds per message (alpha).
    """

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Network:
    """Two levels: GPUs within a node (``intra``) and across nodes (``inter``), and optionally
    the device's compute.

    Attributes:
        name: for tables.
        gpus_per_node: consecutive ranks ``[k*g, (k+1)*g)`` share node ``k``.
        intra: the link between GPUs of one node.
        inter: one GPU's share of the links between nodes.
        flops: achieved matmul FLOP/s of one device (0: compute is not charged).
        memory_bandwidth: achieved bytes/s of the other kernels (0: not charged).
        kernel_latency: seconds charged per kernel launch (0: not charged).
    """

    name: str
    gpus_per_node: int
    intra: Link
    inter: Link
    flops: float = 0.0
    memory_bandwidth: float = 0.0
    kernel_latency: float = 0.0

    def link(self, mesh_sizes: Sequence[int], axes: Sequence[int]) -> Link:
        """The link a group along ``axes`` of a row-major mesh runs over: ``intra`` if the
        group of rank 0 lies in one node, else ``inter`` (the slowest link bounds a ring).

        Args:
            mesh_sizes: the mesh's axis sizes, outer to inner (row-major).
            axes: the positions of the group's axes among them.

        Returns:
            ``intra`` or ``inter``.
        """
        return self.intra if in_node(mesh_sizes, axes, self.gpus_per_node) else self.inter

    def collective_time(self, r: Record, mesh_sizes: Sequence[int], axes: Sequence[int]) -> float:
        """The ring's ``steps x latency + bus_bytes / bandwidth`` on :meth:`link`."""
        link = self.link(mesh_sizes, axes)
        return r.steps * link.latency + r.bus_bytes / link.bandwidth

    def compute_time(self, work: Work) -> float:
        """``flops / flops + bytes / memory_bandwidth + kernels x kernel_latency`` (a rate of 0:
        that term is not charged)."""
        return compute_time(work, self.flops, self.memory_bandwidth, self.kernel_latency)


#: Documented defaults (see docs/profile.md for the sources). Bandwidths are per GPU and per
#: direction; latencies are per message and are rough assumptions, not measurements.
NETWORKS: dict[str, Network] = {
    # DGX H100: NVLink 4, 900 GB/s bidirectional per GPU (450 GB/s each way); 8x ConnectX-7 NDR 400
    # Gb/s (50 GB/s) per GPU.
    "dgx-h100": Network("dgx-h100", 8, Link(450e9, 3e-6), Link(50e9, 10e-6)),
    # DGX A100: NVLink 3, 600 GB/s bidirectional per GPU (300 GB/s each way); 8x ConnectX-6 HDR 200
    # Gb/s (25 GB/s) per GPU.
    "dgx-a100": Network("dgx-a100", 8, Link(300e9, 3e-6), Link(25e9, 10e-6)),
    # 8 PCIe GPUs per node without NVLink (PCIe 4 x16, ~25 GB/s each way in practice) and 100 Gb/s
    # Ethernet per node shared by 8 GPUs.
    "pcie-ethernet": Network("pcie-ethernet", 8, Link(25e9, 5e-6), Link(12.5e9 / 8, 30e-6)),
}
