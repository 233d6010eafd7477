"""Point-to-point and objects on real ranks: tensors and picklable objects between the ranks of
an axis group (``send``/``recv``, ``send_object``, ``broadcast_tensor_dict``, ...), ``barrier``,
and :func:`graph_capture`, which prepares a mesh's groups for CUDA graph capture.

Each function takes a mesh built by ``fastdist.connect`` and an axis; indices (``src``,
``dst``) are positions along that axis. Every call blocks up to the mesh's timeout.
Tensors (``send``/``recv``, the tensor dicts) travel as their bytes: a copy needs no dtype, so
every dtype arrives, including those gloo refuses (int16, uint16/32/64, every float8).

An object travels as its :func:`fastdist.comm.pickling.dumps` pickle, sent as bytes through
``torch.distributed``'s object collectives: a tensor of any dtype inside it arrives equal (float8,
uint16/32/64 and complex32 included, which torch's own pickling cannot bring back). An object that
does not pickle on its sender fails the call as any failed collective does; one that does not
unpickle on a receiving rank raises a :class:`~fastdist.CommError` there naming the sender (the
transfer completed: the mesh stays usable).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor

from fastdist.comm.axes import TorchAxisComm, axis_comm
from fastdist.comm.connect import create_groups
from fastdist.comm.failures import clean_error
from fastdist.comm.pickling import dumps, loads
from fastdist.comm.torch_comm import as_timedelta
from fastdist.comm.transports import select_backend
from fastdist.errors import CollectiveTimeout, CommArgumentError, CommError

if TYPE_CHECKING:
    from fastdist.core.mesh import AxisName, Mesh

__all__ = [
    "broadcast_object",
    "all_gather_object",
    "send_object",
    "recv_object",
    "broadcast_tensor_dict",
    "send_tensor_dict",
    "recv_tensor_dict",
    "graph_capture",
    "GraphCaptureContext",
    "send",
    "recv",
    "barrier",
]

T = TypeVar("T")


def _check_src(op: str, ac: TorchAxisComm, name: str, value: Any, *, peer: bool = False) -> int:
    """``value`` if it is an index along ``ac``'s axis (with ``peer``: another rank's); else a
    :class:`~fastdist.CommArgumentError`, raised before any communication (the mesh stays
    usable)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < ac.n:
        raise CommArgumentError(
            op,
            ac.label,
            ac.ranks,
            ac.rank,
            f"{name}={value!r} is not an index along the axis (size {ac.n})",
            f"use {name} in 0..{ac.n - 1}",
        )
    if peer and value == ac.index:
        others = [i for i in range(ac.n) if i != ac.index]
        raise CommArgumentError(
            op,
            ac.label,
            ac.ranks,
            ac.rank,
            f"{name}={value} is this rank's own index along the axis: a point-to-point call "
            "needs another rank",
            f"use {name} in {others} (the other indices along the axis)"
            if others
            else "the axis has one rank: there is no other rank to talk to; use the value directly",
        )
    return value


def _unpickled(op: str, ac: TorchAxisComm, data: bytes, sender: int) -> Any:
    """The object the rank with index ``sender`` along ``ac``'s axis pickled into ``data``
    (:func:`fastdist.comm.pickling.dumps`). A pickle this rank cannot load raises a
    :class:`~fastdist.CommError` naming the sender and the cause; the transfer itself completed on
    every rank, so the mesh stays usable."""
    try:
        return loads(data)
    except Exception as e:
        raise CommError(
            op,
            ac.label,
            ac.ranks,
            ac.rank,
            f"the object of rank {ac.ranks[sender]} (index {sender} along the axis) arrived but "
            f"could not be unpickled on this rank ({type(e).__name__}: {e}); the transfer "
            "itself completed, so the mesh stays usable",
            "send objects every rank of the group can unpickle: classes importable on every rank "
            "(not defined only on the sender or in an interactive session), tensors on devices "
            "every rank has",
        ) from e


