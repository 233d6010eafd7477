"""examples/train.py, the whole run, against one device in float64: on a simulated mesh in this
process and under torchrun on 4 gloo processes; a mid-run checkpoint resumes at another tp and
continues exactly as the uninterrupted run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_distributed import ROOT, torchrun

pytest.importorskip("transformers")


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("train_example", ROOT / "examples" / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_simulated_run_equals_one_device_and_resumes_at_another_tp(tmp_path: Path) -> None:
    ex = _example()
    common = ["--simulate", "--dtype", "float64", "--check", "--steps", "10", "--accum", "2"]
    args = ex.parse([*common, "--dp", "2", "--tp", "2", "--sp"])
    args.ckpt_every, args.ckpt_dir = 5, str(tmp_path)
    whole = ex.train(args, ex.make_mesh(args))
    assert len(whole["losses"]) == 10
    assert whole["max_loss_diff"] <= 1e-9 and whole["max_weight_diff"] <= 1e-9
    assert whole["max_norm_diff"] <= 1e-9
    assert whole["losses"][-1] != whole["losses"][0]  # it trained
    # resume at tp=4, dp=1 (no sequence parallelism) from step 5
    args = ex.parse(
        [*common, "--dp", "1", "--tp", "4", "--no-sp", "--resume", f"{tmp_path}/step_5"]
    )
    resumed = ex.train(args, ex.make_mesh(args))
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(whole["losses"][5:]), rtol=1e-12, atol=1e-12
    )
    for name, value in whole["state"].items():
        torch.testing.assert_close(resumed["state"][name], value, rtol=1e-12, atol=1e-12)
    assert resumed["max_weight_diff"] <= 1e-9


def test_simulated_mixtral_experts_over_ep_equal_one_device() -> None:
    ex = _example()
    args = ex.parse(["--simulate", "--model", "mixtral", "--dp", "2", "--tp", "2", "--steps", "3"])
    args.dtype, args.check, args.sp = "float64", True, False
    out = ex.train(args, ex.make_mesh(args))
    assert max(out["max_loss_diff"], out["max_norm_diff"], out["max_weight_diff"]) <= 1e-9


def test_main_refuses_a_batch_that_does_not_split() -> None:
    ex = _example()
    with pytest.raises(SystemExit, match="must divide by dp x accum = 4"):
        ex.main(["--simulate", "--dp", "2", "--tp", "1", "--batch", "6", "--steps", "1"])


def _last_step(out: str) -> str:
    return [line for line in out.splitlines() if line.startswith("step ")][-1]


def test_torchrun_4_and_8_gloo_processes_resume_at_other_layouts(tmp_path: Path) -> None:
    """tp2 x dp2 (sp, fastdist's reducer) for 10 steps against one device, checkpoints at 5 and
    10; from step 5, tp4 x dp1 with DDP and tp2 x dp4 with FSDP2 on 8 processes each end where
    the uninterrupted run ended (and match one device resumed from the same checkpoint)."""
    ckpt = str(tmp_path)
    run = ["--steps", "10", "--dtype", "float64", "--check"]
    out = torchrun("train.py", 4, "--tp", "2", *run, "--ckpt-every", "5", "--ckpt-dir", ckpt)
    assert "train on Mesh({'dp': 2, 'tp': 2})" in out and ": OK" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_5"]
    # every rank wrote its own slices
    assert len(list((tmp_path / "step_5").glob("*.distcp"))) == 4
    end = _last_step(out)
    resume = ["--resume", f"{ckpt}/step_5"]
    out = torchrun("train.py", 4, "--tp", "4", "--engine", "ddp", *run, *resume)
    assert "train on Mesh({'dp': 1, 'tp': 4})" in out and ": OK" in out, out
    assert _last_step(out) == end
    out = torchrun("train.py", 8, "--tp", "2", "--engine", "fsdp", *run, *resume)
    assert "train on Mesh({'dp': 4, 'tp': 2})" in out and ": OK" in out, out
    assert _last_step(out) == end
