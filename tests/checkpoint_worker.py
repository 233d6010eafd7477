"""Rank functions for tests/test_checkpoint.py's real-process runs (importable by
fastdist.testing.run_on_gloo), and the helpers both sides use."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import fastdist as fd
from fastdist import checkpoint

VOCAB = 61  # prime: padded over every tp > 1


class Tiny(torch.nn.Module):
    """What makes GPT-2's checkpoints hard, without transformers (cheap to import in 4 processes):
    a vocabulary of 61 (padded over tp), an LM head tied to the embedding, a fused q|k|v
    projection (three parts per rank), a replicated norm; float64. ``forward`` returns the loss,
    the vocabulary-parallel one when ``mesh`` is given."""

    def __init__(self, mesh: fd.Mesh | None = None, d: int = 16) -> None:
        super().__init__()
        self.mesh = mesh
        self.wte = torch.nn.Embedding(VOCAB, d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.o = torch.nn.Linear(d, d)
        self.norm = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        h = self.wte(input_ids)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        logits = self.lm_head(self.norm(h + self.o(q * torch.tanh(k) + v)))
        if self.mesh is None:
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return fd.nn.cross_entropy(logits, labels, self.mesh, "tp", vocab_size=VOCAB)


def make(family: str, mesh: fd.Mesh | None, *, sp: bool = False, seed: int = 0, kv: int = 2) -> Any:
    """A tiny float64 model: ``"tiny"`` (`Tiny`) or an HF family (tests/test_hf_models.build),
    parallel over ``mesh`` (None: the plain model)."""
    if family == "tiny":
        torch.manual_seed(seed)
        model = Tiny(mesh).double()
        plan = {
            "wte": fd.nn.VocabParallel(),
            "qkv": fd.nn.ColwiseParallel(input="replicated", parts=(16, 16, 16)),
            "o": fd.nn.RowwiseParallel(),
            "lm_head": fd.nn.VocabParallel(),
        }
        return model if mesh is None else fd.nn.parallelize(model, mesh, plan)
    from tests.test_hf_models import build

    model = build(family, kv=kv, seed=seed)
    if mesh is None:
        return model
    return fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, sequence_parallel=sp))


def train(
    pm: Any, opt: torch.optim.Optimizer, steps: int, first: int = 20, sched: Any = None
) -> None:
    """``steps`` AdamW steps on batches ``first, first + 1, ...`` (every rank the same batch)."""
    from tests.test_hf_models import batch, rep

    for step in range(first, first + steps):
        ids, labels = batch(step)
        module = pm.module if isinstance(pm, fd.nn.ParallelModel) else pm
        if isinstance(pm, fd.nn.ParallelModel) and pm.simulated:
            ids, labels = rep(ids, pm.mesh), rep(labels, pm.mesh)
        out = pm(input_ids=ids, labels=labels)
        (out if isinstance(module, Tiny) else out.loss).sum().backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def model_state(pm: Any) -> dict[str, Tensor]:
    """The single-device parameters (a collective on real ranks)."""
    if isinstance(pm, fd.nn.ParallelModel):
        return pm.state_dict()
    return {k: v.detach().clone() for k, v in pm.state_dict().items()}


def optim_state(pm: Any, opt: torch.optim.Optimizer) -> dict[str, dict[str, Tensor]]:
    """The optimizer's state in the single-device view, by parameter name (a collective on real
    ranks)."""
    module = pm.module if isinstance(pm, fd.nn.ParallelModel) else pm
    out: dict[str, dict[str, Tensor]] = {}
    for name, p in module.named_parameters():
        out[name] = {}
        for k, v in sorted(opt.state.get(p, {}).items()):
            if isinstance(pm, fd.nn.ParallelModel) and v.dim():
                v = fd.nn.state.gather_full(v, pm.layouts[name], pm.mesh, name=name)
            out[name][k] = v.detach().clone()
    return out


def fsdp(pm: Any, mesh: fd.Mesh) -> None:
    """FSDP2 over the mesh's 'dp' axis: each decoder layer, then the whole model."""
    from torch.distributed.fsdp import fully_shard

    dm = fd.comm.to_device_mesh(mesh, "cpu")
    for layer in getattr(getattr(pm.module, "transformer", None), "h", []):
        fully_shard(layer, mesh=dm["dp"])
    fully_shard(pm.module, mesh=dm["dp"])


