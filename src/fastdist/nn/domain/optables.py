"""The functional guard's tables of torch ops (`fastdist.nn.domain.guard`), as data: for each
op, the dims it reduces, mixes, moves or contracts (``(x, args, kwargs) -> dims``), or why it is
refused outright inside a domain-parallel region. A new op is a new row here; the guard's
machinery reads the rows (`fastdist.nn.domain.guard`, `fastdist.nn.domain.layout`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fastdist.nn.domain.opdims import (
    ALL,
    all_but,
    arg_dims,
    both,
    cross_dims,
    diagonal_dims,
    fft_dims,
    fixed,
    flat_ints,
    loss_dims,
    max_dims,
    moved,
    named,
    norm_shape_dims,
    repeats_dims,
    sum_to_size_dims,
    swap,
)

REFUSED: dict[Any, str] = {
    F.scaled_dot_product_attention: "self-attention over spatial tokens mixes the whole domain",
    F.group_norm: "a functional group norm takes statistics over this rank's block only",
    F.batch_norm: "a functional batch norm takes statistics over this rank's block only",
    F.instance_norm: "a functional instance norm takes statistics over this rank's block only",
    F.unfold: "a functional unfold reads past this rank's block",
    F.fold: "a functional fold writes past this rank's block",
    F.grid_sample: "a grid sample reads the field at positions anywhere in the whole domain",
    F.multi_head_attention_forward: "attention over spatial tokens mixes the whole domain",
    torch.tensordot: "a tensordot contracts dims the guard does not follow (fix: torch.einsum, "
    "which the guard reads, over dims that are not split)",
    **{
        getattr(F, n): "a functional pooling reads past this rank's block"
        for n in (
            "max_unpool1d",
            "max_unpool2d",
            "max_unpool3d",
            "lp_pool1d",
            "lp_pool2d",
            "lp_pool3d",
            "fractional_max_pool2d",
            "fractional_max_pool3d",
        )
        if hasattr(F, n)
    },
    F.conv_tbc: "a functional convolution reads past this rank's block",
    **{
        f: "a functional convolution, pooling, norm or resampling reads past this rank's block "
        "or takes statistics over it"
        for f in named(
            torch,
            (
                "convolution",
                "cudnn_convolution",
                "miopen_convolution",
                "mkldnn_convolution",
                "max_pool1d",
                "max_pool2d",
                "max_pool3d",
                "max_pool1d_with_indices",
                "adaptive_max_pool1d",
                "adaptive_avg_pool1d",
                "avg_pool1d",
                "batch_norm",
                "group_norm",
                "instance_norm",
                "native_batch_norm",
                "native_group_norm",
                "grid_sampler",
                "grid_sampler_2d",
                "grid_sampler_3d",
                "embedding_bag",
            ),
        )
        + named(
            F,
            (
                "max_pool1d_with_indices",
                "max_pool2d_with_indices",
                "max_pool3d_with_indices",
                "adaptive_max_pool1d_with_indices",
                "adaptive_max_pool2d_with_indices",
                "adaptive_max_pool3d_with_indices",
                "fractional_max_pool2d_with_indices",
                "fractional_max_pool3d_with_indices",
            ),
        )
        + [
            f
            for n in dir(torch._C._nn)
            if n.startswith(
                (
                    "adaptive_",
                    "avg_pool",
                    "max_pool",
                    "max_unpool",
                    "fractional_",
                    "upsample_",
                    "slow_conv",
                    "thnn_conv",
                    "conv_depthwise",
                    "im2col",
                    "col2im",
                    "mkldnn_linear",
                )
            )
            for f in [getattr(torch._C._nn, n)]
        ]
    },
    F.bilinear: "a bilinear map contracts the last dims the guard does not follow",
    **{
        f: "a functional pooling or convolution reads past this rank's block"
        for f in (
            F.adaptive_avg_pool1d,
            F.adaptive_avg_pool2d,
            F.adaptive_avg_pool3d,
            F.adaptive_max_pool1d,
            F.adaptive_max_pool2d,
            F.adaptive_max_pool3d,
            F.avg_pool1d,
            F.avg_pool2d,
            F.avg_pool3d,
            F.max_pool1d,
            F.max_pool2d,
            F.max_pool3d,
            F.conv1d,
            F.conv2d,
            F.conv3d,
            F.conv_transpose1d,
            F.conv_transpose2d,
            F.conv_transpose3d,
        )  # fmt: skip
    },
}


_CLASS_LOSSES = ("cross_entropy", "nll_loss", "multi_margin_loss", "multilabel_margin_loss",
                 "multilabel_soft_margin_loss", "ctc_loss")  # fmt: skip
_ELEMENTWISE_LOSSES = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
                       "binary_cross_entropy", "binary_cross_entropy_with_logits",
                       "poisson_nll_loss", "gaussian_nll_loss", "soft_margin_loss",
                       "hinge_embedding_loss", "margin_ranking_loss")  # fmt: skip
_LOSSES: dict[Any, Any] = {
    **{getattr(F, n): loss_dims((1,)) for n in _CLASS_LOSSES if hasattr(F, n)},
    **{getattr(F, n): loss_dims(()) for n in _ELEMENTWISE_LOSSES if hasattr(F, n)},
    **{getattr(F, n): loss_dims((-1,)) for n in ("cosine_embedding_loss", "triplet_margin_loss",
                                                   "triplet_margin_with_distance_loss")
       if hasattr(F, n)},
}  # fmt: skip

#: torch.linalg's matrix functions (over the last two dims) and torch's own
_MATRIX = (
    {getattr(torch.linalg, n) for n in dir(torch.linalg)
     if callable(getattr(torch.linalg, n)) and not n.startswith("_") and n[0].islower()
     and n not in ("vector_norm", "norm", "matrix_norm", "vecdot", "cross", "diagonal")}
    | {f for n in ("svd", "det", "logdet", "slogdet", "inverse", "pinverse", "matrix_exp",
                   "matrix_power", "cholesky", "cholesky_inverse", "cholesky_solve", "qr",
                   "lu", "lu_solve", "triangular_solve", "geqrf", "orgqr", "ormqr", "trace",
                   "triu", "tril", "lstsq")
       for f in (getattr(torch, n, None), getattr(Tensor, n, None)) if f is not None}
)  # fmt: skip


#: reductions: over a split dim they reduce this rank's block as if it were the domain
#: (``{op: the dims it reduces}``; its output drops them, or keeps them with size 1)
REDUCTIONS: dict[Any, Any] = {
    **both(
        (
            "mean",
            "sum",
            "nansum",
            "nanmean",
            "amax",
            "amin",
            "var",
            "std",
            "var_mean",
            "std_mean",
            "prod",
            "logsumexp",
            "argmax",
            "argmin",
            "median",
            "nanmedian",
            "count_nonzero",
            "softmax",
            "log_softmax",
        ),
        arg_dims("dim", 0, ALL),
    ),  # fmt: skip
    **both(("max", "min"), max_dims),
    **both(("aminmax",), arg_dims("dim", -1, ALL)),
    **both(("norm",), arg_dims("dim", 1, ALL)),
    **both(("quantile", "nanquantile"), arg_dims("dim", 1, ALL)),
    **both(("topk", "kthvalue"), arg_dims("dim", 1, (-1,))),
    **both(("mode",), arg_dims("dim", 0, (-1,))),
    torch.linalg.vector_norm: arg_dims("dim", 1, ALL),
    torch.linalg.norm: arg_dims("dim", 1, ALL),
    torch.linalg.matrix_norm: arg_dims("dim", 1, (-2, -1)),
    F.softmax: arg_dims("dim", 0, ALL),
    F.log_softmax: arg_dims("dim", 0, ALL),
    F.softmin: arg_dims("dim", 0, ALL),
    F.normalize: arg_dims("dim", 1, (1,)),
    F.layer_norm: norm_shape_dims,
    **({F.rms_norm: norm_shape_dims} if hasattr(F, "rms_norm") else {}),
    **both(("all", "any"), arg_dims("dim", 0, ALL)),
    **both(
        ("allclose", "equal", "dist", "histc", "histogram", "bincount", "cov", "corrcoef"),
        fixed(ALL),
    ),  # fmt: skip
    **both(("renorm",), all_but(1)),
    **both(("trapezoid", "trapz"), arg_dims("dim", -1, (-1,))),
    torch.linalg.vecdot: arg_dims("dim", -1, (-1,)),
    F.cosine_similarity: arg_dims("dim", 1, (1,)),
    F.pairwise_distance: fixed((-1,)),
    Tensor.sum_to_size: sum_to_size_dims,
    **{f: norm_shape_dims for f in named(torch, ("layer_norm", "native_layer_norm", "rms_norm"))},
    **{
        f: arg_dims("dim", 0, ALL)
        for f in named(torch.special, ("softmax", "log_softmax", "logsumexp"))
    },
    F.gumbel_softmax: arg_dims("dim", -1, (-1,)),
    **{
        f: fixed(ALL)
        for f in named(
            torch,
            (
                "nuclear_norm",
                "frobenius_norm",
                "native_norm",
                "norm_except_dim",
                "segment_reduce",
                "histogramdd",
                "pdist",
                "masked_select",
                "binary_cross_entropy_with_logits",
                "kl_div",
                "cosine_embedding_loss",
                "ctc_loss",
                "hinge_embedding_loss",
                "margin_ranking_loss",
                "poisson_nll_loss",
                "triplet_margin_loss",
            ),
        )
        + named(Tensor, ("masked_select", "tolist", "numpy", "__array__", "__contains__"))
        + [F.pdist]
        + [
            getattr(torch._C._nn, n)
            for n in dir(torch._C._nn)
            if n.endswith(("_loss", "loss2d", "loss_nd", "binary_cross_entropy"))
        ]
    },
    Tensor.renorm_: all_but(1),
    **_LOSSES,
}

#: ops that mix values along their dims (each output row reads every input row, or another
#: row): over a split dim they act on this rank's block as if it were the whole domain
MIXING: dict[Any, Any] = {
    **{getattr(torch.fft, n): fft_dims((-1,), 1) for n in ("fft", "ifft", "rfft", "irfft")},
    **{getattr(torch.fft, n): fft_dims((-1,), 1) for n in ("hfft", "ihfft")},
    **{getattr(torch.fft, n): fft_dims((-2, -1), 1) for n in ("fft2", "ifft2", "rfft2")},
    **{getattr(torch.fft, n): fft_dims((-2, -1), 1) for n in ("irfft2", "hfft2", "ihfft2")},
    **{getattr(torch.fft, n): fft_dims(None, 1) for n in ("fftn", "ifftn", "rfftn", "irfftn")},
    **{getattr(torch.fft, n): fft_dims(None, 1) for n in ("hfftn", "ihfftn")},
    **{getattr(torch.fft, n): fft_dims(None, 0) for n in ("fftshift", "ifftshift")},
    **both(("roll",), arg_dims("dims", 1, ALL)),
    **both(("flip",), arg_dims("dims", 0, ALL)),
    **both(("rot90",), arg_dims("dims", 1, (0, 1))),
    **both(("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"), arg_dims("dim", 0, ALL)),
    **both(("sort", "argsort"), arg_dims("dim", 0, (-1,))),
    **both(("diff",), arg_dims("dim", 1, (-1,))),
    **both(("split", "chunk", "tensor_split"), arg_dims("dim", 1, (0,))),
    **both(("unbind",), arg_dims("dim", 0, (0,))),
    torch.gradient: arg_dims("dim", -1, ALL),
    # indexing along a dim: this rank's rows at the block's own positions
    **both(
        (
            "gather",
            "index_select",
            "scatter",
            "scatter_add",
            "scatter_reduce",
            "index_add",
            "index_copy",
            "index_fill",
            "index_reduce",
            "scatter_",
            "scatter_add_",
            "scatter_reduce_",
            "index_add_",
            "index_copy_",
            "index_fill_",
            "index_reduce_",
            "narrow",
            "narrow_copy",
            "select",
            "select_scatter",
            "slice_scatter",
        ),
        arg_dims("dim", 0, (0,)),
    ),  # fmt: skip
    **both(("take_along_dim",), arg_dims("dim", 1, ALL)),
    **both(
        (
            "take",
            "put",
            "put_",
            "index_put",
            "index_put_",
            "masked_scatter",
            "masked_scatter_",
            "as_strided",
            "kron",
            "stft",
            "istft",
            "unique_consecutive",
            "msort",
        ),
        fixed(ALL),
    ),  # fmt: skip
    **both(("cumulative_trapezoid",), arg_dims("dim", -1, (-1,))),
    **both(("diagonal", "diag_embed"), diagonal_dims),
    **both(("fliplr",), fixed((1,))),
    **both(("flipud",), fixed((0,))),
    **both(("cross",), cross_dims),
    torch.linalg.cross: arg_dims("dim", 1, (-1,)),
    F.glu: arg_dims("dim", 0, (-1,)),
    **({torch._C._nn.glu: arg_dims("dim", 0, (-1,))} if hasattr(torch._C._nn, "glu") else {}),
    **both(("cumsum_", "cumprod_"), arg_dims("dim", 0, ALL)),
    **both(("tril_", "triu_"), fixed((-2, -1))),
    **both(
        (
            "fill_diagonal_",
            "diag",
            "diagflat",
            "diagonal_scatter",
            "as_strided_",
            "as_strided_copy",
            "as_strided_scatter",
            "permute_copy",
            "transpose_copy",
            "t_copy",
            "view_copy",
            "squeeze_copy",
            "unsqueeze_copy",
            "expand_copy",
            "unfold_copy",
            "unbind_copy",
            "lu_unpack",
            "lobpcg",
            "pca_lowrank",
            "svd_lowrank",
            "matrix_rank",
            "solve",
            "symeig",
            "eig",
            "block_diag",
            "slice_inverse",
        ),
        fixed(ALL),
    ),  # fmt: skip
    **both(("diagonal_copy",), diagonal_dims),
    **both(
        (
            "split_with_sizes",
            "unsafe_split",
            "unsafe_split_with_sizes",
            "unsafe_chunk",
            "split_copy",
            "split_with_sizes_copy",
            "select_copy",
            "slice_copy",
        ),
        arg_dims("dim", 1, (0,)),
    ),  # fmt: skip
    **both(("hsplit",), fixed((1,))),
    **both(("vsplit",), fixed((0,))),
    **both(("dsplit",), fixed((2,))),
    **both(("repeat_interleave",), repeats_dims),
    # over the channels: pixel (un)shuffles move rows of the last two dims into dim -3 (exact
    # on a block of whole pixel groups), a local response norm and a channel shuffle mix dim 1
    **{f: fixed((-3,)) for f in named(torch, ("pixel_shuffle", "pixel_unshuffle"))},
    **{
        f: fixed((1,))
        for f in named(torch, ("channel_shuffle", "native_channel_shuffle"))
        + named(F, ("channel_shuffle", "native_channel_shuffle", "local_response_norm"))
    },
    Tensor.__iter__: fixed((0,)),
    Tensor.__reversed__: fixed((0,)),
    torch.cdist: fixed((-2, -1)),
    torch.searchsorted: fixed((-1,)),
    **{f: fixed((-2, -1)) for f in _MATRIX},
}

#: ops whose every tensor argument is checked against the op's dims (not the first alone): two
#: operands read along those dims, or an index and the tensor it indexes
EVERY_INPUT = {
    torch.cdist, F.cosine_similarity, F.pairwise_distance, torch.dist, torch.kron,
    torch.linalg.vecdot, *_LOSSES,
    *both(("gather", "scatter", "scatter_add", "scatter_reduce", "take_along_dim", "scatter_",
           "scatter_add_", "scatter_reduce_", "index_add", "index_add_", "index_copy",
           "index_copy_", "index_reduce", "index_reduce_"), None),
}  # fmt: skip

#: ops whose tensor arguments must hold the split dims alike (an index tensor and the tensor
#: it indexes: a rank's index rows read its own block's rows)
ALIKE = {*both(("gather", "scatter", "scatter_add", "scatter_reduce", "take_along_dim",
                "scatter_", "scatter_add_", "scatter_reduce_"), None)}  # fmt: skip

#: ops that move dims: ``{op: (x, args, kwargs) -> the input dim at each output dim}``
PERMUTE = {
    **both(("permute",), lambda x, a, k: flat_ints(a or k.get("dims"))),
    **both(
        ("transpose", "swapaxes", "swapdims"),
        lambda x, a, k: swap(x.dim(), *(a[:2] or (k["dim0"], k["dim1"]))),
    ),
    **both(
        ("movedim", "moveaxis"),
        lambda x, a, k: moved(x.dim(), *(a[:2] or (k["source"], k["destination"]))),
    ),
    Tensor.t: lambda x, a, k: swap(x.dim(), 0, 1) if x.dim() == 2 else list(range(x.dim())),
    Tensor.T.__get__: lambda x, a, k: list(reversed(range(x.dim()))),  # type: ignore[attr-defined]
    Tensor.mT.__get__: lambda x, a, k: swap(x.dim(), -2, -1),  # type: ignore[attr-defined]
    Tensor.mH.__get__: lambda x, a, k: swap(x.dim(), -2, -1),  # type: ignore[attr-defined]
}

#: ops that reshape (the dims follow from the input's and the output's shapes)
RESHAPE = {
    *both(("reshape", "flatten", "unflatten", "squeeze", "unsqueeze"), None),
    Tensor.view,
    Tensor.view_as,
    Tensor.reshape_as,
}

#: in-place ops that move dims: refused on a tensor that holds split dims
MOVE_IN_PLACE = {
    getattr(Tensor, n)
    for n in ("transpose_", "t_", "swapaxes_", "swapdims_", "squeeze_", "unsqueeze_", "resize_")
    if hasattr(Tensor, n)
}

PAD = {F.pad, torch.constant_pad_nd} | {
    getattr(torch._C._nn, n)
    for n in ("pad", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d",
              "replication_pad1d", "replication_pad2d", "replication_pad3d")
    if hasattr(torch._C._nn, n)
}  # fmt: skip


#: concatenations (a sequence of tensors first): along a split dim each rank would join blocks
CAT = {
    f for f in (torch.cat, getattr(torch, "concat", None), getattr(torch, "concatenate", None)) if f
}

#: repetitions of the whole tensor: along a split dim each rank would repeat its block
REPEAT = {Tensor.repeat, Tensor.tile, torch.tile}

#: calls that only read a tensor's metadata or make a new one from its dtype and device
#: (nothing to follow)
META = {Tensor.dim, Tensor.size, Tensor.numel, Tensor.stride, Tensor.__len__} | {
    getattr(Tensor, f"new_{n}") for n in ("zeros", "ones", "empty", "full", "tensor")
}


#: ops whose first tensor contracts its last dim (and a second tensor its dim -2)
CONTRACT = {
    F.linear, torch.matmul, Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__, torch.bmm,
    Tensor.bmm, torch.mm, Tensor.mm,
}  # fmt: skip

#: ``addmm``-style ops: a bias, then two tensors whose first contracts its last dim and second
#: its dim -2
CONTRACT_AFTER_BIAS = {
    f for n in ("addmm", "addmv", "addbmm", "baddbmm", "addmm_", "addmv_", "addbmm_", "baddbmm_")
    for f in (getattr(torch, n, None), getattr(Tensor, n, None)) if f is not None
} | {torch.inner, Tensor.inner, torch.mv, Tensor.mv, torch.chain_matmul, torch.linalg.multi_dot,
     torch.linalg.matmul}  # fmt: skip

#: stacks: a sequence of tensors joined along a new dim (``dim``)
STACK = {torch.stack}

#: stacks along an existing dim (``{op: the dim}``, as a ``cat``); ``None``: refused
STACK_ALONG = {torch.hstack: 1, torch.vstack: 0, torch.row_stack: 0, torch.dstack: 2,
               torch.column_stack: None}  # fmt: skip

#: ops over several tensors the guard reads itself (checked, or followed)
JOINS = CAT | STACK | set(STACK_ALONG) | {torch.einsum}

#: ops whose other tensor arguments give only a dtype and a device (the output is the first's)
FIRST_ONLY = {Tensor.to, Tensor.type_as}

#: ops that resize their output to a size the model gives (maybe the block's, from ``h.shape``)
RESIZE = {
    F.interpolate, *named(F, ("adaptive_avg_pool1d", "adaptive_avg_pool2d",
    "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d")),
}  # fmt: skip

#: ops that size their output: resizes, and broadcasts or repetitions (constant along new rows)
SIZED = RESIZE | {Tensor.expand, Tensor.broadcast_to, torch.broadcast_to, Tensor.repeat,
                  Tensor.tile, torch.tile}  # fmt: skip

#: ops that drop their ``dim`` (each output one row of it): ``unbind``
UNBIND = {torch.unbind, Tensor.unbind}

#: ops whose output is the input with new leading dims (broadcast to a larger shape)
LEADING = {Tensor.expand, Tensor.expand_as, Tensor.broadcast_to, torch.broadcast_to}

#: reductions and mixing ops the guard checked before it followed moved dims: checked inside a
#: known attention module too (the others only outside one)
ALWAYS = {
    f
    for name in ("mean", "sum", "amax", "amin", "var", "std", "logsumexp", "prod", "nansum",
                 "roll", "flip", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp",
                 "sort", "argsort")
    for f in (getattr(torch, name), getattr(Tensor, name))
} | {f for f in MIXING if getattr(f, "__module__", "").startswith("torch.fft")}  # fmt: skip

#: the kinds of layer (`fastdist.nn.domain.layers.classify`) that take statistics over, or
#: attend across, the split dims: a split dim folded into the batch is refused there
WHOLE_DOMAIN = ("group_norm", "instance_norm", "batch_norm", "adaptive", "attention")

#: ops that fold ``r x r`` pixel groups of the last two dims into the channels
#: (``F.pixel_unshuffle``, which ``nn.PixelUnshuffle`` calls): exact on a rank's block only where
#: every rank's block along a split dim among them divides by ``r`` (checked at the call)
UNSHUFFLE = {f: "downscale_factor" for f in named(torch, ("pixel_unshuffle",))}

#: channel dropouts (``p`` the second argument, the training flag the third, its keyword): one
#: device drops a channel over the whole domain; each rank draws its own mask for its block
CHANNEL_DROPOUT = {
    **{f: "training" for f in named(F, ("dropout1d", "dropout2d", "dropout3d"))},
    F.feature_alpha_dropout: "training",
    **{f: "train" for f in named(torch, ("feature_dropout", "feature_alpha_dropout"))},
}
