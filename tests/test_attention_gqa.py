"""Grouped-query / multi-query attention (fewer k/v heads than q heads) in fastdist.nn attention.

Every layer is checked against a plain single-device oracle: HF's ``repeat_kv`` of k/v, then
softmax attention, then an output projection; float64 values and the gradients of q, k, v and
the projection weight on every rank, to 1e-10. Unsupported head layouts raise ``MeshError``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from einops import rearrange
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import fastdist as fd
from fastdist import P
from fastdist.testing import assert_matches_single_device

F64 = torch.float64
TOL: dict[str, Any] = {"atol": 1e-10, "rtol": 1e-10}


# ============================================================================ the oracle
def repeat_kv(hidden_states: Tensor, n_rep: int) -> Tensor:
    """transformers' ``repeat_kv`` (Llama): (batch, Hkv, seq, hd) -> (batch, Hkv * n_rep, seq,
    hd)."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def oracle(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """(B, S, Hq, hd), (B, S, Hkv, hd) x 2 -> (B, S, Hq, hd): eager softmax attention as HF writes
    it."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, hd)
    # (B, Hq, S, hd)
    k, v = (
        repeat_kv(k, q.shape[1] // k.shape[1]),
        repeat_kv(v, q.shape[1] // v.shape[1]),
    )
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, Hq, S, S)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)  # (B, S, Hq, hd)


def projected(att: Any) -> Any:
    """attention(q, k, v) followed by an output projection wo: (B, S, Hq * hd) @ (Hq * hd, E)."""
    return lambda q, k, v, wo: rearrange(att(q, k, v), "b s h d -> b s (h d)") @ wo


def inputs(
    B: int, S: int, Hq: int, Hkv: int, D: int = 3, E: int = 5, seed: int = 0
) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(*shape, dtype=F64, generator=g)
        for shape in ((B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), (Hq * D, E))
    ]


def check(
    mesh: fd.Mesh,
    layer: Any,
    causal: bool,
    Hq: int,
    Hkv: int,
    seq_axes: Any,
    S_local: int = 2,
    seed: int = 0,
) -> None:
    """layer (per rank) + projection == oracle + projection; batch over dp when the mesh has it,
    sequence over seq_axes."""
    dp = mesh.shape.get("dp", 1)
    n_seq = mesh.axis_size(seq_axes)
    spec = P("dp" if dp > 1 else None, seq_axes, None, None)
    assert_matches_single_device(
        projected(layer),
        projected(lambda q, k, v: oracle(q, k, v, causal)),
        mesh,
        inputs(dp, S_local * n_seq, Hq, Hkv, seed=seed),
        in_specs=(spec, spec, spec, P(None, None)),
        out_specs=P("dp" if dp > 1 else None, seq_axes, None),
        # wo is replicated: as under fd.spmd, its gradient is summed over the ranks (pvary)
        check="insert",
        **TOL,
    )


def ulysses_supported(Hq: int, Hkv: int, n: int) -> bool:
    """The head layouts UlyssesAttention runs (MHA with head padding, or GQA that splits evenly)."""
    return Hkv == Hq or (Hq % n == 0 and (Hkv % n == 0 or n % Hkv == 0))


# ============================================================================ local_attention
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (4, 2), (4, 1), (6, 3)])
def test_local_attention_gqa(Hq: int, Hkv: int, causal: bool) -> None:
    mesh = fd.Mesh({"sp": 1})
    check(
        mesh,
        lambda q, k, v: fd.nn.local_attention(q, k, v, causal=causal),
        causal,
        Hq,
        Hkv,
        "sp",
        S_local=5,
    )


def test_local_attention_gqa_positions_and_padding() -> None:
    """Explicit positions and padding keys with GQA: the oracle with the same mask."""
    q, k, v, _ = inputs(2, 4, 6, 2, seed=3)
    q_pos, k_pos, k_valid = (
        torch.tensor([2, 3, 4, 5]),
        torch.tensor([0, 1, 4, 5]),
        torch.tensor([True, False, True, True]),
    )
    got = fd.nn.local_attention(q, k, v, causal=True, q_pos=q_pos, k_pos=k_pos, k_valid=k_valid)
    kr, vr = (repeat_kv(t.transpose(1, 2), 3) for t in (k, v))  # (B, 6, S, hd)
    s = q.transpose(1, 2) @ kr.transpose(-1, -2) / 3**0.5
    s = s.masked_fill(~((k_pos[None, :] <= q_pos[:, None]) & k_valid), float("-inf"))
    torch.testing.assert_close(got, (s.softmax(-1) @ vr).transpose(1, 2), **TOL)


