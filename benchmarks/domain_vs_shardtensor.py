"""fastdist's ``DomainParallel`` against physicsnemo's ``ShardTensor`` on the same conv net, split
over H on the same 2 gloo processes (issue 41.4).

    benchmarks/setup_physicsnemo_env.sh             # once: /tmp/pnvenv, fastdist + physicsnemo
    /tmp/pnvenv/bin/python benchmarks/domain_vs_shardtensor.py           # ~10 min on 2 cores
    /tmp/pnvenv/bin/python benchmarks/domain_vs_shardtensor.py --quick   # a smoke run

physicsnemo is not a dependency of this repository and is not installed in its ``.venv``:
``nvidia-physicsnemo`` requires ``torchvision``, whose PyPI wheel cannot load beside the CPU build
of torch 2.13.0 (``operator torchvision::nms does not exist``) and then breaks ``import
transformers``. The script runs in a separate environment (``setup_physicsnemo_env.sh``); no test
runs it.

The net: a 2-D conv stack ``Conv2d`` (3 x 3, zero padding) + ``GroupNorm`` + ``SiLU``,
``AvgPool2d(2)``, ``MaxPool2d(2)``, a bilinear ``Upsample(scale_factor=2)``, a
``ConvTranspose2d(2, stride=2)``, back to the input's channels: every layer ``ShardTensor`` 2.2.2
has a patch for. Both sides run an unmodified copy of it on the same field, H split in two blocks
over the 2 ranks:

- fastdist: ``fd.nn.parallelize(net, mesh, {"": fd.nn.DomainParallel({-2: "h"}, output="split")})``
  called with the whole field (the style cuts this rank's rows); the output is this rank's block.
- physicsnemo: the net called with ``ShardTensor.from_local(block, mesh, [Shard(2)])``; every
  weight is a plain tensor that ``ShardTensor`` promotes (``TensorPromotionMode.SILENT``, its
  default) and whose gradient it reduces over the mesh; the output's ``to_local()`` block.

Each rank's loss is the sum of its output block times its block of a fixed cotangent, so the
parameter gradients are the whole gradient on both sides. Rows:

- **float64 check**: the output blocks, the input gradient and every parameter gradient of both
  sides against one device (the whole field on one process) and against each other (max abs).
- **time per forward + backward** (float32, 1 thread per rank): after warm-up the two sides
  alternate step by step (A B, B A, ...), each step after a barrier; a step's wall time is its
  slowest rank's, its CPU time (``time.process_time``) the sum of both ranks' (a rank waiting in a
  collective or descheduled by other load adds to wall time only); each ratio is the median of
  the per-pair ratios fastdist / ShardTensor; the load average is printed before and after. The
  collectives of one step of each side are counted with the profiler.
- **memory per rank** (float32): the bytes saved for backward at the end of the forward (unique
  storages, ``ShardTensor`` unwrapped to its local tensor: the activations autograd holds) and the
  peak of the bytes allocated during forward + backward (the profiler's CPU allocation events
  summed in time order, relative to the step's start), each against one device's.

A last row runs physicsnemo's own 3-D ``UNet`` (``physicsnemo.models.unet``, a small config) on
both sides the same way (float64 check only).

Nothing here asserts a time. Results are written to ``--out`` (``domain_vs_shardtensor.json`` /
``.md``).
"""

from __future__ import annotations

import argparse
import copy
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import statistics
import sys
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import fastdist as fd
from fastdist.testing import run_on_gloo

HERE = Path(__file__).resolve().parent
WORLD = 2
F64 = torch.float64


