"""See the communication before paying for it: a per-axis profile of a step, dry runs at scale, a
layout planner.

Three pieces, all arithmetic on what fastdist already knows about each collective (its
group, shape and dtype):

* :func:`trace` runs a per-rank step once on fake tensors (``torch._subclasses.FakeTensorMode``:
  shapes and dtypes, no data, no memory) and records every collective it issues, forward
  and backward, as a :class:`Record`: the op, the mesh axes, the group size, the bytes in
  the `nccl-tests <https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md>`_
  definitions, the phase and the ``nn.Module`` it ran in. The result is a :class:`Profile`.
  Because nothing is allocated per rank, the same call is the **dry run at scale**: a
  4096-rank mesh costs what one rank's shapes cost. It always runs on fake tensors, whatever
  the mesh: on a ``fastdist.connect`` mesh nothing is sent and the profile is the plain mesh's.
* :func:`record` collects the same records from a step while it really runs, on real ranks
  or under :func:`fastdist.simulate`, through the declared observer point of every collective
  (``fastdist.core.context.COLLECTIVE_OBSERVERS``).
  A trace also counts the step's compute (matmul and attention FLOPs, other kernels and their
  bytes, per phase, in issue order between the collectives: :class:`Work`), the parameters
  that receive gradients and when (:class:`GradReady`), and the activations autograd saves
  (:meth:`Profile.memory`).
* :class:`Network` describes the links (bandwidth and latency inside a node and across
  nodes, GPUs per node) and optionally the device's compute; :data:`NETWORKS` holds
  documented defaults. :func:`calibrate` measures a :class:`CostModel` on the running job
  instead (each collective kind per group size, matmul FLOP/s, memory bandwidth, per-kernel
  time), saved and loaded as JSON.
* :func:`predict` walks the traced step: compute, tensor-parallel collectives on the critical
  path, the data-parallel gradient reduction overlapped with backward in buckets as
  :class:`fastdist.train.DataParallel` runs it; and the memory per rank against a budget.
  :func:`rank_layouts` profiles a step for every candidate layout of a world size (axis sizes and
  their order onto node boundaries) and ranks the layouts by it. No congestion: see
  docs/profile.md.

The package, one concern a module: :mod:`~fastdist.profile.bytes` (the nccl-tests bytes of a
collective), :mod:`~fastdist.profile.records` (:class:`Record`, :class:`Work`,
:class:`Param`, :class:`Memory`, :class:`Profile`), :mod:`~fastdist.profile.tracing`
(:func:`trace`, :func:`trace_model`), :mod:`~fastdist.profile.recording` (:func:`record`),
:mod:`~fastdist.profile.network` (:class:`Link`, :class:`Network`),
:mod:`~fastdist.profile.cost_model` (:class:`CostModel`, :class:`Fit`),
:mod:`~fastdist.profile.calibration` (:func:`calibrate`, :func:`calibrate_kernels`,
:func:`calibrate_step`), :mod:`~fastdist.profile.prediction` (:func:`predict`,
:class:`MeshLayout`, :class:`Prediction`), :mod:`~fastdist.profile.pipeline_cost`
(:class:`PipelineSpec`, :class:`PipelineCost`), :mod:`~fastdist.profile.search`
(:func:`layouts`, :func:`rank_layouts`, :class:`LayoutRanking`).

How the trace sees the collectives (no hook in the op machinery): for the duration of the
call it pushes a rank binding onto the meshes (as :func:`fastdist.simulate` does, with a fake
rank id), so every collective takes its per-rank path and calls its ``torch.ops.fastdist.<op>``
custom op; under ``FakeTensorMode`` that op answers with its shape rule, and its registered
autograd records the per-rank backward rule, whose collectives are per-rank ops again. A
``TorchDispatchMode`` sees each op with its ``mesh_shape``, ``axes`` and parameters. A
``TorchFunctionMode`` tags each forward op's autograd node with the module it ran in, so a
backward collective is attributed to the module whose forward recorded it.

>>> import torch, fastdist as fd
>>> from fastdist.profile import trace
>>> mesh = fd.Mesh({"dp": 2, "tp": 4})
>>> def step(x, w1, w2):
...     h = torch.tanh(fd.pvary(x, mesh, "tp") @ w1)
...     fd.psum(h @ w2, mesh, "tp").sum().backward()
>>> x = torch.ones(8, 16, requires_grad=True)
>>> w1, w2 = torch.ones(16, 32, requires_grad=True), torch.ones(32, 16, requires_grad=True)
>>> prof = trace(step, mesh, x, w1, w2)
>>> # pvary's backward is the all-reduce of dx
>>> [(r.op, r.axis, r.phase, r.size) for r in prof.records]
[('psum', 'tp', 'forward', 512), ('psum', 'tp', 'backward', 512)]
>>> prof.bus_bytes(axis="tp")  # 2 all-reduces of 512 bytes, factor 2(n-1)/n = 1.5
1536.0
"""

from __future__ import annotations

from fastdist.errors import ProfileError
from fastdist.profile.bytes import bus_factor
from fastdist.profile.calibration import calibrate, calibrate_kernels, calibrate_step
from fastdist.profile.cost_model import CALIBRATED_KINDS, CostModel, Fit, Point
from fastdist.profile.network import NETWORKS, Link, Network
from fastdist.profile.pipeline_cost import PipelineCost, PipelineSpec
from fastdist.profile.prediction import MeshLayout, Prediction, predict
from fastdist.profile.recording import Recording, record
from fastdist.profile.records import (
    OPTIMIZER_STATE,
    GradReady,
    Memory,
    Param,
    Profile,
    Record,
    Work,
)
from fastdist.profile.search import LayoutRanking, layouts, rank_layouts
from fastdist.profile.tracing import ROUTINGS, trace, trace_model

__all__ = [
    "CALIBRATED_KINDS",
    "NETWORKS",
    "OPTIMIZER_STATE",
    "CostModel",
    "Fit",
    "GradReady",
    "LayoutRanking",
    "Link",
    "Memory",
    "MeshLayout",
    "Network",
    "Param",
    "PipelineCost",
    "PipelineSpec",
    "ROUTINGS",
    "Point",
    "Prediction",
    "Profile",
    "ProfileError",
    "Record",
    "Recording",
    "Work",
    "bus_factor",
    "calibrate",
    "calibrate_kernels",
    "calibrate_step",
    "layouts",
    "predict",
    "rank_layouts",
    "record",
    "trace",
    "trace_model",
]
