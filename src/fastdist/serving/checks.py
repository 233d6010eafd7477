"""The argument checks of the message queue's setup: each names the caller, the axis and the fix,
and raises :class:`~fastdist.CollectiveError` on every rank before anything is made."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastdist.errors import CollectiveError
from fastdist.ops.prelude import check_index

__all__ = ["MAX_TIMEOUT_S", "check_options", "check_readers"]

#: the longest timeout a queue takes, in seconds (a socket's wait overflows near 1e10 s)
MAX_TIMEOUT_S = 1e9


def check_options(
    op: str, label: Any, max_chunk_bytes: int, max_chunks: int, timeout: float
) -> None:
    """Refuse a slot size or count that is not a positive int, or a timeout that is not positive,
    finite seconds (nan would never time out; inf overflows a socket's wait).

    Args:
        op: the public name of the caller.
        label: the axis the errors name.
        max_chunk_bytes: the size of one slot.
        max_chunks: how many slots.
        timeout: the queue's default timeout in seconds.
    """
    for arg, v in (("max_chunk_bytes", max_chunk_bytes), ("max_chunks", max_chunks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CollectiveError(
                op, label, f"{arg}={v!r} is not a positive int", f"pass {arg} >= 1"
            )
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout <= MAX_TIMEOUT_S  # nan and inf too: every wait must end
    ):
        raise CollectiveError(
            op,
            label,
            f"timeout={timeout!r} is not positive, finite seconds",
            f"pass 0 < timeout <= {MAX_TIMEOUT_S:g} (a wait must end)",
        )


def check_readers(
    op: str, label: Any, n: int, writer: int, readers: Sequence[int] | None
) -> tuple[int, ...]:
    """The checked reader indices of a queue written by ``writer`` on an axis of ``n`` ranks.

    Args:
        op: the public name of the caller.
        label: the axis the errors name.
        n: the axis size.
        writer: the writer's index.
        readers: the readers' indices; ``None``: every index but the writer's.
    """
    check_index(op, label, "writer", writer, n)
    rd = tuple(i for i in range(n) if i != writer) if readers is None else tuple(readers)
    if any(
        isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n or r == writer for r in rd
    ) or len(set(rd)) != len(rd):
        raise CollectiveError(
            op,
            label,
            f"readers={list(rd)} must be distinct indices along the axis other than the "
            f"writer {writer}",
            f"use indices in 0..{n - 1}",
        )
    return rd
