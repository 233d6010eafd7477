"""Sequence-parallel attention: local attention, Ulysses, ring, and the two combined (USP)."""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from ..collectives import axis_index
from ..errors import MeshError
from ..mesh import Mesh

__all__ = ["local_attention", "UlyssesAttention", "RingAttention", "USPAttention"]


def local_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, q_pos: Tensor | None = None, k_pos: Tensor | None = None,
                    k_valid: Tensor | None = None) -> Tensor:
    """Softmax attention per head on ``(batch, seq, heads, head_dim)`` tensors.

    ``q_pos``/``k_pos`` (global token positions, default ``arange``) define the causal mask;
    ``k_valid`` masks padding keys.
    """
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5  # (B, H, Sq, Sk)
    keep = _keep(q.shape[1], k.shape[1], causal, q_pos, k_pos, k_valid, q.device)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1).nan_to_num(0.0), v)


def _keep(sq: int, sk: int, causal: bool, q_pos: Tensor | None, k_pos: Tensor | None, k_valid: Tensor | None, device: Any) -> Tensor | None:
    """(Sq, Sk) mask of the (query, key) pairs that may attend, or None when all may."""
    keep = None
    if causal:
        qp = q_pos if q_pos is not None else torch.arange(sq, device=device)
        kp = k_pos if k_pos is not None else torch.arange(sk, device=device)
        keep = kp.unsqueeze(-2) <= qp.unsqueeze(-1)
    if k_valid is not None:
        keep = k_valid.unsqueeze(-2) if keep is None else keep & k_valid.unsqueeze(-2)
    return keep


def _pad_heads(t: Tensor, n: int) -> Tensor:
    extra = (-t.shape[2]) % n
    return t if not extra else torch.cat([t, t.new_zeros(*t.shape[:2], extra, t.shape[3])], dim=2)  # (B, S, H + pad, D)


class UlyssesAttention(nn.Module):
    """Ulysses sequence parallelism: all-to-all (sequence shard of all heads -> whole sequence of a head shard),
    attention per head, and back. Inputs and output: ``(batch, seq/P, heads, head_dim)``.

    Heads need not divide the axis size: they are padded with zero heads (dropped again).
    The sequence need not divide either: pass ``seq_sizes`` (the tokens on each rank, in axis
    order) with every rank's inputs padded to ``max(seq_sizes)`` rows; padding keys are
    masked, padding query rows come back as zeros.
    """

    def __init__(self, mesh: Mesh, axis: str = "sp", *, causal: bool = False) -> None:
        super().__init__()
        self.mesh, self.axis, self.causal = mesh, axis, causal

    def forward(self, q: Tensor, k: Tensor, v: Tensor, seq_sizes: list[int] | None = None) -> Tensor:
        from ..collectives import all_to_all_4d

        n, H, m = self.mesh.axis_size(self.axis), q.shape[2], q.shape[1]
        sizes = torch.tensor(seq_sizes if seq_sizes is not None else [m] * n, device=q.device)
        if sizes.numel() != n or int(sizes.max()) > m:
            raise MeshError(f"UlyssesAttention: seq_sizes {seq_sizes} must have {n} entries, none above the {m} local rows")
        offsets = sizes.cumsum(0) - sizes
        pos = rearrange(offsets.unsqueeze(1) + torch.arange(m, device=q.device), "n m -> (n m)")  # global position of each gathered row
        valid = rearrange(torch.arange(m, device=q.device) < sizes.unsqueeze(1), "n m -> (n m)")  # real token or padding
        qh, kh, vh = (all_to_all_4d(_pad_heads(t, n), self.mesh, self.axis) for t in (q, k, v))  # (B, n*m, H'/n, D)
        o = local_attention(qh, kh, vh, causal=self.causal, q_pos=pos, k_pos=pos, k_valid=valid if seq_sizes is not None else None)
        out = all_to_all_4d(o, self.mesh, self.axis, scatter_dim=1, gather_dim=2)[:, :, :H]  # (B, m, H, D)
        if seq_sizes is None:
            return out
        mine = torch.arange(m, device=q.device) < sizes[axis_index(self.mesh, self.axis)]
        return out * rearrange(mine, "m -> 1 m 1 1")


class RingAttention(nn.Module):
    """Ring attention: queries stay; key/value blocks travel around the axis ring (``ring_shift``),
    merged with an online softmax. Inputs and output: ``(batch, seq/P, heads, head_dim)``, the
    sequence split evenly in axis order; any number of heads.

    The next block's transfer is issued before the current block's compute, so a backend with
    asynchronous collectives (compiled steps on real ranks) overlaps them.
    """

    def __init__(self, mesh: Mesh, axis: str = "sp", *, causal: bool = False) -> None:
        super().__init__()
        self.mesh, self.axis, self.causal = mesh, axis, causal

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return _ring(q, k, v, self.mesh, self.axis, self.causal)


