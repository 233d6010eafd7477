"""Which modules of a conv net a domain-parallel region can hold, and how each runs on a rank's
block: `classify` sorts a module (a windowed layer, a whole-domain norm, a token-local module,
a container, or one refused with the reason and the fix) and `domain_forward` is the ``forward``
the style puts in a layer's place (the module object, its parameters and its class stay);
`Recompute` re-enters the region where activation checkpointing recomputes a module of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from fastdist.core.mesh import Mesh
from fastdist.errors import CollectiveError, ParallelizeError
from fastdist.nn.domain.adaptive import domain_adaptive_pool
from fastdist.nn.domain.attention import (
    current_attention,
    flat_split,
    is_spatial_attention,
    run_attention,
)
from fastdist.nn.domain.conv import conv_padding
from fastdist.nn.domain.norms import domain_batch_norm, domain_group_norm
from fastdist.nn.domain.windows import (
    UPSAMPLE_HALO,
    Split,
    domain_conv,
    domain_conv_transpose,
    domain_pool,
    domain_upsample,
    outside_region,
    region,
    rows_seen,
)

__all__ = [
    "DOWNSAMPLE_PADS",
    "Recompute",
    "check_converted",
    "saved_hooks_top",
    "folded_pads",
    "Site",
    "classify",
    "domain_forward",
    "inside_layer",
    "is_diffusers_downsample",
    "layer_depth",
]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONVTS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_POOLS = {
    nn.MaxPool1d: ("max", 1), nn.MaxPool2d: ("max", 2), nn.MaxPool3d: ("max", 3),
    nn.AvgPool1d: ("avg", 1), nn.AvgPool2d: ("avg", 2), nn.AvgPool3d: ("avg", 3),
}  # fmt: skip
_ADAPTIVE = (
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)  # fmt: skip
_INSTANCE = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
#: modules that act on each position alone (elementwise, or over channels only)
_LOCAL = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.SiLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU,
    nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.PReLU, nn.SELU,
    nn.CELU, nn.GLU, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
    nn.PixelShuffle, nn.PixelUnshuffle, nn.ChannelShuffle,
)  # fmt: skip

#: token-local classes of other libraries, by module and name (that exact class: a subclass may
#: override ``forward``), each read in that library's source: ``{class: check of the instance}``.
#: physicsnemo's activations: ``Identity`` returns its input, ``Sin`` is ``torch.sin``,
#: ``SquarePlus`` is ``0.5 * (x + sqrt(x * x + b))`` with a number ``b``. Not its ``Stan``: a
#: learned ``beta`` per feature broadcast over the last dim (a spatial dim of a field).
_KNOWN_LOCAL: dict[str, Callable[[nn.Module], bool]] = {
    f"{package}.{name}": check
    for package in ("physicsnemo.nn.module.activations", "physicsnemo.models.layers.activations")
    for name, check in (
        ("Identity", lambda m: True),
        ("Sin", lambda m: True),
        ("SquarePlus", lambda m: type(getattr(m, "b", None)) in (int, float)),
    )
}


#: other libraries' ``nn.LayerNorm`` subclasses whose forward is a layer norm over the channels
#: (dim 1) of each position, written as a reshape of the field (physicsnemo's UNet's
#: ``ReshapedLayerNorm``: ``view(B, C, -1).transpose(1, 2)``, the norm, and back, which merges
#: the split dims): the style runs the same norm on the channels without the reshape
_CHANNEL_LAYER_NORMS = frozenset({"physicsnemo.models.unet.unet.ReshapedLayerNorm"})


#: other libraries' modules named like an attention that are containers of the style's layers
#: with an elementwise forward (physicsnemo's UNet attention gate ``Attention3DBlock``: 1 x 1 x 1
#: convolutions, its ``ReshapedLayerNorm``, a sigmoid, ``x * psi``), by exact class
_KNOWN_CONTAINERS = frozenset({"physicsnemo.models.unet.unet.Attention3DBlock"})


def _exact_class(m: nn.Module) -> str:
    """``m``'s class by module and name (the key of the other libraries' tables above: that
    exact class, not a subclass)."""
    t = type(m)
    return f"{t.__module__}.{t.__qualname__}"


def is_channel_layer_norm(m: nn.Module) -> bool:
    """Whether ``m`` is exactly one of `_CHANNEL_LAYER_NORMS`, over one channel dim."""
    return (
        _exact_class(m) in _CHANNEL_LAYER_NORMS
        and isinstance(m, nn.LayerNorm)
        and len(m.normalized_shape) == 1
    )


def known_local(m: nn.Module) -> bool:
    """Whether ``m`` is an instance of exactly one of the other libraries' token-local classes
    the style knows (``_KNOWN_LOCAL``), with no parameters, buffers or children of its own."""
    check = _KNOWN_LOCAL.get(_exact_class(m))
    bare = not any(True for _ in m.parameters()) and not any(True for _ in m.buffers())
    return check is not None and bare and not list(m.children()) and check(m)


def layer_depth() -> int:
    """How many domain layers are running now (0: model code between them)."""
    return region().layers


@contextmanager
def inside_layer() -> Iterator[None]:
    """Inside a domain layer: its functional calls are its own, not the model's."""
    state = region()
    state.layers += 1
    try:
        yield
    finally:
        state.layers -= 1


