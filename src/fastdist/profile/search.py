"""The layout planner: :func:`layouts` enumerates the candidate layouts of a world size,
:func:`rank_layouts` profiles and predicts each, :class:`LayoutRanking` ranks them."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fastdist.core.mesh import Mesh
from fastdist.errors import ProfileError
from fastdist.profile._common import data_parallel_axes
from fastdist.profile.cost_model import CostModel
from fastdist.profile.network import NETWORKS, Network
from fastdist.profile.pipeline_cost import PipelineSpec
from fastdist.profile.prediction import MeshLayout, Prediction, predict
from fastdist.profile.records import Profile

__all__ = ["LayoutRanking", "layouts", "rank_layouts"]


def _factorizations(world: int, k: int) -> Iterator[tuple[int, ...]]:
    if k == 1:
        yield (world,)
        return
    for d in range(1, world + 1):
        if world % d == 0:
            for rest in _factorizations(world // d, k - 1):
                yield (d, *rest)


def layouts(
    world: int,
    axes: Sequence[str],
    *,
    max_size: Mapping[str, int] | None = None,
    orders: bool = True,
) -> list[MeshLayout]:
    """Every layout of ``world`` ranks over ``axes``: sizes multiplying to ``world`` (each at most
    ``max_size[axis]``), and with ``orders`` every order of the axes of size > 1 onto the ranks
    (which axes stay inside a node); otherwise the order given. Axes of size 1 are left out of
    the name and the order (they are the layout's ``unit`` axes: its mesh has them, with size 1).

    Args:
        world: the number of ranks.
        axes: the axis names.
        max_size: the largest size of each axis named (others: up to ``world``).
        orders: every order of the axes of size > 1 onto the ranks; ``False``: the order given.

    Returns:
        the layouts, as `MeshLayout` values.

    >>> [str(l) for l in layouts(4, ("dp", "tp"), orders=False)]
    ['tp4', 'dp2 x tp2', 'dp4']
    >>> len(layouts(8, ("dp", "tp")))   # tp8, dp8, and dp2 x tp4, dp4 x tp2 in both orders
    6
    """
    if world < 1 or not axes or len(set(axes)) != len(axes):
        raise ProfileError(
            "layouts",
            f"world={world!r}, axes={tuple(axes)!r}",
            "pass a positive world size and distinct axis names",
        )
    limit = dict(max_size or {})
    out: list[MeshLayout] = []
    seen: set[tuple[tuple[str, int], ...]] = set()
    for sizes in _factorizations(world, len(axes)):
        if any(s > limit.get(a, world) for a, s in zip(axes, sizes)):
            continue
        kept = [(a, s) for a, s in zip(axes, sizes) if s > 1] or [(axes[0], 1)]
        unit = tuple(a for a in axes if a not in dict(kept))
        for perm in itertools.permutations(kept) if orders else [tuple(kept)]:
            if perm not in seen:
                seen.add(perm)
                out.append(MeshLayout(tuple(perm), unit))
    return out


@dataclass(frozen=True)
class LayoutRanking:
    """Layouts ranked by predicted step time (fastest first; layouts over the memory budget
    after those that fit)."""

    network: Network | CostModel
    predictions: tuple[Prediction, ...]

    @property
    def best(self) -> Prediction:
        return self.predictions[0]

    def table(self) -> str:
        """One line per layout: predicted time, its share per axis, and (when compute or memory
        was charged) compute, exposed communication, memory per rank and whether it fits; with
        pipelined layouts, the bubble (idle share of the pipeline's timeline)."""
        axes = sorted({a for p in self.predictions for a in p.by_axis})
        extra = any(p.compute > 0 or p.memory is not None for p in self.predictions)
        piped = any(p.pipeline is not None for p in self.predictions)
        head = ["rank", "layout", "time (ms)", *(f"{a} (ms)" for a in axes)]
        if extra:
            head += ["compute (ms)", "exposed (ms)", "memory (MB)", "fits"]
        if piped:
            head += ["bubble"]
        body = [
            [
                str(i + 1),
                str(p.layout),
                f"{p.time * 1e3:.3f}",
                *(f"{p.by_axis.get(a, 0.0) * 1e3:.3f}" for a in axes),
                *(
                    [
                        f"{p.compute * 1e3:.3f}",
                        f"{p.exposed * 1e3:.3f}",
                        f"{p.memory.total / 1e6:.1f}" if p.memory is not None else "",
                        "yes" if p.fits else "no",
                    ]
                    if extra
                    else []
                ),
                *([f"{p.pipeline.bubble:.3f}" if p.pipeline else ""] if piped else []),
            ]
            for i, p in enumerate(self.predictions)
        ]
        widths = [max(len(c[i]) for c in [head, *body]) for i in range(len(head))]
        return f"network: {self.network.name}\n" + "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]
        )

    def plot(self, ax: Any = None) -> Any:
        """A horizontal stacked bar per layout (time per axis); returns the matplotlib Axes.

        Args:
            ax: the matplotlib ``Axes`` to draw on; default: a new figure.

        Returns:
            the matplotlib ``Axes``.
        """
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(7, 0.35 * len(self.predictions) + 1))
        labels = [str(p.layout) for p in self.predictions]
        left = [0.0] * len(labels)
        for a in sorted({a for p in self.predictions for a in p.by_axis}):
            w = [p.by_axis.get(a, 0.0) * 1e3 for p in self.predictions]
            ax.barh(labels, w, left=left, label=a)
            left = [x + y for x, y in zip(left, w)]
        ax.invert_yaxis()
        ax.set_xlabel(f"predicted communication time (ms), {self.network.name}")
        ax.legend()
        return ax

    def __str__(self) -> str:
        return self.table()


