"""Review of fastdist.checkpoint as a new user, on simulated ranks: resumes that must equal the
uninterrupted run, or refuse at the first call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastdist as fd
from fastdist import checkpoint
from fastdist.errors import CheckpointError


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
    ).double()


def dp2(model: torch.nn.Module) -> fd.nn.ParallelModel:
    pm = fd.nn.parallelize(model, fd.Mesh({"dp": 2}), {})
    fd.train.DataParallel(pm)
    return pm


def step(pm: fd.nn.ParallelModel, opt: torch.optim.Optimizer, seed: int, skip: bool) -> None:
    """One step on batch ``seed`` (each dp rank its half); ``skip``: layer 0 gets no gradient
    (a plain optimizer then does not step it: its ``step`` count falls behind)."""
    torch.manual_seed(seed)
    pm(torch.randn(2, 5, 3, dtype=torch.float64)).sum().backward()
    if skip:
        for p in pm.module[0].parameters():
            p.grad = None
    opt.step()
    opt.zero_grad()


def test_zero_refuses_plain_state_whose_steps_differ(tmp_path: Path) -> None:
    """Plain AdamW whose layer 0 skipped the first step (step 2, layer 2: step 3), saved, loaded
    into a ZeroOptimizer (one step count per flat group): before, it silently took the first
    parameter's step (2) for every parameter, and the next step's update of layer 2 used the
    wrong bias correction (9.9e-3 off the uninterrupted run at lr 0.1); now it raises naming
    both counts and the fix. A plain AdamW resumes it exactly."""
    pm = dp2(mlp())
    opt = torch.optim.AdamW(pm.parameters(), lr=0.1)
    for s in range(3):
        step(pm, opt, s, skip=s == 0)
    steps = {n: opt.state[p]["step"].item() for n, p in pm.module.named_parameters()}
    assert steps == {"0.weight": 2.0, "0.bias": 2.0, "2.weight": 3.0, "2.bias": 3.0}
    checkpoint.save(tmp_path, pm, opt)
    step(pm, opt, 3, skip=False)
    want = pm.state_dict()

    zpm = dp2(mlp())
    zero = fd.train.ZeroOptimizer(zpm, torch.optim.AdamW, lr=0.1)
    with pytest.raises(CheckpointError, match=r"'step' differs.*: 2\.0.*: 3\.0.*Fix: resume"):
        checkpoint.load(tmp_path, zpm, zero)

    again = dp2(mlp())
    plain = torch.optim.AdamW(again.parameters(), lr=0.1)
    checkpoint.load(tmp_path, again, plain)
    step(again, plain, 3, skip=False)
    got = again.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_zero_resumes_plain_state_whose_steps_agree(tmp_path: Path) -> None:
    """The same check lets an ordinary plain checkpoint through: ZeRO resumes it bitwise."""
    pm = dp2(mlp())
    opt = torch.optim.AdamW(pm.parameters(), lr=0.1)
    for s in range(2):
        step(pm, opt, s, skip=False)
    checkpoint.save(tmp_path, pm, opt)
    step(pm, opt, 2, skip=False)
    want = pm.state_dict()
    zpm = dp2(mlp())
    zero = fd.train.ZeroOptimizer(zpm, torch.optim.AdamW, lr=0.1)
    checkpoint.load(tmp_path, zpm, zero)
    step(zpm, zero, 2, skip=False)
    got = zpm.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-14, atol=1e-14)


def llama_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two tiny float64 Llamas of one config (vocabulary 61: padded over tp 2), other weights."""
    from transformers import LlamaForCausalLM

    from tests.tiny_models import llama_config

    cfg = llama_config(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=1)
    torch.manual_seed(0)
    old = LlamaForCausalLM(cfg).double()
    torch.manual_seed(1)
    return old, LlamaForCausalLM(cfg).double()


def same(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(state[k], v) for k, v in want.items())


