"""Sequence-parallel attention: local attention, Ulysses, ring, and the two combined (USP).

All take ``(batch, seq, heads, head_dim)`` tensors. k and v may have fewer heads than q
(grouped-query attention; multi-query with one): ``Hkv`` must divide ``Hq``, and q head ``j``
attends with kv head ``j // (Hq // Hkv)``, as transformers' ``repeat_kv`` lays them out. Any
other mismatch raises ``MeshError``.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn
from torch.nn import functional as F

from fastdist.core.mesh import Mesh
from fastdist.errors import MeshError
from fastdist.ops import all_to_all_4d, all_to_all_qkv, axis_index

__all__ = ["local_attention", "UlyssesAttention", "RingAttention", "USPAttention"]


def _check_qkv(name: str, q: Tensor, k: Tensor, v: Tensor, *, same_seq: bool) -> None:
    """Raise MeshError unless q ``(B, Sq, Hq, D)``, k ``(B, Sk, Hkv, D)``, v ``(B, Sk, Hkv, Dv)``
    with Hkv | Hq."""
    shapes = (
        f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (batch, seq, heads, head_dim)"
    )
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise MeshError(
            f"{name}: {shapes} must all be 4-d; fix: reshape to (batch, seq, heads, head_dim)"
        )
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise MeshError(
            f"{name}: {shapes}: the batch sizes differ; fix: pass q, k and v of the same batch"
        )
    if k.shape[1] != v.shape[1] or (same_seq and q.shape[1] != k.shape[1]):
        seqs = "q, k and v" if same_seq else "k and v"
        raise MeshError(
            f"{name}: {shapes}: the seq lengths of {seqs} differ; fix: pass each rank's block of "
            "the same tokens"
        )
    if k.shape[2] != v.shape[2]:
        raise MeshError(
            f"{name}: {shapes}: k has {k.shape[2]} heads but v has {v.shape[2]}; fix: project k "
            "and v to the same number of kv heads"
        )
    if q.shape[3] != k.shape[3]:
        raise MeshError(
            f"{name}: {shapes}: q and k head_dim differ ({q.shape[3]} vs {k.shape[3]}); fix: "
            "project q and k to the same head_dim"
        )
    hq, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or hq % hkv:
        raise MeshError(
            f"{name}: {shapes}: Hq={hq} q heads is not a multiple of Hkv={hkv} k/v heads "
            "(grouped-query attention needs q head j to use kv head j // (Hq // Hkv)); fix: use "
            f"a kv head count that divides {hq}"
        )


def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    q_pos: Tensor | None = None,
    k_pos: Tensor | None = None,
    k_valid: Tensor | None = None,
) -> Tensor:
    """Softmax attention per head: q ``(B, Sq, Hq, D)``, k ``(B, Sk, Hkv, D)``, v
    ``(B, Sk, Hkv, Dv)`` -> ``(B, Sq, Hq, Dv)``.

    ``Hkv`` must divide ``Hq``: q head ``j`` uses kv head ``j // (Hq // Hkv)`` (k/v are not
    repeated in memory; their gradient sums over the q heads of each group). Other shape
    mismatches raise ``MeshError``. ``q_pos``/``k_pos`` (global token positions, default
    ``arange``) define the causal mask; ``k_valid`` masks padding keys; a query row with no
    visible key comes back as zeros.

    Args:
        q: queries ``(B, Sq, Hq, D)``.
        k: keys ``(B, Sk, Hkv, D)``, ``Hkv`` dividing ``Hq``.
        v: values ``(B, Sk, Hkv, Dv)``.
        causal: mask keys after each query, by position.
        q_pos: the queries' global token positions, for the causal mask; default ``arange(Sq)``.
        k_pos: the keys' global token positions, for the causal mask; default ``arange(Sk)``.
        k_valid: a boolean mask over the keys: ``True`` for a real key, ``False`` for padding
            (masked).

    Returns:
        the attention output ``(B, Sq, Hq, Dv)``; a query with no visible key gets zeros.
    """
    _check_qkv("local_attention", q, k, v, same_seq=False)
    # (B, Sq, Hkv, G, D): q heads grouped by their kv head
    qg = rearrange(q, "b q (h g) d -> b q h g d", h=k.shape[2])
    s = torch.einsum("bqhgd,bkhd->bhgqk", qg, k) / q.shape[-1] ** 0.5  # (B, Hkv, G, Sq, Sk)
    # (Sq, Sk) or None
    keep = _keep(q.shape[1], k.shape[1], causal, q_pos, k_pos, k_valid, q.device)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    o = torch.einsum("bhgqk,bkhd->bqhgd", s.softmax(-1).nan_to_num(0.0), v)  # (B, Sq, Hkv, G, Dv)
    return rearrange(o, "b q h g d -> b q (h g) d")  # (B, Sq, Hq, Dv)


def ulysses_sdpa(
    q: Tensor, k: Tensor, v: Tensor, mesh: Mesh, axis: str, attn_mask: Tensor | None = None
) -> Tensor:
    """Ulysses attention with torch's ``F.scaled_dot_product_attention`` (non-causal, the default
    scale): q, k and v traded for every token of ``H / n`` heads in ONE all-to-all
    (`fastdist.ops.all_to_all_qkv`; its backward one too), SDPA, the output traded back.

    What a context-parallel DiT's Ulysses mode runs in place of its processor's SDPA (internal
    to ``ContextParallel``, not exported; for a layer of your own use `UlyssesAttention`): the
    same values, bit for bit, as three ``all_to_all_4d`` calls around SDPA. Never run on a GPU.

    Args:
        q: this rank's queries ``(batch, rows, H, D)``; ``n`` (the axis size) must divide ``H``.
        k: this rank's keys ``(batch, rows, H, D)``.
        v: this rank's values ``(batch, rows, H, Dv)``.
        mesh: the mesh the layer runs on.
        axis: the axis of the all-to-all (the sequence is split over it, in axis order).
        attn_mask: SDPA's mask over the gathered keys, broadcast to ``(batch, H / n, n * rows,
            n * rows)`` (e.g. ``(1, 1, 1, n * rows)`` flags masking padding rows), or ``None``.

    Returns:
        this rank's rows of the output ``(batch, rows, H, Dv)``.
    """
    # (B, n * rows, H / n, D): every token, this rank's heads (views of one received buffer)
    q, k, v = all_to_all_qkv(q, k, v, mesh, axis)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask
    )
    # (B, rows, H, Dv)
    return all_to_all_4d(o.transpose(1, 2), mesh, axis, scatter_dim=1, gather_dim=2)


def _keep(
    sq: int,
    sk: int,
    causal: bool,
    q_pos: Tensor | None,
    k_pos: Tensor | None,
    k_valid: Tensor | None,
    device: Any,
) -> Tensor | None:
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
    # (B, S, H + pad, D)
    return t if not extra else torch.cat([t, t.new_zeros(*t.shape[:2], extra, t.shape[3])], dim=2)


def _ulysses_heads(
    name: str, q: Tensor, k: Tensor, v: Tensor, n: int
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v with head counts the Ulysses all-to-all over ``n`` ranks splits into matching groups.

    Hkv == Hq: zero heads pad both to a multiple of n (dropped after). Hq and Hkv multiples of
    n: as they are (rank r gets q heads r*Hq/n.. and the kv heads they use). Hkv < n, n % Hkv
    == 0, Hq % n == 0: each kv head repeated n // Hkv times, so rank r gets kv head
    r // (n // Hkv), the one its q heads use; the gradient sums the replicas.
    """
    hq, hkv = q.shape[2], k.shape[2]
    if hkv == hq:
        # (B, m, H', D), H' = n * ceil(H / n)
        return (
            _pad_heads(q, n),
            _pad_heads(k, n),
            _pad_heads(v, n),
        )
    if hq % n == 0 and hkv % n == 0:
        return q, k, v
    if hq % n == 0 and n % hkv == 0:
        # k, v: (B, m, n, D)
        return (
            q,
            k.repeat_interleave(n // hkv, dim=2),
            v.repeat_interleave(n // hkv, dim=2),
        )
    raise MeshError(
        f"{name}: Hq={hq} q heads and Hkv={hkv} k/v heads do not split over n={n} ranks of the "
        "Ulysses axis (grouped-query attention needs Hq % n == 0 and either Hkv % n == 0 or n % "
        "Hkv == 0); fix: use an axis size that fits, or repeat k and v to Hq heads first "
        f"(k.repeat_interleave({hq // hkv}, dim=2)), which pads like MHA"
    )


def _check_axes(module: str, mesh: Any, **axes: Any) -> None:
    """Check, when the module is built, that ``mesh`` is a Mesh and each of ``axes`` names its
    axes (not at the first forward)."""
    if not isinstance(mesh, Mesh):
        raise MeshError(
            f"{module}: mesh must be a fastdist.Mesh, got {type(mesh).__name__}. Fix: pass the "
            "Mesh the model runs on"
        )
    for name, axis in axes.items():
        try:
            mesh.axis_indices(axis, module)
        except MeshError as e:  # "<module>: unknown mesh axis ...; ... Fix: ...": add the argument
            problem, _, fix = str(e).partition(". Fix: ")
            raise MeshError(f"{problem} ({name}={axis!r}). Fix: {fix}") from None


class UlyssesAttention(nn.Module):
    """Ulysses sequence parallelism: all-to-all (sequence shard of all heads -> whole sequence of a
    head shard), attention per head, and back.

    Inputs: q ``(batch, seq/P, Hq, head_dim)``, k and v ``(batch, seq/P, Hkv, head_dim)``, this
    rank's block of the sequence (split in axis order); output like q. The gradient is that of
    ``local_attention`` on the whole sequence, each rank getting its block.

    Heads, with ``n`` the axis size: ``Hkv == Hq`` (MHA) may be any count; heads not divisible
    by ``n`` are padded with zero heads (dropped again). Grouped-query (``Hkv`` divides ``Hq``,
    q head ``j`` uses kv head ``j // (Hq // Hkv)``) needs ``Hq % n == 0`` and either
    ``Hkv % n == 0`` (k/v split as they are) or ``n % Hkv == 0`` (each kv head is repeated
    ``n // Hkv`` times before the all-to-all; its gradient sums the copies). Other layouts
    raise ``MeshError``.

    The sequence need not divide either: pass ``seq_sizes`` (the tokens on each rank, in axis
    order) with every rank's inputs padded to ``max(seq_sizes)`` rows; padding keys are
    masked, padding query rows come back as zeros.

    Args:
        mesh: the mesh the layer runs on.
        axis: the sequence-parallel axis.
        causal: apply a causal mask (by global token positions).
    """

    def __init__(self, mesh: Mesh, axis: str = "sp", *, causal: bool = False) -> None:
        super().__init__()
        _check_axes("UlyssesAttention", mesh, axis=axis)
        self.mesh, self.axis, self.causal = mesh, axis, causal

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, seq_sizes: list[int] | None = None
    ) -> Tensor:
        """Attention of this rank's block of queries over the whole sequence.

        Args:
            q: this rank's queries ``(batch, seq/P, Hq, head_dim)``.
            k: this rank's keys ``(batch, seq/P, Hkv, head_dim)``.
            v: this rank's values, like ``k``.
            seq_sizes: the tokens on each rank in axis order, for a sequence the axis size does not
                divide (inputs padded to ``max(seq_sizes)`` rows).

        Returns:
            this rank's block of the attention output, shaped like ``q``.
        """
        from fastdist.ops import all_to_all_4d

        _check_qkv("UlyssesAttention", q, k, v, same_seq=True)
        n, H, m = self.mesh.axis_size(self.axis), q.shape[2], q.shape[1]
        sizes = torch.tensor(seq_sizes if seq_sizes is not None else [m] * n, device=q.device)
        if sizes.numel() != n or int(sizes.max()) > m:
            raise MeshError(
                f"UlyssesAttention(axis={self.axis!r}): seq_sizes {seq_sizes} must have {n} "
                f"entries, none above the {m} local rows. Fix: pass each rank's token count, in "
                f"axis order, with every rank's inputs padded to max(seq_sizes) = {m} rows"
            )
        offsets = sizes.cumsum(0) - sizes
        # global position of each gathered row
        pos = rearrange(offsets.unsqueeze(1) + torch.arange(m, device=q.device), "n m -> (n m)")
        # real token or padding
        valid = rearrange(torch.arange(m, device=q.device) < sizes.unsqueeze(1), "n m -> (n m)")
        # (B, n*m, heads/n, D)
        qh, kh, vh = (
            all_to_all_4d(t, self.mesh, self.axis)
            for t in _ulysses_heads("UlyssesAttention", q, k, v, n)
        )
        o = local_attention(
            qh,
            kh,
            vh,
            causal=self.causal,
            q_pos=pos,
            k_pos=pos,
            k_valid=valid if seq_sizes is not None else None,
        )
        # (B, m, H, D)
        out = all_to_all_4d(o, self.mesh, self.axis, scatter_dim=1, gather_dim=2)[:, :, :H]
        if seq_sizes is None:
            return out
        mine = torch.arange(m, device=q.device) < sizes[axis_index(self.mesh, self.axis)]
        return out * rearrange(mine, "m -> 1 m 1 1")


class RingAttention(nn.Module):
    """Ring attention: queries stay; key/value blocks travel around the axis ring (``ring_shift``),
    merged with an online softmax.

    Inputs: q ``(batch, seq/P, Hq, head_dim)``, k and v ``(batch, seq/P, Hkv, head_dim)``, the
    sequence split evenly in axis order; output like q. Any head counts with ``Hkv`` dividing
    ``Hq`` (q head ``j`` uses kv head ``j // (Hq // Hkv)``; others raise ``MeshError``); the ring
    carries the Hkv-head k/v, never a copy repeated to Hq heads. The gradient is that of
    ``local_attention`` on the whole sequence, each rank getting its block.

    The next block's transfer is issued before the current block's compute, so a backend with
    asynchronous collectives (compiled steps on real ranks) overlaps them.

    Args:
        mesh: the mesh the layer runs on.
        axis: the axis of the ring (sequence parallel).
        causal: apply a causal mask (by global token positions).
    """

    def __init__(self, mesh: Mesh, axis: str = "sp", *, causal: bool = False) -> None:
        super().__init__()
        _check_axes("RingAttention", mesh, axis=axis)
        self.mesh, self.axis, self.causal = mesh, axis, causal

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attention of this rank's block of queries over the whole sequence.

        Args:
            q: this rank's queries ``(batch, seq/P, Hq, head_dim)``.
            k: this rank's keys ``(batch, seq/P, Hkv, head_dim)``.
            v: this rank's values, like ``k``.

        Returns:
            this rank's block of the attention output, shaped like ``q``.
        """
        _check_qkv("RingAttention", q, k, v, same_seq=True)
        return _ring(q, k, v, self.mesh, self.axis, self.causal)


def _ring(q: Tensor, k: Tensor, v: Tensor, mesh: Mesh, axis: str, causal: bool) -> Tensor:
    from fastdist.ops import ring_shift

    n, m, D, hk = mesh.axis_size(axis), q.shape[1], q.shape[3], k.shape[2]
    g = q.shape[2] // hk  # q heads per kv head
    me = axis_index(mesh, axis)
    # Once, so every block's products are plain batched matmuls against (B, Hkv, m, D) k/v:
    # each kv head's g query heads stacked as g*m rows (row i*m + t: head i of the group, token t).
    # q is scaled once here rather than every score block.
    q = rearrange(
        q * D**-0.5, "b m (hk g) d -> b hk (g m) d", hk=hk
    ).contiguous()  # (B, Hkv, g*m, D)
    k, v = (rearrange(t, "b m hk d -> b hk m d").contiguous() for t in (k, v))  # (B, Hkv, m, D)
    # Step 0, my own block: the causal mask is the same lower triangle on every rank, and every
    # query sees at least its own key, so the running max starts from a real score.
    if n > 1:
        # issued before this block's compute
        k_next, v_next = (
            ring_shift(k, mesh, axis),
            ring_shift(v, mesh, axis),
        )
    # The running max `top` only shifts the exponents for stability: the result, (sum of
    # exp(s - top) v) / (sum of exp(s - top)), does not depend on it, so it is computed from
    # detached scores (as flash attention does) and autograd has no max to differentiate.
    s = q @ k.transpose(-1, -2)  # (B, Hkv, g*m, m)
    if causal:
        # (g*m, m): key <= query token, per q head
        tri = torch.ones(m, m, dtype=torch.bool, device=q.device).tril().repeat(g, 1)
        # (B, Hkv, g*m, 1): running max of the scores
        top = torch.where(tri, s.detach(), float("-inf")).amax(-1, keepdim=True)
        # masked: weight exp(-80) ~ 2e-35, no gradient; exp's fast path
        p = torch.exp(torch.where(tri, s - top, -80.0))
    else:
        top = s.detach().amax(-1, keepdim=True)
        p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)  # (B, Hkv, g*m, 1): running sum of exp(score - top)
    acc = p @ v  # (B, Hkv, g*m, Dv): running weighted sum of values
    for step in range(1, n):
        k, v = k_next, v_next  # the block of rank (me - step) % n
        if step < n - 1:
            k_next, v_next = ring_shift(k, mesh, axis), ring_shift(v, mesh, axis)
        s = q @ k.transpose(-1, -2)  # (B, Hkv, g*m, m)
        block_top = s.detach().amax(-1, keepdim=True)
        new_top = torch.maximum(top, block_top)
        if causal:
            # Off the diagonal a block is all visible (it came from an earlier rank: me >= step)
            # or all masked: one per-rank flag, no mask. A masked block leaves top alone,
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
    return rearrange(acc / total, "b hk (g m) d -> b m (hk g) d", g=g)  # (B, m, Hq, Dv)


class USPAttention(nn.Module):
    """Unified sequence parallelism: Ulysses over ``ulysses_axis``, ring over ``ring_axis``.

    Inputs: q ``(batch, seq/P, Hq, head_dim)``, k and v ``(batch, seq/P, Hkv, head_dim)``, the
    sequence split over ``(ring_axis, ulysses_axis)`` (ring-major: rank ``(r, u)`` holds
    chunk ``r * Pu + u``), so after the Ulysses all-to-all each ring rank holds one contiguous
    block; output like q. The two axes are different axes of one mesh, hence orthogonal (no
    xDiT/yunchang group mismatch). Heads follow ``UlyssesAttention``'s rules over the Ulysses
    degree (MHA padded; grouped-query split or kv heads repeated, else ``MeshError``); the ring
    then carries the grouped k/v. The gradient is that of ``local_attention`` on the whole sequence.

    Args:
        mesh: the mesh the layer runs on.
        ulysses_axis: the axis of the Ulysses all-to-all.
        ring_axis: the axis of the ring (a different axis of the mesh).
        causal: apply a causal mask (by global token positions).
    """

    def __init__(
        self, mesh: Mesh, ulysses_axis: str, ring_axis: str, *, causal: bool = False
    ) -> None:
        super().__init__()
        _check_axes("USPAttention", mesh, ulysses_axis=ulysses_axis, ring_axis=ring_axis)
        if ulysses_axis == ring_axis:
            others = [a for a in mesh.axis_names if a != ring_axis]
            raise MeshError(
                f"USPAttention: ulysses_axis and ring_axis are both {ring_axis!r}; they must be "
                f"different axes of {mesh!r}. Fix: "
                + (
                    f"pass another axis for one of them (e.g. ulysses_axis={others[0]!r})"
                    if others
                    else "build a mesh with two axes (e.g. Mesh({'cp': 2, 'sp': 2})), or use "
                    "UlyssesAttention or RingAttention over the one axis"
                )
            )
        self.mesh, self.ulysses_axis, self.ring_axis, self.causal = (
            mesh,
            ulysses_axis,
            ring_axis,
            causal,
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attention of this rank's block of queries over the whole sequence: the arguments and
        result of :meth:`RingAttention.forward`."""
        _check_qkv("USPAttention", q, k, v, same_seq=True)
        n, H = self.mesh.axis_size(self.ulysses_axis), q.shape[2]
        # (B, n*m, heads/n, D)
        qh, kh, vh = (
            all_to_all_4d(t, self.mesh, self.ulysses_axis)
            for t in _ulysses_heads("USPAttention", q, k, v, n)
        )
        o = _ring(qh, kh, vh, self.mesh, self.ring_axis, self.causal)  # (B, n*m, Hq'/n, D)
        # (B, m, Hq, D)
        return all_to_all_4d(o, self.mesh, self.ulysses_axis, scatter_dim=1, gather_dim=2)[:, :, :H]
