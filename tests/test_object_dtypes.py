"""Objects holding tensors of every dtype through fastdist's object helpers.

torch 2.13 pickles a float8 (every kind), uint16/32/64 or complex32 tensor, but ``pickle.loads``
of that pickle fails (``AttributeError: ... UntypedStorage has no attribute 'dtype'``). fastdist
pickles every message through :mod:`fastdist.comm.pickling`, which sends such a tensor as its
storage's bytes: ``broadcast_object``, ``all_gather_object``, ``send_object`` / ``recv_object``
(2 gloo processes; they have no simulated-rank path: a mesh without a job raises
``NoBackendError``), ``StatelessGroup`` (in process, over a ``HashStore``) and the pickling itself.
The reference is the sent tensor: the same type, dtype, shape, strides, ``requires_grad`` and
bytes.

Before: ``all_gather_object`` of a float8 tensor raised ``CommError: ... the collective failed:
... UntypedStorage has no attribute 'dtype'`` and abandoned the mesh; ``StatelessGroup.recv_obj``
raised ``CollectiveTimeout: nothing from rank 0 within ...`` for a message that had arrived, and
raised it again at every later receive.
"""

from __future__ import annotations

import dataclasses
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fastdist as fd
from fastdist.comm import StatelessGroup
from fastdist.comm.pickling import TORCH_PICKLES, Encoder, dumps, loads
from fastdist.errors import CollectiveTimeout, CommError, NoBackendError
from tests.dist_harness import run_on_gloo

#: the dtypes torch's own pickling cannot bring back (each must be in the messages)
UNPICKLABLE = {
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "uint16",
    "uint32",
    "uint64",
    "complex32",
}


def _dtypes() -> list[torch.dtype]:
    """Every whole-byte dtype of this torch: those torch's pickling brings back, and those it
    does not."""
    names = [
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
        *sorted(UNPICKLABLE - {"uint16", "uint32", "uint64", "complex32"}),
    ]  # fmt: skip
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (every bit pattern, nan included)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, generator=g
    )
    return raw % 2 == 1 if dtype is torch.bool else raw.view(dtype)


@dataclasses.dataclass
class Box:
    """A user's record holding tensors (a dataclass pickles by its fields)."""

    name: str
    tensors: list[torch.Tensor]


def message(seed: int) -> dict[str, Any]:
    """Tensors of every dtype, contiguous and as views (transposed, sliced at an offset,
    expanded, 0-d, empty), a conjugate view, a tensor requiring grad, parameters, and nested
    containers (lists, tuples, dicts, a dataclass) with one tensor in two places."""
    msg: dict[str, Any] = {}
    for k, d in enumerate(_dtypes()):
        t = _random(d, (4, 6), 100 * seed + k)
        msg[f"{d}"] = t
        msg[f"{d} transposed"] = t.t()
        msg[f"{d} slice"] = t[1:3, 2:]  # a storage offset, a stride of 6
        msg[f"{d} expanded"] = t[2].expand(3, 6)  # a stride of 0
        msg[f"{d} element"] = t[3, 4]  # 0-d, at an offset
        msg[f"{d} empty"] = t[:0]
    c32 = msg["torch.complex32"]
    msg["complex64 conj"] = torch.complex(torch.arange(4.0) + seed, torch.ones(4)).conj()
    msg["complex32 conj"] = c32.conj()
    msg["float8 grad"] = _random(torch.float8_e5m2, (3,), seed).requires_grad_()
    msg["float8 parameter"] = torch.nn.Parameter(_random(torch.float8_e4m3fn, (2, 2), seed))
    msg["float32 parameter"] = torch.nn.Parameter(_random(torch.float32, (2, 3), seed))
    f8 = msg["torch.float8_e5m2"]
    msg["nested"] = [
        f8,
        (msg["torch.uint32 slice"], {"inner": [c32.t(), 3, "text"], "f64": msg["torch.float64"]}),
        Box(f"rank {seed}", [msg["torch.uint64 element"], msg["torch.bfloat16"]]),
        f8,  # the same tensor twice
        None,
    ]
    return msg