class _Anything(type):
    """A placeholder class whose every attribute is another placeholder class."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torchvision`` and its submodules as empty modules of placeholder classes."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def attribute(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Anything(name, (), {})

        module.__getattr__ = attribute  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def import_physicsnemo() -> Any:
    """Import ``physicsnemo.domain_parallel`` and register its layer patches.

    physicsnemo imports ``physicsnemo.nn``, which imports ``timm``, which imports
    ``torchvision.ops.misc`` and ``torchvision.transforms`` at import time (for names the
    conv nets here never use). When no working torchvision is installed (the case beside the CPU
    torch 2.13.0), THIS SCRIPT ONLY serves ``torchvision`` as a stub of placeholder classes
    (``_TorchvisionStub``), in this process and its gloo ranks; nothing in ``fastdist`` does.
    ``register_custom_ops()`` is what physicsnemo runs at import time only when CUDA is available.
    """
    if importlib.util.find_spec("torchvision") is None:
        sys.meta_path.insert(0, _TorchvisionStub())
    warnings.filterwarnings("ignore", message=".*NVIDIA CUDA driver.*")
    import physicsnemo.domain_parallel as pdp

    pdp.register_custom_ops()
    return pdp


def conv_net(channels: int, width: int) -> nn.Sequential:
    """The 2-D conv stack both sides split: every layer one ``ShardTensor`` has a patch for."""
    w, c = width, channels
    return nn.Sequential(
        nn.Conv2d(c, w, 3, padding=1), nn.GroupNorm(4, w), nn.SiLU(),
        nn.AvgPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.GroupNorm(4, 2 * w), nn.SiLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.SiLU(),
        nn.Upsample(scale_factor=2, mode="bilinear"),
        nn.Conv2d(2 * w, w, 3, padding=1), nn.GroupNorm(4, w), nn.SiLU(),
        nn.ConvTranspose2d(w, w, 2, stride=2),
        nn.Conv2d(w, c, 3, padding=1),
    )  # fmt: skip


def physicsnemo_unet() -> nn.Module:
    """physicsnemo's 3-D U-Net (``Conv3d`` + ``GroupNorm``, ``MaxPool3d``, ``ConvTranspose3d``
    k3 s2 p1, skip connections) from a small config, without gradient checkpointing."""
    from physicsnemo.models.unet import UNet

    return UNet(
        in_channels=2,
        out_channels=2,
        model_depth=2,
        feature_map_channels=[4, 4, 8, 8],
        num_conv_blocks=2,
        gradient_checkpointing=False,
    )


def fastdist_on_fno() -> list[tuple[str, str]]:
    """fastdist's style on physicsnemo's 2-D FNO (simulated ranks, H over 2): what it says.

    Its spectral convolutions mix the whole domain (an FFT over H and W): the style must refuse
    them, and must not be talked into a wrong answer by a wrong ``local=`` declaration."""
    from physicsnemo.models.fno import FNO
    from physicsnemo.nn import SpectralConv2d
    from physicsnemo.nn.module.activations import Identity

    got = []
    wrong = (Identity, SpectralConv2d)  # the spectral convolution declared local: wrong
    for local, pad in (((), 2), ((Identity,), 2), (wrong, 2), (wrong, 0)):
        torch.manual_seed(0)
        fno = FNO(
            in_channels=2, out_channels=2, dimension=2, latent_channels=8, num_fno_layers=2,
            num_fno_modes=4, padding=pad, decoder_layers=1, decoder_layer_size=8,
        ).to(F64)  # fmt: skip
        ref = copy.deepcopy(fno)
        x = _field((1, 2, 16, 16), 1, F64)
        case = f"padding={pad}, local={tuple(c.__name__ for c in local)}"
        try:
            style = fd.nn.DomainParallel({-2: "h"}, local=local)
            pm = fd.nn.parallelize(fno, fd.Mesh({"h": 2}), {"": style})
            out = pm(x.expand(2, *x.shape))
        except fd.MeshError as e:  # ParallelizeError is a MeshError
            got.append((case, f"{type(e).__name__}: {str(e)[:160]}..."))
            continue
        got.append((case, f"ran: max diff vs one device {_diff(out[0], ref(x)):.1e}"))
    return got


# name: (batch, channels, H, W, width) of the timed field; the float64 check uses the same
SIZES = {
    "quick": (1, 4, 32, 16, 8),
    "64": (1, 4, 64, 64, 16),
    "128": (1, 4, 128, 128, 16),
    "256": (1, 4, 256, 256, 32),
}


def _field(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _net(make: Callable[[], nn.Module], dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return make().to(dtype)


class Sides:
    """The two domain-parallel forms of one model on this rank: H (dim -2) split over 2 ranks."""

    def __init__(self, one: nn.Module, pdp: Any, dmesh: Any, mesh: fd.Mesh, ndim: int) -> None:
        self.pdp, self.dmesh, self.dim, self.rank = pdp, dmesh, ndim - 2, dist.get_rank()
        self.st = copy.deepcopy(one)
        style = fd.nn.DomainParallel({-2: "h"}, output="split")
        self.fd_module = copy.deepcopy(one)  # its layers' forwards made domain-parallel in place
        self.fd = fd.nn.parallelize(self.fd_module, mesh, {"": style})

    def block(self, x: Tensor) -> Tensor:
        return x.chunk(WORLD, dim=self.dim)[self.rank]

    def run_fd(self, x: Tensor) -> Tensor:
        return self.fd(x)

    def run_st(self, x: Tensor) -> Tensor:
        from torch.distributed.tensor import Shard

        local = self.block(x)
        xs = self.pdp.ShardTensor.from_local(
            local, self.dmesh, [Shard(self.dim)], sharding_shapes="chunk", global_shape=x.shape
        )
        return self.st(xs).to_local()


def _grads(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def _check(sides: Sides, x: Tensor, cot: Tensor) -> dict[str, Any]:
    """Forward and backward of both sides in float64: this rank's output block, input gradient
    block and the parameter gradients of each."""
    got: dict[str, Any] = {}
    for name, run, module in (
        ("fd", sides.run_fd, sides.fd_module),
        ("st", sides.run_st, sides.st),
    ):
        xr = x.clone().requires_grad_()
        try:
            out = run(xr)
            (out * sides.block(cot)).sum().backward()
        except Exception as e:  # noqa: BLE001 (a side that refuses the model: its error is the row)
            got[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            dist.barrier()
            continue
        assert xr.grad is not None
        got[name] = {"out": out.detach(), "dx": sides.block(xr.grad), "grads": _grads(module)}
        module.zero_grad(set_to_none=True)
    return got


def _saved_bytes(step: Callable[[], Tensor]) -> int:
    """Bytes autograd saves for backward during ``step()`` (unique storages; a tensor subclass
    counted by its local tensor)."""
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        local = getattr(t, "_local_tensor", t)
        if local.device.type != "meta":
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    del out
    return sum(seen.values())


def _peak_bytes(step: Callable[[], None]) -> int:
    """The peak of the bytes allocated on the CPU during ``step()``, over its start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    now = peak = 0
    for _, d in deltas:
        now += d
        peak = max(peak, now)
    return peak


