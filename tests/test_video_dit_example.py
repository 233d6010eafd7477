"""examples/video_dit.py and `fastdist.nn.GuidedModel` (issue 38.4): a denoising loop of a tiny
Wan model with diffusers' ``FlowMatchEulerDiscreteScheduler``, classifier-free guidance over a
``cfg`` axis and context parallelism over ``sp`` (and ``cp``), ends with the latents of the same
loop on one device; on simulated ranks (in this process) and under torchrun on gloo."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import fastdist as fd
from fastdist.errors import ParallelizeError
from tests.dist_harness import load_example, run_example_without_torchrun, torchrun_example

pytest.importorskip("diffusers")
ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def example() -> Any:
    return load_example("video_dit.py", "video_dit_example")


@pytest.mark.parametrize(
    "argv", [["--steps", "2"], ["--steps", "2", "--mode", "ring", "--sp", "4"], ["--mode", "usp"]]
)
def test_loop_equals_one_device_simulated(argv: list[str], capsys: Any) -> None:
    assert example().main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "OK"


def test_swapped_branches_are_caught() -> None:
    """The check can fail: guidance with the branches swapped ends elsewhere."""
    ex = example()
    args = ex.argparse.Namespace(steps=1, guidance=5.0, mode="ulysses", sp=2)
    model, (latents, cond, uncond) = ex.build_model(), ex.make_inputs()
    want = ex.one_device(model, latents, cond, uncond, args)
    swapped = ex.one_device(model, latents, uncond, cond, args)
    assert float((want - swapped).abs().max()) > 1e-3
    got = ex.parallel(model, ex.mesh_for(args, None), latents, uncond, cond, args)
    torch.testing.assert_close(got, swapped, rtol=0, atol=1e-6)


def test_guidance_refusals() -> None:
    ex = example()
    pm = fd.nn.parallelize(ex.build_model(), fd.Mesh({"cfg": 2, "sp": 2}))
    with pytest.raises(ParallelizeError, match="'cfg' has 3 ranks, not 2"):
        fd.nn.GuidedModel(fd.nn.parallelize(ex.build_model(), fd.Mesh({"cfg": 3, "sp": 2})), 5.0)
    guided = fd.nn.GuidedModel(pm, 5.0)
    latents, cond, uncond = ex.make_inputs()
    t = torch.tensor([500.0])
    with pytest.raises(ParallelizeError, match="differ in shape"):
        guided(hidden_states=latents, timestep=t, encoder_hidden_states=cond, uncond=uncond[:, :2])
    with pytest.raises(ParallelizeError, match="no 'encoder_hidden_states'"):
        guided(hidden_states=latents, timestep=t, uncond=uncond)
    split_cfg = fd.nn.parallelize(
        ex.build_model(), fd.Mesh({"cfg": 2}), fd.nn.plans.wan(axis="cfg")
    )
    with pytest.raises(ParallelizeError, match="splits over 'cfg'"):
        fd.nn.GuidedModel(split_cfg, 5.0)


def test_example_without_torchrun() -> None:
    proc = run_example_without_torchrun("video_dit.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "OK", proc.stdout


def test_example_on_gloo() -> None:
    """cfg=2 x sp=2 on 4 gloo processes, ring attention (18 tokens: 9 per rank)."""
    proc = torchrun_example("video_dit.py", 4, "--mode", "ring")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout.splitlines(), proc.stdout


def test_guidance_branches_every_prompt_keyword() -> None:
    """SD3 takes the prompt twice: its encoder states and its pooled projections; the
    unconditional branch gets the negative prompt's both (as diffusers' SD3 pipeline does).
    A tensor ``uncond`` would use the prompt's pooled projections for both branches: refused;
    the dict form equals one device."""
    from tests.test_context_mmdit import sd3_inputs
    from tests.tiny_models import tiny_sd3

    model = tiny_sd3()
    one = copy.deepcopy(model)  # parallelize changes the model in place
    x = sd3_inputs()
    g = torch.Generator().manual_seed(7)
    neg = {
        k: torch.randn(x[k].shape, generator=g, dtype=x[k].dtype)
        for k in ("encoder_hidden_states", "pooled_projections")
    }
    with torch.no_grad():
        cond, uncond = one(**x).sample, one(**{**x, **neg}).sample
    want = uncond + 5.0 * (cond - uncond)
    mesh = fd.Mesh({"cfg": 2, "sp": 2})
    guided = fd.nn.GuidedModel(fd.nn.parallelize(model, mesh, fd.nn.plans.sd3(model, mesh)), 5.0)
    with pytest.raises(ParallelizeError, match=r"prompt's \['pooled_projections'\].*uncond=\{"):
        guided(**x, uncond=neg["encoder_hidden_states"])
    with pytest.raises(ParallelizeError, match=r"prompt's \['encoder_hidden_states'\]"):
        guided(**x, uncond={"pooled_projections": neg["pooled_projections"]})
    torch.testing.assert_close(guided(**x, uncond=neg), want, rtol=1e-9, atol=1e-10)
    shared = {**neg, "pooled_projections": x["pooled_projections"]}  # named: shared on purpose
    with torch.no_grad():
        half = one(**{**x, **shared}).sample
    torch.testing.assert_close(
        guided(**x, uncond=shared), half + 5.0 * (cond - half), rtol=1e-9, atol=1e-10
    )
