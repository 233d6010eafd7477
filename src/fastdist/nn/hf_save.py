"""``save_pretrained`` of a transformers or diffusers model after `fastdist.nn.parallelize`: the
whole model.

`fastdist.nn.parallelize` changes the model in place, so the library's own ``save_pretrained``
would write each parameter as the model now holds it (every rank's shard stacked on a simulated
mesh, this rank's shard on real ranks): a directory that looks like a checkpoint and is not.
`install` gives such a model an instance attribute ``save_pretrained`` (`GatheredSavePretrained`)
that gathers the single-device state dict and hands it to the library's own method on one rank,
so the directory holds the whole model and its config, loadable by a plain ``from_pretrained``.
transformers' method takes the dict as ``state_dict=``; diffusers' (``ModelMixin``) has no such
argument and writes ``model.state_dict()``, so for it the model's ``state_dict`` returns the
gathered dict for the length of the call.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from contextlib import contextmanager
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
        takes_dict = "state_dict" in inspect.signature(own).parameters
        whole = kwargs["state_dict"] if takes_dict else kwargs.pop("state_dict")
        with _state_dict_is(self.module, None if takes_dict else whole):
            if self.mesh.backend is None:
                return own(self.module, save_directory, *args, **kwargs)
            out = None
            if self.mesh.rank == self.dst:
                out = own(self.module, save_directory, *args, is_main_process=True, **kwargs)
        from fastdist.comm.p2p import barrier

        barrier(self.mesh)  # the directory is complete on every rank's return
        return out


@contextmanager
def _state_dict_is(module: nn.Module, whole: dict[str, Any] | None) -> Iterator[None]:
    """Within the block, ``module.state_dict()`` returns ``whole`` (``None``: unchanged), for a
    ``save_pretrained`` that writes ``self.state_dict()`` and takes no dict (diffusers')."""
    if whole is None:
        yield
        return
    module.__dict__["state_dict"] = lambda *args, **kwargs: dict(whole)
    try:
        yield
    finally:
        del module.__dict__["state_dict"]


def install(module: nn.Module, mesh: Mesh) -> None:
    """Give ``module`` (if it has a ``save_pretrained``: transformers', diffusers') a
    `GatheredSavePretrained` as its instance attribute ``save_pretrained``, shadowing the
    class's method."""
    if callable(getattr(type(module), "save_pretrained", None)):
        module.__dict__["save_pretrained"] = GatheredSavePretrained(module, mesh)
