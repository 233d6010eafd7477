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
