"""The functional guard's tables of torch ops (`fastdist.nn.domain.guard`), as data: for each
op, the dims it reduces, mixes, moves or contracts (``(x, args, kwargs) -> dims``), or why it is
refused outright inside a domain-parallel region. A new op is a new row here; the guard's
machinery reads the rows (`fastdist.nn.domain.guard`, `fastdist.nn.domain.layout`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

REFUSED: dict[Any, str] = {
    F.scaled_dot_product_attention: "self-attention over spatial tokens mixes the whole domain",
    F.group_norm: "a functional group norm takes statistics over this rank's block only",
    F.batch_norm: "a functional batch norm takes statistics over this rank's block only",
    F.instance_norm: "a functional instance norm takes statistics over this rank's block only",
    F.unfold: "a functional unfold reads past this rank's block",
    F.fold: "a functional fold writes past this rank's block",
    F.grid_sample: "a grid sample reads the field at positions anywhere in the whole domain",
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

#: ``None``: an op over every dim
ALL = None


def as_dims(v: Any) -> list[int] | None:
    """``v`` as a list of dims, or ``None`` when it names none (``None``, a dtype, a bool)."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int):
        return [v]
    if isinstance(v, (tuple, list)) and all(isinstance(i, int) for i in v):
        return [int(i) for i in v]
    return None


def arg_dims(name: str, at: int, default: Sequence[int] | None) -> Any:
    """The dims of an op that takes them as ``name`` (keyword, or the ``at``-th positional
    after the input; ``at < 0``: keyword only), else ``default`` (``None``: every dim)."""

    def dims(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        v = kwargs.get(name, args[at] if 0 <= at < len(args) else None)
        got = as_dims(v)
        return (range(x.dim()) if default is None else default) if got is None else got

    return dims


def max_dims(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``max`` / ``min``: over ``dim``, every dim without one; the binary ``max(x, y)``
    (elementwise) over none."""
    if (args and isinstance(args[0], Tensor)) or "other" in kwargs:
        return []
    return arg_dims("dim", 0, ALL)(x, args, kwargs)


def norm_shape_dims(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.layer_norm`` / ``F.rms_norm``: the last ``len(normalized_shape)`` dims."""
    shape = kwargs.get("normalized_shape", args[0] if args else ())
    n = 1 if isinstance(shape, int) else len(shape)
    return range(x.dim() - n, x.dim())


def fft_dims(default: tuple[int, ...] | None, at: int) -> Any:
    """The dims an FFT call transforms: its ``dim`` (keyword or the ``at``-th positional after
    the input), else the last ``len(s)`` dims when ``s`` is given, else ``default`` (``None``:
    every dim)."""

    def dims(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        dim = kwargs.get("dim", args[at] if len(args) > at else None)
        if dim is not None:
            return dim
        s = kwargs.get("s", args[0] if args and at == 1 else None)
        if s is not None and default is None:
            return tuple(range(-len(s), 0))
        return range(x.dim()) if default is None else default

    return dims


def both(names: Sequence[str], dims: Any, module: Any = torch) -> dict[Any, Any]:
    """``{torch.name and Tensor.name: dims}`` for each name (those that exist)."""
    out = {}
    for name in names:
        for owner in (module, Tensor):
            f = getattr(owner, name, None)
            if f is not None:
                out[f] = dims
    return out


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
}

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

PAD = {F.pad, torch.constant_pad_nd}

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


def flat_ints(v: Any) -> list[int]:
    if len(v) == 1 and isinstance(v[0], (tuple, list)):
        v = v[0]
    return [int(i) for i in v]


def swap(n: int, a: int, b: int) -> list[int]:
    order = list(range(n))
    order[a % n], order[b % n] = order[b % n], order[a % n]
    return order


def moved(n: int, src: Any, dst: Any) -> list[int]:
    src = [s % n for s in ([src] if isinstance(src, int) else src)]
    dst = [d % n for d in ([dst] if isinstance(dst, int) else dst)]
    rest = iter(i for i in range(n) if i not in src)
    placed = dict(zip(dst, src, strict=True))
    return [placed[j] if j in placed else next(rest) for j in range(n)]


#: ops whose first tensor contracts its last dim (and a second tensor its dim -2)
CONTRACT = {
    F.linear, torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm, Tensor.bmm, torch.mm,
    Tensor.mm,
}  # fmt: skip

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


def op_name(func: Any) -> str:
    """``func`` as the model's code spells it (``torch.max``, ``Tensor.max``, ``F.pad``)."""
    qual = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
    name = qual.split(".")[-1]
    if qual.startswith(("TensorBase.", "Tensor.")):
        return f"Tensor.{name}"
    if qual.startswith("_VariableFunctionsClass."):
        return f"torch.{name}"
    if getattr(func, "__module__", "") == "torch.nn.functional":
        return f"F.{name}"
    return qual.replace(".__get__", "")