def differences(want: Any, have: Any, where: str = "") -> list[str]:
    """Where ``have`` differs from ``want`` (tensors: type, dtype, shape, strides,
    ``requires_grad``, bytes); empty when equal."""
    if isinstance(want, torch.Tensor):
        got = (type(have), getattr(have, "dtype", None), getattr(have, "shape", None))
        if got != (type(want), want.dtype, want.shape):
            return [f"{where}: {got} != {(type(want), want.dtype, want.shape)}"]
        out = [] if have.requires_grad == want.requires_grad else [f"{where}: requires_grad"]
        w, h = (want.resolve_conj(), have.resolve_conj()) if want.is_conj() else (want, have)
        if not want.is_conj() and have.stride() != want.stride():
            out.append(f"{where}: stride {have.stride()} != {want.stride()}")
        wb = w.detach().contiguous().reshape(-1).view(torch.uint8)
        hb = h.detach().contiguous().reshape(-1).view(torch.uint8)
        return out if torch.equal(wb, hb) else [*out, f"{where}: values differ"]
    if isinstance(want, dict):
        if not isinstance(have, dict) or have.keys() != want.keys():
            return [f"{where}: keys"]
        return [e for k in want for e in differences(want[k], have[k], f"{where}[{k!r}]")]
    if isinstance(want, list | tuple):
        if type(have) is not type(want) or len(have) != len(want):
            return [f"{where}: {type(have).__name__} of {len(have)}"]
        out = []
        for i, (a, b) in enumerate(zip(want, have, strict=True)):
            out += differences(a, b, f"{where}[{i}]")
        return out
    if isinstance(want, Box):
        if type(have) is not Box or have.name != want.name:
            return [f"{where}: {have!r}"]
        return differences(want.tensors, have.tensors, f"{where}.tensors")
    return [] if have == want else [f"{where}: {have!r} != {want!r}"]


def value_differences(want: dict[str, torch.Tensor], have: dict[str, Any]) -> list[str]:
    """Where the tensors of ``have`` differ from ``want``'s in dtype, shape or bytes (a tensor
    dict's tensors arrive contiguous, without grad)."""
    if have.keys() != want.keys():
        return ["keys"]
    out = []
    for k, w in want.items():
        h = have[k]
        if not isinstance(h, torch.Tensor) or (h.dtype, h.shape) != (w.dtype, w.shape):
            out.append(f"{k}: {h!r}")
        elif not torch.equal(*(_bytes_of(t) for t in (h, w))):
            out.append(f"{k}: values differ")
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8)


