"""The modules `HeadParallelAttention` puts inside an attention module when its heads do not
split as plain blocks: kv projections replicated over ranks (`ReplicatedHeads`), a fused q|k|v
projected by rows (`FusedRows`, `qkv_rows`), q/k norms over the whole width (`FullWidthRMSNorm`)
or one per head (`HeadNormList`), and the checks that a model's norm is what these compute."""

from __future__ import annotations

from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.state import Layout
from fastdist.ops import axis_index, psum, pvary

__all__ = [
    "QkvLayout",
    "ReplicatedHeads",
    "FusedRows",
    "qkv_rows",
    "FullWidthRMSNorm",
    "HeadNormList",
    "rms_eps",
    "check_full_width_norm",
    "check_head_norm_list",
]


class ReplicatedHeads(nn.Module):
    """k or v projection with fewer heads than ranks: every rank holds all ``heads`` (replicated)
    and projects only the head its query heads use (head ``rank // (n / heads)``). The weight is
    ``pvary``'d: each rank's gradient touches its head's rows, the sum over ranks is the whole
    gradient."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        mesh: Mesh,
        axis: str,
        heads: int,
        transposed: bool,
    ) -> None:
        super().__init__()
        self.weight, self.bias, self.mesh, self.axis, self.heads, self.transposed = (
            weight,
            bias,
            mesh,
            axis,
            heads,
            transposed,
        )

    def forward(self, x: Tensor) -> Tensor:
        n = self.mesh.axis_size(self.axis)
        head = axis_index(self.mesh, self.axis) // (n // self.heads)  # () my kv head
        w = pvary(self.weight, self.mesh, self.axis)
        w = w.t() if self.transposed else w  # (heads * head_dim, in)
        w = w.reshape(self.heads, -1, w.shape[-1])[head]  # (heads, head_dim, in) -> (head_dim, in)
        b = (
            pvary(self.bias, self.mesh, self.axis).reshape(self.heads, -1)[head]
            if self.bias is not None
            else None
        )  # (head_dim,)
        return F.linear(x, w, b)  # (..., head_dim)


# ---------------------------------------------------------------------------- fused q|k|v rows
QkvLayout = Literal["concat", "per_head", "grouped"]


def qkv_rows(
    layout: QkvLayout, hq: int, hkv: int, d: int, n: int, r: int, hl: int, kl: int
) -> list[int]:
    """The rows of a fused q|k|v weight that rank ``r`` projects, in the order the module's forward
    expects for ``hl`` query and ``kl`` kv heads.

    ``concat``: ``[q heads | k heads | v heads]`` (Phi-3's ``qkv_proj``, Falcon's multi-query);
    ``per_head``: ``(heads, 3, d)`` (GPT-NeoX, Falcon's original layout); ``grouped``:
    ``(kv heads, q per kv + 2, d)``, each kv head after its query heads (Falcon's new decoder).
    """
    qh = range(r * hl, (r + 1) * hl)
    kvh = range(r * kl, (r + 1) * kl) if hkv >= n else range(r // (n // hkv), r // (n // hkv) + 1)
    if layout == "per_head":
        return [h * 3 * d + j for h in qh for j in range(3 * d)]
    if layout == "concat":
        q = [h * d + j for h in qh for j in range(d)]
        ks = [hq * d + h * d + j for h in kvh for j in range(d)]
        vs = [(hq + hkv) * d + h * d + j for h in kvh for j in range(d)]
        return q + ks + vs
    g = hq // hkv  # query heads per kv head
    rows: list[int] = []
    for k in kvh:
        for h in (h for h in qh if h // g == k):
            rows += [(k * (g + 2) + h % g) * d + j for j in range(d)]
        rows += [(k * (g + 2) + g + s) * d + j for s in (0, 1) for j in range(d)]
    return rows


class FusedRows(nn.Module):
    """A fused q|k|v projection whose rows for one rank are not one block of its weight (kv heads
    fewer than ranks): every rank holds the weight whole and projects only its heads' rows
    (``rows[rank]``). The weight is ``pvary``'d: each rank's gradient touches its rows, the sum
    over ranks is the whole gradient (kv rows shared by several ranks get each one's part)."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        mesh: Mesh,
        axis: str,
        rows: list[list[int]],
        transposed: bool,
    ) -> None:
        super().__init__()
        self.weight, self.bias, self.mesh, self.axis = weight, bias, mesh, axis
        self.rows, self.transposed = rows, transposed

    def forward(self, x: Tensor) -> Tensor:
        table = torch.tensor(self.rows, device=self.weight.device)  # (ranks, local_out)
        idx = table[axis_index(self.mesh, self.axis).to(self.weight.device)]  # (local_out,)
        w = pvary(self.weight, self.mesh, self.axis)
        w = w.t() if self.transposed else w  # (out, in)
        b = pvary(self.bias, self.mesh, self.axis)[idx] if self.bias is not None else None
        return F.linear(x, w[idx], b)  # (..., local_out)

    def extra_repr(self) -> str:
        return (
            f"axis={self.axis!r}, weight={tuple(self.weight.shape)} replicated, "
            f"{len(self.rows[0])} rows per rank"
        )


# ---------------------------------------------------------------------------- q/k norms
def _my_heads(mesh: Mesh, axis: str, heads: int, local: int) -> Tensor:
    """This rank's head indices (``local`` of ``heads``; one shared head when heads < ranks)."""
    n = mesh.axis_size(axis)
    r = axis_index(mesh, axis)
    if heads >= n:
        return r * local + torch.arange(local, device=r.device)  # (local,)
    return (r // (n // heads)).reshape(1)  # (1,)


class FullWidthRMSNorm(nn.Module):
    """An RMSNorm over a projection's whole width (OLMo-2's ``q_norm``/``k_norm``: all heads
    together) on this rank's heads: the sum of squares is summed over ``axis`` (``psum``, then
    ``pvary`` so each rank's gradient reaches every rank's share of the statistics). Computed
    in float32 and cast back, as ``Olmo2RMSNorm`` does. ``weight``: this rank's columns; with
    heads fewer than ranks (replicated kv heads) the whole weight, of which each rank uses its
    head's slice, and each head's share counted once."""

    def __init__(
        self,
        weight: nn.Parameter,
        eps: float,
        mesh: Mesh,
        axis: str,
        width: int,
        heads: int,
        head_dim: int,
        layout: Layout,
    ) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = weight, eps
        self.mesh, self.axis, self.width, self.heads, self.head_dim = (
            mesh,
            axis,
            width,
            heads,
            head_dim,
        )
        self._layout = layout

    def param_layouts(self) -> dict[str, Layout]:
        return {"weight": self._layout}

    def forward(self, x: Tensor) -> Tensor:
        n = self.mesh.axis_size(self.axis)
        dtype = x.dtype
        h = x.to(torch.float32)  # (..., local width)
        ss = h.pow(2).sum(-1, keepdim=True)  # (..., 1): my heads' share
        w: Tensor = self.weight  # (local width,)
        copies = 1
        if self.heads < n:  # my one head: every head is held by n / heads ranks
            head = _my_heads(self.mesh, self.axis, self.heads, 1)
            w = pvary(self.weight, self.mesh, self.axis).reshape(self.heads, self.head_dim)[head]
            w, copies = w.reshape(-1), n // self.heads  # (1, head_dim) -> (head_dim,)
        total = pvary(psum(ss, self.mesh, self.axis), self.mesh, self.axis)  # (..., 1)
        var = total / (self.width * copies)
        return (w * (h * torch.rsqrt(var + self.variance_epsilon))).to(dtype)

    def extra_repr(self) -> str:
        return f"width={self.width} over {self.axis!r}, eps={self.variance_epsilon}"


def rms_eps(module: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps"):
        value = getattr(module, attr, None)
        if isinstance(value, float):
            return value
    return None


def check_full_width_norm(module: nn.Module, name: str, width: int) -> float:
    """``module`` must be ``weight * x / rms(x)`` over ``width`` in float32; returns its eps."""
    weight = getattr(module, "weight", None)
    eps = rms_eps(module)
    if not isinstance(weight, Tensor) or tuple(weight.shape) != (width,) or eps is None:
        raise ParallelizeError(
            f"parallelize: {name!r} ({type(module).__name__}) is not an RMSNorm over the whole "
            f"{width} features of its projection (a weight of shape ({width},) and an eps). Fix: "
            "list it in HeadParallelAttention(norms=...) if it normalises each head, or write a "
            "style for it"
        )
    if weight.is_meta:
        return eps
    x = torch.randn(2, width, dtype=weight.dtype, generator=torch.Generator().manual_seed(0)).to(
        weight.device
    )
    with torch.no_grad():
        h = x.float()
        want = (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)
        got = module(x)
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        raise ParallelizeError(
            f"parallelize: {name!r} ({type(module).__name__}) does not compute "
            "weight * x * rsqrt(mean(x**2) + eps) over its whole width; splitting its heads "
            "would change it. Fix: write a style for this norm"
        )
    return eps


class HeadNormList(nn.Module):
    """A per-head list of LayerNorms (StableLM's ``StableLmLayerNormPerHead``: ``norms[h]`` for
    head ``h`` of a ``(batch, heads, seq, head_dim)`` input) on this rank's heads. Every rank
    holds the whole list (the same parameter names) and applies its heads' norms; the
    parameters are ``pvary``'d, so their gradients sum over ranks."""

    def __init__(self, norms: nn.ModuleList, mesh: Mesh, axis: str, heads: int, local: int):
        super().__init__()
        self.norms, self.mesh, self.axis, self.heads, self.local = norms, mesh, axis, heads, local
        first = cast(nn.LayerNorm, norms[0])
        self.eps, self.dim = first.eps, first.normalized_shape

    def forward(self, x: Tensor) -> Tensor:
        idx = _my_heads(self.mesh, self.axis, self.heads, self.local)  # (local,)
        y = F.layer_norm(x, self.dim, None, None, self.eps)  # (batch, local, seq, head_dim)
        first = cast(nn.LayerNorm, self.norms[0])
        if first.weight is not None:
            w = torch.stack([cast(Tensor, m.weight) for m in self.norms])  # (heads, head_dim)
            y = y * pvary(w, self.mesh, self.axis)[idx][None, :, None, :]
        if first.bias is not None:
            b = torch.stack([cast(Tensor, m.bias) for m in self.norms])  # (heads, head_dim)
            y = y + pvary(b, self.mesh, self.axis)[idx][None, :, None, :]
        return y


def check_head_norm_list(module: nn.Module, name: str, heads: int) -> None:
    norms = getattr(module, "norms", None)
    ok = (
        isinstance(norms, nn.ModuleList)
        and len(norms) == heads
        and all(type(m) is nn.LayerNorm for m in norms)
    )
    if not ok:
        raise ParallelizeError(
            f"parallelize: {name!r} ({type(module).__name__}) is not a list of {heads} per-head "
            "nn.LayerNorm modules in .norms. Fix: list per-head norms with one shared weight in "
            "HeadParallelAttention(norms=...), or write a style for it"
        )
    first = cast(nn.LayerNorm, cast(nn.ModuleList, norms)[0])
    if first.weight is None or first.weight.is_meta:
        return
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, heads, 2, first.normalized_shape[0], generator=g, dtype=first.weight.dtype)
    x = x.to(first.weight.device)
    with torch.no_grad():
        got = module(x)
        want = torch.cat([m(x[:, h : h + 1]) for h, m in enumerate(cast(nn.ModuleList, norms))], 1)
    if not torch.allclose(got, want):
        raise ParallelizeError(
            f"parallelize: {name!r} ({type(module).__name__}) does not apply norms[h] to head h "
            "of a (batch, heads, seq, head_dim) input. Fix: write a style for it"
        )
