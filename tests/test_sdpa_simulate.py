"""F.scaled_dot_product_attention under fastdist.simulate: one batched kernel call, no warning,
per-rank values and gradients."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import fastdist as fd
from fastdist import P

F64 = torch.float64
W, B, H, HKV, L, S, E = 2, 2, 4, 2, 5, 7, 8
MESH = fd.Mesh({"tp": W})
FLASH = "aten._scaled_dot_product_flash_attention_for_cpu.default"
FLASH_BWD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"


class KernelCalls(TorchDispatchMode):
    """Records the fused attention kernels that run (below vmap: physical shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if "flash_attention" in str(func):
            self.calls.append((str(func), tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


@contextmanager
def no_warnings() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    assert not caught, [str(w.message)[:160] for w in caught]


def rand(*shape: int, seed: int, grad: bool = True) -> Tensor:
    return torch.randn(
        *shape, dtype=F64, generator=torch.Generator().manual_seed(seed)
    ).requires_grad_(grad)


def bool_mask(*shape: int, seed: int) -> Tensor:
    m = torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) > 0.3
    m[..., 0] = True  # no fully masked row (its softmax is nan on every backend)
    return m


def call(
    inputs: dict[str, tuple[Tensor | None, bool]], kw: dict[str, Any]
) -> tuple[Callable[..., Tensor], list[Tensor]]:
    """Per-rank fn over the inputs marked per-rank (leading rank dim); the others are closed over,
    the same on every rank."""
    names = ["q", "k", "v", "mask"]
    ranked = [n for n in names if inputs[n][0] is not None and inputs[n][1]]

    def fn(*xs: Tensor) -> Tensor:
        got = dict(zip(ranked, xs))
        t = {n: got.get(n, inputs[n][0]) for n in names}
        return F.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=t["mask"], **kw)

    return fn, [inputs[n][0] for n in ranked]  # type: ignore[misc]


def per_rank_loop(inputs: dict[str, tuple[Tensor | None, bool]], kw: dict[str, Any]) -> Tensor:
    outs = []
    for r in range(W):
        t = {
            n: (x[r] if ranked else x) if x is not None else None
            for n, (x, ranked) in inputs.items()
        }
        outs.append(
            F.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=t["mask"], **kw)
        )
    return torch.stack(outs)


def weighted(out: Tensor) -> Tensor:
    return (out * torch.linspace(-1, 2, out.numel(), dtype=F64).reshape(out.shape)).sum()


def leaves(inputs: dict[str, tuple[Tensor | None, bool]]) -> list[Tensor]:
    return [x for x, _ in inputs.values() if x is not None and x.requires_grad]


