"""fastdist.nn layers against the single-device modules: outputs and every gradient, on every
rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import Tensor, nn

import fastdist as fd
from fastdist import P
from fastdist.testing import assert_matches_single_device
from tests.dist_harness import run_on_gloo

F64 = torch.float64


def module_fn(module: nn.Module, names: list[str]) -> Any:
    """Per-rank function of (input, *params) for a parallel module (params as explicit inputs)."""
    return lambda x, *ps: torch.func.functional_call(module, dict(zip(names, ps)), (x,))


def check_layer(
    par: nn.Module,
    full: nn.Module | Any,
    mesh: fd.Mesh,
    x: Tensor,
    x_spec: fd.PartitionSpec,
    out_spec: fd.PartitionSpec,
    full_state: dict[str, Tensor],
    checked: bool = True,
) -> None:
    specs = fd.nn.param_specs(par)
    names = list(specs)
    ref = (
        full
        if not isinstance(full, nn.Module)
        else (lambda x, *ps: torch.func.functional_call(full, dict(zip(names, ps)), (x,)))
    )
    assert_matches_single_device(
        module_fn(par, names),
        ref,
        mesh,
        [x, *(full_state[n] for n in names)],
        in_specs=(x_spec, *(specs[n] for n in names)),
        out_specs=out_spec,
        check=checked,
    )


@st.composite
def dp_tp(draw: Any) -> fd.Mesh:
    return fd.Mesh({"dp": draw(st.integers(1, 2)), "tp": draw(st.integers(1, 3))})


@given(mesh=dp_tp(), gather=st.booleans(), seed=st.integers(0, 99), checked=st.booleans())
def test_column_parallel_linear(mesh: fd.Mesh, gather: bool, seed: int, checked: bool) -> None:
    # unchecked: no replication-checking mode, so the simulated layer adds its bias in place
    # (fastdist.nn.layers.linear); and no pvary is inserted over dp, so only a dp=1 mesh gives
    # single-device gradients
    assume(checked or mesh.shape["dp"] == 1)
    tp, dp = mesh.shape["tp"], mesh.shape["dp"]
    torch.manual_seed(seed)
    full = nn.Linear(5, 2 * tp, dtype=F64)
    par = fd.nn.ColumnParallelLinear(5, 2 * tp, mesh, "tp", gather_output=gather, dtype=F64)
    x = torch.randn(2 * dp, 5, dtype=F64)
    check_layer(
        par,
        full,
        mesh,
        x,
        P("dp", None),
        P("dp", None) if gather else P("dp", "tp"),
        full.state_dict(),
        checked,
    )


def check_merged(
    mesh: fd.Mesh,
    sizes: tuple[int, ...],
    gather: bool,
    sequence_parallel: bool,
    seed: int,
    checked: bool = True,
) -> None:
    """MergedColumnParallelLinear == one nn.Linear per size, on every rank (outputs and
    gradients)."""
    tp, dp = mesh.shape["tp"], mesh.shape["dp"]
    torch.manual_seed(seed)
    full = nn.ModuleList(nn.Linear(5, k * tp, dtype=F64) for k in sizes)
    par = fd.nn.MergedColumnParallelLinear(
        5,
        [k * tp for k in sizes],
        mesh,
        "tp",
        gather_output=gather,
        sequence_parallel=sequence_parallel,
        dtype=F64,
    )
    state = {k: v.detach() for k, v in full.state_dict().items()}  # the same names
    specs = fd.nn.param_specs(par)
    names = list(specs)
    x = torch.randn(2 * dp, 2 * tp, 5, dtype=F64)  # (batch, seq, in)
    x_spec = P("dp", "tp" if sequence_parallel else None, None)
    if gather:  # every rank holds every feature: the outputs side by side
        join, out_spec = (lambda outs: torch.cat(outs, -1)), P("dp", None, None)
    else:  # this rank's features of each output (equal sizes): stacked on a new leading dim
        join, out_spec = torch.stack, P(None, "dp", None, "tp")

    def parallel(x: Tensor, *ps: Tensor) -> Tensor:
        return join(torch.func.functional_call(par, dict(zip(names, ps)), (x,)))

    def reference(x: Tensor, *ps: Tensor) -> Tensor:
        w = dict(zip(names, ps))
        return join([F.linear(x, w[f"{i}.weight"], w[f"{i}.bias"]) for i in range(len(sizes))])

    assert_matches_single_device(
        parallel,
        reference,
        mesh,
        [x, *(state[n] for n in names)],
        in_specs=(x_spec, *(specs[n] for n in names)),
        out_specs=out_spec,
        check=checked,
    )


@given(
    mesh=dp_tp(),
    gather=st.booleans(),
    sequence_parallel=st.booleans(),
    seed=st.integers(0, 99),
    checked=st.booleans(),
    data=st.data(),
)
def test_merged_column_parallel_linear(
    mesh: fd.Mesh,
    gather: bool,
    sequence_parallel: bool,
    seed: int,
    checked: bool,
    data: st.DataObject,
) -> None:
    # unchecked: the in-place bias path; no pvary over dp inserted
    assume(checked or mesh.shape["dp"] == 1)
    # unequal sizes (grouped-query attention: q wider than k and v) where the outputs are
    # concatenated
    sizes = (
        data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple))
        if gather
        else (2, 2, 2)
    )
    check_merged(mesh, sizes, gather, sequence_parallel, seed, checked)


def test_merged_column_parallel_linear_runs_one_input_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The point of the merged layer: one all-gather forward (and so one reduce-scatter backward)
    for every projection."""
    import fastdist.nn.layers as fnn

    mesh = fd.Mesh({"tp": 2})
    calls: list[str] = []
    real = fnn.all_gather
    monkeypatch.setattr(
        fnn, "all_gather", lambda *a, **k: (calls.append("all_gather"), real(*a, **k))[1]
    )
    par = fd.nn.MergedColumnParallelLinear(4, (4, 4, 4), mesh, "tp", sequence_parallel=True)
    # the module's own (local) parameters on every rank
    outs = fd.simulate(lambda x: par(x), mesh)(torch.randn(2, 1, 3, 4))
    assert [tuple(o.shape) for o in outs] == [(2, 1, 6, 2)] * 3 and calls == ["all_gather"]
    # loads name for name
    assert list(par.state_dict()) == list(
        nn.ModuleList(nn.Linear(4, 4) for _ in range(3)).state_dict()
    )
    assert len(par) == 3 and par[-1] is list(par)[2] and par[1].weight.shape == (2, 4)
    with pytest.raises(fd.MeshError, match="out_features is empty"):
        fd.nn.MergedColumnParallelLinear(4, (), mesh)


