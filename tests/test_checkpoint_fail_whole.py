"""Checkpoints that fail whole (issue 40): a load that cannot complete (a truncated, damaged or
missing file) raises `fastdist.errors.CheckpointError` (an ``Exception``) naming the file and
leaves the model and optimizer as they were; a save replaces an earlier checkpoint atomically
and creates the directory it is given; ``model.save_pretrained`` of a parallelized
transformers model writes the whole model, loadable by a plain ``from_pretrained``.

Tiny float64 Hugging Face models (tests/tiny_models.py), tp=2, on simulated ranks and on 2 gloo
processes; every comparison is bitwise against the single-device state.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import fastdist as fd
from fastdist import checkpoint
from fastdist.checkpoint import dcp
from tests.checkpoint_worker import cut, fail_whole, make, model_state, train
from tests.dist_harness import run_on_gloo

pytest.importorskip("transformers")


def trained_llama() -> tuple[Any, torch.optim.Optimizer]:
    pm = make("llama", fd.Mesh({"tp": 2}))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    train(pm, opt, 1)
    return pm, opt


def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def fails_whole(path: Path, match: str, optimizer: bool = True, **kw: Any) -> None:
    """Loading ``path`` into a fresh model (and AdamW) raises a CheckpointError matching
    ``match``, caught as an Exception; the model and optimizer are exactly as before."""
    pm = make("llama", fd.Mesh({"tp": 2}), seed=4)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3) if optimizer else None
    if opt is not None:
        train(pm, opt, 1, first=50)  # optimizer state to keep
    before = model_state(pm)
    before_opt = copy.deepcopy(opt.state_dict()) if opt is not None else None
    caught: Exception | None = None
    try:
        checkpoint.load(path, pm, opt, **kw)
    except Exception as e:  # a training loop's fallback: not a BaseException escaping
        caught = e
    assert isinstance(caught, fd.nn.CheckpointError), repr(caught)
    assert re.search(match, str(caught)), str(caught)
    after = model_state(pm)
    assert all(torch.equal(before[k], after[k]) for k in before)
    if opt is not None:
        assert before_opt is not None
        now = opt.state_dict()
        assert now["param_groups"] == before_opt["param_groups"]
        for i, st in before_opt["state"].items():
            assert all(torch.equal(v, now["state"][i][k]) for k, v in st.items())


@pytest.mark.parametrize("fraction", [0.1, 0.9])
def test_a_truncated_distcp_file_fails_whole(tmp_path: Path, fraction: float) -> None:
    pm, opt = trained_llama()
    checkpoint.save(tmp_path / "ck", pm, opt)
    bad = copy_dir(tmp_path / "ck", tmp_path / "bad")
    (file,) = bad.glob("*.distcp")
    cut(str(file), fraction)
    fails_whole(bad, rf"{re.escape(str(file))} is truncated.*Fix")


def test_damaged_bytes_and_a_missing_file_fail_whole(tmp_path: Path) -> None:
    pm, opt = trained_llama()
    checkpoint.save(tmp_path / "ck", pm, opt)
    bad = copy_dir(tmp_path / "ck", tmp_path / "bad")
    (file,) = bad.glob("*.distcp")
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, in the middle of the tensors' bytes
    file.write_bytes(bytes(data))
    fails_whole(bad, rf"{re.escape(str(file))} is damaged.*CRC-32")
    file.unlink()
    fails_whole(bad, rf"reading {re.escape(str(bad))} failed.*{file.name}")


@pytest.mark.parametrize("fraction", [0.1, 0.9])
def test_a_truncated_safetensors_file_fails_whole(tmp_path: Path, fraction: float) -> None:
    from tests.tiny_models import build

    build("llama").save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    cut(str(file), fraction)
    fails_whole(tmp_path / "hf", rf"{re.escape(str(file))} cannot be read", optimizer=False)


def test_a_save_that_dies_keeps_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second save over the first dies after every rank wrote its files, before the commit: the
    first checkpoint loads as it was; the next save removes the orphans."""
    pm, opt = trained_llama()
    want = model_state(pm)
    checkpoint.save(tmp_path / "ck", pm, opt, extra={"step": 1})
    train(pm, opt, 1, first=30)

    def die(self: Any, metadata: Any, results: Any) -> None:
        raise OSError("killed before the commit")

    with monkeypatch.context() as m:
        m.setattr(dcp.Writer, "finish", die)
        with pytest.raises(fd.nn.CheckpointError, match="before is unchanged.*OSError: killed"):
            checkpoint.save(tmp_path / "ck", pm, opt, extra={"step": 2})
    assert len(list((tmp_path / "ck").glob("*.distcp"))) == 2  # the old file and an orphan
    back = make("llama", fd.Mesh({"tp": 2}), seed=4)
    assert checkpoint.load(tmp_path / "ck", back) == {"step": 1}
    got = model_state(back)
    assert all(torch.equal(want[k], got[k]) for k in want)
    (tmp_path / "ck" / "notes.txt").write_text("mine")
    checkpoint.save(tmp_path / "ck", pm, opt, extra={"step": 2})
    names = sorted(f.name for f in (tmp_path / "ck").iterdir())
    assert len(names) == 3 and names[0] == ".metadata" and names[2] == "notes.txt", names
    assert checkpoint.load(tmp_path / "ck", back) == {"step": 2}


