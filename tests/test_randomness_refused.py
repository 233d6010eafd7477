"""Random draws in a training-mode forward of a model split over an axis are refused
(`fastdist.nn.randomness`): the ranks of a group would draw different values for activations
they must hold equal and diverge silently (Mixtral's ``router_jitter_noise``, a ``uniform_`` in
the MoE block; Falcon's ``hidden_dropout``, a functional dropout, not an ``nn.Dropout``).

Simulated ranks: the config setting is named up front; a draw no setting names becomes the
same `ParallelizeError` (vmap's randomness error kept as its cause). Real ranks (gloo): a draw
no setting names raises at the first training call (the generator advanced), before any
backward; eval mode, data parallelism alone (an axis of size 1 included) and a compiled step
run. Everything else in float64 against one device.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers

import fastdist as fd
from fastdist.nn.randomness import accelerators, drawn, generator_states
from tests.tiny_models import tiny_mixtral

F64 = torch.float64


def mixtral(jitter: float = 0.0) -> Any:
    return tiny_mixtral(output_router_logits=True, router_jitter_noise=jitter)


def falcon(hidden_dropout: float) -> Any:
    cfg = transformers.FalconConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_dropout=hidden_dropout,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return transformers.FalconForCausalLM(cfg).to(F64)


def gpt2_without_dropout() -> Any:
    """GPT-2 with its model's dropouts 0; ``summary_first_dropout`` keeps its 0.1 (read by the
    double-heads model's summary only)."""
    cfg = transformers.GPT2Config(
        vocab_size=64,
        n_embd=16,
        n_layer=1,
        n_head=4,
        n_positions=32,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
    )
    assert cfg.summary_first_dropout > 0
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(F64)


def tiny_llama(attention_dropout: float = 0.0) -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=attention_dropout,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(F64)


def ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def simulated_loss(pm: Any, mesh: fd.Mesh) -> torch.Tensor:
    x = ids().expand(mesh.size, 2, 8)
    return pm(input_ids=x, labels=x).loss


def one_device_loss(model: Any) -> torch.Tensor:
    """The causal LM loss (plus a router's aux loss) of the unmodified model, in float64
    (transformers' own loss rounds the logits to float32)."""
    x = ids()
    out = model(input_ids=x)
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    aux = getattr(out, "aux_loss", None)
    return loss if aux is None else loss + model.config.router_aux_loss_coef * aux


def assert_runs_as_one_device(model: Any, mesh: fd.Mesh, train: bool) -> None:
    """``model`` (in the mode ``train`` says) parallelized on ``mesh``: every rank's loss
    equals one device's."""
    want = one_device_loss(copy.deepcopy(model).train(train))
    pm = fd.nn.parallelize(model.train(train), mesh)
    got = simulated_loss(pm, mesh)
    torch.testing.assert_close(got, want.expand(mesh.size), rtol=1e-10, atol=1e-12)


# ============================================================================ simulated ranks
def test_mixtral_router_jitter_is_refused_up_front() -> None:
    """``router_jitter_noise`` > 0 in training mode over ep: named (was vmap's raw error);
    in eval mode (no jitter) it runs and equals one device."""
    mesh = fd.Mesh({"ep": 2})
    pm = fd.nn.parallelize(mixtral(jitter=0.1).train(), mesh)
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"training mode with random noise \(config\.router_jitter_noise=0\.1\).*"
        r"would draw different values.*Fix: .*model\.eval\(\)",
    ):
        simulated_loss(pm, mesh)
    assert_runs_as_one_device(mixtral(jitter=0.1), mesh, train=False)


def test_falcon_hidden_dropout_is_refused_up_front() -> None:
    """Falcon's ``hidden_dropout`` (``dropout_add``, no ``nn.Dropout``) over tp: named; with it
    0 training mode runs and equals one device."""
    mesh = fd.Mesh({"tp": 2})
    pm = fd.nn.parallelize(falcon(0.1).train(), mesh)
    with pytest.raises(
        fd.nn.ParallelizeError,
        match=r"training mode with dropout \(config\.hidden_dropout=0\.1\).*model\.eval\(\)",
    ):
        simulated_loss(pm, mesh)
    assert_runs_as_one_device(falcon(0.0), mesh, train=True)
    assert_runs_as_one_device(falcon(0.1), mesh, train=False)


def test_a_draw_no_setting_names_becomes_a_parallelize_error() -> None:
    """The jitter set on the module after building (the config says 0): vmap's randomness error,
    translated, the original kept as the cause."""
    mesh = fd.Mesh({"ep": 2})
    model = mixtral(jitter=0.0).train()
    pm = fd.nn.parallelize(model, mesh)
    model.model.layers[0].mlp.jitter_noise = 0.1
    with pytest.raises(
        fd.nn.ParallelizeError, match=r"drew random numbers in its forward on simulated ranks"
    ) as e:
        simulated_loss(pm, mesh)
    assert "randomness error mode" in str(e.value.__cause__)


def test_a_setting_no_module_reads_is_not_refused() -> None:
    """GPT-2's ``summary_first_dropout`` (0.1) is read by no module of GPT2LMHeadModel: training
    mode with every dropout of the model at 0 runs and equals one device."""
    assert_runs_as_one_device(gpt2_without_dropout(), fd.Mesh({"tp": 2}), train=True)