@given(mesh=dp_tp(), parallel_in=st.booleans(), seed=st.integers(0, 99))
def test_row_parallel_linear(mesh: fd.Mesh, parallel_in: bool, seed: int) -> None:
    tp, dp = mesh.shape["tp"], mesh.shape["dp"]
    torch.manual_seed(seed)
    full = nn.Linear(2 * tp, 3, dtype=F64)
    par = fd.nn.RowParallelLinear(2 * tp, 3, mesh, "tp", input_is_parallel=parallel_in, dtype=F64)
    x = torch.randn(2 * dp, 2 * tp, dtype=F64)
    check_layer(
        par,
        full,
        mesh,
        x,
        P("dp", "tp") if parallel_in else P("dp", None),
        P("dp", None),
        full.state_dict(),
    )


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_mlp(tp: int) -> None:
    _sp_mlp_check(fd.Mesh({"tp": tp}))


def _sp_mlp_check(mesh: fd.Mesh) -> None:
    """Megatron sequence parallelism: all-gather the sequence in, reduce-scatter it out."""
    tp = mesh.shape["tp"]
    torch.manual_seed(tp)
    fc1, fc2 = nn.Linear(4, 2 * tp, dtype=F64), nn.Linear(2 * tp, 4, dtype=F64)
    mlp = nn.Sequential(
        fd.nn.ColumnParallelLinear(4, 2 * tp, mesh, sequence_parallel=True, dtype=F64),
        nn.Tanh(),
        fd.nn.RowParallelLinear(2 * tp, 4, mesh, sequence_parallel=True, dtype=F64),
    )
    state = {"0.weight": fc1.weight, "0.bias": fc1.bias, "2.weight": fc2.weight, "2.bias": fc2.bias}
    full = nn.Sequential(fc1, nn.Tanh(), fc2)
    x = torch.randn(2, 2 * tp, 4, dtype=F64)  # (batch, seq, hidden): seq split over tp
    check_layer(
        mlp,
        full,
        mesh,
        x,
        P(None, "tp", None),
        P(None, "tp", None),
        {k: v.detach() for k, v in state.items()},
    )


