"""Rank functions for tests/test_train_dp.py's gloo runs (importable by
fastdist.testing.run_on_gloo)."""

from __future__ import annotations

import copy

import torch

import fastdist as fd


def engines_on_gloo(engines: list[str], tp: int, sp: bool, steps: int = 2) -> str:
    """For each engine: a Llama over dp x tp (dp = world / tp), each dp rank its own batch;
    ``steps`` steps of backward, clip, AdamW; gradients (step 0), norms and final weights equal
    one device's, which runs every batch with the mean loss."""
    from tests.test_hf_models import batch, build, reference_loss

    world = torch.distributed.get_world_size()
    mesh = fd.Mesh.from_torch(tp=tp, timeout=120)  # dp = world // tp
    dp = mesh.axis_size("dp")
    me = mesh.coords(mesh.rank)["dp"]
    for engine in engines:
        ref = build("llama")
        pm = fd.nn.parallelize(
            copy.deepcopy(ref), mesh, fd.nn.plans.llama(ref, sequence_parallel=sp)
        )
        wrapped = pm.data_parallel("dp", engine="fastdist" if engine == "zero" else engine)
        if engine == "fsdp":  # 2-D: each parameter a DTensor over dp of this rank's tp block
            w = pm.module.model.layers[0].mlp.gate_proj.weight
            assert type(w).__name__ == "DTensor" and w.to_local().shape[0] == 48 // tp // dp
        elif engine == "ddp":
            assert type(wrapped).__name__ == "DistributedDataParallel"
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = (
            fd.train.ZeroOptimizer(pm, torch.optim.AdamW, lr=1e-2)
            if engine == "zero"
            else torch.optim.AdamW(pm.parameters(), lr=1e-2)
        )
        for step in range(steps):
            batches = [batch(100 * step + i) for i in range(dp)]
            ids, labels = batches[me]
            pm(input_ids=ids, labels=labels).loss.backward()
            losses = [reference_loss(ref, i, lab)[1] for i, lab in batches]
            (sum(losses) / dp).backward()
            if step == 0:
                grads = pm.grads()
                for name, p in ref.named_parameters():
                    torch.testing.assert_close(
                        grads[name],
                        p.grad,
                        rtol=1e-10,
                        atol=1e-12,
                        msg=lambda m, n=name, e=engine: f"{e} {n}: {m}",
                    )
            # garbage in the vocabulary's padding row (61 rows over tp: the last tp rank's last
            # row; under FSDP2 the last dp rank's shard of it) must not count
            g = pm.module.model.embed_tokens.weight.grad
            local = g.to_local() if engine == "fsdp" else g  # zero: fastdist's reducer
            if mesh.coords(mesh.rank)["tp"] == tp - 1 and (engine != "fsdp" or me == dp - 1):
                local[-1] = 1e3
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            got = pm.clip_grad_norm_(0.5)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=0, msg=engine)
            opt_ref.step()
            opt.step()
            opt_ref.zero_grad()
            opt.zero_grad()
        state = pm.state_dict()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(
                state[name],
                p.detach(),
                rtol=1e-10,
                atol=1e-12,
                msg=f"{engine} {name} (world {world})",
            )
    return "ok"


def peer_skips_backward() -> str:
    """dp=2: rank 1 never runs backward; rank 0's bucket all-reduce must fail with a fastdist
    error naming DataParallel, the axis and the gradient all-reduce, within the mesh's timeout."""
    import time

    mesh = fd.Mesh.from_torch(tp=1, timeout=5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    pm = fd.nn.parallelize(model, mesh, {})
    pm.data_parallel("dp")
    mesh.create_groups("dp")  # both ranks: the groups exist, so the all-reduce itself waits
    if mesh.rank == 1:
        time.sleep(8)  # alive, never reaching the all-reduce
        return "skipped"
    start = time.monotonic()
    try:
        pm(torch.randn(3, 4)).sum().backward()
    except fd.FastdistError as e:
        took = time.monotonic() - start
        return f"{type(e).__name__} after {took:.0f}s: {e}"
    return "no error"
