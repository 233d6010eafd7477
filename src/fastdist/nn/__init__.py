"""Parallel building blocks for model code: plain ``torch.nn.Module``s that take the mesh in the
constructor.

Each module holds **this rank's** parameters (local shapes) and says how they split a
single-device module's parameters through :meth:`param_specs` (``PartitionSpec`` per name).
The helpers below move weights between the two views:

* :func:`shard_state`: one rank's shard of a single-device state dict (checkpoints on disk:
  `fastdist.checkpoint.load`, each rank reading only its own slices);
* :func:`stack_state` / :func:`unstack`: every rank's shard stacked along a leading rank dim,
  for :func:`fastdist.simulate` with ``torch.func.functional_call``, and back.

Layout conventions: activations are batch-first ``(batch, seq, features)``; the sequence
parallel variants shard ``seq_dim`` (default 1) over the tensor-parallel axis, as Megatron's
sequence parallelism does.

>>> import torch, fastdist as fd
>>> mesh = fd.Mesh({"tp": 2})
>>> full = torch.nn.Linear(4, 6)
>>> col = fd.nn.ColumnParallelLinear(4, 6, mesh, "tp", gather_output=True)
>>> state = fd.nn.stack_state(full.state_dict(), fd.nn.param_specs(col), mesh)
>>> x = torch.randn(3, 4)
>>> run = fd.simulate(lambda p, x: torch.func.functional_call(col, p, (x,)), mesh)
>>> out = run(state, x.expand(2, 3, 4))
>>> bool(torch.allclose(out[0], full(x), atol=1e-6))
True
"""

from fastdist.errors import CheckpointError, MoEError, ParallelizeError, ReplicaMismatchError
from fastdist.nn import moe, plans  # noqa: E402
from fastdist.nn.attention import RingAttention, UlyssesAttention, USPAttention, local_attention
from fastdist.nn.cfg import GuidedModel, cfg_branch, cfg_combine
from fastdist.nn.clip import clip_grad_norm_, grad_norm
from fastdist.nn.domain import DomainConv, DomainParallel
from fastdist.nn.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from fastdist.nn.loss import causal_lm_loss, cross_entropy, vocab_parallel_cross_entropy
from fastdist.nn.materialize import init_weights, module_seed
from fastdist.nn.parallelize import ParallelModel, parallelize
from fastdist.nn.state import (
    Layout,
    full_state_dict,
    param_layouts,
    param_specs,
    shard_state,
    stack_state,
    unstack,
)
from fastdist.nn.styles import (
    ColwiseParallel,
    ContextParallel,
    GatherSequence,
    HeadParallelAttention,
    PrepareInput,
    PvaryParams,
    RowwiseParallel,
    SequenceParallelAttention,
    SequenceShard,
    Style,
    StyleContext,
    VocabParallel,
)
from fastdist.nn.styles.context_llm import CausalContextParallel, PvaryTree

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "cross_entropy",
    "causal_lm_loss",
    "clip_grad_norm_",
    "grad_norm",
    "local_attention",
    "UlyssesAttention",
    "RingAttention",
    "USPAttention",
    "DomainConv",
    "DomainParallel",
    "param_specs",
    "shard_state",
    "stack_state",
    "unstack",
    "full_state_dict",
    "param_layouts",
    "Layout",
    "CheckpointError",
    "ReplicaMismatchError",
    "parallelize",
    "ParallelModel",
    "ParallelizeError",
    "init_weights",
    "module_seed",
    "Style",
    "StyleContext",
    "ColwiseParallel",
    "RowwiseParallel",
    "VocabParallel",
    "SequenceShard",
    "GatherSequence",
    "PrepareInput",
    "PvaryParams",
    "HeadParallelAttention",
    "ContextParallel",
    "CausalContextParallel",
    "PvaryTree",
    "GuidedModel",
    "cfg_branch",
    "cfg_combine",
    "SequenceParallelAttention",
    "plans",
    "moe",
    "MoEError",
]