@given(tp=st.integers(1, 4), seed=st.integers(0, 99))
def test_vocab_parallel_embedding_and_cross_entropy(tp: int, seed: int) -> None:
    _vocab_check(fd.Mesh({"tp": tp}), seed)


def _vocab_check(mesh: fd.Mesh, seed: int) -> None:
    tp = mesh.shape["tp"]
    g = torch.Generator().manual_seed(seed)
    V, D = 3 * tp, 4
    ids = torch.randint(0, V, (2, 5), generator=g)
    emb = fd.nn.VocabParallelEmbedding(V, D, mesh, "tp", dtype=F64)
    w, head = torch.randn(V, D, dtype=F64, generator=g), torch.randn(V, D, dtype=F64, generator=g)

    def par(
        w: Tensor, head: Tensor
    ) -> Tensor:  # embed, project to this rank's vocab columns, cross entropy
        h = torch.func.functional_call(emb, {"weight": w}, (ids,))
        logits = fd.pvary(h, mesh, "tp") @ head.T  # (2, 5, V/tp)
        return fd.nn.vocab_parallel_cross_entropy(logits, ids, mesh, "tp")

    def ref(w: Tensor, head: Tensor) -> Tensor:
        return F.cross_entropy(
            (F.embedding(ids, w) @ head.T).reshape(-1, V), ids.reshape(-1), reduction="none"
        ).reshape(2, 5)

    assert_matches_single_device(
        par, ref, mesh, [w, head], in_specs=(P("tp", None), P("tp", None)), out_specs=P()
    )


def test_merged_projections_take_checkpoint_names_and_load_hf_keys() -> None:
    """names= gives q_proj/k_proj/v_proj; a checkpoint with the projections one level up loads with
    rename=."""
    mesh = fd.Mesh({"tp": 2})
    full = {
        name: torch.nn.Linear(4, out, dtype=F64)
        for name, out in (("q_proj", 4), ("k_proj", 2), ("v_proj", 2))
    }
    # HF layout
    ckpt = {f"self_attn.{n}.{p}": t for n, lin in full.items() for p, t in lin.state_dict().items()}
    model = torch.nn.Module()
    model.self_attn = torch.nn.Module()
    model.self_attn.qkv = fd.nn.MergedColumnParallelLinear(
        4, (4, 2, 2), mesh, "tp", names=("q_proj", "k_proj", "v_proj"), dtype=F64
    )
    assert [n for n, _ in model.named_parameters()][:2] == [
        "self_attn.qkv.q_proj.weight",
        "self_attn.qkv.q_proj.bias",
    ]
    for p in model.parameters():  # a simulated mesh holds every rank's shard stacked
        p.data = p.data.expand(2, *p.shape).clone()
    fd.checkpoint.load(ckpt, model, mesh=mesh, rename=lambda k: k.replace(".qkv.", "."))
    x = torch.randn(3, 4, dtype=F64)
    params = dict(model.named_parameters())
    outs = fd.simulate(
        lambda p, x: torch.func.functional_call(
            model.self_attn.qkv, {k.split("qkv.")[1]: v for k, v in p.items()}, (x,)
        ),
        mesh,
    )(params, x.expand(2, 3, 4))
    for got, lin in zip(outs, full.values()):
        # rank r: columns r of each projection
        torch.testing.assert_close(torch.cat(list(got), -1), lin(x).detach())
    with pytest.raises(fd.nn.CheckpointError, match="missing keys"):
        fd.checkpoint.load(ckpt, model, mesh=mesh)  # without the rename nothing matches
    with pytest.raises(fd.MeshError, match="names"):
        fd.nn.MergedColumnParallelLinear(4, (4, 2), mesh, "tp", names=("q", "q"))