def rank_layouts(
    build: Callable[[Mesh], Profile],
    candidates: Iterable[MeshLayout] | int,
    network: Network | CostModel | str,
    *,
    axes: Sequence[str] = ("dp", "tp"),
    max_size: Mapping[str, int] | None = None,
    orders: bool = True,
    data_parallel: str | Sequence[str] | None = None,
    bucket_mb: float = 25.0,
    optimizer: str | float = "adamw",
    memory: float | None = None,
    pipeline: PipelineSpec | None = None,
) -> LayoutRanking:
    """Profile ``build(layout.mesh)`` for every candidate layout and rank them by :func:`predict`
    (layouts whose memory per rank passes ``memory`` last, marked ``fits=False``).

    Args:
        build: makes the step for a mesh and traces it (usually ``lambda mesh:
            trace(step_for(mesh), mesh, ...)``): the per-rank shapes depend on the layout (a batch
            split over ``dp``, weights over ``tp``), which only the step's author knows. The mesh
            has every axis of ``axes``, those of size 1 included, so the step may call its
            collectives whatever the layout.
        candidates: a list of :class:`MeshLayout` (e.g. from :func:`layouts`), or a world size: then
            ``layouts(candidates, axes, max_size=max_size, orders=orders)``.
        network: a :class:`Network`, the name of one in :data:`NETWORKS`, or a
            :class:`CostModel` from :func:`calibrate`.
        axes: the axis names, for a world size given as ``candidates`` (see :func:`layouts`).
        max_size: the largest size of each axis, for a world size given as ``candidates``.
        orders: every order of the axes onto the ranks, for a world size given as ``candidates``.
        data_parallel: as for :func:`predict`: the data axes whose gradient reduction
            DataParallel overlaps with backward.
        bucket_mb: as for :func:`predict`.
        optimizer: as for :func:`predict` (the optimizer state in the memory per rank).
        memory: a memory budget per rank (bytes), as for :func:`predict`.
        pipeline: how a layout whose ``pipeline.axis`` has size > 1 pipelines its step (a
            :class:`MeshLayout` given with its own ``pipeline`` keeps it); ``build`` then traces one
            micro-batch (its mesh has the pipeline axis, so it can tell). Put the axis among
            ``axes`` (e.g. ``axes=("pp", "dp", "tp")``, ``max_size={"pp": 4}``) to rank layouts
            with and without a pipeline together.

    >>> import torch, fastdist as fd
    >>> from fastdist.profile import trace
    >>> def build(mesh):   # a TP MLP (tokens 512, hidden 1024) with its dp gradient all-reduce
    ...     dp, tp = mesh.shape["dp"], mesh.shape["tp"]
    ...     def step(x, w):
    ...         fd.psum(fd.pvary(x, mesh, "tp") @ w @ w.T, mesh, "tp").sum().backward()
    ...         fd.psum(w.grad, mesh, "dp")
    ...     x = torch.empty(512 // dp, 1024, device="meta")
    ...     w = torch.empty(1024, 4096 // tp, device="meta", requires_grad=True)
    ...     return trace(step, mesh, x, w)
    >>> p = rank_layouts(build, 16, "dgx-h100", axes=("dp", "tp"), max_size={"tp": 8})
    >>> str(p.best.layout)   # the 16 MiB/tp gradient all-reduce over dp stays inside a node
    'tp2 x dp8'
    """
    if isinstance(network, str):
        if network not in NETWORKS:
            raise ProfileError(
                "rank_layouts",
                f"no network named {network!r}",
                f"use one of {', '.join(NETWORKS)}, or pass a Network",
            )
        network = NETWORKS[network]
    cands = (
        layouts(candidates, axes, max_size=max_size, orders=orders)
        if isinstance(candidates, int)
        else list(candidates)
    )
    if not cands:
        raise ProfileError(
            "rank_layouts",
            "no candidate layout",
            "pass a world size, layouts(world, axes) or a non-empty list of MeshLayout",
        )
    preds = []
    for layout in cands:
        if layout.pipeline is None and pipeline is not None:
            if layout.mesh.shape.get(pipeline.axis, 1) > 1:
                layout = replace(layout, pipeline=pipeline)
        prof = build(layout.mesh)
        if not isinstance(prof, Profile):
            raise ProfileError(
                "rank_layouts",
                f"build returned {type(prof).__name__} for {layout}, not a Profile",
                "return trace(step, mesh, ...) from build",
            )
        pred = predict(
            prof,
            network,
            data_parallel=[
                a for a in data_parallel_axes(data_parallel) if a in layout.mesh.axis_names
            ],
            bucket_mb=bucket_mb,
            optimizer=optimizer,
            memory=memory,
            pipeline=layout.pipeline,
        )
        preds.append(replace(pred, layout=layout))
    return LayoutRanking(network, tuple(sorted(preds, key=lambda p: (not p.fits, p.time))))