@dataclass(frozen=True)
class Site:
    """Where a layer runs: the mesh, the split, and its name for messages."""

    mesh: Mesh
    split: Split
    where: str
    #: a convolution's padding in place of its own, one (before, after) per spatial dim
    pads: tuple[tuple[int, int], ...] | None = None
    #: the axes a BatchNorm's statistics span besides the split ones (``None``: not said)
    batch_axes: tuple[str, ...] | None = None
    #: how a spatial attention sees the other ranks' keys: ``"gather"`` or ``"ring"``
    attention: str = "gather"


def _is_causal_conv(m: nn.Module) -> bool:
    """diffusers' causal convolutions (``WanCausalConv3d``): a ``Conv3d`` subclass that pads by
    hand with ``_padding`` (``F.pad`` order) before a ``padding=0`` convolution, and takes an
    optional ``cache_x`` of earlier frames."""
    pad = getattr(m, "_padding", None)
    return isinstance(m, nn.Conv3d) and isinstance(pad, (tuple, list)) and len(pad) == 6


#: ``F.pad`` modes a pad-then-convolve module may use, as the convolution's padding mode
_PAD_MODES = {
    "constant": "zeros",
    "replicate": "replicate",
    "reflect": "reflect",
    "circular": "circular",
}


def _is_pad_then_conv(m: nn.Module) -> bool:
    """diffusers' ``HunyuanVideoCausalConv3d``: ``F.pad(x, time_causal_padding, mode=pad_mode)``
    (replicate on H and W, causal on T) before its ``padding=0`` ``Conv3d`` child ``conv``; the
    style runs the padding as the convolution's halo (its forward is replaced whole)."""
    pad, conv = getattr(m, "time_causal_padding", None), getattr(m, "conv", None)
    return (
        isinstance(pad, (tuple, list))
        and len(pad) == 6
        and type(conv) is nn.Conv3d
        and conv.padding_mode == "zeros"
        and tuple(conv.padding) == (0, 0, 0)
        and getattr(m, "pad_mode", None) in _PAD_MODES
        and [n for n, _ in m.named_children()] == ["conv"]
    )


def is_diffusers_downsample(m: nn.Module) -> bool:
    """diffusers' ``Downsample2D`` with ``padding=0``: it pads ``(0, 1)`` on H and W by hand
    (``F.pad``) before its stride-2 convolution; the style folds that padding into the
    convolution (its ``conv`` child gets ``Site.pads``) and runs the rest of its forward."""
    return (
        type(m).__name__ == "Downsample2D"
        and getattr(m, "use_conv", False) is True
        and getattr(m, "padding", None) == 0
        and isinstance(getattr(m, "conv", None), nn.Conv2d)
    )


#: the padding of a diffusers ``Downsample2D``'s convolution: (0, 1) on H and W
DOWNSAMPLE_PADS = ((0, 1), (0, 1))


