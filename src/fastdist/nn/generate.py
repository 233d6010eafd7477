"""Generation with a parallel model: Hugging Face ``generate`` made exact on real and simulated
ranks.

A plan's vocabulary-parallel LM head gives each rank its share of the logits, which is what a
loss wants and what ``generate`` must not see: the argmax (or a sample) inside one rank's share
is a wrong token, silently. Two things make generation right:

* `DirectCalls`, hooks `fastdist.nn.parallelize` puts on a model whose layers it split: a call
  of the model itself (``model(...)``: not through `ParallelModel`) gets the whole vocabulary's
  logits, as the unmodified model returns them, and on real ranks its token inputs are checked
  equal across the ranks of every group the plan splits over (ranks that drew different
  samples in a loop of their own diverge; they are stopped at the next step, never silently).
  The model's own ``model.generate(...)`` is `OwnGenerate`, which runs as `generate` does on
  real ranks (`generate_on_ranks`): the last sampled token, which no forward follows, is the
  same on every rank too. On a simulated mesh such calls cannot run (the parameters hold every
  rank's shard): they raise, naming `ParallelModel.generate`.
* `generate` (`ParallelModel.generate`): the inputs checked once, every rank of a group drawing
  with the random state of the group's first rank (so sampling draws one device's tokens, and
  the other ranks' own random state is left as it was), then the model's own ``generate``. On a
  simulated mesh every step runs all ranks through `ParallelModel` without a KV cache (a cache
  object cannot leave the simulation), fine for a notebook's few tokens.

A context-parallel model (`fastdist.nn.CausalContextParallel`) prefills a prompt whose length
divides by ``2 x cp`` split over the sequence and keeps the KV cache split: each decoding step's
single token runs on every rank, attending over every rank's shard of the cache (a log-sum-exp
merge over ``cp``). Megatron sequence parallelism (``sequence_parallel=True``) runs
a call whose tokens divide the ranks split (the prefill) and one whose tokens do not (a
decoding step's single token) on the whole sequence on every rank
(`fastdist.nn.styles.whole_sequence`). Both read the model's one
`fastdist.nn.styles.SequenceSwitch` (on every module since ``parallelize``): ``generate``
turns on its ``decoding`` for its span (`fastdist.nn.styles.decoding`), and each call sets its
``whole``; no call walks the modules.

The logits are gathered (``all_gather`` of the last position's ``V / n`` columns: transformers
computes only the positions ``generate`` keeps); argmax and top-k/top-p over the sharded logits
without gathering would save ``V`` floats per sequence and step, which is small next to one
layer's collectives.
"""

from __future__ import annotations

import contextlib
import inspect
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.errors import ParallelizeError
from fastdist.nn.randomness import RandomSites
from fastdist.nn.styles import ParallelLinear, SequenceShard, decoding, whole_sequence
from fastdist.nn.styles.configs import position_dependent_rope
from fastdist.ops import all_gather

if TYPE_CHECKING:
    from fastdist.nn.parallelize import ParallelModel

__all__ = [
    "DirectCalls",
    "OwnGenerate",
    "generate",
    "generate_on_ranks",
    "indivisible",
    "sequence_sizes",
]

#: the inputs of a causal LM's forward that every rank of a tensor-parallel group must share
TOKEN_INPUTS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")


#: ``generate``'s arguments that turn on assisted generation (it needs a KV cache)
ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def sharded_head(model: nn.Module) -> ParallelLinear | None:
    """The model's LM head when a plan made it give vocabulary-parallel logits, else None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, ParallelLinear) and head.kind == "col" and not head.gather_output:
        return head
    return None


@contextlib.contextmanager
def whole_logits(model: nn.Module) -> Iterator[None]:
    """Within the block, the model's vocabulary-parallel head (if any) gives the whole
    vocabulary's logits ``(..., V)`` (an all-gather, the padding columns dropped)."""
    head = sharded_head(model)
    if head is None:
        yield
        return
    head.gather_output = True
    try:
        yield
    finally:
        head.gather_output = False


