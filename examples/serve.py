"""A serving loop in vLLM's shape on fastdist's parts: rank 0 schedules requests with continuous
batching and broadcasts each step's inputs over `fastdist.serving.MessageQueue`, every rank runs
the tensor-parallel model with its share of the KV cache, and rank 0 streams the tokens out.

    torchrun --standalone --nproc-per-node 2 examples/serve.py
    torchrun --standalone --nproc-per-node 4 examples/serve.py --family qwen3 --max-running 2

Every process builds the same tiny seeded float64 model (``--family`` llama or qwen3) and
parallelizes it with its ready plan over ``tp`` = every process (`fastdist.nn.parallelize`).
The requests (`SCHEDULE`: prompts of different lengths, each asking for a different number of
tokens) arrive over the steps of a schedule. Each step:

* rank 0's `Scheduler` lets the requests that arrived wait in line, admits them while fewer than
  ``--max-running`` run (first come, first served), and writes the step's inputs: the prompts
  of the requests that join (prefill), the last token of every running request (decode), and the
  requests that finished (their caches freed);
* the step goes to every rank in one `MessageQueue` message (shared memory on one host);
* every rank's `Engine` runs the model (`Engine.run`): one forward per joining prompt, then one
  forward for all running requests together, each request's cache holding this rank's key/value
  heads only; calling the parallelized model itself gives the whole vocabulary's logits
  (`fastdist.nn.generate`);
* rank 0 takes the argmax (greedy), prints the step's tokens, and retires the requests that
  reached their length or the stop token (``--eos``). The next step carries those tokens.

At the end rank 0 prints every request's tokens and compares each with the unmodified model's
``generate`` on one device (a copy kept before parallelizing): ``OK`` (exit 0) or ``MISMATCH``
(exit 1). docs/inference.md ("A serving loop") describes the design and what differs from vLLM.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fastdist as fd

VOCAB = 61  # prime: padded to a multiple of every tp size by the vocabulary-parallel layers
#: (arrival step, prompt length, new tokens asked for) of each request
SCHEDULE = [(0, 5, 6), (0, 3, 3), (1, 8, 5), (2, 4, 2), (3, 6, 4), (6, 2, 5)]


def build_model(family: str = "llama", eos: int | None = None, seed: int = 0) -> Any:
    """The single-device model, the same on every rank (same seed): float64, eval mode, stop
    token ``eos`` (None: none)."""
    import transformers

    fields: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # replicated at tp=4: each rank keeps one kv head
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    torch.manual_seed(seed)
    if family == "llama":
        model: Any = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **fields))
    else:
        raise SystemExit(f"--family {family!r}: choose llama or qwen3")
    return model.to(torch.float64).eval()


@dataclass
class Request:
    """One request: its prompt, when it arrives (a step of the schedule), how many tokens it
    asks for, and the tokens generated so far (rank 0)."""

    rid: int
    arrival: int
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)


def make_requests(seed: int = 1) -> list[Request]:
    """`SCHEDULE`'s requests, with prompts drawn from a seeded generator (the same everywhere)."""
    g = torch.Generator().manual_seed(seed)
    return [
        Request(rid, arrival, torch.randint(0, VOCAB, (length,), generator=g).tolist(), new)
        for rid, (arrival, length, new) in enumerate(SCHEDULE)
    ]


def check_request(req: Request) -> None:
    """Refuse a request the loop cannot serve as ``generate`` would: no prompt, a token outside
    the vocabulary, or fewer than 1 new token (``generate`` refuses ``max_new_tokens=0``; the
    loop's prefill always makes one, so such a request would never finish)."""
    if not req.prompt or not all(isinstance(t, int) and 0 <= t < VOCAB for t in req.prompt):
        raise ValueError(
            f"request {req.rid}: prompt {req.prompt!r} must be 1 or more token ids in [0, {VOCAB})"
        )
    if isinstance(req.max_new_tokens, bool) or not isinstance(req.max_new_tokens, int):
        raise ValueError(f"request {req.rid}: max_new_tokens={req.max_new_tokens!r} is not an int")
    if req.max_new_tokens < 1:
        raise ValueError(
            f"request {req.rid}: max_new_tokens={req.max_new_tokens} must be at least 1 (as "
            "for generate: the prefill makes a token)"
        )