def _is_zero_pad(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.padding._ConstantPadNd) and float(m.value) == 0.0


def folded_pads(
    module: nn.Module,
) -> tuple[dict[int, tuple[tuple[int, int], ...]], list[tuple[str, nn.Module]]]:
    """Zero paddings (``nn.ZeroPad2d``, ``nn.ConstantPad*d(value=0)``) folded into the
    convolution that follows them in an ``nn.Sequential`` (Wan's downsampling
    ``Sequential(ZeroPad2d((0, 1, 0, 1)), Conv2d(stride=2))``): ``{id(conv): (before, after) per
    spatial dim}``, and the ``(name, module)`` of every zero padding with no such convolution."""
    folds: dict[int, tuple[tuple[int, int], ...]] = {}
    alone: list[tuple[str, nn.Module]] = []
    for name, seq in module.named_modules():
        kids = list(seq.named_children())
        for j, (kid_name, kid) in enumerate(kids):
            if not _is_zero_pad(kid):
                continue
            nxt = kids[j + 1][1] if isinstance(seq, nn.Sequential) and j + 1 < len(kids) else None
            pad: Any = kid
            nsp = len(pad.padding) // 2
            if type(nxt) not in _CONVS or len(getattr(nxt, "kernel_size", ())) != nsp:
                alone.append((".".join(p for p in (name, kid_name) if p), kid))
                continue
            conv: Any = nxt
            if conv.padding_mode != "zeros":
                alone.append((".".join(p for p in (name, kid_name) if p), kid))
                continue
            own = conv_padding(conv, nsp)
            flat = list(pad.padding)  # F.pad order: the last dim first
            folds[id(conv)] = tuple(
                (own[i][0] + flat[2 * (nsp - 1 - i)], own[i][1] + flat[2 * (nsp - 1 - i) + 1])
                for i in range(nsp)
            )
    return folds, alone


def classify(m: nn.Module, local: tuple[type, ...]) -> tuple[str, str | None]:
    """``(kind, None)`` for a module the style runs (``kind``: the forward it gets, or
    ``"local"`` / ``"container"`` / ``"linear"``), ``("", why and fix)`` for one it refuses."""
    t = type(m)
    name = t.__name__
    if is_diffusers_downsample(m):
        return "downsample2d", None
    if is_spatial_attention(m):
        return "attention", None
    if _exact_class(m) in _KNOWN_CONTAINERS:
        return "container", None
    if isinstance(m, local):  # declared by the user: before the refusal by name (an attention
        return "local", None  # gate local to each pixel); the guard still checks its own code
    if "Attention" in name or isinstance(m, nn.MultiheadAttention):
        return "", (
            "an attention module the domain-parallel style does not know (built: diffusers' "
            "Attention over a field [N, C, H, W], Wan's WanAttentionBlock). Fix: one of those, "
            "end the domain-parallel region before it, or, if it acts on each position alone "
            f"(a gate from 1x1 convolutions), DomainParallel(..., local=({name},))"
        )
    if _is_zero_pad(m):
        return "fold_pad", None  # folded into the next convolution (checked by folded_pads)
    if t in _CONVS:
        return "conv", None
    if _is_causal_conv(m):
        return "causal_conv", None
    if _is_pad_then_conv(m):
        return "pad_conv", None
    if isinstance(m, nn.modules.conv._ConvNd) and not isinstance(m, _CONVTS):
        return "", (
            f"a {name} (a convolution subclass whose forward may differ from the convolution). "
            "Fix: a plain torch.nn.Conv*d, or pass local=(...) if it is local to each pixel"
        )
    if t in _CONVTS:
        ok = m.padding_mode == "zeros"
        return ("conv_t", None) if ok else ("", "padding_mode != 'zeros' is not built")
    if t in _POOLS:
        p: Any = m
        if p.ceil_mode or getattr(p, "return_indices", False):
            return "", "ceil_mode=True or return_indices=True is not built. Fix: the defaults"
        return "pool", None
    if isinstance(m, _ADAPTIVE):
        if getattr(m, "return_indices", False):
            return "", "return_indices=True is not built. Fix: the default"
        return "adaptive", None
    if isinstance(m, nn.Upsample):
        kind, why = _upsample_check(m)
        # a subclass (Wan's WanUpsample casts to float32) runs its own forward: the functional
        # guard runs its F.interpolate domain-parallel
        return ("local" if why is None and t is not nn.Upsample else kind), why
    if t is nn.GroupNorm:
        return "group_norm", None
    if isinstance(m, _INSTANCE):
        if m.track_running_stats:
            return "", "track_running_stats=True is not built. Fix: track_running_stats=False"
        return "instance_norm", None
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        return "batch_norm", None
    if is_channel_layer_norm(m):
        return "channel_layer_norm", None
    if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
        if len(m.normalized_shape) != 1:
            return "", (
                f"normalized_shape={tuple(m.normalized_shape)}: a norm over several dims may "
                "span the split dims. Fix: normalize over channels only (a GroupNorm(1, C) "
                "normalizes over the whole domain)"
            )
        return "local", None
    if name.endswith(("RMSNorm", "RMS_norm")) and not list(m.children()):
        return "local", None  # diffusers' RMS norms: over channels
    if isinstance(m, _LOCAL) or known_local(m):
        return "local", None
    if isinstance(m, nn.Linear):
        return "linear", None
    if isinstance(m, (nn.Flatten, nn.Unflatten)):
        return "", (
            f"{name} flattens the field, and a layer after it (a Linear over the flattened "
            "field) mixes the whole domain. Fix: end the domain-parallel region before it "
            "(DomainParallel on the conv trunk, output='gather')"
        )
    if list(m.children()) or isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return "container", None
    return "", (
        f"{name} ({t.__module__}) is not known to the domain-parallel style (it knows torch.nn's "
        "token-local modules and physicsnemo's Identity, Sin and SquarePlus, by exact class). "
        f"Fix: if it acts on each position alone (elementwise, or over channels only), pass "
        f"DomainParallel(..., local=({name},))"
    )


