"""Prefix-cache eviction policies over block-key sequences, without a scheduler.

The simulator runs the same policy objects as the real pool (:mod:`kvcore.eviction`: ``lru``,
``slru``, ``s3fifo``, ``arc``) over :class:`~kvcore.blocks.KVCacheBlock` records, plus three policies
that exist only here: ``fifo`` (first caching order; hits do not refresh), ``lfu`` (fewest
releases, then least recent) and ``belady``, the offline bound.  Requests run one at a time and
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
an online policy (tested).  The offline policies keep their order in a ``sortedcontainers``
list (O(log n)); they are not pool policies.  Requests needing more blocks than the cache holds
are skipped (counted in ``PolicyResult.skipped``), as the scheduler rejects them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from sortedcontainers import SortedList

from kvcore.blocks import BlockHash, FreeBlockQueue, KVCacheBlock
from kvcore.errors import InvalidArgumentError
from kvcore.eviction import POOL_POLICIES, make_policy
from kvcore.policy import EvictionPolicy
from kvcore.sim.traces import TraceRequest

OFFLINE_BOUND = "belady"
POLICIES = (*POOL_POLICIES, "fifo", "lfu", OFFLINE_BOUND)
INFINITE = float("inf")
_T = TypeVar("_T")


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


class PriorityPolicy(EvictionPolicy):
    """An offline policy: cached free blocks ordered by a priority the subclass computes when a
    block is freed (lowest evicted first); uncached blocks are reused first.  O(log n).

    The cached free blocks are also linked, in freeing order, in an intrusive list (``_held``),
    so that ``check_invariants`` sees every free block in some list when the policy runs in a
    real pool (the replay's offline bound).
    """

    __slots__ = ("_clean", "_clock", "_entries", "_held", "_order")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._clean = FreeBlockQueue(blocks)
        self._held = FreeBlockQueue()
        self._order: SortedList = SortedList()
        self._entries: dict[int, tuple[tuple[float, ...], int, KVCacheBlock]] = {}
        self._clock = 0

    def __len__(self) -> int:
        return len(self._clean) + len(self._order)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        yield from self._clean
        for _, _, bid in self._order:
            yield self._entries[bid][2]

    def first(self) -> KVCacheBlock | None:
        block = self._clean.first()
        if block is None and self._order:
            block = self._entries[self._order[0][2]][2]
        return block

    def queues(self) -> Sequence[FreeBlockQueue]:
        return (self._clean, self._held)

    def check(self) -> list[str]:
        if not len(self._order) == len(self._entries) == len(self._held):
            return [f"{len(self._order)} ordered, {len(self._entries)} entries, "
                    f"{len(self._held)} linked cached free blocks"]
        return []

    def on_free(self, uncached: Sequence[KVCacheBlock], cached: Sequence[KVCacheBlock]) -> None:
        self._clean.prepend_n(uncached)
        for block in cached:
            self._clock += 1
            entry = (self._priority(block, self._clock), self._clock, block)
            self._entries[block.block_id] = entry
            self._order.add((entry[0], entry[1], block.block_id))
            self._held.append(block)

    def on_touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.remove(block)
            block.ref_cnt += 1

    def remove(self, block: KVCacheBlock) -> None:
        entry = self._entries.pop(block.block_id, None)
        if entry is None:
            self._clean.remove(block)
        else:
            self._order.remove((entry[0], entry[1], block.block_id))
            self._held.remove(block)

    def on_uncache(self, block: KVCacheBlock) -> None:
        entry = self._entries.pop(block.block_id, None)
        if entry is not None:  # it lost its hash while free: no cache value left
            self._order.remove((entry[0], entry[1], block.block_id))
            self._held.remove(block)
            self._clean.append(block)

    def reset(self) -> None:
        for block in list(self._held):
            self.on_uncache(block)

    def pick_victims(self, n: int, ref_cnt: int) -> list[KVCacheBlock]:
        out = self._clean.popleft_n(min(n, len(self._clean)))
        while len(out) < n:
            _, _, bid = self._order.pop(0)
            block = self._entries.pop(bid)[2]
            self._held.remove(block)
            out.append(block)
        for block in out:
            block.ref_cnt = ref_cnt
        self.on_evict([b for b in out if b.block_hash is not None])
        return out

    def _priority(self, block: KVCacheBlock, clock: int) -> tuple[float, ...]:
        raise NotImplementedError


class FIFOPolicy(PriorityPolicy):
    """``fifo``: evict in the order blocks were first cached; hits do not refresh."""

    __slots__ = ("_born",)
    name: ClassVar[str] = "fifo"

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().__init__(blocks)
        self._born: dict[int, int] = {}

    def _priority(self, block: KVCacheBlock, clock: int) -> tuple[float, ...]:
        return (self._born.setdefault(block.block_id, clock),)

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            self._born.pop(block.block_id, None)


class LFUPolicy(PriorityPolicy):
    """``lfu``: evict the block released fewest times since it was cached, then the least
    recent."""

    __slots__ = ("_uses",)
    name: ClassVar[str] = "lfu"

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().__init__(blocks)
        self._uses: dict[int, int] = {}

    def _priority(self, block: KVCacheBlock, clock: int) -> tuple[float, ...]:
        uses = self._uses[block.block_id] = self._uses.get(block.block_id, 0) + 1
        return (uses, clock)

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            self._uses.pop(block.block_id, None)


class BeladyPolicy(PriorityPolicy):
    """``belady`` (offline bound): evict the block whose key is needed furthest in the future;
    the simulator sets ``next_use`` before each release."""

    __slots__ = ("next_use",)
    name: ClassVar[str] = "belady"

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().__init__(blocks)
        self.next_use: dict[int, float] = {}

    def _priority(self, block: KVCacheBlock, clock: int) -> tuple[float, ...]:
        return (-self.next_use.pop(block.block_id, INFINITE), clock)


_OFFLINE = {"fifo": FIFOPolicy, "lfu": LFUPolicy, "belady": BeladyPolicy}


def make_sim_policy(name: str, blocks: Sequence[KVCacheBlock]) -> EvictionPolicy:
    """A policy by name: a pool policy (options as ``"slru:protected_share=0.3"``) or one of
    the simulator's offline policies."""
    if name in _OFFLINE:
        return _OFFLINE[name](blocks)
    return make_policy(name, blocks)


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
    base = policy.partition(":")[0]
    if base not in POLICIES:
        raise InvalidArgumentError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
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
    if policy.partition(":")[0] not in POLICIES:
        raise InvalidArgumentError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
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
