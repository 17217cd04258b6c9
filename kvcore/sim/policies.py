"""Prefix-cache eviction policies over block-key sequences, without a scheduler.

Requests run one at a time and follow the real manager's lifecycle, so that LRU here reproduces
``KVCacheManager``'s eviction order (tested against a concurrency-1 replay):

1. a request hits the leading run of its prompt's full blocks that are cached, capped at
   ``(num_prompt_tokens - 1) // block_size`` blocks (the last prompt token is never a hit);
2. its hit blocks are pinned; it then takes one fresh block per remaining block of prompt and
   output, each allocation evicting the policy's victim when the cache is full;
3. when it finishes, its full blocks (prompt and output) become evictable cache entries, released
   tail first, so its prefix is the most recent; a partial last block is not cached.

A block recomputed after its chain broke is cached again even if an older copy with the same key
survives (as in the manager, whose block tables are append-only); hits use the oldest copy.

Policies: ``lru``, ``fifo`` (insertion order; hits do not refresh), ``lfu`` (fewest uses, then
least recent) and ``belady`` — the offline policy that evicts the entry whose key is needed again
furthest in the future (it reads the whole trace).  Belady's MIN is the optimum when blocks are
fetched independently; here a miss forces the rest of the request's chain to be recomputed, so
it is a strong offline bound rather than a proven optimum: a random search finds tiny traces
(8 requests, 7 blocks) where LFU beats it by a few blocks, while on the shipped Mooncake trace
and every synthetic workload it is never below an online policy (tested).  Priority structures
use ``sortedcontainers``.  Requests needing more blocks than the cache holds are skipped, as the
scheduler rejects them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from kvcore.errors import InvalidArgumentError
from kvcore.sim.traces import TraceRequest

POLICIES = ("lru", "fifo", "lfu", "belady")
INFINITE = float("inf")


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


@dataclass
class _Entry:
    key: object
    slot: int
    priority: tuple[float, ...] = field(default=())


class _Cache:
    """Evictable cached blocks, several per key allowed, ordered by policy priority."""

    def __init__(self) -> None:
        self.order = SortedList(key=lambda e: e.priority)
        self.by_key: dict[object, list[_Entry]] = {}

    def __len__(self) -> int:
        return len(self.order)

    def add(self, entry: _Entry) -> None:
        self.order.add(entry)
        self.by_key.setdefault(entry.key, []).append(entry)

    def take(self, key: object) -> _Entry | None:
        """Remove and return the oldest copy for ``key`` (a hit)."""
        copies = self.by_key.get(key)
        if not copies:
            return None
        entry = copies.pop(0)
        if not copies:
            del self.by_key[key]
        self.order.remove(entry)
        return entry

    def evict(self) -> _Entry:
        entry = self.order.pop(0)
        copies = self.by_key[entry.key]
        copies.remove(entry)
        if not copies:
            del self.by_key[entry.key]
        return entry


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


def simulate(requests: Sequence[BlockRequest], capacity_blocks: int, policy: str,
             block_size: int) -> PolicyResult:
    """Run ``requests`` through a cache of ``capacity_blocks`` blocks under ``policy``."""
    if policy not in POLICIES:
        raise InvalidArgumentError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if capacity_blocks <= 0:
        raise InvalidArgumentError(f"capacity must be positive, got {capacity_blocks}")
    next_uses = _next_uses(requests, block_size) if policy == "belady" else None
    cache = _Cache()
    clock = 0  # advances on every access, for recency
    freq: dict[int, int] = {}  # slot -> uses (lfu)
    slot_counter = 0
    hit_tokens = prompt_tokens = evictions = skipped = 0

    for i, r in enumerate(requests):
        total_blocks = -(-(r.num_prompt_tokens + r.num_output_tokens) // block_size)
        if total_blocks > capacity_blocks:
            skipped += 1
            continue
        prompt_tokens += r.num_prompt_tokens
        limit = (r.num_prompt_tokens - 1) // block_size
        pinned: list[_Entry] = []
        for j in range(limit):
            entry = cache.take(r.keys[j])
            if entry is None:
                break
            pinned.append(entry)
        num_hits = len(pinned)
        hit_tokens += num_hits * block_size
        # Fresh blocks for the rest; each one must fit next to the pinned ones.
        for _ in range(total_blocks - num_hits):
            if len(cache) + len(pinned) >= capacity_blocks:
                victim = cache.evict()
                freq.pop(victim.slot, None)
                evictions += 1
            slot_counter += 1
            pinned.append(_Entry(None, slot_counter))
        # Release tail first: full blocks become cache entries, the prefix most recent.
        num_full = (r.num_prompt_tokens + r.num_output_tokens) // block_size
        uses = next_uses[i] if next_uses is not None else None
        for j in range(len(pinned) - 1, -1, -1):
            entry = pinned[j]
            if j >= num_full:
                continue  # partial last block: not cached
            if j >= num_hits:  # freshly computed: gets the request's key (or a unique one)
                entry.key = r.keys[j] if j < len(r.keys) else ("out", i, j)
            clock += 1
            if policy == "lru":
                entry.priority = (clock,)
            elif policy == "fifo":
                if j >= num_hits:
                    entry.priority = (clock,)
            elif policy == "lfu":
                freq[entry.slot] = freq.get(entry.slot, 0) + 1
                entry.priority = (freq[entry.slot], clock)
            else:
                future = uses[j] if uses is not None and j < len(uses) else INFINITE
                entry.priority = (-future, clock)
            cache.add(entry)
    return PolicyResult(policy, capacity_blocks, hit_tokens, prompt_tokens, evictions, skipped)


def hit_rate_curve(requests: Sequence[BlockRequest], capacities: Iterable[int],
                   policies: Iterable[str], block_size: int) -> dict[str, list[PolicyResult]]:
    """Hit rate vs capacity, per policy."""
    caps = list(capacities)
    return {p: [simulate(requests, c, p, block_size) for c in caps] for p in policies}


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
