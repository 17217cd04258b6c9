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
* ``api``: single-turn API requests over a few shared system prompts of Zipf popularity (no
  conversation continues: what is reused is the system prompts).  Sized as ``agent``.
* ``rag``: retrieval-augmented questions: an instruction, then documents drawn from a pool with
  Zipf popularity (the most relevant first), then the question; a prefix is shared as far as the
  leading documents agree.  Sized as ``agent``.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterator

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
        return _segments_of(next_id, tokens)

    systems = [segments(system_len) for _ in range(num_agents)]
    weights = _zipf_weights(num_agents, 1.0)
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


def _segments_of(next_id: Iterator[int], tokens: int) -> list[int]:
    """Hash ids of ``tokens`` tokens in :data:`AGENT_SEGMENT_TOKENS`-token segments (rounded up)."""
    return [next(next_id) for _ in range(max(1, -(-tokens // AGENT_SEGMENT_TOKENS)))]


def _zipf_weights(n: int, exponent: float) -> list[float]:
    return [1.0 / (k + 1) ** exponent for k in range(n)]


def api(num_requests: int = 6000, num_system_prompts: int = 256, zipf: float = 0.9,
        system_len: tuple[int, int] = (1024, 16384), user_len: tuple[int, int] = (256, 8192),
        output_len: tuple[int, int] = (16, 1024), rate_per_s: float = 6.0,
        seed: int = 0) -> list[TraceRequest]:
    """Single-turn API traffic: ``num_requests`` requests arriving as a Poisson process of
    ``rate_per_s``, each one of ``num_system_prompts`` system prompts (lengths uniform in
    ``system_len``; prompt ``k`` drawn with weight ``1 / (k + 1) ** zipf``), then a user message
    of its own (log-uniform in ``user_len``) and an answer of ``output_len`` (log-uniform).  No
    request continues another: only system prompts are reused, and a request's own blocks never
    are.  Lengths are multiples of :data:`AGENT_SEGMENT_TOKENS` (hash-id segments, as
    :func:`agent`)."""
    if num_requests < 1 or num_system_prompts < 1 or rate_per_s <= 0:
        raise InvalidArgumentError(
            f"api workload needs num_requests >= 1, num_system_prompts >= 1 and rate_per_s > 0, "
            f"got {num_requests}, {num_system_prompts}, {rate_per_s}")
    rng = random.Random(seed)
    source = HashIdTokens(AGENT_SEGMENT_TOKENS, seed=seed)
    next_id = itertools.count()
    systems = [_segments_of(next_id, rng.randint(*system_len)) for _ in range(num_system_prompts)]
    weights = _zipf_weights(num_system_prompts, zipf)
    out: list[TraceRequest] = []
    arrival = 0.0
    for i in range(num_requests):
        arrival += rng.expovariate(rate_per_s / 1000.0)
        who = rng.choices(range(num_system_prompts), weights)[0]
        user = int(math.exp(rng.uniform(math.log(user_len[0]), math.log(user_len[1]))))
        answer = int(math.exp(rng.uniform(math.log(output_len[0]), math.log(output_len[1]))))
        hash_ids = systems[who] + _segments_of(next_id, user)
        out.append(TraceRequest(f"api{i}", arrival, len(hash_ids) * AGENT_SEGMENT_TOKENS, answer,
                                hash_ids=tuple(hash_ids), source=source))
    return out


def rag(num_requests: int = 6000, num_documents: int = 4000, zipf: float = 1.1,
        instruction_len: int = 512, document_len: tuple[int, int] = (512, 4096),
        documents_per_request: tuple[int, int] = (1, 4), question_len: tuple[int, int] = (64, 512),
        output_len: tuple[int, int] = (32, 512), rate_per_s: float = 6.0,
        seed: int = 0) -> list[TraceRequest]:
    """Retrieval-augmented questions: ``num_requests`` Poisson arrivals of ``rate_per_s``; each
    prompt is a shared instruction (``instruction_len`` tokens), then 1..4 distinct documents
    from a pool of ``num_documents`` (lengths uniform in ``document_len``; document ``k`` drawn
    with weight ``1 / (k + 1) ** zipf``, the most relevant first), then a question
    (log-uniform in ``question_len``), answered in ``output_len`` tokens (log-uniform).  Two
    prompts share the instruction and as many leading documents as they agree on.  Lengths are
    multiples of :data:`AGENT_SEGMENT_TOKENS` (hash-id segments, as :func:`agent`)."""
    if num_requests < 1 or num_documents < documents_per_request[1] or rate_per_s <= 0:
        raise InvalidArgumentError(
            f"rag workload needs num_requests >= 1, num_documents >= the documents per request "
            f"({documents_per_request[1]}) and rate_per_s > 0, got {num_requests}, "
            f"{num_documents}, {rate_per_s}")
    rng = random.Random(seed)
    source = HashIdTokens(AGENT_SEGMENT_TOKENS, seed=seed)
    next_id = itertools.count()
    instruction = _segments_of(next_id, instruction_len)
    lengths = [rng.randint(*document_len) for _ in range(num_documents)]
    # A document's segments depend on what precedes it (the hash ids chain): the ids of a
    # document after a given prefix are made the first time that prefix and document meet.
    after: dict[tuple[int, ...], list[int]] = {}
    weights = _zipf_weights(num_documents, zipf)
    out: list[TraceRequest] = []
    arrival = 0.0
    for i in range(num_requests):
        arrival += rng.expovariate(rate_per_s / 1000.0)
        docs: list[int] = []
        wanted = rng.randint(*documents_per_request)
        while len(docs) < wanted:
            doc = rng.choices(range(num_documents), weights)[0]
            if doc not in docs:
                docs.append(doc)
        hash_ids = list(instruction)
        for k in range(len(docs)):
            key = tuple(docs[:k + 1])
            if key not in after:
                after[key] = _segments_of(next_id, lengths[docs[k]])
            hash_ids += after[key]
        question = int(math.exp(rng.uniform(math.log(question_len[0]), math.log(question_len[1]))))
        answer = int(math.exp(rng.uniform(math.log(output_len[0]), math.log(output_len[1]))))
        hash_ids += _segments_of(next_id, question)
        out.append(TraceRequest(f"rag{i}", arrival, len(hash_ids) * AGENT_SEGMENT_TOKENS, answer,
                                hash_ids=tuple(hash_ids), source=source))
    return out


WORKLOADS: dict[str, Callable[..., list[TraceRequest]]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "few-shot": few_shot,
    "random": random_prompts,
    "agent": agent,
    "api": api,
    "rag": rag,
}


def make_workload(name: str, **kwargs: object) -> list[TraceRequest]:
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None
    return factory(**kwargs)
