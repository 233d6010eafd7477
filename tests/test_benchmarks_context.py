"""Smoke runs of the context-parallel side-by-side benchmarks (``--quick``): they run, check
themselves against one device and report ratios; no time is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run_quick(script: str, out: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "load average before" in proc.stdout
    return json.loads((out / script.replace(".py", ".json")).read_text())


def test_dit_vs_diffusers_smoke_run(tmp_path: Path) -> None:
    """fastdist (Ulysses, ring) and diffusers' enable_parallelism (Ulysses) on a tiny Wan over 2
    gloo processes: both equal one device in float64; diffusers' own ring is refused on a CPU."""
    res = _run_quick("dit_vs_diffusers.py", tmp_path)
    assert [r["case"].split(",")[0].split(" (")[0] for r in res["rows"]] == ["fwd+bwd"] * 3 + [
        "denoising step"
    ] * 2 + ["guided denoising step"] * 2
    assert all(
        r["ratio"] > 0 and r["fastdist_ms"] > 0 and r["diffusers_ms"] > 0 for r in res["rows"]
    )
    checks = res["checks"]["quick"]
    exact = [k for k in checks if "before all-reduce" not in k and "float32" not in k]
    assert len(exact) == 6 and all(checks[k] < 1e-6 for k in exact), checks
    # without the all-reduce each diffusers rank holds only its own tokens' gradient
    assert checks["diffusers grads before all-reduce"] > 1e-3, checks
    assert checks["denoised latents, fastdist vs diffusers (float32)"] < 1e-4, checks
    # classifier-free guidance: fastdist's cfg axis vs diffusers' two Ulysses forwards per step
    assert checks["guided latents, fastdist cfg vs diffusers (float32)"] < 1e-4, checks
    assert checks["guided latents, fastdist cfg vs diffusers batched (float32)"] < 1e-4, checks
    assert "return_lse" in res["diffusers_ring"]


def test_context_step_smoke_run(tmp_path: Path) -> None:
    """Megatron SP, CP ring and CP Ulysses on an HF Llama over 2 gloo processes: each checked
    against one device, timed, its saved activations measured; torch's context_parallel tried."""
    res = _run_quick("context_step.py", tmp_path)
    assert [r["layout"] for r in res["rows"]] == [
        "Megatron SP (tp=2)",
        "Megatron SP (tp=2), eager attention",
        "CP ring (cp=2)",
        "CP Ulysses (cp=2)",
    ]
    assert all(
        r["ms"] > 0 and r["ratio_vs_sp"] > 0 and r["loss_diff"] < 1e-4 and r["activation_mib"] > 0
        for r in res["rows"]
    )
    # torch's ring replaces only CUDA SDPA kernels: on a CPU it raises (or, one day, runs)
    assert res["torch_context_parallel"] == "runs" or "Error" in res["torch_context_parallel"]
