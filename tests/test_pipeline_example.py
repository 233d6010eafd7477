"""examples/train_pipeline.py under torchrun on 4 gloo processes (pp=2 x tp=2): the losses and
clipped norms it prints are those of the same model trained on one device in this process, and
it exits non-zero when a difference exceeds its tolerance."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_harness import (
    forked_example,
    load_example,
    run_example_without_torchrun,
    torchrun_example,
)

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent
DIFFS = re.compile(r"max differences from one device: loss (\S+), norm (\S+), weights (\S+): (\w+)")


def _example() -> Any:
    return load_example("train_pipeline.py", "train_pipeline_example")


@functools.cache
def _one_device(steps: int = 3) -> list[tuple[float, float]]:
    """(loss, clipped norm) of each step of the example's model trained on one device, with the
    example's defaults."""
    ex = _example()
    args = ex.parse([])
    model = ex.build_model(args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    vocab = model.config.vocab_size
    return [
        ex.reference_step(model, opt, ex.global_batch(s, args.batch, args.seq, vocab), args.clip)
        for s in range(steps)
    ]


def _printed(out: str) -> list[tuple[float, float]]:
    rows = re.findall(r"^step (\d+)  loss (\S+)  norm (\S+)$", out, flags=re.M)
    assert [int(s) for s, _, _ in rows] == [0, 1, 2], out
    return [(float(loss), float(norm)) for _, loss, norm in rows]


def test_1f1b_on_4_gloo_processes_prints_one_devices_losses_and_ok() -> None:
    proc = torchrun_example("train_pipeline.py", 4)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "pipeline 1f1b on Mesh({'pp': 2, 'dp': 1, 'tp': 2}), 4 micro-batches" in out, out
    found = DIFFS.search(out)
    assert found and found.group(4) == "OK", out
    assert all(float(d) <= 1e-9 for d in found.groups()[:3]), out
    printed = _printed(out)
    # the printed values are the one-device run's, to the 10 digits printed
    for (loss, norm), (ref_loss, ref_norm) in zip(printed, _one_device()):
        assert abs(loss - ref_loss) <= 1e-9 and abs(norm - ref_norm) <= 1e-9, (printed, out)
    assert printed[0] != printed[1]  # it stepped: another batch, other weights
    assert out.count(": OK") == 1  # rank 0 alone reports
    # docs/pipeline.md shows this run's output
    doc = (ROOT / "docs" / "pipeline.md").read_text()
    for line in out.splitlines():
        if line.startswith("step "):
            assert f"\n{line}\n" in doc, f"docs/pipeline.md does not show {line!r}"


def test_interleaved_run_matches_and_a_difference_above_the_tolerance_exits_1() -> None:
    """Interleaved 1F1B (two stages per rank, four stages) agrees with one device, and with a
    tolerance no float run meets (1e-300) the same run prints MISMATCH and exits 1."""
    proc = forked_example(  # torchrun's environment per rank, forked (the run above: torchrun)
        "train_pipeline.py", 4, "--schedule", "interleaved_1f1b", "--tol", "1e-300"
    )
    out = proc.stdout
    assert proc.returncode != 0, out
    found = DIFFS.search(out)
    assert found and found.group(4) == "MISMATCH", out + proc.stderr[-3000:]
    assert all(float(d) <= 1e-9 for d in found.groups()[:3]), out
    for (loss, norm), (ref_loss, ref_norm) in zip(_printed(out), _one_device()):
        assert abs(loss - ref_loss) <= 1e-9 and abs(norm - ref_norm) <= 1e-9, out


def test_without_torchrun_it_says_how_to_launch_it() -> None:
    proc = run_example_without_torchrun("train_pipeline.py")
    assert proc.returncode == 1 and "launch it with torchrun --standalone" in proc.stderr, proc
