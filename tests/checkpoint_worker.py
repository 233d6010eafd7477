"""Rank functions for tests/test_checkpoint.py's real-process runs (importable by
fastdist.testing.run_on_gloo), and the helpers both sides use."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import fastdist as fd
from fastdist.train import checkpoint


def make(family: str, mesh: fd.Mesh | None, *, sp: bool = False, seed: int = 0, kv: int = 2) -> Any:
    """A tiny float64 HF model (tests/test_hf_models.build), parallel over ``mesh`` (None: the
    plain model)."""
    from tests.test_hf_models import build

    model = build(family, kv=kv, seed=seed)
    if mesh is None:
        return model
    return fd.nn.parallelize(model, mesh, fd.nn.plans.plan_for(model, mesh, sequence_parallel=sp))


def train(
    pm: Any, opt: torch.optim.Optimizer, steps: int, first: int = 20, sched: Any = None
) -> None:
    """``steps`` AdamW steps on batches ``first, first + 1, ...`` (every rank the same batch)."""
    from tests.test_hf_models import batch, rep

    for step in range(first, first + steps):
        ids, labels = batch(step)
        if isinstance(pm, fd.nn.ParallelModel) and pm.simulated:
            pm(input_ids=rep(ids, pm.mesh), labels=rep(labels, pm.mesh)).loss.sum().backward()
        else:
            pm(input_ids=ids, labels=labels).loss.backward()
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

    dm = mesh.to_device_mesh("cpu")
    for layer in pm.module.transformer.h:
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
    """4 gloo ranks: load the simulated tp=2 checkpoint ``src`` at tp=4, dp=2 x tp=2 and FSDP2
    dp=2 x tp=2; save each (tp=4 after one more step); an optimizer of another kind raises."""
    res: dict[str, Any] = {}
    tp4 = fd.Mesh.from_torch(tp=4, timeout=60)
    pm = make("gpt2", tp4, sp=True, seed=7)
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

    mesh = fd.Mesh.from_torch(tp=2, timeout=60)
    pm = make("gpt2", mesh, seed=8)
    opt = torch.optim.AdamW(pm.parameters())
    checkpoint.load(src, pm, opt)
    res["dp2tp2"] = (model_state(pm), optim_state(pm, opt))  # replicas checked to agree
    checkpoint.save(f"{out}/dp2tp2", pm, opt)

    pm = make("gpt2", mesh, sp=True, seed=9)
    fsdp(pm, mesh)
    opt = torch.optim.AdamW(pm.parameters())
    checkpoint.load(src, pm, opt)
    res["fsdp"] = fsdp_mismatches(pm, opt, want, want_opt)
    checkpoint.save(f"{out}/fsdp", pm, opt)
    return res


def two_ranks(out: str) -> Any:
    """2 gloo ranks, tp=2: load what four_ranks saved (tp=4, dp=2 x tp=2, FSDP2); save tp=2."""
    res: dict[str, Any] = {}
    mesh = fd.Mesh.from_torch(tp=2, timeout=60)
    for name in ("tp4", "dp2tp2", "fsdp"):
        pm = make("gpt2", mesh, seed=11)
        opt = torch.optim.AdamW(pm.parameters())
        res[f"{name} extra"] = checkpoint.load(f"{out}/{name}", pm, opt)
        res[name] = (model_state(pm), optim_state(pm, opt))
    checkpoint.save(f"{out}/tp2", pm, opt, extra={"from": "gloo"})
    try:
        checkpoint.load(f"{out}/tp2", make("llama", mesh))
    except fd.nn.CheckpointError as e:
        res["other model"] = str(e)
    return res

