"""The one table of dtype carriers: which dtypes the data-movement collectives move as they are,
and the same-size dtype every other one is moved as, bit for bit (a bitwise view: no copy, no
arithmetic).

Two users, one table (two columns: c10d carries no int16): the c10d transports
(``fastdist.comm.transports``: gloo, NCCL and HCCL refuse many dtypes) and the movement rules of
simulated ranks (``fastdist.ops``: torch has no CPU gather / index / cat kernel for uint16/32/64,
complex32, the float8 kinds, float4 and the bits dtypes, and its CPU gather rewrites float16 and
bfloat16 NaNs). A quantized dtype has no view (its values need its scale).
"""

from __future__ import annotations

import torch

__all__ = ["CARRIED", "wire_dtype", "bits_dtype"]

#: the dtypes every c10d backend (gloo, NCCL, HCCL) moves as they are, in every movement collective
CARRIED = frozenset(
    {
        torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
    }
)  # fmt: skip
#: the carriers of every other dtype, by item size: ``(on the wire, in this process)``. The wire
#: (c10d, which only copies bytes): gloo has no int16, so 2 bytes go as float16; complex128 as two
#: float64. In this process (torch kernels): a plain integer, as torch's CPU gather does not copy a
#: float's bits as they are (it returns a float16 signalling NaN quiet, every bfloat16 NaN as
#: 0xffff); none for 16 bytes (complex128 has every kernel).
_CARRIERS = {
    1: (torch.uint8, torch.uint8),
    2: (torch.float16, torch.int16),
    4: (torch.int32, torch.int32),
    8: (torch.int64, torch.int64),
    16: (torch.float64, None),
}
#: dtypes without a bitwise view (a quantized tensor's values need its scale and zero point)
_NO_VIEW = frozenset(
    getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, n)
)  # fmt: skip


def wire_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a movement collective sends a ``dtype`` tensor as: ``dtype`` itself when every
    c10d backend carries it (:data:`CARRIED`), else the same-size carrier it is bitwise viewed as;
    None for a dtype no view carries (quantized).

    >>> wire_dtype(torch.float32), wire_dtype(torch.int16), wire_dtype(torch.float8_e4m3fn)
    (torch.float32, torch.float16, torch.uint8)
    >>> wire_dtype(torch.complex128), wire_dtype(torch.quint8)
    (torch.float64, None)
    """
    if dtype in CARRIED:
        return dtype
    if dtype in _NO_VIEW:
        return None
    return _CARRIERS.get(dtype.itemsize, (None, None))[0]


def bits_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The plain integer dtype of ``dtype``'s item size that torch's kernels move a ``dtype``
    tensor as in this process, bit for bit (``x.view(carrier)``: every shape and stride kept);
    None when ``dtype`` is that integer itself, or has no such view (complex128, quantized).

    >>> bits_dtype(torch.uint16), bits_dtype(torch.float4_e2m1fn_x2), bits_dtype(torch.bfloat16)
    (torch.int16, torch.uint8, torch.int16)
    >>> bits_dtype(torch.int16), bits_dtype(torch.complex128), bits_dtype(torch.quint8)
    (None, None, None)
    """
    if dtype in _NO_VIEW:
        return None
    carrier = _CARRIERS.get(dtype.itemsize, (None, None))[1]
    return None if carrier is dtype else carrier
