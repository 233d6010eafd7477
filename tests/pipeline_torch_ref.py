"""torch.distributed.pipelining on an unmodified HF Llama, and the one-device reference it must
equal (importable by ``fastdist.testing.run_on_gloo`` and by ``benchmarks/pipeline.py``).

The comparison side of issue 34 point 4: the same model (same seed, float64), split by layer
index the way fastdist's pipeline splits it, run through torch's own ``PipelineStage`` and
schedules on gloo processes.

Public helpers:

* `llama_config(**overrides)`: a small ``LlamaConfig`` (float64-safe, untied embeddings; from
  tests/tiny_models.py).
* `make_batch(config, batch, seq, seed)`: the ``(ids, labels)`` every side uses.
* `reference(config, ids, labels, seed)`: one device, float64: loss and every gradient by the
  model's own parameter names.
* `LlamaStage` / `split_llama(model, n_stages)`: the stage modules (embedding on the first,
  final norm + LM head on the last; each stage makes its own rotary embeddings and causal mask).
* `torch_pipeline_step(config_kwargs, schedule, microbatches, seed, batch, seq, ...)`: one
  rank's run of torch's schedule: loss, this rank's gradients by HF name, step times and the
  measured bubble (`StageTimer`); `torch_pipeline_cases(cases)`: several such runs on the same
  processes.
* `StageTimer(stages)`: busy time and per-action start/end inside torch's schedules;
  `replay_bubble(actions)`: the bubble those actions leave with free communication.
* `bubble_theory(schedule, pp, microbatches, stages_per_rank)`.

What made torch's pipelining hang or lose stage 0's gradients (torch 2.13, gloo, checked on 2
processes; see `torch_pipeline_step`, which avoids both):

1. **``loss_fn`` given to the last rank's schedule only.** A schedule's ``_has_backward`` is
   ``loss_fn is not None``, decided per schedule object, i.e. per rank. A rank whose schedule
   has no ``loss_fn`` runs its stage forward-only (``stage.has_backward = False``: no backward,
   no gradient receives). Without ``input_args``/``output_args`` (dynamic metadata) the last
   stage's warm-up runs the backward metadata inference and blocks in ``send_object_list``
   (``_backward_metadata_inference`` -> ``_send_meta``) to a stage 0 that never posts the
   matching receive, while stage 0 blocks waiting for its first forward send: the hang "in
   shape inference". With static metadata there is no metadata exchange: under GPipe rank 0
   returns from ``step()`` with every parameter's ``.grad`` None (the last stage is left
   waiting on its gradient send and fails when rank 0's process goes); under 1F1B both ranks
   deadlock in the steady state (the last stage's gradient send is never received). Fix: give
   every rank's schedule the same ``loss_fn`` (only the last stage calls it).
2. **Example tensors that do not require grad.** With static metadata, the ``requires_grad``
   of the examples is taken as the truth about the activations: the receiving stage's buffer
   gets ``requires_grad = input_args.requires_grad`` and an output whose example does not
   require grad gets no gradient receive. Stage 1's ``input_args`` made with
   ``torch.zeros(...)`` (no grad) while stage 0's ``output_args`` requires grad: stage 1
   computes no input gradient and sends none, stage 0 waits for it forever (hang). Stage 0's
   ``output_args`` without grad: stage 0's backward gets ``None`` for its output and raises
   "grad can be implicitly created only for scalar outputs". Fix: floating examples with
   ``requires_grad=True`` (`_stage_example`, `_stage_output_example`).

With ``loss_fn`` on every rank, both dynamic and static metadata give gradients equal to one
device's (tests/test_pipeline_torch.py runs both).

Loss scaling: each micro-batch's loss is the mean cross-entropy over its tokens; the schedules
(``scale_grads=True``, the default) divide every parameter's accumulated gradient by the number
of micro-batches after the last backward (``PipelineScheduleSingle.perform_reduce_grad`` /
``stage.scale_grads`` in the multi-stage schedules), so the gradients are those of the mean of
the micro-batch means, which equals the whole batch's mean when every micro-batch has the same
number of tokens (no ignored labels). The losses the schedule returns are unscaled; the step's
loss is their mean. The division applies to ``p.grad`` as a whole, including what it held
before the step: gradients accumulated over several ``step()`` calls are divided again at each
one, so they are set to None before each step here.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdist.errors import PipelineError
from tests.tiny_models import llama_config

#: schedule name -> (torch class name, stages per rank it needs: None = any >= 1)
SCHEDULES: dict[str, tuple[str, int | None]] = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", None),
}


def build_model(config: Any, seed: int) -> Any:
    """``LlamaForCausalLM(config)`` initialised under ``torch.manual_seed(seed)``, float64,
    train mode (dropout is 0 in the Llama config)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config).double().train()