def test_generator_states_change_with_a_draw_only() -> None:
    """The check at the call sees a draw from the CPU generator and nothing else."""
    model = torch.nn.Linear(2, 2)
    assert accelerators(model, [torch.ones(1), "x"]) == ()
    before = generator_states(())
    model(torch.ones(2))
    assert drawn((), before, generator_states(())) == []
    torch.nn.functional.dropout(torch.ones(4), 0.0, training=True)  # p = 0 draws nothing
    assert drawn((), before, generator_states(())) == []
    torch.empty(3).uniform_()
    assert drawn((), before, generator_states(())) == ["CPU"]
    # an accelerator: its own generator (unreadable, e.g. no CUDA here: left out, never raised)
    cuda = (torch.device("cuda", 0),)
    before = generator_states(cuda)
    torch.empty(3).uniform_()
    assert drawn(cuda, before, generator_states(cuda)) == ["CPU"]
    if torch.cuda.is_available():  # (never ran: no GPU where this was written)
        before = generator_states(cuda)
        torch.rand(3, device="cuda")
        assert drawn(cuda, before, generator_states(cuda)) == ["cuda:0"]


# ============================================================================ real processes
def _first_call(pm: Any, x: torch.Tensor) -> str:
    """``pm``'s first training call: the error's message, or "ran"."""
    try:
        pm(input_ids=x, labels=x)
    except fd.nn.ParallelizeError as e:
        assert all(p.grad is None for p in pm.parameters())
        return str(e)
    return "ran"


def ranks_draw() -> dict[str, Any]:
    """One rank: the models built alike, then each rank its own random stream (as a real job's
    ranks usually have)."""
    ep = fd.connect(ep=2, timeout=120)
    model, declared, plain = mixtral(jitter=0.0).train(), mixtral(jitter=0.1), mixtral()
    llama = tiny_llama(attention_dropout=0.5)
    x = ids()
    torch.manual_seed(1000 + ep.rank)
    out: dict[str, Any] = {}
    pm = fd.nn.parallelize(model, ep)
    model.model.layers[0].mlp.jitter_noise = 0.1  # a draw no config setting names
    out["undeclared"] = _first_call(pm, x)
    model.eval()
    out["eval"] = pm(input_ids=x, labels=x).loss.detach()
    out["declared"] = _first_call(fd.nn.parallelize(declared.train(), ep), x)
    out["train"] = fd.nn.parallelize(plain.train(), ep)(input_ids=x, labels=x).loss.detach()
    # data parallelism alone: dropout draws differently on each rank, as it may
    dp = fd.connect(dp=2, tp=1, timeout=120)
    for plan in ({}, None):  # no axis; tp of size 1
        pm = fd.nn.parallelize(copy.deepcopy(llama).train(), dp, plan)
        loss = pm(input_ids=x, labels=x).loss
        loss.backward()
        out[f"dp {plan}"] = loss.detach()
    return out


def test_a_draw_on_real_ranks_raises_at_the_first_call() -> None:
    """2 gloo processes over ep: the jitter set on the module (no config setting names it) raises
    at the first training call on both ranks, before any backward (was: replicas diverging, the
    router weight's gradients 1.6e-4 apart); the config's jitter is named up front; eval mode and
    a training call without randomness run and equal one device; dropout with data parallelism
    alone (no split axis, or tp of size 1) runs."""
    from tests.dist_harness import run_on_gloo

    results = run_on_gloo(ranks_draw, 2, timeout=500)
    one = mixtral()
    want = one_device_loss(one.train())
    want_eval = one_device_loss(one.eval())
    for rank, r in enumerate(results):
        assert r["undeclared"].startswith(
            f"MixtralForCausalLM drew random numbers in its forward in training mode on rank "
            f"{rank} (the CPU random generator advanced"
        ), r["undeclared"]
        assert "the plan splits over ('ep',) would draw" in r["undeclared"], r["undeclared"]
        assert (
            "(config.router_jitter_noise=0.1): the ranks of a group the plan splits over "
            "('ep',) would draw" in r["declared"]
        ), r["declared"]
        torch.testing.assert_close(r["eval"], want_eval.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(r["train"], want.detach(), rtol=1e-10, atol=1e-12)
    for plan in ({}, None):  # each rank its own dropout masks: the same batch, other losses
        assert not torch.equal(results[0][f"dp {plan}"], results[1][f"dp {plan}"])


def ranks_compile() -> tuple[torch.Tensor, torch.Tensor, int]:
    """One rank of tp 2: a training call without randomness, eager and compiled (fullgraph)."""
    from torch._dynamo.utils import counters

    tp = fd.connect(tp=2, timeout=120)
    fd.comm.create_groups(tp, "tp")  # the groups exist before tracing
    pm = fd.nn.parallelize(tiny_llama().train(), tp)
    x = ids()
    eager = pm(input_ids=x, labels=x).loss.detach()
    step = torch.compile(lambda i: pm(input_ids=i, labels=i).loss, fullgraph=True, backend="eager")
    return eager, step(x).detach(), sum(counters["graph_break"].values())


def test_a_compiled_training_step_keeps_the_check_out_of_the_graph() -> None:
    """The check at the call is skipped while dynamo traces (reading a generator would break
    the graph): a compiled training step over tp 2 is one graph, equal to eager."""
    from tests.dist_harness import run_on_gloo

    for eager, compiled, breaks in run_on_gloo(ranks_compile, 2, timeout=500):
        torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=1e-12)
        assert breaks == 0
