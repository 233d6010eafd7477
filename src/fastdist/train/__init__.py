"""fastdist.train: the training run across steps, built on `fastdist.nn`'s parameter layouts.

* `DataParallel`: gradient reduction over the data axes during backward (simulated and real
  ranks; buckets, ``no_sync``), and the rule for parameters split over a data axis (MoE).
* `ZeroOptimizer`: ZeRO-1, the optimizer state sharded over a data axis, built from fastdist's
  own collectives.
* `save` / `load`: distributed checkpoints through ``torch.distributed.checkpoint``, each rank
  writing its own slices, loadable on any other layout.
* Clipping lives with the layouts: `fastdist.nn.clip_grad_norm_`.
"""

from .checkpoint import load, save
from .data_parallel import DataParallel, reduce_axes
from .zero import ZeroOptimizer

__all__ = ["DataParallel", "reduce_axes", "ZeroOptimizer", "save", "load"]