def _memory(sides: Sides, one: nn.Module, x: Tensor, cot: Tensor) -> dict[str, int]:
    """Saved-for-backward and peak bytes on this rank: each side, and one device (rank 0)."""
    runs = {"fd": (sides.run_fd, sides.fd_module), "st": (sides.run_st, sides.st)}
    got = {}
    for name, (run, module) in runs.items():
        got[f"{name}_saved"] = _saved_bytes(lambda run=run: run(x))

        def step(run: Callable[[Tensor], Tensor] = run) -> None:
            (run(x) * sides.block(cot)).sum().backward()

        got[f"{name}_peak"] = _peak_bytes(step)
        module.zero_grad(set_to_none=True)
    if sides.rank == 0:
        got["one_saved"] = _saved_bytes(lambda: one(x))

        def whole() -> None:
            (one(x) * cot).sum().backward()

        got["one_peak"] = _peak_bytes(whole)
        one.zero_grad(set_to_none=True)
    dist.barrier()
    return got


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    """Wall and CPU seconds of ``fn()`` on this rank (CPU: this process, gloo's threads too; a
    rank waiting in a collective, or descheduled by the machine's load, adds to wall only)."""
    dist.barrier()  # both ranks start together; a step's time is then its slowest rank's
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _collectives(step: Callable[[], None]) -> dict[str, int]:
    """The c10d collectives one ``step()`` calls on this rank, by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("c10d::"):
            counts[e.name] = counts.get(e.name, 0) + 1
    return counts


def _times(sides: Sides, x: Tensor, cot: Tensor, reps: int, warmup: int) -> dict[str, Any]:
    """This rank's step times (wall and CPU seconds): [fastdist, ShardTensor], alternating
    A B, B A, ...; and the collectives of one step of each."""

    def step(run: Callable[[Tensor], Tensor], module: nn.Module) -> Callable[[], None]:
        def go() -> None:
            (run(x) * sides.block(cot)).sum().backward()
            module.zero_grad(set_to_none=True)

        return go

    pair = (step(sides.run_fd, sides.fd_module), step(sides.run_st, sides.st))
    for _ in range(warmup):
        for f in pair:
            f()
    calls = [_collectives(f) for f in pair]
    got: list[list[tuple[float, float]]] = [[], []]
    for i in range(reps):
        for j in (0, 1) if i % 2 == 0 else (1, 0):  # neither side always first
            got[j].append(_timed(pair[j]))
    return {"steps": got, "collectives": calls}


def _rank(size: tuple[int, ...], reps: int, warmup: int) -> dict[str, Any]:
    """One rank: the float64 checks of the conv net and of physicsnemo's U-Net, then the float32
    memory and timing of the conv net."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    pdp = import_physicsnemo()
    dmesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("h",))
    mesh = fd.connect(h=WORLD, timeout=600)
    batch, channels, height, width, hidden = size
    shape = (batch, channels, height, width)
    result: dict[str, Any] = {}
    for name, make, field in (
        ("conv net", lambda: conv_net(channels, hidden), shape),
        ("physicsnemo UNet (3-D)", physicsnemo_unet, (1, 2, 8, 16, 8)),
    ):
        one = _net(make, F64)
        sides = Sides(one, pdp, dmesh, mesh, len(field))
        x, cot = _field(field, 1, F64), _field(field, 2, F64)
        result[name] = _check(sides, x, cot)
    one = _net(lambda: conv_net(channels, hidden), torch.float32)
    sides = Sides(one, pdp, dmesh, mesh, 4)
    x, cot = _field(shape, 1, torch.float32), _field(shape, 2, torch.float32)
    result["memory"] = _memory(sides, one, x, cot)
    result["times"] = _times(sides, x, cot, reps, warmup)
    dist.barrier()  # every collective done on both ranks before either tears down
    return result


