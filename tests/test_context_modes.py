"""Context parallelism of an unmodified diffusers ``WanTransformer3DModel`` in every attention
mode (issue 38): ring and USP (Ulysses x ring over two axes) next to Ulysses, at 2 and 4 ranks;
token counts the ranks do not divide; per-token timesteps (Wan 2.2 TI2V); heads Ulysses cannot
split. Forward and backward against the same model on one device in float64 (the tolerance of
the gradients is explained in tests/test_context_parallel.py: Wan's float32 norms).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fastdist as fd
from fastdist.errors import ParallelizeError
from tests.test_context_parallel import assert_grads, inputs, reference
from tests.tiny_models import tiny_wan

#: (mesh axes, plan keywords) of each mode
MODES: dict[str, tuple[dict[str, int], dict[str, Any]]] = {
    "ulysses-4": ({"sp": 4}, {"mode": "ulysses"}),
    "ring-2": ({"sp": 2}, {"mode": "ring"}),
    "ring-4": ({"sp": 4}, {"mode": "ring"}),
    "usp-2x2": ({"cp": 2, "sp": 2}, {"mode": "usp", "ring_axis": "cp"}),
}


def run(pm: Any, x: dict[str, Tensor], n: int) -> Tensor:
    """Every simulated rank's output (each rank gets the same inputs); backward of the sum of
    each rank's ``sum(out**2)``."""
    out = pm(**{k: v.expand(n, *v.shape) for k, v in x.items()}).sample  # (n, *out)
    out.pow(2).sum().backward()
    return out.detach()


def check_mode(mode: str, x: dict[str, Tensor], heads: int = 4) -> None:
    axes, kw = MODES[mode]
    n = int(torch.tensor(list(axes.values())).prod())
    model = tiny_wan(heads=heads)
    out, grads = reference(copy.deepcopy(model), x)
    plan = {"": fd.nn.ContextParallel("sp", **kw)}
    pm = fd.nn.parallelize(model, fd.Mesh(axes), plan)
    got = run(pm, x, n)
    for r in range(n):
        torch.testing.assert_close(got[r], out, rtol=0, atol=1e-12)
    assert_grads(pm.grads(), grads)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_modes_equal_one_device(mode: str) -> None:
    """8 tokens (2 frames x 2 x 2 patches) over 2 or 4 ranks."""
    check_mode(mode, inputs())


@pytest.mark.parametrize("mode", ["ulysses-4", "ring-2", "usp-2x2"])
def test_uneven_tokens_equal_one_device(mode: str) -> None:
    """6 tokens (3 frames x 1 x 2 patches): 3 + 3 over 2 ranks is even, 2+2+1+1 over 4 is not;
    9 tokens (1 frame x 3 x 3) over 2 ranks: 5 + 4."""
    g = torch.Generator().manual_seed(3)
    x = inputs()
    x["hidden_states"] = torch.randn(2, 4, 3, 2, 4, generator=g, dtype=torch.float64)  # 6 tokens
    check_mode(mode, x)
    x["hidden_states"] = torch.randn(2, 4, 1, 6, 6, generator=g, dtype=torch.float64)  # 9 tokens
    check_mode(mode, x)


def test_per_token_timesteps_equal_one_device() -> None:
    """Wan 2.2 TI2V's 2-d timestep (one per token): cut with the tokens (9 over 2 ranks); the
    text states, 9 tokens long too, stay whole."""
    g = torch.Generator().manual_seed(4)
    x = inputs()
    x["hidden_states"] = torch.randn(2, 4, 1, 6, 6, generator=g, dtype=torch.float64)
    x["timestep"] = torch.rand(2, 9, generator=g, dtype=torch.float64) * 1000
    x["encoder_hidden_states"] = torch.randn(2, 9, 16, generator=g, dtype=torch.float64)
    check_mode("ring-2", x)


def tiny_wan_i2v(
    layers: int = 2, video: dict[str, Tensor] | None = None
) -> tuple[nn.Module, dict[str, Tensor]]:
    """Wan image-to-video (``attn2``'s image projections ``add_k_proj``/``add_v_proj``, its
    ``norm_added_k`` over all heads), ``layers`` blocks of 4 heads of 12; the video latents and
    timestep of ``video`` (default `inputs`), 512 text tokens (the processor takes the last 512
    as the text), 3 image tokens."""
    model = tiny_wan(heads=4, layers=layers, i2v=True)
    g = torch.Generator().manual_seed(1)
    x = {
        **(video if video is not None else inputs()),
        "encoder_hidden_states": torch.randn(2, 512, 16, generator=g, dtype=torch.float64),
        "encoder_hidden_states_image": torch.randn(2, 3, 8, generator=g, dtype=torch.float64),
    }
    return model, x


