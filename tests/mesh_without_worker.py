"""Gloo workers for tests/test_mesh_without.py: ``Mesh.without`` on real ranks (run through
``fastdist.testing.run_on_gloo``).

Each rank contributes its global rank, so a sum or a gather that strays outside this process's
slice shows in the values; the two pipeline slices hold models of different shapes, so a
collective that spanned both would hang (then time out) or fail.
"""

from __future__ import annotations

import copy
import datetime
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d

import fastdist as fd

F64 = torch.float64


def _setup() -> int:
    torch.set_num_threads(1)
    return dist.get_rank()


def slices_pp_tp() -> dict[str, Any]:
    """pp=2 x tp=2 (x dp=1) on 4 ranks: the slice's rank, collectives over "tp" and over all its
    axes, the object helpers, equality and caching."""
    g = _setup()
    mesh = fd.connect(pp=2, tp=2, timeout=30)
    m = mesh.without("pp")
    x = torch.tensor([float(g)], dtype=F64)
    out = _extras(g, mesh, m)
    return {
        **out,
        "rank": m.rank,
        "shape": dict(m.shape),
        "same": m == mesh.without("pp"),
        "plain_differs": m != fd.Mesh({"dp": 1, "tp": 2}) and m != mesh.submesh(("dp", "tp")),
        "timeout": m._comm.timeout.total_seconds(),
        "psum_tp": fd.psum(x, m, "tp").item(),
        "psum_all": fd.psum(x, m, m.axis_names).item(),
        "gather_tp": fd.all_gather(x, m, "tp").tolist(),
        "index": int(fd.axis_index(m, "tp")),
        "objects": fd.comm.all_gather_object(g, m),
        "whole": fd.psum(x, mesh, mesh.axis_names).item(),  # the parent still spans the job
    }


def _extras(g: int, mesh: fd.Mesh, m: fd.Mesh) -> dict[str, Any]:
    """The slice's group names, with_timeout (still the slice), check mode (inherited, naming global
    ranks) and the mesh of no axes."""
    out: dict[str, Any] = {}
    x = torch.tensor([float(g)])
    w = fd.comm.with_timeout(m, 7)
    out["with_timeout"] = (
        w.rank,
        w == m,
        w._comm.timeout.total_seconds(),
        fd.psum(x, w, "tp").item(),
    )
    tp = m._comm.axis(m.axis_indices("tp"))
    out["group_name"] = str(m._comm.group(tp, "gloo", "test").group_name)
    empty = mesh.without(mesh.axis_names)
    out["empty"] = (empty.rank, empty.size, empty.axis_names)
    try:
        fd.psum(x, empty, ())
    except fd.MeshError as e:
        out["empty_error"] = str(e)
    checked = fd.connect(pp=2, tp=2, timeout=30, check=True).without("pp")
    out["check"] = checked._comm.check
    if g >= 2:  # slice pp=1 disagrees: rank 2 passes 1 element, rank 3 two
        try:
            fd.psum(torch.ones(g - 1), checked, "tp")
        except fd.ConsistencyError as e:
            out["consistency"] = str(e)
    return out


def _mlp(d: int, h: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, d)).to(F64)


def stages_hold_different_models() -> dict[str, Any]:
    """Each pp slice parallelizes its own MLP (stage 0: 4 -> 8 -> 4, stage 1: 6 -> 10 -> 6) over
    tp; its gradients and state dict gather inside the slice and equal one device's."""
    _setup()
    mesh = fd.connect(pp=2, tp=2, timeout=30)
    stage = mesh.coords(mesh.rank)["pp"]
    m = mesh.without("pp")
    d, h = (4, 8) if stage == 0 else (6, 10)
    ref = _mlp(d, h, seed=stage)
    plan = {"0": fd.nn.ColwiseParallel(), "2": fd.nn.RowwiseParallel()}
    pm = fd.nn.parallelize(copy.deepcopy(ref), m, plan)
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(10 + stage), dtype=F64)
    local_w = tuple(pm.module[0].weight.shape)
    pm(x).square().sum().backward()
    ref(x).square().sum().backward()
    grads, state = pm.grads(), pm.state_dict()
    err = 0.0
    for name, p in ref.named_parameters():
        assert grads[name].shape == p.shape and state[name].shape == p.shape, name
        err = max(
            err,
            (grads[name] - p.grad).abs().max().item(),
            (state[name] - p.detach()).abs().max().item(),
        )
    return {"stage": stage, "local_w": local_w, "err": err, "names": sorted(grads)}


