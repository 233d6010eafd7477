"""Context parallelism of an unmodified diffusers ``WanTransformer3DModel`` (issue 38, first
slice): its tokens split over ``sp`` (Ulysses self-attention), forward and backward against the
same model on one device, on simulated ranks and on 2 gloo processes; and the refusals.

The model is float64, but Wan computes its norms (``FP32LayerNorm``) and modulation
(``.float()``) in float32 on purpose: gradients summed over the ranks' tokens in another order
differ from one device's by float32 rounding, hence a tolerance of 1e-6 of each gradient's
largest entry (the forward is exact).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fastdist as fd
from fastdist.errors import MeshError, ParallelizeError
from tests.tiny_models import tiny_wan

# at collection: diffusers' import takes seconds, which no single test should be charged
wan_module = pytest.importorskip("diffusers.models.transformers.transformer_wan")

N = 2  # the sp size


def inputs(frames: int = 2, size: int = 4, seed: int = 1) -> dict[str, Tensor]:
    """Latents (2 samples, 4 channels, ``frames`` x ``size`` x ``size``: ``frames * (size/2)^2``
    tokens), one timestep per sample, 5 text tokens."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(2, 4, frames, size, size, generator=g, dtype=torch.float64),
        "timestep": torch.tensor([3.0, 700.0], dtype=torch.float64),
        "encoder_hidden_states": torch.randn(2, 5, 16, generator=g, dtype=torch.float64),
    }


def reference(model: nn.Module, x: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """One device: the output and the gradient of ``sum(out**2)`` by parameter name."""
    out = model(**x).sample
    out.pow(2).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]


