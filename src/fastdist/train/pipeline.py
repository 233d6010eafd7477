"""Pipeline parallelism over a mesh axis: an unmodified decoder split into stages by layer
index, each stage parallelized over the mesh's other axes, run by a schedule of
`fastdist.train.schedules` on simulated or real ranks.

How a stage runs the model's own code. Every stage is a copy of the model's skeleton (its
config, rotary embedding, mask code: everything but the decoder layers and the ends) holding
only its own layers; the other layers are parameter-free placeholders, so parameter names stay
the model's own (``model.layers.5.mlp.up_proj.weight``) and ``pm.load(save_pretrained_dir)``
reads only each stage's slices. The model's ``forward`` runs as on one device (positions,
masks and rotary embeddings from ``input_ids``), with two hooks:

==============  ================================================  ==========================
where           forward                                           backward
==============  ================================================  ==========================
stage input     the first own layer's hidden-states input is      its gradient is sent back
                replaced by the activation received from the      to the previous stage
                previous stage (the first stage embeds
                ``input_ids`` itself)
stage output    the last own layer's output is sent to the next   ``backward(output, the
                stage and the rest of the model is skipped (the   gradient received from
                last stage runs on: final norm, LM head, loss)    the next stage)``
==============  ================================================  ==========================

Placeholders on a stage without the embedding produce zeros of the hidden size (never used:
the first own layer's input is replaced); the final norm and the LM head are absent on the
other stages and raise if reached.

The loss. The last stage computes each micro-batch's loss with ``num_items_in_batch`` set to
the whole batch's count of predicted tokens, so the micro-batch losses add up to the loss of
the whole batch (transformers' mean over its tokens) and their gradients to its gradient: the
step is exactly one device's step on the whole batch, whatever the micro-batch count.

Transfers. On a simulated mesh the schedule runs in one process, action by action in
timeline order (`Schedule.order`), and a transfer hands the stacked tensor over. On real
ranks each rank runs its own actions; a transfer is an asynchronous send (kept until the step
ends) and a blocking receive with the mesh's timeout, over the ``pp`` axis's process group, each
message tagged and preceded by a header (kind, micro-batch, stage, dtype, shape) that the
receiver checks: a peer that sends something else raises instead of being misread.
"""

from __future__ import annotations

import copy
import math
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fastdist.comm.connect import reset as reset_mesh
from fastdist.core.mesh import Mesh
from fastdist.errors import CommError, PipelineError
from fastdist.train.schedules import Schedule, schedule, stage_layers

__all__ = ["Pipeline", "pipeline", "SPLITS", "StageSplit", "Event"]


@dataclass(frozen=True)
class StageSplit:
    """Where a family keeps its decoder layers and what belongs to the first and last stages.

    Attributes:
        layers: the name of the ``nn.ModuleList`` of decoder layers.
        first: modules only the first stage holds (embeddings).
        last: modules only the last stage holds (final norm, LM head).
    """

    layers: str
    first: tuple[str, ...]
    last: tuple[str, ...]


_DECODER = StageSplit("model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"))

#: model_type -> how its decoder splits into stages
SPLITS: dict[str, StageSplit] = {
    **dict.fromkeys(
        (
            "llama",
            "mistral",
            "qwen2",
            "qwen3",
            "gemma",
            "gemma2",
            "gemma3_text",
            "phi3",
            "stablelm",
            "olmo",
            "olmo2",
            "mixtral",
            "qwen2_moe",
            "qwen3_moe",
            "olmoe",
            "deepseek_v2",
            "deepseek_v3",
            "gpt_oss",
        ),
        _DECODER,
    ),
    "gpt2": StageSplit(
        "transformer.h", ("transformer.wte", "transformer.wpe"), ("transformer.ln_f", "lm_head")
    ),
    "gpt_neox": StageSplit(
        "gpt_neox.layers", ("gpt_neox.embed_in",), ("gpt_neox.final_layer_norm", "lm_head")
    ),
    "falcon": StageSplit(
        "transformer.h", ("transformer.word_embeddings",), ("transformer.ln_f", "lm_head")
    ),
}


@dataclass(frozen=True)
class Event:
    """One action as it ran: on ``rank`` (along ``pp``), from ``start`` to ``end`` seconds after
    the step began (the wall clock of the process that ran it)."""

    rank: int
    kind: str
    microbatch: int
    stage: int
    start: float
    end: float


# ====================================================================== stage modules
class _Skip(nn.Module):
    """A layer another stage holds: passes its hidden-states input through (never with
    parameters; what it passes is replaced at this stage's first own layer)."""

    def forward(self, hidden_states: Any = None, *args: Any, **kwargs: Any) -> Any:
        return hidden_states


class _Zeros(nn.Module):
    """An embedding another stage holds: zeros of the hidden size (replaced before they are
    used)."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, ids: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return torch.zeros(*ids.shape, self.dim, dtype=self.dtype, device=ids.device)


class _Absent(nn.Module):
    """A module only the last stage holds; reaching it on another stage is a bug."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.what = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(
            f"pipeline: {self.what} ran on a stage that does not hold it (the stage's last layer "
            "should have ended its forward). Fix: report this as a fastdist bug"
        )


_PLACEHOLDERS = (_Skip, _Zeros, _Absent)


class _Handoff(Exception):  # noqa: N818 - control flow, not an error
    """Ends a non-last stage's forward at its last layer, carrying that layer's output."""

    def __init__(self, hidden: Tensor) -> None:
        super().__init__()
        self.hidden = hidden


#: the keyword under which a stage module receives its input activation
_STAGE_INPUT = "fastdist_stage_input"


