"""Replication types and checked mode: gradients right without hand-written pvary; every error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import fastdist as fd
from fastdist import P

from .reference import meshes

F64 = torch.float64


def leaves(*ts: Tensor) -> list[Tensor]:
    return [t.clone().requires_grad_() for t in ts]


def grads_of(fn: Any, ts: list[Tensor], c: Tensor) -> tuple[Tensor, list[Tensor]]:
    ls = leaves(*ts)
    out = fn(*ls)
    (out * c).sum().backward()
    return out.detach(), [t.grad for t in ls]


def assert_matches_single_device(
    spmd_fn: Any, ref_fn: Any, inputs: list[Tensor], seed: int = 0
) -> None:
    ref_out = ref_fn(*inputs)
    c = torch.randn(
        ref_out.shape, dtype=ref_out.dtype, generator=torch.Generator().manual_seed(seed)
    )
    out, grads = grads_of(spmd_fn, inputs, c)
    want_out, want_grads = grads_of(ref_fn, inputs, c)
    torch.testing.assert_close(out, want_out)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w)


# ============================================================================ the jax.md §2 cases
def test_psum_gradient_per_rank_is_one_in_checked_mode() -> None:
    """jax#3970: d psum(x) / dx is 1 for every element, not the axis size."""
    mesh = fd.Mesh({"tp": 4})
    f = fd.spmd(lambda x: fd.psum(x, mesh, "tp"), mesh, in_specs=(P("tp"),), out_specs=P())
    x = torch.randn(8, dtype=F64, requires_grad=True)
    f(x).sum().backward()
    assert torch.equal(x.grad, torch.ones(8, dtype=F64))


def test_tp_mlp_with_replicated_input_needs_no_pvary() -> None:
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (
        torch.randn(4, 3, dtype=F64, generator=g),
        torch.randn(3, 4, dtype=F64, generator=g),
        torch.randn(4, 3, dtype=F64, generator=g),
    )

    def local(
        x: Tensor, w1: Tensor, w2: Tensor
    ) -> Tensor:  # no pvary anywhere: the checker inserts both
        return fd.psum(torch.tanh(x @ w1) @ w2, mesh, "tp")

    f = fd.spmd(
        local, mesh, in_specs=(P("dp", None), P(None, "tp"), P("tp", None)), out_specs=P("dp", None)
    )
    assert_matches_single_device(f, lambda x, w1, w2: torch.tanh(x @ w1) @ w2, [x, w1, w2])


def test_tp_mlp_explicit_pvary_is_accepted_in_error_mode() -> None:
    mesh = fd.Mesh({"tp": 2})
    g = torch.Generator().manual_seed(1)
    x, w1, w2 = (
        torch.randn(3, 3, dtype=F64, generator=g),
        torch.randn(3, 4, dtype=F64, generator=g),
        torch.randn(4, 3, dtype=F64, generator=g),
    )

    def local(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        return fd.psum(torch.tanh(fd.pvary(x, mesh, "tp") @ w1) @ w2, mesh, "tp")

    f = fd.spmd(
        local, mesh, in_specs=(P(), P(None, "tp"), P("tp", None)), out_specs=P(), check="error"
    )
    assert_matches_single_device(f, lambda x, w1, w2: torch.tanh(x @ w1) @ w2, [x, w1, w2])


def test_forcing_the_wrong_gather_is_refused() -> None:
    """all_gather (varying out) where a replicated result is declared: the documented error."""
    mesh = fd.Mesh({"tp": 2})
    f = fd.spmd(lambda x: fd.all_gather(x, mesh, "tp"), mesh, in_specs=(P("tp"),), out_specs=P())
    with pytest.raises(
        fd.ReplicationError,
        match=r"output 0 varies over 'tp' but P\(\) does not name 'tp'.*all_gather_invariant",
    ):
        f(torch.randn(4))
    ok = fd.spmd(
        lambda x: fd.all_gather_invariant(x, mesh, "tp"), mesh, in_specs=(P("tp"),), out_specs=P()
    )
    assert_matches_single_device(ok, lambda x: x * 1, [torch.randn(4, dtype=F64)])


def test_data_parallel_gradient_sync_is_inserted() -> None:
    """A replicated weight meeting dp-sharded data gets the dp all-reduce in its backward."""
    mesh = fd.Mesh({"dp": 4})
    x, w = torch.randn(8, 3, dtype=F64), torch.randn(3, 2, dtype=F64)
    f = fd.spmd(lambda x, w: x @ w, mesh, in_specs=(P("dp", None), P()), out_specs=P("dp", None))
    assert_matches_single_device(f, lambda x, w: x @ w, [x, w])


def test_partial_out_spec_sums_and_row_parallel_bias() -> None:
    mesh = fd.Mesh({"tp": 2})
    x, w, b = torch.randn(3, 4, dtype=F64), torch.randn(4, 5, dtype=F64), torch.randn(5, dtype=F64)
    f = fd.spmd(
        lambda x, w: fd.as_partial(x @ w, mesh, "tp"),
        mesh,
        in_specs=(P(None, "tp"), P("tp", None)),
        out_specs=P(partial="tp"),
    )
    assert_matches_single_device(f, lambda x, w: x @ w, [x, w])
    g = fd.spmd(
        lambda x, w, b: fd.psum(fd.as_partial(x @ w, mesh, "tp") * 2.0, mesh, "tp") + b,
        mesh,
        in_specs=(P(None, "tp"), P("tp", None), P()),
        out_specs=P(),
    )
    assert_matches_single_device(g, lambda x, w, b: (x @ w) * 2.0 + b, [x, w, b])


def test_pmax_gradient_in_checked_mode() -> None:
    mesh = fd.Mesh({"tp": 4})
    x = torch.tensor([1.0, 5.0, 2.0, 5.0], dtype=F64, requires_grad=True)
    fd.spmd(lambda x: fd.pmax(x, mesh, "tp"), mesh, in_specs=(P("tp"),), out_specs=P())(
        x
    ).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 0.0, 0.0]  # ties: the lowest rank


