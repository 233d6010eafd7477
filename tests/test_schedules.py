"""The pipeline schedules of `fastdist.train.schedules` as values (no torch): every built
schedule passes its own checks for pp 1..5 and 1..8 micro-batches, idles the textbook share with
unit costs, holds the activations it should (1F1B: ``min(pp - r, m)`` on rank ``r``; GPipe:
all ``m``), and a hand-made schedule that deadlocks or misses, repeats or misplaces an action
raises `fastdist.PipelineError` naming the problem; ``show()`` drawn exactly for small cases.
"""

from __future__ import annotations

import itertools

import pytest

from fastdist import PipelineError
from fastdist.train import schedules as S
from fastdist.train.schedules import Action, Schedule

PPS = range(1, 6)
MICRO = range(1, 9)
GRID = list(itertools.product(PPS, MICRO))
INTERLEAVED = [(pp, m, v) for pp, m in GRID if m % pp == 0 for v in (2, 3)]


def _every_action_once(s: Schedule) -> None:
    """Each stage runs F then B of every micro-batch exactly once, on its own rank (checked
    here independently of the constructor's checks)."""
    for r, acts in enumerate(s.actions):
        want = {
            (kind, k, j) for kind in "FB" for k in range(s.microbatches) for j in s.stages_of(r)
        }
        got = [(a.kind, a.microbatch, a.stage) for a in acts]
        assert len(got) == len(set(got)) == len(want)
        assert set(got) == want
        for kind, k, j in got:
            if kind == "B":
                assert got.index(("F", k, j)) < got.index(("B", k, j))


def _respects_dependencies(s: Schedule) -> None:
    """In the timeline every forward starts after the previous stage's forward of its
    micro-batch ended, every backward after the next stage's backward (the last stage's after
    its own forward), and no rank runs two actions at once."""
    slots = s.timeline()
    end = {(sl.action.kind, sl.action.microbatch, sl.action.stage): sl.end for sl in slots}
    last = s.stages - 1
    for sl in slots:
        a = sl.action
        if a.kind == "F" and a.stage > 0:
            assert sl.start >= end[("F", a.microbatch, a.stage - 1)]
        if a.kind == "B":
            dep = ("F", a.microbatch, last) if a.stage == last else ("B", a.microbatch, a.stage + 1)
            assert sl.start >= end[dep]
    for r in range(s.pp):
        mine = sorted((sl.start, sl.end) for sl in slots if sl.rank == r)
        assert all(e0 <= s1 for (_, e0), (s1, _) in zip(mine, mine[1:], strict=False))
        # a rank runs its actions in its listed order
        listed = [(a.kind, a.microbatch, a.stage) for a in s.actions[r]]
        ran = [
            (sl.action.kind, sl.action.microbatch, sl.action.stage)
            for sl in sorted((sl for sl in slots if sl.rank == r), key=lambda sl: sl.start)
        ]
        assert ran == listed


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_are_valid_with_the_textbook_bubble(name: str) -> None:
    for pp, m in GRID:
        s = S.schedule(name, pp, m)
        assert (s.name, s.pp, s.microbatches, s.virtual, s.stages) == (name, pp, m, 1, pp)
        _every_action_once(s)
        _respects_dependencies(s)
        want = (pp - 1) / (m + pp - 1)
        assert S.theoretical_bubble(name, pp, m) == pytest.approx(want, abs=1e-15)
        assert s.bubble() == pytest.approx(want, abs=1e-12), (pp, m)
        assert s.makespan() == pytest.approx(2 * (m + pp - 1), abs=1e-12)
        # GPipe and 1F1B keep the same share when a backward costs twice a forward
        assert s.bubble(1.0, 2.0) == pytest.approx(want, abs=1e-12), (pp, m)


@pytest.mark.parametrize("pp, m, v", INTERLEAVED)
def test_interleaved_is_valid_with_the_textbook_bubble(pp: int, m: int, v: int) -> None:
    s = S.interleaved_1f1b(pp, m, v)
    assert S.schedule("interleaved_1f1b", pp, m, v) == s
    assert (s.pp, s.microbatches, s.virtual, s.stages) == (pp, m, v, pp * v)
    assert s.stages_of(0) == tuple(range(0, pp * v, pp))
    _every_action_once(s)
    _respects_dependencies(s)
    want = (pp - 1) / (v * m + pp - 1)
    assert S.theoretical_bubble("interleaved_1f1b", pp, m, v) == pytest.approx(want, abs=1e-15)
    assert s.bubble() == pytest.approx(want, abs=1e-12)