def broadcast_object(obj: T, mesh: Mesh, axis: AxisName | None = None, src: int = 0) -> T:
    """Every rank of the group gets the (picklable) ``obj`` of the rank with index ``src`` along
    ``axis``.

    ``axis=None`` means the whole mesh. Blocks up to the mesh's timeout.

    Args:
        obj: the picklable object (only ``src``'s is used).
        mesh: a mesh from ``fastdist.connect`` (real ranks).
        axis: the mesh axis of the group (or a tuple of axes); ``None``: the whole mesh.
        src: the index along ``axis`` of the rank whose ``obj`` every rank gets.

    Returns:
        ``src``'s object, on every rank of the group.

    Raises:
        CommError: on a rank where ``src``'s object does not unpickle (a class this rank
            cannot import, a device it lacks), naming the sender; the mesh stays usable.
    """
    op = "broadcast_object"
    ac = axis_comm(mesh, axis, op)
    _check_src(op, ac, "src", src)
    box: list[Any] = [None]
    group = ac.cpu_group(op)

    def call() -> None:
        if ac.index == src:  # pickled inside the call: a failure releases the waiting peers
            box[0] = dumps(obj)
        dist.broadcast_object_list(box, group=group, group_src=src)

    ac.run(op, call)
    if ac.index == src:
        return obj
    return cast(T, _unpickled(op, ac, box[0], src))


def all_gather_object(obj: T, mesh: Mesh, axis: AxisName | None = None) -> list[T]:
    """The (picklable) ``obj`` of every rank of the group, in axis order.

    Args:
        obj: this rank's picklable object.
        mesh: a mesh from ``fastdist.connect`` (real ranks).
        axis: the mesh axis of the group (or a tuple of axes); ``None``: the whole mesh.

    Returns:
        every rank's object, in axis order.

    Raises:
        CommError: on a rank where a rank's object does not unpickle (a class this rank
            cannot import, a device it lacks), naming the sender; the mesh stays usable.
    """
    op = "all_gather_object"
    ac = axis_comm(mesh, axis, op)
    out: list[Any] = [None] * ac.n
    group = ac.cpu_group(op)
    ac.run(op, lambda: dist.all_gather_object(out, dumps(obj), group=group))
    return [_unpickled(op, ac, data, i) for i, data in enumerate(out)]


def send_object(obj: Any, mesh: Mesh, axis: AxisName, dst: int) -> None:
    """Send a picklable object to the rank with index ``dst`` along ``axis`` (pair with
    :func:`recv_object`).

    Args:
        obj: the picklable object.
        mesh: a mesh from ``fastdist.connect`` (real ranks).
        axis: the mesh axis (or tuple of axes) along which ``dst`` is an index.
        dst: the index of the receiving rank (not this rank's own).
    """
    ac = axis_comm(mesh, axis, "send_object")
    _check_src("send_object", ac, "dst", dst, peer=True)
    group = ac.cpu_group("send_object")
    ac.run("send_object", lambda: dist.send_object_list([dumps(obj)], group=group, group_dst=dst))


def recv_object(mesh: Mesh, axis: AxisName, src: int) -> Any:
    """Receive the object sent by the rank with index ``src`` along ``axis``.

    Args:
        mesh: a mesh from ``fastdist.connect`` (real ranks).
        axis: the mesh axis (or tuple of axes) along which ``src`` is an index.
        src: the index of the sending rank (not this rank's own).

    Returns:
        the object ``src`` sent.

    Raises:
        CommError: on a rank where ``src``'s object does not unpickle (a class this rank
            cannot import, a device it lacks), naming the sender; the mesh stays usable.
    """
    ac = axis_comm(mesh, axis, "recv_object")
    _check_src("recv_object", ac, "src", src, peer=True)
    box: list[Any] = [None]
    group = ac.cpu_group("recv_object")
    ac.run("recv_object", lambda: dist.recv_object_list(box, group=group, group_src=src))
    return _unpickled("recv_object", ac, box[0], src)


def _bytes(t: Tensor) -> Tensor:
    """``t``'s values as the point-to-point calls move them: its bytes, a flat uint8 tensor (a
    view of ``t`` when ``t`` is contiguous, so receiving into it fills ``t``; a lazy conjugate or
    negation resolved first). A copy needs no dtype, and gloo refuses many (int16, uint16/32/64,
    every float8: "Invalid scalar type")."""
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def send(x: Tensor, mesh: Mesh, axis: AxisName, dst: int) -> None:
    """Send tensor ``x`` to the rank with index ``dst`` along ``axis`` (not differentiable; see
    ``ppermute``).

    Args:
        x: the tensor to send.
        mesh: a mesh from ``fastdist.connect`` (real ranks).
        axis: the mesh axis (or tuple of axes) along which ``dst`` is an index.
        dst: the index of the receiving rank (not this rank's own).
    """
    ac = axis_comm(mesh, axis, "send")
    _check_src("send", ac, "dst", dst, peer=True)
    group = ac.comm.group(ac, select_backend(x.device.type), "send")
    ac.run("send", lambda: dist.send(_bytes(x), group=group, group_dst=dst))