def _diff(a: Tensor, b: Tensor) -> float:
    return (a - b).abs().max().item()


def _reference(make: Callable[[], nn.Module], field: tuple[int, ...]) -> dict[str, Any]:
    """One device, float64: the whole output, input gradient and parameter gradients."""
    one = _net(make, F64)
    x = _field(field, 1, F64).requires_grad_()
    out = one(x)
    (out * _field(field, 2, F64)).sum().backward()
    assert x.grad is not None
    return {"out": out.detach(), "dx": x.grad, "grads": _grads(one)}


def _compare(per_rank: list[dict[str, Any]], ref: dict[str, Any], dim: int) -> dict[str, Any]:
    """Max abs differences: each side against one device, and fastdist against ShardTensor."""
    row: dict[str, Any] = {}
    whole = {}
    for side in ("fd", "st"):
        errors = [r[side]["error"] for r in per_rank if "error" in r[side]]
        if errors:
            row[f"{side}_vs_one"] = errors[0]
            continue
        out = torch.cat([r[side]["out"] for r in per_rank], dim=dim)
        dx = torch.cat([r[side]["dx"] for r in per_rank], dim=dim)
        grads = [r[side]["grads"] for r in per_rank]
        whole[side] = (out, dx, grads)
        row[f"{side}_vs_one"] = max(
            _diff(out, ref["out"]),
            _diff(dx, ref["dx"]),
            *(_diff(g[n], v) for g in grads for n, v in ref["grads"].items()),
        )
    if len(whole) == 2:
        (o1, d1, g1), (o2, d2, g2) = whole["fd"], whole["st"]
        row["fd_vs_st"] = max(
            _diff(o1, o2),
            _diff(d1, d2),
            *(_diff(a[n], b[n]) for a, b in zip(g1, g2) for n in ref["grads"]),
        )
    return row


