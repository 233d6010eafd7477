"""Benchmarks are measured, never asserted on time; this smoke run only checks they run and report
ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run_quick(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<script> --quick <args>`` in a subprocess; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_benchmark_suite_smoke_run(tmp_path: Path) -> None:
    _run_quick("run.py", "--out", str(tmp_path))
    res = json.loads((tmp_path / "results.json").read_text())
    assert {r["op"] for r in res["overhead"]} == {
        "psum",
        "all_gather",
        "psum_scatter",
        "all_to_all",
        "ppermute",
    }
    assert all(
        r["ratio_vs_c10d"] > 0
        and r["busbw_GBps"] >= 0
        and r["own_fastdist_us"] > 0
        and r["ratio_from_own_work"] > 0
        for r in res["overhead"]
    )
    small = [r for r in res["overhead"] if r["bytes"] == res["overhead"][0]["bytes"]]
    # the cold rows
    assert all(r["fastdist_us_cold"] > 0 and r["outside_fastdist_us"] > 0 for r in small)
    assert {
        r["op"]
        for r in small
        if r.get("grad_forward_fastdist_us", 0) > 0
        and r.get("grad_forward_backward_torch_us", 0) > 0
    } == {"psum", "all_to_all"}  # with autograd
    # 12 with the optional JAX rows
    assert (
        res["sim"][1]["ratio"] > 0 and res["mesh"][0]["world"] == 64 and len(res["sim"]) in (9, 12)
    )
    assert "spmd, torch.compile" in res["sim"][-1]["case"] and res["sim"][-1]["ratio"] > 0
    assert res["groups"][0]["world"] == 4 and res["groups"][0]["fastdist_ms"] > 0
    assert (
        (tmp_path / "overhead.png").stat().st_size > 1000
        and "| psum |" in (tmp_path / "results.md").read_text()
        and "With autograd" in (tmp_path / "results.md").read_text()
    )


def test_hf_models_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/hf_models.py --quick: every family of its table (Llama eager and compiled,
    Gemma 2, Qwen3-MoE, Mixtral at ep 4) checked against one device, then timed."""
    _run_quick("hf_models.py", "--out", str(tmp_path))
    res = json.loads((tmp_path / "hf_models.json").read_text())
    assert [r["case"] for r in res["rows"]] == [
        "HF Llama fwd+bwd, eager",
        "HF Llama fwd+bwd, compiled",
        "HF Gemma 2 fwd+bwd, eager",
        "HF Qwen3-MoE fwd+bwd, eager",
        "HF Mixtral fwd+bwd, eager",
    ]
    assert all(r["ratio"] > 0 and r["one_device_ms"] > 0 for r in res["rows"])
    assert res["rows"][-1]["mesh"] == {"ep": 4} and len(res["loadavg"]) == 2
    md = (tmp_path / "hf_models.md").read_text()
    assert "| HF Gemma 2 fwd+bwd, eager |" in md and "load average" in md


def test_moe_benchmark_smoke_run(tmp_path: Path) -> None:
    _run_quick("moe.py", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "moe.json").read_text())
    assert (
        len(rows) == 3
        and "allgather" in rows[0]["case"]
        and all("all_to_all" in r["case"] for r in rows[1:])
    )
    assert all(r["ratio"] > 0 and r["one_device_ms"] > 0 for r in rows)


def test_profile_check_smoke_run() -> None:
    """benchmarks/profile_check.py --quick: predicted and measured gloo times for three layouts (the
    quick sizes are latency-bound, so only the full run's ranking is compared in
    benchmarks/README.md)."""
    proc = _run_quick("profile_check.py")
    for layout in ("| tp4 |", "| dp2 x tp2 |", "| dp4 |"):
        assert layout in proc.stdout
    assert "ranking predicted:" in proc.stdout and "ranking measured:" in proc.stdout


