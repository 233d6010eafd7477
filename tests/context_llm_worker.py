"""Context-parallel LLM scenarios for tests/test_context_llm_gloo.py, run on every rank of a gloo
job (through `fastdist.testing.run_on_gloo`) and compared there with one device."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import fastdist as fd
from fastdist.nn.styles.context_llm import CausalContextParallel
from tests import tiny_models as tm
from tests.tiny_models import VOCAB

#: a prompt of 8 tokens: split over cp = 2 and 4 at prefill (2 x cp divides 8)
PROMPT = [[3, 5, 7, 11, 13, 17, 19, 23], [2, 4, 6, 8, 10, 12, 14, 16]]
#: the same batch left-padded: the padding masked at prefill and at every decoding step
MASK = [[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8]


def generations(generate: Any) -> dict[str, torch.Tensor]:
    """Greedy tokens of `PROMPT`, plain and left-padded."""
    ids = torch.tensor(PROMPT)
    return {
        "greedy": generate(ids, max_new_tokens=6, do_sample=False),
        "padded": generate(
            ids, attention_mask=torch.tensor(MASK), max_new_tokens=6, do_sample=False
        ),
    }


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def one_device(family: str) -> dict[str, Any]:
    """The unmodified model's loss, logits and gradients on `batch`, and its greedy tokens."""
    model = tm.build(family)
    ids, labels = batch()
    logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    res = model.generate(
        torch.tensor(PROMPT),
        max_new_tokens=6,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return {
        "loss": loss.detach(),
        "logits": logits.detach(),
        "grads": grads,
        "greedy": res.sequences,
        "gen_logits": torch.stack(res.logits),
    }


def one_device_generations(family: str) -> dict[str, torch.Tensor]:
    return generations(tm.build(family).generate)


def on_ranks(
    family: str, degrees: dict[str, int], mode: str, others: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One rank: a training step's loss, logits and (single-device view) gradients, and greedy
    tokens through ParallelModel.generate with the split prefill's per-rank length; then
    `generations` of each of the ``others`` families, context parallel over the same mesh
    (Mistral, Gemma 2: sliding-window KV caches)."""
    mesh = fd.connect(**degrees)
    model = tm.build(family)
    plan = fd.nn.plans.plan(model, mesh, context_parallel=CausalContextParallel("cp", mode))
    pm = fd.nn.parallelize(model, mesh, plan)
    ids, labels = batch()
    if "tp" in degrees:  # fastdist's loss over the vocabulary shards (float64)
        out = pm(input_ids=ids, labels=labels, use_cache=False)
        loss = out.loss
        shards = fd.all_gather_invariant(out.logits.detach().contiguous(), mesh, "tp", dim=-1)
        logits = shards[..., :VOCAB]
    else:  # transformers' loss is float32: the float64 loss here
        logits = pm(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    loss.backward()
    seen: list[int] = []

    def count(module: Any, args: Any) -> None:
        seen.append(args[0].shape[1])  # the tokens the first decoder layer runs on

    handle = model.model.layers[1].register_forward_pre_hook(count)
    res = pm.generate(
        torch.tensor(PROMPT),
        max_new_tokens=6,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    handle.remove()
    # the model's own generate (a direct call on real ranks): decodes against the split cache too
    direct = model.generate(torch.tensor(PROMPT), max_new_tokens=6, do_sample=False)
    gen = {}
    for other in others:
        m = tm.build(other)
        p = fd.nn.plans.plan(m, mesh, context_parallel=CausalContextParallel("cp", mode))
        gen[other] = generations(fd.nn.parallelize(m, mesh, p).generate)
    return {
        "others": gen,
        "loss": loss.detach(),
        "logits": logits.detach(),
        "grads": pm.grads(),
        "greedy": res.sequences,
        "direct_greedy": direct,
        "gen_logits": torch.stack(res.logits),
        "cache_keys": tuple(res.past_key_values.layers[0].keys.shape),
        "layer_tokens": seen,
    }


def moe_one_device(family: str) -> dict[str, Any]:
    """The unmodified mixture-of-experts model's loss (with the router's aux loss) and
    gradients on `batch`, and its greedy tokens of `PROMPT`."""
    model = tm.build(family)
    ids, labels = batch()
    out = model(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    tokens = model.generate(torch.tensor(PROMPT), max_new_tokens=4, do_sample=False)
    return {
        "loss": out.loss.detach(),
        "aux": out.aux_loss.detach(),
        "grads": grads,
        "greedy": tokens,
    }


def moe_on_ranks(family: str, degrees: dict[str, int], mode: str) -> dict[str, Any]:
    """One rank of a context-parallel mixture-of-experts model: `moe_one_device`'s values."""
    mesh = fd.connect(**degrees)
    model = tm.build(family)
    plan = fd.nn.plans.plan(model, mesh, context_parallel=CausalContextParallel("cp", mode))
    pm = fd.nn.parallelize(model, mesh, plan)
    ids, labels = batch()
    out = pm(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    tokens = pm.generate(torch.tensor(PROMPT), max_new_tokens=4, do_sample=False)
    return {
        "loss": out.loss.detach(),
        "aux": out.aux_loss.detach(),
        "grads": pm.grads(),
        "greedy": tokens,  # prefill split, decoding against the split KV cache
    }


def split_logits_on_ranks(family: str, degrees: dict[str, int], mode: str) -> dict[str, Any]:
    """One rank with ``CausalContextParallel(logits="split")``: the model's loss on `batch`
    (with left padding and uneven ignored labels) and its gradients, and this rank's logits
    (its zig-zag chunks; with tp, gathered over the vocabulary shards)."""
    mesh = fd.connect(**degrees)
    model = tm.build(family)
    cp = CausalContextParallel("cp", mode, logits="split")  # type: ignore[arg-type]
    pm = fd.nn.parallelize(model, mesh, fd.nn.plans.plan(model, mesh, context_parallel=cp))
    ids, labels, mask = split_batch()
    out = pm(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    out.loss.backward()
    logits = out.logits.detach().contiguous()
    if "tp" in degrees:
        logits = fd.all_gather_invariant(logits, mesh, "tp", dim=-1)[..., :VOCAB]
    return {
        "cp_rank": int(fd.axis_index(mesh, "cp")),
        "loss": out.loss.detach(),
        "logits": logits,
        "grads": pm.grads(),
    }


def split_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`batch` left-padded on row 0 (its labels -100 there) and with -100s on row 1."""
    ids, labels = batch()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    labels[0, :5] = -100
    labels[1, [6, 9, 15]] = -100
    return ids, labels, mask


def split_one_device(family: str) -> dict[str, Any]:
    """The unmodified model on `split_batch`: the float64 loss, logits and gradients."""
    model = tm.build(family)
    ids, labels, mask = split_batch()
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"loss": loss.detach(), "logits": logits.detach(), "grads": grads}
