"""`fastdist.nn.pvary_sites.PvarySites` on real ranks: a parameter listed for two axes, or twice
for one, keeps its slot and gets its gradient summed once over each axis."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

import fastdist as fd
from fastdist.nn.pvary_sites import PvarySites
from tests.dist_harness import run_on_gloo


def listed_twice_on_gloo() -> dict[str, Any]:
    mesh = fd.connect(dp=1, tp=2)
    rank = mesh.index(mesh.rank, "tp")
    torch.manual_seed(0)
    lin = nn.Linear(3, 2, dtype=torch.float64)
    weight = lin.weight
    # weight over tp and dp, and over tp a second time: pvary'd once per axis
    PvarySites(mesh, [(lin, "weight", "tp"), (lin, "weight", "dp"), (lin, "weight", "tp")])
    xs = torch.randn(2, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    lin(xs[rank]).sum().backward()
    return {
        "same_parameter": lin.weight is weight and isinstance(lin.weight, nn.Parameter),
        "grad": weight.grad,
        "want": xs.sum(dim=(0, 1)).expand(2, 3),  # d/dW of sum(x W^T) summed over both ranks
    }


def test_a_parameter_listed_for_two_axes_and_twice_on_gloo() -> None:
    for r in run_on_gloo(listed_twice_on_gloo, 2):
        assert r["same_parameter"]
        torch.testing.assert_close(r["grad"], r["want"])


# ------------------------------------------------------------------ bucketed gradient sums


class _TwoNorms(nn.Module):
    """Replicated parameters met by per-rank data: two layer norms (one used twice) and a
    linear layer, all ``pvary``'d over ``sp``; ``out`` used outside any site too."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(4, dtype=torch.float64)
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.norm2 = nn.LayerNorm(4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: Tensor = self.norm2(self.lin(self.norm1(x)))
        out: Tensor = self.norm2(h * h)
        return out.sum() + self.lin.bias.sum()  # norm2 twice; bias also outside


def _sites(m: _TwoNorms) -> list[tuple[nn.Module, str, str]]:
    return [(mod, n, "sp") for mod in (m.norm1, m.lin, m.norm2) for n, _ in mod.named_parameters()]


def _reference(xs: torch.Tensor, steps: int) -> dict[str, Tensor]:
    """One device: the whole batch (both ranks' rows), ``steps`` backwards accumulated; the
    term outside the sites is replicated (every rank's copy of it is the one loss term)."""
    torch.manual_seed(0)
    m = _TwoNorms()
    for _ in range(steps):
        once = (xs.shape[0] - 1) * m.lin.bias.sum()
        loss = sum(m(xs[r]) for r in range(xs.shape[0])) - once
        loss.backward()
    return {n: p.grad for n, p in m.named_parameters()}  # type: ignore[misc]


def bucketed_on_gloo(bucket: bool, checkpoint: bool) -> dict[str, Any]:
    from torch.utils.checkpoint import checkpoint as ckpt

    from fastdist.core.context import COLLECTIVE_OBSERVERS

    mesh = fd.connect(sp=2)
    rank = mesh.index(mesh.rank, "sp")
    torch.manual_seed(0)
    m = _TwoNorms()
    PvarySites(mesh, _sites(m), bucket=bucket)
    xs = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    calls: list[str] = []

    def observe(prim: Any, stacked: bool, tensors: Any, spec: Any, params: Any, run: Any) -> Any:
        calls.append(prim.name)
        return run()

    COLLECTIVE_OBSERVERS.add(observe)
    try:
        with torch.no_grad():
            m(xs[rank])  # no graph: no collective, nothing kept
        for _ in range(2):  # two backwards: the second adds to the first's .grad
            loss = (
                ckpt(m, xs[rank].clone().requires_grad_(), use_reentrant=True)
                if checkpoint
                else m(xs[rank])
            )
            loss.backward()
        # torch.autograd.grad: the sums returned to autograd, per parameter
        (g_w,) = torch.autograd.grad(m(xs[rank]), [m.norm1.weight])
    finally:
        COLLECTIVE_OBSERVERS.remove(observe)
    return {
        "grads": {n: p.grad for n, p in m.named_parameters()},
        "psums": calls.count("psum"),
        "calls": len(calls),
        "autograd_grad": g_w,
    }


def _check_bucketed(bucket: bool, checkpoint: bool) -> list[dict[str, Any]]:
    xs = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want, once = _reference(xs, 2), _reference(xs, 1)
    out = run_on_gloo(bucketed_on_gloo, 2, bucket, checkpoint)
    for r in out:
        for n, g in want.items():
            torch.testing.assert_close(r["grads"][n], g, rtol=1e-12, atol=1e-12, msg=n)
        torch.testing.assert_close(r["autograd_grad"], once["norm1.weight"], rtol=1e-12, atol=0)
    return out


def test_bucketed_gradient_sums_on_gloo_equal_one_device_with_fewer_collectives() -> None:
    bucketed = _check_bucketed(bucket=True, checkpoint=False)
    per_param = _check_bucketed(bucket=False, checkpoint=False)
    # per parameter: 6 psums per backward (norm2 used twice: its uses' sums, 2 more) + the
    # autograd.grad call's; bucketed: one flat psum per backward (autograd.grad: per parameter)
    assert per_param[0]["psums"] >= 2 * 6
    assert bucketed[0]["psums"] <= 2 * 1 + 6
    assert bucketed[0]["psums"] < per_param[0]["psums"] - 6
    assert bucketed[0]["calls"] == bucketed[0]["psums"]  # nothing else, none under no_grad


def test_bucketed_gradient_sums_with_reentrant_checkpointing_on_gloo() -> None:
    # the first forward runs under no_grad (skipped), the recomputation pvary's once: no double sum
    _check_bucketed(bucket=True, checkpoint=True)


def test_no_grad_forward_skips_the_hooks_on_simulated_ranks() -> None:
    calls: list[str] = []

    def observe(prim: Any, stacked: bool, tensors: Any, spec: Any, params: Any, run: Any) -> Any:
        calls.append(prim.name)
        return run()

    from fastdist.core.context import COLLECTIVE_OBSERVERS

    mesh = fd.Mesh({"sp": 2})
    torch.manual_seed(0)
    m = _TwoNorms()
    PvarySites(mesh, _sites(m))
    xs = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    COLLECTIVE_OBSERVERS.add(observe)
    try:
        with torch.no_grad():
            out = fd.simulate(m, mesh)(xs)
        with torch.enable_grad():
            fd.simulate(m, mesh)(xs).sum()
    finally:
        COLLECTIVE_OBSERVERS.remove(observe)
    torch.manual_seed(0)
    ref = _TwoNorms()
    torch.testing.assert_close(out, torch.stack([ref(x) for x in xs]).detach())
    assert calls.count("pvary") == 8  # the graph-recording forward only (norm2 called twice)


def test_pending_sums_are_per_backward_and_a_thread_drops_only_its_own() -> None:
    """Kept partial gradients belong to one backward (graph task): a forward that finds stale
    entries (a backward of this thread raised) drops those only, never another thread's running
    backward's."""
    import threading

    from fastdist.nn.grad_buckets import PendingSums

    pending = PendingSums()
    other = threading.Thread(target=lambda: None)
    other.start()
    other.join()
    pending.tasks = {1: {10: [0]}, 2: {20: [1]}}
    pending.threads = {1: threading.get_ident(), 2: other.ident or -1}
    assert pending.stale() and pending.pending() == 2
    pending.drop()
    assert list(pending.tasks) == [2] and not pending.stale()
    assert pending.take(2) == [[1]] and pending.take(2) == []


def test_deferred_pvary_many_one_node_and_an_unused_parameter_gets_no_gradient() -> None:
    """A module's parameters pvary'd in one autograd node: each gets its own gradient; one whose
    view the forward did not use keeps ``.grad`` None (as with one node per parameter)."""
    from fastdist.nn.grad_buckets import deferred_pvary_many

    mesh = fd.Mesh({"sp": 1})
    w, b, unused = (nn.Parameter(torch.full((2,), v, dtype=torch.float64)) for v in (1.0, 2.0, 3))
    vw, vb, vu = deferred_pvary_many([w, b, unused], mesh, ("sp",))
    assert vw.grad_fn is vb.grad_fn is vu.grad_fn  # one node
    (3 * vw + vb * vb).sum().backward()
    assert torch.equal(w.grad, torch.full((2,), 3.0, dtype=torch.float64))  # type: ignore[arg-type]
    assert torch.equal(b.grad, torch.full((2,), 4.0, dtype=torch.float64))  # type: ignore[arg-type]
    assert unused.grad is None
