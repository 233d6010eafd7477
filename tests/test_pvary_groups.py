"""`fastdist.nn.pvary_sites.PvarySites` on real ranks with sites inside sites: the outermost
site's pre-hook ``deferred_pvary``'s the inner sites' parameters with its own, in one autograd
node; every gradient equals one device's (float64, 2 gloo ranks), also with an inner module
checkpointed (reentrant), called twice, never called, holding a frozen parameter, or given
another parameter during the forward."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import fastdist as fd
from fastdist.nn.pvary_sites import PvarySites
from tests.dist_harness import run_on_gloo


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.norm = nn.LayerNorm(4, dtype=torch.float64)


class _Outer(nn.Module):
    """A site itself (``scale``) holding sites: ``a.lin``/``a.norm`` (used one by one), ``b``
    (twice; optionally checkpointed once), ``unused``, ``frozen`` (weight frozen), and ``tied``
    (assigned to ``b.weight`` during the forward when ``retie``)."""

    def __init__(self, ckpt: bool, retie: bool) -> None:
        super().__init__()
        self.ckpt, self.retie = ckpt, retie
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))
        self.a = _Inner()
        self.b = nn.Linear(4, 4, dtype=torch.float64)
        self.unused = nn.Linear(4, 4, dtype=torch.float64)
        self.frozen = nn.LayerNorm(4, dtype=torch.float64)
        self.frozen.weight.requires_grad_(False)
        self.tied = nn.Parameter(torch.eye(4, dtype=torch.float64) * 0.9)

    def forward(self, x: Tensor) -> Tensor:
        if self.retie:
            self.b.weight = self.tied  # the slot given another parameter mid-forward
        h = self.a.norm(self.a.lin(x * self.scale))
        h = checkpoint(self.b, h, use_reentrant=True) if self.ckpt else self.b(h)
        h = self.frozen(self.b(h).tanh())
        out: Tensor = (h * h).sum()
        return out


def _sites(m: _Outer) -> list[tuple[nn.Module, str, str]]:
    """Every parameter but ``tied`` (its gradient is summed where it is used: as ``b.weight``)."""
    mods = [m, m.a.lin, m.a.norm, m.b, m.unused, m.frozen]
    return [
        (mod, n, "sp")
        for mod in mods
        for n, _ in mod.named_parameters(recurse=False)
        if n != "tied"
    ]


def _build(ckpt: bool, retie: bool) -> _Outer:
    torch.manual_seed(0)
    return _Outer(ckpt, retie)


def _xs() -> Tensor:
    return torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _deferred_nodes(loss: Tensor) -> int:
    """The ``deferred_pvary`` autograd nodes in ``loss``'s graph."""
    seen, todo, count = set(), [loss.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ == "_DeferredBackward"
        todo.extend(n for n, _ in node.next_functions)
    return count


def grouped_on_gloo(ckpt: bool, retie: bool) -> dict[str, Any]:
    mesh = fd.connect(sp=2)
    rank = mesh.index(mesh.rank, "sp")
    m = _build(ckpt, retie)
    weight = m.b.weight
    PvarySites(mesh, _sites(m))
    xs = _xs()
    nodes, kept_assignment = [], True
    for _ in range(2):  # the second backward adds to the first's .grad
        loss = m(xs[rank])
        nodes.append(_deferred_nodes(loss))
        if retie:  # the forward's own assignment stays (not undone by the outer site's hook)
            kept_assignment = kept_assignment and m.b.weight is m.tied
        loss.backward()
        if retie:
            m.b.weight = weight  # as the reference does
    slots = all(
        isinstance(mod._parameters[n], nn.Parameter) for mod, n, _ in _sites(m) if n != "weight"
    )
    return {
        "grads": {n: p.grad for n, p in m.named_parameters()},
        "nodes": nodes,
        "slots": slots and m.b.weight is weight and kept_assignment,
    }


def _reference(ckpt: bool, retie: bool) -> dict[str, Tensor | None]:
    m, xs = _build(ckpt, retie), _xs()
    weight = m.b.weight
    for _ in range(2):
        sum(m(x) for x in xs).backward()  # type: ignore[union-attr]
        m.b.weight = weight
    return {n: p.grad for n, p in m.named_parameters()}


def _check(ckpt: bool, retie: bool) -> list[dict[str, Any]]:
    want = _reference(ckpt, retie)
    out = run_on_gloo(grouped_on_gloo, 2, ckpt, retie)
    for r in out:
        assert r["slots"]  # every parameter back in its slot (retie: the model's own choice)
        for n, g in want.items():
            if g is None:
                assert r["grads"][n] is None, n
            else:
                torch.testing.assert_close(r["grads"][n], g, rtol=1e-12, atol=1e-12, msg=n)
    return out


def test_inner_sites_in_one_node_equal_one_device() -> None:
    out = _check(ckpt=False, retie=False)
    # one node for the outer site and every inner one; the frozen norm's bias its own (its
    # module has a frozen parameter: it swaps its own, as before)
    assert out[0]["nodes"] == [2, 2]


def test_inner_site_checkpointed_reentrant_equals_one_device() -> None:
    # b's first use recomputed in backward, outside the outer forward: b swaps its own there
    _check(ckpt=True, retie=False)


def test_inner_slot_given_another_parameter_mid_forward_equals_one_device() -> None:
    _check(ckpt=False, retie=True)
