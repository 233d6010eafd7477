"""Pipeline parallelism over a mesh axis: an unmodified decoder split into stages by layer
index, each stage parallelized over the mesh's other axes, run by a schedule of
`fastdist.train.schedules` on simulated or real ranks.

How a stage runs the model's own code. Every stage is a copy of the model's skeleton (its
config, rotary embedding, mask code: everything but the decoder layers and the ends) holding
only its own layers; the other layers are parameter-free placeholders, so parameter names stay
the model's own (``model.layers.5.mlp.up_proj.weight``) and
``fastdist.checkpoint.load(save_pretrained_dir, pipe)`` reads only each stage's slices. The
model's ``forward`` runs as on one device (positions, masks and rotary embeddings from
``input_ids``), with two hooks:

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

Tied input and output embeddings: the first and the last stage each hold a copy
(``Pipeline.tied``), and a step sums their gradients (Megatron's embedding group).

A diffusers DiT (Wan) splits over its blocks the same way; its condition embedder, which every
block uses, is held by every stage with its gradients summed over them, and its step takes the
model's inputs and a ``target`` (the loss: mean squared error): `dit`.

Modules: `split` (model -> stages), `dit` (a DiT's stages and step), `runtime` (`Pipeline`:
running a schedule), `transfers` (between the ranks along the axis), `build` (the `pipeline`
entry point). Data
parallelism over the stages: ``fastdist.train.DataParallel(pipe, "dp")``.
"""

from fastdist.train.pipeline.build import pipeline
from fastdist.train.pipeline.dit import DIT_SPLITS, DitSplit
from fastdist.train.pipeline.runtime import Event, Pipeline
from fastdist.train.pipeline.split import SPLITS, StageSplit

__all__ = ["Pipeline", "pipeline", "SPLITS", "StageSplit", "DIT_SPLITS", "DitSplit", "Event"]
