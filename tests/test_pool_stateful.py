"""A hypothesis state machine drives a BlockPool with random owners (requests) allocating, hitting
the prefix cache, decoding, caching, evicting and freeing, and compares it after every step with a
plain-Python reference model: free-queue order, reference counts and hash maps must be identical,
and ``check_invariants`` must pass with exact ownership.  A watch on some request's hashes
(``BlockPool.watch``) checks ``cache_version``'s promise: while it is unchanged, every lookup of
those hashes answers as before, and no block of their hit has left the free side."""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
from hypothesis import assume
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvcore import Request
from kvcore.block_pool import BlockPool
from kvcore.errors import DoubleFreeError
from kvcore.testing import check_invariants
from kvcore.types import BlockHash, KVCacheBlock
from tests.factories import make_request, pool_snapshot

BS = 2
NUM_BLOCKS = 12
GROUPS = 2


class ReferenceModel:
    """The pool's semantics, restated with lists and dicts."""

    def __init__(self, num_blocks: int) -> None:
        self.queue: list[int] = list(range(1, num_blocks))
        self.ref: dict[int, int] = dict.fromkeys(range(1, num_blocks), 0)
        self.hash_of: dict[int, tuple[int, bytes]] = {}
        self.maps: dict[tuple[int, bytes], list[int]] = {}

    def _evict(self, b: int) -> None:
        key = self.hash_of.pop(b)
        self.maps[key].remove(b)
        if not self.maps[key]:
            del self.maps[key]

    def get_new(self, n: int) -> list[int]:
        out, self.queue = self.queue[:n], self.queue[n:]
        for b in out:
            if b in self.hash_of:
                self._evict(b)
            self.ref[b] = 1
        return out

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1

    def free(self, ordered: list[int]) -> None:
        head, tail = [], []
        for b in ordered:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (tail if b in self.hash_of else head).append(b)
        self.queue = head + self.queue + tail

    def cache(self, blocks: list[int], hashes: list[bytes], group: int) -> None:
        for b, h in zip(blocks, hashes):
            if b in self.hash_of:
                continue
            self.hash_of[b] = (group, h)
            self.maps.setdefault((group, h), []).append(b)

    def lookup(self, h: bytes, group: int) -> int | None:
        found = self.maps.get((group, h))
        return found[0] if found else None

    def evict(self, b: int) -> None:
        if b in self.hash_of:
            self._evict(b)

    def reset(self) -> bool:
        if any(self.ref.values()):
            return False
        self.hash_of.clear()
        self.maps.clear()
        return True


@dataclass
class Owner:
    request: Request
    group: int
    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_cached: int = 0


@dataclass
class Watch:
    """What a lookup of the watched hashes found, and the pool's version then."""

    hashes: list[BlockHash]
    version: int
    answers: list[int | None]
    hit: list[KVCacheBlock]
    num_free_hits: int


