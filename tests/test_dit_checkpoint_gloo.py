"""A context-parallel diffusers DiT's training checkpoint on real ranks (docs/context_parallel.md,
"Composition ... checkpoints"; docs/training.md, "Checkpoints that reshard"): a tiny float64
``WanTransformer3DModel`` parallelized with `fastdist.nn.plans.wan` on 2 gloo processes
(sp 2, Ulysses), three AdamW steps, ``fastdist.checkpoint.save`` (weights and optimizer state,
DCP; and the single-device safetensors file), then loaded into

* one device: the unmodified model (a plain module) and a plain AdamW, from the DCP directory;
  and the safetensors file read by plain ``safetensors`` into ``load_state_dict`` (diffusers'
  names and shapes);
* sp 2 again, and tp 2 x sp 1 (`fastdist.nn.plans.dit_tp.wan_tp`), on the same 2 processes;
  and a model built on the meta device (its AdamW made before the load), at sp 2 from the DCP
  directory and at tp 2 x sp 1 from the safetensors file, each rank allocating its own shards;
* tp 2 x sp 2 (ring) on simulated ranks (4, in this process);
* a pipeline, pp 2 x sp 2 on simulated ranks (`fastdist.train.pipeline`, 1F1B), with AdamW over
  its stages' parameters: each stage's copy of the condition embedder gets the saved weights
  and state, and the copies stay equal through the next step.

And FSDP2 over dp 2 x sp 2 on 4 gloo processes: saved, loaded back into FSDP2 and into one
device; and every DiT family's tp 2 x sp 2 checkpoint (simulated, weights only: bit-equal
round trips through DCP and safetensors).

Each load starts from other weights and a fresh optimizer; what it loads must be bit-equal to
what was saved (weights and AdamW's state, gathered to the single-device view), and the next
step (forward, gradients, AdamW update) must equal the one-device run that took the same four
steps.

Tolerances: Wan computes its norms and modulation in float32 on purpose, so sp's other
reduction order leaves ~1e-7 of each gradient's largest entry (as in
``tests/test_context_parallel.py``); AdamW's per-element normalization turns that noise in
near-zero gradients into updates of the size of the learning rate at its default ``eps``
(measured: 4e-7 after one step at lr 1e-3, eps 1e-8). With ``eps=1e-4`` (above those gradients'
noise, below most gradients) the parameters after three steps are 4e-9 from one device's
(measured), against updates of 1e-3: parameters are compared to 1e-7, the forward to 1e-6 of
its largest entry, gradients and AdamW's moments to 1e-6 of each one's largest entry
(measured: 1.2e-9, 7e-8, 1.3e-7). What a load reads is compared with what was saved exactly, and
its forward with the saved model's forward to 1e-6 of its largest entry: Wan also rounds its
residual stream to float32 in every block (``(hidden_states.float() + attn_output *
gate_msa).type_as(hidden_states)``), so a layout whose attention sums in another order can flip
a rounding there (measured on these trained weights: tp 2 x sp 2 ring 9.2e-8 from one device,
sp 2 and tp 2 x sp 1 bit-equal; 4.4e-16 with those float32 casts patched out).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fastdist as fd

pytest.importorskip("diffusers.models.transformers.transformer_wan")

from tests.checkpoint_worker import model_state, optim_state  # noqa: E402
from tests.pipeline_dit_worker import batch, tiny_wan  # noqa: E402

STEPS = 3  # AdamW steps before the save; a fourth after each load


def adamw(params: Any) -> torch.optim.Optimizer:
    """AdamW with ``eps`` above the float32 noise of Wan's near-zero gradients (module doc)."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4)


def batches() -> list[dict[str, Tensor]]:
    """``STEPS + 1`` batches of 2 samples (8 latent tokens, 5 text tokens, a target)."""
    return [batch(n=2, seed=10 + i) for i in range(STEPS + 1)]