class Step(TypedDict):
    """One step's inputs, the message every rank gets (plain values: it pickles anywhere)."""

    step: int
    prefill: list[tuple[int, list[int]]]  # (request id, prompt) of the requests that join
    decode: list[tuple[int, int]]  # (request id, its last token) of the running requests
    free: list[int]  # requests that finished: drop their caches


class Scheduler:
    """Rank 0's side: arrivals, a waiting line, the running batch (at most ``max_running``),
    greedy sampling and the stop rule. `next_step` makes the message, `update` takes the step's
    logits."""

    def __init__(self, requests: list[Request], max_running: int, eos: int | None) -> None:
        for req in requests:
            check_request(req)
        if len({req.rid for req in requests}) != len(requests):
            raise ValueError(f"request ids repeat: {sorted(req.rid for req in requests)}")
        if max_running < 1:
            raise ValueError(f"--max-running {max_running}: at least 1 request must run")
        self.pending = deque(sorted(requests, key=lambda r: r.arrival))  # not arrived yet
        self.waiting: deque[Request] = deque()  # arrived, not admitted
        self.running: dict[int, Request] = {}
        self.finished: list[Request] = []
        self.free: list[int] = []
        self.max_running, self.eos, self.clock = max_running, eos, 0

    def next_step(self) -> Step | None:
        """The next step's inputs, or None when every request has finished. With nothing to
        run, the clock skips to the next arrival (a real server would wait for a request)."""
        if not (self.running or self.waiting or self.pending):
            return None
        if not (self.running or self.waiting):
            self.clock = max(self.clock, self.pending[0].arrival)
        while self.pending and self.pending[0].arrival <= self.clock:
            self.waiting.append(self.pending.popleft())
        decode = [(rid, req.tokens[-1]) for rid, req in self.running.items()]
        prefill: list[tuple[int, list[int]]] = []
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting.popleft()
            self.running[req.rid] = req
            prefill.append((req.rid, req.prompt))
        step = Step(step=self.clock, prefill=prefill, decode=decode, free=self.free)
        self.free = []
        return step

    def update(self, step: Step, logits: dict[int, torch.Tensor]) -> str:
        """Take each request's next token (greedy) from its whole-vocabulary logits, retire the
        requests that are done; return the step's line of the stream."""
        out, done = [], []
        for rid, row in logits.items():
            req = self.running[rid]
            token = int(row.argmax())
            req.tokens.append(token)
            out.append(f"r{rid}:{token}")
            if token == self.eos or len(req.tokens) >= req.max_new_tokens:
                self.finished.append(self.running.pop(rid))
                self.free.append(rid)
                done.append(f"r{rid}")
        self.clock += 1
        joined = " ".join(f"r{rid}" for rid, _ in step["prefill"]) or "-"
        decoded = " ".join(f"r{rid}" for rid, _ in step["decode"]) or "-"
        line = (
            f"step {step['step']:2d}  prefill {joined:<8} decode {decoded:<12} -> {' '.join(out)}"
        )
        return line + (f"  (done: {' '.join(done)})" if done else "")