def test_safetensors_save_over_a_sharded_save_pretrained(tmp_path: Path) -> None:
    """save_pretrained (sharded: an index and 6 files), then fastdist's safetensors save of other
    weights into the same directory: before, model.safetensors was written beside the old index,
    transformers read the new weights and fastdist.checkpoint.load the OLD ones (it preferred
    the index). Now the stale index and its shards are removed, and a directory holding both
    (written by something else) is read as transformers reads it: the single file."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    old, new = llama_pair()
    before, want = old.state_dict(), {k: v.clone() for k, v in new.state_dict().items()}
    old.save_pretrained(tmp_path / "a", max_shard_size="20KB")
    assert (tmp_path / "a" / "model.safetensors.index.json").is_file()  # the premise
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(new, mesh, fd.nn.plans.plan(new, mesh))
    checkpoint.save(tmp_path / "a", pm, format="safetensors")
    assert sorted(p.name for p in (tmp_path / "a").glob("*.safetensors*")) == ["model.safetensors"]
    _, back = llama_pair()
    torch.manual_seed(2)
    for p in back.parameters():
        torch.nn.init.normal_(p)
    back = fd.nn.parallelize(back, mesh, fd.nn.plans.plan(back, mesh))
    checkpoint.load(tmp_path / "a", back)
    assert same(back.state_dict(), want) and not same(back.state_dict(), before)
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "a", torch_dtype=torch.float64)
    assert same(hf.state_dict(), want)

    old.save_pretrained(tmp_path / "b", max_shard_size="20KB")  # both, by another writer
    save_file(dict(pm.state_dict()), str(tmp_path / "b" / "model.safetensors"))
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "b", torch_dtype=torch.float64)
    checkpoint.load(tmp_path / "b", back)
    assert same(back.state_dict(), want) and same(hf.state_dict(), want)


def test_safetensors_save_of_a_diffusers_model_loads_with_from_pretrained(tmp_path: Path) -> None:
    """A diffusers transformer (SD3, sp 2 x tp 2): fastdist's safetensors save into a directory
    where diffusers' save_pretrained had written shards. Before, it wrote model.safetensors and
    no config: diffusers' from_pretrained read the old shards (it prefers its index; in an empty
    directory it raised for the missing config). Now it writes
    diffusion_pytorch_model.safetensors and config.json, removes the stale shards, and the
    unmodified class loads the parallel model's weights bitwise."""
    from tests.tiny_models import tiny_sd3

    old, new = tiny_sd3(seed=0), tiny_sd3(seed=1)
    old.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "diffusion_pytorch_model.safetensors.index.json").is_file()
    want = {k: v.clone() for k, v in new.state_dict().items()}
    pm = fd.nn.parallelize(new, fd.Mesh({"sp": 2, "tp": 2}))
    checkpoint.save(tmp_path, pm, format="safetensors")
    back = type(old).from_pretrained(tmp_path, torch_dtype=torch.float64)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in want.items())
    again = fd.nn.parallelize(tiny_sd3(seed=2), fd.Mesh({"sp": 2, "tp": 2}))
    checkpoint.load(tmp_path, again)
    got = again.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_safetensors_save_into_a_distributed_checkpoint_directory_refused(tmp_path: Path) -> None:
    """A DCP save, then a safetensors save of other weights into the same directory: before,
    load(path) went on reading the DCP checkpoint (the older weights) without a word; now the
    safetensors save raises before writing."""
    torch.manual_seed(0)
    first = fd.nn.parallelize(torch.nn.Linear(3, 2).double(), fd.Mesh({"dp": 2}), {})
    checkpoint.save(tmp_path, first)
    torch.manual_seed(1)
    second = fd.nn.parallelize(torch.nn.Linear(3, 2).double(), fd.Mesh({"dp": 2}), {})
    with pytest.raises(CheckpointError, match=r"holds a distributed checkpoint.*Fix: write"):
        checkpoint.save(tmp_path, second, format="safetensors")
    assert not list(tmp_path.glob("*.safetensors"))
    checkpoint.save(tmp_path / "w.safetensors", second, format="safetensors")  # a file: fine
    from safetensors.torch import load_file

    written = load_file(tmp_path / "w.safetensors")
    assert torch.equal(written["weight"], second.state_dict()["weight"])


def llama(tied: bool, seed: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    from tests.tiny_models import llama_config

    cfg = llama_config(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=1,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).double()


def tp2(model: torch.nn.Module) -> fd.nn.ParallelModel:
    mesh = fd.Mesh({"tp": 2})
    return fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh))


@pytest.mark.parametrize("fmt", ["dcp", "safetensors", "torch dcp"])
def test_untied_checkpoint_into_a_tied_model_refused(tmp_path: Path, fmt: str) -> None:
    """An untied Llama's checkpoint (lm_head != embed_tokens) loaded into the tied config at
    tp 2: before, lm_head's values were dropped without a word and the model's LM head became
    the embedding (transformers' from_pretrained instead unties them and keeps both); now it
    raises naming both weights and the fix. strict=False loads the embedding's values (the
    documented escape); a checkpoint holding both names with equal values (a tied model's, as
    torch's get_state_dict or a full state dict writes it) loads as before."""
    untied = llama(False, 0)
    want = {k: v.clone() for k, v in untied.state_dict().items()}
    if fmt == "dcp":
        checkpoint.save(tmp_path, untied)
    elif fmt == "safetensors":
        untied.save_pretrained(tmp_path)
    else:
        import torch.distributed.checkpoint as tdcp

        tdcp.save({"model": untied.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    pm = tp2(llama(True, 1))
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' is tied to.*Fix: build"):
        checkpoint.load(tmp_path, pm)
    checkpoint.load(tmp_path, pm, strict=False)
    got = pm.state_dict()
    assert torch.equal(got["lm_head.weight"], want["model.embed_tokens.weight"])

    tied = llama(True, 2)  # both names, one value: loads
    both = {k: v.clone() for k, v in tied.state_dict().items()}
    assert "lm_head.weight" in both
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(both, str(tmp_path / "model.safetensors"))
    else:
        import shutil

        import torch.distributed.checkpoint as tdcp

        shutil.rmtree(tmp_path)
        tdcp.save({"model": both}, checkpoint_id=str(tmp_path), no_dist=True)
    pm = tp2(llama(True, 3))
    checkpoint.load(tmp_path, pm)
    got = pm.state_dict()
    assert all(torch.equal(got[k], v) for k, v in both.items())
