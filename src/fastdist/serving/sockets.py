"""The TCP side of :class:`~fastdist.serving.MessageQueue`: how readers on other hosts reach the
writer.

The writer listens on an address of its host (:func:`address`); each remote reader connects and
greets it with its axis index and the queue's random token (:func:`connect_to_writer`); the
writer accepts exactly the readers it expects (:func:`accept_readers`). A message then goes out
as its length (8 bytes) and its pickle; the length :data:`CLOSE` says the writer closed the queue.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Sequence

__all__ = [
    "CLOSE",
    "COALESCE",
    "FRAME",
    "accept_readers",
    "address",
    "connect_to_writer",
    "is_open",
    "listen",
]

FRAME = struct.Struct("<Q")  # a message's length, before its body
CLOSE = 2**64 - 1  # the frame length that says the writer closed the queue
COALESCE = 1 << 16  # a socket message up to this size goes out in one send (header + body)
_HELLO = struct.Struct("<Q16s")  # a remote reader's greeting: its axis index, the queue's token


def address() -> str:
    """An address of this host that the other hosts can reach: ``FASTDIST_MQ_ADDR``, else the
    interface that routes to ``MASTER_ADDR``."""
    given = os.environ.get("FASTDIST_MQ_ADDR")
    if given:
        return given
    master = os.environ.get("MASTER_ADDR", "")
    if master and master not in ("localhost", "127.0.0.1", "::1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                # no packet is sent: only picks the route
                s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
                return str(s.getsockname()[0])
        except OSError:
            pass
    try:
        addr = socket.gethostbyname(socket.gethostname())
        return addr if not addr.startswith("127.") or not master else "127.0.0.1"
    except OSError:
        return "127.0.0.1"


def is_open(c: socket.socket) -> bool:
    """False when a readable socket is at EOF (or broken).

    Args:
        c: a connected socket that ``select`` found readable.
    """
    try:
        return bool(c.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return True
    except OSError:
        return False


def listen(readers: int) -> tuple[socket.socket, str, int]:
    """The writer's listening socket for ``readers`` remote readers, with the address and port
    they connect to.

    Args:
        readers: how many remote readers will connect.
    """
    lst = socket.create_server(("", 0), backlog=readers + 4)
    return lst, address(), int(lst.getsockname()[1])


def connect_to_writer(
    addr: str, port: int, index: int, token: bytes, timeout: float
) -> socket.socket:
    """A remote reader's connection to the writer, greeted with its axis ``index`` and the queue's
    ``token``.

    Args:
        addr: the writer's address.
        port: the writer's port.
        index: this reader's index along the axis.
        token: the queue's 16-byte token.
        timeout: seconds to wait for the connection.
    """
    s = socket.create_connection((addr, port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(_HELLO.pack(index, token))
    return s


def _greeting(c: socket.socket) -> tuple[int, bytes] | None:
    """The axis index and token a new connection sends, or None when it sends less."""
    hello = b""
    while len(hello) < _HELLO.size:
        chunk = c.recv(_HELLO.size - len(hello))
        if not chunk:
            break
        hello += chunk
    if len(hello) != _HELLO.size:
        return None
    idx, tok = _HELLO.unpack(hello)
    return int(idx), bytes(tok)


def accept_readers(
    listener: socket.socket,
    want: Sequence[int],
    token: bytes,
    deadline: float,
    ranks: Sequence[int],
    conns: dict[int, socket.socket],
) -> None:
    """Accept the remote readers ``want`` (axis indices) by their greeting into ``conns``; close
    the listener once all came.

    A connection with a wrong token, an index not expected, or a cut-off greeting is closed and
    ignored.

    Args:
        listener: the writer's listening socket.
        want: the remote readers' axis indices.
        token: the queue's token.
        deadline: ``time.monotonic()`` by which every reader must have connected.
        ranks: the group's global ranks, in axis order (for the error).
        conns: filled with each remote reader's axis index -> its connection (those accepted
            before a timeout stay there, for the caller to close).

    Raises:
        TimeoutError: some readers did not connect by ``deadline`` (names their ranks).
    """
    left = set(want)
    while left:
        listener.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            c, _ = listener.accept()
        except TimeoutError as e:
            raise TimeoutError(
                f"remote reader(s) {sorted(ranks[i] for i in left)} did not connect within the "
                "timeout"
            ) from e
        c.settimeout(max(deadline - time.monotonic(), 1e-3))
        hello = _greeting(c)
        if hello is None or hello[1] != token or hello[0] not in left:
            c.close()
            continue
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns[hello[0]] = c
        left.discard(hello[0])
    listener.close()