class Engine:
    """Every rank's side: the parallelized model and each running request's KV cache (per layer,
    keys and values ``(1, kv heads of this rank, tokens, head_dim)``)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.caches: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def run(self, step: Step) -> dict[int, torch.Tensor]:
        """Run one step; return each request's next-token logits over the whole vocabulary."""
        from transformers import DynamicCache

        for rid in step["free"]:
            del self.caches[rid]
        logits: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for rid, prompt in step["prefill"]:  # one forward per prompt: no padding
                cache: Any = DynamicCache()  # this request's, filled by the forward
                out = self.model(
                    input_ids=torch.tensor([prompt]), past_key_values=cache, logits_to_keep=1
                )
                self.caches[rid] = [(layer.keys, layer.values) for layer in cache.layers]
                logits[rid] = out.logits[0, -1]
            if step["decode"]:
                logits.update(self.decode(step["decode"]))
        return logits

    def decode(self, batch: list[tuple[int, int]]) -> dict[int, torch.Tensor]:
        """One forward for every running request: their caches left-padded to the longest into
        one batch, the padding masked out, each token at its own position; then each request's
        new key/value appended to its own cache."""
        from transformers import DynamicCache

        rids = [rid for rid, _ in batch]
        lengths = [self.caches[rid][0][0].shape[-2] for rid in rids]
        longest = max(lengths)
        layers = []
        for i in range(len(self.caches[rids[0]])):
            pad = [(0, 0, longest - n, 0) for n in lengths]  # left-pad the token dim
            keys = torch.cat([F.pad(self.caches[r][i][0], p) for r, p in zip(rids, pad)])
            values = torch.cat([F.pad(self.caches[r][i][1], p) for r, p in zip(rids, pad)])
            layers.append((keys, values))  # (batch, kv heads, longest, head_dim)
        cache: Any = DynamicCache(ddp_cache_data=layers)
        mask = torch.tensor([[0] * (longest - n) + [1] * (n + 1) for n in lengths])  # (B, L+1)
        out = self.model(
            input_ids=torch.tensor([[token] for _, token in batch]),  # (batch, 1)
            attention_mask=mask,
            position_ids=torch.tensor([[n] for n in lengths]),  # (batch, 1): its own position
            past_key_values=cache,
        )
        for b, rid in enumerate(rids):  # this token's key/value, (1, kv heads, 1, head_dim)
            new = [
                (layer.keys[b : b + 1, :, -1:], layer.values[b : b + 1, :, -1:])
                for layer in cache.layers
            ]
            self.caches[rid] = [
                (torch.cat([k, nk], dim=-2), torch.cat([v, nv], dim=-2))
                for (k, v), (nk, nv) in zip(self.caches[rid], new)
            ]
        return {rid: out.logits[b, -1] for b, rid in enumerate(rids)}


def serve(args: argparse.Namespace, mesh: fd.Mesh) -> list[Request] | None:
    """The loop, on every rank; rank 0 returns the finished requests (others: None)."""
    model = build_model(args.family, args.eos)
    pm = fd.nn.parallelize(model, mesh)  # the family's ready plan over "tp"
    engine = Engine(pm.module)  # the model itself: whole logits, inputs checked across ranks
    for req in make_requests():  # every rank: a request the loop cannot serve stops all at once
        check_request(req)
    with fd.serving.MessageQueue.create(mesh, "tp", writer=0, timeout=args.timeout) as q:
        sched = Scheduler(make_requests(), args.max_running, args.eos) if q.is_writer else None
        if sched is not None:
            print(
                f"serving {len(SCHEDULE)} requests with {args.family} on {mesh}, at most "
                f"{args.max_running} running",
                flush=True,
            )
        while True:
            step: Step | None = q.broadcast_object(sched.next_step() if sched else None)
            if step is None:
                break
            logits = engine.run(step)
            if sched is not None:
                print(sched.update(step, logits), flush=True)  # rank 0 streams the tokens
    return sorted(sched.finished, key=lambda r: r.rid) if sched is not None else None


def check(args: argparse.Namespace, done: list[Request]) -> bool:
    """Print every request's tokens and compare each with one device's greedy ``generate``."""
    reference = build_model(args.family, args.eos)
    wrong = []
    for req in done:
        print(f"r{req.rid}: prompt {req.prompt} -> {req.tokens}", flush=True)
        prompt = torch.tensor([req.prompt])  # (1, P)
        want = reference.generate(prompt, max_new_tokens=req.max_new_tokens, do_sample=False)
        if want[0, prompt.shape[1] :].tolist() != req.tokens:
            wrong.append(f"r{req.rid} (one device: {want[0, prompt.shape[1] :].tolist()})")
    verdict = "OK" if not wrong else "MISMATCH " + ", ".join(wrong)
    print(f"every request equal to one device's greedy generate: {verdict}", flush=True)
    return not wrong


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--family", default="llama", choices=["llama", "qwen3"])
    p.add_argument("--max-running", type=int, default=3, help="requests decoded at once")
    p.add_argument("--eos", type=int, default=None, help="stop token (default: none)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a rank waits for a step")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if "RANK" not in os.environ:
        raise SystemExit(
            "examples/serve.py runs on real ranks: launch it with torchrun --standalone "
            "--nproc-per-node 2 examples/serve.py (every process is one tensor-parallel rank)"
        )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mesh = fd.connect(tp=dist.get_world_size(), timeout=args.timeout)
        try:
            done = serve(args, mesh)
            ok = check(args, done) if done is not None else True
        finally:
            fd.comm.close(mesh)  # its groups released now, not torn down at interpreter exit
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
