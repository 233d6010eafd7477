"""fastdist.checkpoint: one ``save`` / ``load`` pair for a parallel model's weights and its
optimizer, each rank writing and reading only its own slices, on any layout.

* `api`: `save` / `load`, the format chosen by ``format=`` or by what is at the path;
* `planner`: which boxes of which single-device tensor each rank holds, writes and reads;
* `optimizer`: optimizer state by parameter name (plain and ZeRO-1 optimizers);
* storages: `dcp` (a ``torch.distributed.checkpoint`` directory, the training checkpoint) and
  `safetensors_io` (single-device safetensors: a file, a ``save_pretrained`` directory, a state
  dict), with `hf` for transformers' renamings and per-expert tensors.

Layer: above `fastdist.nn`; `fastdist.train` may use it, it does not use `fastdist.train` (a
ZeRO optimizer is recognised by its `optimizer.ShardedOptimizer` shape, a pipeline by
`staged.Staged`: its stages write and read the whole model's checkpoint under the model's
names).

``import fastdist.checkpoint`` does not import ``torch.distributed.checkpoint`` (nor DTensor and
sympy through it: about a second): `dcp` and `planner` are imported by the first distributed
save or load (tests/test_import_time.py).
"""

from fastdist.checkpoint import hf
from fastdist.checkpoint.api import LoadResult, Staged, load, save

__all__ = ["save", "load", "LoadResult", "Staged", "hf"]
