"""Tensor-parallel layers: column / row parallel linear, merged projections, vocab-parallel
embedding."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.core.sharding import P, PartitionSpec
from fastdist.errors import NO_IGNORE_INDEX, MeshError
from fastdist.nn.loss import checked_targets
from fastdist.nn.state import Layout
from fastdist.ops import (
    all_gather,
    all_gather_invariant,
    axis_index,
    local_chunk,
    psum,
    psum_scatter,
    pvary,
)

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "column_input",
    "linear",
]


def _axis_size(layer: str, mesh: Any, axis: Any) -> int:
    """The size of ``axis`` of ``mesh``, checked when ``layer`` is built (the error names it)."""
    if not isinstance(mesh, Mesh):
        raise MeshError(
            f"{layer}: mesh must be a fastdist.Mesh, got {type(mesh).__name__}. Fix: pass the "
            "Mesh the model runs on"
        )
    try:
        return mesh.axis_size(axis)
    except MeshError as e:  # "...: unknown mesh axis ...; ... Fix: ...": name the layer
        problem, _, fix = str(e).partition(". Fix: ")
        problem = problem.split(": ", 1)[-1]
        raise MeshError(f"{layer}(axis={axis!r}): {problem}. Fix: {fix}") from None


def _local(layer: str, full: int, n: int, what: str, axis: str) -> int:
    if full % n:
        raise MeshError(
            f"{layer}(axis={axis!r}): {what}={full} is not divisible by the size {n} of axis "
            f"{axis!r}. Fix: choose {what} divisible by {n}, or split the layer over a smaller "
            "axis"
        )
    return full // n


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with the output features split over ``axis`` (Megatron's column parallel).

    Input: replicated over ``axis`` (or, with ``sequence_parallel``, sharded on ``seq_dim``,
    gathered first: backward reduce-scatters). Output: this rank's features, or all of them
    with ``gather_output`` (backward: a local slice). Parameters: ``weight`` (out/n, in),
    ``bias`` (out/n,).

    Args:
        in_features: the input features (whole on every rank).
        out_features: the output features of the whole layer; each rank holds ``out_features / n``.
        mesh: the mesh the layer runs on.
        axis: the mesh axis the output features are split over.
        bias: whether the layer has a bias (split like the output features).
        gather_output: all-gather the output features, so every rank gets all of them.
        sequence_parallel: the input arrives sharded on ``seq_dim`` over ``axis`` and is
            all-gathered first (backward: reduce-scatter).
        seq_dim: the sequence dim of the input, for ``sequence_parallel``.
        dtype: the parameters' dtype; default: torch's default dtype.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mesh: Mesh,
        axis: str = "tp",
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.mesh, self.axis, self.gather_output, self.sequence_parallel, self.seq_dim = (
            mesh,
            axis,
            gather_output,
            sequence_parallel,
            seq_dim,
        )
        n = _axis_size("ColumnParallelLinear", mesh, axis)
        local = _local("ColumnParallelLinear", out_features, n, "out_features", axis)
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(local, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def param_specs(self) -> dict[str, PartitionSpec]:
        return {
            "weight": P(self.axis, None),
            **({"bias": P(self.axis)} if self.bias is not None else {}),
        }

    def forward(self, x: Tensor) -> Tensor:
        return self.project(
            column_input(x, self.mesh, self.axis, self.sequence_parallel, self.seq_dim)
        )

    def project(self, x: Tensor) -> Tensor:
        """The layer on an input already made rank-varying (gathered or ``pvary``'d): no input
        collective.

        Args:
            x: the input, already rank-varying over ``axis``.
        """
        y = linear(x, self.weight, self.bias)  # (..., out/n)
        return all_gather_invariant(y, self.mesh, self.axis, dim=-1) if self.gather_output else y


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
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
    if not torch._C._functorch.is_batchedtensor(x) or _checked_mode_active():
        # plain tensors: one addmm. The checked mode of fastdist.spmd may have to insert a
        # pvary before the bias meets the product, which in place would forbid.
        return F.linear(x, weight, bias)
    return F.linear(x, weight).add_(bias)  # (..., out): the fresh product takes the bias in place


def _times(rows: Tensor, mask: Tensor) -> Tensor:
    """``rows * mask``; under :func:`fastdist.simulate`'s vmap in place on the fresh ``rows``
    (an embedding's output, which its backward does not read), saving a rank-stacked buffer of
    the embeddings' size; the same values."""
    if (
        torch.compiler.is_compiling()
        or not torch._C._functorch.is_batchedtensor(rows)
        or _checked_mode_active()
    ):
        return rows * mask
    return rows.mul_(mask)


def _checked_mode_active() -> bool:
    """Whether a TorchFunctionMode other than simulate's SDPA batching (which passes ``add_``
    through) is active."""
    if not torch._C._is_torch_function_mode_enabled():
        return False
    from fastdist.sim.sdpa import SdpaMode

    modes = torch.overrides._get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    return any(not isinstance(m, SdpaMode) for m in modes)


def column_input(x: Tensor, mesh: Mesh, axis: str, sequence_parallel: bool, seq_dim: int) -> Tensor:
    """A column-parallel layer's input collective: its forward/backward pair, written once."""
    if sequence_parallel:
        return all_gather(x, mesh, axis, dim=seq_dim)  # whole sequence; backward reduce-scatters
    return pvary(x, mesh, axis)  # replicated input, rank-specific use: backward all-reduces dx


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel projections of one input (q, k, v; or gate and up) behind one input
    collective.

    Equivalent to one :class:`ColumnParallelLinear` per entry of ``out_features``, but the
    input's collective runs once for all of them: with ``sequence_parallel`` one all-gather
    forward and one reduce-scatter backward (instead of one each per projection), otherwise
    one all-reduce of ``dx`` backward; and the projections run as one GEMM with the weights
    side by side (split afterwards). This is Megatron's fused QKV and vLLM's
    ``MergedColumnParallelLinear`` / ``QKVParallelLinear`` input handling; the sizes may
    differ (grouped-query attention: ``(D, D_kv, D_kv)``).

    Returns a tuple with one output per projection (this rank's features, or all of them
    with ``gather_output``). Parameters: ``<name>.weight`` (out_i/n, in) and ``<name>.bias``
    (out_i/n,), held by one :class:`ColumnParallelLinear` per projection (``layer[i]``).
    ``names`` gives the projections the names checkpoints use, e.g.
    ``("q_proj", "k_proj", "v_proj")`` or ``("gate_proj", "up_proj")``; by default they are
    ``"0"``, ``"1"``, ... (an ``nn.ModuleList``'s names). A checkpoint whose projections sit
    one level up (HF's ``self_attn.q_proj.weight`` for the model's ``self_attn.qkv.q_proj.weight``)
    loads with ``fastdist.checkpoint.load(path, model, mesh=mesh, rename=lambda k:
    k.replace(".qkv.", "."))``.

    Args:
        in_features: the input features (whole on every rank).
        out_features: the output features of each projection (may differ: ``(D, D_kv, D_kv)``).
        mesh: the mesh the layer runs on.
        axis: the mesh axis the output features of every projection are split over.
        bias: whether the projections have biases.
        gather_output: all-gather each projection's output features.
        sequence_parallel: the input arrives sharded on ``seq_dim`` over ``axis`` and is
            all-gathered first (backward: reduce-scatter).
        seq_dim: the sequence dim of the input, for ``sequence_parallel``.
        dtype: the parameters' dtype; default: torch's default dtype.
        names: the projections' names in checkpoints (``("q_proj", "k_proj", "v_proj")``); default
            ``"0"``, ``"1"``, ...

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 2})
    >>> full = torch.nn.ModuleList([torch.nn.Linear(4, 6), torch.nn.Linear(4, 2)])
    >>> qkv = fd.nn.MergedColumnParallelLinear(4, (6, 2), mesh, "tp", gather_output=True)
    >>> state = fd.nn.stack_state(full.state_dict(), fd.nn.param_specs(qkv), mesh)
    >>> x = torch.randn(3, 4)
    >>> run = fd.simulate(lambda p, x: torch.func.functional_call(qkv, p, (x,)), mesh)
    >>> q, k = run(state, x.expand(2, 3, 4))
    >>> bool(torch.allclose(q[1], full[0](x), atol=1e-6)), tuple(k.shape)
    (True, (2, 3, 2))
    """

    def __init__(
        self,
        in_features: int,
        out_features: tuple[int, ...] | list[int],
        mesh: Mesh,
        axis: str = "tp",
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        dtype: torch.dtype | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if not out_features:
            raise MeshError(
                "MergedColumnParallelLinear: out_features is empty. Fix: give one output size per "
                "projection, e.g. (D, D, D)"
            )
        names = [str(i) for i in range(len(out_features))] if names is None else list(names)
        if (
            len(names) != len(out_features)
            or len(set(names)) != len(names)
            or not all(n.isidentifier() or n.isdigit() for n in names)
        ):
            raise MeshError(
                f"MergedColumnParallelLinear: names {names} must be {len(out_features)} distinct "
                f"module names, one per entry of out_features {tuple(out_features)}. Fix: e.g. "
                "names=('q_proj', 'k_proj', 'v_proj')"
            )
        self.mesh, self.axis, self.sequence_parallel, self.seq_dim = (
            mesh,
            axis,
            sequence_parallel,
            seq_dim,
        )
        n = _axis_size("MergedColumnParallelLinear", mesh, axis)
        for name, out in zip(names, out_features):
            _local(f"MergedColumnParallelLinear[{name!r}]", out, n, "out_features", axis)
        for name, out in zip(names, out_features):
            self.add_module(
                name,
                ColumnParallelLinear(
                    in_features,
                    out,
                    mesh,
                    axis,
                    bias=bias,
                    gather_output=gather_output,
                    dtype=dtype,
                ),
            )

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i: int) -> ColumnParallelLinear:
        return cast(ColumnParallelLinear, list(self._modules.values())[i % len(self)])

    def __iter__(self) -> Iterator[ColumnParallelLinear]:
        return (self[i] for i in range(len(self)))

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        # once for every projection
        x = column_input(x, self.mesh, self.axis, self.sequence_parallel, self.seq_dim)
        parts = list(self)
        if len(parts) == 1:
            return (parts[0].project(x),)
        # One GEMM for all projections (weights side by side), as a fused QKV does: wider
        # matrices than each rank's narrow slices, and one dx instead of a sum of several.
        weight = torch.cat([p.weight for p in parts])  # (sum out_i/n, in)
        bias = torch.cat([p.bias for p in parts]) if parts[0].bias is not None else None  # type: ignore[misc]
        # (..., out_i/n) each
        ys = torch.split(linear(x, weight, bias), [p.weight.shape[0] for p in parts], dim=-1)
        if parts[0].gather_output:
            return tuple(all_gather_invariant(y, self.mesh, self.axis, dim=-1) for y in ys)
        return tuple(ys)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with the input features split over ``axis`` (Megatron's row parallel).

    Input: this rank's features (``input_is_parallel=True``, e.g. a column-parallel output) or
    the whole replicated input, split here. Output: the sum over ranks (replicated), or with
    ``sequence_parallel`` reduce-scattered on ``seq_dim``. Parameters: ``weight`` (out, in/n),
    ``bias`` (out,) replicated, added once after the reduction.

    Args:
        in_features: the input features of the whole layer; each rank holds ``in_features / n``.
        out_features: the output features (whole on every rank).
        mesh: the mesh the layer runs on.
        axis: the mesh axis the input features are split over.
        bias: whether the layer has a bias (replicated, added once after the reduction).
        input_is_parallel: the input is already this rank's features (a column-parallel output);
            ``False``: the whole replicated input, split here.
        sequence_parallel: reduce-scatter the output on ``seq_dim`` instead of all-reducing it.
        seq_dim: the sequence dim of the output, for ``sequence_parallel``.
        dtype: the parameters' dtype; default: torch's default dtype.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mesh: Mesh,
        axis: str = "tp",
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.mesh, self.axis, self.input_is_parallel, self.sequence_parallel, self.seq_dim = (
            mesh,
            axis,
            input_is_parallel,
            sequence_parallel,
            seq_dim,
        )
        n = _axis_size("RowParallelLinear", mesh, axis)
        local = _local("RowParallelLinear", in_features, n, "in_features", axis)
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def param_specs(self) -> dict[str, PartitionSpec]:
        return {"weight": P(None, self.axis), **({"bias": P()} if self.bias is not None else {})}

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            # my slice of the features; backward gathers
            x = local_chunk(x, self.mesh, self.axis, dim=-1)
        y = F.linear(x, self.weight)  # (..., out): this rank's partial sum
        if self.sequence_parallel:
            y = psum_scatter(y, self.mesh, self.axis, dim=self.seq_dim)  # summed, my sequence shard
            # meets per-rank rows
            bias = pvary(self.bias, self.mesh, self.axis) if self.bias is not None else None
        else:
            y = psum(y, self.mesh, self.axis)
            bias = self.bias
        return y + bias if bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary rows split over ``axis``; ids replicated, output replicated.

    Each rank looks up the ids in its row range (zeros elsewhere) and the results are summed
    (psum; backward identity). A vocabulary that does not divide by the axis size (GPT-2's
    50257) is padded with zero rows at the end: ``weight`` is (ceil(num_embeddings/n), dim) and
    the padding belongs to the last ranks (:class:`fastdist.nn.Layout` with ``size``).
    ``padding_idx`` gets no gradient, as in ``nn.Embedding``. An id outside ``[0, num_embeddings)``
    raises :class:`fastdist.TargetError` (``nn.Embedding`` raises ``IndexError``), never a zero row.

    Args:
        num_embeddings: the vocabulary size (padded with zero rows to a multiple of the axis size).
        embedding_dim: the embedding width.
        mesh: the mesh the layer runs on.
        axis: the mesh axis the vocabulary rows are split over.
        padding_idx: an id whose row gets no gradient, as in ``nn.Embedding``.
        dtype: the parameters' dtype; default: torch's default dtype.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        mesh: Mesh,
        axis: str = "tp",
        *,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        n = _axis_size("VocabParallelEmbedding", mesh, axis)
        if padding_idx is not None:
            if (
                isinstance(padding_idx, bool)
                or not isinstance(padding_idx, int)
                or not -num_embeddings <= padding_idx < num_embeddings
            ):
                raise MeshError(
                    f"VocabParallelEmbedding(axis={axis!r}): padding_idx={padding_idx!r} is not "
                    f"an id of the {num_embeddings}-word vocabulary. Fix: pass an id in "
                    f"[0, {num_embeddings}) (or [-{num_embeddings}, -1] counted from the end, as "
                    "nn.Embedding takes), or None"
                )
            padding_idx %= num_embeddings  # as nn.Embedding: a negative id counts from the end
        self.mesh, self.axis, self.num_embeddings, self.padding_idx = (
            mesh,
            axis,
            num_embeddings,
            padding_idx,
        )
        # ceil: padded to a multiple of the axis
        self.local_rows = -(-num_embeddings // n)
        self.weight = nn.Parameter(torch.randn(self.local_rows, embedding_dim, dtype=dtype))

    def param_layouts(self) -> dict[str, Layout]:
        return {"weight": Layout(P(self.axis, None), size=self.num_embeddings)}

    def forward(self, ids: Tensor) -> Tensor:
        ids = checked_targets(
            "VocabParallelEmbedding",
            ids,
            self.mesh,
            self.axis,
            self.num_embeddings,
            NO_IGNORE_INDEX,
        )  # ids < 0 or >= vocab raise
        start = axis_index(self.mesh, self.axis) * self.local_rows
        mine = (ids >= start) & (ids < start + self.local_rows)  # ids in my row range
        rows = F.embedding(torch.where(mine, ids - start, 0), self.weight)  # (..., dim)
        rows = _times(rows, mine.unsqueeze(-1))  # the rows of other ranks' ids zeroed
        if self.padding_idx is not None:
            # no gradient into the padding row
            rows = torch.where((ids == self.padding_idx).unsqueeze(-1), rows.detach(), rows)
        return psum(rows, self.mesh, self.axis)