def test_interleaved_defaults_to_two_stages_per_rank() -> None:
    assert S.schedule("interleaved_1f1b", 2, 4).virtual == 2


def test_1f1b_holds_at_most_pp_minus_rank_micro_batches_gpipe_all() -> None:
    for pp, m in GRID:
        f1b, gp = S.one_f_one_b(pp, m), S.gpipe(pp, m)
        assert [f1b.peak_in_flight(r) for r in range(pp)] == [min(pp - r, m) for r in range(pp)]
        assert [gp.peak_in_flight(r) for r in range(pp)] == [m] * pp


def test_1f1b_with_fewer_micro_batches_than_ranks_is_gpipe_order() -> None:
    for pp in PPS:
        for m in range(1, pp + 1):
            assert S.one_f_one_b(pp, m).actions[0] == S.gpipe(pp, m).actions[0]


def test_order_is_every_action_in_timeline_order() -> None:
    s = S.interleaved_1f1b(2, 4, 2)
    order = list(s.order())
    assert order == [sl.action for sl in s.timeline()]
    assert len(order) == len(set(order)) == 2 * 4 * 2 * 2
    starts = [sl.start for sl in s.timeline()]
    assert starts == sorted(starts)


# ============================================================================ pictures
def test_show_gpipe_exactly() -> None:
    assert S.gpipe(2, 2).show() == "\n".join(
        [
            "gpipe: pp=2, 2 micro-batches; F = forward, B = backward of micro-batch k "
            "(time: 1 per action)",
            "tick    0   1   2   3   4   5",
            "pp=0   F0  F1   .   .  B0  B1",
            "pp=1    .  F0  F1  B0  B1   .",
            "bubble 0.333 (theory (pp-1)/(m+pp-1) = 0.333)",
        ]
    )


def test_show_interleaved_labels_the_rank_stage() -> None:
    assert S.interleaved_1f1b(2, 2, 2).show() == "\n".join(
        [
            "interleaved_1f1b: pp=2, 2 micro-batches, 2 stages per rank; F = forward, "
            "B = backward of micro-batch k (time: 1 per action)",
            "tick     0    1    2    3    4    5    6    7    8    9",
            "pp=0  F0.0 F1.0 F0.1 F1.1    . B0.1    . B1.1 B0.0 B1.0",
            "pp=1     . F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0    .",
            "bubble 0.200 (theory (pp-1)/(v*m+pp-1) = 0.200)",
        ]
    )


def test_show_with_a_backward_twice_a_forward() -> None:
    assert S.one_f_one_b(2, 2).show(1.0, 2.0) == "\n".join(
        [
            "1f1b: pp=2, 2 micro-batches; F = forward, B = backward of micro-batch k "
            "(time: F 1, B 2)",
            "tick    0   1   2   3   4   5   6   7   8",
            "pp=0   F0  F1   .   .  B0   -   .  B1   -",
            "pp=1    .  F0  B0   -  F1  B1   -   .   .",
            "bubble 0.333 (theory (pp-1)/(m+pp-1) = 0.333)",
        ]
    )


def test_the_module_docstring_picture() -> None:
    out = S.one_f_one_b(3, 4).show().splitlines()
    assert out[2] == "pp=0   F0  F1  F2   .   .  B0  F3  B1   .  B2   .  B3"
    assert out[4] == "pp=2    .   .  F0  B0  F1  B1  F2  B2  F3  B3   .   ."


# ============================================================================ bad schedules
def _lists(*ranks: str, pp: int = 2) -> tuple[tuple[Action, ...], ...]:
    """Rank lists from text: ``"F0 F1 B0 B1"``; stage = the rank (one stage per rank), or
    ``F0@2`` for stage 2."""
    out = []
    for r, text in enumerate(ranks):
        acts = []
        for tok in text.split():
            body, _, stage = tok.partition("@")
            acts.append(Action(body[0], int(body[1:]), int(stage) if stage else r))  # type: ignore[arg-type]
        out.append(tuple(acts))
    return tuple(out)


def test_a_hand_made_valid_schedule_is_accepted() -> None:
    s = Schedule("mine", 2, 2, 1, _lists("F0 F1 B0 B1", "F0 B0 F1 B1"))
    assert s.makespan() == 6.0