def assert_grads(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, g in want.items():
        err = float((got[name] - g).abs().max() / g.abs().max())  # relative to the largest entry
        assert err < 1e-6, f"{name}: {err:.2e}"


def run_simulated(pm: Any, x: dict[str, Tensor], n: int = N) -> Tensor:
    """Every rank's output (each of the ``n`` ranks gets the same inputs); backward of each
    rank's ``sum(out**2)``."""
    out = pm(**{k: v.expand(n, *v.shape) for k, v in x.items()}).sample  # (n, *out)
    out.pow(2).sum().backward()
    return out.detach()


def test_wan_ulysses_equals_one_device_simulated() -> None:
    model, x = tiny_wan(), inputs()
    out, grads = reference(copy.deepcopy(model), x)
    pm = fd.nn.parallelize(model, fd.Mesh({"sp": N}))  # the ready plan (fd.nn.plans.wan)
    assert pm.plan == fd.nn.plans.wan(axis="sp")
    assert type(model.blocks[0].attn1.processor).__name__ == "SplitProcessor"
    got = run_simulated(pm, x)
    for r in range(N):
        torch.testing.assert_close(got[r], out, rtol=0, atol=1e-12)
    assert_grads(pm.grads(), grads)


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_wan_attention_swapped_without_a_mode(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Wan's processor reaches its attention through diffusers' ``dispatch_attention_fn`` only:
    the swap replaces that call directly (no ``TorchFunctionMode`` sees a torch call), with
    outputs and gradients bit-equal to the mode's; another backend (``_native_math``) still runs
    under the mode, as before."""
    from fastdist.nn.styles.ring_split import AttentionSwap, DispatchSwap

    seen: list[Any] = []
    original = AttentionSwap.__torch_function__

    def counted(self: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(func)
        return original(self, func, *args, **kwargs)

    monkeypatch.setattr(AttentionSwap, "__torch_function__", counted)
    x = inputs()
    results = []
    for direct in (True, False):
        model = tiny_wan()
        pm = fd.nn.parallelize(model, fd.Mesh({"sp": N}), fd.nn.plans.wan(mode=mode))
        processor = model.blocks[0].attn1.processor
        assert DispatchSwap.fits(processor.inner)
        copied = copy.deepcopy(pm).module.blocks[0].attn1.processor  # a copy swaps in the copy
        assert copied.direct.inner is copied.inner is not processor.inner
        if not direct:
            for block in model.blocks:
                block.attn1.processor.direct = None  # the mode, as before this swap
        seen.clear()
        out = run_simulated(pm, x)
        assert (len(seen) == 0) == direct, len(seen)
        results.append((out, pm.grads()))
    (out, grads), (old_out, old_grads) = results
    assert torch.equal(out, old_out)
    assert all(torch.equal(grads[k], old_grads[k]) for k in grads)
    # set_attention_backend also sets diffusers' active backend process-wide: restored after
    registry = pytest.importorskip("diffusers.models.attention_dispatch")._AttentionBackendRegistry
    monkeypatch.setattr(registry, "_active_backend", registry._active_backend)
    model.set_attention_backend("_native_math")  # not the native one: dispatched under the mode
    for block in model.blocks:
        block.attn1.processor.direct = DispatchSwap(block.attn1.processor.inner, "attn1")
    seen.clear()
    with torch.no_grad():
        math = pm(**{k: v.expand(N, *v.shape) for k, v in x.items()}).sample
    assert seen and torch.allclose(math, out, rtol=0, atol=1e-12)
    assert not DispatchSwap.fits(wan_module.WanAttnProcessor) and not DispatchSwap.fits(object())


def test_wan_auto_uses_the_plan_and_verifies() -> None:
    model, x = tiny_wan(layers=1), inputs()
    with pytest.raises(ParallelizeError, match="takes no input_ids"):
        fd.nn.parallelize(copy.deepcopy(model), fd.Mesh({"sp": N}), "auto")  # verify needs inputs
    out, grads = reference(copy.deepcopy(model), x)
    pm = fd.nn.parallelize(model, fd.Mesh({"sp": N}), "auto", verify=x)
    assert pm.plan == fd.nn.plans.wan(axis="sp")
    got = run_simulated(pm, x)
    torch.testing.assert_close(got[1], out, rtol=0, atol=1e-12)
    assert_grads(pm.grads(), grads)


@pytest.mark.parametrize("frames,size,sp", [(2, 6, 4), (2, 10, 4)])
def test_wan_auto_verifies_uneven_tokens(frames: int, size: int, sp: int) -> None:
    """verify=True accepts the ready plan when the tokens do not divide by sp (18 and 50 tokens
    over 4 ranks: blocks of 5,5,4,4 and 13,13,12,12, balanced, each padded at its end), and the
    model equals one device."""
    model, x = tiny_wan(heads=4, layers=1), inputs(frames, size)
    out, grads = reference(copy.deepcopy(model), x)
    pm = fd.nn.parallelize(model, fd.Mesh({"sp": sp}), "auto", verify=x)
    got = run_simulated(pm, x, sp)
    torch.testing.assert_close(got[sp - 1], out, rtol=0, atol=1e-12)
    assert_grads(pm.grads(), grads)


def test_refusals() -> None:
    mesh = fd.Mesh({"sp": N})
    with pytest.raises(ParallelizeError, match="3 heads, which the 2 ranks of 'sp' do not divide"):
        fd.nn.parallelize(tiny_wan(heads=3, layers=1), mesh)
    with pytest.raises(ParallelizeError, match="lacks"):
        fd.nn.parallelize(tiny_wan(layers=1), fd.Mesh({"tp": N}), "auto")
    forgot = {"": fd.nn.ContextParallel("sp", cross=())}  # attn2 would silently stay local
    with pytest.raises(ParallelizeError, match=r"blocks\.0\.attn2 .* ContextParallel was not"):
        fd.nn.parallelize(tiny_wan(layers=1), mesh, forgot)
    fused = tiny_wan(layers=1)
    fused.blocks[0].attn1.fuse_projections()
    with pytest.raises(ParallelizeError, match="unfuse_projections"):
        fd.nn.parallelize(fused, mesh)
    with pytest.raises(MeshError, match="unknown mesh axis 'sp'"):
        fd.nn.plans.wan(mesh=fd.Mesh({"dp": 2}))
    # uneven tokens, per-token timesteps and the other modes: tests/test_context_modes.py


# ------------------------------------------------------------------ real ranks
def wan_on_gloo() -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """One gloo rank of sp=2: the whole output and every parameter's single-device gradient;
    then the output of the same model under ``torch.compile``."""
    mesh = fd.connect(sp=torch.distributed.get_world_size(), timeout=120)
    pm = fd.nn.parallelize(tiny_wan(heads=4), mesh)  # 2 heads per rank (1 would raise, not err)
    out = pm(**inputs()).sample
    out.pow(2).sum().backward()
    with torch.no_grad():
        compiled = torch.compile(pm)(**inputs()).sample
        torch._dynamo.reset()
        # graphs of torch functions: the attention swap's mode swapped their attention again
        eager_graphs = torch.compile(pm, backend="eager")(**inputs()).sample
    return out.detach(), pm.grads(), torch.stack([compiled, eager_graphs])


def test_wan_ulysses_on_gloo() -> None:
    """Eager: exact; compiled (the attention swap traced by dynamo: it failed with an
    AttributeError before): within float32 rounding (Wan's float32 norms, fused); compiled with
    ``backend="eager"``: 0.09 off before (each graph's attention split twice), exact now."""
    from tests.dist_harness import run_on_gloo

    out, grads = reference(tiny_wan(heads=4), inputs())
    for got, got_grads, compiled in run_on_gloo(wan_on_gloo, N, timeout=300):
        torch.testing.assert_close(got, out, rtol=0, atol=1e-12)
        assert_grads(got_grads, grads)
        torch.testing.assert_close(compiled[0], out, rtol=0, atol=1e-6)
        torch.testing.assert_close(compiled[1], out, rtol=0, atol=1e-12)