class _StageHooks:
    """The hooks that make a copy of the model one stage: take the received activation at the
    first own layer, hand the last own layer's output on."""

    def __init__(self, module: nn.Module, first: nn.Module | None, last: nn.Module | None) -> None:
        self.received: Tensor | None = None
        self.handles = [module.register_forward_pre_hook(self._take, with_kwargs=True)]
        if first is not None:
            self.handles.append(
                first.register_forward_pre_hook(self._substitute, with_kwargs=True, prepend=True)
            )
        if last is not None:
            self.handles.append(last.register_forward_hook(self._hand_on))
            model_forward = module.forward

            def forward(*args: Any, **kwargs: Any) -> Any:
                # inside the (simulated) rank's call: the handoff's tensor is this rank's output
                try:
                    return model_forward(*args, **kwargs)
                except _Handoff as h:
                    return h.hidden

            module.forward = forward

    def _take(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        self.received = kwargs.pop(_STAGE_INPUT, None)
        return args, kwargs

    def _substitute(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        x, self.received = self.received, None
        if x is None:
            raise PipelineError(
                "pipeline: a stage after the first ran without the previous stage's activation. "
                "Fix: report this as a fastdist bug"
            )
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    def _hand_on(self, module: nn.Module, args: Any, out: Any) -> Any:
        raise _Handoff(out[0] if isinstance(out, (tuple, list)) else out)


def _family(model: nn.Module) -> tuple[str, StageSplit]:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    split = SPLITS.get(model_type) if isinstance(model_type, str) else None
    if split is None:
        raise PipelineError(
            f"pipeline: no stage split for {type(model).__name__} (model_type={model_type!r}). "
            f"Fix: use one of {sorted(SPLITS)}, or add a StageSplit(layers=..., first=..., "
            "last=...) for it with split=..."
        )
    return str(model_type), split


def _split_model(
    model: nn.Module, split: StageSplit, ranges: Sequence[range], keep: Sequence[int]
) -> dict[int, nn.Module]:
    """Stage modules ``{stage: copy of the model's skeleton holding its layers}`` for the stages
    in ``keep``; every parameter of ``model`` must belong to a layer or an end module."""
    layers = _layer_list(model, split)
    try:
        ends = {n: model.get_submodule(n) for n in (*split.first, *split.last)}
    except AttributeError as e:
        raise PipelineError(
            f"pipeline: {type(model).__name__} lacks a module its split names ({e}). Fix: pass "
            f"split= naming its first-stage and last-stage modules"
        ) from None
    n_layers = len(layers)
    if ranges[-1].stop != n_layers:
        raise PipelineError(
            f"pipeline: the stages cover {ranges[-1].stop} layers, {split.layers} holds "
            f"{n_layers}. Fix: layers_per_stage= summing to {n_layers}"
        )
    owner: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        where = next(
            (
                part
                for part in (split.layers, *split.first, *split.last)
                if name.startswith(part + ".")
            ),
            None,
        )
        if where is None:
            raise PipelineError(
                f"pipeline: parameter {name} of {type(model).__name__} belongs to no stage "
                f"(not in {split.layers}, {split.first} or {split.last}). Fix: pass split= "
                "with the module holding it among first= or last="
            )
        ends_of = "first" if where in split.first else "last" if where in split.last else where
        if owner.setdefault(id(p), ends_of) != ends_of and len(ranges) > 1:
            raise PipelineError(
                f"pipeline: parameter {name} is shared by the first and the last stage (tied "
                "input and output embeddings): fastdist's pipeline does not sum a tied weight's "
                "gradient across stages yet. Fix: build the model with "
                "tie_word_embeddings=False (and copy the weight), or run without a pipeline axis"
            )
    emb = ends[split.first[0]]
    weight = getattr(emb, "weight", None)
    if weight is None:
        raise PipelineError(
            f"pipeline: {split.first[0]} has no weight to size the hidden states by. Fix: pass "
            "split= whose first module is the token embedding"
        )
    dim, dtype = int(weight.shape[-1]), weight.dtype
    own = list(layers)
    # the skeleton: the model without its layers and ends (a cheap copy)
    stubs: dict[str, nn.Module] = {
        **{n: _Zeros(dim, dtype) for n in split.first},
        **{n: _Absent(n) for n in split.last},
    }

    def put(root: nn.Module, name: str, module: nn.Module) -> None:
        parent, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent) if parent else root, child, module)

    put(model, split.layers, nn.ModuleList([_Skip() for _ in own]))
    for n, stub in stubs.items():
        put(model, n, stub)
    try:
        skeleton = copy.deepcopy(model)
    finally:
        put(model, split.layers, layers)
        for n, m in ends.items():
            put(model, n, m)
    stages: dict[int, nn.Module] = {}
    for j in keep:
        st = copy.deepcopy(skeleton)
        lst = st.get_submodule(split.layers)
        assert isinstance(lst, nn.ModuleList)
        for i in ranges[j]:
            lst[i] = own[i]
        if j == 0:
            for n in split.first:
                put(st, n, ends[n])
        if j == len(ranges) - 1:
            for n in split.last:
                put(st, n, ends[n])
        stages[j] = st
    return stages