def one_slice_fails() -> dict[str, Any]:
    """Slice pp=1: rank 3 skips a psum over "tp"; rank 2 raises CollectiveTimeout within the mesh's
    timeout (3 s, set with ``with_timeout`` after a first call) naming the slice's global ranks;
    both reset (slice 0 never does) and redo it. Slice pp=0 runs its psums meanwhile,
    unaffected."""
    g = _setup()
    store = c10d._get_default_store()
    # The ranks reach their first call as far apart as process start-up leaves them (seconds on
    # a loaded machine), and creating a group waits for its peer under the mesh's timeout: the
    # first call runs under a long one, then the slice's 3 s groups are made while both members
    # are in step (right after that call), before the call one of them skips.
    patient = fd.connect(pp=2, tp=2, timeout=60).without("pp")
    x = torch.tensor([float(g)])
    first = fd.psum(x, patient, "tp").item()
    m = fd.comm.with_timeout(patient, 3)
    fd.comm.create_groups(m, "tp")  # the groups exist on both members
    out: dict[str, Any] = {"first": first}
    if g == 3:  # alive, skipping the call, until its peer reported
        store.wait(["mesh_without/reported"], datetime.timedelta(seconds=60))
    elif g == 2:
        t0 = time.monotonic()
        try:
            fd.psum(x, m, "tp")
            out["error"] = None
        except fd.CommError as e:
            out["error"], out["message"] = type(e).__name__, str(e)
            out["ranks"], out["err_rank"] = list(e.ranks), e.rank
        out["seconds"] = time.monotonic() - t0
        store.set("mesh_without/reported", "1")
    else:
        out["second"] = [fd.psum(x, m, "tp").item() for _ in range(3)]
    if g >= 2:
        fd.comm.reset(m, timeout=30)
        out["after_reset"] = fd.psum(x, m, "tp").item()
    if g == 2:  # a call over all of the slice's axes that its peer skips
        try:
            fd.psum(x, m, m.axis_names)
        except fd.CollectiveTimeout as e:
            out["all_axes_error"] = str(e)
        store.set("mesh_without/created", "1")
    elif g == 3:
        store.wait(["mesh_without/created"], datetime.timedelta(seconds=60))
    return out


def slices_pp_dp_tp() -> dict[str, Any]:
    """pp=2 x dp=2 x tp=2 on 8 ranks: sums over the slice's axes, a nested slice, and a slice
    without two axes."""
    g = _setup()
    mesh = fd.connect(pp=2, dp=2, tp=2, timeout=60)
    m = mesh.without("pp")
    x = torch.tensor([float(g)], dtype=F64)
    return {
        "rank": m.rank,
        "all": fd.psum(x, m, m.axis_names).item(),
        "dp": fd.psum(x, m, "dp").item(),
        "tp_nested": fd.psum(x, m.without("dp"), "tp").item(),
        "tp_two": fd.psum(x, mesh.without(("pp", "dp")), "tp").item(),
    }


def slice_on_fake_nccl(lib: str) -> dict[str, Any]:
    """A slice of a ctypes-backend mesh (host-memory fake NCCL): it keeps the backend, and its psum
    goes through the library, inside the slice."""
    from fastdist.comm.native import fake

    g = _setup()
    mesh = fd.connect(pp=2, tp=2, backend="nccl-ctypes", library=lib, timeout=30)
    m = mesh.without("pp")
    fake.clear_log(lib)
    y = fd.psum(torch.tensor([1.0, 2.0]) * (g + 1), m, "tp")
    calls = [line.split()[0] for line in fake.call_log(lib)]
    fd.comm.close(m)
    fd.comm.close(mesh)
    return {"backend": m.backend, "psum": y.tolist(), "calls": calls}


def pp_tp_checks() -> dict[str, Any]:
    """:func:`slices_pp_tp` and :func:`stages_hold_different_models` in one launch (process start-up
    is most of their time)."""
    return {"slices": slices_pp_tp(), "model": stages_hold_different_models()}
