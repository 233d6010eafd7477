"""The styles a ``parallelize`` plan maps module names to: how one module of an unmodified model is
parallelized.

``ColwiseParallel`` / ``RowwiseParallel`` (``nn.Linear`` and Hugging Face ``Conv1D``, fused parts,
padding), ``VocabParallel`` (embedding or LM head), ``HeadParallelAttention`` (the model's own
attention on this rank's heads), and the input styles ``SequenceShard``, ``GatherSequence``,
``PrepareInput`` and ``PvaryParams``. Each style's ``apply`` swaps or hooks one module in place;
:func:`fastdist.nn.parallelize` walks the model and applies them.

One file per family: ``base`` (`Style`, `StyleContext`), ``linear`` (column, row, vocabulary),
``regions`` (input hooks), ``attention`` (head-parallel attention), ``heads`` (the modules
it puts inside an attention) and ``context`` (a whole transformer's tokens split over an axis:
`ContextParallel`, Ulysses self-attention `SequenceParallelAttention`).
"""

from fastdist.nn.styles.attention import HeadParallelAttention, HeadParams
from fastdist.nn.styles.base import (
    SequenceSwitch,
    Style,
    StyleContext,
    decoding,
    get_child,
    install_switch,
    runs_whole,
    swap_child,
    switch_of,
    whole_sequence,
)
from fastdist.nn.styles.context import ContextParallel, SequenceParallelAttention
from fastdist.nn.styles.heads import ReplicatedHeads
from fastdist.nn.styles.linear import (
    ColwiseParallel,
    ParallelLinear,
    RowwiseParallel,
    ScaledVocabParallelEmbedding,
    VocabParallel,
    linear_parts,
)
from fastdist.nn.styles.regions import GatherSequence, PrepareInput, PvaryParams, SequenceShard

__all__ = [
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
    "HeadParams",
    "ContextParallel",
    "SequenceParallelAttention",
    "ParallelLinear",
    "ReplicatedHeads",
    "ScaledVocabParallelEmbedding",
    "get_child",
    "linear_parts",
    "runs_whole",
    "swap_child",
    "whole_sequence",
    "SequenceSwitch",
    "decoding",
    "install_switch",
    "switch_of",
]