def _upsample_check(m: nn.Upsample) -> tuple[str, str | None]:
    if m.size is not None:
        return "", "Upsample(size=...) is the whole domain's size. Fix: scale_factor="
    if m.align_corners:
        return "", "align_corners=True maps rows through the whole length. Fix: align_corners=False"
    if m.mode not in UPSAMPLE_HALO:
        return "", f"mode={m.mode!r} is not built. Fix: one of {sorted(UPSAMPLE_HALO)}"
    scale = m.scale_factor if isinstance(m.scale_factor, tuple) else (m.scale_factor,)
    if any(s is None or float(s) != int(s) for s in scale):
        return "", f"scale_factor={m.scale_factor}: only integer factors are built"
    return "upsample", None


def _ints(v: Any, n: int) -> tuple[int, ...]:
    return tuple(int(a) for a in v) if isinstance(v, (tuple, list)) else (int(v),) * n


def _conv(
    site: Site,
    m: Any,
    x: Tensor,
    *,
    pads: Sequence[tuple[int, int]] | None = None,
    mode: str | None = None,
) -> Tensor:
    """A convolution; ``pads`` / ``mode``: the padding of the module that calls it (a
    pad-then-convolve parent), in place of its own."""
    nsp = len(m.kernel_size)
    return domain_conv(
        x, m.weight, m.bias, stride=m.stride, dilation=m.dilation, groups=m.groups,
        pads=pads or site.pads or conv_padding(m, nsp), mode=mode or m.padding_mode,
        mesh=site.mesh, split=site.split, where=site.where,
    )  # fmt: skip


def _causal_conv(site: Site, m: Any, x: Tensor, cache_x: Tensor | None = None) -> Tensor:
    pad = list(m._padding)  # F.pad order: W, H, T pairs
    if cache_x is not None and pad[4] > 0:
        if any(d == -3 for d, _ in site.split):
            raise ParallelizeError(
                f"domain parallel: {site.where} got cache_x (earlier frames) with T split: "
                "the cache of a chunked decode belongs to the frames before the whole chunk. "
                "Fix: split H / W for a chunked (cached) decode, or decode without the cache"
            )
        x = torch.cat([cache_x.to(x.device), x], dim=2)
        pad[4] = max(pad[4] - cache_x.shape[2], 0)
    pads = [(pad[4], pad[5]), (pad[2], pad[3]), (pad[0], pad[1])]
    return domain_conv(
        x, m.weight, m.bias, stride=m.stride, dilation=m.dilation, groups=m.groups, pads=pads,
        mode=m.padding_mode, mesh=site.mesh, split=site.split, where=site.where,
    )  # fmt: skip


