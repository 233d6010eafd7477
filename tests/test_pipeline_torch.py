"""torch.distributed.pipelining on an unmodified HF Llama (tests/pipeline_torch_ref.py), on 2 and 4
gloo processes, against one device in float64: the loss and every gradient to 1e-9, and every
parameter's gradient on exactly one rank, for GPipe, 1F1B and interleaved 1F1B (issue 34, point
4: the side fastdist's pipeline is compared with)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fastdist.errors import PipelineError
from tests.dist_harness import run_on_gloo
from tests.pipeline_torch_ref import (
    bubble_theory,
    build_model,
    llama_config,
    make_batch,
    reference,
    replay_bubble,
    split_llama,
    torch_pipeline_cases,
)

SEED, BATCH, SEQ, M = 3, 8, 8, 4
TOL = dict(rtol=0.0, atol=1e-9)


def _check(results: list[dict[str, Any]], config_kwargs: dict[str, Any], label: str) -> None:
    """``results``: every rank's return of one case. Loss on exactly the last stage's rank,
    equal to one device's; each parameter's gradient on exactly one rank, equal to one
    device's."""
    config = llama_config(**config_kwargs)
    ids, labels = make_batch(config, BATCH, SEQ, SEED)
    loss_ref, grads_ref = reference(config, ids, labels, SEED)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert len(losses) == 1, f"{label}: loss on {len(losses)} ranks"
    torch.testing.assert_close(losses[0], loss_ref, **TOL, msg=lambda m: f"{label} loss: {m}")
    owners: dict[str, list[int]] = {}
    for r in results:
        for name, grad in r["grads"].items():
            owners.setdefault(name, []).append(r["rank"])
            assert grad is not None, f"{label}: {name} got no gradient on rank {r['rank']}"
            torch.testing.assert_close(
                grad,
                grads_ref[name],
                **TOL,
                msg=lambda m: f"{label} {name}: {m}",  # noqa: B023
            )
    assert set(owners) == set(grads_ref), f"{label}: {set(grads_ref) ^ set(owners)}"
    shared = {n: o for n, o in owners.items() if len(o) != 1}
    assert not shared, f"{label}: parameters on several ranks: {shared}"


def _case(schedule: str, layers: int, stages_per_rank: int = 1, **kw: Any) -> dict[str, Any]:
    return dict(
        config_kwargs={"num_hidden_layers": layers},
        schedule=schedule,
        microbatches=M,
        seed=SEED,
        batch=BATCH,
        seq=SEQ,
        stages_per_rank=stages_per_rank,
        steps=1,
        **kw,
    )


@pytest.mark.parametrize(
    "world,cases",
    [
        (
            2,
            [
                _case("gpipe", 4),
                _case("1f1b", 4),
                _case("1f1b", 4, static_meta=False),  # metadata inferred at the first step
                _case("interleaved_1f1b", 4, stages_per_rank=2),
            ],
        ),
        (4, [_case("gpipe", 8), _case("1f1b", 8), _case("interleaved_1f1b", 8, 2)]),
    ],
    ids=["pp2", "pp4"],
)
def test_torch_pipelining_equals_one_device(world: int, cases: list[dict[str, Any]]) -> None:
    per_rank = run_on_gloo(torch_pipeline_cases, world, cases, timeout=240)
    for i, case in enumerate(cases):
        label = (
            f"pp={world} {case['schedule']} x{case['stages_per_rank']}"
            f"{'' if case.get('static_meta', True) else ' dynamic'}"
        )
        results = [ranks[i] for ranks in per_rank]
        stages = sorted(s for r in results for s in r["stages"])
        assert stages == list(range(world * case["stages_per_rank"])), label
        _check(results, case["config_kwargs"], label)
        # the timer saw every compute action: F and B of each micro-batch on each stage
        for r in results:
            kinds = sorted((a[0], a[1], a[2]) for a in r["actions"])
            assert kinds == sorted(
                (s, k, i) for s in r["stages"] for k in "FB" for i in range(M)
            ), label
            assert 0 <= r["bubble_replay"] < 1 and 0 <= r["bubble"] < 1, label


def test_stage_split_names_and_errors() -> None:
    """The stages hold the model's own parameters, each once, under the model's names; a stage
    count that does not divide the layers is refused with a PipelineError."""
    model = build_model(llama_config(), SEED)
    stages = split_llama(model, 2)
    names = [hf for s in stages for hf in s.hf_names.values()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert "model.embed_tokens.weight" in stages[0].hf_names.values()
    assert {"lm_head.weight", "model.norm.weight"} <= set(stages[1].hf_names.values())
    assert "model.layers.3.mlp.up_proj.weight" in stages[1].hf_names.values()
    with pytest.raises(PipelineError, match="3 stages do not divide 4 layers.*Fix"):
        split_llama(model, 3)
    # the stages chained on one device give the model's logits
    ids, _ = make_batch(model.config, 2, SEQ, SEED)
    h = ids
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, model(input_ids=ids).logits, rtol=0, atol=1e-12)


def test_bubble_theory() -> None:
    assert bubble_theory("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_theory("gpipe", 2, 4) == pytest.approx(1 / 5)
    assert bubble_theory("interleaved_1f1b", 2, 4, 2) == pytest.approx(1 / 9)


def _one_f_one_b(
    pp: int, m: int, f: float, b: float
) -> list[list[tuple[int, str, int, float, float]]]:
    """Each rank's actions in torch's 1F1B order (warm-up ``pp - rank`` forwards, then
    backward/forward pairs, then the remaining backwards), with durations ``f`` and ``b`` (start
    times are irrelevant to the replay)."""
    out = []
    for s in range(pp):
        order, nf, nb = [], 0, 0
        for _ in range(min(m, pp - s)):
            order.append(("F", nf))
            nf += 1
        while nb < m:
            order.append(("B", nb))
            nb += 1
            if nf < m:
                order.append(("F", nf))
                nf += 1
        out.append([(s, k, i, 0.0, f if k == "F" else b) for k, i in order])
    return out


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (3, 5)])
def test_replay_bubble_of_equal_stages_is_the_theory(pp: int, m: int) -> None:
    """Equal stages, free communication: replaying 1F1B's action order gives every rank
    exactly (pp - 1) / (m + pp - 1), for any forward/backward ratio."""
    got = replay_bubble(_one_f_one_b(pp, m, 1.0, 2.0))
    assert got == pytest.approx([bubble_theory("1f1b", pp, m)] * pp, abs=1e-12)
    # a last stage twice as slow: the others wait for it, the bubble grows
    slow = _one_f_one_b(pp, m, 1.0, 2.0)
    slow[-1] = [(s, k, i, 0.0, 2 * t1) for s, k, i, _, t1 in slow[-1]]
    assert min(replay_bubble(slow)[:-1]) > bubble_theory("1f1b", pp, m) + 0.1
    with pytest.raises(PipelineError, match="never recorded.*Fix"):
        replay_bubble([[(0, "B", 0, 0.0, 1.0)], [(1, "F", 0, 0.0, 1.0)]])
