"""Speculative decoding with two models on two meshes in one job: a small draft model on
``tp=1`` proposes tokens, the target model on ``tp=world`` checks them, greedy acceptance.

    torchrun --standalone --nproc-per-node 2 examples/speculative.py
    torchrun --standalone --nproc-per-node 4 examples/speculative.py --k 3

Every process is one rank of two meshes over the same processes, side by side:

* the **target** mesh ``fd.connect(tp=world)``: every process holds one tensor-parallel shard of
  the target (a tiny seeded float64 Llama, 4 layers, parallelized with its ready plan);
* the **draft** mesh ``fd.connect(tp=1)``, that is ``Mesh({'dp': world, 'tp': 1})``: ``world``
  replicas of the draft (the target's first layer with its embedding, final norm and head: a
  "layer-skip" draft that often agrees with the target), each on a ``tp`` group of its own
  process. ``parallelize`` over ``tp=1`` splits nothing; the draft is a model on its own mesh,
  called like the target.

Each target step (`speculate`): the draft proposes ``--k`` tokens greedily, one forward each
with its KV cache; the target runs the last accepted token and the ``k`` proposals in **one**
forward with its KV cache and takes its own greedy token at each of the ``k + 1`` positions;
the proposals are accepted while they equal the target's tokens, and the target's token at the
first difference (or after the last proposal) is added too. So a step adds 1 to ``k + 1``
tokens, every one of them the target's own greedy token: the output is the target's greedy
``generate``, exactly. Both caches then drop the rejected positions (``DynamicCache.crop``).

The draft is replicated (every process drafts, no message carries the proposals) rather than
run on rank 0 alone and broadcast: fastdist's meshes span the job (a mesh of rank 0 alone is a
slice, ``mesh.without(...)``, and the other ranks would wait for its proposals each step), and a
replicated draft costs the same time as one rank drafting while the others wait, without the
message. Every rank drafts the same tokens because it runs the same model on the same tokens;
if one ever did not, the target's forward would stop it: calling the parallelized model itself
checks its token inputs equal across the ``tp`` group (`fastdist.nn.generate`). The target's
whole-vocabulary logits are the same on every rank (they come out of the head's all-gather), so
every rank accepts the same tokens. At the end the ranks' outputs are compared
(``all_gather_object``).

Rank 0 prints the tokens accepted at each target step, then the tokens, the speed-up in tokens
per target step, and the comparison with the unmodified target's ``generate`` on one device
(``OK``, exit 0, or ``MISMATCH``, exit 1). docs/inference.md ("Speculative decoding") has more.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import fastdist as fd

VOCAB = 61  # prime: padded to a multiple of every tp size by the vocabulary-parallel layers
PROMPT = [3, 5, 7, 11, 13, 17, 19]


def build_target(seed: int = 0, layers: int = 4) -> Any:
    """The single-device target, the same on every rank (same seed): float64, eval mode."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,  # one kv head per rank at tp=4
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(torch.float64).eval()


def build_draft(target: Any, layers: int = 1) -> Any:
    """The draft: the target's first ``layers`` decoder layers with its embedding, final norm and
    LM head (copied: the draft is a model of its own)."""
    import copy

    import transformers

    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = layers
    draft = transformers.LlamaForCausalLM(cfg).to(torch.float64).eval()
    own = draft.state_dict()
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in own})
    return draft


def _keep(cache: Any, n: int) -> None:
    """Drop every cached position from ``n`` on (a `DynamicCache`)."""
    extra = cache.get_seq_length() - n
    if extra > 0:
        cache.crop(-extra)


@dataclass
class Decoded:
    """What `speculate` returns: the new tokens; for each target step, how many of the draft's
    proposals it accepted and the tokens it added (those, then the target's own token; the last
    step's cut to the length asked for)."""

    tokens: list[int] = field(default_factory=list)
    steps: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def per_step(self) -> float:
        """Tokens per target forward (1.0 without a draft)."""
        return len(self.tokens) / max(len(self.steps), 1)