def fsdp_mismatches(
    pm: Any, opt: torch.optim.Optimizer, want: dict[str, Tensor], want_opt: dict[str, Any]
) -> list[str]:
    """Names whose FSDP2 local shard (of this rank's tp block) differs from the single-device
    ``want``."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    bad = []
    for name, p in pm.module.named_parameters():
        assert isinstance(p, DTensor), name
        layout = pm.layouts[name]
        _, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        local = p.to_local()
        rows = tuple(slice(o, o + n) for o, n in zip(off, local.shape))
        if not torch.equal(local, layout.shard(want[name], pm.mesh, pm.mesh.rank)[rows]):
            bad.append(name)
        for k, v in opt.state[p].items():
            full = want_opt[name][k]
            if isinstance(v, DTensor):
                v, full = v.to_local(), layout.shard(full, pm.mesh, pm.mesh.rank)[rows]
            if not torch.equal(v, full):
                bad.append(f"{name}.{k}")
    return bad


def four_ranks(src: str, out: str, want: dict[str, Tensor], want_opt: dict[str, Any]) -> Any:
    """4 gloo ranks: load the simulated tp=2 checkpoint ``src`` of `Tiny` at tp=4, dp=2 x tp=2
    (AdamW, ZeRO-1 over dp) and FSDP2 dp=2 x tp=2; save each (tp=4 after one more step); an
    optimizer of another kind raises."""
    res: dict[str, Any] = {}
    tp4 = fd.connect(tp=4, timeout=60)
    pm = make("tiny", tp4, seed=7)
    opt = torch.optim.AdamW(pm.parameters(), lr=0.5)
    res["extra"] = checkpoint.load(src, pm, opt)
    res["tp4"] = (model_state(pm), optim_state(pm, opt))
    try:
        checkpoint.load(src, pm, torch.optim.SGD(pm.parameters(), lr=0.1))
    except fd.nn.CheckpointError as e:
        res["wrong optimizer"] = str(e)
    train(pm, opt, 1, first=30)
    checkpoint.save(f"{out}/tp4", pm, opt, extra={"step": 3})
    res["tp4 step"] = (model_state(pm), optim_state(pm, opt))

    mesh = fd.connect(tp=2, timeout=60)
    pm = make("tiny", mesh, seed=8)
    opt = torch.optim.AdamW(pm.parameters())
    checkpoint.load(src, pm, opt)
    res["dp2tp2"] = (model_state(pm), optim_state(pm, opt))  # replicas checked to agree
    checkpoint.save(f"{out}/dp2tp2", pm, opt)

    pm = make("tiny", mesh, seed=10)
    fd.train.DataParallel(pm, "dp")
    zero = fd.train.ZeroOptimizer(pm, torch.optim.AdamW)  # AdamW's state sharded over dp
    checkpoint.load(src, pm, zero)
    checkpoint.save(f"{out}/zero", pm, zero)

    pm = make("tiny", mesh, seed=9)
    fsdp(pm, mesh)
    opt = torch.optim.AdamW(pm.parameters())
    checkpoint.load(src, pm, opt)
    res["fsdp"] = fsdp_mismatches(pm, opt, want, want_opt)
    checkpoint.save(f"{out}/fsdp", pm, opt)
    return res


def two_ranks(out: str) -> Any:
    """2 gloo ranks, tp=2: load what four_ranks saved (tp=4, dp=2 x tp=2, ZeRO-1, FSDP2); save
    tp=2 in place of the FSDP2 checkpoint."""
    res: dict[str, Any] = {}
    mesh = fd.connect(tp=2, timeout=60)
    for name in ("tp4", "dp2tp2", "zero", "fsdp"):
        pm = make("tiny", mesh, seed=11)
        opt = torch.optim.AdamW(pm.parameters())
        res[f"{name} extra"] = checkpoint.load(f"{out}/{name}", pm, opt)
        res[name] = (model_state(pm), optim_state(pm, opt))
    checkpoint.save(f"{out}/fsdp", pm, opt, extra={"from": "gloo"})  # over the 4-rank one
    try:
        checkpoint.load(f"{out}/fsdp", fd.nn.parallelize(torch.nn.Linear(4, 4), mesh, {}))
    except fd.nn.CheckpointError as e:
        res["other model"] = str(e)
    return res


def cut(path: str, fraction: float) -> None:
    """Truncate ``path`` to ``fraction`` of its bytes."""
    import os

    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * fraction))


def fail_whole(out: str) -> Any:
    """2 gloo ranks, tp=2 Llama: save (2 files); rank 0 truncates rank 1's file to 10 %; a fresh
    model and optimizer load it; returns (error type, message, model unchanged, optimizer
    state empty) on each rank. Then ``model.save_pretrained(out/hf)`` on every rank (rank 0
    writes the gathered model) and the model's state."""
    import glob

    from fastdist.comm import barrier

    mesh = fd.connect(tp=2, timeout=60)
    pm = make("llama", mesh)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    train(pm, opt, 1)
    checkpoint.save(f"{out}/ck", pm, opt)
    if mesh.rank == 0:
        (second,) = glob.glob(f"{out}/ck/__1_*.distcp")
        cut(second, 0.1)
    barrier(mesh)
    fresh = make("llama", mesh, seed=4)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    before = model_state(fresh)
    res: dict[str, Any] = {}
    try:
        checkpoint.load(f"{out}/ck", fresh, fresh_opt)
    except Exception as e:  # what a training loop's fallback catches
        res["error"] = (type(e).__name__, str(e))
    after = model_state(fresh)
    res["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    res["optimizer empty"] = len(fresh_opt.state) == 0
    pm.module.save_pretrained(f"{out}/hf")
    res["state"] = model_state(pm)
    return res