def test_checked_spmd_is_unchanged_for_non_differentiable_constants() -> None:
    mesh = fd.Mesh({"tp": 2})
    f = fd.spmd(
        lambda x: x * torch.tensor(3.0) + fd.axis_index(mesh, "tp"),
        mesh,
        in_specs=(P("tp"),),
        out_specs=P("tp"),
        check="error",
    )
    assert f(torch.zeros(4)).tolist() == [3 * 0.0 + 0, 0.0, 1.0, 1.0]


# ============================================================================ random programs
@st.composite
def programs(draw: Any) -> tuple[fd.Mesh, tuple[str, ...], list[tuple[Any, ...]]]:
    """A mesh, the initial row sharding of x, and a list of steps whose global meaning is known."""
    mesh = draw(meshes(max_size=8))
    names = list(mesh.axis_names)
    layout = tuple(draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names))))
    steps: list[tuple[Any, ...]] = []
    sharded = layout
    for _ in range(draw(st.integers(1, 4))):
        free = [a for a in names if a not in sharded]
        options = (
            ["tanh", "linear"] + (["tp"] if free else []) + (["gather"] if sharded else ["shard"])
        )
        kind = draw(st.sampled_from(options))
        if kind == "tp":
            steps.append(("tp", draw(st.sampled_from(free))))
        elif kind == "shard":
            sharded = tuple(
                draw(st.lists(st.sampled_from(names), unique=True, min_size=1, max_size=len(names)))
            )
            steps.append(("shard", sharded))
        elif kind == "gather":
            steps.append(("gather", sharded))
            sharded = ()
        else:
            steps.append((kind,))
    if draw(st.booleans()):
        steps.append(("rowsum", sharded))
    return mesh, layout, steps


def _label(axes: tuple[str, ...]) -> Any:
    return axes[0] if len(axes) == 1 else axes


