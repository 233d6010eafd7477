"""Domain parallelism: a convolution over a spatial domain split across the ranks of a mesh axis
(``DomainConv``), each rank holding only its block, the halo exchanged with its neighbours."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.core.sharding import P, PartitionSpec
from fastdist.errors import MeshError
from fastdist.ops import axis_index, halo_exchange, pvary

__all__ = ["DomainConv", "conv_padding"]

_CONVS = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}


class DomainConv(nn.Module):
    """An unmodified ``torch.nn.Conv1d`` / ``Conv2d`` / ``Conv3d`` over a domain split along one
    spatial dim over ``axis``: each rank holds its block (``[N, C, *spatial]`` with the split dim
    cut), receives the halo its kernel reaches into from its neighbours
    (:func:`fastdist.halo_exchange`), and computes its block of the output.

    The result equals the convolution of the whole domain on one device, cut the same way
    (forward and backward): any kernel size, dilation, groups and stride, with a padding along
    the split dim that keeps its length at stride 1 (``padding="same"``, or
    ``dilation * (kernel - 1) == 2 * padding`` there); every ``padding_mode`` (``zeros``,
    ``reflect``, ``replicate``, ``circular``: the domain's ends are padded as one device pads).
    Parameters: the conv's own ``weight`` and ``bias`` (the same tensors, the same names),
    replicated over ``axis`` and ``pvary``'d at every call, so each rank's gradient is the
    whole gradient (its partial sum all-reduced over ``axis``). On a simulated mesh, pass them
    stacked (``fastdist.nn.stack_state`` with `param_specs`) through
    ``torch.func.functional_call``, as for the other parallel layers.

    Uneven blocks: ``sizes[i]`` rows along the split dim on rank ``i`` (an input may carry
    padding rows after them; on simulated ranks every input has ``max(sizes)`` rows); rank
    ``i``'s output has ``out_sizes[i] = ceil(sizes[i] / stride)`` valid rows, its padding rows
    zero. The halo must fit in the smallest block; with a stride ``s`` along the split dim every
    block but the last must have a multiple of ``s`` rows (each block then starts on an output
    row).

    Args:
        conv: the single-device convolution (its parameters are shared, not copied).
        mesh: the mesh the layer runs on.
        axis: the mesh axis the domain is split over.
        dim: the split dim of the batched input ``[N, C, *spatial]`` (``2``: H of an image, T of
            a video; negative counts from the end); an unbatched input is split on the same
            spatial dim.
        sizes: each rank's rows along the split dim, in axis order; ``None``: even blocks.
        padding: ``(before, after)`` rows of padding for each spatial dim, in place of the
            conv's own (which is then ignored): a causal temporal convolution, as video VAEs
            pad it by hand before a ``padding=0`` conv, is ``[(dilation * (k - 1), 0), ...]``
            on T. The ends are padded with the conv's ``padding_mode``.

    Attributes:
        out_sizes: each rank's valid output rows along the split dim, ``ceil(sizes[i] /
            stride)`` (``None`` for even blocks): the ``sizes`` of the next layer.

    Raises:
        MeshError: a module that is not a ``Conv1d/2d/3d``, ``dim`` not a spatial dim, a
            length-changing padding along the split dim, or blocks that a stride does not
            divide.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"sp": 2})
    >>> conv = torch.nn.Conv2d(2, 3, kernel_size=3, padding=1)
    >>> layer = fd.nn.DomainConv(conv, mesh, "sp", dim=2)
    >>> state = fd.nn.stack_state(conv.state_dict(), fd.nn.param_specs(layer), mesh)
    >>> x = torch.randn(1, 2, 8, 5)
    >>> run = fd.simulate(lambda p, x: torch.func.functional_call(layer, p, (x,)), mesh)
    >>> out = run(state, torch.stack(x.chunk(2, dim=2)))  # rank r: rows 4r..4r+3 of H
    >>> bool(torch.allclose(torch.cat(list(out), dim=2), conv(x), atol=1e-6))
    True
    """

    def __init__(
        self,
        conv: nn.Module,
        mesh: Mesh,
        axis: str,
        dim: int = 2,
        *,
        sizes: Sequence[int] | None = None,
        padding: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        kind = next((k for k in _CONVS if type(conv) is k), None)
        if kind is None:
            raise MeshError(
                f"DomainConv: {type(conv).__name__} is not a torch.nn.Conv1d, Conv2d or Conv3d. "
                "Fix: pass an unmodified convolution (transposed convolutions are not built yet)"
            )
        c: Any = conv
        nsp = len(c.kernel_size)
        self.mesh, self.axis, self.nsp = mesh, axis, nsp
        self.split = _spatial_index(dim, nsp)  # which spatial dim is split
        self.sizes = None if sizes is None else tuple(int(s) for s in sizes)
        mesh.axis_size(axis)  # an unknown axis raises here, naming it
        self.fn = _CONVS[kind]
        self.stride, self.dilation, self.groups = c.stride, c.dilation, c.groups
        self.mode: str = c.padding_mode
        # (before, after) per spatial dim
        self.pads = conv_padding(c, nsp) if padding is None else _given_pads(padding, nsp)
        k, s = self.split, self.stride[self.split]
        lo, hi = self.pads[k]
        if lo + hi != self.dilation[k] * (c.kernel_size[k] - 1):
            raise MeshError(
                f"DomainConv: along the split spatial dim {k} the convolution has padding "
                f"({lo}, {hi}) for kernel {c.kernel_size[k]}, dilation {self.dilation[k]}: only a "
                "padding that keeps the length (at stride 1) is built. Fix: split another "
                "spatial dim, or use padding='same' (an odd kernel: padding=(kernel - 1) // 2)"
            )
        if self.sizes is not None and any(r % s for r in self.sizes[:-1]):
            raise MeshError(
                f"DomainConv: stride {s} along the split spatial dim {k} with blocks of "
                f"sizes={list(self.sizes)}: every block but the last must have a multiple of "
                f"{s} rows, so that each starts on an output row. Fix: choose such sizes"
            )
        # each rank's valid output rows along the split dim (None: even blocks)
        self.out_sizes = None if self.sizes is None else tuple(-(-r // s) for r in self.sizes)
        self.weight = c.weight
        self.bias = c.bias

    def param_specs(self) -> dict[str, PartitionSpec]:
        """Both parameters replicated over every axis."""
        return {"weight": P(), **({"bias": P()} if self.bias is not None else {})}

    def forward(self, x: Tensor) -> Tensor:
        d = x.dim() - self.nsp + self.split  # the split dim of this input
        s = self.stride[self.split]
        if self.sizes is None and x.shape[d] % s and self.mesh.axis_size(self.axis) > 1:
            raise MeshError(
                f"DomainConv: stride {s} along the split dim {d} with even blocks of "
                f"{x.shape[d]} rows: a block must have a multiple of {s} rows, so that each "
                "starts on an output row. Fix: split a length divisible by "
                f"{s * self.mesh.axis_size(self.axis)}, or pass sizes= with such blocks"
            )
        x = halo_exchange(
            x, self.mesh, self.axis, d, self.pads[self.split], mode=self.mode, sizes=self.sizes
        )
        # this rank's partial gradient, summed over the axis in backward
        w = pvary(self.weight, self.mesh, self.axis)
        b = None if self.bias is None else pvary(self.bias, self.mesh, self.axis)
        pads = [(0, 0) if i == self.split else p for i, p in enumerate(self.pads)]
        if self.mode == "zeros" and all(lo == hi for lo, hi in pads):
            padding: tuple[int, ...] = tuple(lo for lo, _ in pads)
        else:
            # F.pad takes the last dim first: (last_before, last_after, ...)
            flat = [v for p in reversed(pads) for v in p]
            x = F.pad(x, flat, mode="constant" if self.mode == "zeros" else self.mode)
            padding = (0,) * self.nsp
        y = self.fn(x, w, b, self.stride, padding, self.dilation, self.groups)
        return y if self.sizes is None else self._zero_padding_rows(y, d)

    def _zero_padding_rows(self, y: Tensor, d: int) -> Tensor:
        """The output rows past this rank's size (computed from padding rows) set to zero."""
        sizes = self.out_sizes
        assert sizes is not None
        own = torch.tensor(sizes, device=y.device)[axis_index(self.mesh, self.axis).to(y.device)]
        keep = torch.arange(y.shape[d], device=y.device) < own  # [rows]
        return y * keep.to(y.dtype).reshape(-1, *[1] * (y.dim() - d - 1))

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, split spatial dim={self.split}, mode={self.mode!r}"


