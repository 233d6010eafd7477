"""Pipeline stages of a diffusers diffusion transformer (DiT): `DitSplit` records (where a
family keeps its blocks, what only the first or the last stage holds, what every stage holds),
the stage modules, and a DiT's training step (micro-batches of latents, timesteps and text
states; the loss on the last stage). Built for Wan, LTX-Video, CogVideoX and SD3 (one block
list each); the others are refused by `dit_split`, naming why.

A stage is a copy of the model's skeleton (its config, rotary embedding, forward) holding only
its own blocks; the other blocks are parameter-free placeholders that pass their hidden states
through, so parameter names stay the model's own. The model's ``forward`` runs on every stage:

* the patch embedding is the first stage's; on the others a placeholder makes zeros of its
  output's shape (never used: the first own block's input is replaced by the activation
  received, `StageHooks`);
* the rotary embedding has no parameters: every stage computes it from the latents' shape;
* the condition embedder (timestep and text) feeds every block: every stage holds a copy and
  computes it from the step's ``timestep`` and ``encoder_hidden_states`` (each stage gets the
  whole batch), and a step sums the copies' gradients over the stages (`Pipeline.shared`).
  This is exact: a parameter used by several stages gets the sum of its uses' gradients, as on
  one device. Computing it on the first stage and handing its outputs on would send the text
  states and the six modulations with every activation, and their gradients back: more
  traffic, and a second activation path through the schedule, for the same numbers;
* the output modules (``norm_out``, ``proj_out``, ``scale_shift_table``) are the last stage's;
* a text stream that every block updates (CogVideoX, SD3: ``DitSplit.stream``) travels with
  the hidden states: a stage hands on ``cat([text, image tokens], dim=1)`` (`StreamHooks`).

The loss. A DiT's step takes the model's inputs and ``target`` (the model output's shape:
noise, velocity...), optionally ``weighting`` (broadcastable to ``target``, one row per sample:
the per-timestep loss weights of diffusers' training scripts): the loss is
``mean(weighting * (output - target) ** 2)`` over the whole batch (every element), as
``F.mse_loss`` (``weighting=None``) or diffusers' ``mean(mean(w * d**2, sample dims))``. Each
micro-batch's loss is its sum divided by the whole batch's element count, so the micro-batch
losses add up to the batch's loss and their gradients to its gradient.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from fastdist.errors import PipelineError
from fastdist.train.pipeline.split import StageHooks, recomputed_input, retire

if TYPE_CHECKING:
    from fastdist.train.pipeline.runtime import Pipeline

__all__ = [
    "DIT_SPLITS",
    "DitSplit",
    "StreamHooks",
    "dit_split",
    "split_dit",
    "dit_batches",
    "dit_loss",
]


@dataclass(frozen=True)
class DitSplit:
    """Where a diffusers DiT keeps its blocks and what the stages hold besides them.

    Attributes:
        blocks: the ``nn.ModuleList`` of transformer blocks (the one list split into stages).
        first: the patch embedding (a convolution or linear layer whose output's shape a
            placeholder reproduces on the other stages).
        shared: modules every stage holds a copy of (their outputs feed every block);
            their gradients are summed over the stages.
        last: modules and parameters of the model itself only the last stage holds (the
            output norm, projection, modulation table).
        stream: the blocks' second input and output, a text stream every block updates
            (CogVideoX's ``encoder_hidden_states``); ``None``: the blocks return the hidden
            states alone. A stage hands on ``cat([stream, hidden states], dim=1)`` and the next
            one splits it at the stream's length.
        stream_first: the blocks return ``(stream, hidden states)`` (SD3), not ``(hidden
            states, stream)`` (CogVideoX).
        unsupported: the model's inputs a pipeline step refuses (not ``None``): SD3's
            ``skip_layers`` and ControlNet residuals would skip or change blocks of one stage.
        more: further block lists run after ``blocks`` with the same arguments and outputs
            (Flux's ``single_transformer_blocks``); the stages split them all, in order, as one.
        per_position: the model's tensor inputs that are not per sample (Flux's ``img_ids``,
            ``txt_ids``): every micro-batch gets them whole.
    """

    blocks: str
    first: tuple[str, ...]
    shared: tuple[str, ...]
    last: tuple[str, ...]
    stream: str | None = None
    stream_first: bool = False
    unsupported: tuple[str, ...] = ()
    more: tuple[str, ...] = ()
    per_position: tuple[str, ...] = ()


#: diffusers class name -> how it splits into stages
DIT_SPLITS: dict[str, DitSplit] = {
    "WanTransformer3DModel": DitSplit(
        "blocks",
        ("patch_embedding",),
        ("condition_embedder",),
        ("norm_out", "proj_out", "scale_shift_table"),
    ),
    "LTXVideoTransformer3DModel": DitSplit(
        "transformer_blocks",
        ("proj_in",),
        ("time_embed", "caption_projection"),
        ("norm_out", "proj_out", "scale_shift_table"),
    ),
    "CogVideoXTransformer3DModel": DitSplit(
        "transformer_blocks",
        ("patch_embed",),
        ("time_embedding", "ofs_embedding"),
        ("norm_final", "norm_out", "proj_out"),
        stream="encoder_hidden_states",
    ),
    "SD3Transformer2DModel": DitSplit(
        "transformer_blocks",
        ("pos_embed", "context_embedder"),
        ("time_text_embed",),
        ("norm_out", "proj_out"),
        stream="encoder_hidden_states",
        stream_first=True,
        unsupported=("skip_layers", "block_controlnet_hidden_states"),
    ),
    "FluxTransformer2DModel": DitSplit(
        "transformer_blocks",
        ("x_embedder", "context_embedder"),
        ("time_text_embed",),
        ("norm_out", "proj_out"),
        stream="encoder_hidden_states",
        stream_first=True,
        unsupported=("controlnet_block_samples", "controlnet_single_block_samples"),
        more=("single_transformer_blocks",),
        per_position=("img_ids", "txt_ids"),
    ),
    "HunyuanVideoTransformer3DModel": DitSplit(
        "transformer_blocks",
        ("x_embedder", "context_embedder"),
        ("time_text_embed",),
        ("norm_out", "proj_out"),
        stream="encoder_hidden_states",
        more=("single_transformer_blocks",),
    ),
}

#: why the other DiT families are refused, and the fix
_NOT_BUILT = {
    "Flux2Transformer2DModel": "its single-stream blocks take [text; image] joined by the model "
    "between its two block lists, unlike its double-stream blocks (one hand-on for both is not "
    "built)",
    "QwenImageTransformer2DModel": "its per-sample img_shapes (a Python list) and text mask "
    "are not split into micro-batches (not built)",
}


def dit_split(model: nn.Module) -> DitSplit:
    """The `DitSplit` of a diffusers DiT; refuses a family without one, naming why and the fix."""
    kind = type(model).__name__
    split = DIT_SPLITS.get(kind)
    if split is not None:
        return split
    why = _NOT_BUILT.get(
        kind, "its stage split (block list, first and last modules) is not written"
    )
    raise PipelineError(
        f"pipeline: {kind} is a diffusers diffusion transformer without pipeline stages: {why}. "
        f"DiT pipelines are built for {sorted(DIT_SPLITS)}. Fix: split its tokens instead "
        "(fastdist.nn.parallelize(model, mesh) over an 'sp' axis) with "
        "fastdist.train.DataParallel over 'dp'"
    )


# ====================================================================== placeholders
class _BlockSkip(nn.Module):
    """A block another stage holds: passes its hidden states through. ``absent`` names the
    block's attentions as ``None`` and ``empty`` its cross-attentions as empty modules, so that
    a context-parallel style's checks pass over it (it has no parameters and no attention)."""

    def __init__(
        self,
        absent: Sequence[str],
        empty: Sequence[str],
        stream: str | None,
        signature: inspect.Signature,
        stream_first: bool = False,
    ) -> None:
        super().__init__()
        self.stream = stream
        # the real block's arguments (a context-parallel style reads them off the signature)
        self.forward = _passing(stream, signature, stream_first)  # type: ignore[method-assign]
        for name in absent:
            setattr(self, name, None)
        for name in empty:
            setattr(self, name, nn.Module())

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # replaced in __init__
        raise NotImplementedError


def _passing(stream: str | None, sig: inspect.Signature, stream_first: bool) -> Any:
    """A forward with the block's signature that returns its hidden states (and ``stream``, in
    the block's order)."""
    first = "hidden_states" if "hidden_states" in sig.parameters else next(iter(sig.parameters))

    def forward(*args: Any, **kwargs: Any) -> Any:
        given = sig.bind_partial(*args, **kwargs).arguments
        if stream is None:
            return given.get(first)
        pair = (given.get(first), given.get(stream))
        return pair[::-1] if stream_first else pair

    forward.__signature__ = sig  # type: ignore[attr-defined]
    return forward


class _JointPatchZeros(nn.Module):
    """CogVideoX's patch embedding of another stage (text and latents in, ``[text; image
    tokens]`` out): zeros of its output's shape."""

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        read = cast(Any, embed)  # diffusers' CogVideoXPatchEmbed: plain int attributes
        self.p, self.pt = int(read.patch_size), int(read.patch_size_t or 1)
        self.dim = int(read.embed_dim)
        self.dtype = next(embed.parameters()).dtype

    def forward(self, text: Tensor, image: Tensor) -> Tensor:
        b, f, _, h, w = image.shape
        tokens = text.shape[1] + (f // self.pt) * (h // self.p) * (w // self.p)
        return torch.zeros(b, tokens, self.dim, dtype=self.dtype, device=image.device)


class _TokenPatchZeros(nn.Module):
    """diffusers' ``PatchEmbed`` (SD3's: a convolution, flattened to tokens, positions added) or
    ``HunyuanVideoPatchEmbed`` (a 3-D one) of another stage: zeros of its output's shape
    ``(batch, tokens, dim)``."""

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        proj = getattr(embed, "proj", None)
        if (
            not isinstance(proj, (nn.Conv2d, nn.Conv3d))
            or isinstance(proj.padding, str)
            or any(p != 0 for p in proj.padding)
            or proj.kernel_size != proj.stride
        ):
            raise PipelineError(
                f"pipeline: {type(embed).__name__} has no patch convolution (kernel = stride, no "
                "padding) whose output shape the other stages reproduce. Fix: pass "
                "split=DitSplit(...) naming the patch embedding"
            )
        self.stride = tuple(int(s) for s in proj.stride)
        self.dim, self.dtype = int(proj.out_channels), proj.weight.dtype

    def forward(self, x: Tensor) -> Tensor:
        tokens = 1
        for n, s in zip(x.shape[-len(self.stride) :], self.stride):
            tokens *= n // s
        return torch.zeros(x.shape[0], tokens, self.dim, dtype=self.dtype, device=x.device)


def _first_stub(module: nn.Module) -> nn.Module:
    """The placeholder of a first-stage module on the other stages: zeros of its output's
    shape."""
    kind = type(module).__name__
    if kind == "CogVideoXPatchEmbed":
        return _JointPatchZeros(module)
    if kind in ("PatchEmbed", "HunyuanVideoPatchEmbed"):
        return _TokenPatchZeros(module)
    if kind == "HunyuanVideoTokenRefiner":  # text states in, (batch, tokens, hidden size) out
        return _PatchZeros(cast(nn.Module, module.proj_in))
    return _PatchZeros(module)


class _PatchZeros(nn.Module):
    """The patch embedding (a convolution, or a linear layer over patchified tokens) of another
    stage: zeros of its output's shape (never used: the first own block's input is replaced)."""

    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        if not isinstance(conv, (nn.Conv2d, nn.Conv3d, nn.Linear)) or isinstance(
            getattr(conv, "padding", 0), str
        ):
            raise PipelineError(
                f"pipeline: the patch embedding is a {type(conv).__name__}, not a Conv2d, Conv3d "
                "(numeric padding) or Linear whose output shape the other stages reproduce. Fix: "
                "pass "
                "split=DitSplit(...) naming the patch embedding"
            )
        self.geometry: tuple[tuple[int, int, int, int], ...] | None = None
        if isinstance(conv, nn.Linear):
            self.out: int = conv.out_features
        else:
            self.out = int(conv.out_channels)
            parts = (conv.kernel_size, conv.stride, conv.padding, conv.dilation)
            self.geometry = tuple(zip(*(cast(tuple[int, ...], q) for q in parts)))
        self.dtype = conv.weight.dtype

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.geometry is None:  # a linear layer over the last dim
            return torch.zeros(*x.shape[:-1], self.out, dtype=self.dtype, device=x.device)
        sizes = [
            (n + 2 * p - d * (k - 1) - 1) // s + 1
            for n, (k, s, p, d) in zip(x.shape[2:], self.geometry)
        ]
        return torch.zeros(x.shape[0], self.out, *sizes, dtype=self.dtype, device=x.device)


class _Missing(nn.Module):
    """A module only the last stage holds; reaching it on another stage is a bug."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.what = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(
            f"pipeline: {self.what} ran on a stage that does not hold it (the stage's last block "
            "should have ended its forward). Fix: report this as a fastdist bug"
        )


PLACEHOLDERS = (_BlockSkip, _PatchZeros, _Missing)


# ====================================================================== the stages
def block_lists(model: nn.Module, split: DitSplit) -> list[tuple[str, nn.ModuleList]]:
    """``(name, list)`` of the split's block lists, in the order the model runs them."""
    out = []
    for name in (split.blocks, *split.more):
        try:
            lst: Any = model.get_submodule(name)
        except AttributeError:
            lst = None
        if not isinstance(lst, nn.ModuleList) or len(lst) == 0:
            raise PipelineError(
                f"pipeline: {name} of {type(model).__name__} is not a non-empty nn.ModuleList. "
                "Fix: pass split=DitSplit(...) naming the lists of blocks"
            )
        out.append((name, lst))
    return out


def check_owned(model: nn.Module, split: DitSplit) -> None:
    """Every parameter of ``model`` must be in the blocks or a module the split names, and none
    shared between two of them."""
    parts = (split.blocks, *split.more, *split.first, *split.shared, *split.last)
    owner: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        where = next((x for x in parts if name == x or name.startswith(x + ".")), None)
        if where is None:
            raise PipelineError(
                f"pipeline: parameter {name} of {type(model).__name__} belongs to no stage "
                f"(not in {split.blocks}, {split.first}, {split.shared} or {split.last}). Fix: "
                "pass split=DitSplit(...) naming the module that holds it"
            )
        seen = owner.setdefault(id(p), where)
        if seen != where:
            raise PipelineError(
                f"pipeline: parameter {name} is shared by {seen} and {where}, which different "
                "stages hold. Fix: untie them (copy the weight)"
            )


def split_dit(
    model: nn.Module,
    split: DitSplit,
    ranges: Sequence[range],
    keep: Sequence[int],
    skip_names: Mapping[str, tuple[Sequence[str], Sequence[str]]],
) -> dict[int, nn.Module]:
    """Stage modules ``{stage: copy of the model's skeleton holding its blocks}`` for the stages
    in ``keep``. The first stage holds the model's patch embedding, the last its output modules;
    every stage a copy of the ``shared`` modules (the first stage: the model's own).
    ``skip_names``: per block list, the (absent, empty) attribute names of its placeholders."""
    check_owned(model, split)
    lists = block_lists(model, split)
    blocks = [b for _, lst in lists for b in lst]
    where = [(name, k) for name, lst in lists for k in range(len(lst))]
    if ranges[-1].stop != len(blocks):
        raise PipelineError(
            f"pipeline: the stages cover {ranges[-1].stop} blocks, {[n for n, _ in lists]} hold "
            f"{len(blocks)}. Fix: layers_per_stage= summing to {len(blocks)}"
        )
    own = {n: _get(model, n) for n in (*split.first, *split.shared, *split.last)}
    own = {n: m for n, m in own.items() if m is not None}  # CogVideoX's ofs_embedding: None
    stubs: dict[str, Any] = {
        **{n: _first_stub(own[n]) for n in split.first},
        **{n: _Missing(n) for n in split.last if isinstance(own[n], nn.Module)},
    }
    for name, lst in lists:
        absent, empty = skip_names.get(name, ((), ()))
        sig = inspect.signature(lst[0].forward)
        stubs[name] = nn.ModuleList(
            _BlockSkip(absent, empty, split.stream, sig, split.stream_first) for _ in lst
        )
    skeleton = _swapped_copy(model, {**stubs, **{n: None for n in split.last if n not in stubs}})
    stages: dict[int, nn.Module] = {}
    for j in keep:
        st = copy.deepcopy(skeleton, _shared_memo(skeleton))
        for i in ranges[j]:
            name, k = where[i]
            cast(nn.ModuleList, st.get_submodule(name))[k] = blocks[i]
        for n in split.shared:
            if n in own:
                _set(st, n, own[n] if j == 0 else copy.deepcopy(own[n]))
        for n in split.first if j == 0 else ():
            _set(st, n, own[n])
        for n in split.last if j == len(ranges) - 1 else ():
            if n in own:
                _set(st, n, own[n])
        stages[j] = st
    return stages


def _swapped_copy(model: nn.Module, stubs: Mapping[str, Any]) -> nn.Module:
    """A deep copy of ``model`` with ``stubs`` in place of its submodules or parameters of
    those names (``None``: a parameter left out), made by swapping them out and back."""
    saved = {n: _get(model, n) for n in stubs}
    try:
        for n, stub in stubs.items():
            _set(model, n, stub)
        return copy.deepcopy(model, _shared_memo(model))
    finally:
        for n, m in saved.items():
            _set(model, n, m)


def _shared_memo(model: nn.Module) -> dict[int, Any]:
    """deepcopy's memo keeping the modules' config objects shared (a style that sets a field on
    its stage's config must reach the blocks the stage takes over)."""
    found = (vars(m).get("config") for m in model.modules())
    return {id(c): c for c in found if c is not None and not isinstance(c, (nn.Module, Tensor))}


def _get(root: nn.Module, name: str) -> Any:
    parent, _, leaf = name.rpartition(".")
    holder = root.get_submodule(parent) if parent else root
    if not hasattr(holder, leaf):
        raise PipelineError(
            f"pipeline: {type(root).__name__} has no {name!r} its split names. Fix: pass "
            "split=DitSplit(...) naming its modules"
        )
    return getattr(holder, leaf)


def _set(root: nn.Module, name: str, value: Any) -> None:
    parent, _, leaf = name.rpartition(".")
    holder = root.get_submodule(parent) if parent else root
    if value is None:
        if leaf in holder._parameters:
            del holder._parameters[leaf]
        return
    if isinstance(value, nn.Parameter):
        holder.register_parameter(leaf, value)
    else:
        setattr(holder, leaf, value)


def install_stage(
    module: nn.Module, split: DitSplit, ranges: Sequence[range], j: int, n_stages: int
) -> None:
    """The hooks that make ``module`` stage ``j``: take the received activation at its first
    block, hand its last block's output on; the last stage's forward returns the loss
    (`dit_loss`)."""
    lst = [b for _, blocks in block_lists(module, split) for b in blocks]
    first = None if j == 0 else lst[ranges[j][0]]
    last = None if j == n_stages - 1 else lst[ranges[j][-1]]
    if split.stream is None:
        StageHooks(module, first, last)  # held by the hooks it registers on the module
    else:
        StreamHooks(module, first, last, split.stream, split.stream_first)
    if last is None:
        model_forward = module.forward

        def forward(
            *args: Any,
            target: Tensor,
            num_items: int,
            weighting: Tensor | None = None,
            **kwargs: Any,
        ) -> dict[str, Tensor]:
            out = model_forward(*args, **{**kwargs, "return_dict": False})[0]
            return {"loss": dit_loss(out, target, weighting, num_items)}

        module.forward = forward


class StreamHooks(StageHooks):
    """`StageHooks` for blocks that take and return ``(hidden states, stream)``: a stage hands
    on ``cat([stream, hidden states], dim=1)`` (one tensor through the schedule and its
    transfers: same batch and width); the next stage's first block gets the two back, split at
    the stream's length (the placeholders before it carry the stream's shape). Under context
    parallelism the hidden states are the rank's tokens and the stream whole, as between two
    blocks of one stage."""

    def __init__(
        self,
        module: nn.Module,
        first: nn.Module | None,
        last: nn.Module | None,
        stream: str,
        stream_first: bool = False,
    ) -> None:
        self.stream, self.stream_first = stream, stream_first
        super().__init__(module, first, last)

    def substitute(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        x, self.received = self.received, None
        # positional (diffusers' gradient checkpointing calls blocks so) or keyword
        names = list(inspect.signature(module.forward).parameters)
        given = {**dict(zip(names, args)), **kwargs}
        x = recomputed_input(self.swapped, given.get(names[0]), x)
        n = given[self.stream].shape[1]
        new = {**given, self.stream: x[:, :n], names[0]: x[:, n:]}
        return tuple(new[k] for k in names[: len(args)]), {
            k: v for k, v in new.items() if k not in names[: len(args)]
        }

    def handed_on(self, out: Any) -> Tensor:
        hidden, stream = out[::-1] if self.stream_first else out
        return torch.cat([stream, hidden], dim=1)  # (B, stream + tokens, D)


def dit_loss(out: Tensor, target: Tensor, weighting: Tensor | None, num_items: int) -> Tensor:
    """``sum(weighting * (out - target) ** 2) / num_items`` in the output's dtype: a
    micro-batch's share of the whole batch's mean."""
    if out.shape != target.shape:
        raise PipelineError(
            f"Pipeline.step: the model's output has shape {tuple(out.shape)}, the target "
            f"{tuple(target.shape)} (per rank). Fix: a target of the output's shape (its "
            "out_channels), with nothing left to broadcast"
        )
    d = (out - target.to(out.dtype)) ** 2
    if weighting is not None:
        d = d * weighting.to(out.dtype)
    return d.sum() / num_items


# ====================================================================== the batch
_REQUIRED = ("hidden_states", "timestep", "encoder_hidden_states", "target")
#: the micro-batch keys only the last stage gets
LAST_ONLY = ("target", "weighting", "num_items")


def dit_batches(
    pipe: Pipeline,
    batch: Mapping[str, Any],
    inputs: Sequence[str] = (),
    unsupported: Sequence[str] = (),
    per_position: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """A DiT step's batch as micro-batches: ``hidden_states`` (latents: Wan's ``(batch, channels,
    frames, height, width)``, LTX-Video's ``(batch, tokens, channels)``), ``timestep``,
    ``encoder_hidden_states`` and ``target`` (the output's shape) required; optionally
    ``weighting`` and the model's other keyword inputs (``inputs``: its ``forward``'s, e.g.
    ``encoder_hidden_states_image``, ``encoder_attention_mask``, ``num_frames``). Every tensor
    holds one row per sample and is split along its batch dim; ``num_items`` is the whole
    batch's element count of ``target``. Simulated: every tensor carries the leading rank
    dim."""
    m, sim = pipe.schedule.microbatches, pipe.simulated
    missing = [k for k in _REQUIRED if not isinstance(batch.get(k), Tensor)]
    unknown = sorted(set(batch) - {*_REQUIRED, "weighting", *inputs} - {"return_dict"})
    if missing or unknown:
        raise PipelineError(
            f"Pipeline.step: a DiT pipeline's step takes {list(_REQUIRED)} (tensors), optionally "
            f"weighting and the model's inputs {sorted(set(inputs) - set(_REQUIRED))}; missing "
            f"{missing}, not supported {unknown}. Fix: pass the model's inputs and target= (the "
            "loss is the mean of weighting * (output - target) ** 2 over the whole batch)"
        )
    refused = [k for k in unsupported if batch.get(k) is not None]
    if refused:
        raise PipelineError(
            f"Pipeline.step: {refused} would skip or change blocks of one stage (its hand-in or "
            "hand-on block), which the stages do not follow. Fix: a step without them (train "
            "with them without a pipeline)"
        )
    x, target = batch["hidden_states"], batch["target"]
    bdim = 1 if sim else 0
    if sim and (x.dim() < 1 or x.shape[0] != pipe.mesh.size):
        raise PipelineError(
            f"Pipeline.step: hidden_states of shape {tuple(x.shape)} on a simulated "
            f"{pipe.mesh!r}: every input carries the leading rank dim. Fix: pass "
            f"[{pipe.mesh.size}, batch, ...] (e.g. x.expand({pipe.mesh.size}, *x.shape))"
        )
    if x.dim() < bdim + 3 or target.shape[: bdim + 1] != x.shape[: bdim + 1]:
        raise PipelineError(
            f"Pipeline.step: hidden_states {tuple(x.shape)} and target {tuple(target.shape)}. "
            "Fix: the model's latents and a target of the model output's shape, one row per "
            "sample each (simulated: after the leading rank dim)"
        )
    b = x.shape[bdim]
    w = batch.get("weighting")
    if w is not None and (
        not isinstance(w, Tensor)
        or w.dim() != target.dim()
        or w.shape[: bdim + 1] != target.shape[: bdim + 1]
        or any(a not in (1, t) for a, t in zip(w.shape, target.shape))
    ):
        raise PipelineError(
            f"Pipeline.step: weighting of shape {tuple(getattr(w, 'shape', ()))} for target "
            f"{tuple(target.shape)}. Fix: one weight per sample broadcastable to the target, "
            "e.g. w.view(batch, 1, 1, 1, 1) (simulated: with the leading rank dim)"
        )
    for k, v in batch.items():
        if k in per_position:
            continue
        if isinstance(v, Tensor) and (v.dim() <= bdim or v.shape[bdim] != b):
            raise PipelineError(
                f"Pipeline.step: {k} of shape {tuple(v.shape)} for a batch of {b}. Fix: one row "
                "per sample (simulated: after the leading rank dim)"
            )
    if b % m:
        divisors = [d for d in range(1, b + 1) if b % d == 0]
        raise PipelineError(
            f"Pipeline.step: a batch of {b} samples does not split into {m} micro-batches. Fix: "
            f"a batch size that is a multiple of {m}, or microbatches= one of {divisors}"
        )
    num_items = int(target[0].numel() if sim else target.numel())
    out = []
    for i in range(m):
        mb: dict[str, Any] = {
            key: v.narrow(bdim, i * (b // m), b // m)
            if isinstance(v, Tensor) and key not in per_position
            else v
            for key, v in batch.items()
        }
        mb["num_items"] = num_items
        out.append(mb)
    return out


# ====================================================================== the pipeline
def build_dit(
    model: nn.Module,
    mesh: Any,
    axis: str,
    sched: Any,
    plan: Mapping[str, Any] | None,
    layers_per_stage: Sequence[int] | None,
    split: DitSplit | None,
) -> Pipeline:
    """`fastdist.train.pipeline` for a diffusers DiT: stages of ``split`` (default: its family's
    `DIT_SPLITS` row), each parallelized over the mesh's other axes with ``plan`` (default:
    the family's context-parallel plan over ``sp`` when the stage mesh has it, else none)."""
    from fastdist.nn.parallelize import parallelize
    from fastdist.nn.styles.context import ContextParallel
    from fastdist.train.pipeline.runtime import Pipeline
    from fastdist.train.schedules import stage_layers

    split = dit_split(model) if split is None else split
    stage_mesh = mesh.without(axis)
    if "tp" in stage_mesh.axis_names:
        raise PipelineError(
            f"pipeline: {type(model).__name__} over {mesh!r}: a DiT pipeline's stages are built "
            "with context parallelism over 'sp' (and data parallelism), not tensor parallelism "
            "over 'tp' (not built or tested with placeholder blocks). Fix: a mesh of 'pp', 'sp' "
            "(and 'dp'), or tensor parallelism without a pipeline"
        )
    if plan is None:
        from fastdist.nn.plans.dit import dit_plan

        plan = dit_plan(model, stage_mesh) if "sp" in stage_mesh.axis_names else {}
    cps = [s for v in plan.values() for s in (v if isinstance(v, (list, tuple)) else (v,))]
    cps = [s for s in cps if isinstance(s, ContextParallel)]
    lists = (split.blocks, *split.more)
    if any((c.blocks, *((c.single_blocks,) if c.single_blocks else ())) != lists for c in cps):
        raise PipelineError(
            f"pipeline: the plan's ContextParallel splits blocks other than the stages' "
            f"{list(lists)}. Fix: ContextParallel naming them (the family's plan)"
        )
    skip_names = {
        split.blocks: (
            tuple(n for c in cps for n in (*c.attention, *c.joint)),
            tuple(n for c in cps for n in c.cross),
        ),
        **{
            m: (tuple(n for c in cps for n in (*c.joined, *c.single_joint)), ()) for m in split.more
        },
    }
    n_blocks = sum(len(lst) for _, lst in block_lists(model, split))
    ranges = stage_layers(n_blocks, sched.stages, layers_per_stage)
    keep = (
        list(range(sched.stages))
        if mesh.backend is None
        else list(sched.stages_of(mesh.index(mesh.rank, axis)))
    )
    modules = split_dit(model, split, ranges, keep, skip_names)
    retire(model)
    stages: dict[int, Any] = {}
    for j, module in modules.items():
        stages[j] = parallelize(module, stage_mesh, _stage_plan(plan, module))
        install_stage(module, split, ranges, j, sched.stages)
    shared = [
        n
        for n, _ in model.named_parameters()
        if any(n.startswith(s + ".") or n == s for s in split.shared)
    ]
    pipe = Pipeline(mesh, axis, sched, stage_mesh, stages, ranges, shared=shared)
    inputs = [n for n in inspect.signature(type(model).forward).parameters if n != "self"]
    pipe.batches = lambda batch: dit_batches(
        pipe, batch, inputs, split.unsupported, split.per_position
    )
    pipe.last_only = LAST_ONLY
    pipe.save_pretrained = _no_save_pretrained(model)  # type: ignore[method-assign]
    return pipe


def _no_save_pretrained(model: nn.Module) -> Any:
    def save_pretrained(*args: Any, **kwargs: Any) -> Any:
        raise PipelineError(
            f"Pipeline.save_pretrained: a {type(model).__name__} pipeline's save_pretrained is "
            "not built (it writes transformers models). Fix: fastdist.checkpoint.save(directory, "
            "pipe) (loads at any layout), or save the model without a pipeline"
        )

    return save_pretrained


def _stage_plan(plan: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """The plan's entries that match a module this stage holds (not a placeholder)."""
    from fastdist.nn.parallelize import pattern_matches

    real = [n for n, m in module.named_modules() if not isinstance(m, PLACEHOLDERS)]
    return {p: v for p, v in plan.items() if any(pattern_matches(p, n) for n in real)}