def on_ranks(b: dict[str, Tensor], pm: Any) -> dict[str, Tensor]:
    """The batch as ``pm`` takes it: a leading rank dim on simulated ranks."""
    if isinstance(pm, fd.nn.ParallelModel) and pm.simulated:
        return {k: v.expand(pm.mesh.size, *v.shape) for k, v in b.items()}
    return dict(b)


def forward(pm: Any, b: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """The output and the loss (mean squared error against the target; on simulated ranks the
    sum of the ranks' losses, each the whole one, so each rank's gradient is one device's)."""
    x = on_ranks(b, pm)
    target = x.pop("target")
    out = pm(**x).sample
    sq = (out - target).pow(2)
    loss = sq.flatten(1).mean(1).sum() if out.shape != b["target"].shape else sq.mean()
    return out.detach(), loss


def train(pm: Any, opt: torch.optim.Optimizer, bs: list[dict[str, Tensor]]) -> None:
    for b in bs:
        forward(pm, b)[1].backward()
        opt.step()
        opt.zero_grad()


def grads(pm: Any) -> dict[str, Tensor]:
    if isinstance(pm, fd.nn.ParallelModel):
        return pm.grads()
    return {n: p.grad.clone() for n, p in pm.named_parameters()}


def next_step(pm: Any, opt: torch.optim.Optimizer, b: dict[str, Tensor]) -> dict[str, Any]:
    """What a load gave (weights, optimizer state), then one more step: the output, the
    gradients, the weights and optimizer state after it (collectives on real ranks)."""
    res: dict[str, Any] = {"loaded": (model_state(pm), optim_state(pm, opt))}
    out, loss = forward(pm, b)
    loss.backward()
    res["out"] = out[0] if out.shape != b["target"].shape else out
    res["loss"] = loss.detach() / (out.numel() // b["target"].numel())  # one rank's
    res["grads"] = grads(pm)
    opt.step()
    res["after"] = (model_state(pm), optim_state(pm, opt))
    return res


def save_and_reload(path: str) -> dict[str, Any]:
    """One rank of 2: sp 2 (Ulysses), ``STEPS`` AdamW steps, save (DCP and safetensors); load
    into sp 2, tp 2 x sp 1 and a meta model at sp 2, each followed by one more step; and the
    safetensors file into a meta model at tp 2 x sp 1."""
    from fastdist.nn.plans.dit_tp import wan_tp

    torch.set_num_threads(1)
    bs = batches()
    mesh = fd.connect(sp=2, timeout=120)
    model = tiny_wan(layers=2)
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.wan(model, mesh))
    assert type(model.blocks[0].attn1.processor).__name__ == "SplitProcessor"
    opt = adamw(pm.parameters())
    train(pm, opt, bs[:STEPS])
    fd.checkpoint.save(f"{path}/dcp", pm, opt, extra={"step": STEPS})
    fd.checkpoint.save(f"{path}/weights.safetensors", pm)  # rank 0 writes the whole model
    res: dict[str, Any] = {"saved": (model_state(pm), optim_state(pm, opt))}
    res["saved_out"] = forward(pm, bs[STEPS])[0]
    tp2 = fd.connect(tp=2, sp=1, timeout=120)
    for name, m, build in (
        ("sp2", mesh, lambda: tiny_wan(layers=2, seed=5)),  # other weights: all from the load
        ("tp2", tp2, lambda: tiny_wan(layers=2, seed=5)),
        ("meta", mesh, meta_wan),  # no storage until the load
    ):
        other = build()
        plan = wan_tp(other, m) if "tp" in m.axis_names else fd.nn.plans.wan(other, m)
        pm_n = fd.nn.parallelize(other, m, plan)
        opt_n = adamw(pm_n.parameters())  # before the load: the same parameters after it
        extra = fd.checkpoint.load(f"{path}/dcp", pm_n, opt_n)
        res[name] = {"extra": extra, **next_step(pm_n, opt_n, bs[STEPS])}
    other = meta_wan()  # tp 2 x sp 1 on meta, from the single-device safetensors file
    pm_n = fd.nn.parallelize(other, tp2, wan_tp(other, tp2))
    fd.checkpoint.load(f"{path}/weights.safetensors", pm_n)
    res["meta_safetensors"] = (model_state(pm_n), forward(pm_n, bs[STEPS])[0])
    return res


def meta_wan() -> nn.Module:
    """`tiny_wan`'s architecture on the meta device (shapes, no values); its rotary embedding
    (non-persistent buffers computed in ``__init__``, which no checkpoint holds) built outside,
    as accelerate's ``init_empty_weights`` does (docs/context_parallel.md, meta loading)."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    ref = tiny_wan(layers=2)
    with torch.device("meta"):
        model = type(ref).from_config(ref.config)
    model.rope = WanRotaryPosEmbed(8, (1, 2, 2), 32)
    return model.to(torch.float64)


def one_device() -> dict[str, Any]:
    """The unmodified model on one device: ``STEPS`` steps (the state the checkpoint must hold),
    then the next step as `next_step` records it."""
    ref = tiny_wan(layers=2)
    opt = adamw(ref.parameters())
    bs = batches()
    train(ref, opt, bs[:STEPS])
    return {"saved": (model_state(ref), optim_state(ref, opt)), **next_step(ref, opt, bs[STEPS])}


def assert_rel(got: dict[str, Tensor], want: dict[str, Tensor], tol: float, what: str) -> None:
    """Equal names; each tensor within ``tol`` of ``want``'s largest entry (exactly equal when
    that is 0)."""
    assert sorted(got) == sorted(want), what
    for name, w in want.items():
        scale = float(w.abs().max()) if w.numel() else 0.0
        err = float((got[name] - w).abs().max()) if w.numel() else 0.0
        assert err <= tol * scale, f"{what} {name}: {err:.2e} of {scale:.2e}"


def assert_state(got: Any, want: Any, what: str) -> None:
    """Weights (absolute 1e-7: updates are 1e-3) and AdamW's state (the step count exactly,
    the moments to 1e-6 of their largest entries) against one device's."""
    weights, opt_state = got
    want_w, want_opt = want
    assert sorted(weights) == sorted(want_w), what
    for name, w in want_w.items():
        err = float((weights[name] - w).abs().max())
        assert err < 1e-7, f"{what} weight {name}: {err:.2e}"
    assert sorted(opt_state) == sorted(want_opt), what
    for name, st in want_opt.items():
        assert sorted(opt_state[name]) == ["exp_avg", "exp_avg_sq", "step"], (what, name)
        assert float(opt_state[name]["step"]) == float(st["step"]), (what, name)
        moments = {k: opt_state[name][k] for k in ("exp_avg", "exp_avg_sq")}
        assert_rel(moments, {k: st[k] for k in moments}, 1e-6, f"{what} {name}")


