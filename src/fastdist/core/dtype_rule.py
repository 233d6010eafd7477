"""The dtype rule of every reduction, in one place.

Every collective that combines values across ranks asks :func:`check_reduction_dtype`
before it runs: ``psum``, ``psum_scatter`` and ``reduce_scatter_v`` (``"sum"``), ``pmean``
(``"mean"``), ``pmax`` / ``pmin`` (``"max"`` / ``"min"``), on simulated ranks, on real
ranks over torch.distributed, and in the ctypes NCCL/HCCL communicator (which also has
``"prod"``). The ops that only move data (gathers, scatters, all-to-alls, permutes,
broadcasts) take every dtype.

=====================================  =====  ======  =========  ======
dtype                                  sum    mean    max / min  prod
=====================================  =====  ======  =========  ======
float16, bfloat16, float32, float64    yes    yes     yes        yes
complex64, complex128                  yes    yes     no         no
int8, uint8, int32, int64              yes    no      yes        yes
bool                                   no     no      yes        no
anything else                          no     no      no         no
=====================================  =====  ======  =========  ======

Why: a sum of bools is ambiguous (a count, or a logical or as NCCL computes it), so it is
refused and ``pmax`` / ``pmin`` give the logical or / and; a mean of integers would have
to round; complex numbers are not ordered, and their product is not elementwise on the
real view. "Anything else" (int16, uint16/32/64, complex32, float8 and float4 formats,
quantized types) is not reduced by every backend (gloo has no int16, torch has no CPU sum
for uint16..uint64, no backend sums fp8): each gets a fix that names the cast to use.

>>> import torch
>>> check_reduction_dtype("psum", "tp", torch.float32, "sum")  # allowed: returns None
>>> try:  # doctest: +NORMALIZE_WHITESPACE
...     check_reduction_dtype("psum", "tp", torch.bool, "sum")
... except ReductionDtypeError as e:
...     print(e.fix)
cast to an integer dtype to count (x.int()), or use pmax / pmin for a logical or / and
(they take bool)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from fastdist.errors import ReductionDtypeError

__all__ = ["REDUCTION_DTYPES", "Reduction", "check_reduction_dtype", "reduction_dtype_problem"]

#: The kinds of reduction: what the group does to the values of its members.
Reduction = Literal["sum", "mean", "max", "min", "prod"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_COMPLEX = (torch.complex64, torch.complex128)
_INTS = (torch.int8, torch.uint8, torch.int32, torch.int64)

#: Every dtype each kind of reduction accepts. A constant: never mutated (a plain dict, not a
#: MappingProxyType, because torch.compile's dynamo graph-breaks on mapping proxies).
REDUCTION_DTYPES: Mapping[str, frozenset[torch.dtype]] = {
    "sum": frozenset(_FLOATS + _COMPLEX + _INTS),
    "mean": frozenset(_FLOATS + _COMPLEX),
    "max": frozenset(_FLOATS + _INTS + (torch.bool,)),
    "min": frozenset(_FLOATS + _INTS + (torch.bool,)),
    "prod": frozenset(_FLOATS + _INTS),
}

_VERB = {
    "sum": "sum",
    "mean": "average",
    "max": "take the maximum of",
    "min": "take the minimum of",
    "prod": "multiply",
}


def reduction_dtype_problem(dtype: torch.dtype, reduction: str) -> tuple[str, str] | None:
    """``None`` where ``reduction`` accepts ``dtype``; else ``(problem, fix)``: the two halves of
    the error message."""
    allowed = REDUCTION_DTYPES.get(reduction)
    if allowed is None:
        raise ValueError(
            f"fastdist: unknown reduction {reduction!r}; one of {sorted(REDUCTION_DTYPES)}"
        )
    if dtype in allowed:
        return None
    problem = (
        f"cannot {_VERB[reduction]} {dtype} tensors ({reduction} reductions take "
        f"{', '.join(str(d).removeprefix('torch.') for d in _order(allowed))})"
    )
    return problem, _fix(dtype, reduction)


def _order(dtypes: frozenset[torch.dtype]) -> list[torch.dtype]:
    return [d for d in (*_FLOATS, *_COMPLEX, *_INTS, torch.bool) if d in dtypes]


def _fix(dtype: torch.dtype, reduction: str) -> str:
    if dtype == torch.bool:
        if reduction == "mean":
            return "cast with x.float() first (the fraction of ranks where x is True)"
        return (
            "cast to an integer dtype to count (x.int()), or use pmax / pmin for a logical or / "
            "and (they take bool)"
        )
    if dtype.is_complex and dtype in REDUCTION_DTYPES["sum"]:
        return (
            "complex numbers are not ordered and their product is not elementwise: reduce "
            "x.abs() or x.real, or use psum"
        )
    if dtype in _INTS:  # mean
        return "cast with x.float() first, or psum and divide by the axis size"
    if dtype == torch.int16:
        return "cast to int32 first (gloo and NCCL have no int16 reduction)"
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        return (
            "cast to int64 first (torch has no CPU reduction for wide unsigned types, gloo none "
            "at all)"
        )
    if dtype == torch.complex32:
        return "cast to complex64 first"
    if dtype.is_floating_point:  # float8 / float4 formats: storage types
        return "upcast to bfloat16 or float32, reduce, and cast back (no backend reduces fp8 / fp4)"
    return "cast to float32 or int64 first"


def check_reduction_dtype(
    op: str, axis: object, dtype: torch.dtype, reduction: str, rank: str = "every rank"
) -> None:
    """Raise :class:`~fastdist.ReductionDtypeError` (naming ``op``, ``axis``, ``dtype`` and the fix)
    unless ``reduction`` accepts ``dtype``."""
    bad = reduction_dtype_problem(dtype, reduction)
    if bad is not None:
        raise ReductionDtypeError(op, axis, dtype, reduction, *bad, rank=rank)
