"""KV-cache-manager request cycles, identical for kvcore and vLLM (run in a benchmark worker).

One cycle = ``get_computed_blocks`` -> ``allocate_slots`` (the prompt) ->
``record_prefix_cache_stats`` -> ``D`` decode steps (append a token, ``allocate_slots(request,
1)``) -> ``free``, for requests run one after another through one fresh manager per sample.  The
preemption scenario instead runs a small vLLM-style step loop (see :func:`preempting_loop`).

What is timed (thread CPU time, GC off; see ``timing``): the loop over all requests.  Request
objects are built before the clock starts on both sides.  Their prompt hashes are computed at
construction (not timed), except in the ``hash_timed`` scenarios, where requests are built
without a block hasher and the loop calls the side's request block hasher for each request
before its lookup, so the hashing of every prompt block is inside the timed region on both
sides.  Hashing of blocks completed by decode tokens is timed everywhere (it happens in
``append_output_token_ids`` on both sides).  Everything uses block size 16 and xxh3-128 hashing.

Each sample also reports what the run did (hit tokens, preemptions): the two implementations do
the same work exactly when these agree, and the driver says so when they do not.

The eviction-policy rows (``..., kvcore slru``, ``..., kvcore s3fifo``, ``..., kvcore arc``,
``..., kvcore learned``) run
the eviction-heavy requests (the same ones: they are drawn from the LRU row's seed) with kvcore's pool under another
policy.  vLLM has one policy, LRU, so its column in those rows is vLLM LRU on the same requests:
the same calls, though hits (and so the work behind them) follow each side's policy.  A kvcore
without eviction policies (an older ``--baseline`` tree) skips those rows.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .manager_sides import Group, Side, Unsupported, make_side
from .timing import Sample, cpu_timed, skipped_sample

DEFAULT_REQUESTS = 2000
MIN_REQUESTS = 4
VOCAB = 50_000


@dataclass(frozen=True)
class Scenario:
    name: str
    doc: str
    """What the scenario exercises."""
    groups: tuple[Group, ...] = ("full",)
    caching: bool = True
    prompt_len: int = 128
    shared_len: int = 0
    """Leading prompt tokens taken from a shared prefix."""
    num_prefixes: int = 1
    """How many distinct shared prefixes the prompts draw from (uniformly)."""
    decode: int = 0
    num_blocks: int = 4096
    """Pool size, the null block included."""
    per_requests: int = 1
    """The scenario runs ``--requests // per_requests`` requests (at least MIN_REQUESTS), so
    long requests do not dominate the run time."""
    verify: bool = False
    """kvcore runs with ``verify_hits=True``; vLLM runs the same cycles unverified."""
    hash_timed: bool = False
    max_running: int = 0
    """> 0: the preempting step loop with at most this many running requests."""
    max_model_len: int = 8192
    eviction_policy: str = "lru"
    """kvcore's pool eviction policy (vLLM runs LRU, its only one, whatever this says)."""
    seed: str = ""
    """What the requests are drawn from (default: the name): rows that differ only in the
    eviction policy share their LRU row's seed, so they run the very same requests."""

    def num_requests(self, requests: int) -> int:
        return max(MIN_REQUESTS, requests // self.per_requests)


SWA_PROMPT = "96 shared + 32 unique, 32 decode"
EVICTION_HEAVY = Scenario(
    "eviction-heavy: 2048 prefixes, 256-block pool",
    "Prompts draw one of 2,048 distinct 96-token prefixes (+32 unique tokens): 12,288 blocks of "
    "distinct cached prefixes against 255 usable blocks, so lookups mostly miss and nearly every "
    "allocation evicts cached blocks.  kvcore's pool runs LRU (its default, vLLM's order).",
    shared_len=96, num_prefixes=2048, num_blocks=256)
POLICY_DOCS = {
    "slru": "segmented LRU: probation and protected segments, a ghost table of evicted hashes",
    "s3fifo": "S3-FIFO: small and main FIFO queues, a ghost table of evicted hashes",
    "arc": "ARC: recency and frequency LRU segments balanced by two ghost lists",
    "learned": "categories of blocks ranked by the reuse probability learned in the run",
}
"""The non-default pool policies with an eviction-heavy row each."""


def policy_variant(base: Scenario, policy: str) -> Scenario:
    """``base`` with kvcore's pool under ``policy``, on the same requests (vLLM: LRU)."""
    return replace(
        base, name=f"{base.name}, kvcore {policy}", eviction_policy=policy,
        seed=base.seed or base.name,
        doc=f"The eviction-heavy requests (the same ones) with kvcore's pool under {policy} "
        f"({POLICY_DOCS[policy]}; default options).  vLLM has LRU only: its column is vLLM LRU "
        "on the same requests, so the ratio is kvcore's policy against vLLM's; hits follow each "
        "side's policy.")


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("caching off, 128-token prompts",
             "No prefix cache: the no-cache coordinator allocates and frees 8 blocks per "
             "request; no lookup, nothing cached.", caching=False),
    Scenario("unique 128-token prompts",
             "Lookups that miss at the first block; 8 blocks allocated and cached per request; "
             "once the 4096-block pool is full every allocation evicts."),
    Scenario("96 shared + 32 unique tokens",
             "Prefix hits: 6 cached blocks found, touched and adopted, 2 blocks allocated and "
             "cached per request.", shared_len=96),
    Scenario("96 shared + 32 unique, kvcore verify_hits",
             "As the shared-prefix row, with kvcore proving every hit token by token "
             "(vLLM runs unverified: the ratio is the price of the proof).",
             shared_len=96, verify=True),
    Scenario("128-token prompt + 512 decode steps",
             "Long decode: 512 allocate_slots(request, 1) calls per request, a new block (and "
             "its hash) every 16 tokens, 40 blocks freed at the end.",
             decode=512, per_requests=8),
    Scenario("preemption-heavy: 32 running, pool 50% of demand",
             "A vLLM-style step loop over 64-token prompts + 128 decode steps, at most 32 "
             "running, with 192 usable blocks (half of the 384 that 32 finished requests hold): "
             "decode allocations fail and the latest admitted request is preempted (freed, "
             "re-admitted later with whatever of its blocks is still cached as the hit), about "
             "once per request.",
             prompt_len=64, decode=128, max_running=32, num_blocks=193, per_requests=4),
    Scenario(f"hybrid full + SWA(64), {SWA_PROMPT}",
             "Hybrid coordinator: hits valid for both groups; the sliding-window group nulls "
             "and frees blocks leaving its 64-token window as the request advances.",
             groups=("full", 64), shared_len=96, decode=32),
    Scenario("hybrid full + SWA(64), kvcore verify_hits",
             "As the SWA(64) row, with kvcore proving every hit (vLLM unverified).",
             groups=("full", 64), shared_len=96, decode=32, verify=True),
    Scenario("hybrid full + SWA(512), 1024-token prompts, 32 decode",
             "A window inside long prompts (768 shared + 256 unique tokens): a sliding-window "
             "hit must cover the 512-token window; blocks before the window are nulled and "
             "freed.",
             groups=("full", 512), prompt_len=1024, shared_len=768, decode=32, per_requests=8),
    Scenario("Gemma-3-like full + 5 SWA(1024), 2048-token prompts, 32 decode",
             "Six groups, as vLLM groups Gemma-3's 5:1 sliding/full layers (equal specs per "
             "group), 1536 shared + 512 unique tokens: hits agreed by six groups, six block "
             "tables grown and trimmed.",
             groups=("full", 1024, 1024, 1024, 1024, 1024), prompt_len=2048, shared_len=1536,
             decode=32, num_blocks=8192, per_requests=16),
    Scenario("8k-token prompts, hashing timed",
             "Hashing-bound: unique prompts whose 512 blocks are hashed inside the timed region "
             "(requests built unhashed), then looked up, allocated, cached and freed.",
             prompt_len=8192, hash_timed=True, per_requests=32),
    Scenario("32k-token prompts, hashing timed",
             "Hashing-bound, as the 8k row with 2,048 blocks per request.",
             prompt_len=32768, hash_timed=True, per_requests=128, num_blocks=8192,
             max_model_len=40960),
    EVICTION_HEAVY,
    *(policy_variant(EVICTION_HEAVY, policy) for policy in POLICY_DOCS),
)
BY_NAME = {s.name: s for s in SCENARIOS}


