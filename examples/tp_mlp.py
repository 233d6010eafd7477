"""Tensor-parallel MLP on real ranks:
``torchrun --standalone --nproc-per-node 4 examples/tp_mlp.py``.

The per-rank model code (fastdist.tools.demo.tp_mlp) is the same that `python -m fastdist demo`
runs on simulated ranks. Every rank checks its gradients against the unsharded MLP
computed locally; the script exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from einops import rearrange

import fastdist as fd
from fastdist.tools.demo import tp_mlp


def main() -> int:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    mesh = fd.connect(tp=2, timeout=60)  # dp = world size / 2
    rank, dp, tp = mesh.rank, mesh.shape["dp"], mesh.shape["tp"]
    d, t = mesh.coords(rank)["dp"], mesh.coords(rank)["tp"]

    g = torch.Generator().manual_seed(0)  # the same global tensors on every rank
    B, D, H = 4, 8, 4 * tp
    x, W1, b1, W2 = (
        torch.randn(*s, dtype=torch.float64, generator=g)
        for s in [(dp * B, D), (D, H), (H,), (H, D)]
    )

    # This rank's shards: batch over dp; W1 columns and W2 rows over tp.
    xl = rearrange(x, "(dp b) d -> dp b d", dp=dp)[d].clone().requires_grad_()
    w1 = rearrange(W1, "d (tp h) -> tp d h", tp=tp)[t].clone().requires_grad_()
    bl = rearrange(b1, "(tp h) -> tp h", tp=tp)[t].clone().requires_grad_()
    w2 = rearrange(W2, "(tp h) d -> tp h d", tp=tp)[t].clone().requires_grad_()
    loss = (tp_mlp(xl, w1, bl, w2, mesh) ** 2).sum()
    loss.backward()
    dW1 = fd.psum(w1.grad, mesh, "dp")  # data parallel: sum the replicas' gradients

    ref = [t_.clone().requires_grad_() for t_ in (x, W1, b1, W2)]
    ((torch.tanh(ref[0] @ ref[1] + ref[2]) @ ref[3]) ** 2).sum().backward()
    diff = max(
        (xl.grad - rearrange(ref[0].grad, "(dp b) d -> dp b d", dp=dp)[d]).abs().max().item(),
        (dW1 - rearrange(ref[1].grad, "d (tp h) -> tp d h", tp=tp)[t]).abs().max().item(),
    )
    worst = max(fd.comm.all_gather_object(diff, mesh))
    if rank == 0:
        print(
            f"tp_mlp on {mesh!r}: loss of dp replica 0 = {loss.item():.6f}, max grad diff over "
            f"ranks = {worst:.2e}"
        )
    fd.comm.barrier(mesh)
    fd.comm.close(mesh)  # its groups released now, not torn down at interpreter exit
    dist.destroy_process_group()
    return 0 if worst < 1e-10 else 1


if __name__ == "__main__":
    sys.exit(main())
