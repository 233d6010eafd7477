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
    mesh = fd.connect(tp=tp, timeout=120)  # dp = world // tp
    dp = mesh.axis_size("dp")
    me = mesh.coords(mesh.rank)["dp"]
    for engine in engines:
        ref = build("llama")
        pm = fd.nn.parallelize(
            copy.deepcopy(ref), mesh, fd.nn.plans.plan(ref, family="llama", sequence_parallel=sp)
        )
        wrapped = fd.train.DataParallel(pm, "dp", engine="fastdist" if engine == "zero" else engine)
        if engine == "fsdp":  # 2-D: each parameter a DTensor over dp of this rank's tp block
            w = pm.module.model.layers[0].mlp.gate_proj.weight
            assert type(w).__name__ == "DTensor" and w.to_local().shape[0] == 48 // tp // dp
            try:  # FSDP2 already shards the optimizer state: ZeRO on top is refused
                fd.train.ZeroOptimizer(pm, torch.optim.AdamW)
                raise AssertionError("ZeroOptimizer accepted FSDP2's DTensors")
            except fd.MeshError as e:
                assert "are DTensors" in str(e), e
        elif engine == "ddp":
            assert type(wrapped.wrapped).__name__ == "DistributedDataParallel"
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
            got = fd.nn.clip_grad_norm_(pm, 0.5)
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

    mesh = fd.connect(tp=1, timeout=5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    pm = fd.nn.parallelize(model, mesh, {})
    fd.train.DataParallel(pm, "dp")
    # both ranks: the groups exist, so the all-reduce itself waits
    fd.comm.create_groups(mesh, "dp")
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


def reducer_review_cases() -> str:
    """4 ranks, dp=2 x ep=2, both data axes; ``w`` split over ep (one block per ep index),
    ``a`` replicated; one bucket per parameter. Checked against the rule computed on the stacked
    gradients of every rank:

    * ``a`` used only inside no_sync is reduced by the next synced backward (which uses only w);
    * a second backward without zero_grad adds only the new reduced parts (w too);
    * a backward that raises after ``a``'s bucket went out does not break the next step;
    * clipping with ``w.grad`` None on the ep=0 ranks runs the same collectives everywhere."""
    from tests.test_train_dp import Boom, _mean_over

    mesh = fd.connect(ep=2, timeout=60)
    sim = fd.Mesh(dict(mesh.shape))  # the same layout, for the expected values
    r = mesh.rank
    gen = torch.Generator().manual_seed(0)
    g = [torch.randn(mesh.size, 3, dtype=torch.float64, generator=gen) for _ in range(6)]

    class Local(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
            self.a = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))  # bucket 0

        def param_layouts(self) -> dict[str, fd.nn.Layout]:
            return {"a": fd.nn.Layout(), "w": fd.nn.Layout(fd.P("ep"))}

        def forward(self, k_a: int | None, k_w: int | None, boom: bool = False) -> torch.Tensor:
            loss = torch.zeros((), dtype=torch.float64)
            if k_w is not None:
                w = Boom.apply(self.w) if boom else self.w
                loss = loss + (w * g[k_w][r]).sum()
            if k_a is not None:  # created last: accumulates (and launches) first
                loss = loss + (self.a * g[k_a][r]).sum()
            return loss

    def a_rule(t: torch.Tensor) -> torch.Tensor:
        return _mean_over(t, sim, ("dp", "ep"), 4)[r]

    def w_rule(t: torch.Tensor) -> torch.Tensor:
        return _mean_over(t, sim, ("dp",), 4)[r]

    m = Local()
    dp = fd.train.DataParallel(m, ("dp", "ep"), mesh=mesh, bucket_mb=1e-6)
    assert len(dp._buckets) == 2
    with dp.no_sync():
        m(0, None).backward()
    m(None, 1).backward()
    torch.testing.assert_close(m.a.grad, a_rule(g[0]))
    torch.testing.assert_close(m.w.grad, w_rule(g[1]))
    m(2, 3).backward()
    torch.testing.assert_close(m.a.grad, a_rule(g[0] + g[2]))
    torch.testing.assert_close(m.w.grad, w_rule(g[1] + g[3]))
    m.zero_grad()
    try:
        m(4, 5, boom=True).backward()
        return "no raise"
    except RuntimeError as e:
        assert "boom" in str(e), e
    assert m.a.grad is not None and dp._buckets[0].work is not None  # a's bucket in flight
    m.zero_grad()
    m(4, 5).backward()
    torch.testing.assert_close(m.a.grad, a_rule(g[4]))
    torch.testing.assert_close(m.w.grad, w_rule(g[5]))

    # clipping: w has no gradient on the ep=0 ranks
    dp.remove()
    a, w = g[0][0], g[1][mesh.coords(r)["ep"]]  # a replicated; w one block per ep index
    m.a.grad = a.clone()
    m.w.grad = w.clone() if mesh.coords(r)["ep"] == 1 else None
    want = (a.square().sum() + g[1][1].square().sum()).sqrt()
    got = fd.nn.clip_grad_norm_(m, 1e9, mesh=mesh)
    torch.testing.assert_close(got, want)
    return "ok"