def _ring(q: Tensor, k: Tensor, v: Tensor, mesh: Mesh, axis: str, causal: bool) -> Tensor:
    from ..collectives import ring_shift

    n, m, D = mesh.axis_size(axis), q.shape[1], q.shape[3]
    me = axis_index(mesh, axis)
    # (B, m, H, D) -> (B, H, m, D) once, so every block's products are plain batched matmuls;
    # q is scaled once here rather than every (m, m) score block.
    q = rearrange(q * D**-0.5, "b m h d -> b h m d").contiguous()
    k, v = (rearrange(t, "b m h d -> b h m d").contiguous() for t in (k, v))
    # Step 0, my own block: the causal mask is the same lower triangle on every rank, and every
    # query sees at least its own key, so the running max starts from a real score.
    if n > 1:
        k_next, v_next = ring_shift(k, mesh, axis), ring_shift(v, mesh, axis)  # issued before this block's compute
    # The running max `top` only shifts the exponents for stability: the result, (sum of
    # exp(s - top) v) / (sum of exp(s - top)), does not depend on it, so it is computed from
    # detached scores (as flash attention does) and autograd has no max to differentiate.
    s = q @ k.transpose(-1, -2)  # (B, H, m, m)
    if causal:
        tri = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()  # key <= query
        top = torch.where(tri, s.detach(), float("-inf")).amax(-1, keepdim=True)  # (B, H, m, 1): running max of the scores
        p = torch.exp(torch.where(tri, s - top, -80.0))  # masked: weight exp(-80) ~ 2e-35, no gradient; exp's fast path
    else:
        top = s.detach().amax(-1, keepdim=True)
        p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)  # (B, H, m, 1): running sum of exp(score - top)
    acc = p @ v  # (B, H, m, D): running weighted sum of values
    for step in range(1, n):
        k, v = k_next, v_next  # the block of rank (me - step) % n
        if step < n - 1:
            k_next, v_next = ring_shift(k, mesh, axis), ring_shift(v, mesh, axis)
        s = q @ k.transpose(-1, -2)  # (B, H, m, m)
        block_top = s.detach().amax(-1, keepdim=True)
        new_top = torch.maximum(top, block_top)
        if causal:
            # Off the diagonal a block is all visible (it came from an earlier rank: me >= step)
            # or all masked: one per-rank flag, no (m, m) mask. A masked block leaves top alone,
            # is shifted by its own max (p <= 1, no overflow) and weighted 0.
            visible = me >= step  # () bool, per rank
            new_top = torch.where(visible, new_top, top)
            p = torch.exp(s - torch.where(visible, new_top, block_top))
            block_sum, block_acc = p.sum(-1, keepdim=True) * visible, (p @ v) * visible
        else:
            p = torch.exp(s - new_top)
            block_sum, block_acc = p.sum(-1, keepdim=True), p @ v
        scale = torch.exp(top - new_top)
        total, acc, top = total * scale + block_sum, acc * scale + block_acc, new_top
    return rearrange(acc / total, "b h m d -> b m h d")


class USPAttention(nn.Module):
    """Unified sequence parallelism: Ulysses over ``ulysses_axis``, ring over ``ring_axis``.

    The sequence is split over ``(ring_axis, ulysses_axis)`` (ring-major: rank ``(r, u)`` holds
    chunk ``r * Pu + u``), so after the Ulysses all-to-all each ring rank holds one contiguous
    block. The two axes are different axes of one mesh, hence orthogonal (no xDiT/yunchang
    group mismatch). Heads are padded to a multiple of the Ulysses degree.
    """

    def __init__(self, mesh: Mesh, ulysses_axis: str, ring_axis: str, *, causal: bool = False) -> None:
        super().__init__()
        if ulysses_axis == ring_axis:
            raise MeshError("USPAttention: ulysses_axis and ring_axis must be different mesh axes")
        mesh.axis_indices((ulysses_axis, ring_axis), "USPAttention")
        self.mesh, self.ulysses_axis, self.ring_axis, self.causal = mesh, ulysses_axis, ring_axis, causal

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        from ..collectives import all_to_all_4d

        n, H = self.mesh.axis_size(self.ulysses_axis), q.shape[2]
        qh, kh, vh = (all_to_all_4d(_pad_heads(t, n), self.mesh, self.ulysses_axis) for t in (q, k, v))  # (B, n*S_l, H'/n, D)
        o = _ring(qh, kh, vh, self.mesh, self.ring_axis, self.causal)
        return all_to_all_4d(o, self.mesh, self.ulysses_axis, scatter_dim=1, gather_dim=2)[:, :, :H]
