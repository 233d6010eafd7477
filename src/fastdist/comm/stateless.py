"""A process group over a ``TCPStore`` alone: any subset of processes, no global default group.

Useful to coordinate processes that are not (or not yet) in one ``torch.distributed`` job:
a disaggregated prefill/decode pair, a driver and its workers, an elastic helper. It moves
picklable objects through the store (as :func:`fastdist.comm.pickling.dumps` pickles: a float8,
uint16/32/64 or complex32 tensor arrives equal), so it is for metadata, not bulk tensors.

Each message gets its own key, named by sender, receiver and a per-peer counter, so
messages between any two processes arrive in order and never overwrite each other. A
process deletes the keys it wrote once they are older than ``data_expiration`` seconds,
so a long-lived group does not grow the store without bound.

Usage, one process per member (rank 0 also hosts the store)::

    g = StatelessGroup.create("127.0.0.1", 29600, rank=rank, world_size=2)
    if rank == 0:
        g.send_obj({"step": 3}, dst=1)
    else:
        assert g.recv_obj(src=0) == {"step": 3}
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from typing import Any

import torch.distributed as dist

from fastdist.comm.pickling import dumps, loads
from fastdist.errors import CollectiveTimeout, CommArgumentError, CommError, MeshError

__all__ = ["StatelessGroup"]


class StatelessGroup:
    """Objects between ``world_size`` processes through a shared ``torch.distributed.Store``.

    Args:
        store: a store every member can reach (usually a ``TCPStore``).
        rank: this member's rank in ``0..world_size-1``.
        world_size: number of members.
        timeout: how long a receive waits for its sender.
        data_expiration: seconds after which a member deletes the keys it wrote.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        timeout: float = 300.0,
        data_expiration: float = 3600.0,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise MeshError(
                f"StatelessGroup: world_size must be a positive int, got {world_size!r}"
            )
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise MeshError(f"StatelessGroup: rank {rank!r} is outside 0..{world_size - 1}")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout, self.data_expiration = float(timeout), float(data_expiration)
        self._sent = [0] * world_size  # messages sent to each peer
        self._received = [0] * world_size  # messages received from each peer
        self._broadcasts = [0] * world_size  # broadcasts seen from each source
        self._written: deque[tuple[str, float]] = deque()  # (key, time written), oldest first

    @classmethod
    def create(
        cls,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        timeout: float = 300.0,
        data_expiration: float = 3600.0,
    ) -> StatelessGroup:
        """Connect to (rank 0: host) a ``TCPStore`` at ``host:port`` and form the group.

        Args:
            host: the address of the ``TCPStore`` (rank 0 hosts it).
            port: its port.
            rank: this member's rank in the group.
            world_size: the members.
            timeout: how long a receive waits for its sender (seconds).
            data_expiration: seconds after which a member deletes the keys it wrote.

        Returns:
            the group, formed.
        """
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host,
                port,
                world_size,
                is_master=(rank == 0),
                timeout=datetime.timedelta(seconds=timeout),
                wait_for_workers=False,
            )
        except Exception as e:  # noqa: BLE001
            raise CommError(
                "StatelessGroup.create",
                None,
                list(range(world_size)),
                rank,
                f"could not reach the store at {host}:{port}: {e}",
                "check host, port and that rank 0 runs",
            ) from e
        return cls(store, rank, world_size, timeout=timeout, data_expiration=data_expiration)

    # ------------------------------------------------------------------ keys
    def _put(self, op: str, key: str, obj: Any) -> None:
        try:
            self.store.set(key, dumps(obj))
        except dist.DistNetworkError as e:
            raise self._store_closed(op, e) from e
        self._written.append((key, time.monotonic()))
        self.expire()

    def _get(self, op: str, key: str, peer: int) -> bytes:
        """The pickle ``peer`` wrote under ``key``, once it is there (:meth:`_unpickled` loads
        it)."""
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout))
            data: bytes = self.store.get(key)
            return data
        except dist.DistNetworkError as e:  # the connection to the store broke: no point in waiting
            raise self._store_closed(op, e) from e
        except Exception as e:  # noqa: BLE001 - the store raises DistStoreError on timeout
            raise CollectiveTimeout(
                op,
                None,
                list(range(self.world_size)),
                self.rank,
                f"nothing from rank {peer} within {self.timeout:g} s ({key})",
                f"check that rank {peer} makes the matching call",
            ) from e

    def _unpickled(self, op: str, data: bytes, key: str, peer: int) -> Any:
        """The object ``peer`` pickled into ``data``; a pickle this member cannot load raises a
        :class:`~fastdist.CommError` naming the sender (the message is read: the next receive
        gets the one after it)."""
        try:
            return loads(data)
        except Exception as e:
            raise CommError(
                op,
                None,
                list(range(self.world_size)),
                self.rank,
                f"the object from rank {peer} ({key}) arrived but could not be unpickled on this "
                f"member ({type(e).__name__}: {e}); the next receive gets the message after it",
                "send objects every member can unpickle: classes importable on every member (not "
                "defined only on the sender or in an interactive session), tensors on devices "
                "every member has",
            ) from e

    def _store_closed(self, op: str, e: BaseException) -> CommError:
        """The error for a store that went away: usually its host (rank 0 of :meth:`create`)
        exited."""
        where = (
            f" at {self.store.host}:{self.store.port}"
            if hasattr(self.store, "host") and hasattr(self.store, "port")
            else ""
        )
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return CommError(
            op,
            None,
            list(range(self.world_size)),
            self.rank,
            f"the connection to the store{where} closed ({cause}); the process hosting it "
            "(rank 0 when the group was made with StatelessGroup.create) has probably exited",
            "keep the store's host alive as long as any member uses the group; make a new group "
            "to go on",
        )

    def expire(self, older_than: float | None = None) -> int:
        """Delete the keys this member wrote more than ``older_than`` seconds ago (default
        ``data_expiration``); return how many.

        Every send calls it with the default. A key a slow receiver has not read yet is lost
        once it expires (that receive then times out), so keep ``data_expiration`` well above
        the longest time a message may wait to be read.

        Args:
            older_than: the age in seconds above which keys are deleted.

        Returns:
            how many keys were deleted.
        """
        age = self.data_expiration if older_than is None else float(older_than)
        now, n = time.monotonic(), 0
        while self._written and now - self._written[0][1] > age:
            self.store.delete_key(self._written.popleft()[0])
            n += 1
        return n

    def _check_peer(self, op: str, name: str, peer: Any) -> int:
        if (
            isinstance(peer, bool)
            or not isinstance(peer, int)
            or not 0 <= peer < self.world_size
            or peer == self.rank
        ):
            raise CommArgumentError(
                op,
                None,
                list(range(self.world_size)),
                self.rank,
                f"{name}={peer!r} is not another member",
                f"use a rank in 0..{self.world_size - 1} other than {self.rank}",
            )
        return peer

    # ------------------------------------------------------------------ messages
    def send_obj(self, obj: Any, dst: int) -> None:
        """Send a picklable object to ``dst`` (returns at once; ``dst`` reads it with
        :meth:`recv_obj`).

        Args:
            obj: the picklable object.
            dst: the receiving member.
        """
        self._check_peer("StatelessGroup.send_obj", "dst", dst)
        self._put("StatelessGroup.send_obj", f"p2p/{self.rank}->{dst}/{self._sent[dst]}", obj)
        self._sent[dst] += 1

    def recv_obj(self, src: int) -> Any:
        """The next object ``src`` sent to this member, in order.

        Args:
            src: the sending member.

        Returns:
            the next object ``src`` sent to this member.
        """
        op = "StatelessGroup.recv_obj"
        self._check_peer(op, "src", src)
        key = f"p2p/{src}->{self.rank}/{self._received[src]}"
        data = self._get(op, key, src)
        self._received[src] += 1
        return self._unpickled(op, data, key, src)

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        """``src`` passes the object; every member returns it.

        Args:
            obj: the object (only ``src``'s is used).
            src: the member whose object every member returns.

        Returns:
            ``src``'s object.
        """
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size:
            raise CommArgumentError(
                "StatelessGroup.broadcast_obj",
                None,
                list(range(self.world_size)),
                self.rank,
                f"src={src!r} is not a member",
                f"use 0..{self.world_size - 1}",
            )
        key = f"bcast/{src}/{self._broadcasts[src]}"
        self._broadcasts[src] += 1
        if self.rank == src:
            self._put("StatelessGroup.broadcast_obj", key, obj)
            return obj
        op = "StatelessGroup.broadcast_obj"
        return self._unpickled(op, self._get(op, key, src), key, src)

    def all_gather_obj(self, obj: Any) -> list[Any]:
        """Every member's object, by rank.

        Args:
            obj: this member's object.

        Returns:
            every member's object, by rank.
        """
        return [
            self.broadcast_obj(obj if r == self.rank else None, src=r)
            for r in range(self.world_size)
        ]

    def barrier(self) -> None:
        """Return once every member has called it (or raise
        :class:`~fastdist.CollectiveTimeout`)."""
        self.all_gather_obj(None)
