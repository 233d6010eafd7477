"""torch.compile of an expert-parallel model on real ranks (2 gloo processes, ep=2).

The MoE ``all_to_all`` dispatch reads the row counts each rank receives to the host
(``ragged_all_to_all``), data-dependent sizes: a compiled training step without ``fullgraph``
runs the exchange outside the graph (a graph break) and equals eager and one device (float64);
with ``fullgraph=True`` torch raises its ``Unsupported`` error carrying fastdist's reason and fix
(before: a guard error on an unbacked size inside ``ragged_all_to_all``'s argument checks).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

import fastdist as fd
from tests.tiny_models import tiny_mixtral

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}


def mixtral() -> Any:
    return tiny_mixtral().train()


def compiled_moe_ranks() -> dict[str, Any]:
    """One rank of ep 2: one device's loss and gradients, the parallel model's eager and compiled
    (no fullgraph) ones, and what ``fullgraph=True`` raises."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    mesh = fd.connect(ep=2, timeout=120)
    model = mixtral()
    ref = copy.deepcopy(model)
    pm = fd.nn.parallelize(model, mesh)  # the ready Mixtral plan: all_to_all dispatch
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    # one device's loss in float64 (transformers' own upcasts the logits to float32)
    logits = ref(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))
    loss.backward()
    out: dict[str, Any] = {
        "ref": (loss.detach(), {n: p.grad for n, p in ref.named_parameters()}),
    }

    def run(step: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        got = step(ids)
        got.backward()
        return got.detach(), pm.grads()

    out["eager"] = run(lambda i: pm(input_ids=i, labels=i).loss)
    counters.clear()
    out["compiled"] = run(
        torch.compile(lambda i: pm(input_ids=i, labels=i).loss, backend="aot_eager")
    )
    out["breaks"] = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    try:
        torch.compile(lambda i: pm(input_ids=i, labels=i).loss, fullgraph=True, backend="eager")(
            ids
        )
        out["fullgraph"] = None
    except Exception as e:
        out["fullgraph"] = (type(e).__name__, str(e))
    return out


def test_compiled_moe_step_on_gloo() -> None:
    """Without fullgraph: the compiled step (forward compiled, backward through it) equals eager
    and one device; with fullgraph=True: torch's Unsupported error with fastdist's reason."""
    from tests.dist_harness import run_on_gloo

    for r, res in enumerate(run_on_gloo(compiled_moe_ranks, 2, timeout=300)):
        ref_loss, ref_grads = res["ref"]
        for name in ("eager", "compiled"):
            loss, grads = res[name]
            torch.testing.assert_close(
                loss, ref_loss, **TOL, msg=lambda m, w=f"rank {r} {name} loss": f"{w}: {m}"
            )
            assert grads.keys() == ref_grads.keys()
            for n, g in grads.items():
                torch.testing.assert_close(
                    g, ref_grads[n], **TOL, msg=lambda m, w=f"rank {r} {name} {n}": f"{w}: {m}"
                )
        assert res["breaks"] > 0  # the exchange ran outside the graph
        assert res["fullgraph"] is not None, "fullgraph=True compiled a data-dependent exchange"
        kind, text = res["fullgraph"]
        assert kind == "Unsupported", text
        assert "fastdist.ragged_all_to_all" in text and "data-dependent sizes" in text, text
        assert "compile without fullgraph=True" in text and "strategy='allgather'" in text, text