# ============================================================================ Ulysses
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "axes, Hq, Hkv",
    [
        ({"sp": 2}, 4, 4),
        ({"sp": 2}, 3, 3),  # MHA, with head padding
        ({"sp": 2}, 4, 2),
        ({"sp": 4}, 8, 4),  # GQA, Hkv % n == 0
        ({"sp": 2}, 4, 1),
        ({"sp": 4}, 4, 1),
        ({"sp": 4}, 8, 2),
        ({"dp": 2, "sp": 2}, 4, 1),  # Hkv < n: kv heads replicated
        ({"dp": 2, "sp": 2}, 6, 2),
    ],
)
def test_ulysses_gqa(axes: dict[str, int], Hq: int, Hkv: int, causal: bool) -> None:
    mesh = fd.Mesh(axes)
    check(mesh, fd.nn.UlyssesAttention(mesh, "sp", causal=causal), causal, Hq, Hkv, "sp")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hq, Hkv", [(6, 3), (3, 1), (6, 1)])  # Hkv % n == 0; Hkv < n; Hkv < n
def test_ulysses_gqa_uneven_sequence(Hq: int, Hkv: int, causal: bool) -> None:
    """seq_sizes with grouped heads: each rank's tokens padded to max(seq_sizes) rows."""
    mesh, sizes = fd.Mesh({"sp": 3}), [3, 1, 2]
    att = fd.nn.UlyssesAttention(mesh, "sp", causal=causal)
    m = max(sizes)
    q, k, v, wo = inputs(2, sum(sizes), Hq, Hkv, seed=5)

    def shard(
        t: Tensor,
    ) -> Tensor:  # (B, S, ...) -> [rank, B, m, ...]: each rank's tokens, padded to m rows
        return torch.stack(
            [
                torch.cat([c, c.new_zeros(c.shape[0], m - c.shape[1], *c.shape[2:])], dim=1)
                for c in torch.split(t, sizes, dim=1)
            ]
        )

    leaves = [shard(t).requires_grad_() for t in (q, k, v)] + [
        wo.expand(3, *wo.shape).clone().requires_grad_()
    ]
    out = fd.simulate(
        lambda q, k, v, wo: projected(lambda q, k, v: att(q, k, v, seq_sizes=sizes))(q, k, v, wo),
        mesh,
    )(*leaves)
    ref = [t.clone().requires_grad_() for t in (q, k, v, wo)]
    want = projected(lambda q, k, v: oracle(q, k, v, causal))(*ref)
    torch.testing.assert_close(out, shard(want.detach()), **TOL)
    c = shard(torch.randn(want.shape, dtype=F64, generator=torch.Generator().manual_seed(1)))
    (out * c).sum().backward()
    (want * torch.cat([c[i, :, : sizes[i]] for i in range(3)], dim=1)).sum().backward()
    for got, r in zip(leaves[:3], ref[:3]):
        torch.testing.assert_close(got.grad, shard(r.grad), **TOL)
    # replicated wo: each rank has its tokens' share
    torch.testing.assert_close(leaves[3].grad.sum(0), ref[3].grad, **TOL)


# ============================================================================ ring and USP
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "axes, Hq, Hkv",
    [
        ({"sp": 2}, 4, 4),
        ({"sp": 2}, 4, 2),
        ({"sp": 2}, 4, 1),
        ({"sp": 4}, 6, 2),
        ({"sp": 4}, 3, 1),
        ({"dp": 2, "sp": 2}, 6, 3),
    ],
)
def test_ring_gqa(axes: dict[str, int], Hq: int, Hkv: int, causal: bool) -> None:
    mesh = fd.Mesh(axes)
    check(mesh, fd.nn.RingAttention(mesh, "sp", causal=causal), causal, Hq, Hkv, "sp")


def test_ring_carries_the_kv_heads_it_was_given() -> None:
    """The ring shifts k/v with Hkv heads, never a copy repeated to Hq heads."""
    mesh = fd.Mesh({"sp": 2})
    shifted: list[tuple[int, ...]] = []
    real = fd.ring_shift

    def spy(x: Tensor, *a: Any, **kw: Any) -> Tensor:
        shifted.append(tuple(x.shape))
        return real(x, *a, **kw)

    q, k, v, _ = inputs(1, 4, 4, 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fd.ops, "ring_shift", spy)
        fd.simulate(fd.nn.RingAttention(mesh, "sp", causal=True), mesh)(
            *(rearrange(t, "b (n s) h d -> n b s h d", n=2) for t in (q, k, v))
        )
    assert shifted and all(s[1] == 1 for s in shifted), shifted  # (B, Hkv, m, hd)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (3, 3), (4, 2), (4, 1), (6, 2)])
def test_usp_gqa(Hq: int, Hkv: int, causal: bool) -> None:
    mesh = fd.Mesh({"ring": 2, "uly": 2})
    check(
        mesh,
        fd.nn.USPAttention(mesh, "uly", "ring", causal=causal),
        causal,
        Hq,
        Hkv,
        ("ring", "uly"),
    )


