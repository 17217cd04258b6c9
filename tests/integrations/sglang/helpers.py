"""A no-model driver of SGLang prefix caches: SGLang's own token allocator and a cache
(SGLang's ``RadixCache`` or kvcore's backend) stepped through the calls SGLang's scheduler makes
for a request (match, pin, allocate with eviction, insert, free duplicates, re-pin, unpin).

Two drivers stepped with the same operations give the two caches' answers side by side; the
driver also checks SGLang's leak check after every step."""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from kvcore.integrations.sglang.cache import KVCoreRadixCache
from kvcore.integrations.sglang.settings import SGLangSettings

NAMESPACES: tuple[tuple[str | None, str | None], ...] = (
    (None, None), ("lora-a", None), (None, "salt-1"), ("lora-a", "salt-1"))


def make_allocator(num_pages: int, page_size: int) -> Any:
    size = num_pages * page_size
    if page_size == 1:
        return TokenToKVPoolAllocator(size, torch.int64, "cpu", None, need_sort=False)
    return PagedTokenToKVPoolAllocator(size, page_size, torch.int64, "cpu", None,
                                       need_sort=False)


def make_params(allocator: Any, page_size: int, *, events: bool = False) -> CacheInitParams:
    return CacheInitParams(disable=False, req_to_token_pool=None,
                           token_to_kv_pool_allocator=allocator, page_size=page_size,
                           enable_kv_cache_events=events)


def make_cache(kind: str, num_pages: int, page_size: int, *, events: bool = False,
               verify_hits: bool = False, check_every: int = 0) -> Any:
    """``kind``: ``sglang`` (SGLang's RadixCache, lru), ``unified:python`` / ``unified:rust``
    (SGLang's UnifiedRadixCache, the default cache of 0.5.23, with its Python or Rust tree core)
    or ``kvcore:POLICY``."""
    allocator = make_allocator(num_pages, page_size)
    params = make_params(allocator, page_size, events=events)
    if kind == "sglang":
        return RadixCache(params)
    if kind.startswith("unified:"):
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        params.tree_components = (ComponentType.FULL,)
        params.tree_core_backend = kind.partition(":")[2]
        return UnifiedRadixCache(params)
    policy = kind.partition(":")[2] or "lru"
    return KVCoreRadixCache(params, SGLangSettings(eviction_policy=policy,
                                                   verify_hits=verify_hits,
                                                   check_invariants_every=check_every))


@dataclass
class Step:
    """What one operation answered: the hit length, the tokens evicted, and the cache's sizes
    after it."""

    op: str
    hit: int = 0
    evicted: int = 0
    admitted: bool = True
    evictable: int = 0
    protected: int = 0


