"""examples/serve.py under torchrun on 2 and 4 gloo processes: every request's tokens, streamed
step by step by rank 0, are the unmodified model's greedy ``generate`` on one device (computed
here, in this process); the scheduler batched continuously (requests joined a running batch,
waited for a free slot, left at different steps, never more than ``--max-running`` at once);
a stop token ends requests early."""

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
STEP = re.compile(r"^step +(\d+)  prefill ([r\d ]+|-) +decode ([r\d ]+|-) +-> ([r\d: ]+)", re.M)
SERVED = re.compile(r"^r(\d+): prompt (\[[\d, ]*\]) -> (\[[\d, ]*\])$", re.M)


@functools.cache
def _example() -> Any:
    return load_example("serve.py", "serve_example")


@functools.cache
def _one_device(family: str, eos: int | None) -> dict[int, tuple[list[int], list[int]]]:
    """request id -> (prompt, the new tokens of one device's greedy generate)."""
    ex = _example()
    model = ex.build_model(family, eos)
    out = {}
    for req in ex.make_requests():
        prompt = torch.tensor([req.prompt])  # (1, P)
        ids = model.generate(prompt, max_new_tokens=req.max_new_tokens, do_sample=False)
        out[req.rid] = (req.prompt, ids[0, prompt.shape[1] :].tolist())
    return out


def _names(field: str) -> list[int]:
    return [] if field.strip() == "-" else [int(r[1:]) for r in field.split()]


def _check_run(out: str, want: dict[int, tuple[list[int], list[int]]], most: int) -> None:
    """The served tokens are ``want``'s, the stream adds up to them, and the batching was
    continuous."""
    served = {int(r): (ast.literal_eval(p), ast.literal_eval(t)) for r, p, t in SERVED.findall(out)}
    assert served == want, out
    assert "every request equal to one device's greedy generate: OK" in out, out
    steps = [
        (
            int(s),
            _names(pre),
            _names(dec),
            [tuple(map(int, t[1:].split(":"))) for t in toks.split()],
        )
        for s, pre, dec, toks in STEP.findall(out)
    ]
    streamed: dict[int, list[int]] = {}
    for _, _, _, tokens in steps:
        for rid, token in tokens:
            streamed.setdefault(rid, []).append(token)
    assert streamed == {rid: tokens for rid, (_, tokens) in want.items()}, out
    arrival = {req.rid: req.arrival for req in _example().make_requests()}
    joined = {rid: s for s, pre, _, _ in steps for rid in pre}
    assert sorted(joined) == sorted(want), out  # every request prefilled once
    assert all(joined[rid] >= arrival[rid] for rid in joined), out  # never before it arrived
    assert any(joined[rid] > arrival[rid] for rid in joined), out  # one waited for a slot
    assert any(pre and dec for _, pre, dec, _ in steps), out  # one joined a running batch
    assert max(len(pre) + len(dec) for _, pre, dec, _ in steps) == most, out
    last = {rid: s for s, pre, dec, _ in steps for rid in pre + dec}
    assert len(set(last.values())) >= 3, out  # requests left at different steps


def test_serving_on_2_gloo_processes_equals_one_device() -> None:
    proc = torchrun_example("serve.py", 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "serving 6 requests with llama on Mesh({'dp': 1, 'tp': 2}), at most 3" in proc.stdout
    _check_run(proc.stdout, _one_device("llama", None), most=3)
    # docs/inference.md shows this run's output
    doc = (ROOT / "docs" / "inference.md").read_text()
    for line in proc.stdout.splitlines():
        if line.startswith(("serving ", "step ", "r0: ", "every request")):
            assert f"\n{line}\n" in doc, f"docs/inference.md does not show {line!r}"


def test_serving_qwen3_on_4_gloo_processes_with_a_stop_token() -> None:
    """tp=4 (each rank one of the two kv heads), two running at most, and a stop token: a token
    one device generates second for request 4 ends that request (and any other reaching it)."""
    free = _one_device("qwen3", None)
    eos = free[4][1][1]
    want = _one_device("qwen3", eos)
    assert want[4][1] == free[4][1][:2]  # the stop token ends request 4 early
    proc = forked_example(  # torchrun's environment per rank, forked (the 2-rank run: torchrun)
        "serve.py", 4, "--family", "qwen3", "--max-running", "2", "--eos", str(eos)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_run(proc.stdout, want, most=2)


def test_without_torchrun_it_says_how_to_launch_it() -> None:
    proc = run_example_without_torchrun("serve.py")
    assert proc.returncode == 1 and "launch it with torchrun --standalone" in proc.stderr, proc