def speculate(target: Any, draft: Any, prompt: list[int], new_tokens: int, k: int) -> Decoded:
    """Greedy speculative decoding of ``new_tokens`` tokens after ``prompt`` (batch 1).

    ``target`` and ``draft`` are causal LMs called as ``model(input_ids=..., past_key_values=...)``
    returning whole-vocabulary logits: unmodified models, or parallelized models called
    themselves (``pm.module``). The result's tokens equal ``target.generate(prompt,
    max_new_tokens=new_tokens, do_sample=False)``'s new tokens: every token added is the
    target's own argmax after the tokens before it."""
    from transformers import DynamicCache

    if k < 1 or new_tokens < 1:
        raise ValueError(f"speculate: k={k} and new_tokens={new_tokens} must be at least 1")
    seq = list(prompt)
    t_cache, d_cache = DynamicCache(), DynamicCache()
    out = Decoded()
    with torch.no_grad():
        while len(out.tokens) < new_tokens:
            # the draft: k tokens, fed what its cache lacks, then one token per forward
            proposals: list[int] = []
            for _ in range(k):
                fresh = (seq + proposals)[d_cache.get_seq_length() :]
                logits = draft(input_ids=torch.tensor([fresh]), past_key_values=d_cache).logits
                proposals.append(int(logits[0, -1].argmax()))
            # the target: what its cache lacks (the last accepted token) and the proposals in
            # one forward; its greedy token at each of the k + 1 positions
            fresh = (seq + proposals)[t_cache.get_seq_length() :]
            logits = target(input_ids=torch.tensor([fresh]), past_key_values=t_cache).logits
            greedy = logits[0, -(k + 1) :].argmax(-1).tolist()  # (k + 1,)
            n = 0
            while n < k and proposals[n] == greedy[n]:
                n += 1
            added = (proposals[:n] + [greedy[n]])[: new_tokens - len(out.tokens)]
            out.steps.append((n, added))
            out.tokens += added
            seq += added
            # both caches keep only the positions of accepted tokens (every one but the last)
            _keep(t_cache, len(seq) - 1)
            _keep(d_cache, min(d_cache.get_seq_length(), len(seq) - 1))
    return out


def run(args: argparse.Namespace, target_mesh: fd.Mesh, draft_mesh: fd.Mesh) -> tuple[Decoded, str]:
    """Every rank: the two parallel models, the decoding. Returns the result and a line naming
    the meshes."""
    target = build_target(args.seed)
    draft = build_draft(target, args.draft_layers)
    pt = fd.nn.parallelize(target, target_mesh)  # the ready Llama plan over "tp"
    pd = fd.nn.parallelize(draft, draft_mesh)
    # the models themselves: whole-vocabulary logits, token inputs checked across each tp group
    got = speculate(pt.module, pd.module, PROMPT, args.new_tokens, args.k)
    where = f"target on {target_mesh}, draft on {draft_mesh}"
    return got, where


def report(args: argparse.Namespace, got: Decoded, where: str) -> bool:
    """Rank 0: print each target step's accepted tokens, the speed-up, and compare with one
    device's greedy ``generate`` of the unmodified target."""
    print(f"speculative decoding, k={args.k}: {where}", flush=True)
    for i, (accepted, added) in enumerate(got.steps):
        print(f"target step {i:2d}: {accepted} of {args.k} proposals accepted -> {added}")
    print(f"tokens: {got.tokens}")
    print(
        f"{len(got.tokens)} tokens in {len(got.steps)} target steps: "
        f"{got.per_step:.2f} tokens per target step (1.00 without a draft)"
    )
    prompt = torch.tensor([PROMPT])  # (1, P)
    want = build_target(args.seed).generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
    want_tokens = want[0, prompt.shape[1] :].tolist()
    ok = want_tokens == got.tokens
    verdict = "OK" if ok else f"MISMATCH (one device: {want_tokens})"
    print(f"equal to the target's greedy generate on one device: {verdict}", flush=True)
    return ok


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--k", type=int, default=4, help="tokens the draft proposes per target step")
    p.add_argument("--new-tokens", type=int, default=24, help="tokens to generate")
    p.add_argument(
        "--draft-layers", type=int, default=1, help="the target's layers the draft keeps"
    )
    p.add_argument("--seed", type=int, default=0, help="the target's seed")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a collective waits")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if "RANK" not in os.environ:
        raise SystemExit(
            "examples/speculative.py runs on real ranks: launch it with torchrun --standalone "
            "--nproc-per-node 2 examples/speculative.py (every process holds one target shard)"
        )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    target_mesh = fd.connect(tp=world, timeout=args.timeout)  # every process: one target shard
    draft_mesh = fd.connect(tp=1, timeout=args.timeout)  # dp=world: a whole draft per process
    try:
        got, where = run(args, target_mesh, draft_mesh)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, got.tokens)  # the ranks accepted the same tokens
        if any(tokens != got.tokens for tokens in every):
            raise SystemExit(f"the ranks' tokens differ: {every}")
        ok = report(args, got, where) if dist.get_rank() == 0 else True
    finally:
        fd.comm.close(target_mesh)  # their groups released now, not torn down at interpreter exit
        fd.comm.close(draft_mesh)
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