# name: (q, k, v, mask as (tensor, per rank?)), kwargs, fused kernel expected
CASES: dict[str, tuple[dict[str, tuple[Tensor | None, bool]], dict[str, Any], bool]] = {
    "causal": (
        {
            "q": (rand(W, B, H, L, E, seed=0), True),
            "k": (rand(W, B, H, L, E, seed=1), True),
            "v": (rand(W, B, H, L, E, seed=2), True),
            "mask": (None, False),
        },
        {"is_causal": True},
        True,
    ),
    "q replicated, scale": (
        {
            "q": (rand(B, H, L, E, seed=3), False),
            "k": (rand(W, B, H, S, E, seed=4), True),
            "v": (rand(W, B, H, S, E, seed=5), True),
            "mask": (None, False),
        },
        {"scale": 0.3},
        True,
    ),
    "kv replicated, float mask (L, S) replicated": (
        {
            "q": (rand(W, B, H, L, E, seed=6), True),
            "k": (rand(B, H, S, E, seed=7), False),
            "v": (rand(B, H, S, E, seed=8), False),
            "mask": (rand(L, S, seed=9, grad=False), False),
        },
        {},
        True,
    ),
    "float mask (L, S) per rank": (
        {
            "q": (rand(W, B, H, L, E, seed=10), True),
            "k": (rand(W, B, H, S, E, seed=11), True),
            "v": (rand(W, B, H, S, E, seed=12), True),
            "mask": (rand(W, L, S, seed=13, grad=False), True),
        },
        {},
        True,
    ),
    "bool mask (B, 1, L, S) per rank": (
        {
            "q": (rand(W, B, H, L, E, seed=14), True),
            "k": (rand(W, B, H, S, E, seed=15), True),
            "v": (rand(W, B, H, S, E, seed=16), True),
            "mask": (bool_mask(W, B, 1, L, S, seed=17), True),
        },
        {},
        True,
    ),
    "bool mask (B, H, L, S) replicated": (
        {
            "q": (rand(W, B, H, L, E, seed=18), True),
            "k": (rand(W, B, H, S, E, seed=19), True),
            "v": (rand(W, B, H, S, E, seed=20), True),
            "mask": (bool_mask(B, H, L, S, seed=21), False),
        },
        {},
        True,
    ),
    "gqa, causal": (
        {
            "q": (rand(W, B, H, L, E, seed=22), True),
            "k": (rand(W, B, HKV, L, E, seed=23), True),
            "v": (rand(W, B, HKV, L, E, seed=24), True),
            "mask": (None, False),
        },
        {"is_causal": True, "enable_gqa": True},
        True,
    ),
    "gqa, float mask (1, 1, L, S) per rank": (
        {
            "q": (rand(W, B, H, L, E, seed=25), True),
            "k": (rand(W, B, HKV, S, E, seed=26), True),
            "v": (rand(W, B, HKV, S, E, seed=27), True),
            "mask": (rand(W, 1, 1, L, S, seed=28, grad=False), True),
        },
        {"enable_gqa": True},
        True,
    ),
    # one rank gets the math backend here; so does the simulation (ops vmap batches), with the same
    # values
    "math: mask requiring grad": (
        {
            "q": (rand(W, B, H, L, E, seed=29), True),
            "k": (rand(W, B, H, S, E, seed=30), True),
            "v": (rand(W, B, H, S, E, seed=31), True),
            "mask": (rand(W, B, 1, L, S, seed=32), True),
        },
        {},
        False,
    ),
    "math: 3-d q/k/v": (
        {
            "q": (rand(W, H, L, E, seed=33), True),
            "k": (rand(W, H, S, E, seed=34), True),
            "v": (rand(W, H, S, E, seed=35), True),
            "mask": (bool_mask(W, L, S, seed=36), True),
        },
        {},
        False,
    ),
    "math: 3-d mask": (
        {
            "q": (rand(W, B, H, L, E, seed=37), True),
            "k": (rand(W, B, H, S, E, seed=38), True),
            "v": (rand(W, B, H, S, E, seed=39), True),
            "mask": (rand(W, H, L, S, seed=40, grad=False), True),
        },
        {},
        False,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outer_backward_equals_the_per_rank_loop(case: str) -> None:
    """Values and per-rank gradients (out.sum().backward() outside) bit for bit; the fused kernel
    runs once, folded."""
    inputs, kw, fused = CASES[case]
    fn, args = call(inputs, kw)
    with no_warnings(), KernelCalls() as k:
        out = fd.simulate(fn, MESH)(*args)
        grads = torch.autograd.grad(weighted(out), leaves(inputs))
    ref = per_rank_loop(inputs, kw)
    want = torch.autograd.grad(weighted(ref), leaves(inputs))
    assert torch.equal(out, ref)
    for g, w in zip(grads, want):
        assert torch.equal(g, w)
    q = inputs["q"][0]
    assert q is not None
    folded = (W * B, *q.shape[-3:])
    # one call forward, one backward
    assert k.calls == ([(FLASH, folded), (FLASH_BWD, folded)] if fused else [])


def test_func_grad_inside_simulate_uses_the_math_backend() -> None:
    """torch.func.grad inside simulate: its tensors cannot be unwrapped; torch's math backend
    batches without a warning."""
    inputs, kw, _ = CASES["gqa, float mask (1, 1, L, S) per rank"]
    q, k, v, m = (inputs[n][0] for n in ("q", "k", "v", "mask"))

    def per_rank(q: Tensor, k: Tensor, v: Tensor, m: Tensor) -> tuple[Tensor, ...]:
        return torch.func.grad(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m, **kw).sin().sum(),
            argnums=(0, 1, 2),
        )(q, k, v)

    with no_warnings():
        got = fd.simulate(per_rank, MESH)(q, k, v, m)
    for r in range(W):
        want = torch.autograd.grad(
            F.scaled_dot_product_attention(q[r], k[r], v[r], attn_mask=m[r], **kw).sin().sum(),  # type: ignore[index]
            (q, k, v),
        )
        for g, w in zip(got, want):
            torch.testing.assert_close(g[r], w[r], rtol=1e-12, atol=1e-12)


def test_vmap_of_func_grad_around_simulate() -> None:
    """vmap(grad(simulate)): simulate's vmap sits under a grad transform, out of reach; the math
    backend, no warning."""
    qs = rand(3, W, B, H, L, E, seed=50, grad=False)
    f = fd.simulate(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), MESH)
    with no_warnings():
        got = torch.vmap(torch.func.grad(lambda q: f(q).sin().sum()))(qs)
    for i in range(3):
        q = qs[i].clone().requires_grad_()
        loss = (
            torch.stack(
                [F.scaled_dot_product_attention(q[r], q[r], q[r], is_causal=True) for r in range(W)]
            )
            .sin()
            .sum()
        )
        torch.testing.assert_close(got[i], torch.autograd.grad(loss, q)[0], rtol=1e-12, atol=1e-12)


