"""Parallel building blocks for model code: plain ``torch.nn.Module``s that take the mesh in the constructor.

Each module holds **this rank's** parameters (local shapes) and says how they split a
single-device module's parameters through :meth:`param_specs` (``PartitionSpec`` per name).
The helpers below move weights between the two views:

* :func:`shard_state` / :func:`load_sharded`: one rank's shard of a single-device state dict
  (real ranks: each process loads its own);
* :func:`stack_state` / :func:`unstack`: every rank's shard stacked along a leading rank dim,
  for :func:`fastdist.simulate` with ``torch.func.functional_call``, and back.

Layout conventions: activations are batch-first ``(batch, seq, features)``; the sequence
parallel variants shard ``seq_dim`` (default 1) over the tensor-parallel axis, as Megatron's
sequence parallelism does.

>>> import torch, fastdist as fd
>>> mesh = fd.Mesh({"tp": 2})
>>> full = torch.nn.Linear(4, 6)
>>> col = fd.nn.ColumnParallelLinear(4, 6, mesh, "tp", gather_output=True)
>>> state = fd.nn.stack_state(full.state_dict(), fd.nn.param_specs(col), mesh)
>>> x = torch.randn(3, 4)
>>> out = fd.simulate(lambda p, x: torch.func.functional_call(col, p, (x,)), mesh)(state, x.expand(2, 3, 4))
>>> bool(torch.allclose(out[0], full(x), atol=1e-6))
True
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from .checking import P, PartitionSpec, block_of
from .collectives import all_gather, all_gather_invariant, axis_index, local_chunk, pmax, psum, psum_scatter, pvary
from .errors import MeshError
from .mesh import Mesh

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "local_attention",
    "UlyssesAttention",
    "RingAttention",
    "USPAttention",
    "param_specs",
    "shard_state",
    "stack_state",
    "unstack",
    "load_sharded",
]


def _local(full: int, n: int, what: str, axis: str) -> int:
    if full % n:
        raise MeshError(f"fastdist.nn: {what} = {full} is not divisible by the size {n} of axis {axis!r}. Fix: choose sizes divisible by {n}")
    return full // n


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with the output features split over ``axis`` (Megatron's column parallel).

    Input: replicated over ``axis`` (or, with ``sequence_parallel``, sharded on ``seq_dim``,
    gathered first: backward reduce-scatters). Output: this rank's features, or all of them
    with ``gather_output`` (backward: a local slice). Parameters: ``weight`` (out/n, in),
    ``bias`` (out/n,).
    """

    def __init__(
        self, in_features: int, out_features: int, mesh: Mesh, axis: str = "tp", *, bias: bool = True, gather_output: bool = False,
        sequence_parallel: bool = False, seq_dim: int = 1, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.mesh, self.axis, self.gather_output, self.sequence_parallel, self.seq_dim = mesh, axis, gather_output, sequence_parallel, seq_dim
        local = _local(out_features, mesh.axis_size(axis), "out_features", axis)
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(local, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def param_specs(self) -> dict[str, PartitionSpec]:
        return {"weight": P(self.axis, None), **({"bias": P(self.axis)} if self.bias is not None else {})}

    def forward(self, x: Tensor) -> Tensor:
        return self.project(_column_input(x, self.mesh, self.axis, self.sequence_parallel, self.seq_dim))

    def project(self, x: Tensor) -> Tensor:
        """The layer on an input already made rank-varying (gathered or ``pvary``'d): no input collective."""
        y = _linear(x, self.weight, self.bias)  # (..., out/n)
        return all_gather_invariant(y, self.mesh, self.axis, dim=-1) if self.gather_output else y


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear``, except that under :func:`fastdist.simulate`'s vmap the bias goes in place.

    vmap's rule for ``linear`` with a batched bias adds it out of place: a second output-sized
    buffer per layer that one device's ``addmm`` never allocates.
    """
    if bias is None:
        return F.linear(x, weight)
    if torch.compiler.is_compiling():
        # vmap's linear rule with a bias fails under dynamo's dynamic shapes in torch 2.13
        # ("Cannot call sizes() on tensor with symbolic sizes"); inductor fuses the add anyway
        return F.linear(x, weight) + bias
    if not torch._C._functorch.is_batchedtensor(x) or torch._C._is_torch_function_mode_enabled():
        # plain tensors: one addmm. A TorchFunctionMode (the checked mode of fastdist.spmd) may
        # have to insert a pvary before the bias meets the product, which in place would forbid.
        return F.linear(x, weight, bias)
    return F.linear(x, weight).add_(bias)  # (..., out): the fresh product takes the bias in place


def _column_input(x: Tensor, mesh: Mesh, axis: str, sequence_parallel: bool, seq_dim: int) -> Tensor:
    """A column-parallel layer's input collective: its forward/backward pair, written once."""
    if sequence_parallel:
        return all_gather(x, mesh, axis, dim=seq_dim)  # whole sequence; backward reduce-scatters
    return pvary(x, mesh, axis)  # replicated input, rank-specific use: backward all-reduces dx


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel projections of one input (q, k, v; or gate and up) behind one input collective.

    Equivalent to one :class:`ColumnParallelLinear` per entry of ``out_features``, but the
    input's collective runs once for all of them: with ``sequence_parallel`` one all-gather
    forward and one reduce-scatter backward (instead of one each per projection), otherwise
    one all-reduce of ``dx`` backward; and the projections run as one GEMM with the weights
    side by side (split afterwards). This is Megatron's fused QKV and vLLM's
    ``MergedColumnParallelLinear`` / ``QKVParallelLinear`` input handling; the sizes may
    differ (grouped-query attention: ``(D, D_kv, D_kv)``).

    Returns a tuple with one output per projection (this rank's features, or all of them
    with ``gather_output``). Parameters: ``<i>.weight`` (out_i/n, in) and ``<i>.bias``
    (out_i/n,), held by one :class:`ColumnParallelLinear` per projection (``layer[i]``):
    the names of an ``nn.ModuleList`` of ``nn.Linear``, so a single-device model with
    ``self.qkv = nn.ModuleList([...])`` loads name for name.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 2})
    >>> full = torch.nn.ModuleList([torch.nn.Linear(4, 6), torch.nn.Linear(4, 2)])
    >>> qkv = fd.nn.MergedColumnParallelLinear(4, (6, 2), mesh, "tp", gather_output=True)
    >>> state = fd.nn.stack_state(full.state_dict(), fd.nn.param_specs(qkv), mesh)
    >>> x = torch.randn(3, 4)
    >>> q, k = fd.simulate(lambda p, x: torch.func.functional_call(qkv, p, (x,)), mesh)(state, x.expand(2, 3, 4))
    >>> bool(torch.allclose(q[1], full[0](x), atol=1e-6)), tuple(k.shape)
    (True, (2, 3, 2))
    """

    def __init__(
        self, in_features: int, out_features: tuple[int, ...] | list[int], mesh: Mesh, axis: str = "tp", *, bias: bool = True,
        gather_output: bool = False, sequence_parallel: bool = False, seq_dim: int = 1, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not out_features:
            raise MeshError("MergedColumnParallelLinear: out_features is empty. Fix: give one output size per projection, e.g. (D, D, D)")
        self.mesh, self.axis, self.sequence_parallel, self.seq_dim = mesh, axis, sequence_parallel, seq_dim
        for i, out in enumerate(out_features):  # children "0", "1", ...: an nn.ModuleList's parameter names
            self.add_module(str(i), ColumnParallelLinear(in_features, out, mesh, axis, bias=bias, gather_output=gather_output, dtype=dtype))

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i: int) -> ColumnParallelLinear:
        return cast(ColumnParallelLinear, self._modules[str(i % len(self))])

    def __iter__(self) -> Iterator[ColumnParallelLinear]:
        return (self[i] for i in range(len(self)))

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        x = _column_input(x, self.mesh, self.axis, self.sequence_parallel, self.seq_dim)  # once for every projection
        parts = list(self)
        if len(parts) == 1:
            return (parts[0].project(x),)
        # One GEMM for all projections (weights side by side), as a fused QKV does: wider
        # matrices than each rank's narrow slices, and one dx instead of a sum of several.
        weight = torch.cat([p.weight for p in parts])  # (sum out_i/n, in)
        bias = torch.cat([p.bias for p in parts]) if parts[0].bias is not None else None  # type: ignore[misc]
        ys = torch.split(_linear(x, weight, bias), [p.weight.shape[0] for p in parts], dim=-1)  # (..., out_i/n) each
        if parts[0].gather_output:
            return tuple(all_gather_invariant(y, self.mesh, self.axis, dim=-1) for y in ys)
        return tuple(ys)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with the input features split over ``axis`` (Megatron's row parallel).

    Input: this rank's features (``input_is_parallel=True``, e.g. a column-parallel output) or
    the whole replicated input, split here. Output: the sum over ranks (replicated), or with
    ``sequence_parallel`` reduce-scattered on ``seq_dim``. Parameters: ``weight`` (out, in/n),
    ``bias`` (out,) replicated, added once after the reduction.
    """

    def __init__(
        self, in_features: int, out_features: int, mesh: Mesh, axis: str = "tp", *, bias: bool = True, input_is_parallel: bool = True,
        sequence_parallel: bool = False, seq_dim: int = 1, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.mesh, self.axis, self.input_is_parallel, self.sequence_parallel, self.seq_dim = mesh, axis, input_is_parallel, sequence_parallel, seq_dim
        local = _local(in_features, mesh.axis_size(axis), "in_features", axis)
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def param_specs(self) -> dict[str, PartitionSpec]:
        return {"weight": P(None, self.axis), **({"bias": P()} if self.bias is not None else {})}

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = local_chunk(x, self.mesh, self.axis, dim=-1)  # my slice of the features; backward gathers
        y = F.linear(x, self.weight)  # (..., out): this rank's partial sum
        if self.sequence_parallel:
            y = psum_scatter(y, self.mesh, self.axis, dim=self.seq_dim)  # summed, my sequence shard
            bias = pvary(self.bias, self.mesh, self.axis) if self.bias is not None else None  # meets per-rank rows
        else:
            y = psum(y, self.mesh, self.axis)
            bias = self.bias
        return y + bias if bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary rows split over ``axis``; ids replicated, output replicated.

    Each rank looks up the ids in its row range (zeros elsewhere) and the results are summed.
    Parameter: ``weight`` (num_embeddings/n, dim).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, mesh: Mesh, axis: str = "tp", *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.mesh, self.axis = mesh, axis
        self.local_rows = _local(num_embeddings, mesh.axis_size(axis), "num_embeddings", axis)
        self.weight = nn.Parameter(torch.randn(self.local_rows, embedding_dim, dtype=dtype))

    def param_specs(self) -> dict[str, PartitionSpec]:
        return {"weight": P(self.axis, None)}

    def forward(self, ids: Tensor) -> Tensor:
        start = axis_index(self.mesh, self.axis) * self.local_rows
        mine = (ids >= start) & (ids < start + self.local_rows)  # ids in my row range
        rows = F.embedding(torch.where(mine, ids - start, 0), self.weight)  # (..., dim)
        return psum(rows * mine.unsqueeze(-1), self.mesh, self.axis)


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, mesh: Mesh, axis: str = "tp") -> Tensor:
    """Per-token cross entropy of logits whose vocabulary (last dim) is split over ``axis``.

    ``logits``: (..., vocab/n), this rank's columns; ``target``: (...) global ids, replicated.
    Returns the loss per token, replicated. No rank ever holds the whole vocabulary.
    Gradient: softmax minus one-hot, on this rank's columns.
    """
    n_local = logits.shape[-1]
    top = pmax(logits.detach().amax(-1), mesh, axis)  # (...): a shift for stability, no gradient needed
    shifted = logits - top.unsqueeze(-1)
    log_total = psum(shifted.exp().sum(-1), mesh, axis).log()  # log sum over the whole vocabulary
    start = axis_index(mesh, axis) * n_local
    mine = (target >= start) & (target < start + n_local)
    picked = shifted.gather(-1, torch.where(mine, target - start, 0).unsqueeze(-1)).squeeze(-1)
    return log_total - psum(torch.where(mine, picked, 0.0), mesh, axis)