def make_prompts(sc: Scenario, n: int, rng: random.Random) -> list[list[int]]:
    def draw(k: int) -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(k)]

    prefixes = [draw(sc.shared_len) for _ in range(sc.num_prefixes)]
    tail = sc.prompt_len - sc.shared_len
    return [prefixes[rng.randrange(len(prefixes))] + draw(tail) for _ in range(n)]


def serial_loop(side: Side, reqs: list[Any], sc: Scenario) -> Callable[[], dict[str, Any]]:
    """Requests one after another: lookup, prompt allocation, stats, decode, free."""

    def run() -> dict[str, Any]:
        m = side.manager
        lookup, alloc = side.lookup, m.allocate_slots
        record, free = m.record_prefix_cache_stats, m.free
        hash_request = side.hash_request if sc.hash_timed else None
        decode = sc.decode
        hit_tokens = 0
        for req in reqs:
            if hash_request is not None:
                hash_request(req)
            found = lookup(req)
            hit = found[1]
            if alloc(req, req.num_tokens - hit, hit, found[0]) is None:
                raise RuntimeError(f"{req.request_id}: the prompt did not fit the pool")
            record(req, hit)
            hit_tokens += hit
            req.num_computed_tokens = req.num_tokens
            for t in range(decode):
                req.append_output_token_ids(t)
                if alloc(req, 1) is None:
                    raise RuntimeError(f"{req.request_id}: a decode slot did not fit the pool")
                req.num_computed_tokens += 1
            free(req)
        return {"hit_tokens": hit_tokens}

    return run