def assert_bit_equal(got: Any, want: Any, what: str) -> None:
    """Weights and optimizer state bit-equal (what a load read against what was saved)."""
    weights, opt_state = got
    want_w, want_opt = want
    assert sorted(weights) == sorted(want_w), what
    assert sorted(opt_state) == sorted(want_opt), what
    for name, w in want_w.items():
        assert torch.equal(weights[name], w), f"{what}: weight {name}"
    for name in want_opt:
        assert sorted(opt_state[name]) == sorted(want_opt[name]), (what, name)
        for k, v in want_opt[name].items():
            assert torch.equal(opt_state[name][k], v), f"{what}: {name}.{k}"


def assert_next_step(
    got: dict[str, Any], want: dict[str, Any], saved: Any, saved_out: Tensor, what: str
) -> None:
    """A load read exactly what was saved, and its forward is the saved model's (``saved_out``);
    the next step equals one device's (module doc)."""
    assert_bit_equal(got["loaded"], saved, what)
    assert_rel({"out": got["out"]}, {"out": saved_out}, 1e-6, f"{what} forward (saved model)")
    assert_rel({"out": got["out"]}, {"out": want["out"]}, 1e-6, f"{what} forward")
    assert_rel(got["grads"], want["grads"], 1e-6, f"{what} gradient")
    assert_state(got["after"], want["after"], f"{what} after the next step")