@settings(max_examples=12)
@given(
    n=st.sampled_from([1, 2, 4]),
    Hkv=st.sampled_from([1, 2, 3, 4]),
    g=st.integers(1, 3),
    S=st.integers(1, 2),
    causal=st.booleans(),
    kind=st.sampled_from(["ulysses", "ring"]),
)
def test_sequence_parallel_gqa_any_layout(
    n: int, Hkv: int, g: int, S: int, causal: bool, kind: str
) -> None:
    """Any Hq = g * Hkv: ring always matches the oracle; Ulysses matches it or raises MeshError."""
    mesh, Hq = fd.Mesh({"sp": n}), g * Hkv
    layer = (
        fd.nn.UlyssesAttention(mesh, "sp", causal=causal)
        if kind == "ulysses"
        else fd.nn.RingAttention(mesh, "sp", causal=causal)
    )
    if kind == "ulysses" and not ulysses_supported(Hq, Hkv, n):
        with pytest.raises(fd.MeshError, match=f"UlyssesAttention.*Hq={Hq}.*Hkv={Hkv}"):
            check(mesh, layer, causal, Hq, Hkv, "sp", S_local=S)
    else:
        check(mesh, layer, causal, Hq, Hkv, "sp", S_local=S, seed=n + Hq)


# ============================================================================ errors
def shards(mesh: fd.Mesh, *shapes: tuple[int, ...]) -> list[Tensor]:
    return [torch.zeros(mesh.size, *s, dtype=F64) for s in shapes]


@pytest.mark.parametrize(
    "shapes, what",
    [
        (((1, 4, 4, 3), (1, 4, 3, 3), (1, 4, 3, 3)), r"Hq=4.*Hkv=3"),  # Hq % Hkv != 0
        # k and v head counts differ
        (
            ((1, 4, 4, 3), (1, 4, 2, 3), (1, 4, 1, 3)),
            r"k has 2 heads.*v has 1",
        ),
        (((1, 4, 4, 3), (1, 4, 2, 2), (1, 4, 2, 2)), r"head_dim"),  # q and k head_dim differ
        (((2, 4, 4, 3), (1, 4, 2, 3), (1, 4, 2, 3)), r"batch"),  # batch differs
    ],
)
def test_local_attention_rejects_head_mismatch(
    shapes: tuple[tuple[int, ...], ...], what: str
) -> None:
    q, k, v = (torch.zeros(*s, dtype=F64) for s in shapes)
    with pytest.raises(fd.MeshError, match=rf"local_attention.*{what}") as e:
        fd.nn.local_attention(q, k, v)
    assert str(tuple(shapes[0])) in str(e.value) and "fix" in str(e.value).lower()


@pytest.mark.parametrize("n, Hq, Hkv", [(2, 4, 3), (4, 6, 2), (4, 12, 6), (4, 2, 1)])
def test_ulysses_rejects_unsupported_layout(n: int, Hq: int, Hkv: int) -> None:
    """Hq % Hkv != 0; Hq % n != 0 with GQA; Hkv neither a multiple nor a divisor of n."""
    mesh = fd.Mesh({"sp": n})
    with pytest.raises(fd.MeshError, match=rf"UlyssesAttention.*Hq={Hq}.*Hkv={Hkv}") as e:
        fd.simulate(fd.nn.UlyssesAttention(mesh, "sp"), mesh)(
            *shards(mesh, (1, 2, Hq, 3), (1, 2, Hkv, 3), (1, 2, Hkv, 3))
        )
    assert "fix" in str(e.value).lower()
    if Hq % Hkv == 0:
        assert f"n={n}" in str(e.value)


def test_ring_rejects_unsupported_layout() -> None:
    mesh = fd.Mesh({"sp": 2})
    with pytest.raises(fd.MeshError, match=r"RingAttention.*Hq=4.*Hkv=3"):
        fd.simulate(fd.nn.RingAttention(mesh, "sp"), mesh)(
            *shards(mesh, (1, 2, 4, 3), (1, 2, 3, 3), (1, 2, 3, 3))
        )
    with pytest.raises(fd.MeshError, match=r"RingAttention.*k has 2 heads.*v has 1"):
        fd.simulate(fd.nn.RingAttention(mesh, "sp"), mesh)(
            *shards(mesh, (1, 2, 4, 3), (1, 2, 2, 3), (1, 2, 1, 3))
        )


def test_usp_rejects_unsupported_layout() -> None:
    mesh = fd.Mesh({"ring": 2, "uly": 2})
    att = fd.nn.USPAttention(mesh, "uly", "ring")
    # Hkv neither a multiple nor a divisor of 2
    with pytest.raises(fd.MeshError, match=r"USPAttention.*Hq=6.*Hkv=3.*n=2"):
        fd.simulate(att, mesh)(*shards(mesh, (1, 2, 6, 3), (1, 2, 3, 3), (1, 2, 3, 3)))
    with pytest.raises(fd.MeshError, match=r"USPAttention.*Hq=4.*Hkv=3"):
        fd.simulate(att, mesh)(*shards(mesh, (1, 2, 4, 3), (1, 2, 3, 3), (1, 2, 3, 3)))
