"""Peak resident memory per rank: a Llama made tensor-parallel from a whole model (today's way) vs
built on the meta device and materialised shard by shard, on 4 gloo processes (tp=4).

    python benchmarks/meta_memory.py            # a ~250 MB float32 Llama, about 1-2 minutes
    python benchmarks/meta_memory.py --quick    # a tiny Llama on 2 processes (the smoke test)

Variants, each on fresh processes (``--quick``: one after another in the same processes, the peak
reset in between; its numbers are not meaningful):

* ``whole``: ``LlamaForCausalLM(config)`` on every rank (random init), ``parallelize``, then
  ``fd.checkpoint.load(save_pretrained dir, pm)``: every rank holds the whole model for a while;
* ``meta + load``: built under ``torch.device("meta")``, ``parallelize`` (meta shards),
  ``fd.checkpoint.load(dir, pm)``: each rank allocates and reads only its shards;
* ``meta + init_weights``: built on meta, ``fd.nn.init_weights(pm, seed=0)``: each module's whole
  tensors exist only while its init runs.

Each rank reports the increase of its peak resident set (``VmHWM`` in ``/proc/self/status``, reset
through ``/proc/self/clear_refs`` after the imports and the process group, so the increase is the
variant's alone) against the whole model's parameter bytes and against the ideal: the bytes of
this rank's own parameters (its shards plus the replicated norms). The resident set counts the
pages of the checkpoint file a rank has mapped and touched (safetensors reads through ``mmap``;
a column split touches every page of its tensor): those are page cache, shared by the ranks of a
host and dropped under memory pressure, not each rank's own memory. So the peak of ``RssAnon``
(the process's own memory) is reported too, sampled every millisecond by a thread (a lower bound).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastdist as fd

VARIANTS = ("whole", "meta + load", "meta + init_weights")


def _config(quick: bool) -> Any:
    import transformers

    if quick:
        return transformers.LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
    # 62.3 M parameters, 249 MB in float32: 16k vocabulary (embedding and head untied), 6 layers
    return transformers.LlamaConfig(
        vocab_size=16000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=6,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )


def _status(key: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmHWM: the peak resident set; VmRSS: now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak() -> int:
    """Reset the peak resident set to the current one (Linux: clear_refs 5); returns it."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmHWM")


class _AnonPeak:
    """The peak of ``RssAnon`` (memory of the process's own, not page cache), sampled every
    millisecond by a thread: the kernel keeps no peak of it. Short spikes between samples are
    missed, so this is a lower bound."""

    def __init__(self) -> None:
        self.start = self.peak = _status("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _status("RssAnon"))

    def stop(self) -> int:
        """The increase of the sampled peak over the start."""
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status("RssAnon"))
        return self.peak - self.start


def _variant(name: str, ckpt: str, quick: bool, mesh: fd.Mesh) -> dict[str, Any]:
    import transformers

    cfg = _config(quick)
    start = _reset_peak()
    anon = _AnonPeak()
    if name == "whole":
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
    model.eval()
    pm = fd.nn.parallelize(
        model, mesh, fd.nn.plans.plan(model, family="llama", sequence_parallel=True)
    )
    if name == "meta + init_weights":
        fd.nn.init_weights(pm, seed=0)
    else:
        fd.checkpoint.load(ckpt, pm)
    peak = _status("VmHWM") - start
    anon_peak = anon.stop()
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    # the same batch on every variant: whole and meta + load must give the same loss
    ids = torch.arange(16).reshape(2, 8) % cfg.vocab_size
    with torch.no_grad():
        loss = float(pm(input_ids=ids, labels=ids).loss)
    del pm, model
    gc.collect()
    return {"peak": peak, "anon": anon_peak, "local": local, "loss": loss}


def _warm_up(mesh: fd.Mesh) -> None:
    """Import and run once what the variants use (transformers loads model code lazily), so their
    peaks count their own tensors only."""
    import safetensors.torch  # noqa: F401
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_config(True))
    pm = fd.nn.parallelize(
        model, mesh, fd.nn.plans.plan(model, family="llama", sequence_parallel=True)
    )
    fd.nn.init_weights(pm, seed=0)
    with torch.no_grad():
        pm(input_ids=torch.zeros(2, 8, dtype=torch.long))