@given(prog=programs(), seed=st.integers(0, 2**16))
def test_random_programs_match_single_device_without_pvary(
    prog: tuple[fd.Mesh, tuple[str, ...], list[tuple[Any, ...]]], seed: int
) -> None:
    mesh, layout, steps = prog
    F = 3
    rows = mesh.size * 2
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, F, dtype=F64, generator=gen)
    weights: list[Tensor] = []
    specs: list[fd.PartitionSpec] = [P(layout if layout else None, None)]
    for step in steps:
        if step[0] == "linear":
            weights.append(torch.randn(F, F, dtype=F64, generator=gen) / F)
            specs.append(P())
        elif step[0] == "tp":
            n = mesh.shape[step[1]]
            weights += [
                torch.randn(F, 2 * n, dtype=F64, generator=gen),
                torch.randn(2 * n, F, dtype=F64, generator=gen) / n,
            ]
            specs += [P(None, step[1]), P(step[1], None)]

    def run(h: Tensor, ws: list[Tensor], local: bool) -> tuple[Tensor, tuple[str, ...]]:
        it = iter(ws)
        sharded = layout
        for step in steps:
            if step[0] == "tanh":
                h = torch.tanh(h)
            elif step[0] == "linear":
                h = h @ next(it)
            elif step[0] == "tp":
                w1, w2 = next(it), next(it)
                h = torch.tanh(h @ w1) @ w2
                if local:
                    h = fd.psum(h, mesh, step[1])
            elif step[0] == "gather":
                if local:
                    h = fd.all_gather_invariant(h, mesh, _label(step[1]), 0)
                sharded = ()
            elif step[0] == "shard":
                if local:
                    h = fd.local_chunk(h, mesh, _label(step[1]), 0)
                sharded = step[1]
            elif step[0] == "rowsum":
                h = h.sum(0, keepdim=True)
                if local and sharded:
                    h = fd.psum(h, mesh, _label(sharded))
                sharded = ()
        return h, sharded

    _, final = run(x, weights, local=False)
    out_spec = P(final if final else None, None)
    f = fd.spmd(
        lambda h, *ws: run(h, list(ws), local=True)[0],
        mesh,
        in_specs=tuple(specs),
        out_specs=out_spec,
    )
    assert_matches_single_device(
        f, lambda h, *ws: run(h, list(ws), local=False)[0], [x, *weights], seed=seed
    )


# ============================================================================ one test per error
MESH = fd.Mesh({"dp": 2, "tp": 2})


def test_error_mode_points_at_the_line() -> None:
    f = fd.spmd(
        lambda x, w: x @ w,
        MESH,
        in_specs=(P("dp", None), P()),
        out_specs=P("dp", None),
        check="error",
    )
    with pytest.raises(fd.ReplicationError) as info:
        f(torch.randn(4, 3, requires_grad=True), torch.randn(3, 2, requires_grad=True))
    msg = str(info.value)
    assert (
        "fastdist check: torch matmul over axis 'dp'" in msg
        and "test_checking.py" in msg
        and "lambda x, w: x @ w" in msg
    )
    assert "wrap operand 1 in fastdist.pvary(t, mesh, 'dp')" in msg and info.value.fix


def test_error_mode_collective_input_invariant() -> None:
    f = fd.spmd(
        lambda w: fd.all_gather(w, MESH, "tp"), MESH, in_specs=(P(),), out_specs=P(), check="error"
    )
    with pytest.raises(
        fd.ReplicationError,
        match=r"all_gather over axis 'tp'.*its input is invariant over 'tp' but all_gather needs "
        r"a value that varies.*fastdist\.pvary\(x, mesh, 'tp'\)",
    ):
        f(torch.randn(3, requires_grad=True))


def test_pvary_of_a_varying_value() -> None:
    f = fd.spmd(lambda x: fd.pvary(x, MESH, "tp"), MESH, in_specs=(P("tp"),), out_specs=P("tp"))
    with pytest.raises(
        fd.ReplicationError,
        match=r"pvary over axis 'tp'.*input is varying over 'tp'; pvary accepts invariant.*remove "
        r"the pvary",
    ):
        f(torch.randn(4))


def test_local_chunk_of_a_varying_value() -> None:
    f = fd.spmd(
        lambda x: fd.local_chunk(x, MESH, "dp"), MESH, in_specs=(P("dp"),), out_specs=P("dp")
    )
    with pytest.raises(
        fd.ReplicationError,
        match=r"local_chunk over axis 'dp'.*input is varying.*slice the value directly",
    ):
        f(torch.randn(8))


def test_partial_value_into_a_nonlinear_op() -> None:
    f = fd.spmd(
        lambda x: torch.tanh(fd.as_partial(x, MESH, "tp")),
        MESH,
        in_specs=(P("tp"),),
        out_specs=P(partial="tp"),
    )
    with pytest.raises(
        fd.ReplicationError,
        match=r"torch tanh over axis 'tp'.*partial sum over 'tp'.*enters tanh.*psum it over 'tp' "
        r"first",
    ):
        f(torch.randn(4))


def test_partial_plus_replicated_bias() -> None:
    f = fd.spmd(
        lambda x, b: fd.as_partial(x, MESH, "tp") + b,
        MESH,
        in_specs=(P("tp"), P()),
        out_specs=P(partial="tp"),
    )
    with pytest.raises(fd.ReplicationError, match=r"torch add over axis 'tp'.*partial sum"):
        f(torch.randn(4), torch.randn(2))


