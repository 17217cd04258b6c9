"""Synthetic workloads with explicit token ids, all deterministic for a seed.

* ``shared_prefix``: groups of prompts sharing a system prompt (like SGLang's
  generated-shared-prefix benchmark): ``num_groups x prompts_per_group``.
* ``multi_turn``: conversations where each turn's prompt is the whole previous conversation
  (prompts and answers) plus a new user message.
* ``few_shot``: every prompt is a fixed instruction plus a few examples drawn from a pool, then a
  question — partial sharing that depends on example order.
* ``random_prompts``: unrelated prompts (no sharing; a lower bound for hit rates).
* ``agent``: tool-using agent sessions, interleaved: each step's prompt is the agent's system
  prompt (shared by every session of that agent), the task, and every earlier step's action and
  tool output.  Sized for 512-token blocks (millions of tokens); its prompts are chains of
  64-token segments (:class:`~kvcore.sim.traces.HashIdTokens`), made one request at a time.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

from kvcore.errors import InvalidArgumentError
from kvcore.sim.traces import HashIdTokens, TraceRequest

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


AGENT_SEGMENT_TOKENS = 64
"""Token granularity of the ``agent`` workload: every length is a multiple of it."""


def agent(num_agents: int = 4, num_sessions: int = 384, min_steps: int = 6, max_steps: int = 30,
          system_len: int = 8192, task_len: tuple[int, int] = (256, 1024),
          action_len: tuple[int, int] = (64, 256), tool_median: int = 768,
          tool_max: int = 4096, session_interval_ms: float = 1000.0,
          step_ms: float = 1500.0, tool_ms_median: float = 4000.0,
          seed: int = 0) -> list[TraceRequest]:
    """Tool-using agents (the shape of coding and browsing agents): ``num_sessions`` sessions
    start ``session_interval_ms`` apart on average (exponential gaps), each with one of
    ``num_agents`` agents (Zipf-like popularity: agent ``a`` with weight ``1 / (a + 1)``).  A
    session runs ``min_steps..max_steps`` steps.  Step ``t``'s prompt is the agent's system prompt
    (``system_len`` tokens: instructions and tool definitions, shared by all its sessions), the
    session's task (``task_len`` range), then for every earlier step its action (the model's
    output, ``action_len`` range; also that step's ``output_len``) and the tool's output
    (log-normal around ``tool_median`` tokens, at most ``tool_max``).  Step ``t + 1`` arrives
    ``step_ms`` plus the tool's latency (log-normal around ``tool_ms_median``) after step ``t``
    arrived: arrivals are open loop, so a loaded server sees a session's next step while it is
    still queued.  Every length is a multiple of :data:`AGENT_SEGMENT_TOKENS` (an action's
    rounded down, at least one segment; the others rounded up); segments are hash ids, so the workload holds no token lists (the replay makes each prompt when it arrives)."""
    seg = AGENT_SEGMENT_TOKENS
    if num_agents < 1 or num_sessions < 1 or not 1 <= min_steps <= max_steps:
        raise InvalidArgumentError(
            f"agent workload needs num_agents >= 1, num_sessions >= 1 and 1 <= min_steps <= "
            f"max_steps, got {num_agents}, {num_sessions}, {min_steps}..{max_steps}")
    rng = random.Random(seed)
    source = HashIdTokens(seg, seed=seed)
    next_id = itertools.count()

    def segments(tokens: int) -> list[int]:
        return [next(next_id) for _ in range(max(1, -(-tokens // seg)))]

    systems = [segments(system_len) for _ in range(num_agents)]
    weights = [1 / (a + 1) for a in range(num_agents)]
    out: list[TraceRequest] = []
    start = 0.0
    for s in range(num_sessions):
        start += rng.expovariate(1 / session_interval_ms) if session_interval_ms > 0 else 0.0
        who = rng.choices(range(num_agents), weights)[0]
        history = systems[who] + segments(rng.randint(*task_len))
        arrival = start
        for t in range(rng.randint(min_steps, max_steps)):
            action = rng.randint(*action_len) // seg * seg or seg
            out.append(TraceRequest(f"ag{s}-{t}", arrival, len(history) * seg, action,
                                    hash_ids=tuple(history), source=source,
                                    session_id=f"ag{s}"))
            tool = min(tool_max, int(tool_median * math.exp(rng.gauss(0.0, 0.8))))
            history = history + segments(action) + segments(tool)
            arrival += step_ms + tool_ms_median * math.exp(rng.gauss(0.0, 0.6))
    out.sort(key=lambda r: r.arrival_ms)
    return out


WORKLOADS: dict[str, Callable[..., list[TraceRequest]]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "few-shot": few_shot,
    "random": random_prompts,
    "agent": agent,
}


def make_workload(name: str, **kwargs: object) -> list[TraceRequest]:
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None
    return factory(**kwargs)