def test_wan_image_to_video_equals_one_device() -> None:
    """Wan I2V: ``attn2`` also attends to the image states (``add_k_proj``), locally; 9 tokens
    over 2 ranks (ring). Wan's processor takes the last 512 text tokens as the text."""
    model, x = tiny_wan_i2v(video=nine_tokens())
    out, grads = reference(copy.deepcopy(model), x)
    pm = fd.nn.parallelize(model, fd.Mesh({"sp": 2}), fd.nn.plans.wan(mode="ring"))
    got = run(pm, x, 2)
    for r in range(2):
        torch.testing.assert_close(got[r], out, rtol=0, atol=1e-12)
    assert_grads(pm.grads(), grads)


def test_ring_takes_heads_ulysses_cannot_split() -> None:
    """3 heads over 2 ranks: Ulysses refuses naming the module and the fix; ring runs."""
    with pytest.raises(ParallelizeError, match=r"'blocks\.0\.attn1' .* 3 heads.*mode='ring'"):
        fd.nn.parallelize(tiny_wan(heads=3), fd.Mesh({"sp": 2}))
    check_mode("ring-2", inputs(), heads=3)


def test_mode_refusals() -> None:
    mesh = fd.Mesh({"cp": 2, "sp": 2})
    with pytest.raises(ParallelizeError, match="ring_axis=None"):
        fd.nn.parallelize(tiny_wan(layers=1), mesh, {"": fd.nn.ContextParallel(mode="usp")})
    bad = {"": fd.nn.ContextParallel(mode="ring", ring_axis="cp")}
    with pytest.raises(ParallelizeError, match="for mode='usp' only"):
        fd.nn.parallelize(tiny_wan(layers=1), mesh, bad)
    with pytest.raises(ParallelizeError, match="not a mode"):
        fd.nn.parallelize(tiny_wan(layers=1), mesh, {"": fd.nn.ContextParallel(mode="zigzag")})  # type: ignore[arg-type]
    pm = fd.nn.parallelize(tiny_wan(layers=1), fd.Mesh({"sp": 4}), fd.nn.plans.wan(mode="ring"))
    few = inputs(frames=1, size=2)  # 1 token over 4 ranks
    with pytest.raises(ParallelizeError, match="leaves a rank without tokens"):
        pm(**{k: v.expand(4, *v.shape) for k, v in few.items()})


