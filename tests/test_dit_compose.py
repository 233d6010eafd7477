"""Context parallelism of a diffusers DiT (a tiny ``WanTransformer3DModel``, float64) composed
with the rest of fastdist (issue 38 point 1), on simulated ranks, against the unmodified model
on one device: tensor parallelism (heads over ``tp``, tokens over ``sp``:
`fastdist.nn.plans.dit_tp.wan_tp`), data parallelism with fastdist's engine (gradients,
clipping, an optimizer step), meta-device loading from a ``save_pretrained`` directory, checkpoints
saved at one layout and loaded at another, and the pipeline's refusal. FSDP2 and the real-rank
runs: ``tests/test_dit_compose_gloo.py``.

Wan computes its norms and modulation in float32 on purpose: gradients are compared relative to
each one's largest entry (``assert_grads``, 1e-6), as in ``tests/test_context_parallel.py``; the
optimizer is SGD with momentum (its state checkpointed too), not AdamW, whose per-element
normalization turns that float32 noise in near-zero gradients into updates of the size of the
learning rate (measured: 1.7e-6 apart after one AdamW step at lr 1e-2; 1e-10 after one SGD step
at lr 1e-3, 1.5e-9 after two, against updates of about 1e-2).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fastdist as fd
from fastdist.errors import CheckpointError, ParallelizeError
from fastdist.nn.plans.dit import TpSplit
from fastdist.nn.plans.dit_tp import ContextTensorParallel, WidthRMSNorm, wan_tp
from tests.test_context_parallel import assert_grads, inputs, reference, wan_module
from tests.tiny_models import tiny_wan, wan_config


def on_ranks(x: dict[str, Tensor], mesh: fd.Mesh) -> dict[str, Tensor]:
    """The same inputs on every simulated rank (a leading rank dim)."""
    return {k: v.expand(mesh.size, *v.shape) for k, v in x.items()}


def forward_backward(pm: Any, x: dict[str, Tensor]) -> Tensor:
    """Every rank's output; backward of each rank's ``sum(out**2)`` (the ranks of one group hold
    the same output: the one-device gradient)."""
    out = pm(**on_ranks(x, pm.mesh)).sample  # (world, *out)
    out.pow(2).sum().backward()
    return out.detach()


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def assert_params(state: dict[str, Tensor], ref: nn.Module) -> None:
    for name, p in ref.named_parameters():
        err = float((state[name] - p.detach()).abs().max())
        assert err < 1e-8, f"{name}: {err:.2e}"


# ------------------------------------------------------------------ tp x sp
@pytest.mark.parametrize(
    ("mode", "shape", "heads"),
    [
        ("ulysses", {"tp": 2, "sp": 2}, 4),  # 2 heads per tp rank, 1 per Ulysses rank
        ("ring", {"sp": 2, "tp": 2}, 2),  # 1 head per tp rank: the ring needs no head split
        ("usp", {"cp": 2, "sp": 2, "tp": 2}, 4),
    ],
)
def test_tp_times_sp_equals_one_device(mode: str, shape: dict[str, int], heads: int) -> None:
    model, x = tiny_wan(heads=heads), inputs(frames=3)  # 12 tokens
    out, grads = reference(copy.deepcopy(model), x)
    mesh = fd.Mesh(shape)
    plan = wan_tp(model, mesh, mode=mode, ring_axis="cp" if mode == "usp" else None)  # type: ignore[arg-type]
    pm = fd.nn.parallelize(model, mesh, plan)
    attn = model.blocks[0].attn1
    assert attn.heads == heads // 2 and isinstance(attn.norm_q, WidthRMSNorm)
    dim = heads * 12
    assert tuple(attn.to_q.weight.shape[1:]) == (dim // 2, dim)  # this rank's heads
    assert tuple(model.blocks[1].ffn.net[2].weight.shape[1:]) == (dim, 16)  # ffn_dim 32 / 2
    got = forward_backward(pm, x)
    for r in range(mesh.size):
        torch.testing.assert_close(got[r], out, rtol=0, atol=1e-12)
    assert_grads(pm.grads(), grads)


def test_tp_times_sp_refusals() -> None:
    mesh = fd.Mesh({"tp": 2, "sp": 2})
    with pytest.raises(ParallelizeError, match=r"2 heads: 1 per rank of 'tp'.*mode='ring'"):
        fd.nn.parallelize(tiny_wan(heads=2, layers=1), mesh, wan_tp(mesh=mesh))
    with pytest.raises(ParallelizeError, match="3 heads, which the 2 ranks of 'tp'"):
        fd.nn.parallelize(tiny_wan(heads=3, layers=1), mesh, wan_tp(mesh=mesh, mode="ring"))
    bad = {"": ContextTensorParallel(fd.nn.ContextParallel("sp"), tp="sp")}
    with pytest.raises(ParallelizeError, match="also an axis of the token split"):
        fd.nn.parallelize(tiny_wan(heads=4, layers=1), mesh, bad)
    # (Wan image-to-video's image projections split too: tests/test_dit_tp_families.py)
    with pytest.raises(ParallelizeError, match="not a diffusers WanTransformer3DModel"):
        wan_tp(nn.Linear(2, 2))
    ltx = pytest.importorskip("diffusers.models.transformers.transformer_ltx")
    model = ltx.LTXVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=12,
        cross_attention_dim=48, num_layers=1, caption_channels=16,
    )  # fmt: skip
    attns = ("attn1", "attn2")
    qkv = tuple(f"{a}.{p}" for a in attns for p in ("to_q", "to_k", "to_v"))
    out = tuple(f"{a}.to_out.0" for a in attns)
    split = TpSplit("transformer_blocks", attns, (*qkv, "ff.net.0.proj"), (*out, "ff.net.2"))
    plan = {"": ContextTensorParallel(fd.nn.plans.ltx_video()[""], split=(split,))}
    with pytest.raises(ParallelizeError, match="LTXVideoAttnProcessor.*over the width"):
        fd.nn.parallelize(model, mesh, plan)  # its rotary table spans every head


def test_separate_entries_are_refused_clearly() -> None:
    mesh = fd.Mesh({"tp": 2, "sp": 2})
    plan = {
        "": fd.nn.ContextParallel("sp"),
        "blocks.*.ffn.net.0.proj": fd.nn.ColwiseParallel("tp", input="replicated"),
        "blocks.*.ffn.net.2": fd.nn.RowwiseParallel("tp"),
    }
    with pytest.raises(ParallelizeError, match="ContextTensorParallel"):
        fd.nn.parallelize(tiny_wan(heads=4, layers=1), mesh, plan)


# ------------------------------------------------------------------ dp x sp, clipping, a step
def test_data_parallel_times_sp_step_equals_one_device() -> None:
    """dp x sp with fastdist's engine: each data rank its own latents, tokens split over sp; the
    gradients (of the mean over the data ranks' losses), the clipped norm and the parameters
    after an SGD step with momentum equal one device's."""
    ref = tiny_wan(heads=4)
    model = copy.deepcopy(ref)
    mesh = fd.Mesh({"dp": 2, "sp": 2})
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.wan(model, mesh, mode="ring"))
    fd.train.DataParallel(pm, "dp")
    opt, opt_ref = sgd(pm.parameters()), sgd(ref.parameters())
    batches = [inputs(frames=3, seed=10 + d) for d in range(2)]
    per_rank = {
        k: torch.stack([batches[mesh.coords(r)["dp"]][k] for r in range(mesh.size)])
        for k in batches[0]
    }
    pm(**per_rank).sample.pow(2).sum().backward()  # each rank: its data rank's loss
    (sum(ref(**b).sample.pow(2).sum() for b in batches) / 2).backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}  # type: ignore[union-attr]
    assert_grads(pm.grads(), want)
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    got = fd.nn.clip_grad_norm_(pm, 0.5)
    torch.testing.assert_close(got, norm.expand(mesh.size), rtol=1e-9, atol=0)
    assert_grads(pm.grads(), {n: p.grad for n, p in ref.named_parameters()})  # type: ignore[misc]
    opt.step()
    opt_ref.step()
    assert_params(pm.state_dict(), ref)


