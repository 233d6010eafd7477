"""Gloo ranks for `tests/test_domain_compile.py` (run by `fastdist.testing.run_on_gloo`): a
domain-parallel net under ``torch.compile``, against the same net eager on one device."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

import fastdist as fd
from tests.domain_gloo_worker import TinyUNet

F64 = torch.float64


def nets() -> dict[str, tuple[nn.Module, list[tuple[int, ...]]]]:
    """Each net (float64) and the field shapes of its calls (the last one of another size, so
    the compiled graphs recompile with dynamic shapes)."""
    from tests.test_domain_models import tiny_vae

    torch.manual_seed(0)
    return {
        "convs": (
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1)),
            [(1, 4, 8, 8), (1, 4, 8, 8), (1, 4, 12, 8)],
        ),
        # conv, group norm, max pooling, batch norm (whole-domain statistics), transposed conv,
        # average pooling, bilinear upsampling
        "unet": (TinyUNet(), [(1, 2, 8, 8), (1, 2, 16, 8)]),
        # diffusers AutoencoderKL's decoder with its mid-block attention
        "vae": (tiny_vae(attention=True).decoder, [(1, 4, 4, 6), (1, 4, 8, 6)]),
    }


def compare(
    net: nn.Module, pm: Any, backend: str, shapes: list[tuple[int, ...]], stacked: int | None
) -> list[dict[str, float]]:
    """Each call of ``pm`` compiled with ``backend`` (``stacked``: the number of simulated ranks,
    the field repeated on each; None: real ranks) against ``net`` eager on one device: the
    largest errors of the output, the field's gradient and the parameters' gradients, forward
    and backward."""
    ref = copy.deepcopy(net)
    compiled = torch.compile(pm, backend=backend)
    errors = []
    for i, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(10 + i)
        x = torch.randn(*shape, generator=g, dtype=F64)
        xr = x.clone().requires_grad_()
        want = ref(xr)
        cot = torch.randn(want.shape, generator=g, dtype=F64)
        (want * cot).sum().backward()
        xs = (x if stacked is None else x.expand(stacked, *shape).clone()).requires_grad_()
        got: Tensor = compiled(xs)
        (got * cot).sum().backward()
        assert xs.grad is not None and xr.grad is not None
        grads = pm.grads()
        errors.append(
            {
                "out": (got - want).abs().max().item(),
                "dx": (xs.grad - xr.grad).abs().max().item(),
                "grads": max(
                    (grads[k] - p.grad).abs().max().item()
                    for k, p in ref.named_parameters()
                    if p.grad is not None
                ),
            }
        )
        pm.module.zero_grad()
        ref.zero_grad()
    return errors


def compiled_on_gloo(name: str, backend: str) -> list[dict[str, float]]:
    """One rank of 2 (H over ``h``): net ``name`` domain-parallel, compiled with ``backend``."""
    mesh = fd.connect(h=2, timeout=120)
    net, shapes = nets()[name]
    net = net.to(F64)
    pm = fd.nn.parallelize(copy.deepcopy(net), mesh, {"": fd.nn.DomainParallel({-2: "h"})})
    return compare(net, pm, backend, shapes, None)