def tensors_of(msg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The message's top-level tensors (every dtype, contiguous and views)."""
    return {k: v for k, v in msg.items() if isinstance(v, torch.Tensor)}


class NotOnReceivers:
    """Pickles; unpickling raises (as a class only the sender can import does)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (int, ("not a number",))


# ------------------------------------------------------------------------------ in process
def test_the_messages_hold_every_dtype_torch_cannot_unpickle() -> None:
    """The test's messages are a real test: each dtype torch cannot unpickle is there, and torch's
    own pickling of it fails (so the gloo cases below fail without fastdist's pickling)."""
    names = {str(d).removeprefix("torch.") for d in _dtypes()}
    assert UNPICKLABLE <= names, UNPICKLABLE - names
    assert not {getattr(torch, n) for n in UNPICKLABLE} & TORCH_PICKLES
    with pytest.raises(AttributeError, match="UntypedStorage"):
        pickle.loads(pickle.dumps(message(0)))
    with pytest.raises(AttributeError, match="UntypedStorage"):
        pickle.loads(pickle.dumps(torch.zeros(2, dtype=torch.float8_e4m3fn)))


def test_dumps_and_the_encoder_bring_every_message_back() -> None:
    """:func:`dumps` / :func:`loads` and an :class:`Encoder` reused for two messages: each arrives
    equal; the two places of one tensor are one tensor on arrival."""
    enc = Encoder()
    for seed in (0, 1):
        want = message(seed)
        for have in (loads(dumps(want)), pickle.loads(dumps(want)), loads(enc.dumps(want))):
            assert differences(want, have) == []
            assert have["nested"][0] is have["nested"][3]


def test_stateless_group_objects_of_every_dtype() -> None:
    """``StatelessGroup.send_obj`` / ``recv_obj`` / ``broadcast_obj`` / ``all_gather_obj`` over
    one store in this process: every message arrives equal. An object that does not unpickle on
    the receiver raises a ``CommError`` naming the sender, and the next receive gets the next
    message (before: ``CollectiveTimeout`` for a message that had arrived, at every receive)."""
    store = dist.HashStore()
    a, b = (StatelessGroup(store, r, 2, timeout=2.0) for r in (0, 1))
    m0, m1 = message(0), message(1)
    a.send_obj(m0, dst=1)
    assert differences(m0, b.recv_obj(src=0)) == []
    assert a.broadcast_obj(m0, src=0) is m0
    assert differences(m0, b.broadcast_obj(None, src=0)) == []
    with ThreadPoolExecutor(2) as pool:  # the members gather at once, as two processes would
        gathers = [pool.submit(g.all_gather_obj, m) for g, m in ((a, m0), (b, m1))]
        for got in gathers:
            assert differences([m0, m1], got.result(timeout=30)) == []
    a.send_obj(NotOnReceivers(), dst=1)
    a.send_obj("next", dst=1)
    with pytest.raises(CommError) as e:
        b.recv_obj(src=0)
    assert not isinstance(e.value, CollectiveTimeout)
    msg = str(e.value)
    assert "the object from rank 0 (p2p/0->1/1) arrived but could not be unpickled" in msg, msg
    assert "ValueError" in msg and "the next receive gets the message after it" in msg, msg
    assert b.recv_obj(src=0) == "next"


def test_object_helpers_need_real_ranks() -> None:
    """The object helpers have no simulated-rank path: a mesh without a job raises
    ``NoBackendError`` naming the op."""
    mesh = fd.Mesh({"tp": 2})
    with pytest.raises(NoBackendError, match="all_gather_object"):
        fd.comm.all_gather_object(torch.zeros(1, dtype=torch.float8_e4m3fn), mesh)
    with pytest.raises(NoBackendError, match="broadcast_object"):
        fd.comm.broadcast_object(1, mesh)


# ------------------------------------------------------------------------------ gloo
def objects_on_gloo() -> dict[str, Any]:
    """One rank of 2: every object helper with every message, then an object that does not
    unpickle (then the mesh must still work), then one that does not pickle. Returns the
    differences found per case and the errors' texts."""
    mesh = fd.connect(tp=2, timeout=60)
    me = fd.comm.axis_comm(mesh, "tp", "test").index
    mine, other = message(me), message(1 - me)
    found: dict[str, list[str]] = {}
    for src in (0, 1):
        got = fd.comm.broadcast_object(mine if me == src else None, mesh, "tp", src=src)
        found[f"broadcast_object src={src}"] = differences(message(src), got)
    both = fd.comm.all_gather_object(mine, mesh, "tp")
    found["all_gather_object"] = differences([message(0), message(1)], both)
    found["all_gather_object, whole mesh"] = differences(
        [message(0), message(1)], fd.comm.all_gather_object(mine, mesh)
    )
    for sender in (0, 1):
        if me == sender:
            fd.comm.send_object(mine, mesh, "tp", dst=1 - me)
        else:
            found[f"recv_object from {sender}"] = differences(
                other, fd.comm.recv_object(mesh, "tp", src=sender)
            )
    # tensors move as bytes: every dtype gloo refuses too (int16, uint16/32/64, float8)
    want = tensors_of(message(0))
    got_d = fd.comm.broadcast_tensor_dict(want if me == 0 else None, mesh, "tp", src=0)
    found["broadcast_tensor_dict"] = value_differences(want, got_d)
    if me == 0:
        fd.comm.send_tensor_dict(want, mesh, "tp", dst=1)
        for t in want.values():
            fd.comm.send(t, mesh, "tp", dst=1)
    else:
        found["recv_tensor_dict"] = value_differences(
            want, fd.comm.recv_tensor_dict(mesh, "tp", src=0)
        )
        found["recv"] = value_differences(
            want, {k: fd.comm.recv(t, mesh, "tp", src=0) for k, t in want.items()}
        )
    bad: dict[str, str] = {}
    try:
        fd.comm.broadcast_object(NotOnReceivers() if me == 0 else None, mesh, "tp", src=0)
        bad["broadcast_object"] = "returned"
    except CommError as e:
        bad["broadcast_object"] = str(e)
    try:
        fd.comm.all_gather_object([NotOnReceivers()] if me == 1 else me, mesh, "tp")
        bad["all_gather_object"] = "returned"
    except CommError as e:
        bad["all_gather_object"] = str(e)
    # the mesh still works after both
    after = fd.comm.all_gather_object(torch.full((2,), me, dtype=torch.uint16), mesh, "tp")
    found["after the unpickling errors"] = differences(
        [torch.full((2,), r, dtype=torch.uint16) for r in (0, 1)], after
    )
    try:  # last: a failed call abandons the mesh
        fd.comm.all_gather_object((lambda: 1) if me == 0 else me, mesh, "tp")
        bad["unpicklable"] = "returned"
    except CommError as e:
        bad["unpicklable"] = type(e).__name__ + ": " + str(e)
    return {"found": found, "bad": bad}


def test_object_helpers_on_gloo() -> None:
    """``broadcast_object`` (each source), ``all_gather_object`` (the axis and the whole mesh),
    ``send_object`` / ``recv_object`` (each direction) of messages with tensors of every dtype,
    views and nested containers, on 2 gloo processes: each rank gets the sent objects, equal.
    The tensors of ``broadcast_tensor_dict``, ``send_tensor_dict`` / ``recv_tensor_dict`` and
    ``send`` / ``recv`` of every dtype arrive with their dtype, shape and bytes (before: gloo's
    "Invalid scalar type" for int16, uint16/32/64 and float8, blamed on the ranks disagreeing).

    An object that pickles on its sender but does not unpickle on a receiver raises a
    ``CommError`` there naming the sender, and the mesh stays usable; one that does not pickle
    fails the call as before (a ``CommError`` naming the pickling error, on the sender)."""
    for rank, out in enumerate(run_on_gloo(objects_on_gloo, 2, timeout=240)):
        found = out["found"]
        assert len(found) == 7 + 2 * rank, found  # rank 1 receives the tensors too
        assert {case: d for case, d in found.items() if d} == {}, (rank, found)
        bad = out["bad"]
        if rank == 0:  # the sender of the broadcast keeps its own object
            assert bad["broadcast_object"] == "returned", bad
        else:
            assert (
                "the object of rank 0 (index 0 along the axis) arrived but could not be "
                "unpickled on this rank (ValueError" in bad["broadcast_object"]
            ), bad
        assert "fastdist.all_gather_object(axis='tp')" in bad["all_gather_object"], bad
        assert (
            "the object of rank 1 (index 1 along the axis) arrived but could not be unpickled on "
            "this rank (ValueError" in bad["all_gather_object"]
        ), bad
        assert "the mesh stays usable" in bad["all_gather_object"], bad
        assert bad["unpicklable"].startswith("CommError: fastdist.all_gather_object"), bad
        if rank == 0:
            assert "Can't pickle local object" in bad["unpicklable"], bad
