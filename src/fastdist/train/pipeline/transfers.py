"""The transfers of a pipeline step between the ranks along ``pp`` (`Transfers`): asynchronous
sends, receives with the mesh's timeout, each transfer's header (kind, micro-batch, stage,
dtype, shape, the sender's schedule) sent and checked once per input shapes, receives posted
one action ahead once their shapes are known, and the exchange of a tied weight's gradient."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from fastdist.core.mesh import Mesh
from fastdist.errors import CommError, PipelineError
from fastdist.train.schedules import Schedule

__all__ = ["Transfers", "digest_bits", "flat_inputs", "schedule_id"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_HEADER = 16  # int64 slots: kind, microbatch, stage, dtype, ndim, schedule (3), shape...
_SHAPE = 8  # where the shape starts: at most _HEADER - _SHAPE = 8 dims
_TIED_TAG = 1 << 28  # the tags of a tied weight's gradient halves (above every transfer's)


def schedule_id(sched: Schedule, layers: Sequence[range]) -> tuple[int, int, int]:
    """What a transfer's header says about the sender's pipeline: ``(checksum of its schedule's
    actions and layer split, micro-batches, stages)``, equal on every rank that built the same
    pipeline (a checksum, not Python's per-process ``hash``)."""
    text = repr(
        (
            sched.name,
            [[str(a) for a in acts] for acts in sched.actions],
            [(r.start, r.stop) for r in layers],
        )
    )
    return zlib.crc32(text.encode()), sched.microbatches, sched.stages


class Transfers:
    """Transfers between the ranks of the pipeline axis of a real mesh: asynchronous sends,
    receives with the mesh's timeout, headers checked.

    A transfer's bytes move only once its receive is posted (gloo's rendezvous: the sender's
    data waits for the receiver's notice), so a receive posted when the action needs it waits,
    idle, for two processes' I/O threads to wake (on busy cores, for a time slice). `post`
    starts the receive of the next action's input before this rank computes the current one:
    the bytes arrive meanwhile. Only transfers whose shape an earlier step's header taught
    are posted early (a first step reads the header first)."""

    def __init__(self, mesh: Mesh, axis: str, schedule_id: tuple[int, int, int]) -> None:
        from fastdist.comm.axes import axis_comm

        self.ac = axis_comm(mesh, axis, "pipeline")
        self.axis = axis
        self.schedule_id = schedule_id  # (checksum, micro-batches, stages): `schedule_id`
        self.index = self.ac.index
        self.pending: list[tuple[Any, Tensor, str]] = []  # (work, payload, what it carries)
        # (step's input signature, kind, micro-batch, stage) -> (shape, dtype) of the transfer,
        # once its header went (sent) / came (known): the same step shapes move without one
        self.sent: dict[tuple[Any, ...], tuple[tuple[int, ...], torch.dtype]] = {}
        self.known: dict[tuple[Any, ...], tuple[tuple[int, ...], torch.dtype]] = {}
        self.signature: Any = None  # the running step's (see Pipeline.step)
        # (kind, micro-batch, stage) -> (work, buffer) of a receive posted ahead (`post`)
        self.posted: dict[tuple[str, int, int], tuple[Any, Tensor]] = {}
        # run once before the step's first transfer (`open_gate`): the check that every rank
        # got the same batch, whose collective runs meanwhile (see Pipeline._check_same_batch)
        self.gate: Callable[[], None] | None = None

    def open_gate(self) -> None:
        """Run (once) what must hold before this step's first transfer: `gate`."""
        gate, self.gate = self.gate, None
        if gate is not None:
            gate()

    def forget(self) -> None:
        """Drop what the headers taught (after a failure, with `Pipeline.reset` on every rank)."""
        self.sent.clear()
        self.known.clear()
        self.posted.clear()

    def _group(self, device: torch.device) -> Any:
        return self.ac.process_group("pipeline", device.type)

    def send(self, t: Tensor, peer: int, kind: str, micro: int, stage: int) -> None:
        import torch.distributed as dist

        self.open_gate()

        t = t.detach().contiguous()
        if t.dtype not in _DTYPES or t.dim() > _HEADER - _SHAPE:
            raise PipelineError(
                f"pipeline: stage {stage} hands on a {t.dtype} tensor of {t.dim()} dims. Fix: "
                f"stage outputs are floating-point hidden states of at most {_HEADER - _SHAPE} dims"
            )
        tag = self._tag(kind, micro, stage)
        group = self._group(t.device)
        # `stage` receives: the stage after this one (forward) or before it (backward)
        what = (
            f"the delivery of the {'activation' if kind == 'F' else 'gradient'} of micro-batch "
            f"{micro} from stage {stage - 1 if kind == 'F' else stage + 1} for stage {stage} "
            f"({self.axis}={peer}, rank {self.ac.ranks[peer]})"
        )
        key = (self.signature, kind, micro, stage)
        seen = self.sent.get(key)
        if seen is not None and seen != (tuple(t.shape), t.dtype):
            raise PipelineError(
                f"pipeline: stage {stage - 1 if kind == 'F' else stage + 1} hands on a "
                f"{t.dtype} tensor of shape {tuple(t.shape)} where the same inputs gave "
                f"{seen[1]} {seen[0]} before. Fix: report this as a fastdist bug"
            )
        # the header once per step shapes (tag 2k), then the tensor (tag 2k + 1)
        payloads = [(t, 2 * tag + 1)]
        if seen is None:
            head = [0 if kind == "F" else 1, micro, stage, _DTYPES.index(t.dtype), t.dim()]
            head += [*self.schedule_id, *t.shape, *[0] * (_HEADER - _SHAPE - t.dim())]
            payloads.insert(0, (torch.tensor(head, dtype=torch.int64, device=t.device), 2 * tag))
        for payload, ptag in payloads:
            work = self.ac.run(
                "pipeline send",
                lambda p=payload, g=ptag: dist.isend(p, group=group, group_dst=peer, tag=g),
                what=what,
            )
            self.pending.append((work, payload, what))
        self.sent[key] = (tuple(t.shape), t.dtype)

    def _what_recv(self, peer: int, kind: str, micro: int, stage: int) -> str:
        # `stage` receives; the sender holds the stage before it (forward) or after it (backward)
        return (
            f"the {'activation' if kind == 'F' else 'gradient'} of micro-batch {micro} from "
            f"stage {stage - 1 if kind == 'F' else stage + 1} ({self.axis}={peer}, rank "
            f"{self.ac.ranks[peer]}) for stage {stage}"
        )

    def post(self, peer: int, kind: str, micro: int, stage: int, device: torch.device) -> None:
        """Start receiving the tensor `recv` will return for this transfer, if an earlier step's
        header taught its shape (else `recv` reads the header first); at most once."""
        import torch.distributed as dist

        self.open_gate()

        seen = self.known.get((self.signature, kind, micro, stage))
        if seen is None or (kind, micro, stage) in self.posted:
            return
        buf = torch.empty(seen[0], dtype=seen[1], device=device)
        group, tag = self._group(device), 2 * self._tag(kind, micro, stage) + 1
        work = self.ac.run(
            "pipeline recv",
            lambda: dist.irecv(buf, group=group, group_src=peer, tag=tag),
            what=self._what_recv(peer, kind, micro, stage),
        )
        self.posted[(kind, micro, stage)] = (work, buf)

    def recv(self, peer: int, kind: str, micro: int, stage: int, device: torch.device) -> Tensor:
        import torch.distributed as dist

        self.open_gate()

        what = self._what_recv(peer, kind, micro, stage)
        timeout = self.ac.comm.timeout
        posted = self.posted.pop((kind, micro, stage), None)
        if posted is not None:
            work, buf = posted
            self.ac.run("pipeline recv", lambda: _work(work).wait(timeout), what=what)
            return buf
        tag = self._tag(kind, micro, stage)
        group = self._group(device)

        def receive(buf: Tensor, t: int) -> None:
            self.ac.run(
                "pipeline recv",
                lambda: _work(dist.irecv(buf, group=group, group_src=peer, tag=t)).wait(timeout),
                what=what,
            )

        key = (self.signature, kind, micro, stage)
        seen = self.known.get(key)
        if seen is None:  # the first step of these input shapes: the header says what comes
            seen = self._read_header(receive, peer, kind, micro, stage, tag, what, device)
        out = torch.empty(seen[0], dtype=seen[1], device=device)
        receive(out, 2 * tag + 1)
        self.known[key] = seen
        return out

    def _read_header(
        self,
        receive: Callable[[Tensor, int], None],
        peer: int,
        kind: str,
        micro: int,
        stage: int,
        tag: int,
        what: str,
        device: torch.device,
    ) -> tuple[tuple[int, ...], torch.dtype]:
        """Receive the header of ``what`` (tag ``2 tag``) and check it; the shape and dtype of
        the tensor that follows."""
        head = torch.empty(_HEADER, dtype=torch.int64, device=device)
        receive(head, 2 * tag)
        k, m, s, code, ndim, *theirs = (int(v) for v in head[:_SHAPE].tolist())
        if (
            (k, m, s) != (0 if kind == "F" else 1, micro, stage)
            or tuple(theirs) != self.schedule_id
            or not 0 <= code < len(_DTYPES)
        ):
            _, mine_m, mine_s = self.schedule_id
            same_counts = tuple(theirs[1:]) == (mine_m, mine_s)
            problem = (
                f"expected {what}, but {self.axis}={peer} (rank {self.ac.ranks[peer]}) sent "
                f"{'FB'[k] if k in (0, 1) else '?'}{m} of stage {s} from a pipeline of "
                f"{theirs[1]} micro-batches over {theirs[2]} stages (this rank: {mine_m} over "
                f"{mine_s}{', but another schedule or layer split' if same_counts else ''}): "
                "the ranks run different schedules"
            )
            # drop the groups so that the peers waiting on this rank fail now, not at the timeout
            self.ac.comm.abandon(f"fastdist.pipeline recv failed on this rank: {problem}")
            raise CommError(
                "pipeline recv",
                self.axis,
                list(self.ac.ranks),
                self.ac.rank,
                problem,
                "build the Pipeline with the same schedule, micro-batches, virtual stages and "
                "layers_per_stage on every rank; then pipe.reset() on every rank",
            )
        return tuple(int(v) for v in head[_SHAPE : _SHAPE + ndim].tolist()), _DTYPES[code]

    def finish(self) -> None:
        """Wait for this step's sends (the peers received them, or the timeout names them)."""
        timeout = self.ac.comm.timeout
        pending, self.pending = self.pending, []
        for work, _, what in pending:
            self.ac.run("pipeline send", lambda w=work: w.wait(timeout), what=what)

    def swap(self, t: Tensor, peer: int, what: str) -> Tensor:
        """Send ``t`` to ``peer`` and receive its tensor of the same shape and dtype (checked
        first), e.g. the two halves of a tied weight's gradient."""
        import torch.distributed as dist

        self.open_gate()

        group, timeout = self._group(t.device), self.ac.comm.timeout
        t = t.detach().contiguous()
        kind = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
        head = torch.tensor([t.dim(), kind, *t.shape, *[0] * (_HEADER - t.dim())])
        theirs = torch.empty_like(head)
        out = torch.empty_like(t)
        for mine, buf, tag in ((head.to(t.device), theirs, _TIED_TAG), (t, out, _TIED_TAG + 1)):
            sent = self.ac.run(
                "pipeline send",
                lambda m=mine, g=tag: dist.isend(m, group=group, group_dst=peer, tag=g),
                what=what,
            )
            self.ac.run(
                "pipeline recv",
                lambda b=buf, g=tag: _work(dist.irecv(b, group=group, group_src=peer, tag=g)).wait(
                    timeout
                ),
                what=what,
            )
            self.ac.run("pipeline send", lambda w=sent: _work(w).wait(timeout), what=what)
            if tag == _TIED_TAG and not torch.equal(theirs.cpu(), head):
                raise PipelineError(
                    f"pipeline: {what}: this rank holds shape {tuple(t.shape)}, {self.axis}="
                    f"{peer} another ({theirs.tolist()}): the tied weights are split differently "
                    "on the first and the last stage. Fix: a plan that splits the input and "
                    "output embeddings alike (the family's ready plan does)"
                )
        return out

    def sum_grads(
        self, grads: Sequence[Tensor | None], like: Sequence[Tensor], what: str
    ) -> list[Tensor | None]:
        """``grads`` summed over the ranks along the axis (one all-reduce of one flat buffer:
        zeros of ``like[i]``'s shape where this rank has no ``grads[i]``, and a flag each, so
        that a gradient no rank has stays ``None``)."""
        first = like[0]
        parts = [
            (g if g is not None else torch.zeros_like(t)).reshape(-1) for g, t in zip(grads, like)
        ]
        flags = torch.tensor(
            [float(g is not None) for g in grads], dtype=first.dtype, device=first.device
        )
        buf = torch.cat([*parts, flags])
        self.ac.all_reduce_async("Pipeline.step", buf, what=what).wait()
        out: list[Tensor | None] = []
        at, n = 0, len(grads)
        for i, t in enumerate(like):
            g = buf[at : at + t.numel()].view_as(t)
            at += t.numel()
            out.append(g if bool(buf[buf.numel() - n + i] > 0) else None)
        return out

    @staticmethod
    def _tag(kind: str, micro: int, stage: int) -> int:
        return (micro * 4096 + stage) * 2 + (0 if kind == "F" else 1)


def _work(work: Any) -> Any:
    """A started transfer's handle (torch types it as optional)."""
    assert work is not None
    return work


def flat_inputs(batch: Mapping[str, Any], numbers: bool) -> dict[str, Tensor]:
    """The batch's tensors by name, a tuple's or list's as ``name[i]``; with ``numbers`` its
    ints, floats and bools as 0-d tensors too."""
    out: dict[str, Tensor] = {}
    for k, v in batch.items():
        items = list(enumerate(v)) if isinstance(v, (tuple, list)) else [(None, v)]
        for i, t in items:
            name = k if i is None else f"{k}[{i}]"
            if isinstance(t, Tensor):
                out[name] = t
            elif numbers and isinstance(t, (bool, int, float)):
                out[name] = torch.tensor(float(t), dtype=torch.float64)
    return out


def digest_bits(v: Tensor) -> Tensor:
    """``v`` flattened as int64 for the batch digest: a floating tensor's bits (a DiT's latents
    and text states: ``long()`` would truncate most values to 0 and miss a difference), an
    integer or boolean tensor's values."""
    v = v.detach().contiguous().reshape(-1)
    if v.dtype.is_floating_point:
        bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[v.element_size()]
        v = v.view(bits)
    return v.long()