def test_save_creates_the_directory_it_is_given(tmp_path: Path) -> None:
    """A path that does not exist becomes a directory (never a file), for both formats; the
    safetensors directory of a transformers model loads with a plain from_pretrained."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import build

    ref = build("llama")
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    pm = fd.nn.parallelize(ref, fd.Mesh({"tp": 2}))
    checkpoint.save(tmp_path / "a" / "final", pm)
    assert (tmp_path / "a" / "final" / ".metadata").is_file()
    checkpoint.save(tmp_path / "b" / "final", pm, format="safetensors")
    assert (tmp_path / "b" / "final" / "model.safetensors").is_file()
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "final", dtype=torch.float64)
    assert all(torch.equal(want[k], v) for k, v in back.state_dict().items())
    checkpoint.save(tmp_path / "c" / "w.safetensors", pm)
    assert (tmp_path / "c" / "w.safetensors").is_file()
    assert not [f for f in os.listdir(tmp_path / "c") if f.endswith(".tmp")]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_save_pretrained_of_a_parallel_model_writes_the_whole_model(
    tmp_path: Path, family: str
) -> None:
    """``model.save_pretrained`` after parallelize (simulated tp=2; GPT-2: padded vocabulary, tied
    head): a plain from_pretrained gets the single-device weights bitwise."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import build

    model = build(family)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fd.nn.parallelize(model, fd.Mesh({"tp": 2}))
    model.save_pretrained(tmp_path / "new" / "hf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "new" / "hf", dtype=torch.float64)
    got = back.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_on_gloo_a_damaged_checkpoint_fails_whole_on_every_rank(tmp_path: Path) -> None:
    """2 gloo ranks: rank 1's file truncated; rank 0 reads its own boxes fine, yet both ranks raise
    a CheckpointError naming the file and keep their model and optimizer; then
    ``model.save_pretrained`` on both ranks writes the gathered model."""
    from transformers import AutoModelForCausalLM

    res = run_on_gloo(fail_whole, 2, str(tmp_path))
    for r in res:
        kind, text = r["error"]
        assert kind == "CheckpointError" and re.search(r"__1_\w+_0\.distcp is truncated", text)
        assert r["unchanged"] and r["optimizer empty"]
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    got = back.state_dict()
    assert all(torch.equal(res[0]["state"][k], got[k]) for k in got)


def test_a_meta_model_loads_a_distributed_checkpoint_shards_only(tmp_path: Path) -> None:
    """A Llama built on the meta device and parallelized (tp=2) loads a DCP checkpoint with no
    init first: each tensor gets its shard's storage (the local shape), the values equal the
    saved model's bitwise, and the model runs; a load that fails (a truncated file) puts every
    tensor back on the meta device."""
    from tests.test_hf_models import rep
    from tests.tiny_models import instantiate

    pm, opt = trained_llama()
    want = model_state(pm)
    checkpoint.save(tmp_path / "ck", pm, opt)
    bad = copy_dir(tmp_path / "ck", tmp_path / "bad")
    (file,) = bad.glob("*.distcp")
    cut(str(file), 0.1)

    def meta() -> Any:
        with torch.device("meta"):
            model = instantiate("llama").eval()
        return fd.nn.parallelize(model, fd.Mesh({"tp": 2}))

    lazy = meta()
    with pytest.raises(fd.nn.CheckpointError, match="is truncated"):
        checkpoint.load(bad, lazy)
    assert all(p.is_meta for p in lazy.module.parameters())
    checkpoint.load(tmp_path / "ck", lazy, dtype=torch.float64)
    local = {n: tuple(p.shape) for n, p in pm.module.named_parameters()}
    assert {n: tuple(p.shape) for n, p in lazy.module.named_parameters()} == local
    got = model_state(lazy)
    assert all(torch.equal(want[k], got[k]) for k in want)
    ids = torch.randint(0, 61, (2, 5))
    out, ref = lazy(input_ids=rep(ids, lazy.mesh)), pm(input_ids=rep(ids, pm.mesh))
    assert torch.equal(out.logits, ref.logits)
