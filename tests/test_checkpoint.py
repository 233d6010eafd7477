"""Distributed checkpoints (fastdist.checkpoint): written slice by slice, read on any layout.

Tiny float64 Hugging Face models (tests/test_hf_models.build): GPT-2 (vocabulary 61 padded over
tp=4, lm_head tied to wte, fused c_attn) and Llama (kv heads replicated below tp). Every check
is bitwise against the single-device state, except a resumed run on another tensor-parallel
size, whose sums run in another order (1e-12).
"""

from __future__ import annotations

import fractions
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import fastdist as fd
from fastdist import checkpoint
from tests.checkpoint_worker import make, model_state, optim_state, train
from tests.dist_harness import run_on_gloo

pytest.importorskip("transformers")


def equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same keys and bitwise equal tensors (nested dicts)."""
    if a.keys() != b.keys():
        return False
    return all(equal(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a)


def payload(path: Path) -> dict[str, int]:
    """Tensor bytes per .distcp file, from the checkpoint's metadata."""
    md = torch.distributed.checkpoint.FileSystemReader(path).read_metadata()
    out: dict[str, int] = {}
    for key, tmd in md.state_dict_metadata.items():
        for chunk in getattr(tmd, "chunks", []):
            index = torch.distributed.checkpoint.metadata.MetadataIndex(key, chunk.offsets)
            file = md.storage_data[index].relative_path
            size = tmd.properties.dtype.itemsize * chunk.sizes.numel()
            out[file] = out.get(file, 0) + size
    return out