def bench(name: str, reps: int, warmup: int) -> dict[str, Any]:
    size = SIZES[name]
    batch, channels, height, width, hidden = size
    load_before = list(os.getloadavg())
    per_rank = run_on_gloo(_rank, WORLD, size, reps, warmup, timeout=3600)
    load_after = list(os.getloadavg())
    shape = (batch, channels, height, width)
    checks = {
        "conv net": _compare(
            [r["conv net"] for r in per_rank],
            _reference(lambda: conv_net(channels, hidden), shape),
            2,
        ),
        "physicsnemo UNet (3-D)": _compare(
            [r["physicsnemo UNet (3-D)"] for r in per_rank],
            _reference(physicsnemo_unet, (1, 2, 8, 16, 8)),
            3,
        ),
    }
    steps = [r["times"]["steps"] for r in per_rank]
    # a step's wall time is its slowest rank's; its CPU time the sum of both ranks'
    f, s = ([max(r[side][i][0] for r in steps) for i in range(reps)] for side in (0, 1))
    fc, sc = ([sum(r[side][i][1] for r in steps) for i in range(reps)] for side in (0, 1))
    mem = [r["memory"] for r in per_rank]
    return {
        "size": name,
        "field": f"{batch}x{channels}x{height}x{width}",
        "width": hidden,
        "load_before": load_before,
        "load_after": load_after,
        "checks": checks,
        "fastdist_ms": statistics.median(f) * 1e3,
        "shardtensor_ms": statistics.median(s) * 1e3,
        "ratio": statistics.median(a / b for a, b in zip(f, s)),
        "fastdist_cpu_ms": statistics.median(fc) * 1e3,
        "shardtensor_cpu_ms": statistics.median(sc) * 1e3,
        "cpu_ratio": statistics.median(a / b for a, b in zip(fc, sc)),
        "collectives": per_rank[0]["times"]["collectives"],
        "memory": {
            k: max(m[k] for m in mem) for k in ("fd_saved", "st_saved", "fd_peak", "st_peak")
        }
        | {"one_saved": mem[0]["one_saved"], "one_peak": mem[0]["one_peak"]},
    }


def _fmt(v: Any) -> str:
    return f"{v:.0e}" if isinstance(v, float) else str(v)


def _calls(counts: dict[str, int]) -> str:
    return " + ".join(
        f"{n} {k.removeprefix('c10d::').rstrip('_')}" for k, n in sorted(counts.items())
    )


def table(rows: list[dict[str, Any]]) -> str:
    mb = 2**20
    lines = [
        "| field (N x C x H x W), width | wall ms, fastdist / ShardTensor | ratio | "
        "CPU ms (both ranks), fastdist / ShardTensor | CPU ratio | "
        "collectives per step, fastdist / ShardTensor | load before -> after |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fc, sc = r["collectives"]
        lines.append(
            f"| {r['field']}, {r['width']} | {r['fastdist_ms']:.1f} / {r['shardtensor_ms']:.1f} | "
            f"{r['ratio']:.3f} | {r['fastdist_cpu_ms']:.1f} / {r['shardtensor_cpu_ms']:.1f} | "
            f"{r['cpu_ratio']:.3f} | {_calls(fc)} / {_calls(sc)} | "
            f"{r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f} |"
        )
    lines += [
        "",
        "| field, width | saved for backward per rank, MB (fastdist / ShardTensor / one device) | "
        "peak per rank, MB (fastdist / ShardTensor / one device) |",
        "|---|---|---|",
    ]
    for r in rows:
        m = r["memory"]
        lines.append(
            f"| {r['field']}, {r['width']} | {m['fd_saved'] / mb:.2f} / {m['st_saved'] / mb:.2f} / "
            f"{m['one_saved'] / mb:.2f} | {m['fd_peak'] / mb:.2f} / {m['st_peak'] / mb:.2f} / "
            f"{m['one_peak'] / mb:.2f} |"
        )
    lines += [
        "",
        "| field | model (float64) | fastdist vs one device | ShardTensor vs one device | "
        "fastdist vs ShardTensor |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        for model, c in r["checks"].items():
            lines.append(
                f"| {r['field']} | {model} | {_fmt(c['fd_vs_one'])} | {_fmt(c['st_vs_one'])} | "
                f"{_fmt(c.get('fd_vs_st', '-'))} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="a tiny field (a smoke run)")
    ap.add_argument("--sizes", nargs="*", default=["64", "128", "256"], choices=sorted(SIZES))
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    import_physicsnemo()  # fail here, before any rank starts, when it is not installed
    names, reps, warmup = (["quick"], 3, 1) if args.quick else (args.sizes, args.reps, 2)
    print(f"torch {torch.__version__}, load average before: {os.getloadavg()}", flush=True)
    rows = []
    for name in names:
        rows.append(bench(name, reps, warmup))
        print(table(rows[-1:]), flush=True)
    print(f"load average after: {os.getloadavg()}")
    fno = fastdist_on_fno()
    fno_lines = "\n".join(f"- fastdist on physicsnemo's FNO, {c}: {v}" for c, v in fno)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "domain_vs_shardtensor.json").write_text(json.dumps({"rows": rows, "fno": fno}))
    (args.out / "domain_vs_shardtensor.md").write_text(table(rows) + "\n" + fno_lines + "\n")
    print(table(rows))
    print(fno_lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