class PoolMachine(RuleBasedStateMachine):
    owners = Bundle("owners")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, num_groups=GROUPS)
        self.model = ReferenceModel(NUM_BLOCKS)
        self.live: dict[str, Owner] = {}
        self.counter = 0
        self.watched: Watch | None = None

    def _look(self, hashes: list[BlockHash]) -> tuple[list[int | None], list[KVCacheBlock]]:
        """Every group's entry under each hash, and group 0's leading run of hits."""
        answers: list[int | None] = []
        for g in range(GROUPS):
            for h in hashes:
                found = self.pool.get_cached_block(h, [g])
                answers.append(found[0].block_id if found else None)
        hit: list[KVCacheBlock] = []
        for h in hashes:
            found = self.pool.get_cached_block(h, [0])
            if found is None:
                break
            hit.append(found[0])
        return answers, hit

    def _cache_full(self, o: Owner) -> None:
        num_full = min(o.request.num_tokens // BS, len(o.blocks))
        if num_full > o.num_cached:
            self.pool.cache_full_blocks(o.request, o.blocks, o.num_cached, num_full, BS, o.group)
            self.model.cache([b.block_id for b in o.blocks[o.num_cached:num_full]],
                             o.request.block_hashes[o.num_cached:num_full], o.group)
            o.num_cached = num_full

    @rule(target=owners,
          tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9),
          group=st.integers(0, GROUPS - 1))
    def admit(self, tokens: list[int], group: int) -> str:
        """A new request: take the longest run of leading cache hits, allocate the rest."""
        self.counter += 1
        rid = f"r{self.counter}"
        req = make_request(rid, tokens, BS)
        hits: list[KVCacheBlock] = []
        for h in req.block_hashes:
            found = self.pool.get_cached_block(h, [group])
            want = self.model.lookup(h, group)
            assert (found[0].block_id if found else None) == want
            if found is None:
                break
            hits.append(found[0])
        need = -(-len(tokens) // BS) - len(hits)
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - evictable_hits:
            return rid  # would not fit: nothing is touched (the owner stays empty)
        self.pool.touch(hits)
        self.model.touch([b.block_id for b in hits])
        new = self.pool.get_new_blocks(need)
        assert [b.block_id for b in new] == self.model.get_new(need)
        o = Owner(req, group, hits + new, num_cached=len(hits))
        self.live[rid] = o
        self._cache_full(o)
        return rid

    @rule(rid=owners, token=st.integers(0, 1))
    def decode(self, rid: str, token: int) -> None:
        o = self.live.get(rid)
        assume(o is not None)
        assert o is not None
        if o.request.num_tokens == len(o.blocks) * BS:
            if self.pool.num_free_blocks == 0:
                return
            new = self.pool.get_new_blocks(1)
            assert [b.block_id for b in new] == self.model.get_new(1)
            o.blocks.extend(new)
        o.request.append_output_token_ids(token)
        self._cache_full(o)

    @rule(rid=consumes(owners))
    def free(self, rid: str) -> None:
        o = self.live.pop(rid, None)
        if o is None:
            return
        ordered = list(reversed(o.blocks))
        self.pool.free_blocks(ordered)
        self.model.free([b.block_id for b in ordered])
        before = pool_snapshot(self.pool)
        if any(b.ref_cnt == 0 for b in ordered):  # freeing again would go below zero
            with pytest.raises(DoubleFreeError):
                self.pool.free_blocks(ordered)
            assert pool_snapshot(self.pool) == before

    @rule(block_id=st.integers(1, NUM_BLOCKS - 1))
    def evict(self, block_id: int) -> None:
        self.pool.evict_blocks([block_id])
        self.model.evict(block_id)

    @rule()
    def reset(self) -> None:
        assert self.pool.reset_prefix_cache() == self.model.reset()

    @rule(n=st.integers(NUM_BLOCKS, 3 * NUM_BLOCKS))
    def oversized_allocation_changes_nothing(self, n: int) -> None:
        before = pool_snapshot(self.pool)
        with pytest.raises(ValueError):
            self.pool.get_new_blocks(n)
        assert pool_snapshot(self.pool) == before

    @rule(tokens=st.lists(st.integers(0, 1), min_size=2, max_size=9), every=st.booleans())
    def watch(self, tokens: list[int], every: bool) -> None:
        hashes = list(make_request("w", tokens, BS).block_hashes)
        self.pool.watch(None if every else frozenset(hashes))
        answers, hit = self._look(hashes)
        self.watched = Watch(hashes, self.pool.cache_version, answers, hit,
                             sum(1 for b in hit if b.ref_cnt == 0))

    @invariant()
    def an_unchanged_version_keeps_the_watched_answers(self) -> None:
        w = self.watched
        if w is None or self.pool.cache_version != w.version:
            return
        answers, hit = self._look(w.hashes)
        assert answers == w.answers and hit == w.hit
        assert sum(1 for b in hit if b.ref_cnt == 0) >= w.num_free_hits

    @invariant()
    def matches_model_and_invariants_hold(self) -> None:
        pool, model = self.pool, self.model
        assert [b.block_id for b in pool.policy] == model.queue
        assert {b.block_id: b.ref_cnt for b in pool.blocks[1:]} == model.ref
        assert {b.block_id: (b.group_id, b.block_hash) for b in pool.blocks
                if b.block_hash is not None} == model.hash_of
        for (g, h), ids in model.maps.items():
            found = pool.get_cached_block(h, [g])  # type: ignore[arg-type]
            assert found is not None and found[0].block_id == ids[0]
        check_invariants(pool, {rid: [o.blocks] for rid, o in self.live.items()})


TestPoolMachine = PoolMachine.TestCase
