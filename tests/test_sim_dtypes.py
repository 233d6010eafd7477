"""Simulated ranks move every dtype that real ranks move, bit for bit.

torch has no CPU gather / index / index_fill / cat kernel for uint16/32/64, complex32, the float8
kinds, float4 and the bits dtypes, so the simulated movement rules (and halo_exchange's and
indexed_all_to_all_v's own row picking) raised torch's raw error on them, where real ranks
(``tests/test_gloo_dtypes.py``) carry them: ``halo_exchange`` ("scatter_gather_tensor_cpu not
implemented for 'UInt16'"), ``ppermute`` with a partial perm ("index_fill_cpu"),
``ragged_all_to_all`` on float4 and bits ("index_cpu"), ``all_gather_v`` / ``gather_v`` /
``scatter_v`` on float4 ("cat_serial_kernel"), ``indexed_all_to_all_v``. They now run on the
same-size carrier of ``fastdist.core.carriers`` (the transports' one table). The reference is the
same op on the input's bitwise view as a plain integer dtype of its item size; results are
compared as bytes (NaN patterns included). Gradients of float and complex dtypes are unchanged
(checked against plain torch on the whole domain).

Also: dims, indices, widths and capacities take any integer ``operator.index`` takes (NumPy
integers), never a bool or a float.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import fastdist as fd
from fastdist.core.carriers import CARRIED, bits_dtype, wire_dtype
from fastdist.errors import CollectiveError
from fastdist.ops.prelude import check_index, norm_dim

NAMES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
]  # fmt: skip
#: every dtype of this torch of 1 to 8 bytes that is not quantized
DTYPES = [getattr(torch, n) for n in NAMES if hasattr(torch, n)]
#: a plain integer dtype of each item size: the reference runs on the input viewed as it
SAME_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: the in-process carriers (``fastdist.core.carriers.bits_dtype``)
PLAIN = frozenset({torch.uint8, torch.int16, torch.int32, torch.int64})
N, ROWS, COLS = 2, 4, 3
MESH = fd.Mesh({"tp": N})
SEND = torch.tensor([[1, 2], [3, 1]])  # ragged: rank r sends SEND[r][j] rows to j

Op = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: every data-movement op, as per-rank code (x: [ROWS, COLS], s: this rank's SEND row)
OPS: dict[str, Op] = {
    "all_gather": lambda x, s: fd.all_gather(x, MESH, "tp"),
    "all_gather_dim1": lambda x, s: fd.all_gather(x, MESH, "tp", dim=1, tiled=False),
    "all_gather_invariant": lambda x, s: fd.all_gather_invariant(x, MESH, "tp"),
    "local_chunk": lambda x, s: fd.local_chunk(x, MESH, "tp"),
    "all_to_all": lambda x, s: fd.all_to_all(x, MESH, "tp", 0, 1),
    "all_to_all_4d": lambda x, s: fd.all_to_all_4d(x.reshape(1, 2, 2, 3), MESH, "tp"),
    "all_to_all_qkv": lambda x, s: fd.ops.all_to_all_qkv(*(x.reshape(1, 2, 2, 3),) * 3, MESH, "tp")[
        1
    ],
    "broadcast": lambda x, s: fd.broadcast(x, MESH, "tp", src=1),
    "ppermute": lambda x, s: fd.ppermute(x, MESH, "tp", [(0, 1), (1, 0)]),
    "ppermute_partial": lambda x, s: fd.ppermute(x, MESH, "tp", [(0, 1)]),
    "ring_shift": lambda x, s: fd.ring_shift(x, MESH, "tp"),
    "all_gather_v": lambda x, s: fd.all_gather_v(x, MESH, "tp", [3, 2]),
    "gather_v": lambda x, s: fd.gather_v(x, MESH, "tp", [3, 2], dst=1, capacity=5),
    "scatter_v": lambda x, s: fd.scatter_v(x, MESH, "tp", [3, 1], src=0, capacity=3),
    "halo_circular": lambda x, s: fd.halo_exchange(x, MESH, "tp", 0, 1, mode="circular"),
    "halo_zeros": lambda x, s: fd.halo_exchange(x, MESH, "tp", 0, 1),
    "halo_replicate": lambda x, s: fd.halo_exchange(x, MESH, "tp", 0, (1, 2), mode="replicate"),
    "halo_reflect_dim1": lambda x, s: fd.halo_exchange(x, MESH, "tp", 1, 1, mode="reflect"),
    "halo_uneven": lambda x, s: fd.halo_exchange(x, MESH, "tp", 0, 1, sizes=[4, 3]),
    "halo_uneven_reflect": lambda x, s: fd.halo_exchange(
        x, MESH, "tp", 0, 1, sizes=[4, 3], mode="reflect"
    ),
    "ragged_all_to_all": lambda x, s: fd.ragged_all_to_all(x, MESH, "tp", s, capacity=5)[0],
    "indexed_all_to_all_v": lambda x, s: fd.indexed_all_to_all_v(
        x, MESH, "tp", torch.tensor([3, 1, 2, 0]), s, capacity=5
    )[0],
    # accumulate_fp32 (bfloat16 / float16 widened to float32 and back; other dtypes as they are)
    "indexed_all_to_all_v_fp32": lambda x, s: fd.indexed_all_to_all_v(
        x, MESH, "tp", torch.tensor([3, 1, 2, 0]), s, capacity=5, accumulate_fp32=True
    )[0],
}


def inputs(dtype: torch.dtype, seed: int, nans: bool = False) -> torch.Tensor:
    """Every rank's input stacked, ``[N, ROWS, COLS]``: random bytes (every bit pattern; bool 0
    or 1). ``nans``: each element's top 12 bits all ones but the sign (a NaN, signalling or quiet,
    in every float dtype of 2 bytes or more), the rest random."""
    g = torch.Generator().manual_seed(seed)
    size = dtype.itemsize
    raw = torch.randint(0, 256, (N, ROWS, COLS, size), dtype=torch.uint8, generator=g)
    if nans and size > 1:  # little-endian: the last byte is the top one
        raw[..., -1] = raw[..., -1] | 0x7F
        raw[..., -2] = raw[..., -2] | 0xF0
    raw = raw.reshape(N, ROWS, COLS * size)
    return raw % 2 == 1 if dtype is torch.bool else raw.view(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_the_table_is_one() -> None:
    """The transports use the table of ``fastdist.core.carriers`` (not a copy of it); in this
    process every dtype of 1 to 8 bytes moves as a plain integer of its size."""
    from fastdist.comm import transports

    assert transports.CARRIED is CARRIED and transports.wire_dtype is wire_dtype
    for dtype in DTYPES:
        carrier = bits_dtype(dtype)
        assert (carrier is None) == (dtype in PLAIN), dtype
        assert carrier is None or (carrier in PLAIN and carrier.itemsize == dtype.itemsize)


@pytest.mark.parametrize("nans", [False, True], ids=["random", "nans"])
@pytest.mark.parametrize("name", list(OPS))
def test_every_dtype_bit_for_bit(name: str, nans: bool) -> None:
    """Each op on each dtype: the same bytes as on the input's same-size integer view (before:
    torch's NotImplementedError for uint16/32/64, complex32, float8, float4, bits; float16 and
    bfloat16 NaNs rewritten by halo_exchange and indexed_all_to_all_v)."""
    sim = fd.simulate(OPS[name], MESH)
    wrong = []
    for i, dtype in enumerate(DTYPES):
        if nans and name.endswith("_fp32") and dtype in (torch.float16, torch.bfloat16):
            continue  # widened to float32 and back, as asked: NaN payloads are not kept
        x = inputs(dtype, i, nans)
        want = sim(x.view(SAME_SIZE[dtype.itemsize]), SEND)
        try:
            got = sim(x, SEND)
        except (RuntimeError, NotImplementedError) as e:
            wrong.append(f"{dtype}: {type(e).__name__}: {str(e)[:100]}")
            continue
        if (
            got.dtype != dtype
            or got.shape != want.shape
            or not torch.equal(as_bytes(got), as_bytes(want))
        ):
            wrong.append(f"{dtype}: different bytes")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "dtype", [torch.uint16, torch.bits16, torch.float16, torch.bfloat16, torch.int16]
)
def test_every_two_byte_pattern(dtype: torch.dtype) -> None:
    """Every one of the 65536 bit patterns of a 2-byte dtype (NaN payloads, signalling NaNs, -0)
    comes through unchanged. Before: float16 and bfloat16 through halo_exchange came back with
    their NaNs rewritten (torch's CPU gather, which index_select is under the rank vmap: a float16
    signalling NaN quiet, 0x7d09 -> 0x7f09; every bfloat16 NaN as 0xffff), and the 2-byte wire
    carrier, float16, does the same to uint16."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = patterns.view(dtype).reshape(N, 2**14, 2)  # [rank, rows, 2]
    for f in (
        lambda t, s: fd.ring_shift(t, MESH, "tp"),
        lambda t, s: fd.ppermute(t, MESH, "tp", [(1, 0)]),
        lambda t, s: fd.ragged_all_to_all(t, MESH, "tp", s, capacity=2**15)[0],
        lambda t, s: fd.halo_exchange(t, MESH, "tp", 0, 2**13, mode="circular"),
        lambda t, s: fd.gather_v(t, MESH, "tp", [2**14, 2**13], dst=0, capacity=2**15),
    ):
        send = torch.tensor([[2**13, 2**13], [2**14, 0]])
        sim = fd.simulate(f, MESH)
        want = sim(x.view(torch.int16), send)
        assert torch.equal(as_bytes(sim(x, send)), as_bytes(want))