def test_processor_guards(monkeypatch: pytest.MonkeyPatch) -> None:
    """The swap refuses a processor that calls the attention other than once, unmasked."""
    # set_attention_backend also sets diffusers' active backend process-wide: restored after
    registry = pytest.importorskip("diffusers.models.attention_dispatch")._AttentionBackendRegistry
    monkeypatch.setattr(registry, "_active_backend", registry._active_backend)
    model = tiny_wan(heads=4, layers=1)
    pm = fd.nn.parallelize(model, fd.Mesh({"sp": 2}), fd.nn.plans.wan(mode="ring"))
    processor = model.blocks[0].attn1.processor
    inner = processor.inner
    x = {k: v.expand(2, *v.shape) for k, v in inputs().items()}

    def twice(attn: Any, h: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        inner(attn, h, *args, **kwargs)
        return inner(attn, h, *args, **kwargs)  # type: ignore[no-any-return]

    def masked(attn: Any, h: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        q = h.unflatten(2, (4, -1)).transpose(1, 2)  # (B, H, S, D)
        mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    processor.inner = twice
    with pytest.raises(ParallelizeError, match=r"'blocks\.0\.attn1'.* 2 times, not once"):
        pm(**x)
    processor.inner = masked
    with pytest.raises(ParallelizeError, match=r"'blocks\.0\.attn1'.*\['attn_mask'\]"):
        pm(**x)
    processor.inner = inner
    model.set_attention_backend("_native_math")  # reaches the model's own processor
    assert inner._attention_backend is not None
    pm(**x)  # the math backend calls torch's attention too: swapped as before
    model.blocks[0].attn1.set_processor(type(inner)())
    with pytest.raises(ParallelizeError, match="processor was replaced after parallelize"):
        pm(**x)


# ------------------------------------------------------------------ real ranks
def usp_on_gloo() -> tuple[Tensor, dict[str, Tensor]]:
    """One gloo rank of cp=2 x sp=2 (USP), 9 tokens (uneven): the whole output and every
    parameter's single-device gradient."""
    mesh = fd.connect(cp=2, sp=2, timeout=120)
    pm = fd.nn.parallelize(tiny_wan(heads=4), mesh, fd.nn.plans.wan(mode="usp", ring_axis="cp"))
    out = pm(**nine_tokens()).sample
    out.pow(2).sum().backward()
    return out.detach(), pm.grads()


def nine_tokens() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        **inputs(),
        "hidden_states": torch.randn(2, 4, 1, 6, 6, generator=g, dtype=torch.float64),
    }


def test_wan_usp_uneven_on_gloo() -> None:
    from tests.dist_harness import run_on_gloo

    out, grads = reference(tiny_wan(heads=4), nine_tokens())
    for got, got_grads in run_on_gloo(usp_on_gloo, 4, timeout=300):
        torch.testing.assert_close(got, out, rtol=0, atol=1e-12)
        assert_grads(got_grads, grads)


def checkpointed_on_gloo() -> dict[str, Tensor]:
    """One gloo rank of sp=2 (ring), gradient checkpointing on: a forward of 9 tokens (5 + 4),
    then one of 10 (5 + 5), then the first one's backward, whose recomputed blocks must use the
    9-token split (the same 5 rows per rank, other padding)."""
    mesh = fd.connect(sp=torch.distributed.get_world_size(), timeout=120)
    model = tiny_wan(heads=4)
    model.enable_gradient_checkpointing()
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.wan(mode="ring"))
    first = pm(**nine_tokens()).sample
    pm(**ten_tokens()).sample.sum()  # a second forward in between, never backpropagated
    first.pow(2).sum().backward()
    return pm.grads()


def ten_tokens() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(6)
    return {
        **inputs(),
        "hidden_states": torch.randn(2, 4, 1, 4, 10, generator=g, dtype=torch.float64),
    }


def test_checkpointed_blocks_recompute_with_their_own_split_on_gloo() -> None:
    from tests.dist_harness import run_on_gloo

    _, grads = reference(tiny_wan(heads=4), nine_tokens())
    for got in run_on_gloo(checkpointed_on_gloo, 2, timeout=300):
        assert_grads(got, grads)


def test_block_signatures_follow_each_forward() -> None:
    """The hooks' kept signatures (`context_args.Signatures`) are those ``inspect.signature``
    gives, per forward function: a module whose ``forward`` is an instance attribute gets its
    own, and one whose attribute changes gets the new one (the block hook binds by name)."""
    import inspect

    from fastdist.nn.styles.context_args import Signatures

    sigs = Signatures()
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    assert sigs.of(a) == inspect.signature(a.forward) == sigs.of(b)
    b.forward = lambda x, scale=1.0: x * scale  # type: ignore[method-assign]
    assert list(sigs.of(b).parameters) == ["x", "scale"]
    b.forward = lambda rotary, x: x  # type: ignore[method-assign]
    assert list(sigs.of(b).parameters) == ["rotary", "x"]
    assert list(sigs.of(a).parameters) == ["input"]


def test_pvary_packed_without_a_graph_returns_its_inputs() -> None:
    """Under ``torch.no_grad()`` (no replication check) ``pvary_packed`` is the identity and
    copies nothing; recording a graph, its gradient is ``pvary``'s (summed over the axis)."""
    from fastdist.ops import pvary
    from fastdist.ops.packed import pvary_packed

    mesh = fd.Mesh({"sp": 2})
    a, b = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    with torch.no_grad():
        got = pvary_packed([a, None, b], mesh, "sp")
    assert got[0] is a and got[1] is None and got[2] is b

    grads = []
    for packed in (True, False):
        w = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        w.requires_grad_(True)

        def f(x: Tensor, w: Tensor = w, packed: bool = packed) -> Tensor:
            y = pvary_packed([w * 1.0], mesh, "sp")[0] if packed else pvary(w * 1.0, mesh, "sp")
            assert y is not None
            return (y * x).sum()

        x = torch.arange(6, dtype=torch.float64).view(2, 3)  # rank r: row r
        fd.simulate(f, mesh)(x).sum().backward()
        grads.append(w.grad)
    assert grads[0] is not None and grads[1] is not None
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    assert grads[0].abs().sum() > 0
