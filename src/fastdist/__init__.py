"""fastdist: JAX-style parallel primitives for PyTorch.

Collectives are pure functions of ``(tensor, mesh, axis)`` with per-rank gradient
rules that compose with autograd, ``torch.func`` and ``torch.compile``. A
:class:`Mesh` names the axes; :func:`simulate` runs per-rank code on every rank
of a mesh in one process.

>>> import torch, fastdist
>>> mesh = fastdist.Mesh({"dp": 2, "tp": 2})
>>> step = fastdist.simulate(lambda x: fastdist.all_gather(x, mesh, "tp"), mesh)
>>> step(torch.arange(4.0).reshape(4, 1))
tensor([[0., 1.],
        [0., 1.],
        [2., 3.],
        [2., 3.]])
"""

from .collectives import (
    all_gather,
    all_to_all,
    all_to_all_4d,
    axis_index,
    axis_size,
    broadcast,
    pmax,
    pmean,
    pmin,
    ppermute,
    psum,
    psum_scatter,
    pvary,
    ring_shift,
)
from .errors import CollectiveError, FastdistError, MeshError, NoBackendError
from .mesh import DEFAULT_ORDER, AxisName, Mesh
from .simulate import simulate

__version__ = "0.1.0"

__all__ = [
    "Mesh",
    "AxisName",
    "DEFAULT_ORDER",
    "simulate",
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "pvary",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "all_to_all_4d",
    "ppermute",
    "ring_shift",
    "broadcast",
    "axis_index",
    "axis_size",
    "FastdistError",
    "MeshError",
    "CollectiveError",
    "NoBackendError",
]
