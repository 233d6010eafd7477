"""The kernels of a traced step by signature (private to ``fastdist.profile``): their FLOPs,
their keys, and how to replay one on real tensors of its shapes (``calibrate_kernels``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

# kernels that move no data (aliases the schema does not mark as views)
NOT_KERNELS = {torch.ops.aten._unsafe_view.default, torch.ops.aten.lift_fresh.default}
_SDPA = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
}


def _sdpa_flops(q: Tensor, k: Tensor, v: Tensor) -> float:
    # q [..., L, E], k [..., S, E], v [..., S, Ev]: scores q k^T, then probs v, per batch and head
    return 2.0 * math.prod(q.shape[:-1]) * k.shape[-2] * (q.shape[-1] + v.shape[-1])


def kernel_flops(func: Any, args: Sequence[Any]) -> float:
    """Matmul / attention FLOPs of one aten kernel (0 for anything else)."""
    name = func._opname
    if name in ("mm", "addmm"):
        a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
        return 2.0 * int(a.shape[0]) * int(a.shape[1]) * int(b.shape[1])
    if name in ("bmm", "baddbmm"):
        a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
        return 2.0 * int(a.shape[0]) * int(a.shape[1]) * int(a.shape[2]) * int(b.shape[2])
    if name in _SDPA:
        return _sdpa_flops(args[0], args[1], args[2])
    if name.removesuffix("_backward") in _SDPA:  # recompute scores, dV, dP, dQ, dK: 5 matmuls
        return 2.5 * _sdpa_flops(args[1], args[2], args[3])
    return 0.0


@dataclass(frozen=True)
class TensorSpec:
    """Shape, strides, storage offset and dtype of one tensor argument of a traced kernel."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    def key(self) -> str:
        text = f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"
        contiguous = math.prod(self.shape) == 0 or self.stride == _contiguous(self.shape)
        return (
            text
            + ("" if contiguous else f"s{list(self.stride)}")
            + (f"+{self.offset}" if self.offset else "")
        )


class DeviceArg:
    """A device argument of a traced kernel (replayed on the calibration's device)."""

    def __repr__(self) -> str:
        return "device"


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def spec_of(a: Any) -> Any:
    if isinstance(a, Tensor):
        return TensorSpec(
            tuple(int(d) for d in a.shape),
            tuple(int(d) for d in a.stride()),
            int(a.storage_offset()),
            a.dtype,
        )
    if isinstance(a, torch.device):
        return DeviceArg()
    return a


def _key_text(a: Any) -> str:
    if isinstance(a, TensorSpec):
        return a.key()
    if isinstance(a, (list, tuple)):
        return "[" + ",".join(_key_text(x) for x in a) + "]"
    if isinstance(a, dict):
        return "{" + ",".join(f"{k}={_key_text(v)}" for k, v in a.items()) + "}"
    return repr(a)


def kernel_key(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """A traced kernel's signature: ``aten::mm(float32[64, 32],float32[32, 16])`` (strides when
    not contiguous, other arguments by value)."""
    spec = pytree.tree_map(spec_of, (tuple(args), dict(kwargs)))
    text = ",".join(_key_text(a) for a in spec[0])
    if spec[1]:
        text += "," + ",".join(f"{k}={_key_text(v)}" for k, v in sorted(spec[1].items()))
    return f"{func}({text})"


@dataclass(frozen=True)
class Kernel:
    """One distinct kernel of a traced step, replayable on real tensors of its shapes."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def materialize(spec: Any, dev: torch.device) -> Any:
    """A real tensor for a ``TensorSpec`` (floats: normal, integers: 0 (valid indices), bools:
    True), the device for a ``DeviceArg``, other values unchanged."""
    if isinstance(spec, DeviceArg):
        return dev
    if not isinstance(spec, TensorSpec):
        return spec
    extent = spec.offset + (
        1 + sum((n - 1) * st for n, st in zip(spec.shape, spec.stride))
        if all(n > 0 for n in spec.shape)
        else 0
    )
    base = torch.empty(extent, dtype=spec.dtype, device=dev)
    if spec.dtype.is_floating_point or spec.dtype.is_complex:
        base.normal_()
    elif spec.dtype == torch.bool:
        base.fill_(True)
    else:
        base.zero_()
    return base.as_strided(spec.shape, spec.stride, spec.offset)
