"""Data parallelism (fastdist.train.DataParallel) against one device, in float64.

Every data rank runs its own batch; the one-device model runs every batch and backpropagates
the mean of the losses. Gradients, clipping and AdamW steps must match on every rank.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import fastdist as fd
from tests.test_hf_models import batch, build, reference_loss

TOL = {"rtol": 1e-10, "atol": 1e-12}


def per_rank(mesh: fd.Mesh, data_axes: tuple[str, ...], seed: int) -> tuple[Any, Any, list[Any]]:
    """(ids, labels) stacked [world, B, S]: one batch per data index, replicated over the
    rest; and the list of distinct batches in data-index order."""
    n = 1
    for a in data_axes:
        n *= mesh.axis_size(a)
    batches = [batch(seed + i) for i in range(n)]

    def data_index(r: int) -> int:
        i = 0
        for a in data_axes:
            i = i * mesh.axis_size(a) + mesh.coords(r)[a]
        return i

    ids = torch.stack([batches[data_index(r)][0] for r in range(mesh.size)])
    labels = torch.stack([batches[data_index(r)][1] for r in range(mesh.size)])
    return ids, labels, batches


def compare(pm: Any, ref: Any, **tol: float) -> None:
    grads = pm.grads()
    assert grads.keys() == {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("axes, sp", [({"dp": 2, "tp": 2}, True), ({"dp": 4, "tp": 1}, False)])
def test_gradients_clipping_and_adamw_equal_one_device(axes: dict[str, int], sp: bool) -> None:
    ref = build("llama")
    mesh = fd.Mesh(axes)
    pm = fd.nn.parallelize(
        copy.deepcopy(ref), mesh, fd.nn.plans.plan(ref, family="llama", sequence_parallel=sp)
    )
    dp = fd.train.DataParallel(pm, "dp")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for step in range(3):
        ids, labels, batches = per_rank(mesh, ("dp",), 10 * step)
        out = pm(input_ids=ids, labels=labels)
        out.loss.sum().backward()
        losses = [reference_loss(ref, i, lab)[1] for i, lab in batches]
        (sum(losses) / len(losses)).backward()
        if step == 0:
            compare(pm, ref, **TOL)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch.testing.assert_close(fd.nn.clip_grad_norm_(pm, 0.5), want.expand(mesh.size), **TOL)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    state = pm.state_dict()  # replicas over dp and tp checked equal
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), **TOL)
    assert "simulated" in repr(dp)


def test_no_sync_accumulates_then_reduces_the_sum() -> None:
    ref = build("llama")
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    pm = fd.nn.parallelize(copy.deepcopy(ref), mesh, fd.nn.plans.plan(ref, family="llama"))
    dp = fd.train.DataParallel(pm)
    micro = [per_rank(mesh, ("dp",), s) for s in (1, 5)]
    with dp.no_sync():
        out = pm(input_ids=micro[0][0], labels=micro[0][1])
        (out.loss.sum() / 2).backward()
    with pytest.raises(fd.nn.ReplicaMismatchError):  # not reduced yet
        pm.grads()
    out = pm(input_ids=micro[1][0], labels=micro[1][1])
    (out.loss.sum() / 2).backward()
    losses = [reference_loss(ref, i, lab)[1] for m in micro for i, lab in m[2]]
    (sum(losses) / len(losses)).backward()
    compare(pm, ref, **TOL)


def test_moe_experts_split_over_ep_reduce_over_dp_only() -> None:
    """Mixtral on dp x ep: experts are split over ep, the tokens over dp. Every gradient (experts'
    and the replicated ones') equals one device's for the mean of the dp losses."""
    from tests.test_moe import build_mixtral, reference

    ref = build_mixtral()
    mesh = fd.Mesh({"dp": 2, "ep": 2})
    pm = fd.nn.parallelize(copy.deepcopy(ref), mesh)  # the family plan: experts over ep
    dp = fd.train.DataParallel(pm, "dp")
    layouts = pm.layouts
    expert = next(n for n in layouts if "experts" in n)
    assert fd.train.reduce_axes(layouts[expert], dp.axes) == ("dp",)
    ids, labels, batches = per_rank(mesh, ("dp",), 3)
    pm(input_ids=ids, labels=labels).loss.sum().backward()
    coef = ref.config.router_aux_loss_coef
    total = 0
    for i, lab in batches:
        _, ce, aux = reference(ref, i, lab)
        total = total + ce + coef * aux
    (total / len(batches)).backward()
    compare(pm, ref, **TOL)


def test_ep_as_a_data_axis_divides_expert_sums_by_every_data_rank() -> None:
    """The rule for a parameter split over a data axis, on a functional MoE layer whose tokens
    differ across ep: experts are summed over dp only, divided by dp x ep."""
    mesh = fd.Mesh({"dp": 2, "ep": 2})

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(mesh.size, 2, 3, dtype=torch.float64))
            self.shared = torch.nn.Parameter(torch.randn(mesh.size, 3, dtype=torch.float64))

        def param_layouts(self) -> dict[str, fd.nn.Layout]:
            return {"w": fd.nn.Layout(fd.P("ep")), "shared": fd.nn.Layout()}

    m = Experts()
    with torch.no_grad():  # replicas equal: experts per ep index, shared everywhere
        m.w.copy_(m.w[[0, 1, 0, 1]])
        m.shared.copy_(m.shared[[0, 0, 0, 0]])
    dp = fd.train.DataParallel(m, ("dp", "ep"), mesh=mesh)
    assert dp.size == 4
    w_grad = torch.randn(mesh.size, 2, 3, dtype=torch.float64)
    s_grad = torch.randn(mesh.size, 3, dtype=torch.float64)
    (m.w * w_grad).sum().backward(retain_graph=True)
    (m.shared * s_grad).sum().backward()
    # experts: sum over dp (ranks r and r+2 share an ep index), / 4
    for r in range(4):
        torch.testing.assert_close(m.w.grad[r], (w_grad[r % 2] + w_grad[r % 2 + 2]) / 4)
        torch.testing.assert_close(m.shared.grad[r], s_grad.sum(0) / 4)


def test_bad_arguments_raise() -> None:
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    model = build("llama")
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, family="llama"))
    with pytest.raises(fd.MeshError, match="'data'"):
        fd.train.DataParallel(pm, "data")
    with pytest.raises(fd.MeshError, match="bucket_mb"):
        fd.train.DataParallel(pm, bucket_mb=0)
    with pytest.raises(fd.MeshError, match="ParallelModel"):
        fd.train.DataParallel(torch.nn.Linear(2, 2))
    dp = fd.train.DataParallel(pm)
    with pytest.raises(fd.MeshError, match="reduce its gradients twice"):
        fd.train.DataParallel(pm)
    dp.remove()
    fd.train.DataParallel(pm)  # after remove: allowed again


@pytest.mark.parametrize(
    "world, tp, sp, engines",
    [(4, 2, True, ["fastdist", "ddp", "fsdp", "zero"]), (8, 2, True, ["fastdist", "fsdp"])],
)
def test_engines_on_gloo_equal_one_device(
    world: int, tp: int, sp: bool, engines: list[str]
) -> None:
    """dp x tp on gloo processes: fastdist's reducer, DDP, FSDP2 (2-D TP x FSDP) and fastdist's
    reducer with ZeRO-1 AdamW each give one device's gradients, clipped norm and weights after 2
    AdamW steps."""
    from tests.dist_harness import run_on_gloo
    from tests.train_worker import engines_on_gloo

    assert run_on_gloo(engines_on_gloo, world, engines, tp, sp, timeout=400) == ["ok"] * world


def test_zero1_adamw_equals_replicated_adamw_with_half_the_state() -> None:
    ref = build("llama")
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    pm = fd.nn.parallelize(
        copy.deepcopy(ref), mesh, fd.nn.plans.plan(ref, family="llama", sequence_parallel=True)
    )
    fd.train.DataParallel(pm, "dp")
    opt = fd.train.ZeroOptimizer(pm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    sched_ref = torch.optim.lr_scheduler.LambdaLR(opt_ref, lambda s: 1.0 / (1 + s))
    for step in range(3):
        ids, labels, batches = per_rank(mesh, ("dp",), 7 * step)
        pm(input_ids=ids, labels=labels).loss.sum().backward()
        losses = [reference_loss(ref, i, lab)[1] for i, lab in batches]
        (sum(losses) / len(losses)).backward()
        fd.nn.clip_grad_norm_(pm, 0.5)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt_ref.step()
        sched.step()
        sched_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    state = pm.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), **TOL)
    replicated = sum(2 * p[0].numel() for p in pm.parameters())  # AdamW: two moments per element
    assert replicated / 2 <= opt.state_numel() <= replicated / 2 + 2  # 1/dp (+ padding)


def test_zero1_refuses_what_it_cannot_shard() -> None:
    mesh = fd.Mesh({"dp": 2})
    pm = fd.nn.parallelize(torch.nn.Linear(3, 2), mesh, {})
    with pytest.raises(fd.MeshError, match=r"not reduced over \('dp',\).*DataParallel"):
        fd.train.ZeroOptimizer(pm, torch.optim.SGD, lr=0.1)  # no engine: chunks would drift
    fd.train.DataParallel(pm, "dp")
    with pytest.raises(fd.MeshError, match="LBFGS is not known"):
        fd.train.ZeroOptimizer(pm, torch.optim.LBFGS)
    with pytest.raises(fd.MeshError, match="'tp'"):
        fd.train.ZeroOptimizer(pm, torch.optim.AdamW, "tp")
    opt = fd.train.ZeroOptimizer(pm, torch.optim.SGD, lr=0.1)
    with pytest.raises(fd.MeshError, match=r"fastdist.checkpoint.save"):
        opt.state_dict()  # a flat chunk no other layout could load
    with pytest.raises(fd.MeshError, match=r"fastdist.checkpoint.load"):
        opt.load_state_dict({})
    with pytest.raises(fd.MeshError, match="build a new ZeroOptimizer"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    pm.module.weight.grad = torch.ones_like(pm.module.weight)
    with pytest.raises(fd.MeshError, match=r"\['bias'\] have no gradient"):
        opt.step()


def test_meta_models_are_refused_until_materialized() -> None:
    mesh = fd.Mesh({"dp": 2})
    with torch.device("meta"):
        lin = torch.nn.Linear(3, 2)
    pm = fd.nn.parallelize(lin, mesh, {})
    with pytest.raises(fd.MeshError, match="meta device.*materialize the model first"):
        fd.train.DataParallel(pm, "dp")
    with pytest.raises(fd.MeshError, match="meta device"):
        fd.train.ZeroOptimizer(pm, torch.optim.AdamW)
    fd.nn.init_weights(pm, seed=0)
    dp = fd.train.DataParallel(pm, "dp")  # materialized: accepted
    assert pm.engine is dp


class Stacked(torch.nn.Module):
    """Parameters stacked [world, 3] (a simulated rank's block each): ``a`` replicated, ``w``
    split over ``ep``; forward uses the branches it is told to, and may raise in backward."""

    def __init__(self, mesh: fd.Mesh) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(mesh.size, 3, dtype=torch.float64))
        self.w = torch.nn.Parameter(torch.randn(mesh.size, 3, dtype=torch.float64))

    def param_layouts(self) -> dict[str, fd.nn.Layout]:
        return {"a": fd.nn.Layout(), "w": fd.nn.Layout(fd.P("ep"))}

    def forward(self, ga: Any = None, gw: Any = None, boom: bool = False) -> Any:
        loss = torch.zeros((), dtype=torch.float64)
        if gw is not None:
            w = Boom.apply(self.w) if boom else self.w
            loss = loss + (w * gw).sum()
        if ga is not None:  # created last: its gradient accumulates first in backward
            loss = loss + (self.a * ga).sum()
        return loss


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(x: Any) -> Any:
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        raise RuntimeError("boom")


def _mean_over(g: Any, mesh: fd.Mesh, axes: tuple[str, ...], d: int) -> Any:
    """The reducer's rule on stacked [world, ...] gradients: sum over ``axes``, / d."""
    grid = g.reshape(*mesh.shape.values(), *g.shape[1:])  # [dp, ep, 3]
    dims = [mesh.axis_names.index(a) for a in axes]
    return (grid.sum(dims, keepdim=True) / d).expand_as(grid).reshape(g.shape)


def test_accumulation_no_sync_and_a_failed_backward_follow_the_rule() -> None:
    """Review cases: a parameter used only inside no_sync is reduced by the next synced backward
    (A1); gradients accumulated without zero_grad, for a parameter split over a data axis too, add
    only the new reduced part (A2); a backward that raised half-way leaves nothing that breaks the
    next step (A3)."""
    mesh = fd.Mesh({"dp": 2, "ep": 2})
    m = Stacked(mesh)
    dp = fd.train.DataParallel(m, ("dp", "ep"), mesh=mesh)
    g = [torch.randn(mesh.size, 3, dtype=torch.float64) for _ in range(6)]
    a_rule = lambda t: _mean_over(t, mesh, ("dp", "ep"), 4)  # noqa: E731
    w_rule = lambda t: _mean_over(t, mesh, ("dp",), 4)  # noqa: E731
    with dp.no_sync():
        m(ga=g[0]).backward()  # only a, and only here
    m(gw=g[1]).backward()  # only w, synced: reduces a's too
    torch.testing.assert_close(m.a.grad, a_rule(g[0]))
    torch.testing.assert_close(m.w.grad, w_rule(g[1]))
    m(ga=g[2], gw=g[3]).backward()  # no zero_grad: the reduced new parts add
    torch.testing.assert_close(m.a.grad, a_rule(g[0] + g[2]))
    torch.testing.assert_close(m.w.grad, w_rule(g[1] + g[3]))
    m.zero_grad()
    with pytest.raises(RuntimeError, match="boom"):
        m(ga=g[4], gw=g[5], boom=True).backward()
    assert m.a.grad is not None and m.w.grad is None  # a went through before the raise
    m.zero_grad()
    m(ga=g[4], gw=g[5]).backward()  # the next step: as if the failed one never ran
    torch.testing.assert_close(m.a.grad, a_rule(g[4]))
    torch.testing.assert_close(m.w.grad, w_rule(g[5]))


def test_what_the_reducer_cannot_see_is_refused() -> None:
    """A parameter unfrozen after the reducer was built (A6) and reentrant checkpointing raise."""
    mesh = fd.Mesh({"dp": 2, "ep": 2})
    m = Stacked(mesh)
    m.w.requires_grad_(False)
    fd.train.DataParallel(m, "dp", mesh=mesh)
    m.w.requires_grad_(True)
    g = torch.ones(mesh.size, 3, dtype=torch.float64)
    with pytest.raises(fd.MeshError, match=r"\['w'\] got gradients but did not require grad"):
        m(ga=g, gw=g).backward()

    m = Stacked(mesh)
    fd.train.DataParallel(m, "dp", mesh=mesh)

    def inner(x: Any) -> Any:
        return m(gw=x)

    x = torch.ones(mesh.size, 3, dtype=torch.float64, requires_grad=True)
    loss = (m.a * g).sum() + torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=True)
    with pytest.raises(fd.MeshError, match="use_reentrant=False"):
        loss.backward()


def test_a_standalone_reducer_is_the_models_engine() -> None:
    mesh = fd.Mesh({"dp": 2})
    pm = fd.nn.parallelize(torch.nn.Linear(3, 1, bias=False).double(), mesh, {})
    dp = fd.train.DataParallel(pm, "dp")
    assert pm.engine is dp
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    with pm.engine.no_sync():  # the model's engine is the reducer
        pm(x).sum().backward()
    w = pm.module.weight
    assert w.grad is not None
    torch.testing.assert_close(w.grad, x.sum(1)[:, None])  # per rank: not reduced
    with pytest.raises(fd.MeshError, match="already runs data-parallel"):
        fd.train.DataParallel(pm, "dp")
    dp.remove()
    assert pm.engine is None
    w.grad = None
    pm(x).sum().backward()  # removed: nothing reduces
    torch.testing.assert_close(w.grad, x.sum(1)[:, None])


def test_review_cases_on_gloo() -> None:
    """tests/train_worker.py reducer_review_cases on 4 gloo processes (dp=2 x ep=2)."""
    from tests.dist_harness import run_on_gloo
    from tests.train_worker import reducer_review_cases

    assert run_on_gloo(reducer_review_cases, 4, timeout=200) == ["ok"] * 4


def test_a_peer_that_never_reduces_is_reported_within_the_timeout() -> None:
    from tests.dist_harness import run_on_gloo
    from tests.train_worker import peer_skips_backward

    got, skipped = run_on_gloo(peer_skips_backward, 2, timeout=120)
    assert skipped == "skipped"
    assert (
        "fastdist.train.DataParallel" in got and "'dp'" in got and "gradient all-reduce" in got
    ), got
    assert float(got.split(" after ")[1].split("s:")[0]) <= 5 + 3, got
