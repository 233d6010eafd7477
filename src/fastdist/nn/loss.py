"""Losses over a vocabulary split across ranks.

:func:`cross_entropy` is ``torch.nn.functional.cross_entropy`` for logits whose last
dimension (the vocabulary) is split evenly over a mesh axis: rank ``i`` along the axis
holds columns ``[i * V_local, (i + 1) * V_local)``. No rank ever holds the whole
vocabulary; per token, one all-gather of three numbers crosses the axis (each rank's largest
logit, its sum of exponentials shifted by it, the target's logit), and none in the backward.
:func:`causal_lm_loss` is the vocabulary-parallel twin of transformers' ``ForCausalLMLoss``.

Targets are checked: a class id that is neither ``ignore_index`` nor in ``[0, vocab_size)``
raises :class:`fastdist.errors.TargetError` (``F.cross_entropy`` would index out of range or
silently compute garbage on a split vocabulary). The check reads the data, so it is the
custom op ``fastdist::check_targets``, which works in eager mode on real ranks, inside
:func:`fastdist.simulate` (its vmap rule checks every simulated rank's targets at once and
names the rank) and under ``torch.compile(fullgraph=True)`` (an opaque op with a fake rule:
no graph break; it raises when the compiled step runs). On an accelerator the check costs
one device-to-host synchronisation per call.
"""

from __future__ import annotations

import ast
from typing import Any, Literal

import torch
from torch import Tensor

from fastdist.core.binding import rank_binding
from fastdist.core.context import is_real
from fastdist.core.mesh import AxisName, Mesh
from fastdist.core.transforms import without_values
from fastdist.errors import CollectiveError, TargetError
from fastdist.ops import all_gather_invariant, axis_index
from fastdist.ops.prelude import check_mesh, names_this_rank

__all__ = [
    "causal_lm_loss",
    "cross_entropy",
    "vocab_parallel_cross_entropy",
    "checked_targets",
    "gathered_causal_lm_loss",
    "HFCausalLMLoss",
]

Reduction = Literal["none", "mean", "sum"]


# ----------------------------------------------------------------------------- the target check
@torch.library.custom_op("fastdist::check_targets", mutates_args=())
def _check_targets(
    target: Tensor,
    rank: Tensor,
    vocab_size: int,
    ignore_index: int,
    op: str,
    axis: str,
    simulated: bool,
) -> Tensor:
    """A copy of ``target``; raises :class:`TargetError` if an entry is neither ``ignore_index``
    nor in ``[0, vocab_size)``.

    ``rank`` (broadcastable to ``target``) is the global rank holding each entry, for the message;
    ``axis`` is the ``repr`` of the mesh axis (a schema has no type for a name or a tuple of names).
    Callers use the returned copy, so a compiler cannot drop the check as dead code.
    """
    bad = ((target < 0) | (target >= vocab_size)) & (target != ignore_index)
    if bool(bad.any()):
        t, b = target.detach().cpu(), bad.cpu()
        ranks = rank.detach().cpu().expand(t.shape)
        first = int(ranks[b].min())
        here = ranks == first
        values = sorted(set(t[b & here].tolist()))
        others = sorted(set(ranks[b].tolist()) - {first})
        raise TargetError(
            op,
            ast.literal_eval(axis),
            first,
            simulated,
            values,
            int((b & here).sum()),
            int(here.sum()),
            vocab_size,
            ignore_index,
            others,
        )
    return target.clone()


@_check_targets.register_fake
def _check_targets_fake(
    target: Tensor,
    rank: Tensor,
    vocab_size: int,
    ignore_index: int,
    op: str,
    axis: str,
    simulated: bool,
) -> Tensor:
    return torch.empty_like(target)


@_check_targets.register_vmap
def _check_targets_vmap(
    info: Any, in_dims: tuple[int | None, ...], target: Tensor, rank: Tensor, *params: Any
) -> tuple[Tensor, int]:
    # Check every entry of the stacked target at once: move the vmapped dim to the front and give
    # each entry its rank (a simulated rank id is vmapped like the target, or the target is
    # replicated and only the rank id is). An outer vmap is handled by the op's next rule.
    tb, rb = in_dims[0], in_dims[1]
    n = info.batch_size
    t = target.movedim(tb, 0) if tb is not None else target.unsqueeze(0).expand(n, *target.shape)
    r = rank.movedim(rb, 0) if rb is not None else rank.unsqueeze(0).expand(n, *rank.shape)
    # rank broadcasts to the target per entry
    r = r.reshape(n, *([1] * (t.dim() - r.dim())), *r.shape[1:]).expand(t.shape)
    return _check_targets(t, r, *params), 0


