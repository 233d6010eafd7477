"""docs/pipeline.md shows what the code does: its timeline pictures are `Schedule.show()`'s
output now, and its schedules table holds the bubbles and in-flight counts the schedules give."""

from __future__ import annotations

import re
from pathlib import Path

from fastdist.train import schedules

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "pipeline.md"


def test_the_timeline_pictures_are_what_show_draws() -> None:
    text = DOC.read_text()
    for s in (
        schedules.one_f_one_b(pp=4, microbatches=4),
        schedules.interleaved_1f1b(pp=4, microbatches=4, virtual=2),
    ):
        drawn = s.show()
        assert f"```text\n{drawn}\n```" in text, f"docs/pipeline.md lacks, as drawn now:\n{drawn}"


def _row(text: str, name: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| `{name}` |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_the_schedules_table_states_their_bubbles_and_in_flight_micro_batches() -> None:
    """Each row's formulas evaluated at pp=4, m=8 (v=2) and the numbers in its pp=4, m=8 columns
    are the schedule's own: `Schedule.bubble()` and `Schedule.peak_in_flight(r)`."""
    text = DOC.read_text()
    pp, m, v = 4, 8, 2
    formulas = {  # the table's formulas, as Python
        "gpipe": ((pp - 1) / (m + pp - 1), [m] * pp),
        "1f1b": ((pp - 1) / (m + pp - 1), [min(pp - r, m) for r in range(pp)]),
        "interleaved_1f1b": (
            (pp - 1) / (v * m + pp - 1),
            [min(2 * (pp - r - 1) + (v - 1) * pp + 1, v * m) for r in range(pp)],
        ),
    }
    for name, (bubble, in_flight) in formulas.items():
        s = schedules.schedule(name, pp, m, v if name == "interleaved_1f1b" else 1)
        assert abs(s.bubble() - bubble) < 1e-12, name
        assert [s.peak_in_flight(r) for r in range(pp)] == in_flight, name
        cells = _row(text, name)
        assert cells[3].split()[0] == f"{bubble:.3f}", (name, cells)
        assert re.match(", ".join(map(str, in_flight)), cells[5]), (name, cells)
    assert "`min(pp - r, m)`" in _row(text, "1f1b")[4]
    assert "`min(2 (pp - r - 1) + (v - 1) pp + 1, v m)`" in _row(text, "interleaved_1f1b")[4]


def _transfers(s: schedules.Schedule) -> tuple[dict, dict]:
    """For each (sender, receiver) pair of ranks: the messages in the order the sender's actions
    send them, and in the order the receiver's actions receive them (what `Pipeline.step` does on
    real ranks: an ``F`` receives its input and sends its output, a ``B`` receives its output's
    gradient and sends its input's)."""
    sends: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    recvs: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    last = s.stages - 1
    for r, acts in enumerate(s.actions):
        for a in acts:
            j, m = a.stage, a.microbatch
            src, dst = (j - 1, j + 1) if a.kind == "F" else (j + 1, j - 1)
            if 0 <= src <= last and s.rank_of(src) != r:
                recvs.setdefault((s.rank_of(src), r), []).append((a.kind, m, j))
            if 0 <= dst <= last and s.rank_of(dst) != r:
                sends.setdefault((r, s.rank_of(dst)), []).append((a.kind, m, dst))
    return sends, recvs


def test_each_pair_of_ranks_sends_and_receives_in_one_order() -> None:
    """What the page says about NCCL (which matches point-to-point messages in order, ignoring
    tags): on every pair of ranks the sender's order of messages is the receiver's."""
    built = [
        schedules.schedule(name, pp, m)
        for name in ("gpipe", "1f1b")
        for pp in (2, 3, 4, 8)
        for m in (1, 2, 3, 4, 8, 16)
    ]
    built += [
        schedules.interleaved_1f1b(pp, m, v)
        for pp in (2, 3, 4, 8)
        for m in (pp, 2 * pp, 4 * pp)
        for v in (2, 3)
    ]
    for s in built:
        sends, recvs = _transfers(s)
        assert sends == recvs, (s.name, s.pp, s.microbatches, s.virtual)
        assert sum(map(len, sends.values())) == 2 * s.microbatches * (s.stages - 1)
    # the check can fail: a rank that takes its forwards in another order
    s = schedules.gpipe(2, 2)
    swapped = (s.actions[0], (s.actions[1][1], s.actions[1][0], *s.actions[1][2:]))
    sends, recvs = _transfers(schedules.Schedule("gpipe", 2, 2, 1, swapped))
    assert sends != recvs
