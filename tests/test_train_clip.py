"""Global-norm clipping on parallel models (fastdist.nn.clip_grad_norm_) against
``torch.nn.utils.clip_grad_norm_`` on the single-device model, in float64.

The oracle: the norm one device computes, and the gradients it leaves after clipping,
gathered back from every rank (``pm.grads()`` checks that replicas agree).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

import fastdist as fd
from tests.test_hf_models import batch, build, reference_loss, rep

TOL = {"rtol": 1e-10, "atol": 1e-12}


def _parallel_pair(
    family: str, mesh: fd.Mesh, sp: bool = False, kv: int = 2
) -> tuple[Any, fd.nn.ParallelModel]:
    """(one-device model, its parallel copy), both after one backward of the same batch."""
    ref = build(family, kv=kv)
    pm = fd.nn.parallelize(
        copy.deepcopy(ref), mesh, fd.nn.plans.plan(ref, mesh, sequence_parallel=sp)
    )
    ids, labels = batch()
    reference_loss(ref, ids, labels)[1].backward()
    pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh)).loss.sum().backward()
    return ref, pm


@pytest.mark.parametrize(
    "family, tp, sp, norm_type",
    [
        ("llama", 2, False, 2.0),
        ("llama", 4, True, 2.0),  # kv heads replicated below tp: pvary'd, counted once
        ("gpt2", 4, True, 2.0),  # vocabulary 61 padded to 64, tied head, fused c_attn
        ("llama", 2, True, math.inf),
        ("gpt2", 2, False, 1.0),
        ("qwen3", 2, True, 3.0),
    ],
)
def test_clip_equals_one_device(family: str, tp: int, sp: bool, norm_type: float) -> None:
    mesh = fd.Mesh({"tp": tp})
    kv = 4 if family in ("gpt2", "qwen3") else 2
    ref, pm = _parallel_pair(family, mesh, sp, kv)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
    before = fd.nn.grad_norm(pm, norm_type)
    got = fd.nn.clip_grad_norm_(pm, 0.05, norm_type)
    torch.testing.assert_close(before, got)
    torch.testing.assert_close(got, want.expand(tp), **TOL)  # every rank: the one-device norm
    assert float(want) > 0.05  # the clip did scale
    grads = pm.grads()  # replicas still agree: every rank scaled by the same factor
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_torch_clip_is_the_mistake_it_is_said_to_be() -> None:
    """The documented failure: per-rank norms differ, and the gather names the per-rank clip."""
    mesh = fd.Mesh({"tp": 2})
    ref, pm = _parallel_pair("llama", mesh, sp=True)
    stacked = list(pm.parameters())
    per_rank = [
        torch.nn.utils.get_total_norm([p.grad[r] for p in stacked]) for r in range(mesh.size)
    ]
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    assert all(abs(float(n) - float(want)) > 1e-3 for n in per_rank)
    for p in stacked:  # what each rank would do with torch's clip
        for r in range(mesh.size):
            p.grad[r].mul_(0.01 / float(per_rank[r]))
    with pytest.raises(fd.nn.ReplicaMismatchError, match="per-rank clip or optimizer step"):
        pm.grads()


def test_padding_rows_count_zero_and_moe_experts_sum_over_ep() -> None:
    """Garbage in the vocabulary padding rows is ignored; experts split over ep x tp count once."""
    mesh = fd.Mesh({"tp": 4})
    ref, pm = _parallel_pair("gpt2", mesh, kv=4)
    wte = pm.module.transformer.wte.weight  # [4, 16, 32]: rows 61..63 are padding (rank 3)
    wte.grad[3, -3:] = 1e3
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    torch.testing.assert_close(fd.nn.grad_norm(pm), want.expand(4), **TOL)

    from tests.test_moe import build_mixtral, reference

    ref = build_mixtral()
    mesh = fd.Mesh({"ep": 2, "tp": 2})
    pm = fd.nn.parallelize(copy.deepcopy(ref), mesh)  # experts over ep x tp, attention over tp
    ids, labels = batch()
    pm(input_ids=rep(ids, mesh), labels=rep(labels, mesh)).loss.sum().backward()
    _, ce, aux = reference(ref, ids, labels)
    (ce + ref.config.router_aux_loss_coef * aux).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    torch.testing.assert_close(fd.nn.clip_grad_norm_(pm, 1e-3), want.expand(4), **TOL)
    grads = pm.grads()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_non_finite_norms_behave_as_torch() -> None:
    mesh = fd.Mesh({"tp": 2})
    ref, pm = _parallel_pair("llama", mesh)
    next(iter(ref.parameters())).grad[0, 0] = math.nan
    pm.module.model.embed_tokens.weight.grad[0, 0, 0] = math.nan  # rank 0's shard only
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        fd.nn.clip_grad_norm_(pm, 1.0, error_if_nonfinite=True)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    got = fd.nn.clip_grad_norm_(pm, 1.0)
    assert torch.isnan(want) and torch.isnan(got).all()  # every rank: nan, grads scaled by nan
    assert all(torch.isnan(p.grad).all() for p in pm.parameters())


def test_unreduced_data_parallel_replicas_and_bad_arguments_raise() -> None:
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    model = build("llama")
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, family="llama"))
    (i0, l0), (i1, l1) = batch(1), batch(2)
    out = pm(input_ids=torch.stack([i0, i0, i1, i1]), labels=torch.stack([l0, l0, l1, l1]))
    out.loss.sum().backward()
    with pytest.raises(fd.MeshError, match="different total norms.*data-parallel"):
        fd.nn.clip_grad_norm_(pm, 1.0)
    with pytest.raises(fd.MeshError, match="norm_type=-1"):
        fd.nn.clip_grad_norm_(pm, 1.0, norm_type=-1)
    with pytest.raises(fd.MeshError, match="ParallelModel"):
        fd.nn.clip_grad_norm_(torch.nn.Linear(2, 2), 1.0)
    pm.module.zero_grad(set_to_none=True)
    torch.testing.assert_close(fd.nn.clip_grad_norm_(pm, 1.0), torch.zeros(4))  # no grads: norm 0


def test_plain_module_of_fastdist_layers_with_mesh() -> None:
    mesh = fd.Mesh({"tp": 2})
    full = torch.nn.Linear(4, 6, dtype=torch.float64)
    col = fd.nn.ColumnParallelLinear(4, 6, mesh, "tp", dtype=torch.float64)
    state = fd.nn.stack_state(full.state_dict(), fd.nn.param_specs(col), mesh)
    for name, p in col.named_parameters():
        p.data = state[name]
        twos = torch.full_like(getattr(full, name), 2.0)
        p.grad = fd.nn.stack_state({name: twos}, {name: fd.nn.param_specs(col)[name]}, mesh)[name]
    want = torch.tensor(2.0 * math.sqrt(4 * 6 + 6), dtype=torch.float64)
    torch.testing.assert_close(fd.nn.grad_norm(col, mesh=mesh), want.expand(2))