@pytest.mark.parametrize("tp, V", [(2, 5), (4, 7), (3, 3)])
def test_vocab_parallel_embedding_pads_an_indivisible_vocabulary_and_skips_padding_idx(
    tp: int, V: int
) -> None:
    mesh, D = fd.Mesh({"tp": tp}), 3
    full = torch.nn.Embedding(V, D, padding_idx=1, dtype=F64)
    ids = torch.tensor([[0, 1, V - 1, 1, 2 % V]])
    emb = fd.nn.VocabParallelEmbedding(V, D, mesh, "tp", padding_idx=1, dtype=F64)
    layout = fd.nn.param_layouts(emb)["weight"]
    w = fd.nn.stack_state(full.state_dict(), {"weight": layout}, mesh)[
        "weight"
    ].requires_grad_()  # [tp, ceil(V/tp), D]
    assert w.shape == (tp, -(-V // tp), D)
    out = fd.simulate(lambda w, ids: torch.func.functional_call(emb, {"weight": w}, (ids,)), mesh)(
        w, ids.expand(tp, *ids.shape)
    )
    want = full(ids)
    torch.testing.assert_close(out, want.expand(tp, *want.shape).detach())
    (
        out * torch.arange(D, dtype=F64)
    ).sum().backward()  # every rank's loss: the same replicated value
    (want * torch.arange(D, dtype=F64)).sum().backward()
    assert full.weight.grad[1].abs().max() == 0  # nn.Embedding: no gradient into padding_idx
    torch.testing.assert_close(fd.nn.unstack(w.grad, layout, mesh), full.weight.grad)


# ============================================================================ attention
def _qkv(B: int, S: int, H: int, D: int, seed: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, H, D, dtype=F64, generator=g) for _ in range(3)]


@given(
    P_=st.integers(1, 4),
    H=st.integers(1, 4),
    S=st.integers(1, 3),
    causal=st.booleans(),
    kind=st.sampled_from(["ulysses", "ring"]),
)
def test_sequence_parallel_attention_shapes(
    P_: int, H: int, S: int, causal: bool, kind: str
) -> None:
    """Any head count (Ulysses pads heads that do not divide), any per-rank length, causal or
    not."""
    mesh = fd.Mesh({"sp": P_})
    check_attention(mesh, kind, causal, H=H, S_local=S)


def check_attention(
    mesh: fd.Mesh, kind: str, causal: bool, *, H: int = 3, S_local: int = 2, axis: str = "sp"
) -> None:
    P_ = mesh.axis_size(axis)
    att = (
        fd.nn.UlyssesAttention(mesh, axis, causal=causal)
        if kind == "ulysses"
        else fd.nn.RingAttention(mesh, axis, causal=causal)
    )
    spec = P(None, axis, None, None)
    assert_matches_single_device(
        lambda q, k, v: att(q, k, v),
        lambda q, k, v: fd.nn.local_attention(q, k, v, causal=causal),
        mesh,
        _qkv(2, S_local * P_, H, 4, P_ + H),
        in_specs=(spec, spec, spec),
        out_specs=spec,
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("P_, H", [(2, 4), (2, 3), (4, 2)])  # heads not divisible by P are padded
def test_ulysses_attention(P_: int, H: int, causal: bool) -> None:
    mesh = fd.Mesh({"sp": P_})
    att = fd.nn.UlyssesAttention(mesh, "sp", causal=causal)
    spec = P(None, "sp", None, None)
    assert_matches_single_device(
        lambda q, k, v: att(q, k, v),
        lambda q, k, v: fd.nn.local_attention(q, k, v, causal=causal),
        mesh,
        _qkv(2, 3 * P_, H, 4, P_ + H),
        in_specs=(spec, spec, spec),
        out_specs=spec,
    )


@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_attention_uneven_sequence(causal: bool) -> None:
    mesh, sizes = fd.Mesh({"sp": 3}), [3, 1, 2]
    att = fd.nn.UlyssesAttention(mesh, "sp", causal=causal)
    q, k, v = _qkv(1, sum(sizes), 3, 4, 7)
    m = max(sizes)

    def shard(t: Tensor) -> Tensor:  # [rank, B, m, H, D]: each rank's tokens, padded to m rows
        chunks = torch.split(t, sizes, dim=1)
        return torch.stack(
            [
                torch.cat([c, c.new_zeros(c.shape[0], m - c.shape[1], *c.shape[2:])], dim=1)
                for c in chunks
            ]
        )

    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    out = fd.simulate(lambda q, k, v: att(q, k, v, seq_sizes=sizes), mesh)(*leaves)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = fd.nn.local_attention(*ref, causal=causal)
    torch.testing.assert_close(out, shard(want.detach()))
    c = shard(torch.randn(want.shape, dtype=F64, generator=torch.Generator().manual_seed(1)))
    (out * c).sum().backward()
    (want * torch.cat([c[i, :, : sizes[i]] for i in range(3)], dim=1)).sum().backward()
    for got, r in zip(leaves, ref):
        torch.testing.assert_close(got.grad, shard(r.grad))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("P_", [2, 4])
def test_ring_attention(P_: int, causal: bool) -> None:
    mesh = fd.Mesh({"sp": P_})
    att = fd.nn.RingAttention(mesh, "sp", causal=causal)
    spec = P(None, "sp", None, None)
    assert_matches_single_device(
        lambda q, k, v: att(q, k, v),
        lambda q, k, v: fd.nn.local_attention(q, k, v, causal=causal),
        mesh,
        _qkv(1, 2 * P_, 3, 4, P_),
        in_specs=(spec, spec, spec),
        out_specs=spec,
    )


@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_with_merged_projection_compiled(causal: bool) -> None:
    """Compiled and eager simulated steps (ring attention's detached running max, the
    simulated in-place bias vs the compiled out-of-place one) give one device's gradients."""
    mesh = fd.Mesh({"sp": 2, "tp": 2})
    torch.manual_seed(1)
    D, heads = 8, 2
    qkv = fd.nn.MergedColumnParallelLinear(
        D, (D, D, D), mesh, "tp", sequence_parallel=True, dtype=F64
    )
    att = fd.nn.RingAttention(mesh, "sp", causal=causal)
    full = nn.ModuleList(nn.Linear(D, D, dtype=F64) for _ in range(3))
    specs = fd.nn.param_specs(qkv)
    names = list(specs)
    state = {k: v.detach() for k, v in full.state_dict().items()}
    x = torch.randn(2, 8, D, dtype=F64)  # (batch, seq, hidden): seq over (sp, tp)

    def par(x: Tensor, *ps: Tensor) -> Tensor:
        # (B, S/sp, H/tp, hd)
        q, k, v = (
            t.unflatten(-1, (-1, D // heads))
            for t in torch.func.functional_call(qkv, dict(zip(names, ps)), (x,))
        )
        return att(q, k, v).flatten(-2)  # (B, S/sp, D/tp)

    def ref(x: Tensor, *ps: Tensor) -> Tensor:
        w = dict(zip(names, ps))
        q, k, v = (
            F.linear(x, w[f"{i}.weight"], w[f"{i}.bias"]).unflatten(-1, (heads, D // heads))
            for i in range(3)
        )
        return fd.nn.local_attention(q, k, v, causal=causal).flatten(-2)

    in_specs = (P(None, ("sp", "tp"), None), *(specs[n] for n in names))
    out_spec = P(None, "sp", "tp")
    # Checked (eager; the checker inserts the pvary over sp the weights need, and the bias goes
    # out of place) and unchecked (no pvary: each sp rank's weight gradient covers its own
    # tokens only, and spmd's gradient of a replicated input is the mean over its holders).
    checked = fd.spmd(par, mesh, in_specs=in_specs, out_specs=out_spec, check="insert")
    unchecked = fd.spmd(par, mesh, in_specs=in_specs, out_specs=out_spec, check=False)
    target = torch.randn(2, 8, D, dtype=F64)
    grads = []
    # static shapes: no automatic-dynamic recompile carried over from earlier tests
    torch._dynamo.reset()
    for run in (checked, unchecked, torch.compile(unchecked), ref):
        leaves = [t.clone().requires_grad_() for t in (x, *(state[n] for n in names))]
        out = run(*leaves)
        (out * target).sum().backward()
        grads.append([t.grad for t in leaves])
    for i, (good, eager, compiled, one) in enumerate(zip(*grads)):
        torch.testing.assert_close(good, one)
        # x: exact; parameters: the mean over the 2 sp replicas
        torch.testing.assert_close(eager, one if i == 0 else one / 2)
        torch.testing.assert_close(compiled, eager)


def test_merged_sequence_parallel_projection_compiles_with_dynamic_shapes() -> None:
    """vmap's ``linear`` rule with a bias fails on symbolic shapes in torch 2.13; the layers add the
    bias apart when compiled."""
    mesh = fd.Mesh({"tp": 2})
    D = 4
    qkv = fd.nn.MergedColumnParallelLinear(D, (D, D), mesh, "tp", sequence_parallel=True, dtype=F64)
    specs = fd.nn.param_specs(qkv)
    names = list(specs)
    full = nn.ModuleList(nn.Linear(D, D, dtype=F64) for _ in range(2))
    state = {k: v.detach() for k, v in full.state_dict().items()}

    def par(x: Tensor, *ps: Tensor) -> Tensor:
        # (B, S, 2 D/tp)
        return torch.cat(torch.func.functional_call(qkv, dict(zip(names, ps)), (x,)), -1)

    step = fd.spmd(
        par,
        mesh,
        in_specs=(P(None, "tp", None), *(specs[n] for n in names)),
        out_specs=P(None, None, "tp"),
        check=False,
    )
    x = torch.randn(2, 4, D, dtype=F64)
    grads = []
    for run in (step, torch.compile(step, dynamic=True)):
        leaves = [t.clone().requires_grad_() for t in (x, *(state[n] for n in names))]
        out = run(*leaves)
        q, k = (
            F.linear(leaves[0], *(leaves[1 + names.index(f"{i}.{p}")] for p in ("weight", "bias")))
            for i in range(2)
        )
        half = D // 2  # each tp rank's columns: [q_r, k_r], ranks side by side
        torch.testing.assert_close(
            out, torch.cat([q[..., :half], k[..., :half], q[..., half:], k[..., half:]], -1)
        )
        out.pow(2).sum().backward()
        grads.append([t.grad for t in leaves])
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager)


@pytest.mark.parametrize("causal", [False, True])
def test_usp_attention_on_orthogonal_axes(causal: bool) -> None:
    mesh = fd.Mesh({"ring": 2, "uly": 2})
    att = fd.nn.USPAttention(mesh, "uly", "ring", causal=causal)
    spec = P(None, ("ring", "uly"), None, None)  # ring-major sequence split
    assert_matches_single_device(
        lambda q, k, v: att(q, k, v),
        lambda q, k, v: fd.nn.local_attention(q, k, v, causal=causal),
        mesh,
        _qkv(1, 8, 3, 4, 3),
        in_specs=(spec, spec, spec),
        out_specs=spec,
    )
    with pytest.raises(
        fd.MeshError,
        match=r"ulysses_axis and ring_axis are both 'uly'; they must be different axes",
    ):
        fd.nn.USPAttention(mesh, "uly", "uly")


# ================================================================ a transformer block, TP x SP x DP
class Block(nn.Module):
    """Pre-norm transformer block; with a mesh, the same block tensor-, sequence- and
    data-parallel."""

    def __init__(self, D: int, heads: int, Fh: int, mesh: fd.Mesh | None = None) -> None:
        super().__init__()
        self.heads, self.mesh = heads, mesh
        self.ln1, self.ln2 = nn.LayerNorm(D, dtype=F64), nn.LayerNorm(D, dtype=F64)
        if mesh is None:
            self.qkv = nn.ModuleList(nn.Linear(D, D, dtype=F64) for _ in range(3))
            self.o = nn.Linear(D, D, dtype=F64)
            self.fc1, self.fc2 = nn.Linear(D, Fh, dtype=F64), nn.Linear(Fh, D, dtype=F64)
        else:
            # the same parameter names
            self.qkv = fd.nn.MergedColumnParallelLinear(D, (D, D, D), mesh, "tp", dtype=F64)
            self.o = fd.nn.RowParallelLinear(D, D, mesh, "tp", dtype=F64)
            self.fc1, self.fc2 = (
                fd.nn.ColumnParallelLinear(D, Fh, mesh, "tp", dtype=F64),
                fd.nn.RowParallelLinear(Fh, D, mesh, "tp", dtype=F64),
            )
            self.attn = fd.nn.RingAttention(mesh, "sp", causal=True)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln1(x)
        hd = x.shape[-1] // self.heads
        qkv = self.qkv(h) if self.mesh is not None else [proj(h) for proj in self.qkv]
        q, k, v = (t.unflatten(-1, (-1, hd)) for t in qkv)  # (B, S, heads on this rank, hd)
        a = (
            self.attn(q, k, v)
            if self.mesh is not None
            else fd.nn.local_attention(q, k, v, causal=True)
        )
        x = x + self.o(a.flatten(-2))
        return x + self.fc2(torch.tanh(self.fc1(self.ln2(x))))


def test_transformer_block_tp_sp_dp_matches_and_trains_like_one_device() -> None:
    mesh = fd.Mesh({"dp": 2, "sp": 2, "tp": 2})
    torch.manual_seed(0)
    full, par = Block(8, 4, 12), Block(8, 4, 12, mesh)
    specs = fd.nn.param_specs(par)
    names = list(specs)
    x = torch.randn(4, 6, 8, dtype=F64)
    target = torch.randn(4, 6, 8, dtype=F64)
    x_spec = P("dp", "sp", None)
    state = {n: p.detach().clone() for n, p in full.named_parameters()}
    # every rank's outputs and gradients equal the single-device block's, as fd.spmd runs the
    # block below: check="insert" sums the gradients of dp/sp-replicated parameters over dp/sp
    assert_matches_single_device(
        module_fn(par, names),
        lambda x, *ps: torch.func.functional_call(full, dict(zip(names, ps)), (x,)),
        mesh,
        [x, *(state[n] for n in names)],
        in_specs=(x_spec, *(specs[n] for n in names)),
        out_specs=x_spec,
        check="insert",
    )
    # and a few SGD steps follow the same loss curve (global in, global out through spmd)
    step = fd.spmd(
        module_fn(par, names), mesh, in_specs=(x_spec, *(specs[n] for n in names)), out_specs=x_spec
    )
    par_params = {n: t.clone().requires_grad_() for n, t in state.items()}
    ref_params = {n: t.clone().requires_grad_() for n, t in state.items()}
    curves: tuple[list[float], list[float]] = ([], [])
    for _ in range(4):
        for curve, params, run in (
            (curves[0], par_params, lambda ps: step(x, *(ps[n] for n in names))),
            (curves[1], ref_params, lambda ps: torch.func.functional_call(full, ps, (x,))),
        ):
            loss = ((run(params) - target) ** 2).mean()
            loss.backward()
            curve.append(loss.item())
            with torch.no_grad():
                for p in params.values():
                    p -= 0.1 * p.grad
                    p.grad = None
    assert curves[0][-1] < curves[0][0]
    torch.testing.assert_close(torch.tensor(curves[0]), torch.tensor(curves[1]))


def test_shard_unstack_and_errors() -> None:
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    full = torch.arange(32.0).reshape(4, 8)
    for spec in (P("tp", None), P(None, ("dp", "tp")), P(), P("dp", "tp")):
        stacked = fd.nn.stack_state({"w": full}, {"w": spec}, mesh)["w"]
        assert torch.equal(fd.nn.unstack(stacked, spec, mesh), full)
    with pytest.raises(
        fd.MeshError,
        match=r"ColumnParallelLinear\(axis='tp'\): out_features=5 is not divisible by the size 2 "
        r"of axis 'tp'\. Fix: choose out_features divisible by 2",
    ):
        fd.nn.ColumnParallelLinear(3, 5, mesh)
    with pytest.raises(
        fd.MeshError,
        match=r"splits dim 1 \(size 6\) over \('dp', 'tp'\) \(4 ranks\), which does not divide it",
    ):
        fd.nn.stack_state({"w": torch.zeros(4, 6)}, {"w": P(None, ("dp", "tp"))}, mesh)
    with pytest.raises(fd.MeshError, match=r"the state dict lacks \['bias'\]"):
        fd.nn.shard_state({"weight": torch.zeros(2, 2)}, {"weight": P(), "bias": P()}, mesh, 0)


# ============================================================================ on gloo
def check_column_row(mesh: fd.Mesh, seed: int = 0) -> None:
    tp, dp = mesh.shape["tp"], mesh.shape["dp"]
    torch.manual_seed(seed)
    full = nn.Linear(5, 2 * tp, dtype=F64)
    for gather in (False, True):
        par = fd.nn.ColumnParallelLinear(5, 2 * tp, mesh, "tp", gather_output=gather, dtype=F64)
        check_layer(
            par,
            full,
            mesh,
            torch.randn(2 * dp, 5, dtype=F64),
            P("dp", None),
            P("dp", None) if gather else P("dp", "tp"),
            full.state_dict(),
        )
    full = nn.Linear(2 * tp, 3, dtype=F64)
    for parallel_in in (False, True):
        par = fd.nn.RowParallelLinear(
            2 * tp, 3, mesh, "tp", input_is_parallel=parallel_in, dtype=F64
        )
        check_layer(
            par,
            full,
            mesh,
            torch.randn(2 * dp, 2 * tp, dtype=F64),
            P("dp", "tp") if parallel_in else P("dp", None),
            P("dp", None),
            full.state_dict(),
        )


def gloo_layers() -> str:
    """Every layer on real ranks: the same checks as on simulated ranks."""
    tp_mesh = fd.connect(tp=2)  # dp = 2
    check_column_row(tp_mesh)
    _vocab_check(fd.connect(order=("dp", "tp"), tp=4), seed=3)
    _sp_mlp_check(fd.connect(order=("dp", "tp"), tp=4))
    for gather, sequence_parallel in ((False, True), (True, False)):
        check_merged(
            tp_mesh, (2, 2, 2) if not gather else (2, 1, 1), gather, sequence_parallel, seed=5
        )
    sp = fd.connect(order=("dp", "sp"), sp=4)
    for kind in ("ulysses", "ring"):
        check_attention(sp, kind, causal=True, H=3)
    usp = fd.connect(order=("dp", "ring", "uly"), ring=2, uly=2)
    att = fd.nn.USPAttention(usp, "uly", "ring", causal=True)
    spec = P(None, ("ring", "uly"), None, None)
    assert_matches_single_device(
        lambda q, k, v: att(q, k, v),
        lambda q, k, v: fd.nn.local_attention(q, k, v, causal=True),
        usp,
        _qkv(1, 8, 3, 4, 3),
        in_specs=(spec, spec, spec),
        out_specs=spec,
    )
    col = fd.nn.ColumnParallelLinear(4, 6, tp_mesh, gather_output=True, dtype=F64)
    full = nn.Linear(4, 6, dtype=F64)
    fd.checkpoint.load(full.state_dict(), col, mesh=tp_mesh)
    x = torch.randn(3, 4, dtype=F64)
    torch.testing.assert_close(col(x), full(x))
    return "ok"


def test_layers_on_gloo() -> None:
    assert run_on_gloo(gloo_layers, 4, timeout=240) == ["ok"] * 4