def load_plain(path: Path) -> dict[str, Any]:
    """(a) one device: the DCP checkpoint into the unmodified model and a plain AdamW."""
    model = tiny_wan(layers=2, seed=5)
    opt = adamw(model.parameters())
    assert fd.checkpoint.load(path / "dcp", model, opt) == {"step": STEPS}
    return next_step(model, opt, batches()[STEPS])


def load_simulated(path: Path) -> dict[str, Any]:
    """tp 2 x sp 2 on 4 simulated ranks (`wan_tp`, ring: 1 head per tp rank)."""
    from fastdist.nn.plans.dit_tp import wan_tp

    model = tiny_wan(layers=2, seed=5)
    mesh = fd.Mesh({"tp": 2, "sp": 2})
    pm = fd.nn.parallelize(model, mesh, wan_tp(model, mesh, mode="ring"))
    opt = adamw(pm.parameters())
    assert fd.checkpoint.load(path / "dcp", pm, opt) == {"step": STEPS}
    return next_step(pm, opt, batches()[STEPS])


def pipeline_state(pipe: Any, opt: torch.optim.Optimizer) -> tuple[dict[str, Tensor], Any]:
    """A pipeline's single-device weights and optimizer state by name; the copies of a
    parameter that several stages hold (the condition embedder) must agree bit for bit."""
    state: dict[str, dict[str, Tensor]] = {}
    for j in sorted(pipe.stages):
        for name, st in optim_state(pipe.stages[j], opt).items():
            if name in state:
                assert sorted(st) == sorted(state[name]), name
                assert all(torch.equal(v, state[name][k]) for k, v in st.items()), name
            state[name] = st
    return pipe.state_dict(), state


def load_pipeline(path: Path) -> dict[str, Any]:
    """pp 2 x sp 2 on 4 simulated ranks: a pipeline of the model (`fastdist.train.pipeline`,
    1F1B, 2 micro-batches) and AdamW over its stages' parameters (each stage's copy of the
    condition embedder gets the saved state); then its next step."""
    mesh = fd.Mesh({"pp": 2, "sp": 2})
    pipe = fd.train.pipeline(tiny_wan(layers=2, seed=5), mesh, schedule="1f1b", microbatches=2)
    assert pipe.shared  # the condition embedder: a copy on each stage
    opt = adamw(pipe.parameters())
    assert fd.checkpoint.load(path / "dcp", pipe, opt) == {"step": STEPS}
    res: dict[str, Any] = {"loaded": pipeline_state(pipe, opt)}
    b = {k: v.expand(mesh.size, *v.shape) for k, v in batches()[STEPS].items()}
    res["loss"] = pipe.step(**b)
    res["grads"] = pipe.grads()
    opt.step()
    res["after"] = pipeline_state(pipe, opt)
    return res