def _whole_circular(full: torch.Tensor, rows: int) -> torch.Tensor:
    """Each rank's block of ``full`` with one row of circular halo, on one device: ``[N, rows +
    2, ...]``."""
    padded = torch.cat([full[-1:], full, full[:1]])
    return torch.stack([padded[r * rows : r * rows + rows + 2] for r in range(N)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
def test_gradients_unchanged(dtype: torch.dtype) -> None:
    """Float and complex dtypes keep their gradient: halo_exchange and indexed_all_to_all_v (the
    ops whose own row picking may run on a carrier) against plain torch on one device."""
    g = torch.Generator().manual_seed(0)
    full = torch.randn(N * ROWS, COLS, dtype=dtype, generator=g)
    w = torch.randn(N, ROWS + 2, COLS, dtype=dtype, generator=g)
    x = full.clone().requires_grad_()
    y = fd.simulate(lambda t: fd.halo_exchange(t, MESH, "tp", 0, 1, mode="circular"), MESH)(
        x.view(N, ROWS, COLS)
    )
    (gx,) = torch.autograd.grad((y * w).sum().abs(), x)
    ref = full.clone().requires_grad_()
    want = _whole_circular(ref, ROWS)
    (gr,) = torch.autograd.grad((want * w).sum().abs(), ref)
    assert torch.equal(y.detach(), want.detach())
    torch.testing.assert_close(gx, gr)

    index = torch.tensor([3, 1, 2, 0])
    x2 = full.clone().view(N, ROWS, COLS).requires_grad_()
    out = fd.simulate(
        lambda t, s: fd.indexed_all_to_all_v(t, MESH, "tp", index, s, capacity=5)[0], MESH
    )(x2, SEND)
    v = torch.randn(out.shape, dtype=dtype, generator=g)
    (gi,) = torch.autograd.grad((out * v).sum().abs(), x2)
    # one device: rank r sends x[r][index] rows in order, SEND[r][j] to rank j; j receives by
    # source, then zeros up to capacity
    ref2 = full.clone().view(N, ROWS, COLS).requires_grad_()
    picked = [ref2[r][index] for r in range(N)]
    starts = SEND.cumsum(1) - SEND
    outs = []
    for j in range(N):
        parts = [picked[r][starts[r, j] : starts[r, j] + SEND[r, j]] for r in range(N)]
        got = torch.cat(parts)
        outs.append(torch.cat([got, got.new_zeros(5 - got.shape[0], COLS)]))
    want2 = torch.stack(outs)
    (gw,) = torch.autograd.grad((want2 * v).sum().abs(), ref2)
    assert torch.equal(out.detach(), want2.detach())
    torch.testing.assert_close(gi, gw)


# ====================================================================== NumPy integers
def test_numpy_integers_as_dims_and_indices() -> None:
    """np.int64 / np.int32 dims, indices, widths and capacities act as the Python ints (before:
    "dim=np.int64(0) is out of range", "dst=np.int64(1) is not an index along the axis")."""
    i64, i32 = np.int64, np.int32
    pairs: list[tuple[Op, Op]] = [
        (
            lambda x, s: fd.all_gather(x, MESH, "tp", dim=i64(1)),
            lambda x, s: fd.all_gather(x, MESH, "tp", dim=1),
        ),
        (
            lambda x, s: fd.all_to_all(x, MESH, "tp", i64(0), i32(-1)),
            lambda x, s: fd.all_to_all(x, MESH, "tp", 0, -1),
        ),
        (
            lambda x, s: fd.gather_v(x, MESH, "tp", [3, 2], dst=i64(1), dim=i32(0), capacity=5),
            lambda x, s: fd.gather_v(x, MESH, "tp", [3, 2], dst=1, dim=0, capacity=5),
        ),
        (
            lambda x, s: fd.scatter_v(x, MESH, "tp", [3, 1], src=i32(1), capacity=i64(3)),
            lambda x, s: fd.scatter_v(x, MESH, "tp", [3, 1], src=1, capacity=3),
        ),
        (
            lambda x, s: fd.broadcast(x, MESH, "tp", src=i64(1)),
            lambda x, s: fd.broadcast(x, MESH, "tp", src=1),
        ),
        (
            lambda x, s: fd.halo_exchange(x, MESH, "tp", i64(-2), (i32(1), i64(2))),
            lambda x, s: fd.halo_exchange(x, MESH, "tp", 0, (1, 2)),
        ),
        (
            lambda x, s: fd.ragged_all_to_all(x, MESH, "tp", s, capacity=i64(5))[0],
            lambda x, s: fd.ragged_all_to_all(x, MESH, "tp", s, capacity=5)[0],
        ),
    ]
    x = torch.randn(N, ROWS, COLS, dtype=torch.float64)
    for numpy_op, int_op in pairs:
        got = fd.simulate(numpy_op, MESH)(x, SEND)
        assert torch.equal(got, fd.simulate(int_op, MESH)(x, SEND))
    d, i = norm_dim("op", "tp", "dim", i64(-1), 3), check_index("op", "tp", "src", i32(1), 2)
    assert (d, i) == (2, 1) and type(d) is int and type(i) is int


@pytest.mark.parametrize("bad", [True, np.bool_(True), 1.0, np.float64(1.0), torch.tensor(1)])
def test_non_integers_still_refused(bad: Any) -> None:
    """A bool (Python or NumPy), a float or a tensor is no dim, index, width or capacity."""
    x = torch.zeros(N, ROWS, COLS)
    for f in (
        lambda t: fd.all_gather(t, MESH, "tp", dim=bad),
        lambda t: fd.gather_v(t, MESH, "tp", [3, 2], dst=bad, capacity=5),
        lambda t: fd.broadcast(t, MESH, "tp", src=bad),
        lambda t: fd.halo_exchange(t, MESH, "tp", 0, bad),
        lambda t: fd.ragged_all_to_all(t, MESH, "tp", torch.tensor([1, 1]), capacity=bad)[0],
    ):
        with pytest.raises(CollectiveError):
            fd.simulate(f, MESH)(x)
    with pytest.raises(CollectiveError, match="is not an int"):
        norm_dim("op", "tp", "dim", bad, 3)
    with pytest.raises(CollectiveError, match="not an index"):
        check_index("op", "tp", "src", bad, 2)
