"""The context-parallel layout is traceable by ``torch.compile``: a `TokenSplit` built and read
inside a compiled function makes no graph break (its cached ``functools.cached_property`` did:
dynamo cannot enter its lock, and a break inside a model's hooks made dynamo run the enclosing
frames eagerly)."""

from __future__ import annotations

import torch

import fastdist as fd
from fastdist.nn.styles.ring_split import TokenSplit


def test_token_split_traced_without_a_graph_break() -> None:
    mesh = fd.Mesh({"cp": 2, "sp": 2})

    def rows(x: torch.Tensor) -> torch.Tensor:
        split = TokenSplit(mesh, ("cp", "sp"), x.shape[1])
        return x[:, : split.rows] * split.n + len(split.sizes) + int(split.even)

    x = torch.randn(2, 7, 3)
    torch._dynamo.reset()
    got = torch.compile(rows, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(got, x[:, :2] * 4 + 4 + 0, rtol=0, atol=0)
    eager = TokenSplit(mesh, ("cp", "sp"), 7)
    assert (eager.axis, eager.n, eager.sizes, eager.rows) == (("cp", "sp"), 4, (2, 2, 2, 1), 2)
    assert eager == TokenSplit(mesh, ("cp", "sp"), 7) and "n=" not in repr(eager)