def test_a_deadlocking_schedule_raises() -> None:
    # rank 0 waits for B0 of stage 1 before it sends F1; rank 1 waits for F1 before its B0
    with pytest.raises(PipelineError, match="deadlocks") as e:
        Schedule("mine", 2, 2, 1, _lists("F0 B0 F1 B1", "F1 F0 B0 B1"))
    msg = str(e.value)
    assert "rank 0 at B0 of stage 0" in msg and "rank 1 at F1 of stage 1" in msg
    assert "Fix:" in msg


@pytest.mark.parametrize(
    "lists, fragment",
    [
        (("F0 F1 B0", "F0 F1 B0 B1"), "rank 0 runs 3 actions, not the 4"),  # missing
        (("F0 F1 B0 B1 B1", "F0 F1 B0 B1"), "rank 0 lists B1 of stage 0 twice"),  # duplicated
        (("F0 F1 B0 B1 F0@1", "F0 F1 B0 B1"), "but stage 1 lives on rank 1"),  # misplaced
        (("F0 B1 F1 B0", "F0 F1 B0 B1"), "lists B1 of stage 0 before its forward"),
        (("F0 F2 B0 B2", "F0 F1 B0 B1"), "not an F or B of a micro-batch in 0..1"),
        (("F0 F1 B0 B1 F0@4", "F0 F1 B0 B1"), "but stage 4 lives on rank 0 (stages 0..1)"),
    ],
    ids=["missing", "duplicated", "misplaced", "backward-first", "bad-micro", "bad-stage"],
)
def test_a_schedule_with_a_wrong_action_raises(lists: tuple[str, str], fragment: str) -> None:
    with pytest.raises(PipelineError, match="Fix:") as e:
        Schedule("mine", 2, 2, 1, _lists(*lists))
    assert fragment in str(e.value)
    assert "'mine'" in str(e.value)


def test_a_schedule_with_a_list_per_rank_missing_raises() -> None:
    with pytest.raises(PipelineError, match=r"1 action lists for pp=2 ranks\. Fix:"):
        Schedule("mine", 2, 2, 1, _lists("F0 F1 B0 B1"))


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: S.schedule("zero_bubble", 2, 2), "'zero_bubble' is not known. Fix: use one of"),
        (lambda: S.schedule("gpipe", 2, 2, 2), "holds one stage per rank, not virtual=2"),
        (lambda: S.gpipe(0, 2), "pp=0. Fix: a positive int"),
        (lambda: S.one_f_one_b(2, True), "microbatches=True. Fix: a positive int"),
        (lambda: S.interleaved_1f1b(2, 4, 0), "virtual=0. Fix: a positive int"),
        (lambda: S.interleaved_1f1b(4, 6), "Fix: use 4 or 8 micro-batches"),
        (lambda: S.interleaved_1f1b(4, 3), "Fix: use 4 micro-batches"),
        (lambda: S.gpipe(2, 2).timeline(0.0, 1.0), "forward=0.0"),
        (lambda: S.stage_layers(6, 4), "Fix: use a stage count that divides 6 (1, 2, 3, 6)"),
        (lambda: S.stage_layers(6, 2, [2, 2]), "sums to 4, the model has 6 layers"),
        (lambda: S.stage_layers(6, 2, [2, 2, 2]), "for 2 stages. Fix: 2 positive ints"),
        (lambda: S.stage_layers(6, 2, [0, 6]), "for 2 stages. Fix: 2 positive ints"),
    ],
    ids=[
        "unknown",
        "virtual-gpipe",
        "pp0",
        "bool-micro",
        "virtual0",
        "interleaved-6-over-4",
        "interleaved-3-over-4",
        "costs",
        "layers-undivided",
        "sizes-sum",
        "sizes-length",
        "sizes-zero",
    ],
)
def test_bad_counts_raise(call: object, fragment: str) -> None:
    with pytest.raises(PipelineError) as e:
        call()  # type: ignore[operator]
    assert fragment in str(e.value)
    assert "Fix:" in str(e.value)


def test_stage_layers() -> None:
    assert S.stage_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert S.stage_layers(5, 2, [1, 4]) == [range(0, 1), range(1, 5)]
    assert S.theoretical_bubble("custom", 2, 2) is None