def test_as_partial_of_an_invariant_value() -> None:
    f = fd.spmd(
        lambda b: fd.as_partial(b * 1.0, MESH, "tp"),
        MESH,
        in_specs=(P(),),
        out_specs=P(partial="tp"),
    )
    with pytest.raises(
        fd.ReplicationError,
        match=r"as_partial.*invariant over 'tp'; as a partial sum every rank's copy would be added",
    ):
        f(torch.randn(2))


def test_partial_into_a_collective_that_needs_varying() -> None:
    f = fd.spmd(
        lambda x: fd.all_gather(fd.as_partial(x, MESH, "tp"), MESH, "tp"),
        MESH,
        in_specs=(P("tp"),),
        out_specs=P("tp"),
    )
    with pytest.raises(
        fd.ReplicationError,
        match=r"all_gather over axis 'tp'.*input is partial over 'tp'.*psum \(or psum_scatter\)",
    ):
        f(torch.randn(4))


def test_out_spec_partial_output_declared_replicated() -> None:
    f = fd.spmd(lambda x: fd.as_partial(x, MESH, "tp"), MESH, in_specs=(P("tp"),), out_specs=P())
    with pytest.raises(
        fd.ReplicationError,
        match=r"output 0 is a partial sum over 'tp' but P\(\) declares it replicated.*partial='tp'",
    ):
        f(torch.randn(4))


def test_out_spec_declares_partial_an_invariant_output() -> None:
    f = fd.spmd(lambda x: x * 2, MESH, in_specs=(P(),), out_specs=P(partial="tp"))
    with pytest.raises(
        fd.ReplicationError,
        match=r"output 0 is invariant over 'tp' but P\(partial=\('tp',\)\) declares it partial",
    ):
        f(torch.randn(4))


def test_closure_tensor_requiring_grad_on_simulated_ranks() -> None:
    w = torch.randn(3, 2, requires_grad=True)
    f = fd.spmd(lambda x: x @ w, MESH, in_specs=(P("dp", None),), out_specs=P("dp", None))
    with pytest.raises(
        fd.ReplicationError,
        match=r"comes from outside the spmd function \(a closure\?\).*pass it as an argument with "
        r"an in_spec",
    ):
        f(torch.randn(4, 3))


def test_inplace_op_mixing_states_is_refused() -> None:
    def fn(x: Tensor, w: Tensor) -> Tensor:
        w = w * 1.0
        w.add_(x)
        return w

    f = fd.spmd(fn, MESH, in_specs=(P("dp"), P()), out_specs=P("dp"))
    with pytest.raises(
        fd.ReplicationError, match=r"torch add_ over axis 'dp'.*wrap operand 0 in fastdist\.pvary"
    ):
        f(torch.randn(4), torch.randn(2, requires_grad=True))