def test_func_grad_and_vmap_around_simulate_are_folded() -> None:
    inputs, kw, _ = CASES["bool mask (B, 1, L, S) per rank"]
    q, k, v, m = (inputs[n][0] for n in ("q", "k", "v", "mask"))
    fn = fd.simulate(
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, **kw), MESH
    )
    with no_warnings():
        g = torch.func.grad(lambda q: weighted(fn(q, k, v, m)))(q)
    assert torch.equal(g, torch.autograd.grad(weighted(per_rank_loop(inputs, kw)), q)[0])
    # vmap over simulate (an ensemble of 3 simulations): both vmapped dims fold into the batch
    qs, ks, vs = (torch.stack([t.detach() * (1 + i) for i in range(3)]) for t in (q, k, v))  # type: ignore[union-attr]
    with no_warnings(), KernelCalls() as calls:
        out = torch.vmap(fn, in_dims=(0, 0, 0, None))(qs, ks, vs, m)
    assert calls.calls == [(FLASH, (3 * W * B, H, L, E))]
    for i in range(3):
        assert torch.equal(
            out[i],
            torch.stack(
                [
                    F.scaled_dot_product_attention(qs[i, r], ks[i, r], vs[i, r], attn_mask=m[r])  # type: ignore[index]
                    for r in range(W)
                ]
            ),
        )


def test_vmap_inside_simulate_is_folded_too() -> None:
    x = rand(W, 3, B, H, L, E, seed=41, grad=False)
    f = fd.simulate(
        lambda x: torch.vmap(lambda y: F.scaled_dot_product_attention(y, y, y, is_causal=True))(x),
        MESH,
    )
    with no_warnings(), KernelCalls() as calls:
        out = f(x)
    assert calls.calls == [(FLASH, (W * 3 * B, H, L, E))]
    assert torch.equal(
        out,
        torch.stack(
            [
                torch.stack([F.scaled_dot_product_attention(y, y, y, is_causal=True) for y in xr])
                for xr in x
            ]
        ),
    )


