"""examples/speculative.py: greedy speculative decoding gives the target's greedy ``generate``.

On one device (fast): `speculate` with the unmodified models equals ``generate`` for several
proposal lengths, with the example's layer-skip draft (which gets proposals accepted) and with
an unrelated draft (which gets almost none). Under torchrun on 2 and 4 gloo processes (slow):
the target on ``tp=world`` and the draft on ``tp=1`` in one job; the tokens, and the tokens
accepted at each target step, are the one-device ``generate``'s (computed here)."""

from __future__ import annotations

import ast
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
STEP = re.compile(r"^target step +\d+: (\d+) of (\d+) proposals accepted -> (\[[\d, ]*\])$", re.M)
TOKENS = re.compile(r"^tokens: (\[[\d, ]*\])$", re.M)


@functools.cache
def _example() -> Any:
    return load_example("speculative.py", "speculative_example")


@functools.cache
def _one_device(new_tokens: int) -> list[int]:
    """The new tokens of the unmodified target's greedy ``generate`` after the example's prompt."""
    ex = _example()
    prompt = torch.tensor([ex.PROMPT])  # (1, P)
    ids = ex.build_target().generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    return list(ids[0, prompt.shape[1] :].tolist())


@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculate_on_one_device_equals_generate(k: int) -> None:
    ex = _example()
    target = ex.build_target()
    got = ex.speculate(target, ex.build_draft(target), ex.PROMPT, 17, k)
    assert got.tokens == _one_device(17)
    assert [t for _, added in got.steps for t in added] == got.tokens
    assert all(0 <= n <= k and len(added) <= n + 1 for n, added in got.steps)
    assert len(got.steps) < len(got.tokens)  # the draft got proposals accepted


def test_speculate_with_an_unrelated_draft_still_equals_generate() -> None:
    """A draft with other weights (seed 7) rarely agrees; the tokens are the target's anyway."""
    ex = _example()
    other = ex.build_target(seed=7, layers=1)
    got = ex.speculate(ex.build_target(), other, ex.PROMPT, 12, 3)
    assert got.tokens == _one_device(12)
    assert sum(n for n, _ in got.steps) < len(got.steps)  # few proposals accepted


@pytest.mark.parametrize(("world", "k", "new_tokens"), [(2, 4, 24), (4, 3, 20)])
def test_speculative_example_on_gloo_equals_one_device(world: int, k: int, new_tokens: int) -> None:
    """2 processes: the example's defaults (the run docs/inference.md shows); 4: other k."""
    # 2 processes under torchrun; 4 forked with torchrun's environment per rank (the suite's time)
    launch = torchrun_example if world == 2 else forked_example
    proc = launch("speculative.py", world, "--k", str(k), "--new-tokens", str(new_tokens))
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert (
        f"target on Mesh({{'dp': 1, 'tp': {world}}}), draft on Mesh({{'dp': {world}, 'tp': 1}})"
        in out
    ), out
    want = _one_device(new_tokens)
    assert TOKENS.findall(out) == [str(want)], out
    steps = [(int(n), int(kk), ast.literal_eval(added)) for n, kk, added in STEP.findall(out)]
    assert [t for _, _, added in steps for t in added] == want, out
    assert all(kk == k and len(added) <= n + 1 for n, kk, added in steps), out
    assert any(n > 0 for n, _, _ in steps), out  # proposals were accepted
    per_step = f"{len(want) / len(steps):.2f} tokens per target step"
    assert per_step in out and "generate on one device: OK" in out, out
    # the same steps as speculative decoding on one device
    ex = _example()
    target = ex.build_target()
    ref = ex.speculate(target, ex.build_draft(target), ex.PROMPT, new_tokens, k)
    assert [(n, added) for n, _, added in steps] == ref.steps, out
    if world == 2:  # docs/inference.md shows this run's output
        doc = (ROOT / "docs" / "inference.md").read_text()
        for line in out.splitlines():
            assert f"\n{line}\n" in doc, f"docs/inference.md does not show {line!r}"


def test_without_torchrun_it_says_how_to_launch_it() -> None:
    proc = run_example_without_torchrun("speculative.py")
    assert proc.returncode == 1 and "launch it with torchrun --standalone" in proc.stderr, proc