def _spatial_index(dim: int, nsp: int) -> int:
    """``dim`` of a batched ``[N, C, *spatial]`` input as an index into the spatial dims."""
    k = dim - 2 if dim >= 0 else nsp + dim
    if type(dim) is not int or not 0 <= k < nsp:
        raise MeshError(
            f"DomainConv: dim={dim!r} is not a spatial dim of a [N, C, *{nsp} spatial] input. "
            f"Fix: pass one of {list(range(2, 2 + nsp))} (or {list(range(-nsp, 0))})"
        )
    return k


def _given_pads(padding: Any, nsp: int) -> list[tuple[int, int]]:
    """``padding`` checked: ``nsp`` pairs of row counts >= 0."""
    try:
        pads = [(int(a), int(b)) for a, b in padding]
    except (TypeError, ValueError):
        pads = []
    if len(pads) != nsp or any(v < 0 for p in pads for v in p):
        raise MeshError(
            f"DomainConv: padding={padding!r} is not {nsp} (before, after) pairs of rows >= 0, "
            f"one per spatial dim. Fix: pass e.g. {[(1, 1)] * nsp}"
        )
    return pads


def conv_padding(conv: Any, nsp: int) -> list[tuple[int, int]]:
    """``(before, after)`` padding of each spatial dim, as the conv pads (``"same"``: the extra
    row after, as torch does)."""
    if conv.padding == "valid":
        return [(0, 0)] * nsp
    if conv.padding == "same":
        total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        return [(t // 2, t - t // 2) for t in total]
    return [(int(p), int(p)) for p in conv.padding]
