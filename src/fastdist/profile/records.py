"""What a profile holds: the collectives of a step (:class:`Record`), its compute
(:class:`Work`), its parameters (:class:`Param`, :class:`GradReady`), its memory
(:class:`Memory`), all gathered in a :class:`Profile`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, overload

import torch

from fastdist.core.mesh import Mesh
from fastdist.errors import ProfileError
from fastdist.profile._kernels import Kernel

__all__ = ["OPTIMIZER_STATE", "GradReady", "Memory", "Param", "Profile", "Record", "Work"]


@dataclass(frozen=True)
class Record:
    """One collective one rank issues.

    Attributes:
        op: the fastdist op (``"psum"``, ``"all_gather_v"``, ...; backward rules show as the ops
            they call).
        axis: the mesh axis name, or ``"dp+tp"`` for a tuple of axes.
        n: ranks in the group.
        kind: the nccl-tests collective (see :func:`bus_factor`).
        size: S in bytes (nccl-tests' definition for ``kind``).
        bus_bytes: what this rank sends: ``size * bus_factor(kind, n)`` (times the fraction of
            members that send, for a partial ``ppermute``).
        steps: latency terms of the ring algorithm (``2(n-1)`` for all-reduce, ``n-1`` for
            all-gather / reduce-scatter / all-to-all / gather / scatter / broadcast, ``1`` for
            send/recv).
        phase: ``"forward"`` or ``"backward"``.
        module: dotted path of the innermost ``nn.Module`` whose forward issued it (or recorded
            the backward node that issued it); ``""`` outside any traced module.
        dtype: element type.
        shape: the per-rank input shape.
        bound: ``size`` is an upper bound (``ragged_all_to_all``: the split sizes are data).
    """

    op: str
    axis: str
    n: int
    kind: str
    size: int
    bus_bytes: float
    steps: int
    phase: str
    module: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    bound: bool = False


_KEYS = ("op", "axis", "phase", "module", "kind", "n", "dtype")


# ====================================================== compute and memory of a step
@dataclass(frozen=True)
class Work:
    """The compute one rank runs between two events of a traced step (see :attr:`Profile.events`).

    Attributes:
        phase: ``"forward"`` or ``"backward"`` (kernels autograd runs).
        flops: floating-point operations of its matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``:
            ``2 m k n`` each) and attentions (``scaled_dot_product_attention`` forward: ``2 L S
            (E + Ev)`` per batch and head, every score counted, causal or not; backward 2.5 x
            that).
        kernels: aten kernels run (views excluded), the matmuls included.
        bytes: bytes the kernels other than matmuls and attention read and write (their tensor
            inputs plus outputs).
        module: dotted path of the innermost ``nn.Module`` whose forward ran the kernels (for
            backward kernels: whose forward recorded the autograd node that runs them); ``""``
            outside any traced module (or for nodes no module recorded).
        calls: the kernels one by one, grouped by signature: ``(key, count, flops, bytes)`` per
            distinct kernel (``key``: the aten op with its arguments' shapes, strides, dtypes
            and other values, as :func:`calibrate_kernels` times it; ``flops`` / ``bytes``:
            one call's). Empty for work not traced kernel by kernel (a bucket's packing).
    """

    phase: str
    flops: float
    kernels: int
    bytes: float
    module: str = ""
    calls: tuple[tuple[str, int, float, float], ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class GradReady:
    """The gradient of parameter ``Profile.params[param]`` was accumulated (during backward)."""

    param: int


@dataclass(frozen=True)
class Param:
    """A parameter of a traced step: a leaf tensor that required grad and received a gradient.

    Attributes:
        name: the module path (``model.layers.0.mlp.up_proj.weight``) or the argument's position
            (``args[1]``, ``kwargs['w']``).
        bytes: one rank's bytes (its shard).
        dtype: element type.
    """

    name: str
    bytes: int
    dtype: torch.dtype


#: bytes of optimizer state per byte of parameter (torch's defaults: state in the parameter dtype)
OPTIMIZER_STATE = {"adamw": 2.0, "adam": 2.0, "sgd-momentum": 1.0, "sgd": 0.0, "none": 0.0}


@dataclass(frozen=True)
class Memory:
    """One rank's memory of a step (bytes): what :meth:`Profile.memory` estimates.

    Attributes:
        params: the parameters (shards) that received a gradient.
        grads: their gradients (same bytes).
        optimizer: optimizer state (``OPTIMIZER_STATE[optimizer]`` x params).
        activations: tensors autograd saved for backward (unique storages, parameters excluded),
            the forward's peak of what backward needs; temporaries are not counted.
    """

    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


@dataclass(frozen=True)
class Profile:
    """The collectives of one traced step on one rank (see :func:`trace`).

    Attributes:
        mesh: the mesh the step ran on.
        records: every collective in issue order (forward, then backward).
        outputs: ``(module path, bytes)`` of the first tensor each traced module's forward
            returned (one rank's; the last call's): a pipeline's stage boundary is the output of
            a layer (:class:`PipelineSpec`). Empty without ``modules=``.
        kernels: each distinct kernel of :attr:`Work.calls` by its key, replayable on real
            tensors (:func:`calibrate_kernels`); empty for a :func:`record`.

    >>> import torch, fastdist as fd
    >>> from fastdist.profile import trace
    >>> mesh = fd.Mesh({"dp": 4})
    >>> prof = trace(lambda x: fd.all_gather(x, mesh, "dp"), mesh, torch.ones(2, 3))
    >>> print(prof.table())
    axis   op          phase    count  size (B)  bus bytes
    dp     all_gather  forward  1      96        72
    total                       1      96        72
    """

    mesh: Mesh
    records: tuple[Record, ...]
    events: tuple[Work | Record | GradReady, ...] = field(default=(), compare=False, repr=False)
    params: tuple[Param, ...] = field(default=(), compare=False, repr=False)
    activations: int = field(default=0, compare=False, repr=False)
    outputs: tuple[tuple[str, int], ...] = field(default=(), compare=False, repr=False)
    kernels: Mapping[str, Kernel] = field(default_factory=dict, compare=False, repr=False)

    # A profile reads as the tuple of its records: for r in prof, len(prof), prof[0], prof[-2:].
    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    @overload
    def __getitem__(self, index: int) -> Record: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Record, ...]: ...
    def __getitem__(self, index: int | slice) -> Record | tuple[Record, ...]:
        return self.records[index]

    def flops(self, phase: str | None = None) -> float:
        """Matmul and attention FLOPs of the step on this rank (of one ``phase``); a
        :func:`trace` counts them, :func:`record` does not (0).

        Args:
            phase: ``"forward"`` or ``"backward"``; ``None``: both.
        """
        return sum(
            e.flops
            for e in self.events
            if isinstance(e, Work) and (phase is None or e.phase == phase)
        )

    def memory(self, optimizer: str | float = "adamw") -> Memory:
        """One rank's memory (bytes): parameters, gradients, optimizer state, activations.

        Args:
            optimizer: a name in :data:`OPTIMIZER_STATE` (``"adamw"``: 2 x the parameters) or
                the bytes of state per byte of parameter.
        """
        if isinstance(optimizer, str):
            if optimizer not in OPTIMIZER_STATE:
                raise ProfileError(
                    "Profile.memory",
                    f"unknown optimizer {optimizer!r}",
                    f"use one of {', '.join(OPTIMIZER_STATE)}, or bytes of state per parameter "
                    "byte as a number",
                )
            factor = OPTIMIZER_STATE[optimizer]
        else:
            factor = float(optimizer)
        params = sum(p.bytes for p in self.params)
        return Memory(params, params, int(params * factor), self.activations)

    def filter(self, **where: Any) -> Profile:
        """The records whose fields equal the given values, e.g. ``filter(axis="tp",
        phase="backward")``; the compute and gradient events stay (:func:`predict` of the result
        charges the compute and the kept collectives).

        Args:
            **where: field values a record must have (``axis="tp"``, ``phase="backward"``).

        Returns:
            a `Profile` with the matching records.
        """
        _check_fields(
            "Profile.filter", where, f"filter by {', '.join(Record.__dataclass_fields__)}"
        )

        def keep(r: Record) -> bool:
            return all(getattr(r, k) == v for k, v in where.items())

        return replace(
            self,
            records=tuple(r for r in self.records if keep(r)),
            events=tuple(e for e in self.events if not isinstance(e, Record) or keep(e)),
        )

    def count(self, **where: Any) -> int:
        """Number of collectives (matching ``where``, as :meth:`filter`).

        Args:
            **where: field values a record must have (``axis="tp"``, ``phase="backward"``), as in
                `filter`.
        """
        return len(self.filter(**where).records)

    def size(self, **where: Any) -> int:
        """Sum of the nccl-tests sizes S in bytes (matching ``where``).

        Args:
            **where: field values a record must have (``axis="tp"``, ``phase="backward"``), as in
                `filter`.
        """
        return sum(r.size for r in self.filter(**where).records)

    def bus_bytes(self, **where: Any) -> float:
        """Bytes this rank sends (bus bytes, matching ``where``).

        Args:
            **where: field values a record must have (``axis="tp"``, ``phase="backward"``), as in
                `filter`.
        """
        return sum(r.bus_bytes for r in self.filter(**where).records)

    def summary(self, by: Sequence[str] = ("axis", "op", "phase")) -> list[dict[str, Any]]:
        """Rows grouped by the given Record fields, in first-seen order: the fields, ``count``,
        ``size``, ``bus_bytes``.

        Args:
            by: the ``Record`` fields to group by.

        Returns:
            one row per group: the fields, ``count``, ``size``, ``bus_bytes``.
        """
        _check_fields("Profile.summary", by, f"group by any of {', '.join(_KEYS)}")
        rows: dict[tuple[Any, ...], dict[str, Any]] = {}
        for r in self.records:
            key = tuple(getattr(r, k) for k in by)
            row = rows.setdefault(
                key, {**dict(zip(by, key)), "count": 0, "size": 0, "bus_bytes": 0.0}
            )
            row["count"] += 1
            row["size"] += r.size
            row["bus_bytes"] += r.bus_bytes
        return list(rows.values())

    def table(self, by: Sequence[str] = ("axis", "op", "phase")) -> str:
        """:meth:`summary` as an aligned text table with a total row.

        Args:
            by: the ``Record`` fields to group by.

        Returns:
            the text table.
        """
        rows = self.summary(by)
        head = [*by, "count", "size (B)", "bus bytes"]
        body = [
            [str(r[k]) for k in by] + [str(r["count"]), str(r["size"]), f"{r['bus_bytes']:.0f}"]
            for r in rows
        ]
        body.append(
            [
                "total",
                *([""] * (len(by) - 1)),
                str(len(self.records)),
                str(self.size()),
                f"{self.bus_bytes():.0f}",
            ]
        )
        widths = [max(len(c[i]) for c in [head, *body]) for i in range(len(head))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]
        )

    def __str__(self) -> str:
        return self.table()


def _check_fields(op: str, names: Iterable[str], fix: str) -> None:
    """Refuse any of ``names`` that is not a ``Record`` field (``op`` the caller, ``fix`` the
    error's remedy)."""
    bad = [k for k in names if k not in Record.__dataclass_fields__]
    if bad:
        raise ProfileError(op, f"Record has no field {bad[0]!r}", fix)