@dataclass
class Driver:
    """One cache and its allocator, stepped like SGLang's scheduler steps a request."""

    cache: Any
    deep: bool = True  # also run kvcore's own invariant checks after every step
    running: dict[int, Any] = field(default_factory=dict)  # request id -> its lock's node

    @property
    def allocator(self) -> Any:
        return self.cache.token_to_kv_pool_allocator

    @property
    def total(self) -> int:
        return int(self.allocator.size)

    def key(self, tokens: list[int], namespace: tuple[str | None, str | None]) -> RadixKey:
        return RadixKey(array("q", tokens), namespace[0], cache_salt=namespace[1])

    def admit(self, rid: int, tokens: list[int],
              namespace: tuple[str | None, str | None]) -> Step:
        """Match, pin the hit, allocate the rest (evicting what is short), insert the
        page-aligned key, free the duplicates and the partial tail page, and keep the request
        running with its lock moved to the inserted node."""
        cache, alloc, ps = self.cache, self.allocator, self.cache.page_size
        key = self.key(tokens, namespace)
        match = cache.match_prefix(MatchPrefixParams(key=key))
        hit = match.device_prefix_len
        node = match.last_device_node
        cache.inc_lock_ref(node)
        need = -(-(len(tokens) - hit) // ps) * ps
        evicted = 0
        if alloc.available_size() < need:
            evicted = cache.evict(EvictParams(num_tokens=need - alloc.available_size()))
            evicted = evicted.num_tokens_evicted
        slots = alloc.alloc(need) if need else torch.empty((0,), dtype=torch.int64)
        if slots is None:
            cache.dec_lock_ref(node)
            return self._step("admit", hit, evicted, admitted=False)
        prefix = cache.path_device_indices(node)[:hit]
        row = torch.cat((prefix.to(torch.int64), slots.to(torch.int64)))[:len(tokens)]
        aligned = len(tokens) // ps * ps
        result = cache.insert(InsertParams(key=key.page_aligned(ps), value=row[:aligned]))
        alloc.free(row[hit:result.prefix_len])  # duplicates of pages cached meanwhile
        if need and aligned < hit + need:
            alloc.free(slots[aligned - hit:])  # the partial last page stays the request's
        new_node = result.last_device_node
        cache.inc_lock_ref(new_node)
        cache.dec_lock_ref(node)
        self.running[rid] = new_node
        return self._step("admit", hit, evicted)

    def finish(self, rid: int) -> Step:
        self.cache.dec_lock_ref(self.running.pop(rid))
        return self._step("finish")

    def evict(self, num_tokens: int) -> Step:
        result = self.cache.evict(EvictParams(num_tokens=num_tokens))
        return self._step("evict", evicted=result.num_tokens_evicted)

    def _step(self, op: str, hit: int = 0, evicted: int = 0, *, admitted: bool = True) -> Step:
        self.check_conservation()
        return Step(op, hit, evicted, admitted, self.cache.evictable_size(),
                    self.cache.protected_size())

    def check_conservation(self) -> None:
        """SGLang's leak check (free + evictable + protected = total: no request holds a slot
        between steps here), no page free twice, no page both free and cached."""
        alloc, cache = self.allocator, self.cache
        free = alloc.available_size()
        assert free + cache.evictable_size() + cache.protected_size() == self.total, (
            free, cache.evictable_size(), cache.protected_size(), self.total)
        pages = alloc.get_all_free_pages().tolist()
        assert len(set(pages)) == len(pages), "a page is free twice"
        if self.deep and isinstance(cache, KVCoreRadixCache):
            cached = {b.block_id for b in cache.pool.blocks[1:] if b.block_hash is not None}
            assert not cached.intersection(pages), "a page is both free and cached"
            cache.sanity_check()


def random_ops(seed: int, page_size: int, num_ops: int, *, docs: int = 6,
               doc_pages: int = 6, max_running: int = 4,
               evictions: bool = True) -> list[tuple[Any, ...]]:
    """A random operation trace: requests sharing document prefixes (in four namespaces) with
    random suffixes, unaligned lengths, finishes, and (``evictions``) explicit evictions."""
    rng = random.Random(seed)
    corpus = [[rng.randrange(1, 50_000) for _ in range(doc_pages * page_size)]
              for _ in range(docs)]
    ops: list[tuple[Any, ...]] = []
    running: list[int] = []
    for rid in range(num_ops):
        r = rng.random()
        if running and (r < 0.35 or len(running) >= max_running):
            ops.append(("finish", running.pop(rng.randrange(len(running)))))
        elif evictions and r < 0.42:
            ops.append(("evict", rng.randrange(1, 4 * page_size)))
        else:
            doc = corpus[rng.randrange(docs)]
            cut = rng.randrange(0, len(doc) + 1)
            tail = [rng.randrange(1, 50_000) for _ in range(rng.randrange(0, 3 * page_size))]
            ops.append(("admit", rid, doc[:cut] + tail, rng.choice(NAMESPACES)))
            running.append(rid)
    return ops


def evictable_before(steps: list[Step]) -> list[int]:
    """For each ``evict`` step of ``steps``, the evictable size just before it."""
    return [steps[i - 1].evictable if i else 0 for i, s in enumerate(steps) if s.op == "evict"]


def run(driver: Driver, ops: list[tuple[Any, ...]]) -> list[Step]:
    """Step ``driver`` through ``ops``; a request not admitted is not running (its finish is
    skipped)."""
    out = []
    for op in ops:
        if op[0] == "admit":
            step = driver.admit(op[1], op[2], op[3])
            out.append(step)
        elif op[0] == "finish":
            if op[1] in driver.running:
                out.append(driver.finish(op[1]))
        else:
            out.append(driver.evict(op[1]))
    return out