def recv(like: Tensor, mesh: Mesh, axis: AxisName, src: int) -> Tensor:
    """Receive a tensor shaped like ``like`` (shape, dtype, device) from index ``src`` along
    ``axis``.

    Args:
        like: a tensor with the shape, dtype and device of the one to receive.
        mesh: a mesh from ``fastdist.connect`` (real ranks).
        axis: the mesh axis (or tuple of axes) along which ``src`` is an index.
        src: the index of the sending rank (not this rank's own).

    Returns:
        the received tensor.
    """
    ac = axis_comm(mesh, axis, "recv")
    _check_src("recv", ac, "src", src, peer=True)
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    group = ac.comm.group(ac, select_backend(out.device.type), "recv")
    ac.run("recv", lambda: dist.recv(_bytes(out), group=group, group_src=src))
    return out


def _split_dict(d: Mapping[str, Any]) -> tuple[list[tuple[str, Any]], list[Tensor]]:
    """Metadata (tensor shapes/dtypes/devices, other values as they are) and the tensors, in key
    order."""
    meta: list[tuple[str, Any]] = []
    tensors: list[Tensor] = []
    for key, value in d.items():
        if isinstance(value, Tensor):
            meta.append((key, ("__tensor__", tuple(value.shape), value.dtype, value.device.type)))
            tensors.append(value.contiguous())
        else:
            meta.append((key, ("__value__", value)))
    return meta, tensors


def _empty_from(meta: list[tuple[str, Any]]) -> tuple[dict[str, Any], list[Tensor]]:
    out: dict[str, Any] = {}
    tensors: list[Tensor] = []
    for key, entry in meta:
        if entry[0] == "__tensor__":
            _, shape, dtype, device_type = entry
            device = (
                torch.device(device_type, torch.cuda.current_device())
                if device_type == "cuda"
                else torch.device(device_type)
            )
            out[key] = t = torch.empty(shape, dtype=dtype, device=device)
            tensors.append(t)
        else:
            out[key] = entry[1]
    return out, tensors


def broadcast_tensor_dict(
    d: Mapping[str, Any] | None, mesh: Mesh, axis: AxisName | None = None, src: int = 0
) -> dict[str, Any]:
    """Broadcast a dict of tensors and picklable values from index ``src``; other ranks pass
    ``None``.

    Metadata travels as one object; tensors by a broadcast each on their device's group.

    Args:
        d: the dict on ``src``; ``None`` on the other ranks.
        mesh: a mesh from ``fastdist.connect`` (real ranks).
        axis: the mesh axis of the group (or a tuple of axes); ``None``: the whole mesh.
        src: the index along ``axis`` of the sending rank.

    Returns:
        ``src``'s dict, on every rank of the group.
    """
    op = "broadcast_tensor_dict"
    ac = axis_comm(mesh, axis, op)
    _check_src(op, ac, "src", src)
    if ac.index == src:
        if d is None:
            raise CommArgumentError(
                op,
                ac.label,
                ac.ranks,
                ac.rank,
                "the source rank passed None",
                "pass the dict to send on the source rank",
            )
        meta, tensors = _split_dict(d)
        broadcast_object(meta, mesh, ac.label, src)
        out = dict(d)
    else:
        # filled from src
        meta = broadcast_object(cast(list[tuple[str, Any]], None), mesh, ac.label, src)
        out, tensors = _empty_from(meta)
    for t in tensors:
        group = ac.comm.group(ac, select_backend(t.device.type), op)
        b = _bytes(t)
        ac.run(op, lambda b=b, group=group: dist.broadcast(b, group=group, group_src=src))
    return out


def _ag_plan(
    op: str, mesh: Mesh, axis: AxisName, all_gather_axis: AxisName | None
) -> TorchAxisComm | None:
    """The all-gather axis of a tensor-dict transfer (None: whole tensors); it must not share mesh
    axes with ``axis``."""
    if all_gather_axis is None:
        return None
    ac, gac = axis_comm(mesh, axis, op), axis_comm(mesh, all_gather_axis, op)
    shared = set(mesh.axis_indices(axis, op)) & set(mesh.axis_indices(all_gather_axis, op))
    if shared:
        raise CommArgumentError(
            op,
            ac.label,
            ac.ranks,
            ac.rank,
            f"all_gather_axis={all_gather_axis!r} shares mesh axes with the transfer axis {axis!r}",
            "pass an axis the sender and receiver groups both span (e.g. transfer over 'pp', "
            "all-gather over 'tp')",
        )
    return gac if gac.n > 1 else None


