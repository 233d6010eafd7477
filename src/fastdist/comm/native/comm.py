"""One NCCL or HCCL communicator, driven through ctypes, for one group of ranks.

A :class:`NativeCommunicator` is what a mesh with ``backend="nccl-ctypes"`` (or
``"hccl-ctypes"``) uses for the device tensors of one axis group. It is created
collectively by the group's members: member 0 makes the unique id (NCCL) or root info
(HCCL), the bytes go to the others over a CPU channel (the axis's gloo group, or a
:class:`~fastdist.comm.StatelessGroup`), every member calls ``CommInitRank`` on its device, and
a one-element all-reduce checks the result before the communicator is handed out.

Every op runs on the current CUDA (or NPU) stream, allocates its output with torch, and
never synchronises with the host, so it can be captured in ``torch.cuda.graph``. Tensors
whose dtype the library lacks travel as bytes (fp8 as uint8). Reductions follow fastdist's one
dtype rule (``fastdist.core.dtype_rule``): complex tensors are summed as their real view, bool
max/min runs on uint8, and a dtype the rule refuses raises :class:`~fastdist.ReductionDtypeError`.
All-gather-v and reduce-scatter-v are grouped broadcasts / reduces, one per root.
``close(timeout)`` aborts with a bounded wait (abort blocks while captured graphs live).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from fastdist.comm.native.library import NativeLibrary
from fastdist.core.dtype_rule import check_reduction_dtype
from fastdist.errors import CommError, LibraryError

__all__ = ["NativeCommunicator", "exchange_over_group", "exchange_over_stateless"]

# member 0 passes its id bytes, the others None; all get the bytes
Exchange = Callable[[bytes | None], bytes]


def exchange_over_group(group: Any, src: int = 0) -> Exchange:
    """An id exchange over a CPU (gloo) process group: ``src`` (a group rank) broadcasts the
    bytes.

    Args:
        group: a CPU (gloo) process group of the communicator's members.
        src: the group rank that makes the id.
    """
    import torch.distributed as dist

    def exchange(data: bytes | None) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, group=group, group_src=src)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data is not None
            else torch.empty(int(size), dtype=torch.uint8)
        )
        dist.broadcast(buf, group=group, group_src=src)
        return bytes(buf.numpy().tobytes())

    return exchange


def exchange_over_stateless(group: Any, src: int = 0) -> Exchange:
    """An id exchange over a :class:`~fastdist.comm.StatelessGroup` (a TCPStore, no process group
    needed).

    Args:
        group: a ``StatelessGroup`` of the communicator's members.
        src: the member that makes the id.
    """

    def exchange(data: bytes | None) -> bytes:
        return bytes(group.broadcast_obj(data, src=src))

    return exchange


#: the reduction rule's name for a library reduction op ("avg" is a mean)
_RULE_KIND = MappingProxyType({"avg": "mean"})


def _ptr(t: Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())


class NativeCommunicator:
    """A communicator over ``nranks`` members through a bound :class:`NativeLibrary`.

    Build it with :meth:`create` (collective: every member calls it at the same time).
    Errors name the op, the mesh axis (``label``), the group's global ranks and this rank.

    Attributes:
        lib: the bound library. device: where its buffers live.
        n: members. index: this member's index (its rank in the communicator).
    """

    def __init__(
        self,
        lib: NativeLibrary,
        handle: ctypes.c_void_p,
        *,
        n: int,
        index: int,
        device: torch.device,
        label: Any,
        ranks: Sequence[int],
        rank: int,
    ) -> None:
        self.lib, self._handle, self.n, self.index, self.device = lib, handle, n, index, device
        self.label, self.ranks, self.rank = label, tuple(ranks), rank
        self._nccl = lib.spec.kind == "nccl"
        self.closed = False

    # ------------------------------------------------------------------ set-up and teardown
    @classmethod
    def create(
        cls,
        lib: NativeLibrary,
        *,
        n: int,
        index: int,
        exchange: Exchange,
        device: torch.device | None = None,
        label: Any = None,
        ranks: Sequence[int] | None = None,
        rank: int | None = None,
        warmup: bool = True,
    ) -> NativeCommunicator:
        """Make the id on member 0, exchange it, init on ``device``, check with a warm-up
        all-reduce.

        Args:
            lib: the bound library.
            n: the members.
            index: this member's index (its rank in the communicator).
            exchange: passes member 0's id bytes to every member (`exchange_over_group`,
                `exchange_over_stateless`).
            device: the device of the buffers, of the library's device type; default: the current
                device (cpu for the fake library).
            label: what errors call the group (a mesh axis).
            ranks: the members' global ranks, for error messages.
            rank: this process's global rank, for error messages.
            warmup: check the communicator with one all-reduce.

        Returns:
            the communicator, checked.
        """
        ranks = tuple(range(n)) if ranks is None else tuple(ranks)
        rank = index if rank is None else rank
        device = _default_device(lib) if device is None else torch.device(device)
        if device.type != lib.device_type:
            raise CommError(
                "init",
                label,
                ranks,
                rank,
                f"{lib.spec.kind.upper()} buffers live on {lib.device_type}, not {device}",
                f"pass a {lib.device_type} device",
            )
        blob = exchange(lib.new_id() if index == 0 else None)
        handle = ctypes.c_void_p()
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            if lib.spec.kind == "nccl":
                uid = lib.spec.id_type.from_buffer_copy(blob)
                rc = lib.fn("ncclCommInitRank")(ctypes.byref(handle), n, uid, index)
            else:
                root = lib.spec.id_type.from_buffer_copy(blob)
                rc = lib.fn("HcclCommInitRootInfo")(
                    n, ctypes.byref(root), index, ctypes.byref(handle)
                )
        if rc != 0:
            raise CommError(
                "init",
                label,
                ranks,
                rank,
                f"{lib.spec.kind.upper()} communicator init failed with {rc} "
                f"({lib.error_text(rc)})",
                "check that every member reached this call with the same group and a distinct "
                "device",
            )
        comm = cls(
            lib, handle, n=n, index=index, device=device, label=label, ranks=ranks, rank=rank
        )
        if warmup:
            got = comm.all_reduce("warm-up", torch.ones(1, device=device), "sum")
            if _on_host(got).item() != n:
                raise CommError(
                    "init",
                    label,
                    ranks,
                    rank,
                    f"the warm-up all-reduce gave {got.item()}, expected {n}",
                    f"check the {lib.spec.kind.upper()} installation",
                )
        return comm

    def close(self, timeout: float = 5.0) -> bool:
        """Abort (or destroy) the communicator, waiting at most ``timeout`` seconds.

        Abort can block while CUDA graphs that captured this communicator are alive, so it
        runs in a daemon thread. Returns whether it finished; warns if it did not.

        Args:
            timeout: seconds to wait at most.

        Returns:
            whether the abort finished within ``timeout``.
        """
        if self.closed:
            return True
        self.closed = True
        name = "ncclCommAbort" if self.lib.has("ncclCommAbort") else self._name("CommDestroy")
        fn, handle = self.lib.fn(name), self._handle
        done = threading.Event()

        def run() -> None:
            fn(handle)
            done.set()

        threading.Thread(target=run, name=f"fastdist-{name}", daemon=True).start()
        if not done.wait(timeout):
            warnings.warn(
                f"fastdist: {name} on rank {self.rank} (axis {self.label!r}) did not return "
                f"within {timeout:g} s; left running in a daemon thread",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        return True

    # ------------------------------------------------------------------ plumbing
    def _stream(self) -> ctypes.c_void_p:
        if self.device.type == "cuda":
            return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        if self.device.type == "npu":  # pragma: no cover - needs torch_npu
            return ctypes.c_void_p(torch.npu.current_stream().npu_stream)  # type: ignore[attr-defined]
        return ctypes.c_void_p(None)

    def _wire(self, op: str, x: Tensor, reduce_op: str | None = None) -> tuple[Tensor, int, int]:
        """``(tensor as sent, dtype enum, elements)``.

        Moved data (``reduce_op`` None): dtypes the library lacks travel as uint8 bytes. Reduced
        data: the dtype must pass the one reduction rule; complex travels as its real view
        (``[..., 2]`` floats: elementwise sums stay exact), bool as uint8 (max / min of 0 and 1).
        """
        if self.closed:
            raise CommError(
                op,
                self.label,
                self.ranks,
                self.rank,
                "the communicator was closed",
                "build a new mesh (fastdist.comm.close(mesh) released it)",
            )
        if x.device != self.device:
            raise CommError(
                op,
                self.label,
                self.ranks,
                self.rank,
                f"the tensor is on {x.device}, the communicator on {self.device}",
                f"move the tensor to {self.device}",
            )
        x = _dense(x)
        if reduce_op is not None:
            check_reduction_dtype(
                op,
                self.label,
                x.dtype,
                _RULE_KIND.get(reduce_op, reduce_op),
                rank=f"rank {self.rank}",
            )
            w = (
                x.view(torch.uint8)
                if x.dtype == torch.bool
                else torch.view_as_real(x.resolve_conj())
                if x.is_complex()
                else x
            )
            # every dtype the rule accepts maps to one the library has
            return (
                w,
                self.lib.spec.dtypes[w.dtype],
                w.numel(),
            )
        code = self.lib.spec.dtypes.get(x.dtype)
        if code is not None:
            return x, code, x.numel()
        # [numel * itemsize] bytes (fp8: as uint8)
        raw = x.view(torch.uint8) if x.dim() else x.reshape(1).view(torch.uint8)
        return raw, self.lib.spec.dtypes[torch.uint8], raw.numel()

    def _name(self, base: str) -> str:
        """The library's C name of ``base`` (``"AllReduce"`` -> ``ncclAllReduce`` /
        ``HcclAllReduce``)."""
        return self.lib.spec.prefix + base

    def _call(self, op: str, name: str, *args: Any) -> None:
        rc = self.lib.fn(name)(*args)
        if rc != 0:
            raise CommError(
                op,
                self.label,
                self.ranks,
                self.rank,
                f"{name} returned {rc} ({self.lib.error_text(rc, self._handle)})",
                "a peer probably exited, timed out or called a different op; check its log",
            )

    def _group(self, op: str, body: Callable[[], None]) -> None:
        """Run ``body``'s calls as one NCCL/HCCL group (fused and deadlock-free)."""
        start, end = self._name("GroupStart"), self._name("GroupEnd")
        grouped = self.lib.has(start)
        if grouped:
            self._call(op, start)
        try:
            body()
        finally:
            if grouped:
                self._call(op, end)

    def _reduce_code(self, op: str, reduce_op: str) -> int:
        code = self.lib.spec.reduce_ops.get(reduce_op)
        if code is None:
            raise CommError(
                op,
                self.label,
                self.ranks,
                self.rank,
                f"unknown reduction {reduce_op!r}",
                f"use one of {sorted(self.lib.spec.reduce_ops)}",
            )
        return code

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, op: str, x: Tensor, reduce_op: str) -> Tensor:
        """Elementwise reduction over members (``"sum" | "prod" | "max" | "min" | "avg"``); same
        shape.

        Args:
            op: the fastdist op this serves, for error messages.
            x: this member's tensor, on the communicator's device.
            reduce_op: ``"sum"``, ``"prod"``, ``"max"``, ``"min"`` or ``"avg"``.

        Returns:
            the reduction, shaped like ``x``.
        """
        emulate_avg = reduce_op == "avg" and "avg" not in self.lib.spec.reduce_ops
        code = self._reduce_code(op, "sum" if emulate_avg else reduce_op)
        w, dt, k = self._wire(op, x, reduce_op)
        out = torch.empty_like(w)
        self._call(
            op,
            self._name("AllReduce"),
            _ptr(w),
            _ptr(out),
            k,
            dt,
            code,
            self._handle,
            self._stream(),
        )
        if emulate_avg:
            out.div_(self.n)
        # the wire view undone (complex, bool)
        return out.reshape(-1).view(x.dtype).reshape(x.shape)

    def all_gather_rows(self, op: str, x: Tensor) -> Tensor:
        """Every member's ``x`` concatenated along dim 0, in member order: ``[n * s0, *rest]``.

        Args:
            op: the fastdist op this serves, for error messages.
            x: this member's tensor, on the communicator's device.

        Returns:
            ``[n * s0, *rest]``: every member's ``x`` in member order.
        """
        w, dt, k = self._wire(op, x)
        out = w.new_empty((self.n * w.numel(),))  # [n * k], in the wire dtype
        self._call(
            op, self._name("AllGather"), _ptr(w), _ptr(out), k, dt, self._handle, self._stream()
        )
        return (
            out.view(x.dtype).reshape(self.n * x.shape[0], *x.shape[1:])
            if x.dim()
            else out.view(x.dtype)
        )

    def reduce_scatter_rows(self, op: str, x: Tensor, reduce_op: str = "sum") -> Tensor:
        """Reduce over members; member ``i`` keeps chunk ``i`` of dim 0: ``[s0 / n, *rest]``.

        Args:
            op: the fastdist op this serves, for error messages.
            x: this member's tensor, ``n`` chunks along dim 0.
            reduce_op: as in `all_reduce`.

        Returns:
            ``[s0 / n, *rest]``: this member's chunk of the reduction.
        """
        code = self._reduce_code(op, reduce_op)
        w, dt, k = self._wire(op, x, reduce_op)
        out = w.new_empty((k // self.n,))  # [k / n]
        self._call(
            op,
            self._name("ReduceScatter"),
            _ptr(w),
            _ptr(out),
            k // self.n,
            dt,
            code,
            self._handle,
            self._stream(),
        )
        return out.view(x.dtype).reshape(x.shape[0] // self.n, *x.shape[1:])

    def broadcast(self, op: str, x: Tensor, src: int) -> Tensor:
        """Every member gets member ``src``'s ``x`` (a new tensor; ``x`` is not written).

        Args:
            op: the fastdist op this serves, for error messages.
            x: this member's tensor, on the communicator's device.
            src: the member whose ``x`` every member gets.

        Returns:
            member ``src``'s ``x`` (a new tensor).
        """
        w, dt, k = self._wire(op, x)
        out = w.clone() if self.index == src else torch.empty_like(w)
        if self._nccl:
            self._call(
                op, "ncclBroadcast", _ptr(out), _ptr(out), k, dt, src, self._handle, self._stream()
            )
        else:
            self._call(op, "HcclBroadcast", _ptr(out), k, dt, src, self._handle, self._stream())
        return out.view(x.dtype).reshape(x.shape)

    def all_to_all_rows(
        self, op: str, x: Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None
    ) -> Tensor:
        """Rows ``in_splits[j]`` of dim 0 go to member ``j``; what arrives is stacked by sender
        (``None``: equal splits).

        Args:
            op: the fastdist op this serves, for error messages.
            x: this member's tensor, on the communicator's device.
            out_splits: the rows arriving from each member (``None``: equal splits).
            in_splits: the rows of ``x`` going to each member (``None``: equal splits).

        Returns:
            what arrived, stacked by sender along dim 0.
        """
        if out_splits is None or in_splits is None:
            out_splits = in_splits = [x.shape[0] // self.n] * self.n
        w, dt, _ = self._wire(op, x)
        per_row = _row_elems(x, w)
        # [rows received * row elements], wire dtype
        out = w.new_empty((sum(out_splits) * per_row,))
        send_off = [sum(in_splits[:j]) * per_row for j in range(self.n)]
        recv_off = [sum(out_splits[:j]) * per_row for j in range(self.n)]
        stream = self._stream()
        if self._nccl:
            # (function, buffer, offsets, rows) of the send to and the receive from each peer
            sides = (
                ("ncclSend", w.reshape(-1), send_off, in_splits),
                ("ncclRecv", out, recv_off, out_splits),
            )

            def body() -> None:
                for j in range(self.n):
                    for fn, buf, offs, rows in sides:
                        if rows[j]:
                            ptr = _ptr(buf[offs[j] :])
                            self._call(op, fn, ptr, rows[j] * per_row, dt, j, self._handle, stream)

            self._group(op, body)
        else:
            u64 = ctypes.c_uint64 * self.n
            counts = [u64(*(s * per_row for s in splits)) for splits in (in_splits, out_splits)]
            self._call(
                op,
                "HcclAlltoAllV",
                _ptr(w),
                counts[0],
                u64(*send_off),
                dt,
                _ptr(out),
                counts[1],
                u64(*recv_off),
                dt,
                self._handle,
                stream,
            )
        return out.view(x.dtype).reshape(sum(out_splits), *x.shape[1:])

    def all_gather_v_rows(
        self, op: str, x: Tensor, sizes: Sequence[int], index: int | None = None
    ) -> Tensor:
        """Member ``i`` contributes ``x[:sizes[i]]``; everyone gets them concatenated:
        ``[sum(sizes), *rest]``.

        One broadcast per root, grouped: no padding to the largest size. ``index`` is
        accepted for parity with :class:`fastdist.comm.transports.TorchTransport` (the
        communicator knows its own).

        Args:
            op: the fastdist op this serves, for error messages.
            x: this member's rows (its first ``sizes[index]`` are sent).
            sizes: every member's row count, in member order.
            index: accepted for parity with ``TorchTransport`` (the communicator knows its own).

        Returns:
            ``[sum(sizes), *rest]``: every member's rows, in member order.
        """
        mine = x[: sizes[self.index]]
        w, dt, _ = self._wire(op, mine)
        per_row = _row_elems(x, w)
        out = w.new_empty((sum(sizes) * per_row,))  # [sum(sizes) * row elements], wire dtype
        offs = [sum(sizes[:r]) * per_row for r in range(self.n)]
        stream = self._stream()
        if not self._nccl and sizes[self.index]:
            # HCCL broadcasts in place
            out[offs[self.index] : offs[self.index] + w.numel()].copy_(w.reshape(-1))

        def body() -> None:
            for r in range(self.n):
                if not sizes[r]:
                    continue
                dst = out[offs[r] :]
                if self._nccl:
                    src = w if r == self.index else dst
                    self._call(
                        op,
                        "ncclBroadcast",
                        _ptr(src),
                        _ptr(dst),
                        sizes[r] * per_row,
                        dt,
                        r,
                        self._handle,
                        stream,
                    )
                else:
                    self._call(
                        op,
                        "HcclBroadcast",
                        _ptr(dst),
                        sizes[r] * per_row,
                        dt,
                        r,
                        self._handle,
                        stream,
                    )

        self._group(op, body)
        return out.view(x.dtype).reshape(sum(sizes), *x.shape[1:])

    def reduce_scatter_v_rows(
        self,
        op: str,
        x: Tensor,
        sizes: Sequence[int],
        index: int | None = None,
        reduce_op: str = "sum",
    ) -> Tensor:
        """Reduce ``x`` (``[sum(sizes), *rest]``) over members; member ``i`` keeps rows of chunk
        ``i``.

        One reduce per root, grouped: ``[sizes[me], *rest]``. ``index`` as in
        :meth:`all_gather_v_rows`.

        Args:
            op: the fastdist op this serves, for error messages.
            x: ``[sum(sizes), *rest]``.
            sizes: the rows each member keeps, in member order.
            index: as in `all_gather_v_rows`.
            reduce_op: as in `all_reduce`.

        Returns:
            ``[sizes[me], *rest]``: this member's rows of the reduction.
        """
        code = self._reduce_code(op, reduce_op)
        w, dt, _ = self._wire(op, x, reduce_op)
        per_row = _row_elems(x, w)
        flat = w.reshape(-1)
        out = w.new_empty((sizes[self.index] * per_row,))  # [sizes[me] * row elements]
        stream = self._stream()

        def body() -> None:
            off = 0
            for r in range(self.n):
                if sizes[r]:
                    recv = out if r == self.index else flat[off:]  # non-roots: recv is ignored
                    self._call(
                        op,
                        self._name("Reduce"),
                        _ptr(flat[off:]),
                        _ptr(recv),
                        sizes[r] * per_row,
                        dt,
                        code,
                        r,
                        self._handle,
                        stream,
                    )
                off += sizes[r] * per_row

        self._group(op, body)
        return out.view(x.dtype).reshape(sizes[self.index], *x.shape[1:])

    def __repr__(self) -> str:
        return (
            f"NativeCommunicator({self.lib.spec.kind}, axis={self.label!r}, member "
            f"{self.index} of {self.n}, {self.device})"
        )


def _dense(x: Tensor) -> Tensor:
    """``x`` with row-major strides, as the wire views need (``view(torch.uint8)`` and
    ``view_as_real`` want a last stride of 1). ``x.contiguous()`` is not enough: torch counts a
    tensor with no elements, or one whose last dim has size 1, as contiguous whatever its strides
    (a zero-row shard of a ``dim=-1`` gather, ``x[:, :1]`` of a transposed tensor), and returns it
    unchanged."""
    if x.is_contiguous() and (x.dim() == 0 or x.stride(-1) == 1):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _row_elems(x: Tensor, w: Tensor) -> int:
    """Wire elements per row of dim 0 (bytes when ``x`` travels as uint8, two floats per complex
    number)."""
    return math.prod(x.shape[1:]) * x.element_size() // w.element_size()


def _default_device(lib: NativeLibrary) -> torch.device:
    if lib.device_type == "cuda":
        if not torch.cuda.is_available():
            raise LibraryError(
                f"fastdist: {lib.spec.backend} needs a CUDA device and none is visible. Fix: run "
                "on a GPU machine or use backend='torch'"
            )
        return torch.device("cuda", torch.cuda.current_device())
    if lib.device_type == "npu":  # pragma: no cover - needs torch_npu
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")


def _on_host(t: Tensor) -> Tensor:
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()
    return t.cpu()
