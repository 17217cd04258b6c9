"""Prefix-cache eviction policies over block-key sequences, without a scheduler.

The simulator runs every policy of the registry (:mod:`kvcore.eviction`) over
:class:`~kvcore.types.KVCacheBlock` records: the ones the real pool runs (``lru``, ``slru``,
``s3fifo``, ``arc``, and any registered later) and the offline ones the pool refuses
(:mod:`kvcore.eviction.offline`: ``fifo``, first caching order, hits do not refresh; ``lfu``,
fewest releases, then least recent; ``belady``, the offline bound).  Requests run one at a time and
follow the real manager's lifecycle, so a pool policy here reproduces ``KVCacheManager`` with
that policy at concurrency 1 (tested for LRU):

1. a request hits the leading run of its prompt's full blocks that are cached, capped at
   ``(num_prompt_tokens - 1) // block_size`` blocks (the last prompt token is never a hit);
   the hit blocks are touched (a prefix hit, as ``BlockPool.touch``);
2. it then takes one fresh block per remaining block of prompt and output (``pick_victims``),
   evicting the victims' keys;
3. when it finishes, its blocks are freed tail first (``on_free``): full blocks (prompt and
   output) become evictable cache entries, so its prefix is the most recent; a partial last
   block is not cached.

A block recomputed after its chain broke is cached again even if an older copy with the same key
survives (as in the manager, whose block tables are append-only); hits use the oldest copy.

``belady`` evicts the entry whose key is needed again furthest in the future (it reads the whole
trace).  Belady's MIN is the optimum when blocks are fetched independently; here a miss forces
the rest of the request's chain to be recomputed, so it is a strong offline bound rather than a
proven optimum: a random search finds tiny traces (8 requests, 7 blocks) where LFU beats it by a
few blocks, while on the shipped Mooncake trace and every synthetic workload it is never below
an online policy (tested).  Requests needing more blocks than the cache holds
are skipped (counted in ``PolicyResult.skipped``), as the scheduler rejects them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvcore.errors import InvalidArgumentError
from kvcore.eviction import REGISTRY, EvictionPolicy
from kvcore.eviction.base import Release
from kvcore.eviction.offline import INFINITE, BeladyPolicy
from kvcore.sim.traces import TraceRequest
from kvcore.types import BlockHash, KVCacheBlock

_T = TypeVar("_T")


def __getattr__(name: str) -> tuple[str, ...]:
    """``POLICIES``: the names the simulator runs, read from the registry when asked (so it
    includes policies registered later)."""
    if name == "POLICIES":
        return REGISTRY.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class BlockRequest:
    """A request reduced to what the policies need."""

    keys: tuple[object, ...]  # one per full prompt block
    num_prompt_tokens: int
    num_output_tokens: int


def to_block_requests(trace: Sequence[TraceRequest], block_size: int) -> list[BlockRequest]:
    return [BlockRequest(tuple(t.block_keys(block_size)), t.num_prompt_tokens, t.output_len)
            for t in trace]


@dataclass
class PolicyResult:
    policy: str
    capacity_blocks: int
    hit_tokens: int
    prompt_tokens: int
    evictions: int
    skipped: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def make_sim_policy(name: str, blocks: Sequence[KVCacheBlock]) -> EvictionPolicy:
    """A registered policy by name, offline ones included (options as
    ``"slru:protected_share=0.3"``)."""
    return REGISTRY.make(name, blocks, offline=True)


def _next_uses(requests: Sequence[BlockRequest], block_size: int) -> list[list[float]]:
    """For request i and its full prompt block j, the index of the next request that could hit
    the same key (``inf`` if none)."""
    nxt: dict[object, int] = {}
    out: list[list[float]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        r = requests[i]
        out[i] = [nxt.get(k, INFINITE) for k in r.keys]
        for k in r.keys[:(r.num_prompt_tokens - 1) // block_size]:
            nxt[k] = i
    return out


def _key_hash(key: object) -> BlockHash:
    """A trace key as the bytes a block carries (distinct keys of one trace stay distinct)."""
    return BlockHash(repr(key).encode())


def simulate(requests: Sequence[BlockRequest], capacity_blocks: int, policy: str,
             block_size: int) -> PolicyResult:
    """Run ``requests`` through a cache of ``capacity_blocks`` blocks under ``policy``."""
    REGISTRY.parse(policy, offline=True)  # raises for an unknown name or bad options
    if capacity_blocks <= 0:
        raise InvalidArgumentError(f"capacity must be positive, got {capacity_blocks}")
    # More blocks than the whole trace ever allocates change nothing (no cached block would ever
    # be a victim): build only those, so a huge capacity costs no memory.
    demand = sum(-(-(r.num_prompt_tokens + r.num_output_tokens) // block_size) for r in requests)
    blocks = [KVCacheBlock(i) for i in range(1, min(capacity_blocks, max(demand, 1)) + 1)]
    evictor = make_sim_policy(policy, blocks)
    belady = evictor if isinstance(evictor, BeladyPolicy) else None
    next_uses = _next_uses(requests, block_size) if belady is not None else None
    cached: dict[BlockHash, list[KVCacheBlock]] = {}  # key -> copies, oldest first
    hit_tokens = prompt_tokens = evictions = skipped = 0

    for i, r in enumerate(requests):
        total_blocks = -(-(r.num_prompt_tokens + r.num_output_tokens) // block_size)
        if total_blocks > capacity_blocks:
            skipped += 1
            continue
        prompt_tokens += r.num_prompt_tokens
        limit = (r.num_prompt_tokens - 1) // block_size
        table: list[KVCacheBlock] = []
        for j in range(limit):
            copies = cached.get(_key_hash(r.keys[j]))
            if not copies:
                break
            table.append(copies[0])
        num_hits = len(table)
        hit_tokens += num_hits * block_size
        evictor.on_touch(table)
        if total_blocks > num_hits:
            for victim in evictor.pick_victims(total_blocks - num_hits, 1):
                h = victim.block_hash
                if h is not None:
                    copies = cached[h]
                    copies.remove(victim)
                    if not copies:
                        del cached[h]
                    victim.block_hash = None
                    evictions += 1
                table.append(victim)
        # Freshly computed full blocks get the request's key (or a unique one for output).
        num_full = (r.num_prompt_tokens + r.num_output_tokens) // block_size
        uses = next_uses[i] if next_uses is not None else None
        for j in range(num_hits, num_full):
            key = r.keys[j] if j < len(r.keys) else ("out", i, j)
            h = _key_hash(key)
            table[j].block_hash = h
            cached.setdefault(h, []).append(table[j])
        # Release tail first (the manager's order): the prefix ends up most recent.
        if evictor.reads_releases:
            evictor.on_release((table,), Release(r.num_prompt_tokens, r.num_output_tokens,
                                                 (block_size,)))
        uncached: list[KVCacheBlock] = []
        freed: list[KVCacheBlock] = []
        for j in range(len(table) - 1, -1, -1):
            block = table[j]
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue  # the same cached block twice in one table
            if block.block_hash is None:
                uncached.append(block)
            else:
                if belady is not None:
                    belady.next_use[block.block_id] = (
                        uses[j] if uses is not None and j < len(uses) else INFINITE)
                freed.append(block)
        evictor.on_free(uncached, freed)
    return PolicyResult(policy, capacity_blocks, hit_tokens, prompt_tokens, evictions, skipped)


def simulate_accesses(keys: Sequence[object], capacity_blocks: int, policy: str) -> list[bool]:
    """A plain block-level cache simulation (every access one block, no chains, no pinning):
    per access of ``keys``, whether it hit.  A hit touches the block and frees it again at once;
    a miss takes a victim and caches the key there.  Used to check the policies against other
    cache simulators (libCacheSim) on the traces they read."""
    REGISTRY.parse(policy, offline=True)  # raises for an unknown name or bad options
    if capacity_blocks <= 0:
        raise InvalidArgumentError(f"capacity must be positive, got {capacity_blocks}")
    size = min(capacity_blocks, len(keys) + 1)  # more blocks than accesses change nothing
    evictor = make_sim_policy(policy, [KVCacheBlock(i) for i in range(1, size + 1)])
    belady = evictor if isinstance(evictor, BeladyPolicy) else None
    next_access: list[float] = []
    if belady is not None:
        later: dict[object, int] = {}
        next_access = [INFINITE] * len(keys)
        for i in range(len(keys) - 1, -1, -1):
            next_access[i] = later.get(keys[i], INFINITE)
            later[keys[i]] = i
    cached: dict[BlockHash, KVCacheBlock] = {}
    hits: list[bool] = []
    for i, key in enumerate(keys):
        h = _key_hash(key)
        block = cached.get(h)
        hits.append(block is not None)
        if block is not None:
            evictor.on_touch((block,))
        else:
            block = evictor.pick_victims(1, 1)[0]
            if block.block_hash is not None:
                del cached[block.block_hash]
            block.block_hash = h
            cached[h] = block
        block.ref_cnt = 0
        if belady is not None:
            belady.next_use[block.block_id] = next_access[i]
        evictor.on_free((), (block,))
    return hits


def hit_rate_curve(requests: Sequence[BlockRequest], capacities: Iterable[int],
                   policies: Iterable[str], block_size: int,
                   progress: bool = False) -> dict[str, list[PolicyResult]]:
    """Hit rate vs capacity, per policy (``progress``: a bar on stderr, one step per run)."""
    caps = list(capacities)
    names = list(policies)
    runs = [(p, c) for p in names for c in caps]
    out: dict[str, list[PolicyResult]] = {p: [] for p in names}
    for p, c in progress_bar(runs, "policies", progress):
        out[p].append(simulate(requests, c, p, block_size))
    return out


def progress_bar(items: Sequence[_T], desc: str, enabled: bool) -> Iterable[_T]:
    """``items``, through a tqdm bar on stderr when ``enabled`` and tqdm is installed."""
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # progress is optional
        return items
    return tqdm(items, desc=desc, unit="run", file=sys.stderr)


def ideal_hit_rate(requests: Sequence[BlockRequest], block_size: int) -> float:
    """The hit rate with unbounded capacity: every previously seen prefix hits."""
    seen: set[object] = set()
    hits = total = 0
    for r in requests:
        total += r.num_prompt_tokens
        limit = (r.num_prompt_tokens - 1) // block_size
        k = 0
        while k < limit and r.keys[k] in seen:
            k += 1
        hits += k * block_size
        seen.update(r.keys)
    return hits / total if total else 0.0