def _sliced(t: Tensor, gac: TorchAxisComm | None) -> bool:
    """Whether ``t`` travels as 1/n slices (its element count divides by the all-gather axis
    size)."""
    return gac is not None and t.numel() > 0 and t.numel() % gac.n == 0


def send_tensor_dict(
    d: Mapping[str, Any],
    mesh: Mesh,
    axis: AxisName,
    dst: int,
    *,
    all_gather_axis: AxisName | None = None,
) -> None:
    """Send a dict of tensors and picklable values to index ``dst`` (pair with
    :func:`recv_tensor_dict`).

    ``all_gather_axis`` (vLLM's all-gather optimisation for pipeline stages): the dict is the
    same on every rank of that axis (e.g. ``"tp"``), so each of them sends only its 1/n slice of
    every tensor whose element count n divides, and the receivers, which pass the same
    ``all_gather_axis``, all-gather the slices over it: n times less traffic on ``axis``.
    Other tensors travel whole. Tensors travel as their bytes, so every dtype arrives (float8,
    int16 and uint16/32/64 included, which gloo refuses).

    Args:
        d: a dict of tensors and picklable values.
        mesh: a mesh from ``fastdist.connect`` (real ranks).
        axis: the mesh axis (or tuple of axes) along which ``dst`` is an index.
        dst: the index of the receiving rank.
        all_gather_axis: an axis over which ``d`` is the same on every rank: each sends a slice, the
            receivers all-gather them.

    >>> import fastdist as fd  # doctest: +SKIP
    >>> mesh = fd.connect(pp=2, tp=4)  # doctest: +SKIP
    >>> if fd.axis_index(mesh, "pp") == 0:  # doctest: +SKIP
    ...     fd.comm.send_tensor_dict({"h": hidden}, mesh, "pp", dst=1, all_gather_axis="tp")
    ... else:
    ...     hidden = fd.comm.recv_tensor_dict(mesh, "pp", src=0, all_gather_axis="tp")["h"]
    """
    op = "send_tensor_dict"
    gac = _ag_plan(op, mesh, axis, all_gather_axis)
    _check_src(op, axis_comm(mesh, axis, op), "dst", dst, peer=True)
    meta, tensors = _split_dict(d)
    send_object((meta, None if gac is None else gac.label), mesh, axis, dst)
    for t in tensors:
        if _sliced(t, gac):
            assert gac is not None
            k = t.numel() // gac.n
            # (numel/n,) my slice of the flattened tensor
            t = t.reshape(-1)[gac.index * k : (gac.index + 1) * k]
        send(t, mesh, axis, dst)


