"""SD3's ``skip_layers`` under the DiT context-parallel plan (`fastdist.nn.plans.sd3`): the
tokens are split where the first block that runs starts, so ``skip_layers=[0]`` (block 0
skipped) equals one device in float64 on simulated ranks (sp 2, 9 image tokens: 5 + 4), on the
first call, after a call that ran every block, and with gradient checkpointing; a forward that
skips every block is refused naming the fix (its output would be gathered with no split)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import fastdist as fd
from fastdist.errors import ParallelizeError

pytest.importorskip("diffusers")

from tests.test_context_mmdit import assert_grads, sd3_inputs  # noqa: E402
from tests.tiny_models import tiny_sd3  # noqa: E402


def one_device(model: Any, x: dict[str, Any], skip: list[int]) -> tuple[Any, dict[str, Any]]:
    """The output and the gradients of ``sum(out**2)`` with ``skip_layers=skip``."""
    out = model(**x, skip_layers=skip).sample
    out.pow(2).sum().backward()
    return out.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "after-a-whole-call"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_sd3_skip_first_block_equals_one_device(warm: bool, checkpointing: bool) -> None:
    model, x = tiny_sd3(), sd3_inputs()
    want, grads = one_device(copy.deepcopy(model), x, [0])
    if checkpointing:
        model.enable_gradient_checkpointing()
    mesh = fd.Mesh({"sp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.sd3(model, mesh))
    xs = {k: v.expand(2, *v.shape) for k, v in x.items()}
    if warm:
        with torch.no_grad():
            pm(**xs)
    got = pm(**xs, skip_layers=[0]).sample
    got.pow(2).sum().backward()
    for r in range(2):
        torch.testing.assert_close(got[r].detach(), want, rtol=0, atol=1e-12)
    assert_grads(pm.grads(), grads)


def test_sd3_skipping_every_block_is_refused() -> None:
    model = tiny_sd3()
    mesh = fd.Mesh({"sp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.sd3(model, mesh))
    xs = {k: v.expand(2, *v.shape) for k, v in sd3_inputs().items()}
    for _ in range(2):  # on the first call, and after a call that split the tokens
        with pytest.raises(ParallelizeError, match="no block split the tokens.*run at least one"):
            pm(**xs, skip_layers=[0, 1])
        pm(**xs)