def check_whole_logits(model: nn.Module, out: Any, op: str) -> None:
    """Raise if a call meant to give the whole vocabulary's logits gave fewer columns than the
    model's ``config.vocab_size``: the plan splits an output head that is not the one
    ``get_output_embeddings()`` returns (or not a column-parallel `ParallelLinear`), which
    `whole_logits` cannot gather; the argmax or sample of a shard would be a wrong token."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    if not isinstance(vocab, int) or not isinstance(logits, Tensor):
        return
    if logits.shape[-1] < vocab:
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        raise ParallelizeError(
            f"{op}: {type(model).__name__}'s logits have {logits.shape[-1]} columns, not the "
            f"vocabulary's {vocab}: the plan splits the output head in a way generation cannot "
            "gather (fastdist gathers the head get_output_embeddings() returns when it is a "
            f"column-parallel layer; that is {type(head).__name__}). Fix: split the head "
            "get_output_embeddings() returns (fastdist.nn.VocabParallel on it), or "
            "ColwiseParallel(gather_output=True) on the one the plan splits"
        )


def token_inputs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A call's token inputs by name (`TOKEN_INPUTS`), positional ones included; ``generate``'s
    own name of its prompt, ``inputs``, counts as ``input_ids``."""
    values = {**dict(zip(TOKEN_INPUTS, args, strict=False)), **kwargs}
    if "inputs" in values and values.get("input_ids") is None:
        values["input_ids"] = values["inputs"]
    return values


def _plain(value: Any) -> bool:
    """Whether ``value`` is a plain setting (a number, string, bool, None, or a list / tuple /
    dict of them): one whose ``repr`` is the same wherever it is equal."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def arguments_text(model: nn.Module, kwargs: Mapping[str, Any]) -> str:
    """The settings of a ``generate`` call that every rank of a group must share, as text: its
    plain keyword arguments (``max_new_tokens``, ``temperature``, ...), the ``generation_config``
    passed and the model's own (tensors, callables and other objects are left out)."""
    parts = [f"{k}={v!r}" for k, v in sorted(kwargs.items()) if k not in TOKEN_INPUTS and _plain(v)]
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        to_json = getattr(config, "to_json_string", None)
        if callable(to_json):
            parts.append(str(to_json(use_diff=False)))
    return "\n".join(parts)


def _fingerprint(values: Mapping[str, Any], arguments: str = "") -> Tensor:
    """A float64 vector that differs when any token input differs (its shape, sum and a
    position-weighted sum, per input) or the ``arguments`` text differs (its CRC-32, exact in
    float64)."""
    parts: list[Tensor] = []
    for key in TOKEN_INPUTS:
        v = values.get(key)
        if not isinstance(v, Tensor):
            parts.append(torch.zeros(4, dtype=torch.float64))
            continue
        flat = v.detach().reshape(-1).to(device="cpu", dtype=torch.float64)  # (numel,)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
        parts.append(
            torch.stack(
                [
                    torch.tensor(float(v.dim())),
                    torch.tensor(float(flat.numel())),
                    flat.sum(),
                    (flat * weights.sin()).sum(),
                ]
            ).to(torch.float64)
        )
    parts.append(torch.tensor([float(zlib.crc32(arguments.encode()))], dtype=torch.float64))
    return torch.cat(parts)  # (4 * len(TOKEN_INPUTS) + 1,)


def check_same_inputs(
    values: Mapping[str, Any], mesh: Mesh, axes: Sequence[str], what: str, arguments: str = ""
) -> None:
    """Raise `ParallelizeError` if the token inputs (or the ``arguments`` text: `arguments_text`)
    differ across the ranks of any group over ``axes`` (real ranks; a collective: every rank
    calls it)."""
    mine = _fingerprint(values, arguments)
    device = _comm_device(values)
    for axis in axes:
        every = all_gather(mine.to(device), mesh, axis, tiled=False).cpu()  # (n, k)
        tokens = [r for r in range(every.shape[0]) if not torch.equal(every[r, :-1], every[0, :-1])]
        settings = [r for r in range(every.shape[0]) if every[r, -1] != every[0, -1]]
        if tokens:
            raise ParallelizeError(
                f"{what}: the token inputs differ across the ranks of the {axis!r} group (rank "
                f"{mesh.rank}: index {tokens[0]} differs from index 0). The model's layers are "
                f"split over {axis!r}, so every rank must run the same request; ranks that "
                "sampled different tokens diverge. Fix: give every rank of the group the same "
                "prompt, and generate with ParallelModel.generate (every rank samples with the "
                "group's first rank's random state) or seed every rank the same"
            )
        if settings:
            raise ParallelizeError(
                f"{what}: the generation arguments differ across the ranks of the {axis!r} group "
                f"(rank {mesh.rank}: index {settings[0]} differs from index 0; max_new_tokens, "
                "temperature, top_k, ... or a generation_config). The model's layers are split "
                f"over {axis!r}: ranks that decode with different settings run different steps "
                "or sample different tokens, and mix each other's sequences. Fix: pass every "
                "rank of the group the same generate arguments (no rank-dependent setting)"
            )


