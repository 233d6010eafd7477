"""Moving weights between the single-device view and per-rank shards.

A `Layout` says how one single-device tensor is split over the ranks of a mesh:
a ``PartitionSpec``, plus the two cases real checkpoints need that a block split cannot
express: **fused parts** (GPT-2's ``c_attn`` holds q, k and v side by side; each part is
split on its own, so rank ``i`` holds ``[q_i | k_i | v_i]``) and **padding** (a vocabulary
of 50257 rows split over 4 ranks: padded with zero rows to 50260, 12565 per rank).

Every move goes through one function per direction:

* `Layout.read` reads one rank's block through a slicing callback, so a rank reads
  only its own bytes of a ``safetensors`` file (``safe_open(...).get_slice``) or of an
  in-memory tensor;
* `Layout.join` assembles the single-device tensor from every rank's block, and
  checks that ranks holding the same block agree (a replicated parameter's gradient that
  differs across its holders means a missing ``pvary``: it raises instead of picking one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union, cast

import torch
from torch import Tensor, nn

from fastdist.core.mesh import Mesh
from fastdist.core.sharding import P, PartitionSpec
from fastdist.errors import CheckpointError, MeshError, ReplicaMismatchError

__all__ = [
    "Layout",
    "CheckpointError",
    "ReplicaMismatchError",
    "param_specs",
    "param_layouts",
    "shard_state",
    "stack_state",
    "unstack",
    "full_state_dict",
    "gather_full",
    "named_tensors",
    "tied_aliases",
]

SpecLike = Union[PartitionSpec, "Layout"]
Getter = Callable[[tuple[slice, ...]], Tensor]


@dataclass(frozen=True)
class Layout:
    """How one single-device tensor is split across the ranks of a mesh.

    Args:
        spec: which dims are split over which axes (replicated over the rest).
        parts: the split dim holds these parts side by side (single-device sizes, e.g.
            ``(768, 768, 768)`` for a fused q|k|v); each part is split on its own.
        size: the single-device size of the split dim when it is padded with zeros to a
            multiple of the axis size (a vocabulary); the padding rows belong to the last ranks.
        at: the dim holding ``parts`` or padding when other dims are split too (MoE experts:
            ``Layout(P("ep", "tp", None), parts=(I, I), at=1)`` for a fused gate|up per expert).

    ``parts`` and ``size`` exclude each other and need exactly one split dim unless ``at`` names it.

    >>> import torch, fastdist as fd
    >>> mesh = fd.Mesh({"tp": 2})
    >>> w = torch.arange(6.0).reshape(1, 6)             # columns [q0 q1 | k0 k1 | v0 v1]
    >>> fused = fd.nn.Layout(fd.P(None, "tp"), parts=(2, 2, 2))
    >>> fused.shard(w, mesh, 1)                          # rank 1: [q1 | k1 | v1]
    tensor([[1., 3., 5.]])
    >>> vocab = fd.nn.Layout(fd.P("tp"), size=3)  # 3 rows over 2 ranks: one zero row of padding
    >>> vocab.shard(torch.tensor([1.0, 2.0, 3.0]), mesh, 1)
    tensor([3., 0.])
    """

    spec: PartitionSpec = P()
    parts: tuple[int, ...] = ()
    size: int | None = None
    at: int | None = None

    def __post_init__(self) -> None:
        if self.parts or self.size is not None:
            split = [d for d in range(len(self.spec.dims)) if self.spec.axes_of(d)]
            if self.at is not None:
                if self.at not in split or (self.parts and self.size is not None):
                    raise MeshError(
                        f"Layout: at={self.at} must name a split dim holding parts or padding "
                        f"(not both); got {self!r}"
                    )
            elif len(split) != 1 or (self.parts and self.size is not None):
                raise MeshError(
                    "Layout: parts/size need exactly one split dim (or at= naming which) and not "
                    f"both; got {self!r}"
                )

    @property
    def split_axes(self) -> frozenset[str]:
        """Every mesh axis some dim is split over (the tensor is replicated over the others)."""
        return frozenset(a for d in range(len(self.spec.dims)) for a in self.spec.axes_of(d))

    @property
    def dim(self) -> int | None:
        """The dim that holds fused parts or padding (None for a plain block split)."""
        if not (self.parts or self.size is not None):
            return None
        if self.at is not None:
            return self.at
        return next(d for d in range(len(self.spec.dims)) if self.spec.axes_of(d))

    def _n(self, mesh: Mesh, d: int) -> int:
        return mesh.axis_size(self.spec.axes_of(d)) if self.spec.axes_of(d) else 1

    def local_shape(
        self, full_shape: tuple[int, ...], mesh: Mesh, name: str = "tensor"
    ) -> tuple[int, ...]:
        """One rank's shape for a single-device tensor of ``full_shape``; raises if it does not
        split.

        Args:
            full_shape: the single-device shape.
            mesh: the mesh the tensor splits over.
            name: the tensor's name, for error messages.

        Returns:
            one rank's block shape.
        """
        if len(self.spec.dims) > len(full_shape):
            raise MeshError(
                f"{name}: {self.spec!r} names {len(self.spec.dims)} dims but the tensor has shape "
                f"{tuple(full_shape)}"
            )
        out = list(full_shape)
        for d in range(len(self.spec.dims)):
            n = self._n(mesh, d)
            if d == self.dim and self.size is not None:
                if full_shape[d] != self.size:
                    raise MeshError(
                        f"{name}: dim {d} has size {full_shape[d]}, the layout expects {self.size}"
                    )
                out[d] = -(-self.size // n)  # ceil: the padded rows are split too
            elif d == self.dim:
                if sum(self.parts) != full_shape[d] or any(p % n for p in self.parts):
                    raise MeshError(
                        f"{name}: dim {d} (size {full_shape[d]}) holds parts {self.parts}; "
                        f"each must divide by the {n} ranks of {self.spec.axes_of(d)} and they "
                        f"must add up to the dim. Fix: choose head counts divisible by {n}"
                    )
                out[d] = full_shape[d] // n
            elif full_shape[d] % n:
                raise MeshError(
                    f"{name}: {self.spec!r} splits dim {d} (size {full_shape[d]}) over "
                    f"{self.spec.axes_of(d)} ({n} ranks), which does not "
                    f"divide it. Fix: pad dim {d} to a multiple of {n}"
                )
            else:
                out[d] = full_shape[d] // n
        return tuple(out)

    def full_shape(self, local_shape: tuple[int, ...], mesh: Mesh) -> tuple[int, ...]:
        """The single-device shape whose blocks have ``local_shape`` (inverse of `local_shape`).

        Args:
            local_shape: one rank's block shape.
            mesh: the mesh the tensor splits over.

        Returns:
            the single-device shape.
        """
        out = list(local_shape)
        for d in range(len(self.spec.dims)):
            out[d] = local_shape[d] * self._n(mesh, d)
        if self.dim is not None and self.size is not None:
            out[self.dim] = self.size
        return tuple(out)

    def _pieces(
        self, full_shape: tuple[int, ...], mesh: Mesh, rank: int
    ) -> list[tuple[tuple[slice, ...], int]]:
        """Rank ``rank``'s block as pieces: (slices of the padded single-device tensor, offset in
        the block)."""
        local = self.local_shape(full_shape, mesh)
        base = [slice(None)] * len(full_shape)
        for d in range(len(self.spec.dims)):
            if self.spec.axes_of(d) and d != self.dim:
                i = mesh.index(rank, self.spec.axes_of(d))
                base[d] = slice(i * local[d], (i + 1) * local[d])
        if self.dim is None:
            return [(tuple(base), 0)]
        d, n = self.dim, self._n(mesh, self.dim)
        i = mesh.index(rank, self.spec.axes_of(d))
        pieces, start, offset = [], 0, 0
        for part in self.parts or (local[d] * n,):  # padded: one part, the padded dim
            step = part // n
            pieces.append(
                (
                    tuple(
                        base[:d] + [slice(start + i * step, start + (i + 1) * step)] + base[d + 1 :]
                    ),
                    offset,
                )
            )
            start, offset = start + part, offset + step
        return pieces

    def boxes(
        self, full_shape: tuple[int, ...], mesh: Mesh, rank: int
    ) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
        """Rank ``rank``'s block as rectangular boxes of the single-device tensor.

        Each box is ``(slices of the single-device tensor of full_shape, slices of the block)``
        naming the same elements, every slice with explicit bounds. A plain split gives one box;
        fused ``parts`` give one per part; padding rows lie in no box (a box of only padding is
        left out). What a distributed checkpoint writes and reads for each rank.

        Args:
            full_shape: the single-device shape.
            mesh: the mesh the tensor splits over.
            rank: the rank whose block to describe.

        >>> import fastdist as fd
        >>> mesh = fd.Mesh({"tp": 2})
        >>> fused = fd.nn.Layout(fd.P(None, "tp"), parts=(2, 2, 2))
        >>> [(g[1].start, b[1].start) for g, b in fused.boxes((1, 6), mesh, 1)]  # [q1 | k1 | v1]
        [(1, 0), (3, 1), (5, 2)]
        >>> fd.nn.Layout(fd.P("tp"), size=3).boxes((3,), mesh, 1)  # row 2, then a padding row
        [((slice(2, 3, None),), (slice(0, 1, None),))]
        """
        full_shape = tuple(full_shape)
        local = self.local_shape(full_shape, mesh)
        out = []
        for slices, offset in self._pieces(full_shape, mesh, rank):
            glob, loc = [], []
            for d, s in enumerate(slices):
                start, stop = s.start or 0, full_shape[d] if s.stop is None else s.stop
                if d == self.dim:
                    stop = min(stop, full_shape[d])  # padding rows are in no box
                    if stop <= start < s.stop:
                        break  # only padding
                    glob.append(slice(start, stop))
                    loc.append(slice(offset, offset + stop - start))
                else:
                    glob.append(slice(start, stop))
                    loc.append(slice(0, local[d]))
            else:
                out.append((tuple(glob), tuple(loc)))
        return out

    def read(
        self, get: Getter, full_shape: tuple[int, ...], mesh: Mesh, rank: int, name: str = "tensor"
    ) -> Tensor:
        """Rank ``rank``'s block, reading only its own slices through ``get(slices)`` (zeros for
        padding).

        Args:
            get: reads the single-device tensor's elements at a tuple of slices (a checkpoint's lazy
                slice).
            full_shape: the single-device shape.
            mesh: the mesh the tensor splits over.
            rank: the rank whose block to read.
            name: the tensor's name, for error messages.
        """
        self.local_shape(tuple(full_shape), mesh, name)  # raises on a shape that does not split
        blocks = []
        for slices, _ in self._pieces(tuple(full_shape), mesh, rank):
            if self.size is None:
                blocks.append(get(slices))
                continue
            d = cast(int, self.dim)
            s = slices[d]
            # the rows that exist in the single-device tensor
            real = slice(min(s.start, self.size), min(s.stop, self.size))
            got = get(slices[:d] + (real,) + slices[d + 1 :]) if real.stop > real.start else None
            pad = (s.stop - s.start) - (real.stop - real.start)
            if got is None or pad:
                ref = (
                    got if got is not None else get(slices[:d] + (slice(0, 1),) + slices[d + 1 :])
                )  # dtype and other dims
                shape = list(ref.shape)
                shape[d] = pad
                zeros = ref.new_zeros(shape)
                got = zeros if got is None else torch.cat([got, zeros], dim=d)
            blocks.append(got)
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=self.dim)  # type: ignore[arg-type]

    def shard(self, full: Tensor, mesh: Mesh, rank: int, name: str = "tensor") -> Tensor:
        """Rank ``rank``'s block of single-device ``full`` (a new tensor).

        Args:
            full: the single-device tensor.
            mesh: the mesh the tensor splits over.
            rank: the rank whose block to take.
            name: the tensor's name, for error messages.

        Returns:
            rank ``rank``'s block, a new tensor.
        """
        return self.read(lambda s: full[s], tuple(full.shape), mesh, rank, name).clone()

    def join(
        self, stacked: Tensor, mesh: Mesh, *, check: bool = True, name: str = "tensor"
    ) -> Tensor:
        """The single-device tensor from every rank's block stacked on dim 0 (``[world, *local]``).

        With ``check`` (the default), ranks that hold the same block must agree (to a
        relative ``sqrt(eps)`` of the dtype): a replicated parameter's gradient that differs
        across its holders is a partial sum (a missing ``fastdist.pvary``), or data-parallel
        replicas not yet averaged; it raises `ReplicaMismatchError` naming the
        tensor, the ranks and the fix, instead of silently keeping one copy.

        Args:
            stacked: every rank's block stacked on dim 0, ``[world, *local]``.
            mesh: the mesh the tensor splits over.
            check: require ranks holding the same block to agree (to a relative ``sqrt(eps)``).
            name: the tensor's name, for error messages.

        Returns:
            the single-device tensor.
        """
        if stacked.dim() == 0 or stacked.shape[0] != mesh.size:
            raise MeshError(
                f"{name}: expected a leading rank dim of size {mesh.size}, got shape "
                f"{tuple(stacked.shape)}"
            )
        full_shape = self.full_shape(tuple(stacked.shape[1:]), mesh)
        holder: dict[tuple[int, ...], int] = {}
        for r in range(mesh.size):
            key = tuple(
                mesh.index(r, self.spec.axes_of(d)) if self.spec.axes_of(d) else 0
                for d in range(len(self.spec.dims))
            )
            first = holder.setdefault(key, r)
            if check and first != r:
                _check_agree(stacked[first], stacked[r], first, r, name, mesh)
        padded = list(full_shape)
        if self.dim is not None:
            padded[self.dim] = stacked.shape[1 + self.dim] * self._n(mesh, self.dim)
        out = stacked.new_zeros(padded)
        for r in holder.values():
            for slices, offset in self._pieces(tuple(full_shape), mesh, r):
                block = stacked[r]
                if self.dim is not None:
                    s = slices[self.dim]
                    block = block.narrow(self.dim, offset, s.stop - s.start)
                out[slices] = block
        return out if self.dim is None else out.narrow(self.dim, 0, full_shape[self.dim])


def _check_agree(a: Tensor, b: Tensor, ra: int, rb: int, name: str, mesh: Mesh) -> None:
    if a.is_floating_point() or a.is_complex():
        scale = (
            max(float(a.abs().max()), float(b.abs().max()), torch.finfo(a.dtype).tiny)
            if a.numel()
            else 1.0
        )
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        ok = diff <= math.sqrt(torch.finfo(a.dtype).eps) * scale
    else:
        ok, diff = bool(torch.equal(a, b)), float("nan")
    if not ok:
        raise ReplicaMismatchError(
            f"fastdist.nn.unstack({name}): ranks {ra} and {rb} of {mesh!r} hold the same block but "
            f"differ (max difference {diff:.3g}). Causes: (1) a per-rank clip or optimizer "
            "step: torch.nn.utils.clip_grad_norm_ gives every rank its own norm, so the ranks "
            "scale by different factors (use fastdist.nn.clip_grad_norm_); "
            "(2) a replicated parameter whose gradient got only a partial sum: it meets "
            "rank-varying data (a sequence shard, a head shard) without fastdist.pvary (in a "
            "parallelize plan: the PvaryParams style); (3) data-parallel replicas not reduced yet "
            "(fastdist.train.DataParallel, DDP, or fastdist.pmean over 'dp'). check=False keeps "
            "the first rank's copy"
        )


def module_and_mesh(model: Any, mesh: Mesh | None, op: str) -> tuple[nn.Module, Mesh]:
    """(module, mesh) of a `fastdist.nn.ParallelModel`, or of a module of fastdist layers with
    its ``mesh``; raises naming ``op`` for anything else."""
    module = getattr(model, "module", model)
    mesh = mesh if mesh is not None else getattr(model, "mesh", None)
    if not isinstance(module, nn.Module) or mesh is None:
        raise MeshError(
            f"{op}: expected a fastdist.nn.ParallelModel (or an nn.Module with mesh=), got "
            f"{type(model).__name__}{'' if mesh is not None else ' without a mesh'}. Fix: pass "
            "the model parallelize returned, or the module and its mesh"
        )
    return module, mesh


def _as_layout(spec: SpecLike) -> Layout:
    return spec if isinstance(spec, Layout) else Layout(spec)


def materialize_(
    t: Tensor, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> None:
    """Give meta tensor ``t`` real, uninitialised storage, in place: the same Python object (every
    module that holds it, tied or not, sees the change), shape, strides, ``requires_grad`` and
    attributes; on ``device`` (default cpu) in ``dtype`` (default its own). The values are
    garbage until written."""
    real = torch.empty_strided(
        tuple(t.shape), tuple(t.stride()), dtype=dtype or t.dtype, device=device or "cpu"
    )
    new = nn.Parameter(real, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else real
    new.__dict__.update(t.__dict__)  # swap_tensors swaps the attribute dicts too
    torch.utils.swap_tensors(t, new)  # type: ignore[no-untyped-call]


def meta_names(module: nn.Module) -> list[str]:
    """Names of ``module``'s parameters and buffers (persistent or not) still on the meta
    device."""
    return [
        *(n for n, p in module.named_parameters() if p.is_meta),
        *(n for n, b in module.named_buffers() if b.is_meta),
    ]


def listed(names: list[str], limit: int = 6) -> str:
    """``['a', 'b'] (and 7 more)``: a list of names for a message, cut at ``limit``."""
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return f"{names[:limit]}{more}"


# ============================================================================ specs of a module
def param_specs(module: nn.Module) -> dict[str, PartitionSpec]:
    """``PartitionSpec`` of every parameter of ``module`` by dotted name (replicated unless a
    submodule says otherwise).

    Args:
        module: a module holding fastdist layers (or any module: everything replicated).

    Returns:
        the ``PartitionSpec`` of every parameter by dotted name.
    """
    return {name: layout.spec for name, layout in param_layouts(module).items()}


def param_layouts(module: nn.Module) -> dict[str, Layout]:
    """`Layout` of every parameter of ``module`` by dotted name.

    A submodule says how its own parameters split with ``param_layouts()`` (a dict of
    Layout) or ``param_specs()`` (a dict of PartitionSpec); anything else is replicated.
    Tied parameters appear once, under their first name (as ``named_parameters`` lists them).

    Args:
        module: a module holding fastdist layers (or any module: everything replicated).

    Returns:
        the ``Layout`` of every parameter by dotted name.
    """
    out: dict[str, Layout] = {name: Layout() for name, _ in module.named_parameters()}
    for prefix, sub in module.named_modules():
        own = getattr(sub, "param_layouts", None) or getattr(sub, "param_specs", None)
        if callable(own):
            for name, spec in own().items():
                full = f"{prefix}.{name}" if prefix else name
                if full in out:
                    out[full] = _as_layout(spec)
    return out


# ============================================================================ in-memory state dicts
def shard_state(
    full: Mapping[str, Tensor], specs: Mapping[str, SpecLike], mesh: Mesh, rank: int
) -> dict[str, Tensor]:
    """Rank ``rank``'s shard of every tensor of a single-device state dict (specs: PartitionSpec or
    Layout).

    Args:
        full: a single-device state dict.
        specs: each tensor's ``PartitionSpec`` or ``Layout`` by name (what ``param_specs`` /
            ``param_layouts`` give); names absent are replicated.
        mesh: the mesh the tensors split over.
        rank: the rank whose shards to take.

    Returns:
        rank ``rank``'s shard of every tensor, by name.
    """
    missing = set(specs) - set(full)
    if missing:
        raise CheckpointError(
            f"fastdist.nn: the state dict lacks {sorted(missing)}. Fix: load a state dict of the "
            "matching single-device module"
        )
    return {
        name: _as_layout(spec).shard(full[name], mesh, rank, name) for name, spec in specs.items()
    }


def stack_state(
    full: Mapping[str, Tensor], specs: Mapping[str, SpecLike], mesh: Mesh
) -> dict[str, Tensor]:
    """Every rank's shard stacked on a leading rank dim ``[world, *local]``, for
    `fastdist.simulate`.

    Args:
        full: a single-device state dict.
        specs: each tensor's ``PartitionSpec`` or ``Layout`` by name (what ``param_specs`` /
            ``param_layouts`` give); names absent are replicated.
        mesh: the mesh the tensors split over.

    Returns:
        every tensor as ``[world, *local]`` stacked shards, by name.
    """
    per_rank = [shard_state(full, specs, mesh, r) for r in range(mesh.size)]
    return {name: torch.stack([p[name] for p in per_rank]) for name in specs}


def unstack(
    stacked: Tensor, spec: SpecLike, mesh: Mesh, *, check: bool = True, name: str = "tensor"
) -> Tensor:
    """The single-device tensor from stacked shards (inverse of `stack_state` for one tensor).

    Shards are joined along their dims. Ranks holding the same block must agree unless
    ``check=False`` (see `Layout.join`): a forgotten ``pvary`` raises here.

    Args:
        stacked: every rank's shard stacked on dim 0, ``[world, *local]``.
        spec: the tensor's ``PartitionSpec`` or ``Layout``.
        mesh: the mesh the tensor splits over.
        check: require ranks holding the same block to agree (``False``: keep one copy unchecked).
        name: the tensor's name, for error messages.

    Returns:
        the single-device tensor.
    """
    return _as_layout(spec).join(stacked, mesh, check=check, name=name)


# ============================================================================ state dicts
def named_tensors(module: nn.Module) -> dict[str, tuple[Tensor, bool]]:
    """Parameters and persistent buffers by state-dict name (tied parameters once), each with "is a
    parameter".

    Buffers are never sharded nor stacked over simulated ranks: every rank holds them whole.
    """
    out: dict[str, tuple[Tensor, bool]] = {n: (p, True) for n, p in module.named_parameters()}
    keys = set(module.state_dict(keep_vars=True))
    out.update({n: (b, False) for n, b in module.named_buffers() if n in keys})
    return out


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """Second names of tied parameters -> the first name (GPT-2's ``lm_head.weight`` ->
    ``transformer.wte.weight``)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def gather_full(
    t: Tensor, layout: Layout, mesh: Mesh, *, check: bool = True, name: str = "tensor"
) -> Tensor:
    """The single-device tensor from a parallel tensor: stacked shards on a simulated mesh; on real
    ranks this rank's shard, all-gathered first (a collective: call it on every rank)."""
    if hasattr(t, "full_tensor"):  # an FSDP2 DTensor: this rank's whole block first
        t = t.full_tensor()
    if mesh.backend is not None:
        from fastdist.ops import all_gather_invariant

        # [world, *local], rank order
        t = all_gather_invariant(t.unsqueeze(0), mesh, mesh.axis_names, dim=0)
    return layout.join(t, mesh, check=check, name=name)