def _worker(rank: int, store: str, ckpt: str, names: list[str], quick: bool, out: str) -> None:
    world = 2 if quick else 4
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    mesh = fd.connect(tp=world, timeout=300)
    torch.set_num_threads(1)
    _warm_up(mesh)
    res = {name: _variant(name, ckpt, quick, mesh) for name in names}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, res)
    if rank == 0:
        Path(out).write_text(json.dumps(every))
    dist.barrier()
    dist.destroy_process_group()
    # exit without the interpreter's teardown: torch's native gloo threads can abort in their
    # static destructors after everything is done (SIGABRT at exit, seen in CI)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(names: list[str], ckpt: str, quick: bool, tmp: str) -> list[dict[str, Any]]:
    out = os.path.join(tmp, "res.json")
    store = f"file://{tmp}/store-{len(os.listdir(tmp))}"
    mp.spawn(  # type: ignore[no-untyped-call]
        _worker, args=(store, ckpt, names, quick, out), nprocs=2 if quick else 4, join=True
    )
    every: list[dict[str, Any]] = json.loads(Path(out).read_text())
    return every


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="a tiny Llama on 2 processes")
    ap.add_argument("--out", type=Path, default=None, help="write meta_memory.json here")
    args = ap.parse_args(argv)
    import transformers

    cfg = _config(args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        torch.manual_seed(1)
        ref = transformers.LlamaForCausalLM(cfg)
        whole = sum(p.numel() * p.element_size() for p in ref.parameters())
        ref.save_pretrained(ckpt)
        del ref
        if args.quick:  # one set of processes, the peak reset between variants
            every = _run(list(VARIANTS), ckpt, True, tmp)
        else:  # fresh processes per variant
            runs = [_run([name], ckpt, False, tmp) for name in VARIANTS]
            every = [{k: v for r in runs for k, v in r[rank].items()} for rank in range(4)]
    world = len(every)
    rows = []
    for name in VARIANTS:
        peaks = [every[r][name]["peak"] for r in range(world)]
        anons = [every[r][name]["anon"] for r in range(world)]
        local = max(every[r][name]["local"] for r in range(world))
        rows.append(
            {
                "variant": name,
                "peak_mb": [p / 2**20 for p in peaks],
                "max_peak_mb": max(peaks) / 2**20,
                "anon_mb": [a / 2**20 for a in anons],
                "anon_vs_ideal": max(anons) / local,
                "whole_mb": whole / 2**20,
                "ideal_mb": local / 2**20,
                "vs_whole": max(peaks) / whole,
                "vs_ideal": max(peaks) / local,
                "loss": every[0][name]["loss"],
            }
        )
    print(
        f"Llama {whole / 2**20:.0f} MB float32 ({cfg.num_hidden_layers} layers, hidden "
        f"{cfg.hidden_size}, vocabulary {cfg.vocab_size}), tp={world} on {world} gloo processes, "
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores"
        + (" (quick: a smoke run, numbers not meaningful)" if args.quick else "")
    )
    print(
        "| variant | peak RSS increase per rank, MB | / whole model | / ideal (own shards) "
        "| sampled peak RssAnon increase, MB | RssAnon / ideal |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        per_rank = " / ".join(f"{p:.0f}" for p in r["peak_mb"])
        anon = " / ".join(f"{a:.0f}" for a in r["anon_mb"])
        print(
            f"| {r['variant']} | {per_rank} | {r['vs_whole']:.2f} | {r['vs_ideal']:.2f} | {anon} "
            f"| {r['anon_vs_ideal']:.2f} |"
        )
    print(
        f"whole model {rows[0]['whole_mb']:.1f} MB; ideal per rank (its own parameters) "
        f"{rows[0]['ideal_mb']:.1f} MB; ratios use the largest rank's increase"
    )
    if abs(rows[0]["loss"] - rows[1]["loss"]) > 1e-4 * abs(rows[0]["loss"]):
        print(f"MISMATCH: whole loss {rows[0]['loss']} vs meta + load {rows[1]['loss']}")
        return 1
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "meta_memory.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