def test_mq_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/mq.py --quick: fastdist.serving.MessageQueue vs broadcast_object over gloo on 4
    processes, ratios reported."""
    proc = _run_quick("mq.py", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "mq.json").read_text())
    assert [r["case"] for r in rows] == ["stream", "rtt"] and all(
        r["ratio"] > 0 and r["mq_us"] > 0 and r["gloo_us"] > 0 for r in rows
    )
    assert "| gloo / mq |" in proc.stdout and "Traceback" not in proc.stderr


def test_train_dp_benchmark_smoke_run(tmp_path: Path) -> None:
    _run_quick("train_dp.py", "--out", str(tmp_path))
    res = json.loads((tmp_path / "train_dp.json").read_text())
    assert res["after_ms"] > 0 and res["overlapped_ms"] > 0 and res["ratio"] > 0
    # ZeRO-1 over dp=4: a quarter of AdamW's state (the flat vector is padded to a multiple of 4)
    assert res["adamw_state_per_rank"] / 4 <= res["zero_state_per_rank"]
    assert res["zero_state_per_rank"] <= res["adamw_state_per_rank"] / 4 + 8


def test_tp_vs_dtensor_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/tp_vs_dtensor.py --quick: fastdist TP vs DTensor's parallelize_module on an HF
    Llama over 2 gloo processes; the run itself checks both against one device before timing."""
    proc = _run_quick("tp_vs_dtensor.py", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "tp_vs_dtensor.json").read_text())
    assert len(rows) == 7 and sum("AdamW" in r["case"] for r in rows) == 3
    assert sum("loss_parallel" in r["case"] for r in rows) == 2  # DTensor's vocabulary split
    assert all(
        r["ratio"] > 0
        and r["fastdist_ms"] > 0
        and r["dtensor_ms"] > 0
        and r["fastdist_diff"] < 1e-4
        and r["dtensor_diff"] < 1e-4
        for r in rows
    )
    assert "| fastdist / DTensor |" in proc.stdout and "Traceback" not in proc.stderr


