"""GPU check and benchmark of the ctypes NCCL communicator (issue 8 GPU tests, issue 11 section 4).

    python benchmarks/native_gpu.py [--library /path/libnccl.so.2] [--iters 200]

On a one-GPU world it runs every op of :class:`fastdist.comm.native.NativeCommunicator` through the
real NCCL, eagerly and inside ``torch.cuda.graph`` capture set up by ``fastdist.comm.graph_capture``
(then replayed with new inputs), and
checks the values; then it times small all-reduces: ctypes NCCL eager, torch's NCCL process
group eager, and ctypes NCCL replayed from a CUDA graph, printed as ratios to torch's time.
Not part of CI (needs a GPU); exits 0 with "SKIPPED" where there is none, 1 on a wrong value.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import fastdist


def _check(name: str, got: torch.Tensor, want: torch.Tensor, failures: list[str]) -> None:
    ok = got.shape == want.shape and torch.equal(got.float().cpu(), want.float().cpu())
    print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    if not ok:
        failures.append(name)


def run_ops(comm: object, dev: torch.device, failures: list[str]) -> None:
    from fastdist.comm.native import NativeCommunicator

    assert isinstance(comm, NativeCommunicator)
    x = torch.arange(24.0, device=dev).reshape(6, 4)
    for red in ("sum", "max", "min", "avg", "prod"):
        _check(f"all_reduce {red}", comm.all_reduce("psum", x, red), x, failures)
    for dt in (torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.float64):
        _check(f"all_reduce sum {dt}", comm.all_reduce("psum", x.to(dt), "sum"), x.to(dt), failures)
    _check("all_gather", comm.all_gather_rows("all_gather", x), x, failures)
    _check("reduce_scatter", comm.reduce_scatter_rows("psum_scatter", x), x, failures)
    _check("broadcast", comm.broadcast("broadcast", x, 0), x, failures)
    _check("all_to_all", comm.all_to_all_rows("all_to_all", x, [6], [6]), x, failures)
    _check("all_gather_v", comm.all_gather_v_rows("all_gather_v", x, [4]), x[:4], failures)
    _check(
        "reduce_scatter_v",
        comm.reduce_scatter_v_rows("reduce_scatter_v", x[:5], [5]),
        x[:5],
        failures,
    )
    f8 = x.to(torch.float8_e4m3fn)
    _check("all_gather fp8 (as uint8)", comm.all_gather_rows("all_gather", f8), f8, failures)
    _check(
        "all_to_all int16 (as bytes)",
        comm.all_to_all_rows("all_to_all", x.to(torch.int16), [6], [6]),
        x.to(torch.int16),
        failures,
    )


def run_graph(comm: object, mesh: fastdist.Mesh, dev: torch.device, failures: list[str]) -> None:
    from fastdist.comm.native import NativeCommunicator

    assert isinstance(comm, NativeCommunicator)
    static = torch.zeros(6, 4, device=dev)
    g = torch.cuda.CUDAGraph()
    # graph_capture: the mesh's groups exist before capture, and the block runs on a side stream
    # that waits for the current one (capture cannot run on the default stream)
    with fastdist.comm.graph_capture(mesh, device=dev) as ctx:
        comm.all_reduce("psum", static, "sum")  # warm up on the capture stream
        with torch.cuda.graph(g, stream=ctx.stream):
            outs = {
                "psum": comm.all_reduce("psum", static, "sum"),
                "all_gather": comm.all_gather_rows("all_gather", static),
                "reduce_scatter": comm.reduce_scatter_rows("psum_scatter", static),
                "broadcast": comm.broadcast("broadcast", static, 0),
                "all_to_all": comm.all_to_all_rows("all_to_all", static, [6], [6]),
                "all_gather_v": comm.all_gather_v_rows("all_gather_v", static, [3])[:3],
            }
    for trial in range(3):
        new = torch.randn(6, 4, device=dev).round()
        static.copy_(new)
        g.replay()
        torch.cuda.synchronize(dev)
        for name, out in outs.items():
            want = new[:3] if name == "all_gather_v" else new
            _check(f"graph replay {trial}: {name}", out, want, failures)


def bench(comm: object, mesh: fastdist.Mesh, dev: torch.device, iters: int) -> None:
    import torch.distributed as dist

    from fastdist.comm.native import NativeCommunicator

    assert isinstance(comm, NativeCommunicator)
    x = torch.ones(1, device=dev)

    def timed(fn: object) -> float:
        for _ in range(10):
            fn()  # type: ignore[operator]
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()  # type: ignore[operator]
        torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) / iters * 1e6

    t_torch = timed(lambda: dist.all_reduce(x))
    t_native = timed(lambda: comm.all_reduce("psum", x, "sum"))
    g = torch.cuda.CUDAGraph()
    k = 32
    with fastdist.comm.graph_capture(mesh, device=dev) as ctx:
        comm.all_reduce("psum", x, "sum")  # warm up on the capture stream
        with torch.cuda.graph(g, stream=ctx.stream):
            for _ in range(k):
                comm.all_reduce("psum", x, "sum")
    t_graph = timed(g.replay) / k
    print(
        f"\n4-byte all-reduce, one GPU, {iters} iterations (us per call; ratio to torch NCCL eager)"
    )
    print(f"  torch NCCL process group, eager : {t_torch:8.1f}  1.00")
    print(f"  fastdist ctypes NCCL, eager     : {t_native:8.1f}  {t_native / t_torch:.2f}")
    print(f"  fastdist ctypes NCCL, CUDA graph: {t_graph:8.1f}  {t_graph / t_torch:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--library", help="the NCCL shared object (default: discovered)")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA device")
        return 0
    import torch.distributed as dist

    from fastdist.comm.native import NativeCommunicator, load_library
    from fastdist.testing import _free_port

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        device_id=dev,
    )
    lib = load_library("nccl", args.library)
    print(f"{lib!r}; unbound: {lib.unbound or 'none'}")
    comm = NativeCommunicator.create(
        lib,
        n=1,
        index=0,
        exchange=lambda b: b if b is not None else b"",
        device=dev,
        label="tp",
        rank=0,
    )
    # what graph_capture prepares (groups; a one-rank axis needs none) and runs on its side stream
    mesh = fastdist.connect(tp=1)
    failures: list[str] = []
    print("eager ops:")
    run_ops(comm, dev, failures)
    print("inside torch.cuda.graph (fastdist.comm.graph_capture's stream):")
    run_graph(comm, mesh, dev, failures)
    bench(comm, mesh, dev, args.iters)
    print("closed within 5 s:", comm.close(timeout=5.0))
    dist.destroy_process_group()
    print("FAILED: " + ", ".join(failures) if failures else "\nall values OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
