"""``save_pretrained`` of a pipelined transformers model: the whole model, from every stage.

A stage is a copy of the model's skeleton holding only its own layers, and the model given to
`fastdist.train.pipeline` lent its layers to the stages (which parallelized them in place), so
neither's own ``save_pretrained`` can write the model: a stage's would write its layers only, the
model's would write shards. `install` gives both a `PipelineSavePretrained`, which writes the
whole model's single-device weights (every stage's, gathered over its tensor-parallel axes; a
tied embedding once, under the first stage's name; MoE experts one tensor per expert, as
transformers writes them) through transformers' own ``save_pretrained``, so a plain
``from_pretrained`` loads it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

if TYPE_CHECKING:
    from fastdist.train.pipeline.runtime import Pipeline

__all__ = ["PipelineSavePretrained", "install"]


class PipelineSavePretrained:
    """``save_pretrained(save_directory, ...)`` of a `fastdist.train.Pipeline`'s model.

    Every stage's single-device state dict (``pipe.state_dict()``: gathered over the stage's
    axes) is collected on rank ``dst`` and written there by transformers' own
    ``save_pretrained`` of the model's class (config, file names, ``max_shard_size``, tied
    weights written once, experts converted back to one tensor per expert) with ``state_dict=``
    that dict; the other ranks wait until it is written. On real ranks a **collective**: call it
    on every rank. The ranks along the pipeline axis of ``dst`` hold the whole model's weights in
    CPU memory for the call (for a model too large for that: `fastdist.checkpoint.save`).

    >>> import tempfile, fastdist as fd
    >>> from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> pipe = fd.train.pipeline(LlamaForCausalLM(cfg), fd.Mesh({"pp": 2}), microbatches=1)
    >>> saved = tempfile.mkdtemp()
    >>> pipe.save_pretrained(saved)
    >>> back = AutoModelForCausalLM.from_pretrained(saved)
    >>> all((back.state_dict()[k] == w).all().item() for k, w in pipe.state_dict().items())
    True

    Attributes:
        pipe: the pipeline.
        dst: the rank (global, on real ranks) that writes.
    """

    def __init__(self, pipe: Pipeline, dst: int = 0) -> None:
        self.pipe, self.dst = pipe, dst

    def __call__(self, save_directory: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
        pipe = self.pipe
        module = pipe.stages[min(pipe.stages)].module
        own = type(module).save_pretrained
        kwargs.pop("is_main_process", None)
        given = kwargs.pop("state_dict", None)
        if pipe.simulated:
            state = given if given is not None else _once(pipe, pipe.state_dict())
            return own(module, save_directory, *args, state_dict=state, **kwargs)
        from fastdist.comm.p2p import all_gather_object, barrier

        mine = pipe.state_dict()  # a collective over each stage's mesh: every rank
        mesh, out = pipe.mesh, None
        if _same_group(mesh, pipe.axis, mesh.rank, self.dst):
            parts = all_gather_object(_cpu(mine), mesh, pipe.axis)
            if mesh.rank == self.dst:
                whole: dict[str, Tensor] = {}
                for part in parts:
                    whole.update(part)
                out = own(
                    module,
                    save_directory,
                    *args,
                    state_dict=given if given is not None else _once(pipe, whole),
                    is_main_process=True,
                    **kwargs,
                )
        barrier(mesh)  # the directory is complete on every rank's return
        return out


def _same_group(mesh: Any, axis: str, rank: int, dst: int) -> bool:
    """Whether ``rank`` is in ``dst``'s group along ``axis``."""
    return rank in mesh.group(dst, axis)


def _once(pipe: Pipeline, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` without the last stage's copies of tied weights (the checkpoint holds each once,
    under the first stage's name, as transformers writes a tied model)."""
    return {k: v for k, v in state.items() if not (k in pipe.tied and pipe.tied[k] in state)}


def _cpu(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().cpu() for k, v in state.items()}


def install(pipe: Pipeline, model: nn.Module) -> None:
    """Give ``model`` (the model `fastdist.train.pipeline` took apart) and every stage module
    held here, if they have transformers' ``save_pretrained``, a `PipelineSavePretrained` as
    their instance attribute ``save_pretrained``."""
    saver = PipelineSavePretrained(pipe)
    for m in [model, *(pipe.stages[j].module for j in sorted(pipe.stages))]:
        if callable(getattr(type(m), "save_pretrained", None)):
            m.__dict__["save_pretrained"] = saver