# ------------------------------------------------------------------ meta device, checkpoints
def meta_wan() -> nn.Module:
    """``tiny_wan(heads=4)``'s architecture built on the meta device: shapes, no values; its
    rotary embedding (buffers only, computed in its ``__init__``) built outside, as
    accelerate's ``init_empty_weights`` (what diffusers' ``from_pretrained`` uses) does."""
    with torch.device("meta"):
        model = wan_module.WanTransformer3DModel(**wan_config(heads=4))
    model.rope = wan_module.WanRotaryPosEmbed(12, (1, 2, 2), 32)
    return model.to(torch.float64)


def test_meta_rotary_buffers_are_refused_with_the_fix(tmp_path: Path) -> None:
    """Built wholly under torch.device('meta'), the rotary buffers have no values that a
    checkpoint or an init could give: refused at load, naming them and the fix."""
    tiny_wan(heads=4, layers=2).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = wan_module.WanTransformer3DModel(**wan_config(heads=4)).to(torch.float64)
    pm = fd.nn.parallelize(model, fd.Mesh({"sp": 2}))
    with pytest.raises(CheckpointError, match=r"rope\.freqs_cos.*Fix: build the modules"):
        fd.checkpoint.load(tmp_path, pm)


@pytest.mark.parametrize("tp", [False, True])
def test_meta_model_loads_save_pretrained(tmp_path: Path, tp: bool) -> None:
    """A Wan built on meta, parallelized (sp, or tp x sp), then loaded from the unmodified
    model's ``save_pretrained`` directory: each rank reads its shards; equal to one device."""
    ref = tiny_wan(heads=4)
    ref.save_pretrained(tmp_path)
    x = inputs(frames=3)
    out, grads = reference(ref, x)
    model = meta_wan()
    mesh = fd.Mesh({"tp": 2, "sp": 2} if tp else {"sp": 2})
    pm = fd.nn.parallelize(model, mesh, wan_tp(model, mesh) if tp else None)
    with pytest.raises(ParallelizeError, match="meta device"):
        pm(**on_ranks(x, mesh))
    fd.checkpoint.load(tmp_path, pm)
    got = forward_backward(pm, x)
    torch.testing.assert_close(got[-1], out, rtol=0, atol=1e-12)
    assert_grads(pm.grads(), grads)