def test_checkpoint_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/checkpoint.py --quick: DCP save/load against safetensors save/load on 2 gloo
    processes; every row timed, the ratios and per-rank peaks reported."""
    proc = _run_quick("checkpoint.py", "--out", str(tmp_path))
    res = json.loads((tmp_path / "checkpoint.json").read_text())
    assert len(res["rows"]) == 5 and res["world"] == 2
    assert all(r["s"] > 0 and len(r["peak_mb_per_rank"]) == 2 for r in res["rows"])
    assert [r["case"] for r in res["rows"] if r.get("time_ratio", 0) > 0] == [
        "save: fastdist.checkpoint.save (DCP)",
        "load: fastdist.checkpoint.load (DCP)",
    ]
    assert "| save: fastdist.checkpoint.save (DCP) |" in proc.stdout


def test_pipeline_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/pipeline.py --quick: torch.distributed.pipelining and fastdist's pipeline on the
    same gloo processes, same model, stages, schedule and batch; the script asserts both losses
    equal one device and the two sides' gradients equal each other (1e-9). ``--profile``: where
    fastdist's step went on each rank (the parts add up to the step's wall time)."""
    proc = _run_quick("pipeline.py", "--out", str(tmp_path), "--profile")
    main_table = proc.stdout.split("\n\n")[0]  # the profile's table follows a blank line
    rows = [line for line in main_table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 4, proc.stdout  # header + one row per case
    assert "fastdist's step per rank, ms" in proc.stdout
    assert "not built yet" not in proc.stdout
    table = json.loads((tmp_path / "pipeline.json").read_text())
    assert [(r["schedule"], r["pp"], r["m"]) for r in table] == [
        ("gpipe", 2, 4),
        ("1f1b", 2, 4),
        ("interleaved_1f1b (v=2)", 2, 4),
        ("1f1b", 4, 4),
    ]
    for r in table:
        assert r["fastdist"] is not None and r["ratio"] > 0
        assert 0 <= r["bubble_theory"] < 1 and r["torch"]["bubble_max"] < 1
        for parts in r["fastdist"]["parts"]:  # one per rank, ms
            assert parts["compute"] > 0 and parts["recv"] >= 0 and parts["send"] >= 0
            assert parts["compute"] + parts["recv"] + parts["send"] <= parts["wall"]


def test_meta_memory_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/meta_memory.py --quick: a tiny Llama on 2 gloo processes, built whole and on the
    meta device (load, init_weights); per-rank peaks and ratios reported, the losses agree."""
    proc = _run_quick("meta_memory.py", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "meta_memory.json").read_text())
    assert [r["variant"] for r in rows] == ["whole", "meta + load", "meta + init_weights"]
    assert all(len(r["peak_mb"]) == 2 and r["ideal_mb"] > 0 and r["whole_mb"] > 0 for r in rows)
    assert rows[0]["loss"] == rows[1]["loss"]  # the same checkpoint, both ways
    assert "| meta + load |" in proc.stdout and "Traceback" not in proc.stderr


def test_import_time_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/import_time.py --quick: its five smoke commands run and get a row against
    their baseline, with the ``-X importtime`` columns for fastdist.nn (the times are reported,
    not asserted; what each namespace imports is checked by tests/test_import_time.py)."""
    proc = _run_quick("import_time.py", "--out", str(tmp_path))
    times = json.loads((tmp_path / "import_time.json").read_text())
    assert {"import torch", "import fastdist", "python -m fastdist --help"} <= set(times)
    assert all(len(t) == 1 and t[0] > 0 for t in times.values())
    assert "fastdist.nn" in json.loads((tmp_path / "import_time_x.json").read_text())
    for row in ("`import fastdist` |", "`import fastdist.nn` |", "`python -m fastdist --help` |"):
        assert row in proc.stdout, proc.stdout


def test_planner_accuracy_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/planner_accuracy.py --quick: calibrate on 4 gloo processes, then a tiny Llama,
    a TP MLP and a tiny Mixtral over 5 layouts each: every layout predicted and measured
    (accuracy is reported, not asserted); the saved cost model loads."""
    from fastdist.profile import CostModel

    proc = _run_quick("planner_accuracy.py", "--out", str(tmp_path))
    res = json.loads((tmp_path / "planner_accuracy.json").read_text())
    dense = ["dp4", "tp4", "dp2 x tp2", "tp4 + sp", "dp2 x tp2 + sp"]
    moe = ["dp4", "ep4", "dp2 x ep2", "ep2 x tp2", "tp4"]
    assert [(r["model"], r["layout"]) for r in res["rows"]] == [
        *((m, lay) for m in ("HF Llama", "TP MLP") for lay in dense),
        *(("HF Mixtral (MoE)", lay) for lay in moe),
    ]
    assert all(
        r["predicted_ms"] > 0 and r["compute_ms"] > 0 and r["measured_ms"] > 0 and r["gflops"] > 0
        for r in res["rows"]
    )
    assert set(res["summary"]) == {"HF Llama", "TP MLP", "HF Mixtral (MoE)"}
    model = CostModel.load(tmp_path / "cost_model.json")
    assert model.flops > 0 and {f.n for f in model.fits} == {2, 4}
    assert "| dp2 x tp2 + sp |" in proc.stdout and "ranking agrees" in proc.stdout


def test_verify_cost_benchmark_smoke_run() -> None:
    """benchmarks/verify_cost.py --quick: parallelize, verify=True and 'auto' on a tiny Llama, each
    a row with a ratio to plain parallelize."""
    proc = _run_quick("verify_cost.py")
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| Llama")]
    assert len(rows) == 1, proc.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert float(cells[5]) > 1 and float(cells[7]) > 1, rows  # verify costs more than plain


def test_decode_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/decode.py --quick: a tiny Llama on 2 gloo processes against one device; the run
    itself checks the greedy tokens are one device's before timing; ratios and the load reported."""
    proc = _run_quick("decode.py", "--out", str(tmp_path))
    res = json.loads((tmp_path / "decode.json").read_text())
    assert [r["case"] for r in res["rows"]] == [
        "decode loop, batch 1",
        "HF generate, batch 1",
        "input check",
    ]
    assert all(r["tp"] == 2 and r["ratio"] > 0 and r["a_ms"] > 0 for r in res["rows"])
    assert 0 < res["rows"][0]["own_share"] < 1 and len(res["loadavg"]) == 2
    assert "| tp / one device |" in proc.stdout and "/proc/loadavg before" in proc.stdout
