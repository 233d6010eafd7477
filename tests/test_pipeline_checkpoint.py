"""Pipelines checkpoint like everything else (issue 40, point 4): `fastdist.checkpoint.save` of
a `fastdist.train.Pipeline` and its AdamW state writes the whole model's checkpoint under the
model's own names (each stage its own parameters), which loads into another pipeline layout
(pp 2 -> 4, tp 2 -> 1, with dp), into the model without a pipeline (parallel or on one
device), and back; on simulated ranks and on 4 gloo processes.

Every load is compared bitwise with the single-device state that was saved (weights and AdamW
state, gathered), and a step after it with the same step on one device (float64, 1e-9: the
reference sums in another order).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import fastdist as fd
from fastdist import checkpoint
from fastdist.errors import CheckpointError
from tests.dist_harness import run_on_gloo
from tests.pipeline_checkpoint_worker import (
    States,
    adamw,
    llama,
    on_four_ranks,
    states,
    step,
    tied_llama,
)

pytest.importorskip("transformers")

TOL = {"rtol": 0.0, "atol": 1e-9}


def equal(a: States, b: States) -> bool:
    """Same names, bitwise equal weights and optimizer state."""
    (wa, oa), (wb, ob) = a, b
    if wa.keys() != wb.keys() or oa.keys() != ob.keys():
        return False
    return all(torch.equal(wa[k], wb[k]) for k in wa) and all(
        oa[n].keys() == ob[n].keys() and all(torch.equal(oa[n][k], ob[n][k]) for k in oa[n])
        for n in oa
    )


def close(a: States, b: States) -> None:
    """Equal within `TOL` (another layout's sums run in another order)."""
    (wa, oa), (wb, ob) = a, b
    assert wa.keys() == wb.keys() and oa.keys() == ob.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")
    for n in oa:
        assert oa[n].keys() == ob[n].keys(), n
        for k in oa[n]:
            torch.testing.assert_close(oa[n][k], ob[n][k], **TOL, msg=lambda m, n=n: f"{n}: {m}")


def merged(per_rank: list[States]) -> States:
    """A pipeline on real ranks: the union of what every rank holds."""
    weights: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for w, o in per_rank:
        weights.update(w)
        optim.update(o)
    return weights, optim


def one_device(steps: int) -> tuple[Any, torch.optim.Optimizer]:
    """The plain model after ``steps`` AdamW steps (batches 0, 1, ...)."""
    ref = llama()
    opt = adamw(ref.parameters())
    for s in range(steps):
        step(ref, opt, s)
    return ref, opt


def pipe_of(mesh: dict[str, int], seed: int, **kw: Any) -> tuple[Any, torch.optim.Optimizer]:
    pipe = fd.train.pipeline(llama(seed), fd.Mesh(mesh), microbatches=kw.pop("m", 2), **kw)
    return pipe, adamw(pipe.parameters())


def test_pipeline_checkpoint_reshards_across_pp_tp_dp_and_onto_one_device(tmp_path: Path) -> None:
    """pp=2 x tp=2 after two steps, saved with AdamW -> pp=4 (tp 1), pp=2 x dp=2, tp=2 without a
    pipeline and the plain model: each holds the saved single-device state bitwise, and its next
    step is one device's."""
    ref, ref_opt = one_device(2)
    pipe = fd.train.pipeline(copy.deepcopy(llama()), fd.Mesh({"pp": 2, "tp": 2}), microbatches=2)
    opt = adamw(pipe.parameters())
    for s in range(2):
        step(pipe, opt, s)
    want = states(pipe, opt)
    close(want, states(ref, ref_opt))
    checkpoint.save(tmp_path, pipe, opt, extra={"step": 2})
    step(ref, ref_opt, 2)
    after = states(ref, ref_opt)

    model = llama(seed=5)
    tp2 = fd.nn.parallelize(model, fd.Mesh({"tp": 2}), fd.nn.plans.plan(model, fd.Mesh({"tp": 2})))
    plain = llama(seed=6)
    targets = {
        "pp4": pipe_of({"pp": 4}, 7, m=4),
        "pp2xdp2": pipe_of({"pp": 2, "dp": 2}, 8),
        "tp2": (tp2, adamw(tp2.parameters())),
        "one device": (plain, adamw(plain.parameters())),
    }
    for name, (model, opt) in targets.items():
        assert checkpoint.load(tmp_path, model, opt) == {"step": 2}, name
        assert equal(states(model, opt), want), name
        step(model, opt, 2)
        close(states(model, opt), after)


def test_checkpoints_without_a_pipeline_load_into_one(tmp_path: Path) -> None:
    """The one-device checkpoint into an interleaved pp=2 x tp=2 pipeline; that pipeline's
    checkpoint into one built on the meta device (each rank's shards given storage by the
    load): the single-device state bitwise, then one device's step."""
    ref, ref_opt = one_device(2)
    checkpoint.save(tmp_path / "one", ref, ref_opt, extra={"step": 2})
    want = states(ref, ref_opt)
    step(ref, ref_opt, 2)
    after = states(ref, ref_opt)

    pipe, opt = pipe_of({"pp": 2, "tp": 2}, 3, schedule="interleaved_1f1b")
    assert checkpoint.load(tmp_path / "one", pipe, opt) == {"step": 2}
    assert equal(states(pipe, opt), want)
    checkpoint.save(tmp_path / "pp", pipe, opt)

    with torch.device("meta"):
        meta = llama()
    pipe = fd.train.pipeline(meta, fd.Mesh({"pp": 2, "tp": 2}), microbatches=2)
    opt = adamw(pipe.parameters())
    checkpoint.load(tmp_path / "pp", pipe, opt)
    assert not any(p.is_meta for p in pipe.parameters())
    assert equal(states(pipe, opt), want)
    step(pipe, opt, 2)
    close(states(pipe, opt), after)


def test_pipeline_checkpoint_errors(tmp_path: Path) -> None:
    """Refused with the fix: a pipeline saved as safetensors; another model's checkpoint (keys
    missing from a stage) with the model and optimizer left as they were."""
    pipe, opt = pipe_of({"pp": 2}, 0)
    with pytest.raises(CheckpointError, match="format='safetensors' of a pipeline"):
        checkpoint.save(tmp_path / "w.safetensors", pipe)
    small = fd.train.pipeline(tiny_two_layers(), fd.Mesh({"pp": 2}), microbatches=2)
    checkpoint.save(tmp_path / "small", small, adamw(small.parameters()))
    before = states(pipe, opt)
    with pytest.raises(CheckpointError, match="missing keys") as e:
        checkpoint.load(tmp_path / "small", pipe, opt)
    assert "model.layers.2" in str(e.value) and "Fix:" in str(e.value)
    assert equal(states(pipe, opt), before)


def test_a_skeleton_buffer_in_every_stage_is_written_once_and_read_into_each(
    tmp_path: Path,
) -> None:
    """A persistent buffer outside the layers and the ends sits in every stage's copy of the
    skeleton: the checkpoint holds it once (as the one-device model's does), and a load fills
    every stage's copy."""
    model = llama()
    model.model.register_buffer("scale", torch.arange(3.0, dtype=torch.float64))
    pipe = fd.train.pipeline(model, fd.Mesh({"pp": 2, "tp": 2}), microbatches=2)
    checkpoint.save(tmp_path / "pp", pipe)
    plain = llama(seed=2)
    plain.model.register_buffer("scale", torch.zeros(3, dtype=torch.float64))
    checkpoint.load(tmp_path / "pp", plain)
    assert torch.equal(plain.model.scale, torch.arange(3.0, dtype=torch.float64))
    plain.model.scale.fill_(7.0)
    checkpoint.save(tmp_path / "one", plain)
    checkpoint.load(tmp_path / "one", pipe)
    for pm in pipe.stages.values():
        assert torch.equal(pm.module.model.scale, torch.full((3,), 7.0, dtype=torch.float64))


def untie(s: States, tied: dict[str, str]) -> States:
    """A pipeline's state without the last stage's copies of tied weights (checked equal to
    the first's): the one-device model's names."""
    weights, optim = dict(s[0]), dict(s[1])
    for alias, name in tied.items():
        assert torch.equal(weights.pop(alias), weights[name]), alias
        if optim:
            copy_ = optim.pop(alias)
            assert copy_.keys() == optim[name].keys()
            assert all(torch.equal(copy_[k], optim[name][k]) for k in copy_), alias
    return weights, optim


def test_tied_embeddings_across_stages_checkpoint_and_train(tmp_path: Path) -> None:
    """Tied embeddings at pp=2 x tp=2 (a copy on the first and the last stage, gradients
    summed): two clipped AdamW steps equal one device's; the checkpoint holds the weight once,
    as the tied one-device model's does, and loads into it, into pp=4 and back (both copies)."""
    ref = tied_llama()
    ref_opt = adamw(ref.parameters())
    pipe = fd.train.pipeline(copy.deepcopy(ref), fd.Mesh({"pp": 2, "tp": 2}), microbatches=2)
    opt = adamw(pipe.parameters())
    for s in range(2):
        norm = step(pipe, opt, s, clip=0.5)
        torch.testing.assert_close(norm, torch.full_like(norm, step(ref, ref_opt, s, 0.5)), **TOL)
    want = untie(states(pipe, opt), pipe.tied)
    close(want, states(ref, ref_opt))
    checkpoint.save(tmp_path / "pp", pipe, opt, extra={"step": 2})
    md = torch.distributed.checkpoint.FileSystemReader(tmp_path / "pp").read_metadata()
    assert "model.lm_head.weight" not in md.state_dict_metadata

    one = tied_llama(seed=4)
    one_opt = adamw(one.parameters())
    checkpoint.load(tmp_path / "pp", one, one_opt)
    assert equal(states(one, one_opt), want)
    checkpoint.save(tmp_path / "one", one, one_opt)
    pipe4 = fd.train.pipeline(tied_llama(seed=5), fd.Mesh({"pp": 4}), microbatches=4)
    opt4 = adamw(pipe4.parameters())
    checkpoint.load(tmp_path / "one", pipe4, opt4)
    assert equal(untie(states(pipe4, opt4), pipe4.tied), want)
    step(ref, ref_opt, 2, 0.5)
    step(pipe4, opt4, 2, 0.5)
    close(untie(states(pipe4, opt4), pipe4.tied), states(ref, ref_opt))

    # save_pretrained of a tied model holds the weight once: both copies read it
    ref.save_pretrained(tmp_path / "hf")
    with torch.device("meta"):
        meta = type(ref)(ref.config)
    pipe = fd.train.pipeline(meta, fd.Mesh({"pp": 2, "tp": 2}), microbatches=2)
    checkpoint.load(tmp_path / "hf", pipe, dtype=torch.float64)
    weights = untie((pipe.state_dict(), {}), pipe.tied)[0]
    assert weights.keys() == states(ref, ref_opt)[0].keys()
    assert all(torch.equal(w, states(ref, ref_opt)[0][k]) for k, w in weights.items())


def tiny_two_layers() -> Any:
    from tests.tiny_models import tiny_llama

    return tiny_llama(2, seed=1).eval()


def test_pipeline_checkpoint_on_gloo(tmp_path: Path) -> None:
    """4 gloo processes: the one-device checkpoint -> pp=2 x tp=2 -> (a step) -> pp=4 -> (a step)
    -> pp=2 x dp=2 interleaved (two stages per rank; dp replicas written once) -> dp=2 x tp=2
    without a pipeline -> the plain model here; tied embeddings at pp=2 x tp=2 (a clipped step:
    the copies on the first and the last stage's ranks stay bitwise equal) and back. Every load
    bitwise equal to the state saved; every step one device's; each rank writes its own slices,
    nothing twice; another model's checkpoint refused on every rank (also the ranks whose
    stages it matches)."""
    from tests.test_checkpoint import nbytes, payload

    ref, ref_opt = one_device(2)
    checkpoint.save(tmp_path / "one", ref, ref_opt, extra={"step": 2})
    small = fd.train.pipeline(tiny_two_layers(), fd.Mesh({"pp": 2}), microbatches=2)
    checkpoint.save(tmp_path / "other", small)
    want = states(ref, ref_opt)
    steps = []
    for s in (2, 3):
        step(ref, ref_opt, s)
        steps.append(states(ref, ref_opt))
    tied = tied_llama()
    tied_opt = adamw(tied.parameters())
    for s in range(2):
        step(tied, tied_opt, s, clip=0.5)
    checkpoint.save(tmp_path / "tied_one", tied, tied_opt)
    want_tied = states(tied, tied_opt)
    tied_norm = float(step(tied, tied_opt, 2, clip=0.5))

    res = run_on_gloo(on_four_ranks, 4, str(tmp_path / "one"), str(tmp_path), timeout=240)
    assert [r["pp2tp2 extra"] for r in res] == [{"step": 2}] * 4
    assert equal(merged([r["pp2tp2"] for r in res]), want)
    pp2_step = merged([r["pp2tp2 step"] for r in res])
    close(pp2_step, steps[0])
    assert [r["pp4 extra"] for r in res] == [{"step": 3}] * 4
    assert equal(merged([r["pp4"] for r in res]), pp2_step)
    pp4_step = merged([r["pp4 step"] for r in res])
    close(pp4_step, steps[1])
    assert [r["pp2dp2 extra"] for r in res] == [{"step": 4}] * 4
    assert equal(merged([r["pp2dp2"] for r in res]), pp4_step)
    assert all(equal(merged([r["pp2dp2"] for r in res[d::2]]), pp4_step) for d in (0, 1))
    assert res[0]["dp2tp2 extra"] == {"step": 4}
    assert all(equal(r["dp2tp2"], pp4_step) for r in res)
    # tied embeddings: the copies on the first and the last stage's ranks equal, bitwise
    alias = {"lm_head.weight": "model.embed_tokens.weight"}
    assert equal(untie(merged([r["tied"] for r in res]), alias), want_tied)
    assert all(abs(r["tied norm"] - tied_norm) < 1e-12 for r in res)
    tied_step = untie(merged([r["tied step"] for r in res]), alias)
    close(tied_step, states(tied, tied_opt))
    back = tied_llama(seed=3)
    back_opt = adamw(back.parameters())
    checkpoint.load(tmp_path / "tied_pp", back, back_opt)
    assert equal(states(back, back_opt), tied_step)
    for r in res:
        assert "missing keys" in r["other model"] and "model.layers.2" in r["other model"]
    assert "process rank 2 refused" in res[0]["other model"]  # pp=0 holds what it has

    for name in ("pp2tp2", "pp4", "pp2dp2"):
        files = payload(tmp_path / name)
        assert len(files) == 4, (name, files)  # one file per rank
        assert sum(files.values()) == nbytes(*want), name  # nothing twice, no padding
    plain = llama(seed=9)
    opt = adamw(plain.parameters())
    assert checkpoint.load(tmp_path / "pp4", plain, opt) == {"step": 4}
    assert equal(states(plain, opt), pp4_step)


def tied_moe(family: str) -> Any:
    """A tiny float64 MoE (4 experts, 2 layers) with tied input and output embeddings."""
    from tests import tiny_models

    return tiny_models.build(
        family, kv=2, seed=3, fill_zeros=True, tie_word_embeddings=True, output_router_logits=False
    )


def safetensors_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_tied_moe_pipeline_save_pretrained_loads_in_from_pretrained(
    tmp_path: Path, family: str
) -> None:
    """A tied MoE at pp2 x tp2 after an SGD step: ``save_pretrained`` (the pipeline's, the
    model's given to pipeline(), a stage's) writes the files one device's ``save_pretrained``
    writes (one tensor per expert, the tied weight once), which plain ``from_pretrained`` loads
    bitwise equal to the pipeline's weights (the embedding owned by the first stage, used by the
    last); and ``fd.checkpoint.load`` reads them back into a fresh pipeline."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import VOCAB

    model = tied_moe(family).train()
    tied_moe(family).save_pretrained(tmp_path / "one")
    mesh = fd.Mesh({"pp": 2, "tp": 2})
    pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    assert pipe.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    ids = ids.expand(mesh.size, *ids.shape)  # [ranks, 2, 8]
    pipe.step(input_ids=ids, labels=ids)
    torch.optim.SGD(pipe.parameters(), lr=0.5).step()
    want = pipe.state_dict()
    assert torch.equal(want["lm_head.weight"], want["model.embed_tokens.weight"])
    assert not torch.equal(want["model.embed_tokens.weight"], tied_moe(family).lm_head.weight)
    for name, save in {
        "pipe": pipe.save_pretrained,
        "model": model.save_pretrained,
        "stage": pipe.stages[1].module.save_pretrained,
    }.items():
        save(tmp_path / name)
        assert safetensors_keys(tmp_path / name) == safetensors_keys(tmp_path / "one"), name
        back = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float64)
        assert back.lm_head.weight is back.model.embed_tokens.weight
        got = back.state_dict()
        assert got.keys() == want.keys(), name
        assert all(torch.equal(got[k], w) for k, w in want.items()), name
    # the per-expert files into a fresh tied pipeline (the last stage reads the tied weight
    # under the first stage's name, the experts under their fused names)
    again = fd.train.pipeline(tied_moe(family), mesh, schedule="1f1b", microbatches=2)
    checkpoint.load(tmp_path / "pipe", again)
    got = again.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], w) for k, w in want.items())