def checked_targets(
    op: str, target: Tensor, mesh: Mesh, axis: AxisName, vocab_size: int, ignore_index: int
) -> Tensor:
    """``target`` through ``fastdist::check_targets`` with this rank's global rank id."""
    if is_real(mesh):  # real ranks (a simulation over the mesh takes precedence)
        rank, simulated = torch.tensor(mesh.rank, device=target.device), False
    else:
        binding = rank_binding(op, mesh)  # raises on a multi-rank mesh that is not simulated
        rank = (
            binding.rank
            if binding is not None
            else torch.zeros((), dtype=torch.long, device=target.device)
        )
        simulated = binding is not None
    return torch.ops.fastdist.check_targets(  # type: ignore[no-any-return]
        target, rank, vocab_size, ignore_index, op, repr(axis), simulated
    )


# ----------------------------------------------------------------------------- the loss
# rows of a chunk in the loss's passes on the CPU: about 256K elements (1 MB of float32), so that
# the shift, the exponential and the sum (or the product) run in a core's L2 cache, not through
# memory. Other devices take the whole tensor at once (a chunk is a kernel launch per op there).
_CHUNK_ELEMS = 1 << 18


def _row_chunks(x: Tensor) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering the rows of ``x`` (N, V): chunks of about
    ``_CHUNK_ELEMS`` elements (at least one row each) on the CPU, one chunk elsewhere (and for a
    fake or meta tensor, which has no cache to fit: a trace's op count); one empty
    chunk when N is 0, so that the callers' results keep their (empty) shapes."""
    n_rows, n_cols = x.shape
    chunked = x.device.type == "cpu" and not without_values(x)  # a trace: one chunk
    step = max(1, _CHUNK_ELEMS // max(1, n_cols)) if chunked else max(1, n_rows)
    return [(i, min(i + step, n_rows)) for i in range(0, max(n_rows, 1), step)]


def _plain(*ts: Tensor) -> bool:
    """Whether ``ts`` are plain tensors: none a ``torch.func`` level's wrapper (vmap of
    ``fastdist.simulate``, ``torch.func.grad``) and none recorded by autograd (a differentiable
    backward, ``create_graph=True``; a Function's forward and a plain backward run without grad).
    Neither vmap nor autograd takes ``out=`` ops: elsewhere the passes below write in place."""
    wrapped, recording = torch._C._functorch.is_functorch_wrapped_tensor, torch.is_grad_enabled()
    return not any(wrapped(t) or (recording and t.requires_grad) for t in ts)


def _shifted_into(dst: Tensor, x: Tensor, shift: Tensor) -> Tensor:
    """``dst`` overwritten with ``x - shift`` (broadcast): one pass (``out=``) on plain tensors,
    else a copy and an in-place subtraction (the same values, bit for bit)."""
    if _plain(dst, x, shift):
        return torch.sub(x, shift, out=dst)
    return dst.copy_(x).sub_(shift)


def _column_sum(x: Tensor, valid: Tensor | None) -> Tensor:
    """``x`` (..., V) summed over its last dim, over the columns ``valid`` (V,) keeps (all when
    None): the logits' sum that label smoothing needs, padding columns (``-inf``) left out."""
    return (x if valid is None else torch.where(valid, x, 0.0)).sum(-1)


def _local_stats(
    x: Tensor, smooth: bool = False, valid: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(top, shift, sum, xsum)`` of each row of ``x`` (..., V): the largest logit ``top``
    (``-inf`` for a row of ``-inf`` only), ``shift`` (``top``, or 0 where ``top`` is ``-inf``),
    ``sum_j exp(x_j - shift)`` and, with ``smooth``, ``sum_j x_j`` over the columns ``valid``
    keeps (`_column_sum`; zeros without ``smooth``), in ONE read of ``x`` from memory: chunk by
    chunk, the chunk's maximum, then the shift, the exponential and the sums while the chunk is
    in the core's cache, through one chunk-sized buffer (no logits-sized temporary). The values
    are bit for bit those of ``amax`` over the whole row, then ``(x - shift).exp().sum(-1)``."""
    rows = x.reshape(-1, x.shape[-1])  # (N, V)
    spans = _row_chunks(rows)
    buf = rows.new_empty(spans[0][1] - spans[0][0], rows.shape[1]) if _plain(rows) else None
    tops, shifts, sums, xsums = [], [], [], []
    for a, b in spans:
        chunk = rows[a:b]
        top = chunk.amax(-1, keepdim=True)  # (b - a, 1): exact, as the whole row's
        shift = torch.where(top == float("-inf"), 0.0, top)
        if smooth:  # before the buffer is written: chunk is a view of x, buf is not
            xsums.append(_column_sum(chunk, valid))
        e = (chunk - shift) if buf is None else _shifted_into(buf[: b - a], chunk, shift)
        tops.append(top)
        shifts.append(shift)
        sums.append(e.exp_().sum(-1))
    top, shift, total = (t[0] if len(t) == 1 else torch.cat(t) for t in (tops, shifts, sums))
    shape = x.shape[:-1]
    if not smooth:
        xsum = total.new_zeros(shape)
    else:
        xsum = (xsums[0] if len(xsums) == 1 else torch.cat(xsums)).reshape(shape)
    return top.reshape(shape), shift.reshape(shape), total.reshape(shape), xsum


def _scaled_exp(
    x: Tensor, shift: Tensor, scale: Tensor, add: Tensor | None = None, valid: Tensor | None = None
) -> Tensor:
    """``exp(x - shift[..., None]) * scale[..., None]``, plus ``add[..., None]`` on the columns
    ``valid`` keeps (all when None) when ``add`` is given (label smoothing's gradient), a fresh
    tensor shaped like ``x`` written chunk by chunk in place (shift, exponential, product and sum
    while the chunk is in cache); the exponentials bit for bit `_local_stats`'."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    # (N, V); view, not reshape: it shares out's storage or raises, never writes into a copy
    rows, dst = x.reshape(-1, x.shape[-1]), out.view(-1, x.shape[-1])
    shifts, scales = shift.reshape(-1, 1), scale.reshape(-1, 1).to(x.dtype)  # (N, 1)
    adds = add.reshape(-1, 1).to(x.dtype) if add is not None else None  # (N, 1)
    for a, b in _row_chunks(rows):
        part = _shifted_into(dst[a:b], rows[a:b], shifts[a:b]).exp_().mul_(scales[a:b])
        if adds is not None:
            part.add_(adds[a:b])
            if valid is not None:  # padding columns: exp gave 0, the added term is taken off
                part.mul_(valid)
    return out


class _LocalSoftmaxStats(torch.autograd.Function):
    """This rank's part of the loss, per row: the largest logit ``top``, the ``shift`` (``top``, or
    0 for a row of ``-inf`` only), ``sum_j exp(x_j - shift)``, ``x[index] - shift`` and, with
    ``smooth`` (label smoothing), ``sum_j x_j`` over the columns ``valid`` keeps (all when None;
    zeros without ``smooth``).

    Written as one Function so that eager mode makes one dense tensor per step, the gradient, and
    reads the logits once in the forward: the forward finds the largest logit and sums the
    exponentials chunk by chunk (`_local_stats`) and saves ``x`` (not the exponentials, a second
    tensor of its size), the backward recomputes ``exp(x - shift)`` into the gradient chunk by
    chunk, bit for bit the forward's, and scatters ``g_picked`` into the target's column (autograd
    of the plain ops would save a dense ``exp``, fill a dense zero tensor for the gather and add
    two dense gradients). ``top`` and ``shift`` carry no gradient. An in-place change of ``x``
    between the forward and the backward raises (autograd's version check). Shapes: ``x``
    (..., V_local), ``index`` and the outputs (...). Under ``torch.compile`` the plain ops are used
    instead (the compiler fuses them; see torch-notes on Functions under compile).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: Tensor, index: Tensor, smooth: bool, valid: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        top, shift, total, xsum = _local_stats(x, smooth, valid)
        picked = x.gather(-1, index.unsqueeze(-1)).squeeze(-1) - shift  # (...)
        return top, shift, total, picked, xsum

    @staticmethod
    def setup_context(
        ctx: Any,
        inputs: tuple[Tensor, Tensor, bool, Tensor | None],
        output: tuple[Tensor, Tensor, Tensor, Tensor, Tensor],
    ) -> None:
        ctx.set_materialize_grads(False)  # no dense zeros for an absent gradient
        ctx.mark_non_differentiable(output[0], output[1])
        ctx.save_for_backward(inputs[0], output[1], inputs[1], inputs[3])

    @staticmethod
    def backward(
        ctx: Any,
        g_top: Tensor | None,
        g_shift: Tensor | None,
        g_sum: Tensor | None,
        g_picked: Tensor | None,
        g_xsum: Tensor | None,
    ) -> tuple[Tensor | None, None, None, None]:
        x, shift, index, valid = ctx.saved_tensors
        if g_sum is None and g_picked is None and g_xsum is None:
            return None, None, None, None
        # (..., V_local): exp(x - shift) * g_sum (+ g_xsum on the valid columns), the
        # exponentials bit for bit the forward's
        if g_sum is None and g_xsum is None:
            dx = torch.zeros_like(x)
        else:
            scale = g_sum if g_sum is not None else shift.new_zeros(shift.shape)
            dx = _scaled_exp(x, shift, scale, g_xsum, valid)
        if g_picked is not None:  # in place: dx is fresh
            dx.scatter_add_(-1, index.unsqueeze(-1), g_picked.unsqueeze(-1).to(dx.dtype))
        return dx, None, None, None


def _token_losses(
    op: str,
    logits: Tensor,
    target: Tensor,
    mesh: Mesh,
    axis: AxisName,
    ignore_index: int,
    vocab_size: int | None,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Per-token loss (0 where ignored) in the compute dtype, and the mask of counted tokens.

    With ``label_smoothing`` ``eps`` (checked by `_checked_smoothing`), the loss of
    ``F.cross_entropy(..., label_smoothing=eps)`` over the ``vocab_size`` real columns:
    ``(1 - eps) * (lse - x_target) + eps * (lse - mean_c x_c)``; one more number per token (this
    rank's sum of its real columns) joins the all-gather."""
    if not isinstance(logits, Tensor) or not isinstance(target, Tensor):
        raise CollectiveError(
            op,
            axis,
            f"logits and target must be tensors, got {type(logits).__name__} and "
            f"{type(target).__name__}",
            "pass tensors",
        )
    check_mesh(op, mesh, axis)
    if logits.dim() == 0 or logits.shape[-1] == 0 or not logits.is_floating_point():
        raise CollectiveError(
            op,
            axis,
            "logits must be a floating tensor (..., V_local) with V_local > 0, got "
            f"{logits.dtype} of shape {tuple(logits.shape)}",
            "pass this rank's vocabulary columns as the last dim",
        )
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise CollectiveError(
            op,
            axis,
            f"target must hold integer class ids, got {target.dtype}",
            "pass class ids (target.long()); class probabilities are not supported",
        )
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise CollectiveError(
            op,
            axis,
            f"target has shape {tuple(target.shape)}, logits {tuple(logits.shape)}: target must "
            "be logits.shape[:-1]",
            "pass one class id per row of logits",
        )
    n_local = logits.shape[-1]
    n_cols = n_local * mesh.axis_size(axis)
    vocab = n_cols if vocab_size is None else vocab_size
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 0 < vocab <= n_cols:
        raise CollectiveError(
            op,
            axis,
            f"vocab_size={vocab_size!r} must be an int in [1, {n_cols}] (V_local={n_local} "
            f"columns on each of {n_cols // n_local} ranks)",
            "pass the real vocabulary size, at most the padded one",
        )
    target = checked_targets(op, target, mesh, axis, vocab, ignore_index)

    # low precision computes in float32
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    start = axis_index(mesh, axis) * n_local  # this rank's first global column
    smooth = label_smoothing > 0
    valid = None  # (V_local,) the real columns, when some are padding
    if vocab < n_cols:  # padding columns get no probability and no gradient
        valid = start + torch.arange(n_local, device=x.device) < vocab
        x = x.masked_fill(~valid, float("-inf"))
    # Each rank shifts by its own largest logit top_r (a shard of padding columns only: by 0, its
    # sum is 0), and one all-gather of (top_r, sum_r, the target's logit) per token combines them
    # as an online softmax does: logsumexp = M + log(sum_r sum_r * exp(top_r - M)), M the largest
    # top_r. One collective, not a pmax and then a psum (on busy cores each is a wait).
    mine = (target >= start) & (target < start + n_local)  # the target's column is on this rank
    # (...) local column of the target (0 where not mine)
    index = torch.where(mine, target - start, 0)
    if torch.compiler.is_compiling():  # plain ops: the compiler fuses them
        top = x.detach().amax(-1)  # (...): this rank's largest logit, no gradient needed
        shift = torch.where(top == float("-inf"), 0.0, top)  # (...)
        shifted = x - shift.unsqueeze(-1)
        # the target's logit as a masked sum, not a gather: the same value (one term, the rest
        # exact zeros), but its backward is a pointwise where that fuses with the exp's, where a
        # gather's is a dense zero tensor and a scatter_add (+2 % of a compiled Llama step)
        cols = torch.arange(n_local, device=x.device)
        local_sum, picked = (
            shifted.exp().sum(-1),
            torch.where(cols == index.unsqueeze(-1), shifted, 0.0).sum(-1),
        )
        xsum = _column_sum(x, valid) if smooth else top.new_zeros(top.shape)
    else:  # eager: one read of the logits, one dense tensor (the gradient): _LocalSoftmaxStats
        top, shift, local_sum, picked, xsum = _LocalSoftmaxStats.apply(x, index, smooth, valid)  # type: ignore[no-untyped-call]
    stats = [top, local_sum, torch.where(mine, picked + shift, 0.0)]
    if smooth:
        stats.append(xsum)  # this rank's sum of its real columns' logits
    # (n, 3 or 4, ...): the gradient of each rank's part stays on it (no collective in backward)
    every = all_gather_invariant(torch.stack(stats).unsqueeze(0), mesh, axis, dim=0)
    tops = every[:, 0].detach()  # (n, ...)
    high = tops.amax(0)  # (...): the largest logit of the token
    scale = (tops - high).exp()  # (n, ...): 0 for a rank of padding columns only (top -inf)
    total = (every[:, 1] * scale).sum(0)  # (...): sum over the vocabulary of exp(x - high)
    target_logit = every[:, 2].sum(0)  # (...): on one rank, 0 on the others
    counted = target != ignore_index
    if not smooth:
        return torch.where(counted, total.log() - (target_logit - high), 0.0), counted
    eps = label_smoothing
    mean_logit = every[:, 3].sum(0) / vocab  # (...): the mean of the real columns' logits
    loss = total.log() - (1 - eps) * (target_logit - high) - eps * (mean_logit - high)
    return torch.where(counted, loss, 0.0), counted


def _checked_smoothing(op: str, axis: AxisName, label_smoothing: Any) -> float:
    """``label_smoothing`` as a float in ``[0, 1]`` (``F.cross_entropy``'s range), else raise."""
    ok = isinstance(label_smoothing, (int, float)) and not isinstance(label_smoothing, bool)
    if not ok or not 0.0 <= label_smoothing <= 1.0:
        raise CollectiveError(
            op,
            axis,
            f"label_smoothing={label_smoothing!r} must be a float in [0.0, 1.0]",
            "pass the smoothing as F.cross_entropy takes it (0.0: none)",
        )
    return float(label_smoothing)


@names_this_rank
def cross_entropy(
    logits: Tensor,
    target: Tensor,
    mesh: Mesh,
    axis: AxisName = "tp",
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    vocab_size: int | None = None,
    label_smoothing: float = 0.0,
) -> Tensor:
    """``F.cross_entropy(full_logits, target, ignore_index=, reduction=, label_smoothing=)`` with
    the vocabulary split over ``axis``.

    ``logits``: (..., V_local), this rank's columns ``[i*V_local, (i+1)*V_local)`` (``i`` =
    :func:`fastdist.axis_index` along ``axis``); ``target``: (...) global class ids, the same on
    every rank of the axis. ``vocab_size``: the real vocabulary when it was padded to
    ``V_local * n``; the padding columns get no probability and no gradient, whatever they hold.

    Returns, replicated over ``axis``: the loss per token (``reduction="none"``, 0 where the
    target is ``ignore_index``), their sum (``"sum"``) or their mean over the tokens not ignored
    (``"mean"``: NaN when all are ignored, as ``F.cross_entropy``). float16/bfloat16 logits
    compute, and return, in float32; float32/float64 stay as they are.

    Raises :class:`~fastdist.errors.TargetError` for a target neither ``ignore_index`` nor in
    ``[0, vocab_size)``, when the data is seen (eagerly, or when a compiled step runs).

    ``label_smoothing`` ``eps`` in ``[0, 1]``: ``F.cross_entropy``'s, over the ``vocab_size``
    real columns ``C``: each counted token's loss is ``(1 - eps) * (-log p_target) + eps *
    mean_c(-log p_c)`` (0 where ignored; ``"mean"`` divides by the tokens not ignored). It adds
    one number per token to the all-gather and one sum per row, done in the same pass.

    Gradient: (softmax - (1 - eps) * one-hot - eps / C) on this rank's columns, scaled by the
    reduction; zero into padding columns and from ignored tokens.

    Args:
        logits: ``(..., V_local)``, this rank's vocabulary columns ``[i*V_local, (i+1)*V_local)``.
        target: ``(...)`` global class ids, the same on every rank of the axis.
        mesh: the mesh the code runs on.
        axis: the axis the vocabulary is split over.
        ignore_index: a target id that contributes no loss and no gradient.
        reduction: ``"mean"`` (over the tokens not ignored), ``"sum"`` or ``"none"`` (per token).
        vocab_size: the real vocabulary when it was padded to ``V_local * n``; the padding columns
            get no probability.
        label_smoothing: ``F.cross_entropy``'s, a float in ``[0, 1]`` (0: none); the uniform
            part spreads over the ``vocab_size`` real columns.

    Returns:
        replicated over ``axis``: the loss per token (``"none"``), its sum or its mean; float32 for
        float16/bfloat16 logits.

    >>> import torch, torch.nn.functional as F, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 2})
    >>> full, target = torch.randn(3, 6, dtype=torch.float64), torch.tensor([5, -100, 0])
    >>> shards = torch.stack(full.chunk(2, dim=-1))  # rank r holds columns [3r, 3r + 3)
    >>> loss = fd.simulate(lambda lg: fd.nn.cross_entropy(lg, target, mesh, "tp"), mesh)(shards)
    >>> bool(torch.allclose(loss, F.cross_entropy(full, target).expand(2)))
    True
    """
    if reduction not in ("none", "mean", "sum"):
        raise CollectiveError(
            "cross_entropy",
            axis,
            f"reduction={reduction!r} is not one of 'none', 'mean', 'sum'",
            "pass one of them",
        )
    eps = _checked_smoothing("cross_entropy", axis, label_smoothing)
    loss, counted = _token_losses(
        "cross_entropy", logits, target, mesh, axis, ignore_index, vocab_size, eps
    )
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / counted.sum()


@names_this_rank
def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    mesh: Mesh,
    axis: AxisName = "tp",
    *,
    label_smoothing: float = 0.0,
) -> Tensor:
    """Per-token cross entropy of logits whose vocabulary (last dim) is split over ``axis``.

    ``logits``: (..., vocab/n), this rank's columns; ``target``: (...) global ids, replicated.
    Returns the loss per token, replicated; a target of -100 is ignored (loss 0) and any other
    id outside the vocabulary raises :class:`~fastdist.errors.TargetError`. The same as
    ``cross_entropy(logits, target, mesh, axis, reduction="none", label_smoothing=)``.
    Gradient: softmax minus one-hot (minus the smoothing), on this rank's columns.

    Args:
        logits: ``(..., vocab/n)``, this rank's vocabulary columns.
        target: ``(...)`` global ids, the same on every rank of the axis (-100: ignored).
        mesh: the mesh the code runs on.
        axis: the axis the vocabulary is split over.
        label_smoothing: ``F.cross_entropy``'s, a float in ``[0, 1]`` (0: none).

    Returns:
        the loss per token, replicated over ``axis``.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 2})
    >>> logits = torch.zeros(2, 1, 2)  # rank r's two columns of a uniform 4-way vocabulary
    >>> loss = lambda lg: fd.nn.vocab_parallel_cross_entropy(lg, torch.tensor([3]), mesh)
    >>> fd.simulate(loss, mesh)(logits)
    tensor([[1.3863],
            [1.3863]])
    """
    op = "vocab_parallel_cross_entropy"
    eps = _checked_smoothing(op, axis, label_smoothing)
    return _token_losses(op, logits, target, mesh, axis, -100, None, eps)[0]


@names_this_rank
def causal_lm_loss(
    logits: Tensor,
    labels: Tensor | None,
    mesh: Mesh,
    axis: AxisName = "tp",
    *,
    vocab_size: int | None = None,
    num_items_in_batch: Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: Tensor | None = None,
    label_smoothing: float = 0.0,
    **kwargs: Any,
) -> Tensor:
    """transformers' ``ForCausalLMLoss`` with the vocabulary split over ``axis``.

    ``logits``: (batch, seq, V_local), this rank's vocabulary columns; ``labels``: (batch, seq)
    token ids, replicated. Token ``t`` predicts label ``t + 1`` (labels are shifted left and
    padded with ``ignore_index``), unless ``shift_labels`` (already shifted, same shape) is
    given. Returns the summed loss over the tokens not ignored divided by
    ``num_items_in_batch`` when given, else their mean (a 0-d tensor, replicated).
    ``vocab_size`` is the real vocabulary (``config.vocab_size``) when the columns were padded.
    ``label_smoothing`` is ``F.cross_entropy``'s (as in :func:`cross_entropy`; transformers'
    own drops it). Extra keyword arguments are ignored, so ``functools.partial(causal_lm_loss,
    mesh=mesh, axis="tp")`` can be a model's ``loss_function``; ``reduction=`` and ``weight=``
    (which ``F.cross_entropy`` would honour and transformers drops) raise. Unlike
    ``ForCausalLMLoss``, which always upcasts to float32, float64 logits stay float64
    (float16/bfloat16 compute in float32).
    Gradient: that of :func:`cross_entropy` with ``reduction="sum"``, divided likewise.

    Args:
        logits: ``(batch, seq, V_local)``, this rank's vocabulary columns.
        labels: ``(batch, seq)`` token ids, the same on every rank of the axis (shifted here: token
            ``t`` predicts label ``t + 1``).
        mesh: the mesh the code runs on.
        axis: the axis the vocabulary is split over.
        vocab_size: the real vocabulary (``config.vocab_size``) when the columns were padded.
        num_items_in_batch: divide the summed loss by this instead of taking the mean.
        ignore_index: a label id that contributes no loss.
        shift_labels: labels already shifted (same shape as ``labels``), used instead.
        label_smoothing: ``F.cross_entropy``'s, a float in ``[0, 1]`` (0: none).
        **kwargs: ignored (what transformers passes a ``loss_function``), except the
            ``F.cross_entropy`` keywords that would change the loss (``reduction``, ``weight``,
            ``reduce``, ``size_average``): those raise `CollectiveError` instead of being dropped.

    Returns:
        a 0-d tensor, replicated over ``axis``: the mean (or ``num_items_in_batch``-divided sum) of
        the loss.

    >>> import torch, torch.nn.functional as F, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 2})
    >>> full, labels = torch.randn(1, 4, 6), torch.tensor([[1, 4, -100, 2]])
    >>> shards = torch.stack(full.chunk(2, dim=-1))
    >>> loss = fd.simulate(lambda lg: fd.nn.causal_lm_loss(lg, labels, mesh, "tp"), mesh)(shards)
    >>> ref = F.cross_entropy(full[0, :-1], labels[0, 1:])  # position t predicts label t + 1
    >>> bool(torch.allclose(loss, ref.expand(2)))
    True
    """
    _refuse_cross_entropy_kwargs("causal_lm_loss", axis, kwargs)
    eps = _checked_smoothing("causal_lm_loss", axis, label_smoothing)
    shift_labels = _shifted_labels(logits, labels, shift_labels, axis, ignore_index)
    loss, counted = _token_losses(
        "causal_lm_loss", logits, shift_labels, mesh, axis, ignore_index, vocab_size, eps
    )
    return _reduce_tokens(loss, counted, num_items_in_batch)


#: ``F.cross_entropy`` keywords that change the loss, which the causal-LM losses do not compute
_UNSUPPORTED = ("weight", "reduction", "reduce", "size_average")


def _refuse_cross_entropy_kwargs(op: str, axis: AxisName, kwargs: dict[str, Any]) -> None:
    """Raise `CollectiveError` for a ``F.cross_entropy`` keyword that would change the loss
    (``reduction``, ``weight``, ...): the causal-LM losses take ``**kwargs``
    to be a transformers ``loss_function`` and would otherwise drop it silently."""
    given = sorted(k for k in _UNSUPPORTED if k in kwargs)
    if given:
        raise CollectiveError(
            op,
            axis,
            f"{given} are F.cross_entropy keywords this loss does not compute (it returns the "
            "mean over the tokens not ignored, or their sum divided by num_items_in_batch, "
            "without class weights; transformers' ForCausalLMLoss drops them silently)",
            "drop them; for a sum pass num_items_in_batch=1, or use fastdist.nn.cross_entropy("
            "reduction=...) on the shifted labels",
        )


def _shifted_labels(
    logits: Tensor, labels: Tensor | None, shift_labels: Tensor | None, axis: AxisName, ignore: int
) -> Tensor:
    """The label each token predicts: ``labels`` shifted left, padded with ``ignore``, unless
    ``shift_labels`` is given."""
    if shift_labels is None:
        if labels is None:
            raise CollectiveError(
                "causal_lm_loss",
                axis,
                "labels and shift_labels are both None",
                "pass labels (or shift_labels, already shifted)",
            )
        # tokens < n predict n
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore)[..., 1:]
    return shift_labels.to(logits.device)


def _reduce_tokens(
    loss: Tensor, counted: Tensor, num_items_in_batch: Tensor | int | None
) -> Tensor:
    """The summed loss over the tokens not ignored, divided by ``num_items_in_batch`` when given,
    else by their count."""
    if num_items_in_batch is None:
        return loss.sum() / counted.sum()
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss.sum() / num_items_in_batch


def gathered_causal_lm_loss(
    logits: Tensor,
    labels: Tensor | None,
    mesh: Mesh,
    axis: AxisName = "tp",
    *,
    vocab_size: int | None = None,
    num_items_in_batch: Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: Tensor | None = None,
    label_smoothing: float = 0.0,
    **kwargs: Any,
) -> Tensor:
    """:func:`causal_lm_loss` for logits that hold the whole vocabulary on every rank of ``axis``
    (a ``VocabParallel`` head with ``gather_output=True``, i.e. a plan's ``gather_logits=True``).

    ``logits``: (batch, seq, V), the same on every rank of ``axis``; the rest as in
    :func:`causal_lm_loss`, with the same targets check (:class:`~fastdist.errors.TargetError`),
    the same ``label_smoothing`` and the same dtypes: float64 logits stay float64,
    float16/bfloat16 compute in float32. No collective: every rank computes the same loss.

    >>> import torch, torch.nn.functional as F, fastdist as fd
    >>> from fastdist.nn.loss import gathered_causal_lm_loss
    >>> mesh = fd.Mesh({"tp": 2})
    >>> full = torch.randn(1, 4, 6, dtype=torch.float64)
    >>> labels = torch.tensor([[1, 4, -100, 2]])
    >>> fn = lambda lg: gathered_causal_lm_loss(lg, labels, mesh, "tp")
    >>> loss = fd.simulate(fn, mesh)(full.expand(2, 1, 4, 6))
    >>> ref = F.cross_entropy(full[0, :-1], labels[0, 1:])  # position t predicts label t + 1
    >>> loss.dtype, bool(torch.allclose(loss, ref.expand(2), rtol=1e-15, atol=0))
    (torch.float64, True)
    """
    op = "causal_lm_loss"
    _refuse_cross_entropy_kwargs(op, axis, kwargs)
    eps = _checked_smoothing(op, axis, label_smoothing)
    target = _shifted_labels(logits, labels, shift_labels, axis, ignore_index)
    if not isinstance(logits, Tensor) or logits.dim() == 0 or not logits.is_floating_point():
        raise CollectiveError(
            op,
            axis,
            f"logits must be a floating tensor (..., V), got {type(logits).__name__} "
            f"{getattr(logits, 'dtype', '')}",
            "pass the gathered logits (the whole vocabulary as the last dim)",
        )
    n_cols = logits.shape[-1]
    vocab = n_cols if vocab_size is None else vocab_size
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 0 < vocab <= n_cols:
        raise CollectiveError(
            op,
            axis,
            f"vocab_size={vocab_size!r} must be an int in [1, {n_cols}] (the gathered logits "
            f"have {n_cols} columns)",
            "pass the real vocabulary size, at most the number of columns",
        )
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise CollectiveError(
            op,
            axis,
            f"labels have shape {tuple(target.shape)}, logits {tuple(logits.shape)}: labels "
            "must be logits.shape[:-1]",
            "pass one label per token",
        )
    target = checked_targets(op, target, mesh, axis, vocab, ignore_index)
    # low precision computes in float32
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    valid = None  # (V,) the real columns, when some are padding
    if vocab < n_cols:  # padding columns get no probability and no gradient
        valid = torch.arange(n_cols, device=x.device) < vocab
        x = x.masked_fill(~valid, float("-inf"))
    counted = target != ignore_index
    index = torch.where(counted, target, 0).unsqueeze(-1)  # (..., 1)
    picked = x.gather(-1, index).squeeze(-1)  # (...): the target's logit
    lse = torch.logsumexp(x, -1)
    if eps > 0:  # F.cross_entropy's label smoothing over the real columns
        loss = lse - (1 - eps) * picked - eps * _column_sum(x, valid) / vocab
    else:
        loss = lse - picked
    loss = torch.where(counted, loss, 0.0)
    return _reduce_tokens(loss, counted, num_items_in_batch)


class HFCausalLMLoss:
    """transformers' ``loss_function`` call, ``(logits, labels, vocab_size, **kwargs)`` by position
    or keyword, on vocabulary-parallel logits (`causal_lm_loss`) or, with ``gathered``, on logits
    gathered over ``axis`` (`gathered_causal_lm_loss`). ``parallelize`` sets it as a causal-LM
    model's ``loss_function``; a pipeline stage holding the head does too."""

    def __init__(self, mesh: Mesh, axis: str, gathered: bool = False) -> None:
        self.mesh, self.axis, self.gathered = mesh, axis, gathered

    def __call__(
        self, logits: Tensor, labels: Tensor, vocab_size: int | None = None, **kwargs: Any
    ) -> Tensor:
        # gathered logits (gather_output=True) hold the whole vocabulary: the same loss, no
        # collective (transformers' own would compute in float32)
        loss = gathered_causal_lm_loss if self.gathered else causal_lm_loss
        return loss(logits, labels, self.mesh, self.axis, vocab_size=vocab_size, **kwargs)