def untied(pm: Any, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` without the second names of tied parameters (written once)."""
    module = pm.module if isinstance(pm, fd.nn.ParallelModel) else pm
    keep = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    return {k: v for k, v in state.items() if k in keep}


def nbytes(*states: dict[str, Any]) -> int:
    return sum(
        nbytes(v) if isinstance(v, dict) else v.numel() * v.element_size()
        for s in states
        for v in s.values()
    )


def trained(family: str, tp: int, sp: bool, *, kv: int = 2, steps: int = 2) -> Any:
    """A simulated tp model after ``steps`` AdamW steps, with its optimizer."""
    pm = make(family, fd.Mesh({"tp": tp}), sp=sp, kv=kv)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    train(pm, opt, steps)
    return pm, opt


@pytest.mark.parametrize("family, kv", [("gpt2", 4), ("llama", 2)])
def test_reshard_on_simulated_ranks(tmp_path: Path, family: str, kv: int) -> None:
    """tp=4 with sequence parallelism -> tp=2 without, and -> the plain model: parameters and
    AdamW state equal the single-device state bitwise; nothing duplicated, no padding written."""
    pm, opt = trained(family, 4, True, kv=kv)
    want, want_opt = model_state(pm), optim_state(pm, opt)
    checkpoint.save(tmp_path, pm, opt, extra={"step": 2, "note": "tp4"})
    assert sum(payload(tmp_path).values()) == nbytes(untied(pm, want), want_opt)
    for target in (fd.Mesh({"tp": 2}), None):
        other = make(family, target, kv=kv, seed=5)  # other weights
        params = other.parameters()
        other_opt = torch.optim.AdamW(params, lr=0.5, betas=(0.5, 0.5))
        assert checkpoint.load(tmp_path, other, other_opt) == {"step": 2, "note": "tp4"}
        assert equal(model_state(other), want)
        assert equal(optim_state(other, other_opt), want_opt)
        assert other_opt.param_groups[0]["lr"] == 1e-2 and other_opt.param_groups[0]["betas"] == (
            0.9,
            0.999,
        )


def test_resume_is_bitwise(tmp_path: Path) -> None:
    """2 steps, save, 2 more == load into a fresh model and optimizer, 2 more: bitwise on the same
    layout (LR schedule in extra), to 1e-12 on another tp (sums in another order)."""
    pm, opt = trained("gpt2", 4, True, steps=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(pm, opt, 2, sched=sched)
    checkpoint.save(tmp_path, pm, opt, extra={"sched": sched.state_dict()})
    train(pm, opt, 2, first=40, sched=sched)
    want = model_state(pm)
    for tp, sp in ((4, True), (2, False)):
        fresh = make("gpt2", fd.Mesh({"tp": tp}), sp=sp, seed=3)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
        fresh_sched.load_state_dict(checkpoint.load(tmp_path, fresh, fresh_opt)["sched"])
        train(fresh, fresh_opt, 2, first=40, sched=fresh_sched)
        got = model_state(fresh)
        if tp == 4:
            assert equal(got, want)
        else:
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12)


def test_real_ranks_write_their_own_slices_and_reshard(tmp_path: Path) -> None:
    """Simulated tp=2 -> 4 gloo ranks (tp=4, dp=2 x tp=2 with AdamW and with ZeRO-1, FSDP2 over
    dp of the tp blocks) -> 2 gloo ranks (tp=2) -> simulated tp=4 and the plain model. Each rank
    writes only its slices: one file per rank, each about a quarter of the bytes, nothing twice."""
    pm, opt = trained("tiny", 2, False)
    want, want_opt = model_state(pm), optim_state(pm, opt)
    src = tmp_path / "sim"
    checkpoint.save(src, pm, opt, extra={"step": 2})
    from tests.checkpoint_worker import four_ranks, two_ranks

    four = run_on_gloo(four_ranks, 4, str(src), str(tmp_path), want, want_opt)[0]
    assert four["extra"] == {"step": 2}
    assert equal(four["tp4"][0], want) and equal(four["tp4"][1], want_opt)
    assert equal(four["dp2tp2"][0], want) and equal(four["dp2tp2"][1], want_opt)
    assert four["fsdp"] == []  # every FSDP2 local shard and its AdamW state, bitwise
    assert "rank 0" in four["wrong optimizer"] and "AdamW" in four["wrong optimizer"]
    single = nbytes(untied(pm, want), want_opt)
    for name in ("tp4", "dp2tp2", "zero", "fsdp"):
        files = payload(tmp_path / name)
        assert [re.sub(r"_[0-9a-f]{8}_", "_", f) for f in sorted(files)] == [
            f"__{r}_0.distcp" for r in range(4)
        ], (name, files)  # __<rank>_<save id>_0.distcp
        assert sum(files.values()) == single, name  # no slice twice, no padding
        assert max(files.values()) < 0.3 * single, (name, files)  # a quarter each, about

    two = run_on_gloo(two_ranks, 2, str(tmp_path))[0]
    assert two["tp4 extra"] == {"step": 3}
    assert equal(two["tp4"][0], four["tp4 step"][0]) and equal(two["tp4"][1], four["tp4 step"][1])
    for name in ("dp2tp2", "zero", "fsdp"):
        assert equal(two[name][0], want) and equal(two[name][1], want_opt), name
    assert "rank 0: " in two["other model"] and "missing keys" in two["other model"]
    # the 2-rank save replaced the 4-rank checkpoint: its files are gone
    files = sorted(re.sub(r"_[0-9a-f]{8}_", "_", f.name) for f in (tmp_path / "fsdp").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files
    for target in (fd.Mesh({"tp": 4}), None):  # gloo -> simulated, and one device
        back = make("tiny", target, seed=12)
        back_opt = torch.optim.AdamW(back.parameters())
        assert checkpoint.load(tmp_path / "fsdp", back, back_opt) == {"from": "gloo"}
        assert equal(model_state(back), want) and equal(optim_state(back, back_opt), want_opt)


def test_zero_optimizer_state_is_the_plain_optimizers(tmp_path: Path) -> None:
    """ZeRO-1 (AdamW's state in flat chunks over dp) writes what a plain AdamW writes: each loads
    the other's checkpoint bitwise, at another layout too, and a resumed ZeRO run is bitwise."""
    from tests.test_hf_models import batch

    mesh = fd.Mesh({"dp": 2, "tp": 2})

    def run(zero: bool, seed: int = 0, steps: int = 2, first: int = 20) -> Any:
        pm = make("llama", mesh, seed=seed)
        fd.train.DataParallel(pm)
        opt = (
            fd.train.ZeroOptimizer(pm, torch.optim.AdamW, lr=1e-2)
            if zero
            else torch.optim.AdamW(pm.parameters(), lr=1e-2)
        )
        return pm, opt

    def step(pm: Any, opt: Any, first: int, steps: int = 2) -> None:
        for s in range(first, first + steps):  # each dp rank its own batch
            data = [batch(10 * s + mesh.index(r, "dp")) for r in range(mesh.size)]
            ids, labels = (torch.stack(t) for t in zip(*data))
            pm(input_ids=ids, labels=labels).loss.sum().backward()
            opt.step()
            opt.zero_grad()

    plain, plain_opt = run(False)
    zero, zero_opt = run(True)
    step(plain, plain_opt, 20)
    step(zero, zero_opt, 20)
    checkpoint.save(tmp_path / "zero", zero, zero_opt)
    checkpoint.save(tmp_path / "plain", plain, plain_opt)
    tp2 = make("llama", fd.Mesh({"tp": 2}), seed=3)
    tp2_opt = torch.optim.AdamW(tp2.parameters())
    checkpoint.load(tmp_path / "zero", tp2, tp2_opt)
    assert equal(optim_state(tp2, tp2_opt), optim_state(plain, plain_opt))
    for src in ("plain", "zero"):
        fresh, fresh_opt = run(True, seed=5)
        checkpoint.load(tmp_path / src, fresh, fresh_opt)
        assert fresh_opt.param_groups is fresh_opt.inner.param_groups
        for a, b in zip(
            zero_opt.inner.param_groups[0]["params"], fresh_opt.param_groups[0]["params"]
        ):
            assert equal(zero_opt.inner.state[a], fresh_opt.inner.state[b]), src
    step(zero, zero_opt, 40, 1)
    step(fresh, fresh_opt, 40, 1)
    assert equal(model_state(fresh), model_state(zero))
    checkpoint.save(tmp_path / "model", zero)
    with pytest.raises(fd.nn.CheckpointError, match=r"0 param groups.*no optimizer state"):
        checkpoint.load(tmp_path / "model", fresh, fresh_opt)


def test_flat_boxes_cover_a_run_of_elements_in_order() -> None:
    from fastdist.checkpoint.optimizer import flat_boxes as _flat_boxes

    shape = (3, 4, 5)
    for a in range(0, 61, 7):
        for b in range(a, 61, 5):
            seen = []
            for offs, sizes in _flat_boxes(a, b, shape):
                block = torch.arange(60).view(shape)[
                    tuple(slice(o, o + n) for o, n in zip(offs, sizes))
                ]
                seen += block.flatten().tolist()
            assert seen == list(range(a, b)), (a, b)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_get_state_dict_checkpoints_interoperate(tmp_path: Path) -> None:
    """A DCP checkpoint of torch's get_state_dict (one device) loads at tp=2, and ours converts to
    torch.save form with torch's own dcp_to_torch_save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ref = make("llama", None)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train(ref, ref_opt, 2)
    model_sd, optim_sd = get_state_dict(ref, ref_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "torch", no_dist=True)
    pm = make("llama", fd.Mesh({"tp": 2}), seed=4)
    opt = torch.optim.AdamW(pm.parameters())
    assert checkpoint.load(tmp_path / "torch", pm, opt) == {}
    assert equal(model_state(pm), model_state(ref)) and equal(
        optim_state(pm, opt), optim_state(ref, ref_opt)
    )
    checkpoint.save(tmp_path / "ours", pm, opt, extra={"step": 5})
    dcp_to_torch_save(tmp_path / "ours", tmp_path / "ours.pt")
    plain = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert equal(plain["model"], model_state(ref)) and plain["extra"] == {"step": 5}
    assert plain["optim"]["param_groups"][0]["params"][0] == "model.embed_tokens.weight"


def test_errors_name_the_key_the_rank_and_the_fix(tmp_path: Path) -> None:
    pm, opt = trained("llama", 2, False, steps=1)
    checkpoint.save(tmp_path / "ck", pm, opt)
    checkpoint.save(tmp_path / "model-only", pm)
    ck = tmp_path / "ck"

    def fails(match: str, path: Path, model: Any, optimizer: Any = None, **kw: Any) -> None:
        before = model_state(model)
        with pytest.raises(fd.nn.CheckpointError, match=match):
            checkpoint.load(path, model, optimizer, **kw)
        assert equal(model_state(model), before)  # untouched

    other = make("llama", fd.Mesh({"tp": 2}), seed=1)
    fails(r"simulated ranks.*not a distributed checkpoint.*Fix", tmp_path / "nothing", other)
    (tmp_path / "empty").mkdir()
    fails(r"not a distributed checkpoint", tmp_path / "empty", other)
    from tests.test_hf_models import build

    build("llama").save_pretrained(tmp_path / "hf")
    fails(
        r"not a distributed checkpoint.*format='safetensors'", tmp_path / "hf", other, format="dcp"
    )
    fails(r"single-device weights, no optimizer state", tmp_path / "hf", other, opt)
    kv1 = make("llama", fd.Mesh({"tp": 2}), kv=1)  # k_proj, v_proj: other shapes
    fails(
        r"'model.model.layers.0.self_attn.k_proj.weight' has shape \(16, 32\).*expects \(8, 32\)",
        ck,
        kv1,
    )
    fails(
        r"one device: .* does not match GPT2LMHeadModel: missing keys \['model\.transformer.*"
        r"unexpected keys \['model\.model\.embed_tokens.*Fix.*strict=False",
        ck,
        make("gpt2", None),
    )
    three = fd.nn.parallelize(build("llama", layers=3), fd.Mesh({"tp": 2}))
    fails(r"missing keys \['model.model.layers.2.*3 missing, 0 unexpected", ck, three)
    checkpoint.load(ck, three, strict=False)  # the first two layers
    assert equal(
        {k: v for k, v in model_state(three).items() if "layers.2" not in k}, model_state(pm)
    )
    fails(
        r"holds the state of a torch.optim.adamw.AdamW, not of a torch.optim.sgd.SGD",
        ck,
        other,
        torch.optim.SGD(other.parameters(), lr=0.1),
    )
    fails(
        r"no optimizer state.*Fix",
        tmp_path / "model-only",
        other,
        torch.optim.AdamW(other.parameters()),
    )
    params = list(other.parameters())
    two_groups = torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:]}])
    fails(r"1 param groups, this AdamW 2", ck, other, two_groups)
    # metadata that lost a chunk: the load says so instead of leaving garbage
    md_file = ck / ".metadata"
    md = pickle.loads(md_file.read_bytes())
    md.state_dict_metadata["model.lm_head.weight"].chunks.pop()
    (tmp_path / "damaged").mkdir()
    for f in ck.iterdir():
        (tmp_path / "damaged" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "damaged" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(fd.nn.CheckpointError, match=r"lm_head.weight.*incomplete or damaged"):
        checkpoint.load(tmp_path / "damaged", other)
    # save
    with pytest.raises(fd.nn.CheckpointError, match=r"simulated ranks.*extra\['f'\].*Fix"):
        checkpoint.save(tmp_path / "x", pm, extra={"f": lambda: 0})  # no pickle
    with pytest.raises(fd.nn.CheckpointError, match=r"extra\['third'\].*weights_only=True"):
        checkpoint.save(tmp_path / "x", pm, extra={"third": fractions.Fraction(1, 3)})
    (tmp_path / "file").write_text("")
    with pytest.raises(fd.nn.CheckpointError, match="is a file.*Fix"):
        checkpoint.save(tmp_path / "file", pm)
    foreign = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(fd.nn.CheckpointError, match=r"not the model's.*Fix"):
        checkpoint.save(tmp_path / "y", pm, foreign)