def test_sp2_checkpoint_on_gloo_reloads_on_every_layout(tmp_path: Path) -> None:
    """Saved at sp 2 on 2 gloo processes after three AdamW steps; loaded at one device, sp 2,
    tp 2 x sp 1 (real ranks), tp 2 x sp 2 and a pp 2 x sp 2 pipeline (simulated); the
    safetensors file holds the single-device weights under diffusers' names."""
    from safetensors.torch import load_file

    from tests.dist_harness import run_on_gloo

    want = one_device()
    ranks = run_on_gloo(save_and_reload, 2, str(tmp_path), timeout=300)
    saved = ranks[0]["saved"]
    assert_state(saved, want["saved"], "saved at sp 2")
    out = ranks[0]["saved_out"]  # the saved model's forward of the next batch
    for rank, r in enumerate(ranks):
        assert_bit_equal(r["saved"], saved, "sp 2 ranks")  # every rank's single-device view
        torch.testing.assert_close(r["saved_out"], out, rtol=0, atol=0)
        for name in ("sp2", "tp2", "meta"):
            assert r[name]["extra"] == {"step": STEPS}
            assert_next_step(r[name], want, saved, out, f"rank {rank} {name}")
        weights, meta_out = r["meta_safetensors"]
        assert_bit_equal((weights, {}), (saved[0], {}), f"rank {rank} meta tp 2 from safetensors")
        assert_rel({"out": meta_out}, {"out": out}, 1e-6, f"rank {rank} meta tp 2 forward")
    assert_next_step(load_plain(tmp_path), want, saved, out, "one device")
    assert_next_step(load_simulated(tmp_path), want, saved, out, "simulated tp 2 x sp 2")
    pipe = load_pipeline(tmp_path)
    assert_bit_equal(pipe["loaded"], saved, "pipeline pp 2 x sp 2")
    torch.testing.assert_close(pipe["loss"], want["loss"].expand(4), rtol=1e-6, atol=0)
    assert_rel(pipe["grads"], want["grads"], 1e-6, "pipeline gradient")
    assert_state(pipe["after"], want["after"], "pipeline after the next step")
    # the single-device safetensors file: diffusers' names and shapes, the saved values
    weights = load_file(tmp_path / "weights.safetensors")
    ref = tiny_wan(layers=2, seed=5)
    ref.load_state_dict(weights, strict=True)
    assert_bit_equal((model_state(ref), {}), (saved[0], {}), "safetensors")
    x = {k: v for k, v in batches()[STEPS].items() if k != "target"}
    torch.testing.assert_close(ref(**x).sample.detach(), out, rtol=0, atol=1e-12)


def fsdp_save_and_reload(path: str) -> dict[str, Any]:
    """One rank of dp 2 x sp 2 with FSDP2 over dp (``DataParallel(pm, "dp", engine="fsdp")``:
    each parameter a DTensor shard): ``STEPS`` AdamW steps on the same batches on both data
    ranks, save; then load into FSDP2 at dp 2 x sp 2 from other weights."""
    torch.set_num_threads(1)
    mesh = fd.connect(dp=2, sp=2, timeout=120)
    res: dict[str, Any] = {}
    for name, seed in (("saved", 0), ("back", 5)):
        model = tiny_wan(layers=2, seed=seed)
        pm = fd.nn.parallelize(model, mesh, fd.nn.plans.wan(model, mesh))
        fd.train.DataParallel(pm, "dp", engine="fsdp")
        assert type(model.blocks[0].attn1.to_q.weight).__name__ == "DTensor"
        opt = adamw(pm.parameters())
        if name == "saved":
            train(pm, opt, batches()[:STEPS])
            fd.checkpoint.save(f"{path}/fsdp", pm, opt, extra={"step": STEPS})
        else:
            assert fd.checkpoint.load(f"{path}/fsdp", pm, opt) == {"step": STEPS}
        res[name] = (model_state(pm), optim_state(pm, opt))
    return res


def test_fsdp_times_sp_checkpoint_on_gloo(tmp_path: Path) -> None:
    """FSDP2 over dp x sp 2 on 4 gloo processes (every data rank the same batches, so the mean
    over dp is one device's gradient): the saved weights and AdamW state equal one device's
    after the same steps; they load back into FSDP2 bit-equal, and into the unmodified model
    on one device, whose next step equals one device's."""
    from tests.dist_harness import run_on_gloo

    want = one_device()
    ranks = run_on_gloo(fsdp_save_and_reload, 4, str(tmp_path), timeout=300)
    saved = ranks[0]["saved"]
    assert_state(saved, want["saved"], "saved by FSDP2 x sp 2")
    for rank, r in enumerate(ranks):
        assert_bit_equal(r["saved"], saved, f"rank {rank} saved")
        assert_bit_equal(r["back"], saved, f"rank {rank} loaded into FSDP2")
    model = tiny_wan(layers=2, seed=5)
    opt = adamw(model.parameters())
    assert fd.checkpoint.load(tmp_path / "fsdp", model, opt) == {"step": STEPS}
    got = next_step(model, opt, batches()[STEPS])
    assert_next_step(got, want, saved, got["out"], "FSDP2 x sp 2 -> one device")