def full_state_dict(module: nn.Module, mesh: Mesh, *, check: bool = True) -> dict[str, Tensor]:
    """The single-device state dict of a parallel module (parameters and persistent buffers, by
    their names).

    Tied parameters appear under every name, as ``nn.Module.state_dict`` gives them (so a
    single-device model loads it strictly); `fastdist.checkpoint.save` writes them once.

    On a simulated mesh the module holds stacked shards (``[world, *local]``); on real
    ranks every rank all-gathers every parameter (a collective: call it on every rank) and
    every rank gets the whole dict. Ranks that should hold equal copies are checked to agree
    (``check``; see `Layout.join`). A tensor still on the meta device (no values) raises
    `CheckpointError` naming it.

    Args:
        module: the parallel module.
        mesh: the mesh it runs on (simulated or real ranks).
        check: require ranks that should hold equal copies to agree (see `Layout.join`).

    Returns:
        the single-device state dict, on every rank.
    """
    meta = meta_names(module)
    if meta:
        raise CheckpointError(
            f"fastdist.nn.full_state_dict: {listed(meta)} are on the meta device (no values "
            "yet; a model built under torch.device('meta')). Fix: materialise them first: "
            "fastdist.checkpoint.load(path, pm) or fastdist.nn.init_weights(pm, seed=...)"
        )
    layouts = param_layouts(module)
    out = {}
    for name, (t, is_param) in named_tensors(module).items():
        t = t.detach()
        # buffers: whole on every rank
        out[name] = (
            gather_full(t, layouts.get(name, Layout()), mesh, check=check, name=name)
            if is_param
            else t.clone()
        )
    out.update({alias: out[name] for alias, name in tied_aliases(module).items()})
    return out