def make_batch(config: Any, batch: int, seq: int, seed: int) -> tuple[Tensor, Tensor]:
    """``(ids, labels)``, each ``[batch, seq]`` int64, drawn from ``seed`` (labels independent of
    ids: every position is a scored token, none ignored)."""
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    labels = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    return ids, labels


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean token cross-entropy; ``logits`` ``[b, s, V]``, ``labels`` ``[b, s]`` (already
    aligned with the positions: no shift here)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))  # [b*s, V]


def reference(
    config: Any, ids: Tensor, labels: Tensor, seed: int
) -> tuple[Tensor, dict[str, Tensor]]:
    """One device, float64: ``(loss, {hf_name: grad})`` of `lm_loss` over the whole batch for
    the model `build_model(config, seed)` makes."""
    model = build_model(config, seed)
    loss = lm_loss(model(input_ids=ids).logits, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


class LlamaStage(nn.Module):
    """Layers ``[lo, hi)`` of an HF Llama as one pipeline stage.

    First stage: ``forward(ids [b, s] int64) -> hidden [b, s, h]``; middle stages
    ``hidden -> hidden``; last stage ``hidden -> logits [b, s, V]`` (final norm + LM head); a
    single stage does all of it. Positions are ``0..s-1`` (no padding, no cache); the rotary
    embeddings and the causal mask are made here from the hidden states' shape, as
    ``LlamaModel.forward`` makes them. The submodules are the model's own (shared, not copied),
    so gradients land on the model's parameters; `hf_names` maps this module's parameter names to
    the model's.
    """

    def __init__(self, model: Any, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        inner = model.model
        self.config = model.config
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): inner.layers[i] for i in range(lo, hi)})
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = copy.deepcopy(inner.rotary_emb)  # buffers only
        hf = {id(p): n for n, p in model.named_parameters()}
        self.hf_names = {n: hf[id(p)] for n, p in self.named_parameters()}

    def forward(self, x: Tensor) -> Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.embed_tokens(x) if self.embed_tokens is not None else x  # [b, s, h]
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)  # [1, s]
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=h,
            attention_mask=None,
            past_key_values=None,
            position_ids=position_ids,
        )
        pos = self.rotary_emb(h, position_ids=position_ids)
        for layer in self.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=pos, position_ids=position_ids)
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))  # [b, s, V]
        return h


def split_llama(model: Any, n_stages: int) -> list[LlamaStage]:
    """``n_stages`` consecutive `LlamaStage` s, ``num_hidden_layers / n_stages`` layers each.

    Raises:
        PipelineError: the stage count does not divide the layer count.
    """
    n_layers = model.config.num_hidden_layers
    if n_stages < 1 or n_layers % n_stages:
        raise PipelineError(
            f"split_llama: {n_stages} stages do not divide {n_layers} layers. "
            f"Fix: use a stage count that divides num_hidden_layers={n_layers}."
        )
    per = n_layers // n_stages
    return [
        LlamaStage(model, s * per, (s + 1) * per, first=s == 0, last=s == n_stages - 1)
        for s in range(n_stages)
    ]


