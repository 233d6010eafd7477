"""Pipeline schedules as values: which stage does what, in which order, and the timeline they
make.

A :class:`Schedule` lists, for each rank along the ``pp`` axis, the actions it runs in order:
``F`` (forward of one micro-batch through one stage) and ``B`` (its backward: the input
gradient and the weight gradients). Nothing here needs torch: a schedule is built, checked,
drawn and timed in pure Python, and the executor (`fastdist.train.Pipeline`) runs the same
lists on simulated or real ranks.

=====================  =======================================  ==================================
schedule               order on rank ``r`` (``pp`` ranks,        bubble with unit ``F`` and ``B``
                       ``m`` micro-batches, ``v`` stages each)   (idle share of the step)
=====================  =======================================  ==================================
``gpipe``              every ``F``, then every ``B``             ``(pp - 1) / (m + pp - 1)``
``1f1b``               ``pp - r - 1`` warm-up ``F``, then one    ``(pp - 1) / (m + pp - 1)``, with
                       ``F`` and one ``B`` alternately           at most ``pp - r`` micro-batches'
                                                                 activations held
``interleaved_1f1b``   Megatron's interleaving over ``v``        ``(pp - 1) / (v m + pp - 1)``
                       virtual stages per rank (stage ``j``
                       on rank ``j % pp``)
=====================  =======================================  ==================================

The bubble column holds when ``B`` costs as much as ``F`` (``Schedule.bubble()``'s default);
with any other costs :meth:`Schedule.timeline` computes it from the dependencies.

>>> from fastdist.train import schedules
>>> s = schedules.one_f_one_b(pp=3, microbatches=4)
>>> print(s.show())
1f1b: pp=3, 4 micro-batches; F = forward, B = backward of micro-batch k (time: 1 per action)
tick    0   1   2   3   4   5   6   7   8   9  10  11
pp=0   F0  F1  F2   .   .  B0  F3  B1   .  B2   .  B3
pp=1    .  F0  F1   .  B0  F2  B1  F3  B2   .  B3   .
pp=2    .   .  F0  B0  F1  B1  F2  B2  F3  B3   .   .
bubble 0.333 (theory (pp-1)/(m+pp-1) = 0.333)
>>> round(s.bubble(), 12) == round(schedules.theoretical_bubble("1f1b", 3, 4), 12)
True
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from fastdist.errors import PipelineError

__all__ = [
    "Action",
    "Schedule",
    "Slot",
    "NAMES",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "schedule",
    "theoretical_bubble",
]

#: the schedules :func:`schedule` builds by name
NAMES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class Action:
    """One unit of work: ``kind`` ``"F"`` or ``"B"`` of ``microbatch`` through ``stage``."""

    kind: Literal["F", "B"]
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Slot:
    """An action placed on the timeline: it runs on ``rank`` from ``start`` to ``end``."""

    rank: int
    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class Schedule:
    """The per-rank action lists of one pipeline step.

    Attributes:
        name: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` (or a custom name).
        pp: ranks along the pipeline axis.
        microbatches: micro-batches per step.
        virtual: stages per rank (``1`` except for interleaved schedules); stage ``j`` of the
            ``pp * virtual`` lives on rank ``j % pp``.
        actions: ``actions[r]`` is what rank ``r`` runs, in order.

    Building one checks it: every stage runs ``F`` and then ``B`` of every micro-batch exactly
    once, on the rank that holds the stage, and the dependencies (``F`` of a micro-batch on
    stage ``j`` after ``F`` on stage ``j - 1``; ``B`` on stage ``j`` after ``B`` on stage
    ``j + 1``) can be met in the listed orders without a deadlock; otherwise
    :class:`~fastdist.PipelineError`.
    """

    name: str
    pp: int
    microbatches: int
    virtual: int
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        _check_counts(self.name, self.pp, self.microbatches, self.virtual)
        if len(self.actions) != self.pp:
            raise PipelineError(
                f"Schedule {self.name!r}: {len(self.actions)} action lists for pp={self.pp} "
                "ranks. Fix: give one list per rank"
            )
        stages = self.pp * self.virtual
        for r, acts in enumerate(self.actions):
            seen: set[tuple[str, int, int]] = set()
            for a in acts:
                if a.kind not in ("F", "B") or not 0 <= a.microbatch < self.microbatches:
                    raise PipelineError(
                        f"Schedule {self.name!r}: rank {r} lists {a!r}, not an F or B of a "
                        f"micro-batch in 0..{self.microbatches - 1}. Fix: list only those"
                    )
                if not 0 <= a.stage < stages or a.stage % self.pp != r:
                    raise PipelineError(
                        f"Schedule {self.name!r}: rank {r} lists {a!r}, but stage {a.stage} "
                        f"lives on rank {a.stage % self.pp} (stages 0..{stages - 1}). Fix: put "
                        "each action on the rank of its stage"
                    )
                key = (a.kind, a.microbatch, a.stage)
                if key in seen:
                    raise PipelineError(
                        f"Schedule {self.name!r}: rank {r} lists {a} of stage {a.stage} twice. "
                        "Fix: run each action once"
                    )
                if a.kind == "B" and ("F", a.microbatch, a.stage) not in seen:
                    raise PipelineError(
                        f"Schedule {self.name!r}: rank {r} lists {a} of stage {a.stage} before "
                        f"its forward. Fix: run F{a.microbatch} first"
                    )
                seen.add(key)
            want = self.microbatches * self.virtual * 2
            if len(seen) != want:
                raise PipelineError(
                    f"Schedule {self.name!r}: rank {r} runs {len(seen)} actions, not the "
                    f"{want} (F and B of {self.microbatches} micro-batches x {self.virtual} "
                    "stages) a step needs. Fix: list every one"
                )
        self.timeline()  # raises on a deadlock

    # ------------------------------------------------------------------ structure
    @property
    def stages(self) -> int:
        """Stages in all: ``pp * virtual``."""
        return self.pp * self.virtual

    def rank_of(self, stage: int) -> int:
        """The rank along ``pp`` holding ``stage``."""
        return stage % self.pp

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, in order."""
        return tuple(range(rank, self.stages, self.pp))

    def _deps(self, a: Action) -> list[Action]:
        """The actions (on other stages) that ``a`` waits for."""
        if a.kind == "F":
            return [Action("F", a.microbatch, a.stage - 1)] if a.stage > 0 else []
        if a.stage == self.stages - 1:
            return [Action("F", a.microbatch, a.stage)]  # the loss's backward starts here
        return [Action("B", a.microbatch, a.stage + 1)]

    # ------------------------------------------------------------------ time
    def timeline(
        self,
        forward: float | Sequence[float] = 1.0,
        backward: float | Sequence[float] = 1.0,
        *,
        transfer: float = 0.0,
    ) -> list[Slot]:
        """Every action placed in time: it starts when its rank is free and what it waits for
        has ended and, from another rank, arrived.

        Args:
            forward: the cost of one micro-batch's forward through all the stages one rank
                holds (one action costs ``forward / virtual``), or one cost per stage
                (``stages`` values: stages of different sizes).
            backward: the same for the backward.
            transfer: the time a stage's output (or input gradient) takes to reach a stage on
                another rank; stages on one rank pass it at no cost.

        Returns:
            the slots in the order they start (ties: lower rank first).
        """
        cost = {"F": self._costs("forward", forward), "B": self._costs("backward", backward)}
        if not (math.isfinite(transfer) and transfer >= 0):
            raise PipelineError(
                f"Schedule.timeline: transfer={transfer}. Fix: a time >= 0 (0: free transfers)"
            )
        end: dict[Action, float] = {}
        nxt = [0] * self.pp
        free = [0.0] * self.pp
        slots: list[Slot] = []
        left = sum(len(a) for a in self.actions)
        while left:
            progressed = False
            for r in range(self.pp):
                while nxt[r] < len(self.actions[r]):
                    a = self.actions[r][nxt[r]]
                    deps = self._deps(a)
                    if any(d not in end for d in deps):
                        break
                    arrive = [end[d] + (transfer if d.stage % self.pp != r else 0.0) for d in deps]
                    start = max([free[r], *arrive])
                    end[a] = free[r] = start + cost[a.kind][a.stage]
                    slots.append(Slot(r, start, end[a], a))
                    nxt[r] += 1
                    left -= 1
                    progressed = True
            if not progressed:
                waiting = [
                    (r, self.actions[r][nxt[r]])
                    for r in range(self.pp)
                    if nxt[r] < len(self.actions[r])
                ]
                stuck = ", ".join(f"rank {r} at {a} of stage {a.stage}" for r, a in waiting)
                raise PipelineError(
                    f"Schedule {self.name!r} deadlocks: {stuck} each wait for an action listed "
                    "later on another rank. Fix: order each rank's actions so that what a stage "
                    "waits for can run first"
                )
        return sorted(slots, key=lambda s: (s.start, s.rank))

    def _costs(self, what: str, value: float | Sequence[float]) -> list[float]:
        """One action's cost on each stage."""
        if isinstance(value, (int, float)):
            values = [value / self.virtual] * self.stages
        else:
            values = list(value)
            if len(values) != self.stages:
                raise PipelineError(
                    f"Schedule.timeline: {what}= has {len(values)} costs for {self.stages} "
                    f"stages. Fix: one number (a rank's micro-batch) or one per stage"
                )
        if not all(isinstance(c, (int, float)) and math.isfinite(c) and c > 0 for c in values):
            raise PipelineError(f"Schedule.timeline: {what}={value!r}. Fix: positive finite costs")
        return [float(c) for c in values]

    def makespan(
        self,
        forward: float | Sequence[float] = 1.0,
        backward: float | Sequence[float] = 1.0,
        *,
        transfer: float = 0.0,
    ) -> float:
        """The time from the first action's start to the last one's end."""
        return max(s.end for s in self.timeline(forward, backward, transfer=transfer))

    def bubble(
        self,
        forward: float | Sequence[float] = 1.0,
        backward: float | Sequence[float] = 1.0,
        *,
        transfer: float = 0.0,
    ) -> float:
        """The share of ``pp x makespan`` that ranks sit idle."""
        slots = self.timeline(forward, backward, transfer=transfer)
        busy = sum(s.end - s.start for s in slots)
        return 1.0 - busy / (self.pp * max(s.end for s in slots))

    def order(self) -> Iterator[Action]:
        """All actions in timeline order: how one process runs the whole schedule (simulated
        ranks)."""
        return (s.action for s in self.timeline())

    def peak_in_flight(self, rank: int) -> int:
        """The most micro-batches (summed over its stages) whose forward has run on ``rank``
        and whose backward has not yet: the activations it holds at once."""
        held = peak = 0
        for a in self.actions[rank]:
            held += 1 if a.kind == "F" else -1
            peak = max(peak, held)
        return peak

    # ------------------------------------------------------------------ pictures
    def show(self, forward: float = 1.0, backward: float = 1.0) -> str:
        """The timeline as a text table: one row per rank, one column per tick (with unit costs
        a tick is one action). Interleaved schedules label an action ``F3.1``: micro-batch 3,
        the rank's stage 1 (of ``virtual``)."""
        slots = self.timeline(forward, backward)
        step = min(s.end - s.start for s in slots)
        ticks = round(max(s.end for s in slots) / step)
        grid = [["."] * ticks for _ in range(self.pp)]
        for s in slots:
            label = str(s.action)
            if self.virtual > 1:
                label += f".{s.action.stage // self.pp}"
            first = round(s.start / step)
            for t in range(first, round(s.end / step)):
                grid[s.rank][t] = label if t == first else "-"
        width = max(3, *(len(c) for row in grid for c in row)) + 1
        head = (
            f"{self.name}: pp={self.pp}, {self.microbatches} micro-batches"
            + (f", {self.virtual} stages per rank" if self.virtual > 1 else "")
            + "; F = forward, B = backward of micro-batch k (time: "
            + ("1 per action)" if forward == backward == 1.0 else f"F {forward:g}, B {backward:g})")
        )
        lines = [head, "tick " + "".join(str(t).rjust(width) for t in range(ticks))]
        for r, row in enumerate(grid):
            lines.append(f"pp={r}".ljust(5) + "".join(c.rjust(width) for c in row))
        theory = theoretical_bubble(self.name, self.pp, self.microbatches, self.virtual)
        formula = "(pp-1)/(m+pp-1)" if self.virtual == 1 else "(pp-1)/(v*m+pp-1)"
        lines.append(
            f"bubble {self.bubble(forward, backward):.3f}"
            + (f" (theory {formula} = {theory:.3f})" if theory is not None else "")
        )
        return "\n".join(line.rstrip() for line in lines)

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(self.show())}</pre>"


# ====================================================================== builders
def _check_counts(name: str, pp: object, microbatches: object, virtual: object) -> None:
    for what, v in (("pp", pp), ("microbatches", microbatches), ("virtual", virtual)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PipelineError(
                f"schedule {name!r}: {what}={v!r}. Fix: a positive int"
                + (" (the size of the mesh's pipeline axis)" if what == "pp" else "")
            )


def gpipe(pp: int, microbatches: int) -> Schedule:
    """GPipe: every rank runs all forwards, then all backwards (in reverse order of arrival).

    Holds every micro-batch's activations at once; bubble ``(pp - 1) / (m + pp - 1)``.

    >>> [str(a) for a in gpipe(2, 3).actions[1]]
    ['F0', 'F1', 'F2', 'B0', 'B1', 'B2']
    """
    _check_counts("gpipe", pp, microbatches, 1)
    acts = tuple(
        tuple(Action("F", k, r) for k in range(microbatches))
        + tuple(Action("B", k, r) for k in range(microbatches))
        for r in range(pp)
    )
    return Schedule("gpipe", pp, microbatches, 1, acts)


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush, as Megatron runs it): rank ``r`` runs ``pp - r - 1`` warm-up
    forwards, then alternates one forward and one backward, then drains the backwards.

    Same bubble as GPipe, but rank ``r`` holds at most ``pp - r`` micro-batches' activations.
    Any micro-batch count works (with fewer than ``pp`` it is GPipe's order).

    >>> [str(a) for a in one_f_one_b(2, 3).actions[0]]
    ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    """
    _check_counts("1f1b", pp, microbatches, 1)
    lists = []
    for r in range(pp):
        warm = min(pp - r - 1, microbatches)
        acts = [Action("F", k, r) for k in range(warm)]
        for i in range(microbatches - warm):
            acts += [Action("F", warm + i, r), Action("B", i, r)]
        acts += [Action("B", k, r) for k in range(microbatches - warm, microbatches)]
        lists.append(tuple(acts))
    return Schedule("1f1b", pp, microbatches, 1, tuple(lists))


def interleaved_1f1b(pp: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron's virtual pipeline): each rank holds ``virtual`` stages
    (stage ``j`` on rank ``j % pp``), and runs forwards in rounds of ``pp`` micro-batches per
    stage, which cuts the bubble to ``(pp - 1) / (virtual m + pp - 1)`` for more transfers.

    ``microbatches`` must be a multiple of ``pp`` (as in Megatron); :class:`PipelineError`
    otherwise, naming the nearest counts that work.

    >>> [str(a) + "." + str(a.stage // 2) for a in interleaved_1f1b(2, 2, 2).actions[1]]
    ['F0.0', 'F1.0', 'F0.1', 'B0.1', 'F1.1', 'B1.1', 'B0.0', 'B1.0']
    """
    _check_counts("interleaved_1f1b", pp, microbatches, virtual)
    if microbatches % pp:
        lo, hi = microbatches // pp * pp, (microbatches // pp + 1) * pp
        near = f"{lo} or {hi}" if lo else f"{hi}"
        raise PipelineError(
            f"schedule 'interleaved_1f1b': {microbatches} micro-batches over pp={pp} ranks: the "
            f"interleaved schedule runs micro-batches in rounds of pp. Fix: use {near} "
            "micro-batches, or the '1f1b' schedule"
        )
    total = microbatches * virtual  # actions of each kind per rank

    def unit(k: int, kind: str, r: int) -> Action:
        # the k-th forward (backward) of rank r: rounds of pp micro-batches per stage
        chunk = (k // pp) % virtual
        if kind == "B":
            chunk = virtual - 1 - chunk
        micro = (k // (pp * virtual)) * pp + k % pp
        return Action(kind, micro, chunk * pp + r)  # type: ignore[arg-type]

    lists = []
    for r in range(pp):
        warm = min((pp - r - 1) * 2 + (virtual - 1) * pp, total)
        acts = [unit(k, "F", r) for k in range(warm)]
        for i in range(total - warm):
            acts += [unit(warm + i, "F", r), unit(i, "B", r)]
        acts += [unit(k, "B", r) for k in range(total - warm, total)]
        lists.append(tuple(acts))
    return Schedule("interleaved_1f1b", pp, microbatches, virtual, tuple(lists))


def schedule(name: str, pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The schedule called ``name`` (one of :data:`NAMES`).

    ``virtual`` (stages per rank) is for ``"interleaved_1f1b"`` (default 2 there); the other
    schedules hold one stage per rank and refuse ``virtual > 1``.
    """
    if name == "interleaved_1f1b":
        return interleaved_1f1b(pp, microbatches, 2 if virtual == 1 else virtual)
    if name not in NAMES:
        raise PipelineError(f"schedule {name!r} is not known. Fix: use one of {', '.join(NAMES)}")
    if virtual != 1:
        raise PipelineError(
            f"schedule {name!r} holds one stage per rank, not virtual={virtual}. Fix: use "
            "'interleaved_1f1b' for several stages per rank"
        )
    return gpipe(pp, microbatches) if name == "gpipe" else one_f_one_b(pp, microbatches)


def theoretical_bubble(name: str, pp: int, microbatches: int, virtual: int = 1) -> float | None:
    """The textbook idle share with equal ``F`` and ``B`` costs: ``(pp - 1) / (m + pp - 1)``
    for GPipe and 1F1B, ``(pp - 1) / (v m + pp - 1)`` interleaved; ``None`` for other names."""
    if name in ("gpipe", "1f1b"):
        return (pp - 1) / (microbatches + pp - 1)
    if name == "interleaved_1f1b":
        return (pp - 1) / (virtual * microbatches + pp - 1)
    return None


def stage_layers(layers: int, stages: int, sizes: Sequence[int] | None = None) -> list[range]:
    """Which layers each stage holds: ``layers / stages`` each, in order, or ``sizes``.

    >>> stage_layers(8, 4)
    [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    """
    if sizes is None:
        if layers % stages:
            divisors = [d for d in range(1, layers + 1) if layers % d == 0]
            raise PipelineError(
                f"pipeline: {layers} layers do not split evenly into {stages} stages. Fix: use a "
                f"stage count that divides {layers} ({', '.join(map(str, divisors))}), or pass "
                f"layers_per_stage= with {stages} sizes summing to {layers}"
            )
        sizes = [layers // stages] * stages
    sizes = list(sizes)
    if len(sizes) != stages or any(
        isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes
    ):
        raise PipelineError(
            f"pipeline: layers_per_stage={sizes} for {stages} stages. Fix: {stages} positive ints"
        )
    if sum(sizes) != layers:
        raise PipelineError(
            f"pipeline: layers_per_stage={sizes} sums to {sum(sizes)}, the model has {layers} "
            "layers. Fix: make them sum to the layer count"
        )
    out, start = [], 0
    for s in sizes:
        out.append(range(start, start + s))
        start += s
    return out