# ============================================================================ moving weights between views
def param_specs(module: nn.Module) -> dict[str, PartitionSpec]:
    """``PartitionSpec`` of every parameter of ``module`` by dotted name (replicated unless a submodule says otherwise)."""
    specs: dict[str, PartitionSpec] = {name: P() for name, _ in module.named_parameters()}
    for prefix, sub in module.named_modules():
        own = getattr(sub, "param_specs", None)
        if callable(own):
            for name, spec in own().items():
                specs[f"{prefix}.{name}" if prefix else name] = spec
    return specs


def shard_state(full: Mapping[str, Tensor], specs: Mapping[str, PartitionSpec], mesh: Mesh, rank: int) -> dict[str, Tensor]:
    """Rank ``rank``'s shard of every tensor of a single-device state dict."""
    missing = set(specs) - set(full)
    if missing:
        raise MeshError(f"fastdist.nn: the state dict lacks {sorted(missing)}. Fix: load a state dict of the matching single-device module")
    return {name: block_of(full[name], spec, mesh, rank).clone() for name, spec in specs.items()}


def stack_state(full: Mapping[str, Tensor], specs: Mapping[str, PartitionSpec], mesh: Mesh) -> dict[str, Tensor]:
    """Every rank's shard stacked on a leading rank dim ``[world, *local]``, for :func:`fastdist.simulate`."""
    per_rank = [shard_state(full, specs, mesh, r) for r in range(mesh.size)]
    return {name: torch.stack([p[name] for p in per_rank]) for name in specs}