def _pad_conv(site: Site, m: Any, x: Tensor) -> Tensor:
    """``HunyuanVideoCausalConv3d.forward``: its ``F.pad`` as the convolution's padding."""
    pad = list(m.time_causal_padding)  # F.pad order: W, H, T pairs
    pads = [(pad[4], pad[5]), (pad[2], pad[3]), (pad[0], pad[1])]
    # through the child's call: its hooks (its parameters' pvary) run, its forward is `_conv`
    out: Tensor = m.conv(x, pads=pads, mode=_PAD_MODES[m.pad_mode])
    return out


def _conv_t(site: Site, m: Any, x: Tensor, output_size: Any = None) -> Tensor:
    if output_size is not None:
        raise ParallelizeError(
            f"domain parallel: {site.where} was called with output_size=, the whole domain's. "
            "Fix: call it without (the output_padding of the module decides)"
        )
    return domain_conv_transpose(
        x, m.weight, m.bias, stride=m.stride, padding=m.padding,
        output_padding=m.output_padding, dilation=m.dilation, groups=m.groups,
        mesh=site.mesh, split=site.split, where=site.where,
    )  # fmt: skip


def _pool(site: Site, m: Any, x: Tensor) -> Tensor:
    kind, nsp = _POOLS[type(m)]
    return domain_pool(
        x, kind, nsp, kernel=_ints(m.kernel_size, nsp), stride=_ints(m.stride, nsp),
        padding=_ints(m.padding, nsp), dilation=_ints(getattr(m, "dilation", 1), nsp),
        count_include_pad=getattr(m, "count_include_pad", True),
        divisor_override=getattr(m, "divisor_override", None), mesh=site.mesh,
        split=site.split, where=site.where,
    )  # fmt: skip


def _adaptive(site: Site, m: Any, x: Tensor) -> Tensor:
    kind = "max" if "Max" in type(m).__name__ else "avg"
    nsp = int(type(m).__name__[-2])  # AdaptiveAvgPool2d: 2
    size = m.output_size if isinstance(m.output_size, (tuple, list)) else (m.output_size,) * nsp
    return domain_adaptive_pool(
        x, kind, nsp, size, mesh=site.mesh, split=site.split, where=site.where
    )


def _upsample(site: Site, m: Any, x: Tensor) -> Tensor:
    scale = _ints(m.scale_factor, x.dim() - 2)
    return domain_upsample(x, scale, m.mode, mesh=site.mesh, split=site.split, where=site.where)


def _group_norm(site: Site, m: Any, x: Tensor) -> Tensor:
    split, call, mask = site.split, current_attention(), None
    if call is not None and x.dim() == 3:  # diffusers' Attention.group_norm: [N, C, H * W]
        split, mask = flat_split(call), call.valid
    return domain_group_norm(
        x, m.num_groups, m.weight, m.bias, m.eps, mesh=site.mesh, split=split, mask=mask,
        where=site.where,
    )  # fmt: skip


def _instance_norm(site: Site, m: Any, x: Tensor) -> Tensor:
    return domain_group_norm(
        x, x.shape[1], m.weight, m.bias, m.eps, mesh=site.mesh, split=site.split,
        where=site.where,
    )  # fmt: skip


def _batch_norm(site: Site, m: Any, x: Tensor) -> Tensor:
    return domain_batch_norm(
        x, m, m.weight, m.bias, mesh=site.mesh, split=site.split, where=site.where,
        batch_axes=site.batch_axes,
    )  # fmt: skip


