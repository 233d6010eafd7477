"""`fastdist.train.pipeline` of a diffusers DiT (issue 38, "composes with pipelines"): a tiny
float64 ``WanTransformer3DModel`` split into stages over ``pp`` (GPipe, 1F1B, interleaved 1F1B),
alone and with its tokens split over ``sp`` inside each stage (pp x sp), on simulated ranks,
against the unmodified model on one device: the loss (the mean of ``weighting * (output -
target) ** 2``), every parameter's gradient, the whole-model gradient clip, an SGD step; and the
refusals; and pp 2 on two gloo processes (``tests/pipeline_dit_worker.py``).

Wan computes its norms and modulation in float32 on purpose (``FP32LayerNorm``, ``.float()``):
a batch split into micro-batches, or ranks batched by the simulation, differ from one device's
whole batch by float32 rounding, hence 1e-6 of each gradient's largest entry (as in
``tests/test_context_parallel.py``); measured 2e-7 (the same as one device accumulating two
micro-batches against its whole batch).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fastdist as fd
from fastdist.errors import PipelineError
from fastdist.train.pipeline import SPLITS, DitSplit

pytest.importorskip("diffusers.models.transformers.transformer_wan")

from tests.dist_harness import run_on_gloo  # noqa: E402
from tests.pipeline_dit_worker import (  # noqa: E402
    batch,
    cogvideox_batch,
    flux_batch,
    hunyuan_batch,
    ltx_batch,
    one_device,
    sd3_batch,
    tiny_cogvideox,
    tiny_flux,
    tiny_hunyuan_video,
    tiny_ltx,
    tiny_sd3,
    tiny_wan,
    wan_on_2,
)

TOL = 1e-6  # relative to each gradient's largest entry (Wan's float32 norms)


def on_ranks(b: dict[str, Tensor], mesh: fd.Mesh) -> dict[str, Tensor]:
    return {k: v.expand(mesh.size, *v.shape) for k, v in b.items()}


def assert_grads(
    got: dict[str, Tensor], ref: nn.Module, tol: float = TOL, floor: float = 0.0
) -> None:
    """``got`` has the gradients of ``ref``'s parameters that have one, each within ``tol`` of
    it relative to its largest entry (or to ``floor``, where that is larger)."""
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert sorted(got) == sorted(want)
    for name, g in want.items():
        scale = g.abs().max().clamp(min=floor) if floor else g.abs().max()
        err = float((got[name] - g).abs().max() / scale)
        assert err < tol, f"{name}: {err:.2e}"


CASES = [
    ("gpipe", {"pp": 2}),
    ("1f1b", {"pp": 2}),
    ("interleaved_1f1b", {"pp": 2}),
    ("1f1b", {"pp": 2, "sp": 2}),
    ("gpipe", {"sp": 2, "pp": 2}),
]


@pytest.mark.parametrize(("sched", "shape"), CASES)
def test_step_equals_one_device(sched: str, shape: dict[str, int]) -> None:
    model, b = tiny_wan(), batch(weighted=sched == "1f1b")
    ref = copy.deepcopy(model)
    want = one_device(ref, b)
    mesh = fd.Mesh(shape)
    virtual = 2 if sched == "interleaved_1f1b" else 1
    pipe = fd.train.pipeline(model, mesh, schedule=sched, microbatches=2, virtual=virtual)
    loss = pipe.step(**on_ranks(b, mesh))
    assert loss.shape == (mesh.size,)
    torch.testing.assert_close(loss, want.expand(mesh.size), rtol=1e-9, atol=0)
    assert_grads(pipe.grads(), ref)
    # each stage holds its blocks, the ends where they belong, a copy of the condition embedder
    last = pipe.schedule.stages - 1
    for j, pm in pipe.stages.items():
        names = {n for n, _ in pm.module.named_parameters()}
        blocks = {int(n.split(".")[1]) for n in names if n.startswith("blocks.")}
        assert blocks == set(pipe.layers[j])
        assert any(n.startswith("condition_embedder.") for n in names)
        assert ("patch_embedding.weight" in names) == (j == 0)
        assert ("scale_shift_table" in names) == ("proj_out.weight" in names) == (j == last)
    cond = "condition_embedder.time_embedder.linear_1.weight"
    first = pipe.stages[0].module.get_parameter(cond).grad
    for pm in pipe.stages.values():  # the summed gradient, bitwise the same on every stage
        assert torch.equal(pm.module.get_parameter(cond).grad, first)


def test_activations_travel_split_over_sp() -> None:
    """pp x sp: the activations travel split (each sp rank hands on its own tokens)."""
    model, b = tiny_wan(layers=2), batch(n=2)
    mesh = fd.Mesh({"pp": 2, "sp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=1)
    sent: list[tuple[int, ...]] = []
    block = pipe.stages[1].module.blocks[1]  # the received activation, after the hand-in
    handle = block.register_forward_pre_hook(lambda m, a: sent.append(tuple(a[0].shape)))
    try:
        pipe.step(**on_ranks(b, mesh))
    finally:
        handle.remove()
    assert sent and sent[0][-2] == 8 // 2  # 8 tokens, 4 per sp rank (under the rank batching)


def test_clip_and_sgd_step_equal_one_device() -> None:
    model, b = tiny_wan(), batch()
    ref = copy.deepcopy(model)
    one_device(ref, b)
    want_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    ref_opt.step()
    mesh = fd.Mesh({"pp": 2, "sp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    pipe.step(**on_ranks(b, mesh))
    total = pipe.clip_grad_norm_(0.05)  # the condition embedder counted once, not per stage
    torch.testing.assert_close(total, want_total.expand(mesh.size), rtol=1e-6, atol=0)
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-2)
    opt.step()
    state = pipe.state_dict()
    for name, p in ref.named_parameters():
        err = float((state[name] - p.detach()).abs().max())
        assert err < 1e-8, f"{name}: {err:.2e}"
    cond = "condition_embedder.text_embedder.linear_1.weight"
    copies = [pm.module.get_parameter(cond) for pm in pipe.stages.values()]
    assert all(torch.equal(c, copies[0]) for c in copies)  # the copies stay equal


def test_two_steps_accumulate_like_one_device() -> None:
    model = tiny_wan(layers=2)
    ref = copy.deepcopy(model)
    b1, b2 = batch(seed=3), batch(seed=4)
    one_device(ref, b1)
    one_device(ref, b2)
    mesh = fd.Mesh({"pp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="gpipe", microbatches=4)
    pipe.step(**on_ranks(b1, mesh))
    pipe.step(**on_ranks(b2, mesh))
    assert_grads(pipe.grads(), ref)


def test_pp_dp_sp_data_parallel_and_a_checkpoint_at_another_layout(tmp_path: Any) -> None:
    """pp 2 x dp 2 x sp 2, each dp rank its own half of a batch of 8, fastdist's data
    parallelism: the gradients of one device's whole batch; a checkpoint of it loads into a
    pp 2 pipeline of another model with the same weights."""
    model, whole = tiny_wan(), batch(n=8)
    ref = copy.deepcopy(model)
    one_device(ref, whole)
    mesh = fd.Mesh({"dp": 2, "pp": 2, "sp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    fd.train.DataParallel(pipe, "dp")
    dp = [mesh.coords(r)["dp"] for r in range(mesh.size)]
    x = {k: torch.stack([v[4 * d : 4 * d + 4] for d in dp]) for k, v in whole.items()}
    pipe.step(**x)
    assert_grads(pipe.grads(), ref)
    fd.checkpoint.save(str(tmp_path), pipe)
    other = fd.train.pipeline(tiny_wan(seed=5), fd.Mesh({"pp": 2}), schedule="gpipe")
    fd.checkpoint.load(str(tmp_path), other)
    want, got = pipe.state_dict(), other.state_dict()
    assert sorted(got) == sorted(want) == sorted(n for n, _ in ref.named_parameters())
    assert all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize(
    ("sched", "shape"),
    [("1f1b", {"pp": 2}), ("interleaved_1f1b", {"pp": 2}), ("gpipe", {"pp": 2, "sp": 2})],
)
def test_ltx_video_step_equals_one_device(sched: str, shape: dict[str, int]) -> None:
    """LTX-Video (one block list, a linear patch embedding over patchified tokens, the timestep
    and caption embedders on every stage): no float32 internals, so equal to rounding."""
    model, b = tiny_ltx(), ltx_batch()
    ref = copy.deepcopy(model)
    want = one_device(ref, b)
    mesh = fd.Mesh(shape)
    virtual = 2 if sched == "interleaved_1f1b" else 1
    pipe = fd.train.pipeline(model, mesh, schedule=sched, microbatches=2, virtual=virtual)
    assert pipe.shared and all(
        n.startswith(("time_embed.", "caption_projection.")) for n in pipe.shared
    )
    x = {k: v.expand(mesh.size, *v.shape) if isinstance(v, Tensor) else v for k, v in b.items()}
    loss = pipe.step(**x)
    torch.testing.assert_close(loss, want.expand(mesh.size), rtol=1e-12, atol=0)
    assert_grads(pipe.grads(), ref, tol=1e-12)


def on_ranks_any(b: dict[str, Any], mesh: fd.Mesh) -> dict[str, Any]:
    """Every tensor (and tuple of tensors) with the leading rank dim; other values as given."""

    def put(v: Any) -> Any:
        if isinstance(v, tuple):
            return tuple(put(t) for t in v)
        return v.expand(mesh.size, *v.shape) if isinstance(v, Tensor) else v

    return {k: put(v) for k, v in b.items()}


@pytest.mark.parametrize(
    ("sched", "shape", "rotary"),
    [
        ("1f1b", {"pp": 2}, False),
        ("interleaved_1f1b", {"pp": 2}, True),
        ("gpipe", {"pp": 2, "sp": 2}, True),
    ],
)
def test_cogvideox_step_equals_one_device(sched: str, shape: dict[str, int], rotary: bool) -> None:
    """CogVideoX: every block updates the text stream too, so a stage hands on ``[text; image
    tokens]`` (under sp: the whole text and the rank's image tokens) and the next splits it;
    the timestep embedding on every stage. No float32 internals: equal to rounding."""
    model, b = tiny_cogvideox(rotary), cogvideox_batch(rotary)
    ref = copy.deepcopy(model)
    want = one_device(ref, b)
    mesh = fd.Mesh(shape)
    virtual = 2 if sched == "interleaved_1f1b" else 1
    pipe = fd.train.pipeline(model, mesh, schedule=sched, microbatches=2, virtual=virtual)
    assert pipe.shared and all(n.startswith("time_embedding.") for n in pipe.shared)
    loss = pipe.step(**on_ranks_any(b, mesh))
    torch.testing.assert_close(loss, want.expand(mesh.size), rtol=1e-12, atol=0)
    # floor: the keys' norm bias has a gradient of 1e-19 (softmax ignores a shift of every key)
    assert_grads(pipe.grads(), ref, tol=1e-12, floor=1e-6)


@pytest.mark.parametrize(
    ("sched", "shape"),
    [("1f1b", {"pp": 2}), ("interleaved_1f1b", {"pp": 2}), ("gpipe", {"pp": 2, "sp": 2})],
)
def test_sd3_step_equals_one_device(sched: str, shape: dict[str, int]) -> None:
    """SD3 (MM-DiT): its blocks return ``(text, image)``; the text stream handed on with the image
    tokens; the patch and context embedders the first stage's, the timestep + pooled-text
    embedder on every stage. Equal to rounding."""
    model, b = tiny_sd3(), sd3_batch()
    ref = copy.deepcopy(model)
    want = one_device(ref, b)
    mesh = fd.Mesh(shape)
    virtual = 2 if sched == "interleaved_1f1b" else 1
    pipe = fd.train.pipeline(model, mesh, schedule=sched, microbatches=2, virtual=virtual)
    assert pipe.shared and all(n.startswith("time_text_embed.") for n in pipe.shared)
    loss = pipe.step(**on_ranks(b, mesh))
    torch.testing.assert_close(loss, want.expand(mesh.size), rtol=1e-12, atol=0)
    assert_grads(pipe.grads(), ref, tol=1e-12, floor=1e-6)
    with pytest.raises(PipelineError, match=r"\['skip_layers'\] would skip or change blocks"):
        pipe.step(**on_ranks(b, mesh), skip_layers=[1])


@pytest.mark.parametrize(
    ("sched", "shape", "per_stage"),
    [
        ("1f1b", {"pp": 2}, None),  # the double blocks, then the single ones
        ("gpipe", {"pp": 2}, [3, 1]),  # a stage across the two lists
        ("interleaved_1f1b", {"pp": 2}, None),
        ("1f1b", {"pp": 2, "sp": 2}, [1, 3]),
    ],
)
@pytest.mark.parametrize("family", ["flux", "hunyuan_video"])
def test_two_list_step_equals_one_device(
    sched: str, shape: dict[str, int], per_stage: list[int] | None, family: str
) -> None:
    """Flux and HunyuanVideo: two block lists (double-stream, then single-stream) with the same
    arguments and outputs, split into stages as one list; the text stream handed on (Flux's
    position ids whole in every micro-batch; HunyuanVideo's text padding mask, its token
    refiner the first stage's). Equal to rounding."""
    model, b = (
        (tiny_flux(), flux_batch()) if family == "flux" else (tiny_hunyuan_video(), hunyuan_batch())
    )
    ref = copy.deepcopy(model)
    want = one_device(ref, b)
    mesh = fd.Mesh(shape)
    virtual = 2 if sched == "interleaved_1f1b" else 1
    pipe = fd.train.pipeline(
        model, mesh, schedule=sched, microbatches=2, virtual=virtual, layers_per_stage=per_stage
    )
    loss = pipe.step(**on_ranks(b, mesh))
    torch.testing.assert_close(loss, want.expand(mesh.size), rtol=1e-12, atol=0)
    assert_grads(pipe.grads(), ref, tol=1e-12, floor=1e-6)


def test_pp_dp_two_steps_accumulate_with_data_parallel() -> None:
    """SD3 at pp 2 x dp 2 with fastdist's data parallelism, two steps without ``zero_grad``:
    each dp rank its half of each batch; the shared embedder's copies set aside and added back
    around the reduction: one device's accumulated gradients."""
    model = tiny_sd3()
    ref = copy.deepcopy(model)
    steps = [sd3_batch(n=8, seed=1), sd3_batch(n=8, seed=2)]
    for b in steps:
        one_device(ref, b)
    mesh = fd.Mesh({"dp": 2, "pp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    fd.train.DataParallel(pipe, "dp")
    dp = [mesh.coords(r)["dp"] for r in range(mesh.size)]
    for b in steps:
        pipe.step(**{k: torch.stack([v[4 * d : 4 * d + 4] for d in dp]) for k, v in b.items()})
    got = pipe.grads()
    for name, p in ref.named_parameters():
        assert p.grad is not None
        err = float((got[name] - p.grad).abs().max() / max(float(p.grad.abs().max()), 1e-6))
        assert err < 1e-12, f"{name}: {err:.2e}"


# ----------------------------------------------------------------------------- refusals
def test_refuses_a_family_without_stages() -> None:
    from tests.test_dit_families_joint import tiny_qwen_image

    model, _ = tiny_qwen_image()
    with pytest.raises(PipelineError, match=r"QwenImageTransformer2DModel .*img_shapes.*Fix:"):
        fd.train.pipeline(model, fd.Mesh({"pp": 2}))


def test_refuses_tp_and_a_wrong_split() -> None:
    with pytest.raises(PipelineError, match=r"not tensor parallelism over 'tp'.*Fix:"):
        fd.train.pipeline(tiny_wan(), fd.Mesh({"pp": 2, "tp": 2}))
    with pytest.raises(PipelineError, match=r"DitSplit"):
        fd.train.pipeline(tiny_wan(), fd.Mesh({"pp": 2}), split=SPLITS["llama"])


def test_refuses_a_parameter_no_stage_holds() -> None:
    split = DitSplit(
        "blocks", ("patch_embedding",), (), ("norm_out", "proj_out", "scale_shift_table")
    )
    with pytest.raises(PipelineError, match=r"condition_embedder\..* belongs to no stage"):
        fd.train.pipeline(tiny_wan(), fd.Mesh({"pp": 2}), split=split)


def test_refuses_a_bad_batch_and_calls_to_the_model() -> None:
    model = tiny_wan(layers=2)
    mesh = fd.Mesh({"pp": 2})
    pipe = fd.train.pipeline(model, mesh, microbatches=2)
    b = on_ranks(batch(), mesh)
    with pytest.raises(PipelineError, match=r"missing \['target'\]"):
        pipe.step(**{k: v for k, v in b.items() if k != "target"})
    with pytest.raises(PipelineError, match=r"not supported \['labels'\]"):
        pipe.step(**b, labels=b["target"])
    with pytest.raises(PipelineError, match=r"target .* output's shape"):
        pipe.step(**{**b, "target": b["target"][..., :2]})
    with pytest.raises(PipelineError, match=r"weighting of shape"):
        pipe.step(**b, weighting=torch.ones(mesh.size, 4, 4, dtype=torch.float64))
    with pytest.raises(PipelineError, match=r"output has shape .*4, 2, 4, 4.*target .*1, 2, 4, 4"):
        pipe.step(**{**b, "target": b["target"][:, :, :1]})  # one channel: would broadcast
    with pytest.raises(PipelineError, match=r"encoder_hidden_states of shape .* for a batch of 4"):
        pipe.step(**{**b, "encoder_hidden_states": b["encoder_hidden_states"][:, :2]})
    with pytest.raises(PipelineError, match=r"does not split into 2 micro-batches"):
        pipe.step(**on_ranks(batch(n=3), mesh))
    with pytest.raises(PipelineError, match=r"save_pretrained is not built.*Fix:"):
        pipe.save_pretrained("/nonexistent")
    with pytest.raises(PipelineError, match=r"taken apart by fastdist.train.pipeline"):
        model(**{k: v for k, v in batch().items() if k != "target"})


def test_tied_llm_embeddings_accumulate_over_steps() -> None:
    """Two steps without ``zero_grad`` (gradient accumulation): a weight held in two copies
    (a causal LM's tied embeddings, like a DiT's shared condition embedder) gets each step's
    gradient once (before the fix: the first step's twice, silently)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).double()
    ref = copy.deepcopy(model)
    steps = [
        torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(s)) for s in (1, 2)
    ]
    for ids in steps:
        logits = ref(input_ids=ids).logits
        torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1)
        ).backward()
    mesh = fd.Mesh({"pp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    assert pipe.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    for ids in steps:
        pipe.step(input_ids=ids.expand(2, 4, 8), labels=ids.expand(2, 4, 8))
    got = pipe.grads()
    for name, p in ref.named_parameters():
        assert p.grad is not None
        err = float((got[name] - p.grad).abs().max() / p.grad.abs().max())
        assert err < 1e-9, f"{name}: {err:.2e}"


def test_refuses_rotary_tables_that_differ_between_stages() -> None:
    """Every stage reads its own copy of the step's inputs, a tuple's tensors too (CogVideoX's
    rotary tables): copies that differ along pp are refused, not mixed into one loss."""
    model, b = tiny_cogvideox(True), cogvideox_batch(True)
    mesh = fd.Mesh({"pp": 2})
    pipe = fd.train.pipeline(model, mesh, microbatches=2)
    x = on_ranks_any(b, mesh)
    cos, sin = x["image_rotary_emb"]
    x["image_rotary_emb"] = (cos, torch.stack([sin[0], sin[1] + 1e-3]))
    with pytest.raises(PipelineError, match=r"different image_rotary_emb\[1\]"):
        pipe.step(**x)


# ----------------------------------------------------------------------------- real ranks
def test_pp2_on_gloo_equals_one_device() -> None:
    """2 gloo processes, pp 2: each schedule's loss and the gradients of each rank's stages equal
    one device (Wan under each schedule; SD3, whose text stream is handed on, under 1F1B; Wan
    and CogVideoX with diffusers' gradient checkpointing, which recomputes each stage's first
    and last blocks in backward);
    every parameter is held by the ranks of its stages (the condition embedder by
    both); latents that differ between the ranks are refused (the digest reads float bits)."""
    got = run_on_gloo(wan_on_2, 2, timeout=300)
    for case in ("gpipe", "1f1b", "interleaved_1f1b", "sd3_1f1b", "wan_ckpt", "cogvideox_ckpt"):
        tol = TOL if case in ("gpipe", "1f1b", "interleaved_1f1b", "wan_ckpt") else 1e-12
        for r in (g[case] for g in got):
            assert r["loss_shape"] == () and r["loss_err"] < 1e-9, (case, r["loss_err"])
            assert r["grad_err"] < tol, (case, r["grad_err"])
        names = [set(g[case]["names"]) for g in got]
        assert names[0] | names[1] == set(got[0][case]["model"])
        shared = names[0] & names[1]
        embedder = {"sd3_1f1b": "time_text_embed.", "cogvideox_ckpt": "time_embedding."}.get(
            case, "condition_embedder."
        )
        assert shared and all(n.startswith(embedder) for n in shared)
    for g in got:
        assert g["differs"] is not None and "different hidden_states" in g["differs"], g["differs"]