@pytest.mark.parametrize(
    "make, args, match",
    [
        (
            lambda: fd.spmd(lambda x: x, MESH, (P("zz"),), P()),
            (torch.zeros(2),),
            r"unknown mesh axis 'zz'",
        ),
        (
            lambda: fd.spmd(lambda x: x, MESH, (P("dp", "dp"),), P()),
            (torch.zeros(2, 2),),
            r"uses a mesh axis twice",
        ),
        (
            lambda: fd.spmd(lambda x: x, MESH, (P("dp"),), P("dp")),
            (torch.zeros(3),),
            r"splits dim 0 \(size 3\) over \('dp',\) \(2 ranks\).*pad dim 0 to a multiple of 2",
        ),
        (
            lambda: fd.spmd(lambda x: x, MESH, (P(None, None),), P()),
            (torch.zeros(2),),
            r"has 2 entries but the tensor is 1-d",
        ),
        (
            lambda: fd.spmd(lambda x: x, MESH, (P(), P()), P()),
            (torch.zeros(2),),
            r"got 1 arguments but 2 in_specs",
        ),
        (
            lambda: fd.spmd(lambda x: x, MESH, (P(partial="tp"),), P()),
            (torch.zeros(2),),
            r"partial= is for out_specs",
        ),
        (
            lambda: fd.spmd(lambda x: x, MESH, ("dp",), P()),
            (torch.zeros(2),),
            r"in_specs\[0\] must be a fastdist\.P",
        ),
        (
            lambda: fd.spmd(lambda x: (x, x), MESH, (P(),), P()),
            (torch.zeros(2),),
            r"output 0 is a tuple, not a tensor",
        ),
        (
            lambda: fd.spmd(lambda x: (x, x), MESH, (P(),), (P(),)),
            (torch.zeros(2),),
            r"fn returned 2 outputs but out_specs has 1",
        ),
        (
            lambda: fd.spmd(lambda x: x, MESH, (P(),), P(), check="maybe"),
            (torch.zeros(2),),
            r"check must be 'insert', 'error', True or False",
        ),
        (lambda: fd.P(3), (), r"each entry is None, an axis name or a tuple of names"),
    ],
)
def test_spec_errors(make: Any, args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(fd.MeshError, match=match):
        make()(*args)


def test_compiled_unchecked_spmd_equals_checked_eager() -> None:
    """Check once eagerly with check='error', write the pvarys it asks for; the compiled program is
    the same."""
    torch._dynamo.reset()
    mesh = fd.Mesh({"dp": 2, "tp": 2})

    def local(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        h = torch.tanh(fd.pvary(x, mesh, "tp") @ fd.pvary(w1, mesh, "dp"))
        return fd.ring_shift(fd.psum(h @ fd.pvary(w2, mesh, "dp"), mesh, "tp"), mesh, "dp")

    specs = {"in_specs": (P("dp", None), P(None, "tp"), P("tp", None)), "out_specs": P("dp", None)}
    g = torch.Generator().manual_seed(3)
    ts = [
        torch.randn(4, 3, dtype=F64, generator=g),
        torch.randn(3, 4, dtype=F64, generator=g),
        torch.randn(4, 3, dtype=F64, generator=g),
    ]
    c = torch.randn(4, 3, dtype=F64, generator=g)
    out_a, grads_a = grads_of(fd.spmd(local, mesh, **specs, check="error"), ts, c)
    out_b, grads_b = grads_of(
        torch.compile(fd.spmd(local, mesh, **specs, check=False), fullgraph=True), ts, c
    )
    torch.testing.assert_close(out_b, out_a)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a)


def test_property_reads_keep_the_state() -> None:
    """x.T goes through a property (__get__): its result must keep x's state (found by the
    vocab-parallel test)."""
    mesh = fd.Mesh({"tp": 2})
    f = fd.spmd(
        lambda x, w: fd.all_gather_invariant(fd.pvary(x, mesh, "tp") @ w.T, mesh, "tp", dim=-1),
        mesh,
        in_specs=(P(), P("tp", None)),
        out_specs=P(),
        check="error",
    )
    assert_matches_single_device(
        f, lambda x, w: x @ w.T, [torch.randn(2, 3, dtype=F64), torch.randn(4, 3, dtype=F64)]
    )


def test_tracker_forgets_dead_tensors() -> None:
    mesh = fd.Mesh({"tp": 2})
    tracker = fd.check.replication.RepTracker(mesh, "insert", simulated=True)
    for _ in range(100):
        t = torch.randn(3)
        tracker.set(t, fd.check.replication.Rep(frozenset({"tp"})))
        assert tracker.get(t).state("tp") == "V"
    del t
    assert len(tracker._states) == 0


@pytest.mark.parametrize("x_spec", [P("tp"), P(), P(("dp", "tp"))])
def test_spmd_simulated_sharding_contract(x_spec: fd.PartitionSpec) -> None:
    """A global input's gradient is each block's mean over the ranks holding it; an output comes
    from the lowest rank holding each block, and each rank gets its block of the cotangent.

    Checked unchecked (check=False) with per-rank gradients that differ over dp, where "mean"
    and "sum" or "rank 0" would disagree.
    """
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    x = torch.arange(1.0, 5.0, dtype=F64, requires_grad=True)
    c = torch.tensor([1.0, 10.0, 100.0, 1000.0], dtype=F64)
    f = fd.spmd(
        lambda x: x * (1 + fd.axis_index(mesh, "dp")),
        mesh,
        in_specs=(x_spec,),
        out_specs=x_spec,
        check=False,
    )
    out = f(x)
    (out * c).sum().backward()
    # dp shards the blocks: blocks 0-1 live on dp=0, 2-3 on dp=1 (one holder each)
    if "dp" in x_spec.sharded_axes:
        torch.testing.assert_close(out, x.detach() * torch.tensor([1.0, 1.0, 2.0, 2.0], dtype=F64))
        torch.testing.assert_close(x.grad, c * torch.tensor([1.0, 1.0, 2.0, 2.0], dtype=F64))
    else:
        torch.testing.assert_close(out, x.detach())  # from the holders at dp = 0
        torch.testing.assert_close(x.grad, c * 1.5)  # the mean over dp of (1 + dp)


def test_func_grad_around_simulated_spmd_and_integer_inputs() -> None:
    """torch.func.grad of a loss through spmd (the shard/unshard pair under a grad transform)
    equals the single-device gradient; integer inputs shard without gradients."""
    mesh = fd.Mesh({"dp": 2, "tp": 2})
    f = fd.spmd(
        lambda x, w: fd.psum(x @ w, mesh, "tp"),
        mesh,
        in_specs=(P("dp", "tp"), P("tp", None)),
        out_specs=P("dp", None),
    )
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(4, 6, dtype=F64, generator=g), torch.randn(6, 3, dtype=F64, generator=g)
    grads = torch.func.grad(lambda x, w: f(x, w).sin().sum(), argnums=(0, 1))(x, w)
    want = torch.func.grad(lambda x, w: (x @ w).sin().sum(), argnums=(0, 1))(x, w)
    for got, ref_grad in zip(grads, want):
        torch.testing.assert_close(got, ref_grad)
    ids = torch.arange(8).reshape(4, 2)
    assert torch.equal(
        fd.spmd(lambda i: i * 2, mesh, in_specs=(P("dp", None),), out_specs=P("dp", None))(ids),
        ids * 2,
    )


def test_spmd_under_torch_compile() -> None:
    """Issue 20.8: the checked mode cannot be traced, so compiling it raises fastdist's message
    (fullgraph) instead of graph-breaking or silently dropping the pvary it inserts; check=False
    with the pvarys written out compiles to one graph and equals eager and one device; without
    fullgraph a checked step still gives the eager (checked) result."""
    from torch._dynamo.utils import counters

    mesh = fd.Mesh({"dp": 2, "tp": 2})

    def written(x, w1, w2, b):  # the pvarys check="error" asks for
        x, b = fd.pvary(x, mesh, "tp"), fd.pvary(b, mesh, "dp")
        w1, w2 = fd.pvary(w1, mesh, "dp"), fd.pvary(w2, mesh, "dp")
        return fd.psum(torch.tanh(x @ w1) @ w2, mesh, "tp") + b

    def bare(x, w1, w2, b):  # relies on check="insert"
        return fd.psum(torch.tanh(x @ w1) @ w2, mesh, "tp") + b

    specs = {"in_specs": (P("dp"), P(None, "tp"), P("tp", None), P()), "out_specs": P("dp")}
    g = torch.Generator().manual_seed(0)
    args = [
        torch.randn(*s, generator=g, dtype=torch.float64) for s in ((4, 4), (4, 6), (6, 4), (4,))
    ]
    c = torch.arange(16.0, dtype=torch.float64).reshape(4, 4)

    def run(fn):
        leaves = [a.clone().requires_grad_() for a in args]
        out = fn(*leaves)
        (out * c).sum().backward()
        return out.detach(), [leaf.grad for leaf in leaves]

    leaves = [a.clone().requires_grad_() for a in args]
    ((torch.tanh(leaves[0] @ leaves[1]) @ leaves[2] + leaves[3]) * c).sum().backward()
    want = [leaf.grad for leaf in leaves]

    torch._dynamo.reset()
    counters.clear()
    out, grads = run(torch.compile(fd.spmd(written, mesh, check=False, **specs), fullgraph=True))
    assert not counters["graph_break"]
    for got, w in zip(grads, want):
        torch.testing.assert_close(got, w)
    torch.testing.assert_close(out, run(fd.spmd(bare, mesh, **specs))[0])

    torch._dynamo.reset()
    with pytest.raises(
        Exception,
        match=r"spmd: check='insert' runs eagerly only.*Fix: run the step once eagerly with "
        r"check='error'",
    ):
        torch.compile(fd.spmd(bare, mesh, **specs), fullgraph=True)(*args)
    torch._dynamo.reset()
    # not fullgraph: dynamo falls back to the eager, checked step
    _, grads = run(torch.compile(fd.spmd(bare, mesh, **specs)))
    for got, w in zip(grads, want):
        torch.testing.assert_close(got, w)