def unstack(stacked: Tensor, spec: PartitionSpec, mesh: Mesh) -> Tensor:
    """The single-device tensor from stacked shards (inverse of :func:`stack_state` for one tensor).

    Shards are joined along their dims; over axes the spec does not name, the copy at index 0 is used.
    """
    rank_of: dict[tuple[int, ...], int] = {}
    for r in range(mesh.size):
        key = tuple(mesh.index(r, spec.axes_of(d)) if spec.axes_of(d) else 0 for d in range(len(spec.dims)))
        rank_of.setdefault(key, r)

    def join(d: int, prefix: tuple[int, ...]) -> Tensor:
        if d == len(spec.dims):
            return stacked[rank_of[prefix]]
        n = mesh.axis_size(spec.axes_of(d)) if spec.axes_of(d) else 1
        return torch.cat([join(d + 1, (*prefix, i)) for i in range(n)], dim=d)

    return join(0, ())


def load_sharded(module: nn.Module, full: Mapping[str, Tensor], mesh: Mesh) -> None:
    """Copy this process's shard of a single-device state dict into ``module`` (a mesh from ``Mesh.from_torch``)."""
    local = shard_state(full, param_specs(module), mesh, mesh.rank)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(local[name])



# ============================================================================ sequence-parallel attention
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
        from .collectives import all_to_all_4d

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
    from .collectives import ring_shift

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
        from .collectives import all_to_all_4d

        n, H = self.mesh.axis_size(self.ulysses_axis), q.shape[2]
        qh, kh, vh = (all_to_all_4d(_pad_heads(t, n), self.mesh, self.ulysses_axis) for t in (q, k, v))  # (B, n*S_l, H'/n, D)
        o = _ring(qh, kh, vh, self.mesh, self.ring_axis, self.causal)
        return all_to_all_4d(o, self.mesh, self.ulysses_axis, scatter_dim=1, gather_dim=2)[:, :, :H]
