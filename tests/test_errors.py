"""Every bad input raises a specific error naming the op, the axis and the fix."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import fastdist as fd
from fastdist.core.primitive import PRIMITIVES

MESH = fd.Mesh({"dp": 2, "tp": 4})
X = torch.zeros(8, 6, 5)  # per rank (6, 5)


def sim(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor = X) -> torch.Tensor:
    return fd.simulate(fn, MESH)(x)


COLLECTIVE_ERRORS = [
    (
        lambda x: fd.all_gather(x, MESH, "tp", dim=2),
        r"fastdist\.all_gather\(axis='tp'\) on every rank: dim=2 is out of range for a 2-d "
        r"tensor\. Fix: use a dim in \[-2, 1\]",
    ),
    (
        lambda x: fd.all_gather(x, MESH, "tp", dim=-4, tiled=False),
        r"dim=-4 is out of range for a 3-d tensor",
    ),
    (
        lambda x: fd.psum_scatter(x, MESH, "tp", dim=1),
        r"psum_scatter\(axis='tp'\).*dim 1 has size 5, not divisible by the axis size 4\. Fix: "
        r"pad dim 1 to a multiple of 4, or use reduce_scatter_v",
    ),
    (
        lambda x: fd.psum_scatter(x, MESH, ("dp", "tp"), dim=0, tiled=False),
        r"tiled=False needs dim 0 of size 8 \(the axis size\), got 6",
    ),
    (
        lambda x: fd.all_to_all(x, MESH, "tp", split_dim=0, concat_dim=1),
        r"all_to_all\(axis='tp'\).*dim 0 has size 6, not divisible by the axis size 4",
    ),
    (
        lambda x: fd.all_to_all(x, MESH, "tp", split_dim=5, concat_dim=1),
        r"split_dim=5 is out of range",
    ),
    (
        lambda x: fd.all_to_all(x, MESH, "dp", split_dim=0, concat_dim=-3),
        r"concat_dim=-3 is out of range",
    ),
    (
        lambda x: fd.all_to_all_4d(x, MESH, "tp"),
        r"all_to_all_4d.*must be a 4-d \(batch, seq, heads, head_dim\) tensor, got \(6, 5\)",
    ),
    (
        lambda x: fd.all_to_all_4d(x.reshape(1, 6, 5, 1), MESH, "tp", scatter_dim=3, gather_dim=1),
        r"must be the seq \(1\) and heads \(2\) dims",
    ),
    (
        lambda x: fd.ppermute(x, MESH, "tp", [(0, 1), (0, 2)]),
        r"ppermute\(axis='tp'\).*source 0 appears in more than one pair.*Fix: give each source "
        r"one pair",
    ),
    (
        lambda x: fd.ppermute(x, MESH, "tp", [(0, 1), (2, 1)]),
        r"destination 1 appears in more than one pair",
    ),
    (
        lambda x: fd.ppermute(x, MESH, "tp", [(0, 4)]),
        r"dst=4 is not an index along the axis \(size 4\)\. Fix: use dst in 0\.\.3",
    ),
    (lambda x: fd.ppermute(x, MESH, "tp", [(-1, 0)]), r"src=-1 is not an index"),
    (
        lambda x: fd.ppermute(x, MESH, "tp", zip([0], [1], [2])),
        r"not a sequence of \(src, dst\) pairs",
    ),
    (lambda x: fd.ppermute(x, MESH, "tp", 3), r"not a sequence of \(src, dst\) pairs"),
    (
        lambda x: fd.broadcast(x, MESH, "dp", src=2),
        r"broadcast\(axis='dp'\).*src=2 is not an index along the axis \(size 2\)",
    ),
    (lambda x: fd.ring_shift(x, MESH, "tp", shift=1.5), r"ring_shift.*shift=1\.5 is not an int"),
    (
        lambda x: fd.pmean(x.long(), MESH, "tp"),
        r"pmean\(axis='tp'\).*cannot average torch\.int64 tensors.*Fix: cast with x\.float\(\) "
        r"first, or psum and divide",
    ),
    (
        lambda x: fd.pmax(x.to(torch.complex64), MESH, "tp"),
        r"pmax.*complex numbers are not ordered",
    ),
    (lambda x: fd.psum(x.bool(), MESH, "tp"), r"psum.*bool.*x\.int\(\)"),
    (lambda x: fd.psum_scatter(x.bool(), MESH, "tp"), r"psum_scatter.*bool"),
    (
        lambda x: fd.psum([1.0], MESH, "tp"),
        r"psum\(axis='tp'\).*x must be a torch\.Tensor, got list",
    ),
    (lambda x: fd.psum(x, {"tp": 4}, "tp"), r"mesh must be a fastdist\.Mesh, got dict"),
    (lambda x: fd.axis_index({"tp": 4}, "tp"), r"axis_index.*mesh must be a fastdist\.Mesh"),
    (lambda x: fd.axis_size(None, "tp"), r"axis_size.*mesh must be a fastdist\.Mesh"),
]


@pytest.mark.parametrize("fn, match", COLLECTIVE_ERRORS)
def test_collective_argument_errors(fn, match: str) -> None:
    with pytest.raises(fd.CollectiveError, match=match) as info:
        sim(fn)
    err = info.value
    assert (
        isinstance(err, ValueError) and err.op in str(err) and err.fix and err.rank == "every rank"
    )


@pytest.mark.parametrize(
    "fn, match",
    [
        (
            lambda x: fd.psum(x, MESH, "sp"),
            r"fastdist\.psum: unknown mesh axis 'sp'; Mesh\(\{'dp': 2, 'tp': 4\}\) has axes "
            r"\('dp', 'tp'\)\. Fix: use one of",
        ),
        (
            lambda x: fd.all_gather(x, MESH, ("tp", "tp")),
            r"fastdist\.all_gather: axis \('tp', 'tp'\) repeats an axis",
        ),
        (lambda x: fd.pmean(x, MESH, ()), r"fastdist\.pmean: axis=\(\) names no mesh axis"),
        (lambda x: fd.axis_index(MESH, "pp"), r"fastdist\.axis_index: unknown mesh axis 'pp'"),
        (lambda x: fd.ring_shift(x, MESH, "pp"), r"fastdist\.ring_shift: unknown mesh axis 'pp'"),
    ],
)
def test_unknown_axis_names_the_op(fn, match: str) -> None:
    with pytest.raises(fd.MeshError, match=match):
        sim(fn)


def test_collective_outside_simulate_has_no_backend() -> None:
    with pytest.raises(
        fd.NoBackendError,
        match=r"fastdist\.psum: Mesh\(\{'dp': 2, 'tp': 4\}\) has 8 ranks but no backend "
        r"here.*fastdist\.simulate\(fn, mesh\)",
    ):
        fd.psum(torch.zeros(3), MESH, "tp")
    with pytest.raises(fd.NoBackendError, match=r"fastdist\.axis_index"):
        fd.axis_index(MESH, "tp")


def test_collective_on_a_mesh_not_given_to_simulate() -> None:
    other = fd.Mesh({"tp": 8})
    with pytest.raises(
        fd.NoBackendError, match=r"no simulation of this mesh is running.*meshes=\[\.\.\.\]"
    ):
        sim(lambda x: fd.psum(x, other, "tp"))
    assert fd.core.context._RUNNING.simulations == ()  # dropped even on error


def test_simulate_argument_errors() -> None:
    with pytest.raises(
        fd.MeshError,
        match=r"simulate\(<lambda>\): a tensor argument has shape \(4, 2\); every tensor needs a "
        r"leading rank dimension of size 8.*Fix: stack",
    ):
        fd.simulate(lambda x: x, MESH)(torch.zeros(4, 2))
    with pytest.raises(fd.MeshError, match=r"leading rank dimension"):
        fd.simulate(lambda x: x, MESH)(torch.tensor(1.0))
    with pytest.raises(fd.MeshError, match=r"every mesh in meshes= must be a Mesh of 8 ranks"):
        fd.simulate(lambda x: x, MESH, meshes=[fd.Mesh({"tp": 4})])
    with pytest.raises(fd.MeshError, match=r"simulate: mesh must be a fastdist\.Mesh, got dict"):
        fd.simulate(lambda x: x, {"tp": 4})  # type: ignore[arg-type]


@pytest.mark.parametrize("rows", [3, 8])  # 8 == world size: must not be mistaken for the rank dim
def test_user_vmap_inside_simulate_over_a_collective_is_refused(rows: int) -> None:
    x = torch.zeros(8, 8, 5)
    with pytest.raises(
        fd.NoBackendError,
        match=r"fastdist\.psum: its input is batched by a torch\.vmap inside "
        r"fastdist\.simulate.*move the vmap outside simulate",
    ):
        sim(lambda x: torch.vmap(lambda row: fd.psum(row, MESH, "tp"))(x[:rows]), x)


def test_vmap_rule_refuses_a_batch_that_is_not_the_world() -> None:
    """The compiled path cannot inspect functorch levels; the vmap rule still checks the size."""
    prim = PRIMITIVES["psum"]
    args = prim._op_args(fd.core.primitive.GroupSpec((2, 4), (1,)), {})
    with pytest.raises(
        fd.NoBackendError, match=r"fastdist\.psum: vmapped over 3 entries, but the mesh has 8 ranks"
    ):
        torch.vmap(lambda r: prim.per_rank_op(r, *args))(torch.zeros(3, 2))


@pytest.mark.parametrize("name", ["psum", "all_gather"])
def test_raw_per_rank_op_on_a_plain_tensor_over_many_ranks(name: str) -> None:
    prim = PRIMITIVES[name]
    params = {"dim": 0, "tiled": True} if name == "all_gather" else {}
    with pytest.raises(
        fd.NoBackendError,
        match=rf"fastdist\.{name}: called on a plain tensor over a mesh of 8 ranks",
    ):
        prim.per_rank_op(
            torch.zeros(3), *prim._op_args(fd.core.primitive.GroupSpec((2, 4), (1,)), params)
        )


# Issue 32.7: the weak or silent cases of the error census. Each message names the op or module,
# the axis (and the rank where there is one) and the fix.
TP2 = fd.Mesh({"sp": 2, "tp": 2})


def _linear_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv1d(4, 4, 1), torch.nn.Linear(4, 4))


CENSUS = [
    (
        "all_gather tiled='no'",
        lambda: fd.simulate(lambda x: fd.all_gather(x, TP2, "tp", tiled="no"), TP2)(
            torch.ones(4, 3)
        ),
        fd.CollectiveError,
        "fastdist.all_gather(axis='tp') on every rank: tiled='no' is not a bool. Fix: pass "
        "tiled=True or tiled=False",
    ),
    (
        "psum_scatter tiled=1",
        lambda: fd.simulate(lambda x: fd.psum_scatter(x, TP2, "tp", tiled=1), TP2)(
            torch.ones(4, 2)
        ),
        fd.CollectiveError,
        "fastdist.psum_scatter(axis='tp') on every rank: tiled=1 is not a bool. Fix: pass "
        "tiled=True or tiled=False",
    ),
    (
        "padding_idx outside the vocabulary",
        lambda: fd.nn.VocabParallelEmbedding(8, 4, TP2, "tp", padding_idx=9),
        fd.MeshError,
        "VocabParallelEmbedding(axis='tp'): padding_idx=9 is not an id of the 8-word vocabulary. "
        "Fix: pass an id in [0, 8) (or [-8, -1] counted from the end, as nn.Embedding takes), or "
        "None",
    ),
    (
        "UlyssesAttention, unknown axis",
        lambda: fd.nn.UlyssesAttention(TP2, "cp"),
        fd.MeshError,
        "UlyssesAttention: unknown mesh axis 'cp'; Mesh({'sp': 2, 'tp': 2}) has axes ('sp', 'tp') "
        "(axis='cp'). Fix: use one of ('sp', 'tp')",
    ),
    (
        "RingAttention, no mesh",
        lambda: fd.nn.RingAttention({"sp": 2}),  # type: ignore[arg-type]
        fd.MeshError,
        "RingAttention: mesh must be a fastdist.Mesh, got dict. Fix: pass the Mesh the model "
        "runs on",
    ),
    (
        "spmd spec longer than the tensor",
        lambda: fd.spmd(lambda x: x, TP2, (fd.P("sp", "tp"),), fd.P("sp"))(torch.ones(4)),
        fd.MeshError,
        "spmd: in_specs[0] P('sp', 'tp') has 2 entries but the tensor is 1-d (4,). Fix: give at "
        "most 1 entry, one per leading dim of the tensor (dims left out are replicated)",
    ),
    (
        "spmd bad check=",
        lambda: fd.spmd(lambda x: x, TP2, (fd.P("sp"),), fd.P("sp"), check="yes"),
        fd.MeshError,
        "spmd: check must be 'insert', 'error', True or False, got 'yes'. Fix: check='insert' "
        "(add the pvary a replicated value needs), check='error' (name it), or check=False (no "
        "bookkeeping; needed under torch.compile)",
    ),
    (
        "ColumnParallelLinear, indivisible",
        lambda: fd.nn.ColumnParallelLinear(4, 5, TP2, "tp"),
        fd.MeshError,
        "ColumnParallelLinear(axis='tp'): out_features=5 is not divisible by the size 2 of axis "
        "'tp'. Fix: choose out_features divisible by 2, or split the layer over a smaller axis",
    ),
    (
        "RowParallelLinear, unknown axis",
        lambda: fd.nn.RowParallelLinear(4, 4, TP2, "dp"),
        fd.MeshError,
        "RowParallelLinear(axis='dp'): unknown mesh axis 'dp'; Mesh({'sp': 2, 'tp': 2}) has axes "
        "('sp', 'tp'). Fix: use one of ('sp', 'tp')",
    ),
    (
        "MergedColumnParallelLinear, one projection indivisible",
        lambda: fd.nn.MergedColumnParallelLinear(4, (4, 3), TP2, "tp", names=("q", "k")),
        fd.MeshError,
        "MergedColumnParallelLinear['k'](axis='tp'): out_features=3 is not divisible by the size "
        "2 of axis 'tp'. Fix: choose out_features divisible by 2",
    ),
    (
        "USPAttention, one axis twice",
        lambda: fd.nn.USPAttention(TP2, "tp", "tp"),
        fd.MeshError,
        "USPAttention: ulysses_axis and ring_axis are both 'tp'; they must be different axes of "
        "Mesh({'sp': 2, 'tp': 2}). Fix: pass another axis for one of them (e.g. "
        "ulysses_axis='sp')",
    ),
    (
        "parallelize, wrong module type",
        lambda: fd.nn.parallelize(_linear_model(), TP2, {"0": fd.nn.ColwiseParallel()}),
        fd.nn.ParallelizeError,
        "parallelize: '0' is a Conv1d; ColwiseParallel(axis='tp') needs nn.Linear or "
        "transformers' Conv1D. Fix: give this style to the linear layers only",
    ),
    (
        "checkpoint.load, missing file",
        lambda: fd.checkpoint.load(
            "/nonexistent/model.safetensors", fd.nn.ColumnParallelLinear(4, 4, TP2, "tp"), mesh=TP2
        ),
        fd.MeshError,
        "fastdist.checkpoint.load: /nonexistent/model.safetensors does not exist. Fix: pass a "
        ".safetensors file, a save_pretrained directory",
    ),
    (
        "from_torch timeout=-1",
        lambda: fd.connect(tp=2, timeout=-1),
        fd.MeshError,
        "fastdist.connect: timeout must be positive seconds or a positive timedelta, got -1. Fix: "
        "pass timeout=<seconds> greater than 0 (e.g. timeout=60), or leave it out for the default "
        "(600 s)",
    ),
    (
        "from_torch check='yes'",
        lambda: fd.connect(tp=2, check="yes"),  # type: ignore[arg-type]
        fd.MeshError,
        "fastdist.connect: check must be True or False, got 'yes'. Fix: check=True",
    ),
]


@pytest.mark.parametrize("case, call, kind, start", CENSUS, ids=[c[0] for c in CENSUS])
def test_census_messages_name_the_op_axis_and_fix(
    case: str, call: Callable[[], object], kind: type[Exception], start: str
) -> None:
    """Issue 32.7 (the wrong world size for from_torch and meshes built in different orders run
    on gloo: tests/test_reliability.py)."""
    with pytest.raises(kind) as info:
        call()
    assert str(info.value).startswith(start), (case, str(info.value))
    assert "Fix: " in str(info.value)


def test_batch_norm_training_on_simulated_data_parallel_names_the_modules() -> None:
    """A BatchNorm updating its running statistics under a data-parallel simulation: torch's raw
    vmap error before, a ParallelizeError naming the module and the fix now (real ranks run it:
    each rank's own statistics, as DDP does without SyncBatchNorm)."""
    from torch import nn

    from fastdist.errors import ParallelizeError

    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)).double()
    pm = fd.nn.parallelize(model, fd.Mesh({"dp": 2}), {})
    x = torch.randn(2, 2, 3, 5, 5, dtype=torch.float64)  # (rank, batch, C, H, W)
    with pytest.raises(ParallelizeError, match=r"\['1'\] \(1 modules\) are BatchNorms.*Fix: "):
        pm(x)
    model.eval()
    assert pm(x).shape == (2, 2, 4, 5, 5)  # eval mode: the running statistics are only read


def test_a_style_given_as_the_plan_names_the_dict_to_write() -> None:
    """A style where the plan goes: torch's raw AttributeError ('... has no attribute items')
    before."""
    from torch import nn

    from fastdist.errors import ParallelizeError

    with pytest.raises(ParallelizeError, match=r"Fix: plan=\{'': DomainParallel\(\.\.\.\)\}"):
        fd.nn.parallelize(nn.Conv2d(2, 2, 3), fd.Mesh({"h": 2}), fd.nn.DomainParallel({-2: "h"}))
