"""Serving plumbing (vLLM-shaped): a message queue broadcaster on a mesh axis, and node locality.

One concern per module:

* :mod:`~fastdist.serving.queue`: :class:`MessageQueue`, one writer and N readers of picklable
  objects, and its collective setup.
* :mod:`~fastdist.serving.wire`: ``QueueWire``, the queue's ends and how a message's bytes
  move over them (ring fragments, socket frames), with the waits and errors of both.
* :mod:`~fastdist.serving.broadcasters`: vLLM's constructors, :func:`create_mq_broadcaster`
  and :func:`create_single_reader_mq_broadcasters`.
* :mod:`~fastdist.serving.shm_ring`: the shared-memory ring the readers on the writer's host
  read.
* :mod:`~fastdist.serving.sockets`: the TCP connections of the readers on other hosts.
* :mod:`~fastdist.serving.node`: :func:`node_info` and :func:`local_device`, which ranks share
  a host and this rank's device.
* :mod:`~fastdist.serving.checks`: the setup's argument checks.

The queue's errors (:class:`PeerLostError`, :class:`QueueClosedError`, :class:`QueueEmpty`,
:class:`QueueFull`) are defined in :mod:`fastdist.errors` and exported here too.
"""

from fastdist.errors import PeerLostError, QueueClosedError, QueueEmpty, QueueFull
from fastdist.serving.broadcasters import (
    create_mq_broadcaster,
    create_single_reader_mq_broadcasters,
)
from fastdist.serving.node import NodeInfo, local_device, node_info
from fastdist.serving.queue import MessageQueue

__all__ = [
    "MessageQueue",
    "NodeInfo",
    "PeerLostError",
    "QueueClosedError",
    "QueueEmpty",
    "QueueFull",
    "create_mq_broadcaster",
    "create_single_reader_mq_broadcasters",
    "local_device",
    "node_info",
]