def _downsample2d(site: Site, m: Any, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """diffusers' ``Downsample2D.forward`` without its ``F.pad`` (its convolution pads)."""
    if m.norm is not None:
        x = m.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # over channels
    y: Tensor = m.conv(x)
    return y


def _linear(site: Site, m: Any, x: Tensor) -> Tensor:
    if x.shape[-1] != m.in_features:
        raise ParallelizeError(
            f"domain parallel: {site.where} (in_features={m.in_features}) got an input whose "
            f"last dim is {x.shape[-1]}: a Linear over the split (or flattened) field mixes the "
            "whole domain. Fix: end the domain-parallel region before it"
        )
    return F.linear(x, m.weight, m.bias)


def _channel_layer_norm(site: Site, m: Any, x: Tensor) -> Tensor:
    """A layer norm over the channels (dim 1) of each position of ``x`` ``(B, C, *spatial)``."""
    y = F.layer_norm(x.movedim(1, -1), m.normalized_shape, m.weight, m.bias, m.eps)
    return y.movedim(-1, 1)


def _fold_pad(site: Site, m: Any, x: Tensor) -> Tensor:
    """A zero padding folded into the next convolution's halo: nothing here."""
    return x


_FORWARDS: dict[str, Callable[..., Tensor]] = {
    "fold_pad": _fold_pad,
    "conv": _conv,
    "causal_conv": _causal_conv,
    "pad_conv": _pad_conv,
    "channel_layer_norm": _channel_layer_norm,
    "conv_t": _conv_t,
    "pool": _pool,
    "upsample": _upsample,
    "adaptive": _adaptive,
    "group_norm": _group_norm,
    "instance_norm": _instance_norm,
    "batch_norm": _batch_norm,
    "linear": _linear,
    "downsample2d": _downsample2d,
}


#: the layers whose output rows along a split dim follow their input's by a window
_WINDOWS = frozenset({"conv", "causal_conv", "pad_conv", "conv_t", "pool", "upsample"})


def _run(kind: str, site: Site, m: nn.Module, *args: Any, **kwargs: Any) -> Tensor:
    if not region().depth:
        raise outside_region(site.where)
    try:
        with inside_layer():
            y = _FORWARDS[kind](site, m, *args, **kwargs)
    except CollectiveError as e:  # a block too narrow for the halo: name the layer
        raise ParallelizeError(f"domain parallel: {site.where}: {e}") from e
    if kind in _WINDOWS and args and isinstance(args[0], Tensor) and isinstance(y, Tensor):
        rows_seen(args[0].shape, y, y.dim() - 2, site.split, site.where)
    return y


def domain_forward(kind: str, site: Site, m: nn.Module) -> Callable[..., Tensor] | None:
    """The ``forward`` of a layer of ``kind`` on a rank's block (``None``: its own forward runs,
    for token-local modules and containers)."""
    if kind == "attention":  # its own forward, its sdpa given the whole domain's keys
        ring = site.attention == "ring"
        return functools.partial(run_attention, site.mesh, site.split, site.where, ring, m.forward)
    if kind not in _FORWARDS:
        return None
    return functools.partial(_run, kind, site, m)


# ============================================================== activation checkpointing
# Activation checkpointing inside a domain-parallel region (real ranks): a module that
# ``torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False)`` recomputes in the backward
# runs inside its region again, with the region's state of its own forward.
#
# A non-reentrant checkpoint recomputes its function in the backward with the same input tensors.
# Where a module of the region starts under a checkpoint that its enclosing module did not (the
# top of autograd's saved-tensor hooks changed between them: the module is the checkpoint's
# function, or its first module), `Recompute` records the region's state then (the pooled axes,
# the uneven blocks, the attention running) on its input tensors (weakly). When that module runs
# again in the backward outside any region, its forward pre-hook finds the record on its inputs and
# re-enters the region (depth, the functional guard, the state) until its forward returns.
#
# Refused with the reason: a module recomputed in the backward whose inputs carry no record (a
# reentrant checkpoint detaches its inputs; a checkpointed function whose first module gets a
# tensor the function computed), and, at the forward, an ``F.interpolate`` or attention that the
# functional guard runs domain-parallel inside a checkpointed function but outside its modules
# (the recompute would run it without the guard, on the block as if it were the whole domain).


def saved_hooks_top() -> Any:
    """The pack hook on top of autograd's saved-tensor hooks (a checkpoint's while its function
    runs), or ``None``."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if top is None else top[0]


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a checkpointed module
    is being recomputed)."""
    return bool(torch._C._current_graph_task_id() != -1)


@dataclass(frozen=True)
class _State:
    """The region's state where a checkpointed module started."""

    pooled: frozenset[str]
    ragged: tuple[tuple[int, tuple[int, ...]], ...]
    attention: tuple[Any, ...]


def check_converted(where: str, what: str) -> None:
    """At the forward: ``what`` (an ``F.interpolate`` or attention the guard runs
    domain-parallel) inside a checkpointed function but outside the modules of the region that
    started under that checkpoint: refused (its recompute would run without the guard)."""
    frames = region().frames
    if not frames or saved_hooks_top() is frames[-1]:
        return
    raise ParallelizeError(
        f"DomainParallel on {where!r}: the model calls {what} inside a function that "
        "torch.utils.checkpoint recomputes in the backward, outside a module of the region: "
        "the recompute would run it outside the region, on this rank's block as if it were the "
        "whole domain. Fix: checkpoint a module (checkpoint(module, x, use_reentrant=False)), "
        "with the call inside its forward, or no checkpointing there"
    )


class Recompute:
    """The forward hooks of every module inside one domain-parallel region: the record of the
    region's state on a checkpointed module's inputs, and the re-entry where it is recomputed.
    ``guard``: the region's functional guard (a ``TorchFunctionMode``); ``where``: the region's
    name for messages."""

    def __init__(self, guard: Any, where: str) -> None:
        self.guard, self.where = guard, where
        self.records: Any = WeakIdKeyDictionary()  # Tensor -> {id(module): _State}

    def install(self, module: nn.Module, name: str) -> None:
        """The pre-hook and hook on ``module`` (named ``name`` for messages)."""
        module.register_forward_pre_hook(
            lambda m, args, kwargs: self._before(m, name, args, kwargs), with_kwargs=True
        )
        module.register_forward_hook(lambda m, args, out: self._after(m), always_call=True)

    def _before(self, m: nn.Module, name: str, args: Any, kwargs: Any) -> None:
        state = region()
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        if state.depth:  # the forward: the saved-tensor hooks this module starts under
            top = saved_hooks_top()
            if state.frames and top is not state.frames[-1]:  # a checkpoint began here
                snap = _State(
                    frozenset(state.pooled), tuple(state.ragged.items()), tuple(state.attention)
                )
                for t in tensors:
                    self.records.setdefault(t, {})[id(m)] = snap
            state.frames.append(top)
            return
        if not in_backward():
            return  # called directly: the domain layers refuse it
        found: _State | None = next(
            (self.records[t][id(m)] for t in tensors if id(m) in self.records.get(t, {})), None
        )
        if found is None:
            raise ParallelizeError(
                f"DomainParallel on {self.where!r}: {name!r} ({type(m).__name__}) is recomputed "
                "in the backward (activation checkpointing) on inputs that carry no record of "
                "its forward's domain-parallel region (a reentrant checkpoint detaches them, or "
                "the checkpointed function computed them before its first module), so it cannot "
                "run inside its region again. Fix: checkpoint the module itself with "
                "use_reentrant=False (torch.utils.checkpoint.checkpoint(module, x, "
                "use_reentrant=False)), or no checkpointing inside the region"
            )
        state.pooled, state.ragged = set(found.pooled), dict(found.ragged)
        state.attention = list(found.attention)
        self.guard.__enter__()
        state.depth += 1
        state.frames.append(saved_hooks_top())
        state.reentered.append(id(m))

    def _after(self, m: nn.Module) -> None:
        state = region()
        if state.reentered and state.reentered[-1] == id(m):
            state.reentered.pop()
            state.frames.pop()
            state.depth -= 1
            self.guard.__exit__(None, None, None)
            state.pooled.clear()
            state.thin.clear()
            state.ragged.clear()
            state.attention.clear()
        elif state.depth and state.frames:
            state.frames.pop()
