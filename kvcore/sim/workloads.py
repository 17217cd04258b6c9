"""Synthetic workloads with explicit token ids, all deterministic for a seed.

* ``shared_prefix``: groups of prompts sharing a system prompt (like SGLang's
  generated-shared-prefix benchmark): ``num_groups x prompts_per_group``.
* ``multi_turn``: conversations where each turn's prompt is the whole previous conversation
  (prompts and answers) plus a new user message.
* ``few_shot``: every prompt is a fixed instruction plus a few examples drawn from a pool, then a
  question — partial sharing that depends on example order.
* ``random_prompts``: unrelated prompts (no sharing; a lower bound for hit rates).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvcore.errors import InvalidArgumentError
from kvcore.sim.traces import TraceRequest

VOCAB = 32_000


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def shared_prefix(num_groups: int = 8, prompts_per_group: int = 16, system_len: int = 1024,
                  question_len: int = 128, output_len: int = 64, interval_ms: float = 50.0,
                  seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    systems = [_tokens(rng, system_len) for _ in range(num_groups)]
    order = [(g, i) for g in range(num_groups) for i in range(prompts_per_group)]
    rng.shuffle(order)
    out = []
    for k, (g, i) in enumerate(order):
        prompt = systems[g] + _tokens(rng, question_len)
        out.append(TraceRequest(f"sp{g}-{i}", k * interval_ms, len(prompt), output_len,
                                prompt=tuple(prompt)))
    return out


def multi_turn(num_conversations: int = 16, turns: int = 6, user_len: int = 96,
               assistant_len: int = 128, think_ms: float = 2000.0, interval_ms: float = 100.0,
               seed: int = 0) -> list[TraceRequest]:
    """Turn ``t`` of a conversation arrives ``think_ms`` after turn ``t-1`` and carries the whole
    conversation so far; the assistant's earlier answers are drawn here (the replay generates
    its own tokens, so answers are part of the *prompt* of the next turn, not of the cache)."""
    rng = random.Random(seed)
    out = []
    for c in range(num_conversations):
        history: list[int] = []
        start = c * interval_ms
        for t in range(turns):
            history = history + _tokens(rng, user_len)
            out.append(TraceRequest(f"mt{c}-{t}", start + t * think_ms, len(history),
                                    assistant_len, prompt=tuple(history), session_id=f"mt{c}"))
            history = history + _tokens(rng, assistant_len)
    out.sort(key=lambda r: r.arrival_ms)
    return out


def few_shot(num_requests: int = 128, instruction_len: int = 256, pool_size: int = 12,
             shots: int = 4, example_len: int = 96, question_len: int = 64, output_len: int = 32,
             interval_ms: float = 50.0, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    instruction = _tokens(rng, instruction_len)
    pool = [_tokens(rng, example_len) for _ in range(pool_size)]
    out = []
    for k in range(num_requests):
        picks = rng.sample(range(pool_size), shots)
        prompt = list(instruction)
        for p in picks:
            prompt += pool[p]
        prompt += _tokens(rng, question_len)
        out.append(TraceRequest(f"fs{k}", k * interval_ms, len(prompt), output_len,
                                prompt=tuple(prompt)))
    return out


def random_prompts(num_requests: int = 128, min_len: int = 64, max_len: int = 1024,
                   output_len: int = 64, interval_ms: float = 50.0,
                   seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    out = []
    for k in range(num_requests):
        prompt = _tokens(rng, rng.randint(min_len, max_len))
        out.append(TraceRequest(f"rnd{k}", k * interval_ms, len(prompt), output_len,
                                prompt=tuple(prompt)))
    return out


WORKLOADS: dict[str, Callable[..., list[TraceRequest]]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "few-shot": few_shot,
    "random": random_prompts,
}


def make_workload(name: str, **kwargs: object) -> list[TraceRequest]:
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None
    return factory(**kwargs)
