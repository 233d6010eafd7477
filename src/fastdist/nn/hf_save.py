"""``save_pretrained`` of a transformers model after `fastdist.nn.parallelize`: the whole model.

`fastdist.nn.parallelize` changes the model in place, so transformers' own ``save_pretrained``
would write each parameter as the model now holds it (every rank's shard stacked on a simulated
mesh, this rank's shard on real ranks): a directory that looks like a checkpoint and is not.
`install` gives such a model an instance attribute ``save_pretrained`` (`GatheredSavePretrained`)
that gathers the single-device state dict and hands it to transformers' own method on one rank,
so the directory holds the whole model and its config, loadable by a plain ``from_pretrained``.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from fastdist.core.mesh import Mesh
from fastdist.nn.state import full_state_dict

__all__ = ["GatheredSavePretrained", "install"]


class GatheredSavePretrained:
    """``model.save_pretrained(save_directory, ...)`` for a parallelized transformers model.

    The single-device state dict (`fastdist.nn.state.full_state_dict`: gathered, replicas
    checked to agree) is written by transformers' own ``save_pretrained`` (its config, generation
    config, file names, tied weights written once, ``max_shard_size``...) with
    ``state_dict=`` that dict, on rank ``dst`` only (``is_main_process`` is decided here); the
    other ranks wait until it is written. On real ranks a **collective**: call it on every rank,
    not only on rank 0. A ``state_dict=`` given by the caller is written as it is.

    Attributes:
        module: the parallelized model (its class's ``save_pretrained`` does the writing).
        mesh: the mesh it runs on.
        dst: the rank (global, on real ranks) that writes.
    """

    def __init__(self, module: nn.Module, mesh: Mesh, dst: int = 0) -> None:
        self.module, self.mesh, self.dst = module, mesh, dst

    def __call__(self, save_directory: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
        own = type(self.module).save_pretrained  # type: ignore[attr-defined]
        if kwargs.get("state_dict") is None:
            kwargs["state_dict"] = full_state_dict(self.module, self.mesh)
        kwargs.pop("is_main_process", None)
        if self.mesh.backend is None:
            return own(self.module, save_directory, *args, **kwargs)
        out = None
        if self.mesh.rank == self.dst:
            out = own(self.module, save_directory, *args, is_main_process=True, **kwargs)
        from fastdist.comm.p2p import barrier

        barrier(self.mesh)  # the directory is complete on every rank's return
        return out


def install(module: nn.Module, mesh: Mesh) -> None:
    """Give ``module`` (if it has transformers' ``save_pretrained``) a `GatheredSavePretrained`
    as its instance attribute ``save_pretrained``, shadowing the class's method."""
    if callable(getattr(type(module), "save_pretrained", None)):
        module.__dict__["save_pretrained"] = GatheredSavePretrained(module, mesh)
