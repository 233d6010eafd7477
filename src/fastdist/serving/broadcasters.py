"""vLLM's broadcaster constructors as functions of a mesh: one writer to every other rank
(:func:`create_mq_broadcaster`), or every other rank to one reader
(:func:`create_single_reader_mq_broadcasters`)."""

from __future__ import annotations

from typing import Any

from fastdist.errors import CollectiveError
from fastdist.ops.prelude import check_index, names_this_rank
from fastdist.serving.node import axis_group
from fastdist.serving.queue import MessageQueue, build_queues

__all__ = ["create_mq_broadcaster", "create_single_reader_mq_broadcasters"]


@names_this_rank
def create_mq_broadcaster(
    mesh: Any, axis: Any = None, *, writer: int = 0, **kwargs: Any
) -> MessageQueue:
    """vLLM's ``GroupCoordinator.create_mq_broadcaster``: :meth:`MessageQueue.create` with every
    other index reading. Collective.

    Args:
        mesh: a mesh from ``fastdist.connect``.
        axis: the axis of the queue; default: the whole mesh.
        writer: the index along ``axis`` that writes.
        **kwargs: passed to ``MessageQueue.create`` (``max_chunk_bytes``, ``max_chunks``,
            ``timeout``, ...).

    Returns:
        this rank's end of the queue.
    """
    return MessageQueue.create(mesh, axis, writer=writer, **kwargs)


@names_this_rank
def create_single_reader_mq_broadcasters(
    mesh: Any, axis: Any = None, *, reader: int = 0, **kwargs: Any
) -> tuple[MessageQueue | None, list[MessageQueue | None]]:
    """vLLM's ``create_single_reader_mq_broadcasters``: every other index writes to its own queue,
    read by ``reader``. Collective.

    Returns ``(mine, theirs)``: on a writing rank ``mine`` is its queue (to ``enqueue``) and
    ``theirs`` is empty; on the reader ``mine`` is None and ``theirs[i]`` is the queue from
    index ``i`` (None at ``reader``). One setup for all queues (four small all-gathers).

    Args:
        mesh: a mesh from ``fastdist.connect``.
        axis: the axis of the queues; default: the whole mesh.
        reader: the index along ``axis`` that reads every queue.
        **kwargs: passed to ``MessageQueue.create`` for every queue.

    >>> mine, theirs = create_single_reader_mq_broadcasters(mesh, "tp")        # doctest: +SKIP
    >>> replies = [q.dequeue() for q in theirs if q is not None]   # on index 0   # doctest: +SKIP
    """
    op = "create_single_reader_mq_broadcasters"
    ranks, index, label = axis_group(op, mesh, axis)
    n = len(ranks)
    check_index(op, label, "reader", reader, n)
    writers = [i for i in range(n) if i != reader]
    opts: dict[str, Any] = {
        "max_chunk_bytes": 1 << 20,
        "max_chunks": 8,
        "timeout": 60.0,
        "nodes": None,
    }
    unknown = sorted(set(kwargs) - set(opts))
    if unknown:  # a misspelt option would otherwise leave its default in force, silently
        raise CollectiveError(
            op,
            label,
            f"unknown option(s) {unknown}",
            f"pass only {sorted(opts)} (the writers are every index but reader={reader})",
        )
    opts.update(kwargs)
    qs = build_queues(
        op,
        mesh,
        axis,
        [(w, [reader]) for w in writers],
        opts["max_chunk_bytes"],
        opts["max_chunks"],
        opts["timeout"],
        opts["nodes"],
    )
    if index == reader:
        theirs: list[MessageQueue | None] = [None] * n
        for w, q in zip(writers, qs):
            theirs[w] = q
        return None, theirs
    for w, q in zip(writers, qs):
        if w != index:
            q.close()  # a bystander's object holds nothing
    return qs[writers.index(index)], []