def _stage_plan(plan: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """The plan's entries that match a module this stage holds (not a placeholder)."""
    from fastdist.nn.parallelize import _matches

    real = [n for n, m in module.named_modules() if not isinstance(m, _PLACEHOLDERS)]
    return {p: v for p, v in plan.items() if any(_matches(p, n) for n in real)}


# ====================================================================== transfers
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_HEADER = 16  # int64 slots: kind, microbatch, stage, dtype, ndim, schedule (3), shape...
_SHAPE = 8  # where the shape starts: at most _HEADER - _SHAPE = 8 dims


def _schedule_id(sched: Schedule, layers: Sequence[range]) -> tuple[int, int, int]:
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


class _Ranks:
    """Transfers between the ranks of the pipeline axis of a real mesh: asynchronous sends,
    receives with the mesh's timeout, headers checked."""

    def __init__(self, mesh: Mesh, axis: str, schedule_id: tuple[int, int, int]) -> None:
        from fastdist.comm.distributed import _axis_comm, select_backend

        self.ac = _axis_comm("pipeline", mesh, axis)
        self.axis = axis
        self.schedule_id = schedule_id  # (checksum, micro-batches, stages): `_schedule_id`
        self.index = self.ac.index
        self._backend = select_backend
        self.pending: list[tuple[Any, Tensor, str]] = []  # (work, payload, what it carries)
        # (step's input signature, kind, micro-batch, stage) -> (shape, dtype) of the transfer,
        # once its header went (sent) / came (known): the same step shapes move without one
        self.sent: dict[tuple[Any, ...], tuple[tuple[int, ...], torch.dtype]] = {}
        self.known: dict[tuple[Any, ...], tuple[tuple[int, ...], torch.dtype]] = {}
        self.signature: Any = None  # the running step's (see Pipeline.step)

    def forget(self) -> None:
        """Drop what the headers taught (after a failure, with `Pipeline.reset` on every rank)."""
        self.sent.clear()
        self.known.clear()

    def _group(self, device: torch.device) -> Any:
        return self.ac.comm.group(self.ac, self._backend(device.type), "pipeline")

    def send(self, t: Tensor, peer: int, kind: str, micro: int, stage: int) -> None:
        import torch.distributed as dist

        t = t.detach().contiguous()
        if t.dtype not in _DTYPES or t.dim() > _HEADER - _SHAPE:
            raise PipelineError(
                f"pipeline: stage {stage} hands on a {t.dtype} tensor of {t.dim()} dims. Fix: "
                f"stage outputs are floating-point hidden states of at most {_HEADER - _SHAPE} dims"
            )
        head = torch.zeros(_HEADER, dtype=torch.int64)
        head[:_SHAPE] = torch.tensor(
            [0 if kind == "F" else 1, micro, stage, _DTYPES.index(t.dtype), t.dim()]
            + list(self.schedule_id)
        )
        head[_SHAPE : _SHAPE + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
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
        payloads = [(t, 2 * tag + 1)] if seen else [(head.to(t.device), 2 * tag), (t, 2 * tag + 1)]
        for payload, ptag in payloads:
            work = self.ac.run(
                "pipeline send",
                lambda p=payload, g=ptag: dist.isend(p, group=group, group_dst=peer, tag=g),
                what=what,
            )
            self.pending.append((work, payload, what))
        self.sent[key] = (tuple(t.shape), t.dtype)

    def recv(self, peer: int, kind: str, micro: int, stage: int, device: torch.device) -> Tensor:
        import torch.distributed as dist

        tag = self._tag(kind, micro, stage)
        group = self._group(device)
        # `stage` receives; the sender holds the stage before it (forward) or after it (backward)
        what = (
            f"the {'activation' if kind == 'F' else 'gradient'} of micro-batch {micro} from "
            f"stage {stage - 1 if kind == 'F' else stage + 1} ({self.axis}={peer}, rank "
            f"{self.ac.ranks[peer]}) for stage {stage}"
        )
        timeout = self.ac.comm.timeout

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

    @staticmethod
    def _tag(kind: str, micro: int, stage: int) -> int:
        return (micro * 4096 + stage) * 2 + (0 if kind == "F" else 1)


# ====================================================================== the pipeline
class Pipeline:
    """A model split into pipeline stages over ``axis``, each stage parallelized over the mesh's
    other axes, and the schedule that runs a training step over micro-batches.

    Build it with :func:`pipeline`. On a simulated mesh it holds every stage; on real ranks only
    the stages of this process's index along ``axis``.

    Attributes:
        mesh: the whole mesh (with the pipeline axis).
        axis: the pipeline axis.
        schedule: the `fastdist.train.schedules.Schedule` a step runs.
        stage_mesh: the mesh each stage is parallelized over (the other axes).
        stages: ``{stage index: ParallelModel}`` held here.
        layers: ``layers[j]`` are the decoder layer indices of stage ``j``.
        events: what the last step ran, where and when (:class:`Event`; per rank on a simulated
            mesh, this process's actions on real ranks, timing the compute without the wait
            for the input).
        span: the last step's wall time on this rank (real ranks), in seconds.
    """

    def __init__(
        self,
        mesh: Mesh,
        axis: str,
        sched: Schedule,
        stage_mesh: Mesh,
        stages: dict[int, Any],
        layers: list[range],
    ) -> None:
        self.mesh, self.axis, self.schedule, self.stage_mesh = mesh, axis, sched, stage_mesh
        self.stages, self.layers = stages, layers
        self.events: list[Event] = []
        self.span = 0.0  # the last step's wall time on this rank (real ranks), seconds
        self._ranks = (
            _Ranks(mesh, axis, _schedule_id(sched, layers)) if mesh.backend is not None else None
        )
        self.rank = self._ranks.index if self._ranks is not None else None

    @property
    def simulated(self) -> bool:
        """True on a plain mesh: every stage is here, each over the simulated stage mesh."""
        return self._ranks is None

    # ------------------------------------------------------------------ parameters
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters of the stages held here, by the model's own names."""
        for j in sorted(self.stages):
            yield from self.stages[j].named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters of the stages held here (give them to the optimizer)."""
        for _, p in self.named_parameters():
            yield p

    def grads(self, *, check: bool = True) -> dict[str, Tensor]:
        """The single-device gradients of the stages held here, by name (on real ranks a
        collective over each stage's mesh)."""
        out: dict[str, Tensor] = {}
        for j in sorted(self.stages):
            out.update(self.stages[j].grads(check=check))
        return out

    def state_dict(self) -> dict[str, Tensor]:
        """The single-device weights of the stages held here, by name."""
        out: dict[str, Tensor] = {}
        for j in sorted(self.stages):
            out.update(self.stages[j].state_dict())
        return out

    def load(self, source: Any, **kwargs: Any) -> None:
        """Load each stage held here from the whole model's single-device checkpoint (a
        ``save_pretrained`` directory, a safetensors file or a state dict), each rank reading
        only its stages' slices; a key a stage needs and the checkpoint lacks raises."""
        kwargs.setdefault("strict", "missing")
        for j in sorted(self.stages):
            self.stages[j].load(source, **kwargs)

    def data_parallel(self, axis: Any = "dp", engine: str = "fastdist", **kwargs: Any) -> None:
        """Reduce each stage's gradients over the data axes (`ParallelModel.data_parallel` on
        every stage held here). A step reduces once per stage, in the backward of the stage's
        last micro-batch (the earlier ones run under ``no_sync``).

        Only fastdist's engine (`fastdist.train.DataParallel`) is supported: DDP decides in each
        forward whether the next backward reduces, and a schedule runs several forwards before
        their backwards (1F1B); FSDP2 under a pipeline has not been tested. Both are refused
        rather than risked."""
        if engine != "fastdist":
            raise PipelineError(
                f"Pipeline.data_parallel: engine={engine!r} is not supported under a pipeline "
                "(DDP prepares each forward's reduction, and 1F1B runs several forwards before "
                "their backwards; FSDP2 is untested here). Fix: engine='fastdist'"
            )
        for j in sorted(self.stages):
            self.stages[j].data_parallel(axis, engine=engine, **kwargs)

    def grad_norm(self, norm_type: float = 2.0) -> Tensor:
        """The single-device total norm of every stage's gradients (a collective over the mesh
        on real ranks): ``[mesh.size]`` simulated, 0-d on real ranks."""
        return self._norm(norm_type)[0]

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip every stage's gradients by the whole model's single-device total norm, and
        return that norm (``fastdist.nn.clip_grad_norm_`` on one stage would see only that
        stage's norm and clip the stages by different factors).

        The norm combines each stage's (`fastdist.nn.grad_norm` rules: shards summed,
        replicas once) over the stages: ``(sum of p-th powers) ** (1/p)``, the largest for
        the inf-norm; on real ranks a collective over the whole mesh. Call it after the
        data-parallel reduction (after `step`)."""
        from fastdist.nn.clip import _coefficient, _scale

        total, grads = self._norm(norm_type)
        op = "Pipeline.clip_grad_norm_"
        coef = _coefficient(op, total, max_norm, norm_type, error_if_nonfinite)
        for j, gs in grads.items():
            # simulated: the factors of the ranks of stage j's rank along the axis
            _scale(
                gs,
                coef.index_select(0, self._stage_rows(j)) if self.simulated else coef,
                self.stage_mesh,
            )
        return total

    def _norm(self, norm_type: float) -> tuple[Tensor, dict[int, list[Tensor]]]:
        from fastdist.nn.clip import _norm_type, _total

        op = "Pipeline.clip_grad_norm_"
        p = _norm_type(norm_type, op)
        grads: dict[int, list[Tensor]] = {}
        per_stage: list[Tensor] = []
        for j in sorted(self.stages):
            total, gs, _ = _total(self.stages[j], p, None, op)
            grads[j] = gs
            t = total.to(torch.float64)
            if self.simulated:  # [stage mesh size] -> [mesh size]: rows of this stage's rank
                t = torch.zeros(self.mesh.size, dtype=torch.float64).index_copy(
                    0, self._stage_rows(j), t
                )
            per_stage.append(t if p == math.inf else t**p)
        if self.simulated:
            stacked = torch.stack(per_stage)  # [stages, mesh size]: zeros off the stage's rows
            # every rank: its stage-mesh index's value summed over the stages
            per_rank = stacked.amax(0) if p == math.inf else stacked.sum(0)
            by_index = per_rank.index_select(0, self._peers()).view(-1, self.mesh.size)
            combined = by_index.amax(0) if p == math.inf else by_index.sum(0)
        else:
            from fastdist.ops.collectives import pmax, psum

            mine = torch.stack(per_stage)
            local = mine.amax(0) if p == math.inf else mine.sum(0)
            combined = (pmax if p == math.inf else psum)(local, self.mesh, self.axis)
        total = combined if p == math.inf else combined ** (1.0 / p)
        dtype = next(self.parameters()).dtype
        return total.to(dtype), grads

    def _stage_rows(self, stage: int) -> Tensor:
        """The mesh ranks of ``stage``'s rank along the axis, in stage-mesh order."""
        r = self.schedule.rank_of(stage)
        return torch.tensor(
            [
                self.mesh.rank_of({**self.stage_mesh.coords(i), self.axis: r})
                for i in range(self.stage_mesh.size)
            ]
        )

    def _peers(self) -> Tensor:
        """For each pipeline-axis index r (outer) and mesh rank (inner): the mesh rank with r
        along the axis and the same other coordinates."""
        return torch.tensor(
            [
                self.mesh.rank_of({**self.mesh.coords(q), self.axis: r})
                for r in range(self.schedule.pp)
                for q in range(self.mesh.size)
            ]
        )

    def train(self, mode: bool = True) -> Pipeline:
        """Put every stage held here in training mode (``mode=False``: eval), as
        ``nn.Module.train`` does; returns the pipeline. (The model given to `pipeline` is not
        the stages: its ``train()`` / ``eval()`` do not reach their copies of its skeleton.)"""
        for pm in self.stages.values():
            pm.module.train(mode)
        return self

    def eval(self) -> Pipeline:
        """``train(False)``: every stage held here in eval mode (dropout off)."""
        return self.train(False)

    def zero_grad(self) -> None:
        """Drop every gradient of the stages held here (``grad = None``)."""
        for p in self.parameters():
            p.grad = None

    def reset(self) -> None:
        """Recover on real ranks after a failed step (a `CommError`, a `CollectiveTimeout`, or
        any error one rank raised mid-step, which drops the mesh's and the stage mesh's groups
        so that its peers fail at once): ``fastdist.comm.reset`` of the mesh and of the stage
        mesh, then drop the gradients. Call it on **every** rank, then redo the step.

        Resetting the mesh alone is not enough: a failure can leave the ranks of one stage at
        different points (one got its gradient and went on into the backward's collectives
        over the stage mesh, its peer in the stage waited for one that never came), which
        breaks the stage mesh's groups too. The gradients of the failed step are partial.
        """
        if self.simulated:
            raise PipelineError(
                "Pipeline.reset: a simulated pipeline has no process groups to reset. Fix: "
                "call it on real ranks (fastdist.connect) after a failed step"
            )
        reset_mesh(self.mesh)
        if self.stage_mesh.ndim:  # the mesh of no axes has no groups
            reset_mesh(self.stage_mesh)
        assert self._ranks is not None
        self._ranks.forget()  # the next step's transfers carry their headers again
        self.zero_grad()

    # ------------------------------------------------------------------ a step
    def step(self, **batch: Any) -> Tensor:
        """Forward and backward of one batch through the schedule; gradients accumulate into the
        parameters' ``.grad`` as one device's ``loss.backward()`` on the whole batch would.

        Args:
            batch: the model's keyword inputs for the whole batch: ``input_ids`` and ``labels``
                (required; or ``shift_labels``, labels already aligned with the positions as
                transformers' loss takes them), optionally ``attention_mask``,
                ``position_ids``. Every rank along
                the pipeline axis gets the same batch (stages after the first read only its
                shape and masks, the last stage its labels). On a simulated mesh each carries
                the leading rank dim ``[mesh.size, batch, ...]``.

        Returns:
            the loss of the whole batch (the mean over its predicted tokens), detached: on a
            simulated mesh ``[mesh.size]`` (every rank's), on real ranks a 0-d tensor on every
            rank of the pipeline axis.
        """
        micro = self._micro_batches(batch)
        self._check_same_batch(batch)
        if self._ranks is not None:
            # the first step with these input shapes sends every transfer's header (shape,
            # dtype, the sender's pipeline); later ones only the tensors
            self._ranks.signature = tuple(
                sorted(
                    (k, tuple(v.shape), v.dtype) for k, v in batch.items() if isinstance(v, Tensor)
                )
            )
        self.events = []
        if self.simulated:
            return self._run_simulated(micro)
        return self._run_ranks(micro)

    def _check_same_batch(self, batch: Mapping[str, Any]) -> None:
        """Every rank along the pipeline axis must be given the same batch: each stage reads its
        own copy (the first its ids, every stage the masks and positions, the last the labels),
        so copies that differ would mix two batches into one loss. Simulated: the rows are
        compared; real ranks: a digest of each input, all-gathered over the axis (one small
        collective per step)."""
        keys = sorted(k for k, v in batch.items() if isinstance(v, Tensor))
        if self.simulated:
            pp, size = self.schedule.pp, self.mesh.size
            for k in keys:
                v = batch[k]
                # [pp, mesh size, ...]: row r holds every rank's copy as the rank with pp=r has it
                rows = v.index_select(0, self._peers()).view(pp, size, *v.shape[1:])
                if not bool((rows == rows[:1]).all()):
                    self._differs(k)
            return
        from fastdist.ops.collectives import all_gather_invariant

        digests = []
        for k in keys:
            v = batch[k].detach().reshape(-1).long()  # [n]
            weights = torch.arange(v.numel(), device=v.device) % 1000003 + 1  # [n]
            digests.append(torch.stack([v.sum(), (v * weights).sum()]))
        mine = torch.stack(digests).reshape(1, -1)  # [1, 2 * len(keys)], int64
        every = all_gather_invariant(mine, self.mesh, self.axis, dim=0)  # [pp, 2 * len(keys)]
        for i, k in enumerate(keys):
            if not bool((every[:, 2 * i : 2 * i + 2] == every[:1, 2 * i : 2 * i + 2]).all()):
                self._differs(k)

    def _differs(self, key: str) -> None:
        raise PipelineError(
            f"Pipeline.step: the ranks along {self.axis!r} were given different {key} (every "
            "stage reads its own copy of the batch: the first its input_ids, every stage the "
            "masks and positions, the last the labels, so different copies would mix two "
            "batches into one loss). Fix: give every rank with the same coordinates on the "
            f"other axes the same batch (e.g. seed the data loader by the data-parallel index, "
            f"not by the global rank)"
        )

    def _micro_batches(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        m, sim = self.schedule.microbatches, self.simulated
        batch = dict(batch)
        if "labels" not in batch and isinstance(batch.get("shift_labels"), Tensor):
            batch["labels"] = batch["shift_labels"]  # the model computes a loss only with labels
        for key in ("input_ids", "labels"):
            if not isinstance(batch.get(key), Tensor):
                raise PipelineError(
                    f"Pipeline.step: {key}= is required (a tensor). Fix: pass input_ids= and "
                    "labels= (the loss is computed on the last stage)"
                )
        known = {"input_ids", "labels", "shift_labels", "attention_mask", "position_ids"}
        unknown = sorted(set(batch) - known)
        if unknown:
            raise PipelineError(
                f"Pipeline.step: inputs {unknown} are not supported. Fix: pass input_ids, labels "
                "(or shift_labels) and optionally attention_mask, position_ids"
            )
        ids = batch["input_ids"]
        bdim = 1 if sim else 0  # [rank, batch, seq] simulated, [batch, seq] on a rank
        if sim and (ids.dim() < 2 or ids.shape[0] != self.mesh.size):
            raise PipelineError(
                f"Pipeline.step: input_ids of shape {tuple(ids.shape)} on a simulated "
                f"{self.mesh!r}: every input carries the leading rank dim. Fix: pass "
                f"[{self.mesh.size}, batch, seq] (e.g. ids.expand({self.mesh.size}, *ids.shape))"
            )
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dim() != bdim + 2:
            raise PipelineError(
                f"Pipeline.step: input_ids of dtype {ids.dtype} and shape {tuple(ids.shape)}. "
                "Fix: integer token ids [batch, seq] (simulated: [rank, batch, seq])"
            )
        for key in ("attention_mask", "position_ids"):
            v = batch.get(key)
            if v is None:
                continue
            # the same [batch, seq] as input_ids (position_ids: or a batch of 1, broadcast)
            ok = isinstance(v, Tensor) and v.dim() == ids.dim() and v.shape[-1] == ids.shape[-1]
            ok = ok and v.shape[:bdim] == ids.shape[:bdim]
            ok = ok and v.shape[bdim] in (
                (ids.shape[bdim], 1) if key == "position_ids" else (ids.shape[bdim],)
            )
            if not ok:
                raise PipelineError(
                    f"Pipeline.step: {key} of shape {tuple(getattr(v, 'shape', ()))} for input_ids "
                    f"of shape {tuple(ids.shape)}. Fix: a tensor of input_ids' shape"
                    + (" (simulated: with the leading rank dim)" if sim else "")
                )
        b = ids.shape[bdim]
        if b % m:
            divisors = [d for d in range(1, b + 1) if b % d == 0]
            raise PipelineError(
                f"Pipeline.step: a batch of {b} sequences does not split into {m} micro-batches "
                f"(schedule {self.schedule.name!r}). Fix: a batch size that is a multiple of {m}, "
                f"or microbatches= one of {divisors}"
            )
        aligned = isinstance(batch.get("shift_labels"), Tensor)
        labels = batch["shift_labels" if aligned else "labels"]
        if labels.dim() != bdim + 2 or labels.shape[: bdim + 1] != ids.shape[: bdim + 1]:
            raise PipelineError(
                f"Pipeline.step: {'shift_labels' if aligned else 'labels'} of shape "
                f"{tuple(labels.shape)} for input_ids of shape {tuple(ids.shape)}. Fix: "
                "[batch, seq] (simulated: [rank, batch, seq]), as input_ids"
            )
        # predicted tokens of the whole batch (-100 ignored; labels shift by one), per rank
        dims = tuple(range(1, labels.dim())) if sim else tuple(range(labels.dim()))
        count = ((labels if aligned else labels[..., 1:]) != -100).sum(dims)
        out = []
        for k in range(m):
            mb: dict[str, Any] = {}
            for key, v in batch.items():
                if isinstance(v, Tensor) and v.dim() > bdim and v.shape[bdim] == b:
                    mb[key] = v.narrow(bdim, k * (b // m), b // m)
                else:
                    mb[key] = v
            mb["num_items_in_batch"] = count
            out.append(mb)
        return out

    def _rows(self, stage: int, mb: Mapping[str, Any]) -> dict[str, Any]:
        """A simulated stage's inputs: the rows of the ranks at its index along the axis."""
        rows = self._stage_rows(stage)
        return {k: v.index_select(0, rows) if isinstance(v, Tensor) else v for k, v in mb.items()}

    def _forward(self, j: int, mb: Mapping[str, Any], x: Tensor | None) -> Tensor:
        pm = self.stages[j]
        kwargs = dict(mb)
        if j != self.schedule.stages - 1:
            for key in ("labels", "shift_labels", "num_items_in_batch"):
                kwargs.pop(key, None)
        per_rank = {_STAGE_INPUT: x} if x is not None else {}
        out = pm._call((), kwargs, per_rank)
        if j == self.schedule.stages - 1:
            out = out.loss if hasattr(out, "loss") else out["loss"]
        assert isinstance(out, Tensor)  # the loss, or the last own layer's output (_StageHooks)
        return out

    def _backward(self, j: int, y: Tensor, g: Tensor | None, last_of_stage: bool) -> None:
        pm = self.stages[j]
        ctx = pm.no_sync() if not last_of_stage else _nothing()
        with ctx:
            # the last stage: every rank's own loss (simulated: their sum); else the output's
            torch.autograd.backward(y.sum() if g is None else y, g)

    def _run_simulated(self, micro: list[dict[str, Any]]) -> Tensor:
        s = self.schedule
        last = s.stages - 1
        acts: dict[tuple[int, int], Tensor] = {}  # (stage, micro) -> activation into the stage
        grads: dict[tuple[int, int], Tensor] = {}  # (stage, micro) -> gradient of its output
        inputs: dict[tuple[int, int], Tensor] = {}
        outputs: dict[tuple[int, int], Tensor] = {}
        left_b = {j: s.microbatches for j in range(s.stages)}
        loss: Tensor | None = None
        t0 = time.perf_counter()
        for a in s.order():
            j, m = a.stage, a.microbatch
            start = time.perf_counter() - t0
            if a.kind == "F":
                x = acts.pop((j, m), None)
                if x is not None:
                    x = x.detach().requires_grad_(True)
                    inputs[(j, m)] = x
                y = self._forward(j, self._rows(j, micro[m]), x)
                outputs[(j, m)] = y
                if j == last:
                    loss = y.detach() if loss is None else loss + y.detach()
                else:
                    acts[(j + 1, m)] = y
            else:
                left_b[j] -= 1
                self._backward(j, outputs.pop((j, m)), grads.pop((j, m), None), not left_b[j])
                x = inputs.pop((j, m), None)
                if x is not None:
                    grads[(j - 1, m)] = _grad_of(x, j, m)
            self.events.append(Event(s.rank_of(j), a.kind, m, j, start, time.perf_counter() - t0))
        assert loss is not None
        # every rank's loss: rank r holds its stage-mesh index's loss of the last stage
        idx = torch.tensor(
            [
                self.stage_mesh.rank_of(
                    {a: c for a, c in self.mesh.coords(r).items() if a != self.axis}
                )
                for r in range(self.mesh.size)
            ]
        )
        return loss.index_select(0, idx)

    def _run_ranks(self, micro: list[dict[str, Any]]) -> Tensor:
        assert self._ranks is not None and self.rank is not None
        s, me, ranks = self.schedule, self.rank, self._ranks
        last = s.stages - 1
        device = next(self.parameters()).device
        inputs: dict[tuple[int, int], Tensor] = {}
        outputs: dict[tuple[int, int], Tensor] = {}
        local: dict[tuple[str, int, int], Tensor] = {}  # transfers between stages on this rank
        left_b = {j: s.microbatches for j in s.stages_of(me)}
        loss = torch.zeros((), dtype=torch.float64, device=device)
        t0 = time.perf_counter()
        try:
            for a in s.actions[me]:
                j, m = a.stage, a.microbatch
                if a.kind == "F":
                    x = None
                    if j > 0:
                        src = s.rank_of(j - 1)
                        x = (
                            local.pop(("F", m, j))
                            if src == me
                            else ranks.recv(src, "F", m, j, device)
                        )
                        x = x.detach().requires_grad_(True)
                        inputs[(j, m)] = x
                    start = time.perf_counter() - t0  # compute only: the wait is idle time
                    y = self._forward(j, micro[m], x)
                    end = time.perf_counter() - t0
                    outputs[(j, m)] = y
                    if j == last:
                        loss += y.detach().to(torch.float64)
                    elif s.rank_of(j + 1) == me:
                        local[("F", m, j + 1)] = y
                    else:
                        ranks.send(y, s.rank_of(j + 1), "F", m, j + 1)
                else:
                    g = None
                    if j < last:
                        src = s.rank_of(j + 1)
                        g = (
                            local.pop(("B", m, j))
                            if src == me
                            else ranks.recv(src, "B", m, j, device)
                        )
                    left_b[j] -= 1
                    start = time.perf_counter() - t0
                    self._backward(j, outputs.pop((j, m)), g, not left_b[j])
                    end = time.perf_counter() - t0
                    x = inputs.pop((j, m), None)
                    if x is not None:
                        gx = _grad_of(x, j, m)
                        if s.rank_of(j - 1) == me:
                            local[("B", m, j - 1)] = gx
                        else:
                            ranks.send(gx, s.rank_of(j - 1), "B", m, j - 1)
                self.events.append(Event(me, a.kind, m, j, start, end))
            ranks.finish()
            self.span = time.perf_counter() - t0
        except Exception as e:
            # peers wait on this rank's transfers and its stage's collectives: drop the groups of
            # both meshes so that they fail now, not at their timeout (a fastdist error dropped
            # only the groups of the mesh it happened on)
            why = f"the pipeline step failed on this rank ({type(e).__name__}: {e})"
            for held in (self.mesh, self.stage_mesh):
                if held._comm is not None and held._comm.broken is None:
                    held._comm.abandon(why)
            raise
        finally:
            ranks.pending.clear()
        from fastdist.ops.collectives import broadcast

        # the last stage's loss on every rank of the pipeline axis
        dtype = next(self.parameters()).dtype
        return broadcast(loss, self.mesh, self.axis, src=s.rank_of(last)).to(dtype)

    # ------------------------------------------------------------------ inspection
    def show(self) -> str:
        """The schedule's timeline (see `Schedule.show`)."""
        return self.schedule.show()

    def measured_bubble(self) -> dict[int, float]:
        """This rank's idle share of the last step: ``1 - (time computing its actions) / (the
        step's wall time)``, from :attr:`events` (each action's compute, not the wait for its
        input) and :attr:`span`; ``{rank along the axis: share}``."""
        if self.simulated:
            raise PipelineError(
                "Pipeline.measured_bubble: on a simulated mesh the stages run one after another in "
                "one process, so there is no idle time to measure. Fix: pipe.schedule.bubble() "
                "for the schedule's own, or measure on real ranks"
            )
        if not self.events:
            raise PipelineError("Pipeline.measured_bubble: no step has run. Fix: call step first")
        span = self.span
        out: dict[int, float] = {}
        for r in sorted({e.rank for e in self.events}):
            busy = sum(e.end - e.start for e in self.events if e.rank == r)
            out[r] = 1.0 - busy / span if span > 0 else 0.0
        return out


class _nothing:  # noqa: N801 - a context manager used like contextlib.nullcontext
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _grad_of(x: Tensor, stage: int, micro: int) -> Tensor:
    if x.grad is None:
        raise PipelineError(
            f"pipeline: stage {stage}'s input got no gradient in the backward of micro-batch "
            f"{micro} (its output does not depend on it). Fix: report this as a fastdist bug"
        )
    return x.grad


def pipeline(
    model: nn.Module,
    mesh: Mesh,
    *,
    axis: str = "pp",
    schedule: str | Schedule = "1f1b",
    microbatches: int | None = None,
    virtual: int = 1,
    plan: Mapping[str, Any] | None = None,
    sequence_parallel: bool = False,
    layers_per_stage: Sequence[int] | None = None,
    split: StageSplit | None = None,
) -> Pipeline:
    """Split ``model`` into pipeline stages over ``axis`` and parallelize each stage over the
    mesh's other axes.

    Args:
        model: a transformers causal LM (a family of :data:`SPLITS`), with weights or built on
            the meta device. It is taken apart: use the returned pipeline, not ``model`` (its
            calls raise), and build the optimizer afterwards from ``pipe.parameters()``: one
            built before holds the model's old parameters, which receive no gradient, and
            torch's optimizers skip those without a word.
        mesh: a plain mesh (simulated ranks: every stage here) or a ``fastdist.connect`` mesh
            (this process builds and holds only its own stages).
        axis: the pipeline axis of ``mesh``.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` or a built `Schedule`.
        microbatches: micro-batches per step (default: the axis size).
        virtual: stages per rank (``"interleaved_1f1b"``; default 2 there).
        plan: the plan for the whole model (default: the ready plan of its family over the
            other axes); each stage applies the entries that match its modules.
        sequence_parallel: for the default plan: Megatron sequence parallelism over ``tp``
            (stages hand on sequence shards).
        layers_per_stage: layers of each stage (default: even); ``pp * virtual`` ints.
        split: where the decoder layers and the ends are (default: ``SPLITS[model_type]``).

    Returns:
        the :class:`Pipeline`.

    >>> import torch, fastdist as fd
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    >>> model = LlamaForCausalLM(cfg).double()
    >>> ids = torch.randint(0, 64, (4, 8))
    >>> logits = model(input_ids=ids).logits                  # one device, float64
    >>> one_device = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64),
    ...                                                 ids[:, 1:].reshape(-1))
    >>> mesh = fd.Mesh({"pp": 2, "tp": 2})
    >>> pipe = fd.train.pipeline(model, mesh, schedule="1f1b", microbatches=2)
    >>> loss = pipe.step(input_ids=ids.expand(4, 4, 8), labels=ids.expand(4, 4, 8))
    >>> loss.dtype, bool(torch.allclose(loss, one_device.detach(), rtol=1e-12, atol=0))
    (torch.float64, True)
    """
    if not isinstance(mesh, Mesh):
        raise PipelineError(f"pipeline: mesh={mesh!r} is not a fastdist.Mesh. Fix: pass one")
    if axis not in mesh.axis_names:
        raise PipelineError(
            f"pipeline: {mesh!r} has no axis {axis!r}. Fix: add it (e.g. Mesh({{'{axis}': 2, "
            f"'tp': 2}})) or pass axis= one of {mesh.axis_names}"
        )
    pp = mesh.shape[axis]
    if isinstance(schedule, Schedule):
        sched = schedule
        if sched.pp != pp:
            raise PipelineError(
                f"pipeline: the schedule is for pp={sched.pp}, the mesh's {axis!r} has {pp} "
                "ranks. Fix: build the schedule for the mesh's axis size"
            )
    else:
        sched = _schedule_for(schedule, pp, pp if microbatches is None else microbatches, virtual)
    _, fam = _family(model) if split is None else ("", split)
    layer_list = _layer_list(model, fam)
    ranges = stage_layers(len(layer_list), sched.stages, layers_per_stage)
    stage_mesh = mesh.without(axis)  # real ranks: over this process's slice
    if mesh.backend is None:
        keep = list(range(sched.stages))
    else:
        keep = list(sched.stages_of(mesh.index(mesh.rank, axis)))
    from fastdist.nn.parallelize import parallelize
    from fastdist.nn.plans import plan_for

    if plan is None:
        plan = (
            plan_for(model, stage_mesh, sequence_parallel=sequence_parallel)
            if "tp" in stage_mesh.axis_names
            else {}
        )
    modules = _split_model(model, fam, ranges, keep)
    _retire(model)
    stages: dict[int, Any] = {}
    for j, module in modules.items():
        pm = parallelize(module, stage_mesh, _stage_plan(plan, module))
        own = _layer_list(module, fam)
        first = None if j == 0 else own[ranges[j][0]]
        last = None if j == sched.stages - 1 else own[ranges[j][-1]]
        if last is None and hasattr(type(module), "loss_function"):
            from fastdist.nn.parallelize import _HFCausalLMLoss

            if not isinstance(getattr(module, "loss_function", None), _HFCausalLMLoss):
                # no vocabulary-parallel head (no tp): fastdist's loss all the same, so that the
                # step's loss and gradients keep the model's dtype (transformers' own loss
                # computes in float32), as with a tp plan
                axis_name = stage_mesh.axis_names[-1] if stage_mesh.ndim else "tp"
                module.loss_function = _HFCausalLMLoss(stage_mesh, axis_name, gathered=True)  # type: ignore[assignment]
        pm._stage_hooks = _StageHooks(module, first, last)  # type: ignore[attr-defined]
        stages[j] = pm
    return Pipeline(mesh, axis, sched, stage_mesh, stages, ranges)


def _retire(model: nn.Module) -> None:
    """The model given to `pipeline` lends its layers and ends to the stages, which parallelize
    them in place: called afterwards it would run a mix of both. Its calls raise instead."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        raise PipelineError(
            f"{type(model).__name__} was taken apart by fastdist.train.pipeline: its layers now "
            "belong to the pipeline's stages (parallelized in place). Fix: call the Pipeline "
            "(pipe.step), and build the optimizer from pipe.parameters(); for a one-device "
            "model, copy.deepcopy it before pipeline()"
        )

    model.forward = forward


def _layer_list(model: nn.Module, split: StageSplit) -> nn.ModuleList:
    try:
        layers = model.get_submodule(split.layers)
    except AttributeError:
        raise PipelineError(
            f"pipeline: {type(model).__name__} has no module {split.layers!r} (the decoder "
            "layers). Fix: pass split= naming its layer list"
        ) from None
    if not isinstance(layers, nn.ModuleList):
        raise PipelineError(
            f"pipeline: {split.layers} of {type(model).__name__} is a {type(layers).__name__}, "
            "not an nn.ModuleList of decoder layers. Fix: pass split= naming the layer list"
        )
    return layers


def _work(work: Any) -> Any:
    """A started transfer's handle (torch types it as optional)."""
    assert work is not None
    return work


def _schedule_for(name: Any, pp: int, microbatches: int, virtual: int) -> Schedule:
    if not isinstance(name, str):
        raise PipelineError(
            f"pipeline: schedule={name!r}. Fix: a name ('gpipe', '1f1b', 'interleaved_1f1b') or "
            "a fastdist.train.schedules.Schedule"
        )
    return schedule(name, pp, microbatches, virtual)