@pytest.mark.parametrize(
    "case", ["gqa, causal", "bool mask (B, H, L, S) replicated", "float mask (L, S) per rank"]
)
def test_compiled_forward_and_backward_equal_eager(case: str) -> None:
    """torch.compile(simulate(...), fullgraph=True): no graph break, no batching-rule warning,
    eager's values and gradients."""
    torch._dynamo.reset()
    inputs, kw, _ = CASES[case]
    fn, args = call(inputs, kw)
    out = fd.simulate(fn, MESH)(*args)
    want = torch.autograd.grad(weighted(out), leaves(inputs))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cout = torch.compile(fd.simulate(fn, MESH), fullgraph=True)(*args)
        grads = torch.autograd.grad(weighted(cout), leaves(inputs))
    assert not [
        w
        for w in caught
        if "batching rule" in str(w.message) or "graph break" in str(w.message).lower()
    ], [str(w.message)[:160] for w in caught]
    torch.testing.assert_close(cout, out, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("check", ["insert", "error"])
def test_checked_spmd_with_sdpa(check: str) -> None:
    """spmd's checked mode (its own TorchFunctionMode) sees SDPA as one op; the kernel still runs
    once over the ranks."""
    q, k, v = rand(B, H, L, E, seed=42), rand(B, HKV, L, E, seed=43), rand(B, HKV, L, E, seed=44)
    m = rand(L, L, seed=45, grad=False)
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    f = fd.spmd(
        fn,
        MESH,
        in_specs=(P(None, "tp"), P(None, "tp"), P(None, "tp"), P()),
        out_specs=P(None, "tp"),
        check=check,  # type: ignore[arg-type]
    )
    with no_warnings(), KernelCalls() as calls:
        out = f(q, k, v, m)
        grads = torch.autograd.grad(weighted(out), (q, k, v))
    assert calls.calls[0] == (FLASH, (W * B, H // W, L, E))
    ref = fn(q, k, v, m)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, torch.autograd.grad(weighted(ref), (q, k, v))):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    # a replicated q (invariant, requiring grad) meeting sharded k/v: "insert" adds the pvary,
    # "error" names the line
    qr = rand(B, H // W, L, E, seed=46)
    g = fd.spmd(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        MESH,
        in_specs=(P(), P(None, "tp"), P(None, "tp")),
        out_specs=P(None, "tp"),
        check=check,  # type: ignore[arg-type]
    )
    if check == "error":
        with pytest.raises(fd.ReplicationError, match="scaled_dot_product_attention"):
            g(qr, k[:, : H // W].detach(), v[:, : H // W].detach())  # type: ignore[index]
        return
    kk, vv = rand(B, H, L, E, seed=47), rand(B, H, L, E, seed=48)
    out = g(qr, kk, vv)
    got = torch.autograd.grad(weighted(out), (qr, kk, vv))
    ref = torch.cat(
        [
            F.scaled_dot_product_attention(
                qr, kk[:, i * 2 : (i + 1) * 2], vv[:, i * 2 : (i + 1) * 2]
            )
            for i in range(W)
        ],
        dim=1,
    )
    assert torch.equal(out, ref)
    for a, b in zip(got, torch.autograd.grad(weighted(ref), (qr, kk, vv))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_dropout_follows_vmap_randomness() -> None:
    """dropout_p > 0 goes through torch's math backend under vmap: randomness="different" gives each
    rank its own mask, "same" one mask for all, "error" vmap's error."""
    q = rand(B, H, L, E, seed=49, grad=False).expand(W, B, H, L, E)  # every rank the same inputs
    v = torch.ones(W, B, H, L, E, dtype=F64)
    fn = lambda q, v: F.scaled_dot_product_attention(q, q, v, dropout_p=0.5)
    torch.manual_seed(0)
    with no_warnings():
        diff, same = (
            fd.simulate(fn, MESH, randomness="different")(q, v),
            fd.simulate(fn, MESH, randomness="same")(q, v),
        )
    assert not torch.equal(diff[0], diff[1]) and torch.equal(same[0], same[1])
    no_drop = F.scaled_dot_product_attention(q[0], q[0], v[0])
    assert not torch.equal(same[0], no_drop)
    with pytest.raises(RuntimeError, match="randomness"):
        fd.simulate(fn, MESH)(q, v)


def test_batch_sdpa_false_leaves_no_mode() -> None:
    seen = []
    f = lambda x: seen.append(torch._C._is_torch_function_mode_enabled()) or x * 2
    fd.simulate(f, MESH)(torch.ones(W))
    fd.simulate(f, MESH, batch_sdpa=False)(torch.ones(W))
    assert seen == [True, False]
    assert not torch._C._is_torch_function_mode_enabled()  # popped after the call


def test_hf_llama_sdpa_under_simulate() -> None:
    """An unmodified transformers Llama (attn_implementation "sdpa") on stacked replicated
    parameters: no warning, the plain model's logits and gradients on every rank."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg).to(F64).eval()
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 64, (W, 2, 8), generator=torch.Generator().manual_seed(1))
    params = {
        n: p.detach().expand(W, *p.shape).clone().requires_grad_()
        for n, p in model.named_parameters()
    }
    f = fd.simulate(
        lambda p, ids: torch.func.functional_call(model, p, (), {"input_ids": ids}).logits, MESH
    )
    with no_warnings(), KernelCalls() as calls:
        logits = f(params, ids)
        grads = torch.autograd.grad(weighted(logits), list(params.values()))
    assert [c for c in calls.calls if "backward" not in c[0]] == [
        (FLASH, (W * 2, 4, 8, 8))
    ] * 2  # one call per layer, all ranks
    for r in range(W):
        model.zero_grad()
        want = model(input_ids=ids[r]).logits
        torch.testing.assert_close(logits[r], want, rtol=1e-12, atol=1e-12)
        c = torch.linspace(-1, 2, logits.numel(), dtype=F64).reshape(logits.shape)[r]
        (want * c).sum().backward()
        for (name, p), g in zip(model.named_parameters(), grads):
            torch.testing.assert_close(g[r], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_print_speed_against_the_per_rank_loop(capsys: Any) -> None:
    """Not a timed assert: prints simulated SDPA (one folded call) against torch's per-rank loop
    (batch_sdpa=False)."""
    lines = []
    for world, (b, h, seq, e) in [
        (2, (2, 4, 8, 8)),
        (8, (2, 4, 8, 8)),
        (2, (2, 8, 256, 64)),
        (8, (1, 8, 256, 64)),
    ]:
        mesh = fd.Mesh({"tp": world})
        q, k, v = (torch.randn(world, b, h, seq, e) for _ in range(3))
        fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        folded, loop = fd.simulate(fn, mesh), fd.simulate(fn, mesh, batch_sdpa=False)
        times: dict[str, list[float]] = {"folded": [], "loop": []}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(12):
                for name, f in (
                    (("folded", folded), ("loop", loop))
                    if i % 2
                    else (("loop", loop), ("folded", folded))
                ):
                    t = time.perf_counter()
                    f(q, k, v)
                    times[name].append(time.perf_counter() - t)
        med = {n: sorted(ts[2:])[len(ts[2:]) // 2] * 1e6 for n, ts in times.items()}
        lines.append(
            f"world={world} q={(b, h, seq, e)} float32: folded {med['folded']:.0f} us, per-rank "
            f"loop {med['loop']:.0f} us, speedup {med['loop'] / med['folded']:.2f}x"
        )
    with capsys.disabled():
        print("\nsimulated SDPA forward:\n  " + "\n  ".join(lines))
