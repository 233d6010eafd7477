"""fastdist.train: the training run across steps, built on `fastdist.nn`'s parameter layouts.

* `DataParallel`: gradient reduction over the data axes during backward (simulated and real
  ranks; buckets, ``no_sync``), and the rule for parameters split over a data axis (MoE).
* `ZeroOptimizer`: ZeRO-1, the optimizer state sharded over a data axis, built from fastdist's
  own collectives.
* `GradScaler`: torch's dynamic loss scaler with its overflow flag agreed over the mesh (on
  real ranks one rank's inf skips every rank's step).
* `pipeline` / `Pipeline`: a model split into stages over a ``pp`` axis, each stage parallelized
  over the other axes, run by a schedule of `fastdist.train.schedules` (GPipe, 1F1B,
  interleaved 1F1B) on simulated or real ranks.
* Clipping lives with the layouts (`fastdist.nn.clip_grad_norm_`), checkpoints in
  `fastdist.checkpoint` (`save` / `load`).
"""

from fastdist.train import schedules
from fastdist.train.data_parallel import DataParallel, reduce_axes
from fastdist.train.grad_scaler import GradScaler
from fastdist.train.pipeline import Pipeline, pipeline
from fastdist.train.zero import ZeroOptimizer

__all__ = [
    "DataParallel",
    "reduce_axes",
    "ZeroOptimizer",
    "GradScaler",
    "pipeline",
    "Pipeline",
    "schedules",
]
