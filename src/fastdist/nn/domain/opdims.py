"""Reading a torch call for the functional guard (`fastdist.nn.domain.guard`): the dims its
arguments name (``(x, args, kwargs) -> dims``, the rows of `fastdist.nn.domain.optables`), the
name the model's code spells it by, and whether torch tags it elementwise."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def named(owner: Any, names: Sequence[str]) -> list[Any]:
    """The callables of ``owner`` named ``names`` (those that exist)."""
    return [getattr(owner, n) for n in names if hasattr(owner, n)]


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


def fixed(dims: Sequence[int] | None) -> Any:
    """An op over fixed ``dims`` (``None``: every dim)."""
    return lambda x, args, kwargs: range(x.dim()) if dims is None else dims


def all_but(at: int) -> Any:
    """``renorm``: over every dim but its ``dim`` (the ``at``-th positional after the input)."""

    def dims(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        d = int(kwargs.get("dim", args[at] if len(args) > at else 0)) % max(x.dim(), 1)
        return [i for i in range(x.dim()) if i != d]

    return dims


def diagonal_dims(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``diagonal(x, offset=0, dim1=0, dim2=1)``: its two dims."""
    return [kwargs.get("dim1", args[1] if len(args) > 1 else 0),
            kwargs.get("dim2", args[2] if len(args) > 2 else 1)]  # fmt: skip


def cross_dims(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.cross``: its ``dim``, else the first dim of size 3."""
    d = kwargs.get("dim", args[1] if len(args) > 1 else None)
    return [d] if d is not None else [next((i for i, n in enumerate(x.shape) if n == 3), 0)]


def loss_dims(per_position: Sequence[int]) -> Any:
    """A loss: over every dim (``reduction`` ``'mean'`` / ``'sum'``), else over
    ``per_position`` (``'none'``: the class dim of a cross entropy, none of an elementwise
    loss)."""

    def dims(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return per_position if kwargs.get("reduction", "mean") == "none" else range(x.dim())

    return dims


def sum_to_size_dims(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``Tensor.sum_to_size(*size)``: the dims it sums (size 1 where ``x``'s is not)."""
    size = flat_ints(args or (kwargs.get("size", ()),))
    lead = x.dim() - len(size)
    return [i for i in range(x.dim()) if i < lead or (size[i - lead] == 1 and x.shape[i] != 1)]


def repeats_dims(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``repeat_interleave``: none for an int count along a dim (each row repeated where it
    is), its ``dim`` for a count per row (the block's rows would read the whole dim's counts)."""
    reps = kwargs.get("repeats", args[0] if args else 1)
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if isinstance(reps, Tensor) and reps.numel() > 1:
        return range(x.dim()) if dim is None else [dim]
    return []


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


def op_name(func: Any) -> str:
    """``func`` as the model's code spells it (``torch.max``, ``Tensor.max``, ``F.pad``)."""
    qual = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
    name = qual.split(".")[-1]
    if "<locals>" in qual:  # torch's boolean_dispatch wrappers (F.max_pool2d): their own name
        name = str(getattr(func, "__name__", name))
    if qual.startswith(("TensorBase.", "Tensor.")):
        return f"Tensor.{name}"
    if qual.startswith("_VariableFunctionsClass."):
        return f"torch.{name}"
    if getattr(func, "__module__", "") == "torch.nn.functional":
        return f"F.{name}"
    return qual.replace(".__get__", "")


#: aten ops that keep every element where it is (no math across positions), not tagged
#: pointwise
_ATEN_IN_PLACE_OF = {"detach", "alias", "clone", "contiguous", "to", "_to_copy", "copy_",
                     "lift_fresh", "type_as"}  # fmt: skip


#: Python's operator names that aten spells otherwise
_DUNDER = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "and": "bitwise_and",
           "or": "bitwise_or", "xor": "bitwise_xor", "invert": "bitwise_not",
           "lshift": "bitwise_left_shift", "rshift": "bitwise_right_shift"}  # fmt: skip


def _aten_packet(func: Any) -> Any:
    """The aten overload packet of a torch function, method or ``F`` function, by name
    (``Tensor.__radd__`` -> ``aten.add``), or ``None``."""
    name = str(getattr(func, "__name__", ""))
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        name = name[1:] if name.startswith("r") and not hasattr(torch.ops.aten, name) else name
        name = _DUNDER.get(name, name)
    name = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    return getattr(torch.ops.aten, name, None) if name else None


def is_pointwise(func: Any) -> bool:
    """Whether ``func`` (a torch function, a method, an aten overload or packet) is elementwise
    (torch's ``pointwise`` tag): its output broadcasts its inputs and reads no other position."""
    if isinstance(func, torch._ops.OpOverload):
        return torch.Tag.pointwise in func.tags or func.__name__.split(".")[0] in _ATEN_IN_PLACE_OF
    packet = func if isinstance(func, torch._ops.OpOverloadPacket) else _aten_packet(func)
    if packet is None:
        return False
    if packet.__name__.split(".")[-1] in _ATEN_IN_PLACE_OF:
        return True
    names = packet.overloads()
    # a packet's tensor overloads: where(cond, x, y) (not where(cond)), exp(x) (not exp(2.0))
    main = [o for o in names if o in ("Tensor", "self", "default")] or [
        o for o in names if o == "Scalar"
    ]
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in main)