def family_builds() -> list[str]:
    from tests.test_dit_tp_families import BUILD

    return sorted(BUILD)


@pytest.mark.parametrize("case", family_builds())
def test_every_family_tp_sp_checkpoint_round_trips(case: str, tmp_path: Path) -> None:
    """Every DiT family with a tensor x context plan (`fastdist.nn.plans.dit_tp.dit_tp`, tp 2 x
    sp 2, simulated: fused parts, joint streams, per-head norms): its DCP checkpoint loads into
    the unmodified model on one device, its safetensors file holds the single-device weights
    under diffusers' names, and that file loads back at tp 2 x sp 2; all bit-equal to the
    model's own weights."""
    from safetensors.torch import load_file

    from fastdist.nn.plans.dit_tp import dit_tp
    from tests.test_dit_tp_families import BUILD

    def other_weights() -> nn.Module:
        model = BUILD[case]()[0]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # everything must come from the checkpoint
        return model

    def tp_sp(model: nn.Module) -> Any:
        mesh = fd.Mesh({"tp": 2, "sp": 2})
        return fd.nn.parallelize(model, mesh, dit_tp(case.split("-")[0], model, mesh))

    model = BUILD[case]()[0]
    want = {k: v.clone() for k, v in model.state_dict().items()}
    pm = tp_sp(model)
    fd.checkpoint.save(tmp_path / "dcp", pm)
    fd.checkpoint.save(tmp_path / "weights.safetensors", pm)
    one = other_weights()
    fd.checkpoint.load(tmp_path / "dcp", one)
    back = tp_sp(other_weights())
    fd.checkpoint.load(tmp_path / "weights.safetensors", back)
    for what, got in (
        ("state_dict", pm.state_dict()),
        ("DCP -> one device", one.state_dict()),
        ("safetensors", load_file(tmp_path / "weights.safetensors")),
        ("safetensors -> tp 2 x sp 2", back.state_dict()),
    ):
        assert sorted(got) == sorted(want), what
        for name, w in want.items():
            assert torch.equal(got[name], w), f"{case} {what}: {name}"


def test_diffusers_save_pretrained_of_a_parallel_model_writes_the_whole_model(
    tmp_path: Path,
) -> None:
    """docs/models.md: ``model.save_pretrained(d)`` after `fastdist.nn.parallelize` writes the
    whole model (`fastdist.nn.hf_save`), for a diffusers model too (tp 2 x sp 1, simulated).
    diffusers' ``save_pretrained`` takes no ``state_dict=`` (it landed in ``**kwargs``) and wrote
    each parameter's shards stacked over the ranks, without an error; a later
    ``from_pretrained`` refused them. Now the file holds one device's tensors, and its config
    and tensors load back."""
    from safetensors.torch import load_file

    from fastdist.nn.plans.dit_tp import wan_tp

    ref = tiny_wan(layers=1)
    model = tiny_wan(layers=1)
    mesh = fd.Mesh({"tp": 2, "sp": 1})
    fd.nn.parallelize(model, mesh, wan_tp(model, mesh))
    model.save_pretrained(tmp_path)
    written = load_file(tmp_path / "diffusion_pytorch_model.safetensors")
    for name, w in ref.state_dict().items():
        assert tuple(written[name].shape) == tuple(w.shape), name
        assert torch.equal(written[name], w), name
    assert "state_dict" not in model.__dict__  # the model's own state_dict is back
    # the directory's config builds the model and the file loads into it strictly (diffusers'
    # from_pretrained of a Wan needs accelerate's low_cpu_mem_usage, not installed here)
    back = type(ref).from_config(type(ref).load_config(tmp_path)).to(torch.float64)
    back.load_state_dict(written, strict=True)