def test_checkpoint_saved_at_tp_sp_loads_at_sp4(tmp_path: Path) -> None:
    """Weights and SGD momentum saved from tp 2 x sp 2 after a step, loaded into sp 2 and sp 4
    (resharded), and the next step equals one device's."""
    ref, x = tiny_wan(heads=4), inputs(frames=3)
    mesh = fd.Mesh({"tp": 2, "sp": 2})
    model = copy.deepcopy(ref)
    pm = fd.nn.parallelize(model, mesh, wan_tp(model, mesh))
    opt, opt_ref = sgd(pm.parameters()), sgd(ref.parameters())
    forward_backward(pm, x)
    ref(**x).sample.pow(2).sum().backward()
    opt.step()
    opt_ref.step()
    fd.checkpoint.save(tmp_path / "ckpt", pm, opt, extra={"step": 1})
    opt_ref.zero_grad()
    ref(**x).sample.pow(2).sum().backward()
    opt_ref.step()
    for n in (2, 4):
        other = tiny_wan(heads=4, seed=5)  # other weights: all must come from the checkpoint
        mesh_n = fd.Mesh({"sp": n})
        pm_n = fd.nn.parallelize(other, mesh_n, fd.nn.plans.wan(other, mesh_n))
        opt_n = sgd(pm_n.parameters())
        assert fd.checkpoint.load(tmp_path / "ckpt", pm_n, opt_n) == {"step": 1}
        forward_backward(pm_n, x)
        opt_n.step()
        assert_params(pm_n.state_dict(), ref)


# ------------------------------------------------------------------ pipelines
def test_width_rms_norm_equals_torch() -> None:
    """`WidthRMSNorm` on tp column shards equals ``torch.nn.RMSNorm`` over the whole width,
    forward and backward (and with eps=None: the dtype's epsilon, as torch's)."""
    for eps in (1e-6, None):
        norm = nn.RMSNorm(8, eps=eps).double()
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(3, 8, dtype=torch.float64)
        want = norm(x)
        mesh = fd.Mesh({"tp": 2})
        plan = {"": fd.nn.ColwiseParallel("tp", input="replicated")}
        lin = nn.Linear(8, 8, dtype=torch.float64)
        seq = nn.Sequential(lin, copy.deepcopy(norm))
        want = seq[1](lin(x))
        want.pow(3).sum().backward()
        wgrad = seq[1].weight.grad.clone()  # type: ignore[union-attr]
        model = nn.Sequential(copy.deepcopy(lin), nn.Identity())
        pm = fd.nn.parallelize(model, mesh, {"0": plan[""]})
        w = nn.Parameter(norm.weight.detach().reshape(2, 4).clone())  # [rank, width / 2]
        model[1] = WidthRMSNorm(w, eps, mesh, "tp", 8)
        got = pm(x.expand(2, 3, 8))  # (rank, 3, 4): each rank's columns
        torch.testing.assert_close(torch.cat(list(got), -1), want, rtol=0, atol=1e-14)
        got.pow(3).sum().backward()
        torch.testing.assert_close(w.grad.reshape(8), wgrad, rtol=0, atol=1e-12)  # type: ignore[union-attr]


def test_default_plan_uses_tp_when_the_mesh_has_it() -> None:
    model = tiny_wan(heads=4, layers=1)
    mesh = fd.Mesh({"tp": 2, "sp": 2})
    pm = fd.nn.parallelize(model, mesh)
    assert pm.plan == wan_tp(mesh=mesh)