def bubble_theory(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle fraction of each rank when every stage takes the same time per micro-batch:
    ``(pp - 1) / (m + pp - 1)`` for GPipe and 1F1B, ``(pp - 1) / (v * m + pp - 1)`` for
    interleaved 1F1B with ``v`` stages per rank."""
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


#: one compute action of a rank: (stage index, "F" | "B" | "W", micro-batch, start s, end s),
#: times from the step's start (B: the full backward, or the input-gradient half when a "W"
#: follows; the last stage's loss counted in its F)
Action = tuple[int, str, int, float, float]


class StageTimer:
    """Busy time of one rank inside a pipeline schedule: wall-clock seconds spent in the stages'
    ``forward_one_chunk`` / ``backward_one_chunk`` (and ``backward_weight_one_chunk``) and in the
    loss function, and each of those actions' start and end (`actions`).

    Those are the schedule's compute actions: torch's schedules post and wait for every send and
    receive outside them (``get_*_ops`` + ``_batch_p2p``/``_wait_batch_p2p``), so the time
    outside them is waiting for a peer (the bubble) plus communication and the schedule's own
    bookkeeping. ``1 - busy / wall`` is what the pipeline leaves idle on this rank; it is the
    theory's bubble plus those overheads (`replay_bubble` takes the overheads out). Wraps the
    methods on the stage instances (their classes are untouched); `wrap_loss` wraps a loss
    function the same way. Call `reset` at the start of each step.
    """

    def __init__(self, stages: list[Any]) -> None:
        self.busy, self.start = 0.0, time.perf_counter()
        self.actions: list[Action] = []
        for stage in stages:
            for name, kind in (
                ("forward_one_chunk", "F"),
                ("backward_one_chunk", "B"),
                ("backward_weight_one_chunk", "W"),
            ):
                setattr(stage, name, self._timed(getattr(stage, name), stage.stage_index, kind))

    def _timed(self, fn: Callable[..., Any], stage_index: int, kind: str) -> Callable[..., Any]:
        def timed(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(chunk_id, *args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self.busy += t1 - t0
                self.actions.append((stage_index, kind, chunk_id, t0 - self.start, t1 - self.start))

        return timed

    def wrap_loss(self, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
        """``loss_fn`` timed into `busy` and into the last stage's forward action that precedes
        it (the schedules compute the loss right after that forward)."""

        def timed(output: Tensor, target: Tensor) -> Tensor:
            t0 = time.perf_counter()
            try:
                return loss_fn(output, target)
            finally:
                dt = time.perf_counter() - t0
                self.busy += dt
                if self.actions and self.actions[-1][1] == "F":  # not in metadata inference
                    s, kind, mb, a, b = self.actions[-1]
                    self.actions[-1] = (s, kind, mb, a, b + dt)

        return timed

    def reset(self) -> None:
        self.busy, self.start, self.actions = 0.0, time.perf_counter(), []


def replay_bubble(actions: list[list[Action]]) -> list[float]:
    """The idle fraction each rank would have if communication and the schedule's bookkeeping
    were free: every rank runs its recorded actions (``actions[rank]``, in the order it ran
    them) with their measured durations, each as soon as the rank is free and its inputs exist
    (F of stage s, micro-batch i after F of s - 1, i; B of s, i after F of s, i and B of
    s + 1, i; W after B). Theory's bubble assumes equal stages too; this one keeps the stages'
    real (unequal) times. Returns ``1 - busy / makespan`` per rank.

    Raises:
        PipelineError: the actions cannot all run (a dependency never recorded).
    """
    n_stages = 1 + max(a[0] for acts in actions for a in acts)
    done: dict[tuple[int, str, int], float] = {}
    free, pos = [0.0] * len(actions), [0] * len(actions)
    moved = True
    while moved:
        moved = False
        for r, acts in enumerate(actions):
            while pos[r] < len(acts):
                s, kind, mb, t0, t1 = acts[pos[r]]
                deps = {
                    "F": [(s - 1, "F", mb)] if s > 0 else [],
                    "B": [(s, "F", mb)] + ([(s + 1, "B", mb)] if s < n_stages - 1 else []),
                    "W": [(s, "B", mb)],
                }[kind]
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                done[(s, kind, mb)] = free[r] = start + (t1 - t0)
                pos[r] += 1
                moved = True
    stuck = [r for r, acts in enumerate(actions) if pos[r] < len(acts)]
    if stuck:
        raise PipelineError(
            f"replay_bubble: ranks {stuck} have actions whose inputs were never recorded "
            f"(first: {[actions[r][pos[r]][:3] for r in stuck]}). Fix: pass every rank's "
            f"actions of one step."
        )
    makespan = max(free)
    return [1 - sum(a[4] - a[3] for a in acts) / makespan for acts in actions]


def _stage_example(module: LlamaStage, stage_index: int, mb: int, seq: int, config: Any) -> Tensor:
    """The example input of a stage for static metadata: int64 ids on the first stage, else a
    float64 ``[mb, seq, hidden]`` activation that *requires grad* (cause 2 of the module
    docstring: an example without it leaves the previous stage waiting for a gradient that is
    never sent)."""
    if stage_index == 0:
        return torch.zeros(mb, seq, dtype=torch.long)
    return torch.zeros(mb, seq, config.hidden_size, dtype=torch.float64, requires_grad=True)


def _stage_output_example(module: LlamaStage, mb: int, seq: int, config: Any) -> Tensor:
    """The example output: ``[mb, seq, hidden]`` (logits ``[mb, seq, V]`` on the last stage),
    float64, requiring grad (it is produced by the stage's parameters)."""
    width = config.vocab_size if module.lm_head is not None else config.hidden_size
    return torch.zeros(mb, seq, width, dtype=torch.float64, requires_grad=True)


def torch_pipeline_step(
    config_kwargs: dict[str, Any],
    schedule: str,
    microbatches: int,
    seed: int,
    batch: int,
    seq: int,
    stages_per_rank: int = 1,
    steps: int = 3,
    static_meta: bool = True,
) -> dict[str, Any]:
    """One rank of torch's pipeline on the gloo processes of ``run_on_gloo``: the model of
    `build_model(llama_config(**config_kwargs), seed)` split into ``world * stages_per_rank``
    stages (rank ``r`` holds stages ``r, r + world, ...``), run by torch's ``schedule``
    (``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``) over ``microbatches`` micro-batches of
    `make_batch(config, batch, seq, seed)`, ``steps`` times (gradients set to None before each;
    the first step is not timed).

    Returns, on every rank:
        ``loss``: the step's loss (mean of the micro-batch losses) on the rank of the last
        stage, else None; ``grads``: ``{hf_name: grad}`` of this rank's parameters after the
        last step (None where a parameter got no gradient); ``step_s``: the median over the
        timed steps of the step's wall time (the slowest rank's, from a common barrier);
        ``busy_s`` / ``bubble``: this rank's median busy time and ``1 - busy / step wall``
        (`StageTimer`); ``bubble_replay``: the median of `replay_bubble` (the same actions with
        free communication); ``actions``: this rank's `Action` s of the last step; ``rank``,
        ``stages`` (indices held here).

    Raises:
        PipelineError: an unknown schedule, or a stage count the schedule or the layers do not
        allow.
    """
    import torch.distributed as dist
    from torch.distributed import pipelining

    torch.set_num_threads(1)
    if schedule not in SCHEDULES:
        raise PipelineError(
            f"torch_pipeline_step: unknown schedule {schedule!r}. Fix: use one of "
            f"{sorted(SCHEDULES)}."
        )
    cls_name, needs = SCHEDULES[schedule]
    if needs is not None and stages_per_rank != needs:
        raise PipelineError(
            f"torch_pipeline_step: {schedule} runs {needs} stage per rank, got "
            f"stages_per_rank={stages_per_rank}. Fix: use interleaved_1f1b for several."
        )
    if batch % microbatches:
        raise PipelineError(
            f"torch_pipeline_step: batch {batch} does not split into {microbatches} equal "
            f"micro-batches. Fix: a batch that is a multiple of the micro-batch count."
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    config = llama_config(**config_kwargs)
    model = build_model(config, seed)
    n_stages = world * stages_per_rank
    all_stages = split_llama(model, n_stages)
    mine = list(range(rank, n_stages, world))
    mb = batch // microbatches
    stages = []
    for s in mine:
        meta: dict[str, Any] = {}
        if static_meta:
            meta = dict(
                input_args=_stage_example(all_stages[s], s, mb, seq, config),
                output_args=_stage_output_example(all_stages[s], mb, seq, config),
            )
        stages.append(
            pipelining.PipelineStage(all_stages[s], s, n_stages, torch.device("cpu"), **meta)
        )
    timer = StageTimer(stages)
    cls = getattr(pipelining, cls_name)
    loss_fn = timer.wrap_loss(lm_loss)
    sched = cls(stages if needs is None else stages[0], microbatches, loss_fn=loss_fn)
    ids, labels = make_batch(config, batch, seq, seed)
    has_first, has_last = 0 in mine, n_stages - 1 in mine

    walls, busys, actions, loss = [], [], [], None
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        losses: list[Tensor] = []
        dist.barrier()
        timer.reset()
        sched.step(
            *((ids,) if has_first else ()),
            **({"target": labels, "losses": losses} if has_last else {}),
        )
        walls.append(time.perf_counter() - timer.start)
        busys.append(timer.busy)
        actions.append(timer.actions)
        if has_last:
            loss = torch.stack(losses).mean().detach()
    # the step's wall time is the slowest rank's (all started at the barrier)
    wall = torch.tensor(walls, dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, actions)
    timed = range(1, steps) if steps > 1 else range(steps)  # the first step infers metadata
    replay = [replay_bubble([every[r][i] for r in range(world)])[rank] for i in timed]
    grads = {
        module.hf_names[n]: (None if p.grad is None else p.grad.detach().clone())
        for s in mine
        for module in (all_stages[s],)
        for n, p in module.named_parameters()
    }
    return {
        "rank": rank,
        "stages": mine,
        "loss": loss,
        "grads": grads,
        "step_s": statistics.median(float(wall[i]) for i in timed),
        "busy_s": statistics.median(busys[i] for i in timed),
        "bubble": statistics.median(1 - busys[i] / float(wall[i]) for i in timed),
        "bubble_replay": statistics.median(replay),
        "actions": actions[-1],
    }


def torch_pipeline_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`torch_pipeline_step` for each keyword dict of ``cases`` in turn, on the same gloo
    processes (one start-up for several schedules); the results in the same order."""
    return [torch_pipeline_step(**case) for case in cases]