def recv_tensor_dict(
    mesh: Mesh, axis: AxisName, src: int, *, all_gather_axis: AxisName | None = None
) -> dict[str, Any]:
    """Receive the dict sent by :func:`send_tensor_dict` from index ``src`` along ``axis``.

    Pass the sender's ``all_gather_axis``; a mismatch raises :class:`~fastdist.CommError` at
    once on the receiver (the sender's choice travels with the metadata).

    Args:
        mesh: a mesh from ``fastdist.connect`` (real ranks).
        axis: the mesh axis (or tuple of axes) along which ``src`` is an index.
        src: the index of the sending rank.
        all_gather_axis: the sender's ``all_gather_axis``.

    Returns:
        the dict ``src`` sent.
    """
    op = "recv_tensor_dict"
    gac = _ag_plan(op, mesh, axis, all_gather_axis)
    _check_src(op, axis_comm(mesh, axis, op), "src", src, peer=True)
    meta, sender_ag = recv_object(mesh, axis, src)
    ac = axis_comm(mesh, axis, op)
    mine = None if gac is None else gac.label
    if sender_ag != mine:
        raise CommError(
            op,
            ac.label,
            ac.ranks,
            ac.rank,
            f"the sender used all_gather_axis={sender_ag!r}, this rank {mine!r}",
            "pass the same all_gather_axis on both sides",
        )
    out, tensors = _empty_from(meta)
    for t in tensors:
        group = ac.comm.group(ac, select_backend(t.device.type), op)
        # whole, or (numel/n,) my slice; received as bytes (a view: receiving fills it)
        buf = t if not _sliced(t, gac) else t.new_empty(t.numel() // cast(TorchAxisComm, gac).n)
        b = _bytes(buf)
        ac.run(op, lambda b=b, group=group: dist.recv(b, group=group, group_src=src))
        if buf is t:
            continue
        assert gac is not None
        # (numel * itemsize,) every member's slice, in index order
        _bytes(t).copy_(gac.all_gather_rows(op, b))
    return out


class GraphCaptureContext:
    """What :func:`graph_capture` sets up: the ``stream`` to capture on (None on CPU) and the
    ``device``.

    Args:
        stream: the stream to capture on (``None`` on CPU).
        device: the device.
    """

    def __init__(self, stream: Any, device: torch.device) -> None:
        self.stream, self.device = stream, device

    def __repr__(self) -> str:
        return f"GraphCaptureContext(stream={self.stream!r}, device={self.device})"


@contextlib.contextmanager
def graph_capture(
    mesh: Mesh, *axes: AxisName, device: torch.device | str | None = None, stream: Any = None
) -> Iterator[GraphCaptureContext]:
    """Prepare ``mesh`` for CUDA graph capture and run the block on a side stream.

    On a real mesh it first creates this rank's groups, and with a ctypes backend its NCCL/HCCL
    communicators, for ``axes`` (default: every axis) on ``device``: a communicator cannot be
    created during capture. On a CUDA ``device`` (default: the current CUDA device when there
    is one) the block runs on ``stream`` (default: a new side stream that first waits for the
    current one; capture cannot run on the default stream), and the current stream waits for
    it afterwards. Every fastdist op inside runs on that stream: the torch ops, and the ctypes
    communicators, which use the current stream. Capture itself stays yours
    (``torch.cuda.graph(g, stream=ctx.stream)``). On CPU there is nothing to capture: the
    groups are created and the block runs as is (``ctx.stream`` is None); with the fake NCCL
    library that is how the set-up is tested without a GPU. Every rank of each group must enter.

    Args:
        mesh: the mesh whose groups (and ctypes communicators) to create first.
        *axes: the axes to prepare; default: every axis.
        device: the CUDA device (or ``"cpu"``); default: the current CUDA device when there is one.
        stream: the stream the block runs on; default: a new side stream that first waits for the
            current one.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 2})
    >>> with fd.comm.graph_capture(mesh, device="cpu") as ctx:
    ...     out = fd.simulate(lambda x: fd.psum(x, mesh, "tp"), mesh)(torch.ones(2))
    >>> ctx.stream is None, out.tolist()
    (True, [2.0, 2.0])
    """
    if device is not None:
        dev = torch.device(device)
    else:
        dev = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    for axis in axes:
        mesh.axis_indices(axis, "graph_capture")  # a wrong axis name raises MeshError, on any mesh
    if mesh.comm is not None:
        create_groups(mesh, *axes, device_type=dev.type)
    if dev.type != "cuda":
        yield GraphCaptureContext(None, dev)
        return
    side = stream if stream is not None else torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        yield GraphCaptureContext(side, dev)
    torch.cuda.current_stream(dev).wait_stream(side)


def barrier(
    mesh: Mesh, axis: AxisName | None = None, *, timeout: float | datetime.timedelta | None = None
) -> None:
    """Wait until every rank of the group arrives; raise :class:`CollectiveTimeout` naming the
    missing ranks.

    ``timeout`` overrides the mesh's timeout for this call.

    Args:
        mesh: a mesh from ``fastdist.connect`` (real ranks).
        axis: the mesh axis of the group (or a tuple of axes); ``None``: the whole mesh.
        timeout: seconds (or a timedelta) to wait for this call; default: the mesh's timeout.
    """
    ac = axis_comm(mesh, axis, "barrier")
    td = as_timedelta(timeout, ac.comm.timeout, "fastdist.barrier")
    group = ac.cpu_group("barrier")
    try:
        if not torch.compiler.is_compiling():
            dist.monitored_barrier(group=group, timeout=td, wait_all_ranks=True)
    except Exception as e:
        msg = clean_error(e)
        ac.comm.abandon(f"fastdist.barrier(axis={ac.label!r}) failed on this rank: {msg}")
        raise CollectiveTimeout(
            "barrier",
            ac.label,
            ac.ranks,
            ac.rank,
            f"not every rank arrived within {td.total_seconds():g} s: {msg}",
            "check that every rank of the group reaches this barrier; to go on, call "
            "fastdist.comm.reset(mesh) on every rank",
        ) from e