def _comm_device(values: Mapping[str, Any]) -> torch.device:
    for v in values.values():
        if isinstance(v, Tensor):
            return v.device
    return torch.device("cpu")


class DirectCalls:
    """Hooks on a model whose layers a plan split, for calls of the model itself (not through
    `ParallelModel`): the whole vocabulary's logits, and (real ranks) the token inputs checked
    equal across the plan's groups. ``bypass()``: a block whose calls are `ParallelModel`'s own
    (the logits stay sharded); ``trusted()``: calls whose inputs were already checked
    (`generate`)."""

    def __init__(
        self, model: nn.Module, mesh: Mesh, axes: Sequence[str], sequence: Sequence[int] = ()
    ) -> None:
        self.mesh, self.axes, self.sequence = mesh, tuple(axes), tuple(sequence)
        self.name = type(model).__name__
        self._bypass = 0
        self._trusted = 0
        self._gathering: list[contextlib.ExitStack] = []
        self._token = object()  # the mark of the KV caches this model filled (`_claim`)
        self._random: RandomSites | None = None  # `refuse_random`'s scan of the model
        # the names of forward's positional parameters (GPT-2's second is past_key_values)
        try:
            self._names = tuple(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            self._names = TOKEN_INPUTS
        self.handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, always_call=True),
        ]
        if callable(getattr(type(model), "generate", None)):
            # the model's own generate (model.generate(...)) runs as ParallelModel.generate
            model.__dict__["generate"] = OwnGenerate(model, self)

    @contextlib.contextmanager
    def bypass(self) -> Iterator[None]:
        self._bypass += 1
        try:
            yield
        finally:
            self._bypass -= 1

    @contextlib.contextmanager
    def trusted(self) -> Iterator[None]:
        self._trusted += 1
        try:
            yield
        finally:
            self._trusted -= 1

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._bypass:
            return
        if self.mesh.backend is None:
            raise ParallelizeError(
                f"{self.name} was called itself on a simulated mesh, where its parameters hold "
                "every rank's shard stacked: it cannot run outside the simulation. Fix: call "
                "the ParallelModel that parallelize returned (pm(...), or pm.generate(...) to "
                "generate)"
            )
        self.refuse_random(module, f"{self.name} called on real ranks")
        values = {**dict(zip(self._names, args, strict=False)), **kwargs}
        if not self._trusted and self.axes:
            check_same_inputs(values, self.mesh, self.axes, f"{self.name} called on real ranks")
        self._claim(values.get("past_key_values"))
        stack = contextlib.ExitStack()
        stack.enter_context(whole_logits(module))
        # a direct call is inference (the model's own generate): a call that cannot split may
        # run whole, or, context parallel, against the KV cache a split prefill left split
        stack.enter_context(decoding(module))
        # Megatron sequence parallelism: a call whose tokens do not divide runs whole
        stack.enter_context(whole_sequence(module, on=indivisible(values, self.sequence)))
        self._gathering.append(stack)

    def refuse_random(self, model: nn.Module, what: str) -> None:
        """Raise where ``model`` is in training mode and draws random numbers in its forward
        (dropout, noise: `fastdist.nn.randomness.RandomSites`) while the plan splits it over an
        axis of size > 1 (or the ranks are simulated): HF ``generate`` does not call ``eval()``,
        and the ranks' masks of their shards would not be one device's (the same refusal as
        ``ParallelModel``'s calls in training mode)."""
        split = tuple(a for a in self.axes if self.mesh.axis_size(a) > 1)
        simulated = self.mesh.backend is None
        if not model.training or not (split or simulated):
            return
        if self._random is None:  # scanned once, at the first call in training mode
            self._random = RandomSites.of(model)
        if self._random.refused:
            error = self._random.refusal(self.name, () if simulated else split)
            raise ParallelizeError(f"{what}: {error}")

    def _claim(self, cache: Any) -> None:
        """A KV cache object is this model's from its first use here: one another parallel
        model (another mesh, another plan: other heads per rank) filled is refused, also when
        its shapes happen to fit."""
        if cache is None or isinstance(cache, (Tensor, tuple, list)):
            return
        owner = getattr(cache, "_fastdist_owner", None)
        if owner is None:
            try:
                cache._fastdist_owner = self._token
            except AttributeError:  # a cache type without a __dict__: not tagged
                return
        elif owner is not self._token:
            raise ParallelizeError(
                f"{self.name} called on real ranks with a KV cache (past_key_values, "
                f"{type(cache).__name__}) that another parallel model filled: its keys and values "
                "are that model's heads on that mesh. Fix: give each model its own cache (a new "
                "one per model, e.g. DynamicCache())"
            )

    def _post(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if self._gathering and not self._bypass:
            self._gathering.pop().close()
            check_whole_logits(module, out, f"{self.name} called on real ranks")

    def remove(self, model: nn.Module) -> None:
        """Take the hooks and the model's own `OwnGenerate` off ``model``."""
        for h in self.handles:
            h.remove()
        if isinstance(model.__dict__.get("generate"), OwnGenerate):
            del model.__dict__["generate"]


class OwnGenerate:
    """The model's own ``generate`` on a model whose layers a plan split (``model.generate(...)``,
    an instance attribute `DirectCalls` sets): on real ranks what ``ParallelModel.generate``
    does (`generate_on_ranks`: the prompt and settings compared at the call, every rank of a
    group sampling with its first rank's random state). Without it, ranks whose random states
    differ sampled different tokens, and the last one, fed to no forward, was never compared:
    each rank returned a different sequence, silently. On a simulated mesh it raises, naming
    ``ParallelModel.generate``.

    It holds the model and its `DirectCalls`: ``copy.deepcopy`` of the model copies both with
    it (the copy's ``generate`` runs the copy)."""

    def __init__(self, model: nn.Module, calls: DirectCalls) -> None:
        self.model, self.calls = model, calls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.calls.mesh.backend is None:
            raise ParallelizeError(
                f"{self.calls.name}.generate was called on a simulated mesh, where the model's "
                "parameters hold every rank's shard stacked: it cannot run outside the "
                "simulation. Fix: pm.generate(...) on the ParallelModel that parallelize "
                "returned (every simulated rank runs each step)"
            )
        what = f"{self.calls.name}.generate on real ranks"
        return generate_on_ranks(self.model, self.calls, what, args, kwargs)


def _rng_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _group_rng_state(model: nn.Module, mesh: Mesh, axes: Sequence[str]) -> tuple[Tensor, bool]:
    """(the random state of the first rank of this rank's group over ``axes``, whether this rank
    is that first rank); the state of the device the model's parameters live on."""
    device = _rng_device(model)
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    shared = state.to(torch.int64)  # (bytes,): gloo and NCCL gather int64
    first = True
    for axis in axes:
        every = all_gather(shared.to(device), mesh, axis, tiled=False)  # (n, bytes)
        shared = every[0].cpu()
        first = first and mesh.index(mesh.rank, axis) == 0
    return shared.to(torch.uint8), first


@contextlib.contextmanager
def _group_rng(model: nn.Module, mesh: Mesh, axes: Sequence[str]) -> Iterator[None]:
    """Within the block, every rank of a group draws from its first rank's random state; the
    first rank's own state advances as on one device, the others' is restored after."""
    state, first = _group_rng_state(model, mesh, axes)
    device = _rng_device(model)
    with contextlib.ExitStack() as stack:
        if not first:
            stack.enter_context(
                torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
            )
            if device.type == "cuda":
                torch.cuda.set_rng_state(state, device)
            else:
                torch.set_rng_state(state)
        yield


def generate(pm: ParallelModel, *args: Any, **kwargs: Any) -> Any:
    """``pm.module.generate(*args, **kwargs)`` (Hugging Face's), exact on a parallel model: the
    result equals the unmodified model's on one device (greedy, beam search, sampling with the
    same random state). See this module's docstring."""
    model = pm.module
    if not callable(getattr(type(model), "generate", None)):
        raise ParallelizeError(
            f"ParallelModel.generate: {type(model).__name__} has no generate method (a Hugging "
            "Face model's GenerationMixin). Fix: generate with a causal LM, or write the "
            "decoding loop over pm(...)"
        )
    if not pm.simulated:
        return generate_on_ranks(model, pm.direct_calls, "ParallelModel.generate", args, kwargs)
    pm.direct_calls.refuse_random(model, "ParallelModel.generate")
    with decoding(model):  # sequence / context parallel: calls that cannot split may run
        return _simulated_generate(pm, *args, **kwargs)


def generate_on_ranks(
    model: nn.Module, calls: DirectCalls, what: str, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """The model class's ``generate(model, *args, **kwargs)`` on real ranks, as one device runs
    it: the prompt and the plain settings compared across the ranks of every group the plan
    splits over (`check_same_inputs`, raising naming ``what``), then every rank of a group
    sampling with its first rank's random state (`_group_rng`: the same tokens on every rank,
    the last one included), the steps' own input checks skipped (``trusted``)."""
    calls.refuse_random(model, what)
    with decoding(model):  # sequence / context parallel: calls that cannot split may run
        # generate's positional arguments: the prompt, then a generation_config
        values = token_inputs(args[:1], kwargs)
        given = {"generation_config": args[1]} if len(args) > 1 else {}
        arguments = arguments_text(model, {**kwargs, **given})
        check_same_inputs(values, calls.mesh, calls.axes, what, arguments)
        with _group_rng(model, calls.mesh, calls.axes), calls.trusted():
            # the class's generate: the model's own attribute is `OwnGenerate`, which calls this
            return cast(Any, type(model)).generate(model, *args, **kwargs)


def sequence_sizes(plan: Mapping[str, Any], mesh: Mesh) -> tuple[int, ...]:
    """The sizes of the axes a plan's Megatron sequence parallelism (`SequenceShard`) splits
    the tokens over (empty: none)."""
    return tuple(
        mesh.axis_size(style.axis)
        for styles in plan.values()
        for style in (styles if isinstance(styles, (list, tuple)) else [styles])
        if isinstance(style, SequenceShard)
    )


def indivisible(values: Mapping[str, Any], sizes: Sequence[int]) -> bool:
    """Whether a call's tokens (``input_ids`` ``(..., tokens)`` or ``inputs_embeds``
    ``(..., tokens, hidden)``) do not divide one of the sequence-parallel ``sizes``: such a call
    (a decoding step's single new token) runs on the whole sequence
    (`fastdist.nn.styles.whole_sequence`), a prefill split; the values and the KV cache (every
    token of the rank's heads) are the same either way."""
    ids, embeds = values.get("input_ids"), values.get("inputs_embeds")
    if isinstance(ids, Tensor):
        length = ids.shape[-1]
    elif isinstance(embeds, Tensor):
        length = embeds.shape[-2]
    else:
        return False
    return any(length % n for n in sizes)


def _simulated_generate(pm: ParallelModel, *args: Any, **kwargs: Any) -> Any:
    """HF ``generate`` whose every model call runs all simulated ranks through ``pm`` (no KV
    cache), the logits gathered and rank 0's taken (checked equal on every rank)."""
    if kwargs.get("use_cache"):
        raise ParallelizeError(
            "ParallelModel.generate on a simulated mesh: use_cache=True cannot hold, a KV cache "
            "object cannot leave the simulation. Fix: leave use_cache unset (every step "
            "recomputes the sequence) or generate on real ranks"
        )
    assisted = [k for k in ASSISTED if kwargs.get(k) is not None]
    if assisted:
        raise ParallelizeError(
            f"ParallelModel.generate on a simulated mesh: {assisted[0]}= (assisted generation) "
            "needs a KV cache, which cannot leave the simulation. Fix: generate on real ranks "
            "(fastdist.connect), or leave it unset"
        )
    if kwargs.get("past_key_values") is not None:
        raise ParallelizeError(
            "ParallelModel.generate on a simulated mesh: past_key_values="
            f"{type(kwargs['past_key_values']).__name__} cannot be used, a KV cache object cannot "
            "enter or leave the simulation (every step recomputes the sequence; the cache would "
            "be filled with every rank's keys stacked and generate would skip the tokens it "
            "counts as cached). Fix: leave past_key_values unset and pass the whole sequence, or "
            "generate on real ranks"
        )
    model = pm.module
    dynamic = next((m for m in model.modules() if position_dependent_rope(m)), None)
    if dynamic is not None and kwargs.get("use_cache") is None:
        raise ParallelizeError(
            "ParallelModel.generate on a simulated mesh: the model's rotary embedding "
            f"({type(dynamic).__name__}, rope_type {getattr(dynamic, 'rope_type', None)!r}) "
            "picks its frequencies from the longest position seen, so one device's generate "
            "with its default KV cache gives other tokens than a generate without one, and a "
            "simulated mesh has no cache. Fix: pass use_cache=False (and compare against one "
            "device's generate(use_cache=False)), or generate on real ranks"
        )
    world = pm.mesh.size
    config = kwargs.get("generation_config") or (args[1] if len(args) > 1 else None)
    config = config if config is not None else getattr(model, "generation_config", None)
    cached = kwargs.get("use_cache", getattr(config, "use_cache", True)) is not False
    seen = {"tokens": 0}  # the sequence length of the previous step (this call's own)

    def call(*a: Any, **k: Any) -> Any:
        batched = {
            key: v.expand(world, *v.shape) if isinstance(v, Tensor) and v.dim() else v
            for key, v in {**dict(zip(TOKEN_INPUTS, a, strict=False)), **k}.items()
        }
        batched.pop("use_cache", None)
        whole = indivisible(batched, pm.direct_calls.sequence)  # sequence parallel: run whole
        with whole_logits(model), whole_sequence(model, on=whole):
            out = pm(**batched)
        check_whole_logits(model, out, "ParallelModel.generate")
        logits = out["logits"]  # (world, batch, positions, V)
        first = logits[:1].expand_as(logits)
        # NaN equals NaN here: rows the unmodified model makes NaN (Gemma 2's fully masked
        # left padding) are NaN on every rank, as on one device
        if not bool(((logits == first) | (logits.isnan() & first.isnan())).all()):
            raise ParallelizeError(
                "ParallelModel.generate on a simulated mesh: the ranks' logits differ; the plan "
                "does not give every rank the whole output. Fix: check the plan with verify=True"
            )
        out["logits"] = logits[0]
        length = _length(batched)
        # with its KV cache, one device's step computes the tokens after the previous step's
        new = length - seen["tokens"] if cached and 0 < seen["tokens"] < length else length
        seen["tokens"] = length
        for key in ("hidden_states", "attentions"):
            if out.get(key) is not None:
                out[key] = _rank_zero(out[key], key, new)
        return out

    proxy = _simulated_proxy(model, call)
    # no cache: every step recomputes the sequence (the user's own use_cache=False included)
    return cast(Any, type(model)).generate(proxy, *args, **{**kwargs, "use_cache": False})


def _length(values: Mapping[str, Any]) -> int:
    """The token count of a simulated step's inputs (``(world, batch, tokens)`` ids or
    ``(world, batch, tokens, hidden)`` embeddings; 0: neither)."""
    ids, embeds = values.get("input_ids"), values.get("inputs_embeds")
    if isinstance(ids, Tensor):
        return int(ids.shape[-1])
    return int(embeds.shape[-2]) if isinstance(embeds, Tensor) else 0


def _rank_zero(values: Any, key: str, new: int) -> Any:
    """Rank 0's ``(world, ...)`` hidden states or attention weights (a tuple per layer), each
    cut to its last ``new`` query positions (what one device's step with a KV cache computes);
    raises if the ranks' differ (a plan that leaves them split)."""
    if not isinstance(values, (tuple, list)) or not all(isinstance(v, Tensor) for v in values):
        return values
    kept = []
    for v in values:
        first = v[:1].expand_as(v)
        if not bool(((v == first) | (v.isnan() & first.isnan())).all()):
            raise ParallelizeError(
                f"ParallelModel.generate on a simulated mesh: output_{key}=True, and the ranks' "
                f"{key} differ: the plan leaves them split (each rank's heads or tokens). Fix: "
                f"leave output_{key} unset, or generate on real ranks with a plan that gives "
                "every rank the whole hidden state"
            )
        kept.append(v[0][..., v.shape[-2] - new :, :])
    return tuple(kept)


def _simulated_proxy(model: nn.Module, call: Any) -> nn.Module:
    """An instance of a subclass of the model's class sharing the model's attributes, whose call
    is ``call``: HF's ``generate`` runs on it as on the model (``isinstance`` and ``super()`` hold),
    and every forward it makes goes through the simulation."""
    cls = type(model)
    sub = type(
        f"{cls.__name__}OnSimulatedRanks", (cls,), {"__call__": lambda self, *a, **k: call(*a, **k)}
    )
    proxy: nn.Module = object.__new__(sub)
    proxy.__dict__ = model.__dict__  # the same modules, parameters, config
    return proxy