def preempting_loop(side: Side, reqs: list[Any], sc: Scenario) -> Callable[[], dict[str, Any]]:
    """A vLLM-scheduler-style step loop with recompute preemption (no token budget).

    Each step: every running request gets a slot for its newest token; when that fails the
    latest admitted running request is preempted (freed, ``num_computed_tokens = 0``, back to the
    front of the waiting queue) and the allocation retried, until it fits or the request itself
    was preempted.  In steps that preempted nobody, waiting requests are admitted in order (prefix
    lookup, allocation of all their tokens, stats) while fewer than ``max_running`` run and
    allocation succeeds.  Then the step "runs": each scheduled request has all its tokens
    computed and either finishes (``decode`` output tokens, freed) or samples one more token.
    """

    def run() -> dict[str, Any]:
        m = side.manager
        lookup, alloc = side.lookup, m.allocate_slots
        record, free = m.record_prefix_cache_stats, m.free
        decode, max_running = sc.decode, sc.max_running
        waiting: deque[Any] = deque(reqs)
        running: list[Any] = []
        hit_tokens = preemptions = steps = 0
        step_limit = 10 * len(reqs) * (decode + 2)
        while waiting or running:
            steps += 1
            if steps > step_limit:
                raise RuntimeError("the preempting loop made no progress")
            preempted = False
            i = 0
            while i < len(running):
                req = running[i]
                if alloc(req, 1) is not None:
                    i += 1
                    continue
                victim = running.pop()
                free(victim)
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                waiting.appendleft(victim)
                preemptions += 1
                preempted = True
            if not preempted:
                while waiting and len(running) < max_running:
                    req = waiting[0]
                    found = lookup(req)
                    hit = found[1]
                    if alloc(req, req.num_tokens - hit, hit, found[0]) is None:
                        if not running:
                            raise RuntimeError(f"{req.request_id} does not fit an empty pool")
                        break
                    waiting.popleft()
                    record(req, hit)
                    hit_tokens += hit
                    running.append(req)
            still: list[Any] = []
            for req in running:
                req.num_computed_tokens = req.num_tokens
                if req.num_output_tokens >= decode:
                    free(req)
                else:
                    req.append_output_token_ids(req.num_output_tokens + 1)
                    still.append(req)
            running = still
        return {"hit_tokens": hit_tokens, "preemptions": preemptions, "steps": steps}

    return run


def cases(impl: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    requests = int(params.get("requests", DEFAULT_REQUESTS))
    out = []
    for s in SCENARIOS:
        case: dict[str, Any] = {
            "name": s.name, "doc": s.doc, "verify_hits": s.verify, "hash_timed": s.hash_timed,
            "requests": s.num_requests(requests), "decode_steps": s.decode,
            "eviction_policy": s.eviction_policy}
        if s.eviction_policy != "lru":
            case["lru_row"] = next(o.name for o in SCENARIOS if o.eviction_policy == "lru"
                                   and (o.seed or o.name) == s.seed)
            case["peer_note"] = ("vLLM has LRU only: its column is vLLM LRU on the same "
                                 f"requests (kvcore runs {s.eviction_policy}), so hits may "
                                 "differ")
        out.append(case)
    return out


def measure(impl: str, case: str, params: dict[str, Any], repeat: int,
            warmup: bool = False) -> Sample:
    """Build a fresh manager and the requests of ``case`` (untimed), then time the loop.
    A warm-up runs an eighth of the requests (imports, first-call paths, adaptive bytecode).
    A kvcore that cannot build the scenario's manager (:class:`Unsupported`) answers a skipped
    sample."""
    if case not in BY_NAME:
        raise KeyError(f"unknown scenario {case!r}")
    sc = BY_NAME[case]
    n = sc.num_requests(int(params.get("requests", DEFAULT_REQUESTS)))
    if warmup:
        n = max(2, n // 8)
    try:
        run = build_loop(impl, sc, n, repeat, warmup)
    except Unsupported as exc:
        return skipped_sample(str(exc))
    return cpu_timed(run, n)


def build_loop(impl: str, sc: Scenario, n: int, repeat: int = 0,
               warmup: bool = False) -> Callable[[], dict[str, Any]]:
    """A fresh manager of ``impl`` and ``n`` requests of ``sc`` (drawn from the scenario's seed,
    ``repeat`` and ``warmup``), built now; returns the loop to time over them.  Raises
    :class:`Unsupported` when this kvcore cannot build the scenario's manager.  Also used by
    ``scripts/instr_cycle.py``, which counts the loop's instructions instead."""
    side = make_side(impl, sc.groups, sc.num_blocks, sc.max_model_len, sc.caching, sc.verify,
                     sc.eviction_policy)
    rng = random.Random(f"{sc.seed or sc.name}/{repeat}/{warmup}")
    reqs = [side.make_request(f"r{i}", p, hashed=not sc.hash_timed)
            for i, p in enumerate(make_prompts(sc, n, rng))]
    loop = preempting_loop if sc.max_running else serial_loop
    return loop(side, reqs, sc)
